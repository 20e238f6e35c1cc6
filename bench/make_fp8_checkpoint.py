"""Writes an FP8 checkpoint of a dummy shape in vLLM's ``quant_method: "fp8"`` format with
static activation scales (AutoFP8's ``activation_scheme: "static"``), or with ``--block BN
BK`` block-wise weight scales (``weight_block_size``, dynamic activations), for serving
benchmarks of those paths without downloading a real FP8 export.

The weights are the dummy shape's (``--load-format dummy``: uniform noise, norms of ones),
each linear weight stored as e4m3 codes with one ``[]`` float32 ``weight_scale`` (its amax /
448). The ``input_scale`` of every linear weight is calibrated as AutoFP8 calibrates it: the
largest magnitude its input takes over a forward pass of ``--calibration-tokens`` random
tokens through the unquantized (bf16) dummy model, divided by 448 (q, k and v share their
input, as gate and up do). Norms, embeddings and the LM head are stored in bf16. Block-wise:
each ``[BN, BK]`` block of a linear weight takes its own amax / 448 (``weight_scale_inv``
``[ceil(out / BN), ceil(in / BK)]``); nothing is calibrated. ``--weights embedded`` (with
``--shape smollm2-135m`` and ``--block``) takes the embedded SmolLM2 GGUF's real weights
instead of noise, the other tensors kept in their own dtype: a real model to measure the
block-wise path's accuracy on (``fp8_accuracy.py --fp8-checkpoint``).

    python bench/make_fp8_checkpoint.py --shape llama3-8b --out /tmp/llama3-8b-fp8-static
    python bench/make_fp8_checkpoint.py --shape smollm2-135m --device cpu --out /tmp/s
    python bench/make_fp8_checkpoint.py --block 128 128 --out /tmp/llama3-8b-fp8-block
    python bench/make_fp8_checkpoint.py --shape smollm2-135m --weights embedded --device cpu \
        --block 128 128 --out /tmp/smollm2-fp8-block
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard_writer import ShardWriter  # noqa: E402  (bench/shard_writer.py)

from tpserve.model.attention.backend import select_attention  # noqa: E402
from tpserve.model.kernels.backend import select_ops  # noqa: E402
from tpserve.model.kv_pool import KVPool  # noqa: E402
from tpserve.model.loader import dummy, gguf_file  # noqa: E402
from tpserve.model.loader.build import build_model  # noqa: E402
from tpserve.model.loader.checkpoint import embedded_model_path, open_checkpoint  # noqa: E402
from tpserve.model.plan import SeqChunk, StepPlan  # noqa: E402
from tpserve.model.quant.fp8 import FP8, FP8_MAX  # noqa: E402
from tpserve.parallel.comm import Communicator  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402

# the served module whose input each checkpoint linear weight multiplies
INPUT_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
            "down_proj": "down_proj"}
BLOCK = 16


def calibrate(shape: str, seed: int, device: torch.device, tokens: int) -> dict[str, float]:
    """``{served module name: amax of its input}`` over one prefill of ``tokens`` random
    token ids through the bf16 dummy model (torch ops: the reference path)."""
    ckpt = open_checkpoint(shape, "dummy", seed)
    cfg = ckpt.config
    comm = Communicator(TPGroup(0, 1, device, None))
    model = build_model(ckpt, comm, device, torch.bfloat16, select_ops("torch"),
                        select_attention("torch", torch.bfloat16), tokens)
    amax: dict[str, float] = {}

    def record(name: str):
        def hook(_module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules()
             if n.rsplit(".", 1)[-1] in INPUT_OF.values()]
    ids = torch.randint(0, cfg.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(seed)).tolist()
    blocks = -(-tokens // BLOCK)
    pool = KVPool(cfg.num_hidden_layers, blocks, BLOCK, cfg.kv_heads_for(1), cfg.head_dim,
                  torch.bfloat16, device)
    plan = StepPlan.build([SeqChunk(ids, 0, list(range(blocks)), True)], BLOCK,
                          model.attn_backend).to(device)
    with torch.no_grad():
        model(plan.input_ids, plan.positions, pool.layers, plan.metadata(model.attn_backend))
    for h in hooks:
        h.remove()
    del model, pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return amax


def fp8_tensors(name: str, w: torch.Tensor, amax: dict[str, float]) -> dict[str, torch.Tensor]:
    """A linear weight as stored: e4m3 codes, its ``[]`` weight scale, its input scale."""
    prefix = name.removesuffix(".weight")
    parent, proj = prefix.rsplit(".", 1)
    served = f"{parent}.{INPUT_OF[proj]}"
    scale = (w.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return {name: q.cpu(), prefix + ".weight_scale": scale.cpu(),
            prefix + ".input_scale": torch.tensor(amax[served] / FP8_MAX, dtype=torch.float32)}


def block_tensors(name: str, w: torch.Tensor, block: tuple[int, int]
                  ) -> dict[str, torch.Tensor]:
    """A linear weight as a block-wise checkpoint stores it: codes and block scales."""
    bn, bk = block
    n, k = w.shape
    rb, cb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, cb * bk - k, 0, rb * bn - n))
    scale = (padded.abs().reshape(rb, bn, cb, bk).amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return {name: (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8).cpu(),
            name + "_scale_inv": scale.cpu()}


def embedded_weights(shape: str):
    """The embedded SmolLM2 GGUF's tensors by Hugging Face name (its config must be the
    ``shape``'s: the checkpoint's ``config.json`` is written from the shape)."""
    path = embedded_model_path()
    reader = gguf_file.open_reader(path)
    cfg = gguf_file.read_config(reader, path)
    want = dummy.shape_config(shape)
    if (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) != (
            want.hidden_size, want.num_hidden_layers, want.vocab_size):
        raise SystemExit(f"the embedded model is not --shape {shape}")
    return gguf_file.iter_weights(reader, cfg)


def write(shape: str, seed: int, device: torch.device, amax: dict[str, float] | None,
          out: Path, block: tuple[int, int] | None = None, embedded: bool = False) -> dict:
    cfg = dummy.shape_config(shape)
    writer = ShardWriter(out)
    weights = embedded_weights(shape) if embedded else dummy.iter_weights(cfg, seed, device)
    for name, source in weights:
        w = source.read().to(device)
        proj = name.rsplit(".", 2)[-2]
        if not (proj in INPUT_OF and name.endswith(".weight")):
            part = {name: (w if embedded else w.to(torch.bfloat16)).contiguous().cpu()}
        elif block is not None:
            part = block_tensors(name, w, block)
        else:
            part = fp8_tensors(name, w, amax)
        writer.add(part)
    info = writer.finish()
    config = dummy.shape_hf_config(shape)
    config["torch_dtype"] = "float32" if embedded else "bfloat16"
    config["quantization_config"] = {"quant_method": "fp8",
                                     "activation_scheme": "dynamic" if block else "static",
                                     "ignored_layers": ["lm_head"]}
    if block is not None:
        config["quantization_config"]["weight_block_size"] = list(block)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=dummy.SHAPES)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-tokens", type=int, default=512)
    p.add_argument("--block", type=int, nargs=2, metavar=("BN", "BK"), default=None,
                   help="block-wise weight scales instead of static activation scales")
    p.add_argument("--weights", choices=["dummy", "embedded"], default="dummy",
                   help="embedded: the embedded SmolLM2's real weights (with --block)")
    a = p.parse_args()
    if a.weights == "embedded" and a.block is None:
        p.error("--weights embedded writes block-wise checkpoints only (give --block)")
    device = torch.device(a.device)
    amax = None
    t1 = time.perf_counter()
    if a.block is None:
        amax = calibrate(a.shape, a.seed, device, a.calibration_tokens)
        print(f"calibrated {len(amax)} layer inputs in {time.perf_counter() - t1:.1f} s; "
              f"input amax {min(amax.values()):.3g} .. {max(amax.values()):.3g}", flush=True)
        t1 = time.perf_counter()
    info = write(a.shape, a.seed, device, amax, a.out, None if a.block is None
                 else tuple(a.block), a.weights == "embedded")
    print(f"wrote {len(info['files'])} files, {info['bytes'] / 2**30:.2f} GiB, to {a.out} in "
          f"{time.perf_counter() - t1:.1f} s", flush=True)


if __name__ == "__main__":
    main()
