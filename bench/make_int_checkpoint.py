"""Writes a GPTQ (or AWQ) checkpoint of a dummy shape, for serving benchmarks of the integer
weight path (``--quantization gptq`` / ``awq``) without downloading a real export.

Every linear layer's codes are random (uniform over the code range, so the products are
of realistic magnitude with the scales below), its zero points the middle of the range, its
fp16 scales ``2 / (2**bits * sqrt(in))`` per group of ``--group-size`` columns; GPTQ's
``g_idx`` is ``k // group_size``, or with ``--act-order`` a random permutation of it
(shared by the layers that share an input). Norms, embeddings and the LM head are the dummy
shape's (``--load-format dummy``'s noise), stored in fp16. Speed only: the model is noise.

    python bench/make_int_checkpoint.py --shape llama3-8b --out /tmp/llama3-8b-gptq
    python bench/make_int_checkpoint.py --format awq --out /tmp/llama3-8b-awq
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard_writer import ShardWriter  # noqa: E402  (bench/shard_writer.py)

from tpserve.model.loader import dummy  # noqa: E402

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def int_tensors(name: str, out_f: int, in_f: int, fmt: str, bits: int, group: int,
                act_order: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """The packed tensors of one linear layer ``[out_f, in_f]`` (random codes)."""
    layer = name.removesuffix(".weight")
    proj = layer.rsplit(".", 1)[-1]
    pack = 32 // bits
    groups = 1 if group == -1 else -(-in_f // group)
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(layer.encode()))
    shape = (in_f // pack, out_f) if fmt == "gptq" else (in_f, out_f // pack)
    t = {f"{layer}.qweight": torch.randint(-2**31, 2**31, shape, generator=gen,
                                           dtype=torch.int64, device=device).to(torch.int32)}
    middle = (2**(bits - 1) - (1 if fmt == "gptq" else 0))  # GPTQ v1 stores zero - 1
    word = sum(middle << (bits * j) for j in range(pack))
    word = word - 2**32 if word >= 2**31 else word
    t[f"{layer}.qzeros"] = torch.full((groups, out_f // pack), word, dtype=torch.int32)
    t[f"{layer}.scales"] = torch.full((groups, out_f), 2 / (2**bits * in_f**0.5),
                                      dtype=torch.float16)
    if fmt == "gptq":
        per = in_f if group == -1 else group
        g_idx = torch.arange(in_f, dtype=torch.int32) // per
        if act_order:
            shared = layer.replace(proj, SHARED_INPUT.get(proj, proj))
            perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(
                zlib.crc32(shared.encode())))
            g_idx = g_idx[perm]
        t[f"{layer}.g_idx"] = g_idx
    return {k: v.contiguous().cpu() for k, v in t.items()}


def write(shape: str, fmt: str, bits: int, group: int, act_order: bool, seed: int,
          device: torch.device, out: Path) -> dict:
    cfg = dummy.shape_config(shape)
    if cfg.num_experts:
        raise SystemExit(f"{shape} is a mixture of experts: GPTQ / AWQ experts are refused")
    writer = ShardWriter(out)
    for name, source in dummy.iter_weights(cfg, seed, device):
        proj = name.rsplit(".", 2)[-2]
        if proj in LINEAR and name.endswith(".weight"):
            part = int_tensors(name, *source.shape, fmt, bits, group, act_order, device)
        else:
            part = {name: source.read().to(torch.float16).contiguous().cpu()}
        writer.add(part)
    info = writer.finish()
    config = dummy.shape_hf_config(shape)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
         "sym": True, "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
         "version": "gemm"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=dummy.SHAPES)
    p.add_argument("--format", default="gptq", choices=("gptq", "awq"))
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args()
    t0 = time.perf_counter()
    info = write(a.shape, a.format, a.bits, a.group_size, a.act_order, a.seed,
                 torch.device(a.device), a.out)
    print(json.dumps({**info, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
