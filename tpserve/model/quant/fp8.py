"""FP8 (e4m3) linear layers (``--quantization fp8``): weights quantized per output channel
at load, the product chosen by the step's (static) token count M.

- ``M <= weight_only_max_tokens`` (decode): weight-only. ``y = x (q_w * s_w)^T``: the fp8
  weight is widened in registers and multiplied by the unquantized activations, the
  per-channel scale applied to the accumulator (a memory-bound kernel reading half the
  bytes of bf16).
- larger M (prefill, mixed steps): W8A8. Activations are quantized per token (or, for an
  FP8 checkpoint with static activation scales, with the layer's ``input_scale``), then the
  fp8 operands are multiplied with row-wise scales: by the Triton split-K kernel
  (``kernels/triton_w8a8.py``) up to ``W8A8_TRITON_MAX_TOKENS``, where cuBLAS leaves SMs
  idle, else by ``torch._scaled_mm``. The quantization is fused into the kernel that
  produces the activations where it can be (``takes_quantized_input``: the RMSNorm before
  qkv and gate/up, the SiLU gate before down; ``Fp8Activation`` carries the result), else
  it is one kernel of its own.

Invariants:
- ``x ~= q * scale`` row by row. Activations: each row's largest magnitude is mapped to the
  largest finite e4m3 value (448). Weights: each output channel takes, of the scales
  ``amax / 448 * 2^(i / WEIGHT_SCALE_CANDIDATES)``, the one whose codes have the least
  squared error (ties: the smallest), so its largest magnitude maps into (224, 448] and
  nothing is clipped (e4m3's grid is log-spaced: one octave of scales covers every placement
  of it; on Gaussian weights the search cuts the error by ~6 %, on the embedded Q4_1
  SmolLM2 by 11 %). An all-zero row gets the scale ``MIN_SCALE`` and zero codes, so zero
  (padding) rows and columns stay exactly zero and never produce NaN or inf.
- A weight's scale covers its whole output channel (the row of the unsharded weight): a
  column-parallel shard holds whole rows; a row-parallel shard's row amax is max-reduced
  and its per-candidate errors summed over the ranks first (in float64). So every rank's
  fp8 codes are exactly the tp-1 codes of its shard (barring float64 summation ties),
  and the weight-only product at any tp equals the tp-1 one up to fp32 summation order.
  (W8A8 activations are scaled per token over this rank's input columns.)
- The torch reference (``backend="torch"``: CPU, and the test oracle) computes the same
  two functions in float32 from the dequantized operands; the Triton/``_scaled_mm`` path
  (``backend="triton"``) differs from it only by accumulation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.parallel.linear import UNQUANTIZED, RowParallelLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
MIN_SCALE = 1e-12
# the weight-scale search (see the invariants): candidates per octave, rows at a time; 8
# candidates: 11 % less squared error on the embedded SmolLM2 (16: 13 %, 4: 8 %)
WEIGHT_SCALE_CANDIDATES = 8
SEARCH_ROWS = 2048
# float32(1 / 448), correctly rounded (exact as a Python float)
INV_FP8_MAX = (torch.tensor(1.0, dtype=torch.float32) / FP8_MAX).item()
# Decode steps of more than this many tokens take W8A8. The graph-timed sweep on an H200
# (bench/fp8_gemm.py, llama3-8b shapes, a layer's four products; bench/README.md round 20):
# the Triton W8A8 kernel (activations quantized by their producers) 68.6-69.8 us at
# M = 4-32 against weight-only 96.1-122.7; the served layer at M = 2 81.6 (W8A8, its
# quantizer included) against 89.3 (the weight-only GEMV); at M = 1 the GEMV's 62.3 stays.
# Serving at concurrency 2 / 8 / 16 / 32: 563 / 1,975 / 3,357 / 5,209 out tok/s against
# 509 / 1,726 / 3,020 / 4,484 with the 32 of rounds 3-19 (chosen when W8A8 meant cuBLAS,
# slower than weight-only up to 32 tokens; the Triton kernel replaced it up to 64).
DEFAULT_WEIGHT_ONLY_MAX_TOKENS = 1
# W8A8 steps up to this many tokens take the Triton split-K kernel, larger ones _scaled_mm
# (H200, 1ca1fb8, a llama3-8b layer's four GEMMs: 81.8 against 109.9 us at M = 64; from
# M = 128 cuBLAS was as fast or faster on every shape but down)
W8A8_TRITON_MAX_TOKENS = 64
# _scaled_mm keeps the FP8 tensor cores' own running sums (use_fast_accum), as CUTLASS's
# FP8FastAccum schedules in vLLM's sm90 fp8 GEMMs do. H200, 9e342c4: a llama3-8b layer's
# four GEMMs at M = 512 took 170.9 us against 183.5 promoted, at M = 8192 2,668 against
# 3,024; serving (fp8 weights + KV) 7,297.8 against 7,026.4 out tok/s
# (bench/results/h200-2026-12-02-r6a-*). The Triton W8A8 kernel (decode steps) follows the
# same flag; the weight-only kernels widen fp8 to 16 bits and always sum in float32.
DEFAULT_FAST_ACCUM = True


def tokens(n: int) -> str:
    """``"1 token"``, ``"32 tokens"`` (start-up lines)."""
    return f"{n} token" if n == 1 else f"{n} tokens"


class Fp8Activation(NamedTuple):
    """Activations quantized by the kernel that produced them (the input of a W8A8 layer
    whose ``takes_quantized_input`` said so): ``q [M, K]`` e4m3 and ``scale [M, 1]`` float32
    with ``x ~= q * scale`` row by row, exactly ``quantize_per_row`` (or, with the layer's
    static ``input_scale``, ``quantize_static``; for a block-wise layer ``scale [M, groups]``,
    ``quantize_per_group``) of the activations the unfused kernel would have written in
    ``dtype``; ``dtype`` is also the layer's output dtype."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_per_row(x: torch.Tensor, amax: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> ``(q [R, C] e4m3, scale [R, 1] float32)`` with ``x ~= q * scale``.
    ``amax [R, 1]`` (default: each row's own) sets the scale, ``max(amax * float32(1/448),
    MIN_SCALE)``: a float32 product, correctly rounded on every device (``amax / 448`` is
    not one formula: ATen on CUDA multiplies by the reciprocal, the CPU divides, one ulp
    apart for some amax); it must be >= the row's largest magnitude (values are clamped)."""
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.tensor(INV_FP8_MAX, dtype=torch.float32, device=xf.device)
    scale = (amax.float() * inv).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` quantized with one given scale (a checkpoint's static ``input_scale``,
    ``[1]`` float32 > 0) -> ``(q [M, K] e4m3, scale [M, 1] float32)``, every row's scale the
    given one: ``q = clamp(x / scale, +-448)`` rounded to nearest even, so values beyond
    ``448 * scale`` are clipped, as the checkpoint was calibrated for. Elementwise: a
    column shard of ``x`` quantizes exactly as the same columns of the whole row."""
    xf = x.float()
    s = scale.float().reshape(1, 1)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s.expand(xf.shape[0], 1).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def reference_weight_only(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` times the dequantized ``wq [N, K]`` (``w_scale [N]``), in float32."""
    y = F.linear(x.float(), dequantize(wq, w_scale.view(-1, 1)),
                 None if bias is None else bias.float())
    return y.to(x.dtype)


def reference_w8a8(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, input_scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``x [M, K]`` quantized per token (or with the static ``input_scale``), times the
    dequantized weight, in float32."""
    xq, xs = quantize_per_row(x) if input_scale is None else quantize_static(x, input_scale)
    return reference_quantized_product(xq, xs, wq, w_scale, bias, x.dtype)


def reference_quantized_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor,
                                w_scale: torch.Tensor, bias: torch.Tensor | None,
                                out_dtype: torch.dtype) -> torch.Tensor:
    """Per-token quantized ``xq [M, K]`` (scales ``xs [M, 1]``) times the dequantized
    weight, in float32, rounded to ``out_dtype``."""
    y = F.linear(dequantize(xq, xs), dequantize(wq, w_scale.view(-1, 1)),
                 None if bias is None else bias.float())
    return y.to(out_dtype)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``y = x W^T + b`` with ``W = wq * w_scale`` (``wq [N, K]`` e4m3, ``w_scale [N, 1]``);
    ``x [..., K]`` is quantized per token on the way in (eager; the W8A8 reference, and
    ``torch._scaled_mm`` where the device has FP8 matrix products)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if scaled_mm_supported(x.device):
        xq, xs = quantize_per_row(x2)
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale.view(1, -1),
                             bias=bias, out_dtype=out_dtype)
    else:
        y = reference_w8a8(x2.float(), wq, w_scale, bias).to(out_dtype)
    return y.reshape(*lead, y.shape[-1])


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 matrix products need compute capability 8.9 or newer (Ada, Hopper)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def weight_scale_factors(device: torch.device) -> torch.Tensor:
    """``[WEIGHT_SCALE_CANDIDATES]`` float32: ``2^(i / WEIGHT_SCALE_CANDIDATES)``."""
    i = torch.arange(WEIGHT_SCALE_CANDIDATES, dtype=torch.float64)
    return (2.0 ** (i / WEIGHT_SCALE_CANDIDATES)).to(torch.float32).to(device)


def weight_scale_errors(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``[N, WEIGHT_SCALE_CANDIDATES]`` float64: each row's squared error, summed over its
    columns, when ``w [N, K]`` is quantized with the row amax ``amax [N, 1]`` times each of
    ``weight_scale_factors`` (``SEARCH_ROWS`` rows at a time, which bounds the float32
    copies the search makes)."""
    factors = weight_scale_factors(w.device)
    out = torch.empty(w.shape[0], factors.numel(), dtype=torch.float64, device=w.device)
    for r0 in range(0, w.shape[0], SEARCH_ROWS):
        rows = w[r0:r0 + SEARCH_ROWS].float()
        for i, f in enumerate(factors):
            q, scale = quantize_per_row(rows, amax[r0:r0 + SEARCH_ROWS] * f)
            err = dequantize(q, scale).sub_(rows).square_()  # float32 squares, float64 sums
            out[r0:r0 + SEARCH_ROWS, i] = err.sum(-1, dtype=torch.float64)
    return out


def searched_amax(w: torch.Tensor, amax: torch.Tensor, reduce=None) -> torch.Tensor:
    """The ``[N, 1]`` float32 amax to quantize ``w [N, K]`` with (``quantize_per_row``):
    ``amax`` times the least-error factor of each row. ``reduce`` (row-parallel shards: the
    sum over the ranks) is applied to the per-candidate errors before the choice."""
    errors = weight_scale_errors(w, amax)
    if reduce is not None:
        errors = reduce(errors)
    best = errors.argmin(dim=1, keepdim=True)  # the first of equal errors
    return amax * weight_scale_factors(w.device)[best]


def quantize_rows(w: torch.Tensor, comm, row_parallel: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard ``w [N, K]`` as ``(q [N, K] e4m3, scale [N] float32)``, scaled per
    output row of the unsharded weight with the least-error scale of the search
    (``row_parallel``, columns split over ``comm``'s ranks: the row amax is max-reduced and
    the errors summed over the ranks, so that every rank picks the tp-1 scale)."""
    amax = w.abs().amax(dim=-1, keepdim=True).float()
    reduce = None
    if row_parallel and comm.world_size > 1:
        amax = -comm.all_reduce_min(-amax)  # max over ranks
        reduce = comm.all_reduce
    q, scale = quantize_per_row(w, searched_amax(w, amax, reduce))
    return q, scale.view(-1)


def quantize_layer_weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` of this rank's shard of ``layer.weight``."""
    return quantize_rows(layer.weight.detach(), layer.comm,
                         isinstance(layer, RowParallelLinear))


@dataclass(frozen=True)
class Fp8LinearMethod:
    """The ``quant_method`` (see ``parallel/linear.py``) of ``--quantization fp8``.

    ``backend`` "torch": the float32 reference functions; "triton": the Triton kernels
    (weight-only ``kernels/triton_fp8.py``, quantizer ``kernels/triton_fp8_quant.py``) and,
    when ``scaled_mm`` (FP8 matrix products: compute capability >= 8.9, and a bf16 model),
    W8A8 through ``kernels/triton_w8a8.py`` up to ``w8a8_triton_max_tokens`` and
    ``torch._scaled_mm`` above; without it every M takes the weight-only kernel (a tiled
    GEMM at any M). ``fast_accum`` (``--fp8-fast-accum``):
    ``_scaled_mm`` keeps the FP8 tensor cores' own running sums instead of promoting them
    into float32 (``use_fast_accum``), and so does the Triton W8A8 kernel (each program's
    K chunk in the tensor cores' accumulator)."""

    backend: str = "torch"
    weight_only_max_tokens: int = DEFAULT_WEIGHT_ONLY_MAX_TOKENS
    scaled_mm: bool = False
    w8a8_triton_max_tokens: int = W8A8_TRITON_MAX_TOKENS
    fast_accum: bool = DEFAULT_FAST_ACCUM

    # a mixture of experts' experts are quantized at load as well (``process_experts``)
    quantizes_experts = True

    def create_weights(self, layer: nn.Module, rows: int, cols: int,
                       dtype: torch.dtype | None) -> None:
        """The weight is loaded in the model's dtype, then quantized by ``process_weights``."""
        UNQUANTIZED.create_weights(layer, rows, cols, dtype)

    def process_weights(self, layer: nn.Module) -> None:
        q, scale = quantize_layer_weight(layer)
        # the loaded weight is dropped here: the layer holds fp8 codes + float32 scales
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def process_experts(self, experts: nn.Module) -> None:
        """A mixture of experts' ``w13`` / ``w2`` (``parallel.moe.ParallelExperts``) as e4m3
        codes with a least-error scale per expert and output row, as a linear layer's
        (``w2``, split by columns over the ranks like a row-parallel weight: its amax
        max-reduced and its errors summed over the ranks, so every rank picks the tp-1
        scale); weight-only products (the activations stay in the model's dtype)."""
        # expert parallel: every expert whole on one rank, nothing to agree on
        for name, row_parallel in (("w13", False), ("w2", not experts.expert_parallel)):
            w = getattr(experts, name).detach()
            e, n, k = w.shape
            q, scale = quantize_rows(w.reshape(e * n, k), experts.comm, row_parallel)
            setattr(experts, name, nn.Parameter(q.view(e, n, k), requires_grad=False))
            setattr(experts, f"{name}_scale", scale.view(e, n))

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Activation,
              bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Activation):  # quantized by its producer (2-D, W8A8 only)
            return self.w8a8(x.q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        y = self.matmul(x2, layer.weight, layer.weight_scale, bias, self.input_scale(layer))
        return y.reshape(*lead, y.shape[-1])

    def takes_quantized_input(self, layer: nn.Module, num_tokens: int) -> bool:
        """Whether ``apply`` at this static token count quantizes its input (the W8A8 path),
        so that the producer of the input may do it instead and hand over an
        ``Fp8Activation`` (the same codes and scales, one kernel fewer): per token, or with
        ``input_scale(layer)`` where that is not None."""
        return self.uses_w8a8(num_tokens, layer.weight)

    def describe_products(self) -> str:
        """Which products the W8A8 steps take (for the start-up log, with ``scaled_mm``)."""
        sums = "fast accumulation" if self.fast_accum else "sums promoted to float32"
        return (f"fp8 x fp8 products above {tokens(self.weight_only_max_tokens)} (cuBLAS's "
                f"above {self.w8a8_triton_max_tokens}: {sums})")

    def input_scale(self, layer: nn.Module) -> torch.Tensor | None:
        """The static scale (``[1]`` float32) W8A8 quantizes ``layer``'s input with; None:
        per-token scales computed at run time (``Fp8CheckpointMethod`` overrides this)."""
        return None

    def uses_w8a8(self, num_tokens: int, wq: torch.Tensor) -> bool:
        """Whether ``matmul`` at this static token count quantizes the activations (W8A8)
        rather than multiplying them by the widened weight (weight-only)."""
        if num_tokens <= self.weight_only_max_tokens:
            return False
        if self.backend == "torch":
            return True
        n, k = wq.shape
        return self.scaled_mm and n % 16 == 0 and k % 16 == 0

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a merged gate/up layer in one kernel where the static M
        takes the weight-only GEMV (``triton_fp8.weight_only_silu_mul``); ``None`` where it
        does not (torch back-end, larger M): the layer then multiplies, and its caller
        gates."""
        if isinstance(x, Fp8Activation):
            return None
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.backend != "triton" or x2.shape[0] > self.weight_only_max_tokens:
            return None
        from tpserve.model.kernels import triton_fp8

        y = triton_fp8.weight_only_silu_mul(x2, layer.weight, layer.weight_scale, bias)
        return None if y is None else y.reshape(*lead, y.shape[-1])

    def matmul(self, x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, input_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``x [M, K] -> [M, N]``; the path is chosen by the static M only. W8A8 quantizes
        ``x`` per token, or with ``input_scale`` (``quantize_static``) when given."""
        w8a8 = self.uses_w8a8(x.shape[0], wq)
        if self.backend == "torch":
            if w8a8:
                return reference_w8a8(x, wq, w_scale, bias, input_scale)
            return reference_weight_only(x, wq, w_scale, bias)
        from tpserve.model.kernels import triton_fp8, triton_fp8_quant

        if not w8a8:
            return triton_fp8.weight_only_linear(x, wq, w_scale, bias)
        xq, xs = triton_fp8_quant.quantize_per_token(x, static_scale=input_scale)
        return self.w8a8(xq, xs, wq, w_scale, bias, x.dtype)

    def w8a8(self, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor,
             w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
             ) -> torch.Tensor:
        """Per-token quantized activations ``xq [M, K]`` (scales ``xs [M, 1]``) times the
        fp8 weight: the float32 reference on the torch back-end; the Triton split-K kernel
        up to ``w8a8_triton_max_tokens``, ``torch._scaled_mm`` above (static M only)."""
        if self.backend == "torch":
            return reference_quantized_product(xq, xs, wq, w_scale, bias, out_dtype)
        if xq.shape[0] <= self.w8a8_triton_max_tokens:
            from tpserve.model.kernels import triton_w8a8

            return triton_w8a8.w8a8_linear(xq, xs, wq, w_scale, bias, out_dtype,
                                           fast_accum=self.fast_accum)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale.view(1, -1),
                                bias=bias, out_dtype=out_dtype, use_fast_accum=self.fast_accum)
