"""The KV cache dtype (``--kv-cache-dtype``) and the FP8 cache's scale convention.

Names: ``bfloat16``, ``float16``, ``float32`` and ``fp8_e4m3`` are canonical (what a
``RunnerConfig`` holds); ``fp8`` is an alias of ``fp8_e4m3`` (as in vLLM) and ``auto`` is the
model's ``--dtype``, both resolved once by ``resolve_kv_cache_dtype`` when the config tree
is built.

The FP8 cache stores ``torch.float8_e4m3fn`` with float32 scales per layer, one for K and
one for V: ``kv_scale [2]`` (K's at 0, V's at 1), a device buffer of the layer's attention
module. Invariants, kept by both attention back-ends (the torch reference states them as
code: ``torch_ops.quantize_kv`` / ``dequantize_kv``):
- write: ``q = e4m3(clamp(x / s, -448, 448))``, rounded to nearest even. Values beyond
  ``±448 s`` saturate to ``±448``; they never become NaN (e4m3fn has no infinity, and a
  bare cast of an out-of-range float is NaN).
- read: ``x ~= q * s``. Every e4m3 value is exact in bf16/fp16/fp32, so the Triton kernels
  read ``q`` exactly and fold ``s`` into the score scale (K) and the output (V).
- the scales are chosen at start-up and change only with a weight reload
  (``model/reload.py``), which reads the new checkpoint's: the checkpoint's
  ``k_scale``/``v_scale`` (or one ``kv_scale`` for both) per layer where it has them; else,
  with ``--calculate-kv-scales`` (no reload then), calibrated from one prefill of a fixed
  text (``model/kv_calibration.py``); else 1.0 (vLLM's default). Every
  rank ends with the same scales (the same checkpoint scalars, or the calibration's maxima
  all-reduced); the scales are static device tensors, so CUDA graphs bake in their address
  and nothing reads them on the host.
- with a non-FP8 cache the scales are ignored (K/V are rounded to the cache dtype only).
- with ``--kv-cache-hadamard`` (``model/kv_hadamard``; the default with FP8) the cache holds
  K rotated by a Hadamard matrix after RoPE, and K's scale is the scale of rotated K.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448

# KV cache scales in checkpoints (vLLM / llm-compressor / AutoFP8 spellings): the name's
# tail after the layer's ``self_attn.`` -> which of the layer's ``kv_scale`` entries it sets
KV_SCALE_NAMES = {"k_scale": (0,), "k_proj.k_scale": (0,), "k_proj.output_scale": (0,),
                  "v_scale": (1,), "v_proj.v_scale": (1,), "v_proj.output_scale": (1,),
                  "kv_scale": (0, 1)}

KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                   "float32": torch.float32, "fp8_e4m3": FP8_KV_DTYPE}
KV_CACHE_DTYPE_NAMES = tuple(KV_CACHE_DTYPES)  # the resolved, canonical names
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPE_NAMES, *KV_CACHE_DTYPE_ALIASES)


def resolve_kv_cache_dtype(flag: str, model_dtype: str) -> str:
    """The canonical name for a ``--kv-cache-dtype`` value (``model_dtype`` is the resolved
    ``--dtype``, which ``auto`` follows)."""
    if flag == "auto":
        return model_dtype
    name = KV_CACHE_DTYPE_ALIASES.get(flag, flag)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {flag!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return name


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor of this name is a KV cache scale (``KV_SCALE_NAMES``)."""
    return name.partition(".self_attn.")[2] in KV_SCALE_NAMES


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is scaled FP8 (see the module docstring)."""
    return dtype == FP8_KV_DTYPE
