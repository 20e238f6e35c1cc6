"""GPTQ and AWQ checkpoints written by the tests from an unquantized safetensors folder, as
AutoGPTQ / GPTQModel and AutoAWQ write them (packing written here independently of
``tpserve.model.quant.int_checkpoint``, bit by bit), with the twin float32 folder holding
the dequantized weights: the oracle of every test that serves them."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.model.util import LINEAR_NAMES

AWQ_INTERLEAVE = [0, 2, 4, 6, 1, 3, 5, 7]  # output column held by bit field j (AutoAWQ)


def group_indices(cols: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """Each input column's group: ``i // group_size`` (one group: -1), or with act-order
    the groups of a random column order (GPTQ's ``desc_act``)."""
    per = cols if group_size == -1 else group_size
    if not act_order:
        return torch.arange(cols, dtype=torch.int32) // per
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    g = torch.empty(cols, dtype=torch.int32)
    g[order] = (torch.arange(cols, dtype=torch.int32) // per)
    return g


def quantize(w: torch.Tensor, g_idx: torch.Tensor, bits: int, min_zero: int,
             symmetric: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of ``w [out, in]`` per (row, group), asymmetric or (``symmetric``)
    with every zero point ``2**(bits - 1)``: ``(codes [in, out], zeros [G, out], scales
    [G, out] float16, dequantized [out, in] float32)``."""
    top = 2**bits - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
        if symmetric:
            half = 2**(bits - 1)
            s = (torch.maximum(-lo, hi) / (half - 1)).clamp(min=1e-4).to(torch.float16)
            scales[g], zeros[g] = s, half
            continue
        s = ((hi - lo) / top).clamp(min=1e-4).to(torch.float16)
        scales[g] = s
        zeros[g] = torch.round(-lo / s.float()).clamp(min_zero, top).long()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]  # [in, out]
    codes = (torch.round(w.t() / s) + z).clamp(0, top).long()
    return codes, zeros, scales, ((codes - z).float() * s).t().contiguous()


def pack(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None
         ) -> torch.Tensor:
    """int32, ``32 // bits`` values of ``values`` (non-negative ints) per element along
    ``dim``: bit field j holds value ``order[j]`` of its pack (identity by default)."""
    n = 32 // bits
    order = order or list(range(n))
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // n, n)
    out = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(n):
        out |= v[..., order[j]] << (bits * j)
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32).movedim(-1, dim).contiguous()


def save_int_folders(base: Path, folder: Path, fmt: str, bits: int = 4, group_size: int = 32,
                     act_order: bool = False, gptq_version: str = "gptq",
                     biases: bool = True, symmetric: bool = False) -> tuple[Path, Path]:
    """``(quantized folder, its dequantized float32 twin)`` of the unquantized folder
    ``base``: every linear layer quantized (``fmt`` "gptq", "awq" or "compressed-tensors",
    llm-compressor's pack-quantized, ``symmetric`` or not); GPTQ folders also hold each
    layer's all-zero ``bias`` when ``biases`` (AutoGPTQ writes one)."""
    twin = folder.with_name(folder.name + "-dequantized")
    shutil.copytree(base, folder)
    shutil.copytree(base, twin)
    for f in sorted(base.glob("*.safetensors")):
        state, quantized, dense = load_file(str(f)), {}, {}
        for name, w in sorted(state.items()):
            layer, _, kind = name.rpartition(".")
            if layer.rpartition(".")[2] not in LINEAR_NAMES or kind != "weight":
                quantized[name], dense[name] = w, w
                continue
            # q/k/v (gate/up) see the same inputs, so GPTQ orders their columns alike
            shared = layer.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            g_idx = group_indices(w.shape[1], group_size, act_order,
                                  seed=zlib.crc32(shared.replace("up_proj", "gate_proj")
                                                  .encode()))
            v1 = fmt == "gptq" and gptq_version == "gptq"
            codes, zeros, scales, deq = quantize(w.float(), g_idx, bits, 1 if v1 else 0,
                                                 symmetric)
            dense[name] = deq
            if fmt == "compressed-tensors":
                quantized[f"{layer}.weight_packed"] = pack(codes.t(), bits, 1)
                quantized[f"{layer}.weight_scale"] = scales.t().contiguous()
                quantized[f"{layer}.weight_shape"] = torch.tensor(w.shape, dtype=torch.int32)
                if not symmetric:
                    quantized[f"{layer}.weight_zero_point"] = pack(zeros.t(), bits, 0)
                if act_order:
                    quantized[f"{layer}.weight_g_idx"] = g_idx
                continue
            quantized[f"{layer}.scales"] = scales
            if fmt == "gptq":
                quantized[f"{layer}.qweight"] = pack(codes, bits, 0)
                quantized[f"{layer}.qzeros"] = pack(zeros - 1 if v1 else zeros, bits, 1)
                quantized[f"{layer}.g_idx"] = g_idx
                if biases:
                    quantized[f"{layer}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
            else:
                quantized[f"{layer}.qweight"] = pack(codes, bits, 1, AWQ_INTERLEAVE)
                quantized[f"{layer}.qzeros"] = pack(zeros, bits, 1, AWQ_INTERLEAVE)
        save_file(quantized, str(folder / f.name), metadata={"format": "pt"})
        save_file(dense, str(twin / f.name), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        d = json.loads(index.read_text())
        weight_map = {}
        for f in folder.glob("*.safetensors"):
            weight_map.update(dict.fromkeys(load_file(str(f)), f.name))
        d["weight_map"] = weight_map
        index.write_text(json.dumps(d))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, bits, group_size, act_order,
                                                     gptq_version, symmetric)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, twin


def quantization_config(fmt: str, bits: int, group_size: int, act_order: bool,
                        gptq_version: str, symmetric: bool = False) -> dict:
    if fmt == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
                   "strategy": "channel" if group_size == -1 else "group",
                   "group_size": None if group_size == -1 else group_size,
                   "actorder": "group" if act_order else None, "dynamic": False,
                   "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None,
                                              "output_activations": None}}}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                "desc_act": act_order, "sym": False, "lm_head": False,
                "checkpoint_format": gptq_version, "damp_percent": 0.01,
                "static_groups": False, "true_sequential": True}
    return {"quant_method": "awq", "bits": bits, "group_size": group_size,
            "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
