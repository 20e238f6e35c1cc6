"""Qwen3's q/k head RMSNorm fused into the Triton RoPE + KV write kernel (``triton_rope``,
``head_norm``) against the torch reference (``torch_ops.rms_norm`` of each head, then RoPE),
with and without the Hadamard rotation and into a bf16/fp16/fp32 or an FP8 cache; and
Gemma 3's (``unit_offset``: ``1 + w``), heads of 128 and 256. On CPU under
``TRITON_INTERPRET=1`` (set by ``test_triton_kernels``, imported first), on CUDA compiled.
q and k agree to the dtype's tolerance; the cache holds the kernel's own k (bit for bit,
FP8 codes included) and the reference's v; a zero (padding) head stays zero."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_triton_fp8_kv import _bits
from tests.model.test_triton_kernels import DEVICE, DTYPES, _close, _cos_sin_cache, _randn
from tpserve.model.kernels import torch_ops
from tpserve.model.kernels.torch_ops import HeadNorm
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE

triton = pytest.importorskip("triton")


def _qkv_and_caches(tokens: int, num_blocks: int, hq: int, hkv: int, head_dim: int,
                    dtype: torch.dtype, fp8: bool, gen: torch.Generator):
    """q, k, v views of one ``[tokens, (hq + 2 hkv) head_dim]`` projection output (as the
    model hands them over), and empty K/V caches of 16-slot pages (FP8 or ``dtype``)."""
    qkv = _randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, gen=gen) * 3
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cache_dtype = FP8_KV_DTYPE if fp8 else dtype
    k_cache = torch.zeros(num_blocks, 16, hkv, head_dim, device=DEVICE).to(cache_dtype)
    return q, k, v, k_cache, torch.zeros_like(k_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8,hadamard", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("head_dim,hq,hkv", [(64, 12, 3), (128, 4, 2)])
def test_rope_with_head_norm_and_write_kv(kernels, dtype, fp8, hadamard, head_dim, hq, hkv):
    gen = torch.Generator().manual_seed(5)
    q, k, v, k_cache, v_cache = _qkv_and_caches(6, 4, hq, hkv, head_dim, dtype, fp8, gen)
    q[:, -1] = 0  # a zero-padding query head (tp that does not divide the heads)
    norm = HeadNorm(1 + _randn(head_dim, dtype=dtype, gen=gen) * 0.3,
                    1 + _randn(head_dim, dtype=dtype, gen=gen) * 0.3, 1e-6)
    positions = torch.tensor([0, 5, 6, 100, 3, 64], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 39, 8], device=DEVICE)
    cs = _cos_sin_cache(128, head_dim)
    kv_scale = torch.tensor([0.01, 0.02], device=DEVICE)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = torch_ops.rope_and_write_kv(q.clone(), k.clone(), v, positions, cs, ref_kc,
                                               ref_vc, slots, kv_scale, hadamard, norm)
    out_q, out_k = kernels["triton_rope"].rope_and_write_kv(
        q, k, v, positions, cs, k_cache, v_cache, slots, kv_scale=kv_scale,
        hadamard=hadamard, head_norm=norm)
    _close(out_q, ref_q, dtype, scale=2)
    _close(out_k, ref_k, dtype, scale=2)
    assert not out_q[:, -1].any()
    assert torch.equal(out_q, q) and torch.equal(out_k, k)  # in place, in the qkv output
    _check_cache(k_cache, v_cache, ref_vc, out_k, slots, kv_scale, fp8)


def _check_cache(k_cache, v_cache, ref_vc, out_k, slots, kv_scale, fp8: bool) -> None:
    """The kernel's K rows are its rotated k (FP8: quantized as the reference quantizes),
    its V cache the reference's, bit for bit."""
    written = slots >= 0
    flat = (-1, *k_cache.shape[2:])
    if fp8:
        assert torch.equal(_bits(k_cache.view(flat)[slots[written]]),
                           _bits(torch_ops.quantize_kv(out_k[written], kv_scale[0])))
        assert torch.equal(_bits(v_cache), _bits(ref_vc))
    else:
        assert torch.equal(k_cache.view(flat)[slots[written]], out_k[written])
        assert torch.equal(v_cache, ref_vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 4, 2), (256, 8, 4), (256, 4, 1)])
def test_rope_with_unit_offset_head_norm_and_write_kv(kernels, dtype, fp8, head_dim, hq, hkv):
    """Gemma 3's head norm (``unit_offset``: the checkpoint's ``w`` near 0, the scale
    ``1 + w`` multiplied in float32 and rounded once) on heads of 128 and 256."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, k_cache, v_cache = _qkv_and_caches(5, 3, hq, hkv, head_dim, dtype, fp8, gen)
    norm = HeadNorm(_randn(head_dim, dtype=dtype, gen=gen) * 0.3,
                    _randn(head_dim, dtype=dtype, gen=gen) * 0.3, 1e-6, unit_offset=True)
    positions = torch.tensor([0, 7, 100, 3, 64], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 39], device=DEVICE)
    cs = _cos_sin_cache(128, head_dim)
    kv_scale = torch.tensor([0.01, 0.02], device=DEVICE)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = torch_ops.rope_and_write_kv(q.clone(), k.clone(), v, positions, cs, ref_kc,
                                               ref_vc, slots, kv_scale, head_norm=norm)
    plain_q, _ = torch_ops.rope_and_write_kv(q.clone(), k.clone(), v, positions, cs,
                                             ref_kc.clone(), ref_vc.clone(), slots, kv_scale,
                                             head_norm=norm._replace(unit_offset=False))
    assert not torch.allclose(ref_q.float(), plain_q.float(), atol=0.1)  # the offset acts
    out_q, out_k = kernels["triton_rope"].rope_and_write_kv(
        q, k, v, positions, cs, k_cache, v_cache, slots, kv_scale=kv_scale, head_norm=norm)
    _close(out_q, ref_q, dtype, scale=2)
    _close(out_k, ref_k, dtype, scale=2)
    _check_cache(k_cache, v_cache, ref_vc, out_k, slots, kv_scale, fp8)


def test_head_norm_is_refused_with_partial_rotary(kernels):
    q = torch.zeros(1, 2, 64, device=DEVICE)
    k = v = torch.zeros(1, 1, 64, device=DEVICE)
    cache = torch.zeros(1, 16, 1, 64, device=DEVICE)
    norm = HeadNorm(torch.ones(64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="whole head"):
        kernels["triton_rope"].rope_and_write_kv(
            q, k, v, torch.zeros(1, dtype=torch.long, device=DEVICE), _cos_sin_cache(8, 32),
            cache, cache.clone(), torch.zeros(1, dtype=torch.long, device=DEVICE),
            head_norm=norm)
