"""The FP8 KV cache in the Triton kernels against the torch reference (see
``model/kv_cache_dtype`` for the convention). On CPU under ``TRITON_INTERPRET=1`` (set by
``test_triton_kernels``, imported first), on CUDA compiled.

Triton 3.9's interpreter decodes e4m3 exactly but does not round when it encodes (it
truncates and loses the carry into the exponent), so the write kernel rounds onto the e4m3
grid itself (``triton_fp8_kv.quantize_e4m3``) and only then casts, which is exact
everywhere; the first test holds that rounding to torch's cast bit for bit.

Exact checks: the encoding, and the cache contents the write kernel produces from its own
rotated k (and from v, which is not rotated). Attention is compared with the dtype's
tolerance (``ATOL``): the kernels read the same e4m3 values exactly and only fold the
scales in elsewhere (K's into the score scale, V's into the output), so they differ from
the reference by float32 rounding plus the existing rounding of P to q's dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.test_triton_kernels import (
    DEVICE,
    MIXED,
    _close,
    _cos_sin_cache,
    _make_batch,
    _randn,
)
from tpserve.model.kernels import torch_ops, triton_fp8_kv  # reloaded in place by ``kernels``
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE, FP8_MAX

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _scales(k: float, v: float) -> torch.Tensor:
    return torch.tensor([k, v], dtype=torch.float32, device=DEVICE)


@triton.jit
def _quantize_kernel(x_ptr, s_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    q = triton_fp8_kv.quantize_e4m3(x, tl.load(s_ptr))
    tl.store(o_ptr + offs, q.to(o_ptr.dtype.element_ty), mask=offs < n)


def test_quantize_e4m3_is_torchs_cast_bit_for_bit(kernels):
    gen = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_KV_DTYPE).float()
    grid = grid[grid.isfinite()]
    pos = grid[grid >= 0].sort().values
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties: round to the even neighbour
    x = torch.cat([
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -448.0, 463.9, 464.0, 1e4, -1e4]),
        grid, mids, -mids,
        torch.randn(4096, generator=gen) * 10 ** torch.empty(4096).uniform_(-4, 3,
                                                                            generator=gen),
        torch.linspace(-500, 500, 4001), torch.linspace(-0.03, 0.03, 4001)])
    for scale in (1.0, 0.37, 2.0 ** -5):
        s = torch.tensor([scale], device=DEVICE)
        out = torch.empty(x.numel(), dtype=FP8_KV_DTYPE, device=DEVICE)
        _quantize_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), s, out, x.numel(),
                                                          BLOCK=1024)
        want = torch_ops.quantize_kv(x.to(DEVICE), s[0])
        assert torch.equal(_bits(out), _bits(want)), scale
        assert not out.float().isnan().any()
    assert torch_ops.quantize_kv(torch.tensor([1e4, -1e4, 460.0]), torch.tensor(1.0)).float(
        ).tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]  # saturates (a bare cast gives NaN)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,page", [(64, 64, 16), (128, 64, 8)])
def test_rope_and_write_kv_into_fp8(kernels, dtype, head_dim, rotary_dim, page):
    """Non-unit scales, some values saturating; the -1 slots leave the cache untouched."""
    gen = torch.Generator().manual_seed(4)
    tokens, hq, hkv, num_blocks = 7, 12, 3, 5
    qkv = _randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, gen=gen) * 4
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 5, 6, 7, 100, 3, 64], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 39, -1, 8], device=DEVICE)
    kv_scale = _scales(0.02, 0.025)  # |x| > 448 s: 8.96 (K), 11.2 (V) saturate
    cs = _cos_sin_cache(128, rotary_dim)
    junk = torch.randint(0, 126, (2, num_blocks, page, hkv, head_dim), generator=gen,
                         dtype=torch.uint8).view(FP8_KV_DTYPE).to(DEVICE)
    k_cache, v_cache = junk[0].clone(), junk[1].clone()
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = torch_ops.rope_and_write_kv(q.clone(), k.clone(), v, positions, cs,
                                               ref_kc, ref_vc, slots, kv_scale)
    out_q, out_k = kernels["triton_rope"].rope_and_write_kv(q, k, v, positions, cs, k_cache,
                                                         v_cache, slots, kv_scale=kv_scale)
    _close(out_q, ref_q, dtype)
    _close(out_k, ref_k, dtype)
    written = slots >= 0
    flat = (-1, hkv, head_dim)
    # exact: the kernel's cache holds quantize_kv of its own rotated k, and of v
    assert torch.equal(_bits(k_cache.view(flat)[slots[written]]),
                       _bits(torch_ops.quantize_kv(out_k[written], kv_scale[0])))
    assert torch.equal(_bits(v_cache.view(flat)[slots[written]]),
                       _bits(torch_ops.quantize_kv(v[written], kv_scale[1])))
    assert torch.equal(_bits(v_cache), _bits(ref_vc))
    # the rest of the cache is untouched
    keep = torch.ones(num_blocks * page, dtype=torch.bool, device=DEVICE)
    keep[slots[written]] = False
    for got, before in ((k_cache, junk[0]), (v_cache, junk[1])):
        assert torch.equal(_bits(got.view(flat)[keep]), _bits(before.view(flat)[keep]))
    # saturation: present, exact, never NaN
    sat = v[written].float().abs() > FP8_MAX * 0.025
    assert sat.any()
    stored = v_cache.view(flat)[slots[written]].float()
    assert torch.equal(stored[sat].abs(), torch.full_like(stored[sat], FP8_MAX))
    assert not k_cache.float().isnan().any() and not v_cache.float().isnan().any()
    # against the reference's rotation: within one e4m3 step (rope rounding may differ)
    ref_deq = torch_ops.dequantize_kv(ref_kc, kv_scale[0])
    got_deq = torch_ops.dequantize_kv(k_cache, kv_scale[0])
    assert ((got_deq - ref_deq).abs() <= ref_deq.abs() * 2**-3 + 2**-9 * 0.02).all()


def _fp8_batch(seqs, page, hkv, head_dim, gen, kv_scale):
    """``_make_batch``'s metadata with an FP8 cache of ``randn`` values under ``kv_scale``."""
    meta, k, v = _make_batch(seqs, page, hkv, head_dim, torch.float32, gen)
    return (meta, torch_ops.quantize_kv(k, kv_scale[0]),
            torch_ops.quantize_kv(v, kv_scale[1]))


def _ref(q, k_cache, v_cache, meta, scale, kv_scale):
    from dataclasses import replace
    tables = meta.block_tables.clone()
    tables[tables >= k_cache.shape[0]] = 0
    return torch_ops.paged_attention(q, k_cache, v_cache, replace(meta, block_tables=tables),
                                     scale, kv_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,page,head_dim", [(1, 16, 64), (4, 8, 128)])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("launch", [
    {"fp16_dot": False}, {"fp16_dot": True}, {"fp16_dot": True, "late_widen": True},
    {"fp16_dot": True, "swap_qk": True, "heads_first": True}, {"fp16_dot": False, "swap_qk": True},
    {"fp16_dot": True, "scale_v": False}, {"fp16_dot": True, "scale_v": True},
    {"fp16_dot": True, "scale_v": True, "block_n": 64, "num_stages": 3},
    {"fp16_dot": True, "scale_v": True, "block_n": 32, "num_warps": 1, "lazy_rescale": True},
    {"fp16_dot": True, "scale_v": True, "block_n": 16, "num_warps": 1, "maxnreg": 128},
    {"fp16_dot": True, "scale_v": True, "block_n": 16, "num_warps": 1, "num_stages": 4,
     "bt_ahead": True}])
def test_decode_attention_over_fp8(kernels, dtype, group, page, head_dim, splits, launch):
    """Both matmul operand choices (q's dtype, or fp16 with q pre-scaled), K widened before
    or after its transpose, the scores computed as ``K q^T``, the grid ordered KV head
    first, the V scale applied to the widened V tile or to the output, the lazily moved
    running maximum, 16-key tiles under a register cap, and the shipped one-warp launch
    (16-key tiles, the block table a tile ahead), all equal the torch reference over the
    dequantized cache."""
    gen = torch.Generator().manual_seed(5)
    hkv = 2
    kv_scale = _scales(2.0 ** -6, 0.013)  # cache values up to ~300: no saturation here
    lens = [1, 7, 33, 100, 300] if splits > 1 else [1, 7, 33, 100]
    meta, k_cache, v_cache = _fp8_batch([(n - 1, 1) for n in lens], page, hkv, head_dim, gen,
                                        kv_scale)
    q = _randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out, splits,
        kv_scale=kv_scale, **launch)
    _close(out, _ref(q, k_cache, v_cache, meta, scale, kv_scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,page,head_dim", [(1, 16, 64), (4, 8, 128)])
def test_paged_attention_mixed_batch_over_fp8(backend, dtype, group, page, head_dim):
    """Decodes, prefills and chunked prefills (unmasked and masked key tiles)."""
    gen = torch.Generator().manual_seed(7)
    hkv = 2
    kv_scale = _scales(0.05, 2.0 ** -7)
    meta, k_cache, v_cache = _fp8_batch(MIXED, page, hkv, head_dim, gen, kv_scale)
    q = _randn(int(meta.query_start_loc[-1]), hkv * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim ** -0.5
    out = backend.paged_attention(q, k_cache, v_cache, meta, scale, kv_scale)
    _close(out, _ref(q, k_cache, v_cache, meta, scale, kv_scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp16_dot,block_n", [(False, 64), (True, 64), (True, None)])
def test_prefill_attention_over_fp8_with_either_operand_dtype(kernels, backend, dtype,
                                                              fp16_dot, block_n):
    """The prefill kernel alone over the mixed batch's prefill rows, with q's dtype or fp16
    (q pre-scaled) as the matmul operands, 64-key tiles or the FP8 default (128, wider than
    the 64-row query tile): each equals the torch reference."""
    gen = torch.Generator().manual_seed(11)
    hkv, group, head_dim = 2, 4, 128
    kv_scale = _scales(0.05, 2.0 ** -7)
    meta, k_cache, v_cache = _fp8_batch(MIXED, 8, hkv, head_dim, gen, kv_scale)
    q = _randn(int(meta.query_start_loc[-1]), hkv * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels["triton_prefill_attention"].prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.tiles(), scale, out, kv_scale=kv_scale, fp16_dot=fp16_dot, block_n=block_n)
    first = meta.num_decodes  # decode rows come first; the prefill kernel skips them
    _close(out[first:], _ref(q, k_cache, v_cache, meta, scale, kv_scale)[first:], dtype)


def test_rope_write_then_attend_over_fp8(kernels, backend):
    """The layer's order of ops on an FP8 cache, with saturating V: the Triton pair writes
    V as the torch pair does (bit for bit) and attends over what it wrote like the torch
    reference does. (K is compared through ``test_rope_and_write_kv_into_fp8``: a one-ulp
    difference of the two RoPEs can move a K element to the next e4m3 value, 2^-4 relative,
    which would be a test of RoPE's rounding, not of the cache.)"""
    gen = torch.Generator().manual_seed(9)
    dtype, hq, hkv, d, page = torch.bfloat16, 8, 2, 64, 16
    seqs = [(12, 1), (0, 9), (17, 5)]
    kv_scale = _scales(0.01, 0.004)
    meta, k_cache, v_cache = _fp8_batch(seqs, page, hkv, d, gen, kv_scale)
    n = int(meta.query_start_loc[-1])
    positions = torch.cat([torch.arange(c, c + m) for c, m in seqs]).to(DEVICE)
    q, k, v = (_randn(n, h, d, dtype=dtype, gen=gen) for h in (hq, hkv, hkv))
    cs = _cos_sin_cache(64, d)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    torch_ops.rope_and_write_kv(q, k, v, positions, cs, ref_kc, ref_vc, meta.slot_mapping,
                                kv_scale)
    assert (ref_vc.float().abs() == FP8_MAX).any()
    tq, _ = kernels["triton_rope"].rope_and_write_kv(q.clone(), k.clone(), v, positions, cs,
                                                  k_cache, v_cache, meta.slot_mapping,
                                                  kv_scale=kv_scale)
    assert torch.equal(_bits(v_cache), _bits(ref_vc))
    _close(backend.paged_attention(tq, k_cache, v_cache, meta, d ** -0.5, kv_scale),
           _ref(tq, k_cache, v_cache, meta, d ** -0.5, kv_scale), dtype)


def test_fp8_cache_under_a_float32_model_on_the_triton_backend(kernels, backend, tiny_llama):
    """The Triton back-end over an FP8 cache decodes the tiny model's greedy tokens like
    the torch back-end over the same FP8 cache (both dequantize the same e4m3 values), and
    like the float32 cache within the FP8 tolerance of ``test_fp8_kv_cache``."""
    from tests.model.test_fp8_kv_cache import assert_fp8_greedy

    if DEVICE.type != "cpu":
        pytest.skip("CPU oracle check (the model helpers run on CPU)")
    assert_fp8_greedy(tiny_llama, "triton", 8)


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("launch", [
    {}, {"fp16_dot": True, "scale_v": True, "block_n": 16, "num_warps": 1, "num_stages": 4,
         "bt_ahead": True}, {"fp16_dot": True, "scale_v": True, "block_n": 32,
                             "num_warps": 1, "lazy_rescale": True}])
@pytest.mark.parametrize("window", [5, 40])
def test_windowed_decode_over_fp8(kernels, backend, head_dim, launch, window):
    """A sliding window and heads of 96 (tiled as 128) over an FP8 cache: the default
    launch, the one-warp launch with the block table a tile ahead and the lazy rescale
    decode, and the mixed batch's prefill kernel, equal the torch reference over the
    dequantized cache."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(9)
    hkv, group, dtype = 2, 4, torch.bfloat16
    kv_scale = _scales(2.0 ** -6, 0.013)
    lens = [1, 7, 33, 100, 300]
    meta, k_cache, v_cache = _fp8_batch([(n - 1, 1) for n in lens], 16, hkv, head_dim, gen,
                                        kv_scale)
    q = _randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    tables = meta.block_tables.clone()
    tables[tables >= k_cache.shape[0]] = 0
    want = torch_ops.paged_attention(q, k_cache, v_cache, replace(meta, block_tables=tables),
                                     0.125, kv_scale, window)
    out = torch.full_like(q, float("nan"))
    kernels["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, out, 4,
        kv_scale=kv_scale, window=window, **launch)
    _close(out, want, dtype)
    meta, k_cache, v_cache = _fp8_batch([(4, 1), (0, 7), (20, 33), (100, 33)], 16, hkv,
                                        head_dim, gen, kv_scale)
    q = _randn(int(meta.query_start_loc[-1]), hkv * group, head_dim, dtype=dtype, gen=gen)
    tables = meta.block_tables.clone()
    tables[tables >= k_cache.shape[0]] = 0
    want = torch_ops.paged_attention(q, k_cache, v_cache, replace(meta, block_tables=tables),
                                     0.125, kv_scale, window)
    _close(backend.paged_attention(q, k_cache, v_cache, meta, 0.125, kv_scale, window=window),
           want, dtype)
