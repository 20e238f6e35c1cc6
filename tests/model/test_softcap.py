"""Gemma 2's attention logit softcap (``attn_logit_softcapping`` c): every logit
``s = q.k * scale`` becomes ``c * tanh(s / c)`` before the causal / sliding-window mask and
the softmax, as transformers' eager attention computes it.

The torch reference (``torch_ops.paged_attention(..., softcap=c)``) equals a naive float32
attention written here (per token: explicit scores, the cap, the mask, softmax, P.V) over
decodes, fresh and chunked prefills and mixed batches, with and without a window, under
GQA, and transformers' own ``eager_attention_forward``. The Triton decode and prefill
kernels (Triton's interpreter off CUDA: ``test_triton_kernels`` sets it) equal the
reference in float32 (atol 1e-5) and bf16, over heads of 64, 128 and 256 (Gemma's), an FP8
cache, and the FP8 decode launches (one warp, the block table a tile ahead, the lazy
rescale). A cap that is not a finite number > 0 is refused. Without a cap nothing changes:
the kernels' other tests (``test_triton_kernels``, ``test_sliding_window``,
``test_triton_fp8_kv``) hold that path.
"""

from __future__ import annotations

import types
from dataclasses import fields, replace

import pytest
import torch

from tests.model.test_triton_fp8_kv import _fp8_batch, _scales
from tests.model.test_triton_kernels import DEVICE, _close, _make_batch, _randn
from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.attention.torch_backend import TorchAttention
from tpserve.model.kernels import torch_ops

triton = pytest.importorskip("triton")

FP32_TOL = 1e-5


def _tables_in_range(meta, k_cache):
    """``meta`` with block-table padding pointing at block 0 (the reference's batched decode
    gathers padding entries, then masks them; ``_make_batch`` makes them out of range)."""
    tables = meta.block_tables.clone()
    tables[tables >= k_cache.shape[0]] = 0
    return replace(meta, block_tables=tables)


def _ref(q, k_cache, v_cache, meta, scale, softcap, window=None, kv_scale=None):
    return torch_ops.paged_attention(q, k_cache, v_cache, _tables_in_range(meta, k_cache),
                                     scale, kv_scale, window, softcap)


def _naive(q, k_cache, v_cache, meta, scale, softcap, window=None):
    """Float32 attention token by token: the sequence's keys gathered through its block
    table, ``tanh``-capped scores, the causal (and window) mask, softmax, P.V."""
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    kc = k_cache.float().flatten(0, 1)
    vc = v_cache.float().flatten(0, 1)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, length in enumerate(lens):
        pos = torch.arange(length, device=q.device)
        slots = meta.block_tables[i, pos // page].long() * page + pos % page
        k = kc[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = vc[slots].repeat_interleave(group, dim=1)
        ctx = length - (qsl[i + 1] - qsl[i])
        for j, t in enumerate(range(qsl[i], qsl[i + 1])):
            scores = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
            scores = torch.tanh(scores / softcap) * softcap
            seen = pos <= ctx + j
            if window is not None:
                seen &= pos > ctx + j - window
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out.to(q.dtype)


def _case(seqs, group, head_dim, dtype, seed, page=16, hkv=2, q_gain=4.0):
    """``_make_batch``'s batch with q scaled by ``q_gain``, so logits reach the cap."""
    gen = torch.Generator().manual_seed(seed)
    meta, k_cache, v_cache = _make_batch(seqs, page, hkv, head_dim, dtype, gen)
    q = _randn(int(meta.query_start_loc[-1]), hkv * group, head_dim, dtype=torch.float32,
               gen=gen)
    return (q * q_gain).to(dtype), k_cache, v_cache, meta


DECODES = [(0, 1), (6, 1), (32, 1), (99, 1)]  # (ctx, q_len)
FRESH = [(0, 20), (0, 7)]
CHUNKED = [(13, 9), (40, 25), (0, 1)]
MIXED = [(4, 1), (39, 1), (0, 7), (20, 33), (36, 1), (100, 33), (0, 70)]


# ------------------------------------------------------------------- the torch reference


@pytest.mark.parametrize("seqs", [DECODES, FRESH, CHUNKED, MIXED],
                         ids=["decodes", "fresh", "chunked", "mixed"])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_reference_equals_naive_attention(seqs, window, group, softcap):
    q, k_cache, v_cache, meta = _case(seqs, group, 64, torch.float32, seed=1)
    scale = 64 ** -0.5
    want = _naive(q, k_cache, v_cache, meta, scale, softcap, window)
    got = _ref(q, k_cache, v_cache, meta, scale, softcap, window)
    torch.testing.assert_close(got, want, atol=FP32_TOL, rtol=FP32_TOL)
    if softcap == 5.0 and window != 1:  # the cap really changes the answer (one key: no)
        uncapped = _ref(q, k_cache, v_cache, meta, scale, None, window)
        assert not torch.allclose(got, uncapped, atol=1e-3)


def _gather(cache, meta, length):
    """The first sequence's ``length`` cache rows, in position order."""
    page = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache.flatten(0, 1)[meta.block_tables[0, pos // page].long() * page + pos % page]


@pytest.mark.parametrize("window", [None, 6])
def test_reference_equals_transformers_eager_attention(window):
    """A fresh prefill against transformers' Gemma 2 ``eager_attention_forward`` (its
    additive mask: -inf above the diagonal and, with a window, left of it)."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    group, d, n, softcap = 4, 64, 21, 50.0
    q, k_cache, v_cache, meta = _case([(0, n)], group, d, torch.float32, seed=2, q_gain=12.0)
    scale = d ** -0.5
    pos = torch.arange(n, device=q.device)
    k, v = (_gather(c, meta, n) for c in (k_cache, v_cache))  # [n, Hkv, D]
    seen = pos[None, :] <= pos[:, None]
    if window is not None:
        seen &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(n, n, device=q.device).masked_fill(~seen, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=group, training=False, head_dim=d)
    want, _ = gemma2.eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        mask, scaling=scale, softcap=softcap)
    got = _ref(q, k_cache, v_cache, meta, scale, softcap, window)
    torch.testing.assert_close(got, want[0], atol=FP32_TOL, rtol=FP32_TOL)


# ------------------------------------------------------------------------ Triton kernels


def _close_to(out, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=FP32_TOL, rtol=FP32_TOL)
    else:
        _close(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,window", [(64, None), (128, 40), (256, None)])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_softcap(kernels, dtype, head_dim, window, splits):
    q, k_cache, v_cache, meta = _case([(n - 1, 1) for n in (1, 7, 70, 200)], 4, head_dim,
                                      dtype, seed=3, page=8)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out, splits,
        window=window, softcap=20.0)
    _close_to(out, _ref(q, k_cache, v_cache, meta, scale, 20.0, window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group,window", [(64, 2, None), (64, 2, 5), (128, 4, 40),
                                                   (256, 2, None), (256, 2, 16)])
def test_paged_attention_softcap_mixed_batch(backend, dtype, head_dim, group, window):
    """Decodes, fresh and chunked prefills (unmasked and masked key tiles) through the
    back-end's split between the two kernels."""
    q, k_cache, v_cache, meta = _case(MIXED, group, head_dim, dtype, seed=4)
    scale = head_dim ** -0.5
    out = backend.paged_attention(q, k_cache, v_cache, meta, scale, window=window,
                                  softcap=50.0)
    _close_to(out, _ref(q, k_cache, v_cache, meta, scale, 50.0, window), dtype)


def test_prefill_kernel_small_tiles_softcap(kernels):
    """16x16 tiles: several unmasked key tiles and query blocks, the cap biting hard."""
    q, k_cache, v_cache, meta = _case([(37, 50), (0, 19)], 2, 64, torch.float32, seed=5,
                                      q_gain=8.0)
    meta.num_decodes = 0
    from tpserve.model.attention.triton_backend import prefill_tiles

    tiles = torch.tensor(prefill_tiles([50, 19], 0, tile_m=16), dtype=torch.int32,
                         device=DEVICE)
    out = torch.full_like(q, float("nan"))
    kernels["triton_prefill_attention"].prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles,
        0.125, out, block_m=16, block_n=16, softcap=3.0)
    _close_to(out, _ref(q, k_cache, v_cache, meta, 0.125, 3.0), torch.float32)


def test_backend_classes_forward_softcap(backend):
    """``TritonAttention.forward`` (common metadata: it builds its own) and
    ``TorchAttention.forward`` take the cap the same way."""
    q, k_cache, v_cache, meta = _case(MIXED, 2, 64, torch.float32, seed=6)
    common = AttentionMetadata(**{f.name: getattr(meta, f.name)
                                  for f in fields(AttentionMetadata)})
    triton_out = backend.TritonAttention(torch.float32).forward(
        q, k_cache, v_cache, common, 0.125, window=16, softcap=30.0)
    torch_out = TorchAttention(torch.float32).forward(
        q, k_cache, v_cache, _tables_in_range(common, k_cache), 0.125, window=16,
        softcap=30.0)
    torch.testing.assert_close(torch_out, _naive(q, k_cache, v_cache, meta, 0.125, 30.0, 16),
                               atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(triton_out, torch_out, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("launch", [
    {}, {"fp16_dot": True, "scale_v": True, "block_n": 16, "num_warps": 1, "num_stages": 4,
         "bt_ahead": True}, {"fp16_dot": True, "scale_v": True, "block_n": 32,
                             "num_warps": 1, "lazy_rescale": True}])
def test_softcap_over_fp8(kernels, backend, launch):
    """An FP8 cache under a bf16 q (fp16 matmul operands, q pre-scaled by the score and K
    scales): the decode launches, and the mixed batch through both kernels."""
    gen = torch.Generator().manual_seed(7)
    hkv, group, d, dtype = 2, 4, 128, torch.bfloat16
    kv_scale = _scales(2.0 ** -6, 0.013)
    meta, k_cache, v_cache = _fp8_batch([(n - 1, 1) for n in (1, 7, 100, 300)], 16, hkv, d,
                                        gen, kv_scale)
    q = (_randn(4, hkv * group, d, dtype=torch.float32, gen=gen) * 4).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernels["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, out, 2,
        kv_scale=kv_scale, softcap=10.0, **launch)
    _close(out, _ref(q, k_cache, v_cache, meta, 0.125, 10.0, kv_scale=kv_scale), dtype)
    if launch:
        return
    meta, k_cache, v_cache = _fp8_batch([(4, 1), (0, 7), (20, 33), (100, 33)], 16, hkv, d,
                                        gen, kv_scale)
    q = (_randn(int(meta.query_start_loc[-1]), hkv * group, d, dtype=torch.float32,
                gen=gen) * 4).to(dtype)
    out = backend.paged_attention(q, k_cache, v_cache, meta, 0.125, kv_scale, window=40,
                                  softcap=10.0)
    _close(out, _ref(q, k_cache, v_cache, meta, 0.125, 10.0, 40, kv_scale), dtype)


def test_the_triton_backend_serves_gemma_heads(backend):
    """Gemma 2/3's heads of 256 (Gemma 3's q/k head norm over the whole head) pass the
    Triton back-end's check (the kernels above compute them)."""
    backend.TritonAttention(torch.bfloat16).check_model(256, 256, head_norm=True)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("softcap", [0.0, -50.0, float("nan"), float("inf")])
def test_a_cap_that_is_not_positive_and_finite_is_refused(kernels, backend, softcap):
    q, k_cache, v_cache, meta = _case([(3, 1), (0, 5)], 1, 64, torch.float32, seed=8)
    out = torch.empty_like(q)
    calls = [
        lambda: torch_ops.paged_attention(q, k_cache, v_cache,
                                          _tables_in_range(meta, k_cache), 0.125,
                                          softcap=softcap),
        lambda: TorchAttention(torch.float32).forward(
            q, k_cache, v_cache, _tables_in_range(meta, k_cache), 0.125, softcap=softcap),
        lambda: backend.paged_attention(q, k_cache, v_cache, meta, 0.125, softcap=softcap),
        lambda: backend.TritonAttention(torch.float32).forward(q, k_cache, v_cache, meta,
                                                               0.125, softcap=softcap),
        lambda: kernels["triton_decode_attention"].decode_attention(
            q[:1], k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, out[:1], 1,
            softcap=softcap),
        lambda: kernels["triton_prefill_attention"].prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.tiles(), 0.125, out, softcap=softcap),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            call()
