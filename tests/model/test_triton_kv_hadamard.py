"""The Hadamard rotation in the Triton RoPE + KV write kernel (``triton_rope``, ``hadamard``)
against the torch reference (``model/kv_hadamard``). On CPU under ``TRITON_INTERPRET=1`` (set
by ``test_triton_kernels``, imported first), on CUDA compiled.

The kernel (butterflies) and the reference (a matrix product) round the same RoPE output and
then sum the same ±1 products in another order, so q and k agree to the dtype's tolerance
(``ATOL``); the cache is checked against the kernel's own rotated k exactly (bit for bit
for FP8, as in ``test_triton_fp8_kv``), and V bit for bit against the reference. Attention through the
Triton kernels over a rotated cache equals the reference's attention without the rotation."""

from __future__ import annotations

import pytest
import torch

from tests.model import test_triton_kernels as tk
from tests.model.test_triton_fp8_kv import _bits, _fp8_batch
from tests.model.test_triton_fp8_kv import _ref as fp8_ref
from tests.model.test_triton_kernels import (
    DEVICE,
    DTYPES,
    _close,
    _cos_sin_cache,
    _make_batch,
    _randn,
)
from tpserve.model.kernels import torch_ops
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE
from tpserve.model.kv_hadamard import hadamard_rotate

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim,hq,hkv", [(16, 4, 2), (32, 4, 1), (64, 12, 3),
                                             (128, 32, 8)])
def test_rope_hadamard_and_write_kv(kernels, dtype, fp8, head_dim, hq, hkv):
    gen = torch.Generator().manual_seed(4)
    tokens, num_blocks, page = 7, 5, 16
    qkv = _randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, gen=gen) * 4
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    k[..., 5] += 40  # an outlier channel
    positions = torch.tensor([0, 5, 6, 7, 100, 3, 64], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 39, -1, 8], device=DEVICE)
    cs = _cos_sin_cache(128, head_dim)
    cache_dtype = FP8_KV_DTYPE if fp8 else dtype
    kv_scale = torch.tensor([0.05, 0.02], device=DEVICE)
    k_cache = torch.zeros(num_blocks, page, hkv, head_dim, device=DEVICE).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = torch_ops.rope_and_write_kv(q.clone(), k.clone(), v, positions, cs,
                                               ref_kc, ref_vc, slots, kv_scale, hadamard=True)
    out_q, out_k = kernels["triton_rope"].rope_and_write_kv(
        q, k, v, positions, cs, k_cache, v_cache, slots, kv_scale=kv_scale, hadamard=True)
    _close(out_q, ref_q, dtype, scale=4)
    _close(out_k, ref_k, dtype, scale=4)
    written = slots >= 0
    flat = (-1, hkv, head_dim)
    want_k = out_k[written]
    if fp8:
        assert torch.equal(_bits(k_cache.view(flat)[slots[written]]),
                           _bits(torch_ops.quantize_kv(want_k, kv_scale[0])))
        assert torch.equal(_bits(v_cache), _bits(ref_vc))
    else:
        assert torch.equal(k_cache.view(flat)[slots[written]], want_k)
        assert torch.equal(v_cache, ref_vc)
    assert not k_cache.view(flat)[[i for i in range(num_blocks * page)
                                   if i not in slots.tolist()]].float().any()


SEQS = [(12, 1), (0, 9), (17, 5)]  # (context, new tokens): two decodes' worth and prefills


def _step_inputs(dtype, hq, hkv, d, gen):
    """The new tokens' positions, q, k, v for ``SEQS`` and a RoPE table."""
    n = sum(m for _, m in SEQS)
    positions = torch.cat([torch.arange(c, c + m) for c, m in SEQS]).to(DEVICE)
    q, k, v = (_randn(n, h, d, dtype=dtype, gen=gen) for h in (hq, hkv, hkv))
    return positions, q, k, v, _cos_sin_cache(64, d)


def test_attention_over_a_rotated_cache_is_attention_without_it(kernels, backend):
    """float32: rope + rotation + write, then the Triton decode and prefill kernels, against
    the reference without the rotation."""
    gen = torch.Generator().manual_seed(9)
    dtype, hq, hkv, d, page = torch.float32, 8, 2, 64, 16
    meta, k_cache, v_cache = _make_batch(SEQS, page, hkv, d, dtype, gen)
    positions, q, k, v, cs = _step_inputs(dtype, hq, hkv, d, gen)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    rq, _ = torch_ops.rope_and_write_kv(q, k, v, positions, cs, ref_kc, ref_vc,
                                        meta.slot_mapping)
    want = tk._ref(rq, ref_kc, ref_vc, meta, d ** -0.5)
    rot_kc = hadamard_rotate(k_cache)  # the context, as earlier rotated writes left it
    tq, _ = kernels["triton_rope"].rope_and_write_kv(
        q.clone(), k.clone(), v, positions, cs, rot_kc, v_cache, meta.slot_mapping,
        hadamard=True)
    _close(backend.paged_attention(tq, rot_kc, v_cache, meta, d ** -0.5), want, dtype)


def test_attention_over_a_rotated_fp8_cache(kernels, backend):
    """bf16 over an FP8 cache: the Triton pair writes V as the torch pair does (bit for bit)
    and attends over its rotated K like the torch reference does over the same cache."""
    gen = torch.Generator().manual_seed(9)
    dtype, hq, hkv, d, page = torch.bfloat16, 8, 2, 64, 16
    kv_scale = torch.tensor([0.05, 0.02], device=DEVICE)
    meta, k_cache, v_cache = _fp8_batch(SEQS, page, hkv, d, gen, kv_scale)
    positions, q, k, v, cs = _step_inputs(dtype, hq, hkv, d, gen)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    torch_ops.rope_and_write_kv(q, k, v, positions, cs, ref_kc, ref_vc, meta.slot_mapping,
                                kv_scale, hadamard=True)
    tq, _ = kernels["triton_rope"].rope_and_write_kv(
        q.clone(), k.clone(), v, positions, cs, k_cache, v_cache, meta.slot_mapping,
        kv_scale=kv_scale, hadamard=True)
    assert torch.equal(_bits(v_cache), _bits(ref_vc))
    _close(backend.paged_attention(tq, k_cache, v_cache, meta, d ** -0.5, kv_scale),
           fp8_ref(tq, k_cache, v_cache, meta, d ** -0.5, kv_scale), dtype)
