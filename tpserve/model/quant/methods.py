"""``--quantization`` -> the linear layers' ``quant_method`` (see ``parallel/linear.py``),
chosen once when the model is built.

``auto`` (the flag's default) is resolved by ``resolve_quantization`` when the config tree
is built: the checkpoint's own method (``checkpoint_format.py``) if it has one, else
``none``. The runner's config holds ``none``, ``fp8``, ``gptq`` or ``awq``; which fp8
method serves fp8 follows from the checkpoint: quantize at load (an unquantized checkpoint)
or load the fp8 codes and scales as stored (an FP8 checkpoint). ``gptq`` and ``awq`` serve
only checkpoints of that method, as stored (``wna16_method.py``). ``gguf`` serves a GGUF
file's integer blocks as stored (``loader/gguf_integer.py``; a method per module,
``ModuleMethods``, where its modules take different forms); for
such a file every other choice, ``auto`` included, dequantizes them at load
(``dequantizable``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.model.loader.gguf_blocks import BLOCK_TYPES
from tpserve.model.quant.checkpoint_format import CheckpointQuantization
from tpserve.model.quant.fp8 import DEFAULT_FAST_ACCUM, Fp8LinearMethod, scaled_mm_supported
from tpserve.model.quant.fp8_block import Fp8BlockMethod, block_mm_supported
from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod
from tpserve.model.quant.wna16_method import Wna16Method

QUANTIZATIONS = ("none", "fp8", "gptq", "awq", "compressed-tensors", "gguf")
# never quantized at load: a checkpoint of that method ("compressed-tensors": its integer
# weights; its FP8 checkpoints resolve to fp8)
STORED_ONLY = ("gptq", "awq", "compressed-tensors", "gguf")
# vLLM's names of its kernels for these checkpoints: the same weights here
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS, *ALIASES)


def resolve_quantization(flag: str, checkpoint: CheckpointQuantization | None) -> str:
    """``--quantization`` resolved against the checkpoint's own quantization: ``auto`` is
    the checkpoint's method, else ``none``; ``fp8`` serves either kind; ``none`` on an FP8
    checkpoint is refused (its weights are not dequantized to the model's dtype)."""
    if flag not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown --quantization {flag!r}; choose one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    checkpoint = served_quantization(flag, checkpoint)
    if flag == "auto":
        return "none" if checkpoint is None else checkpoint.method
    flag = ALIASES.get(flag, flag)
    if checkpoint is not None and flag == checkpoint.quant_method:
        flag = checkpoint.method  # as config.json spells it: compressed-tensors FP8 is fp8
    check_matches(flag, checkpoint)
    return flag


def served_quantization(quantization: str, checkpoint: CheckpointQuantization | None
                        ) -> CheckpointQuantization | None:
    """The checkpoint's quantization as ``quantization`` serves it: a ``dequantizable`` one
    (a GGUF file's integer blocks) counts only for its own method; otherwise its weights
    are dequantized at load, as an unquantized checkpoint's."""
    if checkpoint is not None and checkpoint.dequantizable and quantization != checkpoint.method:
        return None
    return checkpoint


def check_matches(quantization: str, checkpoint: CheckpointQuantization | None) -> None:
    """ValueError when the resolved ``quantization`` cannot serve the checkpoint."""
    checkpoint = served_quantization(quantization, checkpoint)
    if quantization == "gguf" and checkpoint is None:
        raise ValueError("--quantization gguf serves GGUF files whose decoder layers' linear "
                         f"weights are all of the types {', '.join(BLOCK_TYPES)} (and not "
                         "Phi-3's fused attn_qkv), as stored; this checkpoint is not one "
                         "(other GGUF files, the IQ types', are dequantized at load: "
                         "--quantization auto)")
    if checkpoint is not None and quantization != checkpoint.method:
        raise ValueError(f"--quantization {quantization}: the checkpoint is quantized "
                         f"({checkpoint.describe()}) and is served as stored; use "
                         f"--quantization auto or {checkpoint.method} (tpserve does not "
                         "dequantize it)")
    if checkpoint is None and quantization in STORED_ONLY:
        raise ValueError(f"--quantization {quantization} serves the checkpoints whose "
                         "config.json's quantization_config.quant_method is "
                         f"{quantization!r}, as stored; this checkpoint is not quantized "
                         "(--quantization fp8 quantizes one at load)")


@dataclass(frozen=True, eq=False)
class ModuleMethods:
    """A method per decoder linear module: a GGUF file whose layers mix block types
    (``Q4_K_M``: ``Q6_K`` in some ``attn_v`` and ``ffn_down``), each module in its form
    (``loader/gguf_integer.Form``). ``methods``: ``(layer, module) -> Wna16Method``, module
    one of "qkv_proj", "o_proj", "gate_up_proj", "down_proj"."""

    methods: dict[tuple[int, str], Wna16Method]
    quantizes_experts = False  # as Wna16Method: the experts have no WNA16 product

    def of(self, layer: int, module: str) -> Wna16Method:
        try:
            return self.methods[(layer, module)]
        except KeyError:
            raise ValueError(f"the checkpoint has no weight for layer {layer}'s "
                             f"{module}") from None


def module_method(quant, layer: int, module: str):
    """The method of decoder layer ``layer``'s linear ``module``: ``quant`` itself (None,
    or one method for every layer) unless it is a ``ModuleMethods``."""
    return quant.of(layer, module) if isinstance(quant, ModuleMethods) else quant


def linear_method(quantization: str, kernel_backend: str, device: torch.device,
                  dtype: torch.dtype, weight_only_max_tokens: int,
                  checkpoint: CheckpointQuantization | None = None,
                  fast_accum: bool = DEFAULT_FAST_ACCUM
                  ) -> Fp8LinearMethod | Wna16Method | ModuleMethods | None:
    """None (the layers' default, unquantized) or the method for ``quantization``: fp8
    quantizes an unquantized checkpoint at load, or loads an FP8 ``checkpoint`` as stored;
    gptq / awq load the checkpoint's integer weights as stored; the Triton kernels with the
    Triton kernel back-end, the torch reference otherwise."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {quantization!r}; choose one of "
                         f"{', '.join(QUANTIZATIONS)}")
    check_matches(quantization, checkpoint)
    checkpoint = served_quantization(quantization, checkpoint)
    if quantization == "none":
        return None
    backend = "triton" if kernel_backend == "triton" else "torch"
    if checkpoint is not None and checkpoint.modules:  # GGUF modules of different forms
        return ModuleMethods({(layer, name): Wna16Method(checkpoint.method, bits, group,
                                                         backend=backend, offset=offset)
                              for layer, name, bits, group, offset in checkpoint.modules})
    if quantization in STORED_ONLY:
        return Wna16Method(checkpoint.method, checkpoint.bits, checkpoint.group_size,
                           checkpoint.zero_offset, backend, checkpoint.symmetric,
                           checkpoint.act_order, checkpoint.offset)
    kw = dict(backend=backend,
              weight_only_max_tokens=weight_only_max_tokens,
              scaled_mm=scaled_mm_supported(device) and dtype == torch.bfloat16,
              fast_accum=fast_accum)
    if checkpoint is None:
        return Fp8LinearMethod(**kw)
    if checkpoint.weight_block is not None:
        return Fp8BlockMethod(**kw, block=checkpoint.weight_block,
                              scale_name=checkpoint.scale_name,
                              block_mm=kw["scaled_mm"] and block_mm_supported(device))
    return Fp8CheckpointMethod(**kw, static_activations=checkpoint.static_activations)
