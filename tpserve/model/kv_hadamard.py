"""The FP8 KV cache's Hadamard rotation of K (``--kv-cache-hadamard``; on by default with an
FP8 cache).

e4m3 keeps 3 mantissa bits, so each stored K element is off by up to 1/16 of itself. A
score ``q . k`` sums those errors weighted by ``q_i k_i``; in Llama-family models a few
channels of q and k (the slow RoPE frequencies) carry most of that product, so a handful of
large terms decide the error and nothing averages it out. Rotating q and k by the same
orthogonal matrix leaves every score unchanged in exact arithmetic and spreads each head's
energy over all of its channels, so the score's quantization error becomes a sum of many
small, independent terms. Measured on the embedded SmolLM2 at 2,000 tokens
(``bench/README.md``, round 12): the fp8 cache's perplexity excess falls from +2.73 % to
+0.69 % on the H200 (+3.25 % to +0.71 % on the CPU reference, where the KL over the copied
half of the text falls from 0.0258 to 0.0067).

The rotation is the normalized Sylvester-Hadamard matrix ``H / sqrt(D)`` with
``H[i, j] = (-1)^popcount(i & j)`` (symmetric, ``H H = D I``), applied to each head's
``D`` channels **after** RoPE (RoPE's position-dependent rotation does not commute with
it, so it cannot be folded into ``k_proj``). Invariants, kept by both attention back-ends
(``torch_ops.rope_and_write_kv`` states them as code):
- q and K are rotated the same way (each rounded to the model's dtype once more); V is
  not (its error enters the output linearly and is small: +0.19 % measured).
- the cache holds rotated K; the attention kernels read it unchanged, with the rotated q.
  Everything that reads the cache (prefix-cache hits, the scale calibration) sees
  rotated K, so the KV scales (calibrated or 1.0) are the scales of rotated K. A checkpoint's
  own scales were chosen for unrotated K, so by default a checkpoint that has them is not
  rotated (``--kv-cache-hadamard`` still asks for it).
- ``D`` is a power of two from 2 to 512 (the Triton kernel's butterflies), and RoPE covers
  the whole head: the kernel rotates the RoPE halves it holds in registers, so a model
  with ``partial_rotary_factor`` (Phi-4-mini) is not rotated by default, and an explicit
  request is refused (``resolve_kv_cache_hadamard``; the model refuses a back-end that
  has it, ``AttentionBackend.check_model``).
"""

from __future__ import annotations

import torch

from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPES, is_fp8

MAX_HEAD_DIM = 512


def hadamard_signs(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The unnormalized Sylvester-Hadamard matrix of order ``n`` (a power of two), float32
    ``[n, n]`` of ±1: ``H[i, j] = (-1)^popcount(i & j)``."""
    assert n > 0 and n & (n - 1) == 0, f"order must be a power of two, got {n}"
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:  # [[H, H], [H, -H]]: bit log2(size) of i & j flips the sign
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` times ``H / sqrt(D)`` along its last dim, in float32, rounded to
    ``x``'s dtype."""
    d = x.shape[-1]
    return ((x.float() @ hadamard_signs(d, x.device)) * d ** -0.5).to(x.dtype)


def resolve_kv_cache_hadamard(flag: bool | None, kv_cache_dtype: str, head_dim: int,
                              checkpoint_kv_scales: bool = False,
                              rotary_dim: int | None = None) -> bool:
    """``--kv-cache-hadamard``'s value: None (the default) turns it on for an FP8 cache when
    the head allows it (a power of two up to 512, RoPE over all of it: ``rotary_dim`` None
    or ``head_dim``) and the checkpoint has no KV scales of its own (those were chosen for
    unrotated K); True is refused (naming the flag) when the head does not allow it. Any
    cache dtype takes it (with a 16-bit or float32 cache it only reorders rounding)."""
    fits = 2 <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
    whole = rotary_dim is None or rotary_dim == head_dim
    if flag is None:
        return (fits and whole and is_fp8(KV_CACHE_DTYPES[kv_cache_dtype])
                and not checkpoint_kv_scales)
    if flag and not fits:
        raise ValueError(f"--kv-cache-hadamard needs a head dim that is a power of two from 2 "
                         f"to {MAX_HEAD_DIM}; this model's is {head_dim}: leave the flag out")
    if flag and not whole:
        raise ValueError(partial_rotary_refusal(rotary_dim, head_dim))
    return flag


def partial_rotary_refusal(rotary_dim: int, head_dim: int) -> str:
    """Why the rotation is refused for a model whose RoPE covers part of each head."""
    return (f"--kv-cache-hadamard needs RoPE over the whole head; this model rotates "
            f"{rotary_dim} of its {head_dim} head dims (partial_rotary_factor), which the "
            "Triton RoPE kernel cannot combine with the rotation: pass --no-kv-cache-hadamard")
