"""FP8 accuracy: the model with fp8 weights and/or an fp8 KV cache against the same model
unquantized, on a fixed public-domain text (``tests/data/pride_and_prejudice_ch1.txt``).

Modes: ``base``, ``fp8-weights`` (``--quantization fp8``), ``fp8-kv`` (``--kv-cache-dtype
KV``), ``both``. Each mode's ``RunnerConfig`` is built (and so validated) the way the server
builds it, then the model is built from it on one rank. A mode whose config is refused (an
fp8 KV cache before that feature exists) is skipped with the reason recorded.

Per mode against base:
- the next-token log-probabilities of base's top-5 tokens at ``--positions`` positions spread
  over one prefill of the text (up to ``--max-prompt-len`` tokens; W8A8 path): mean, p95 and
  max |difference|, and the mean KL(base || mode) there; and KL(base || mode) over every
  position of the prefill (mean, p95);
- greedy agreement: the argmax at every position of the prefill, and decoded continuations
  (``--decode-tokens`` greedy steps, one token per step: the weight-only path) from
  ``--decode-prompts`` cut points, as the fraction of tokens before the first divergence;
- perplexity of the text, and the criterion: within 2 % of base.

``--fp8-checkpoint FOLDER``: the fp8-weight modes serve that FP8 checkpoint of the same
model as stored (e.g. ``make_fp8_checkpoint.py --weights embedded --block 128 128``)
instead of quantizing ``--model`` at load.

The text is tokenized by the model's tokenizer; dummy shapes (``--load-format dummy``) have
none, so a fixed byte-level mapping stands in (every byte one token id): their figures
measure the arithmetic of fp8, not language modelling.

    python bench/fp8_accuracy.py --out bench/results/cpu-DATE-fp8-accuracy.json
    python bench/fp8_accuracy.py --model llama3-8b --load-format dummy --out OUT.json
    python bench/fp8_accuracy.py --dtype float32 --fp8-checkpoint /tmp/smollm2-fp8-block \
        --out OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.attention.backend import select_attention  # noqa: E402
from tpserve.model.kernels.backend import select_ops  # noqa: E402
from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPES  # noqa: E402
from tpserve.model.kv_calibration import (  # noqa: E402
    calibrate_kv_scales,
    checkpoint_calibration_ids,
)
from tpserve.model.kv_pool import KVPool  # noqa: E402
from tpserve.model.loader.build import DTYPES, build_model  # noqa: E402
from tpserve.model.loader.checkpoint import open_checkpoint  # noqa: E402
from tpserve.model.plan import SeqChunk, StepPlan  # noqa: E402
from tpserve.model.quant.methods import linear_method  # noqa: E402
from tpserve.model.runner_config import RunnerConfig  # noqa: E402
from tpserve.parallel.comm import Communicator  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "pride_and_prejudice_ch1.txt"
MODES = ("base", "fp8-weights", "fp8-kv", "both")
BLOCK = 16
PPL_TOLERANCE = 0.02


def runner_config(a: argparse.Namespace, mode: str) -> RunnerConfig:
    """The mode's ``RunnerConfig``, resolved by the server's own flags and validation."""
    model = a.fp8_checkpoint if a.fp8_checkpoint and mode in ("fp8-weights", "both") \
        else a.model
    argv = ["serve", *([model] if model else []),
            "--load-format", "auto" if model != a.model else a.load_format,
            "--dtype", a.dtype, "--device", a.device, "--enforce-eager",
            "--max-model-len", str(a.max_prompt_len + a.decode_tokens + BLOCK)]
    if mode in ("fp8-weights", "both"):
        argv += ["--quantization", "fp8"]
        if a.fp8_weight_only_max_tokens is not None:
            argv += ["--fp8-weight-only-max-tokens", str(a.fp8_weight_only_max_tokens)]
        if a.fp8_fast_accum is not None:
            argv += ["--fp8-fast-accum" if a.fp8_fast_accum else "--no-fp8-fast-accum"]
    if mode in ("fp8-kv", "both"):
        argv += ["--kv-cache-dtype", a.kv_fp8_dtype]
        if a.calculate_kv_scales is not None:
            argv += ["--calculate-kv-scales" if a.calculate_kv_scales
                     else "--no-calculate-kv-scales"]
        if a.kv_cache_hadamard is not None:
            argv += ["--kv-cache-hadamard" if a.kv_cache_hadamard else "--no-kv-cache-hadamard"]
    parser, _ = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        raise ValueError(f"the server refuses {' '.join(argv[1:])}") from None
    return config_from_args(ns).runner


class Model:
    """One mode's model on one rank, with a KV pool for one sequence."""

    def __init__(self, cfg: RunnerConfig, max_tokens: int):
        self.device = torch.device(cfg.device)
        group = TPGroup(0, 1, self.device, None)
        self.comm = Communicator(group)
        ckpt = open_checkpoint(cfg.model, cfg.load_format, cfg.seed)
        dtype = DTYPES[cfg.dtype]
        kv_dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype]  # resolved by the config
        self.attn = select_attention(cfg.kernel_backend, kv_dtype, cfg.kv_cache_hadamard)
        quant = linear_method(cfg.quantization, cfg.kernel_backend, self.device, dtype,
                              cfg.fp8_weight_only_max_tokens, ckpt.quantization,
                              fast_accum=cfg.fp8_fast_accum)
        self.model = build_model(ckpt, self.comm, self.device, dtype,
                                 select_ops(cfg.kernel_backend), self.attn, max_tokens,
                                 tp_comm=cfg.tp_comm, quant_method=quant)
        mc = ckpt.config
        self.blocks = -(-max_tokens // BLOCK)
        self.pool = KVPool(mc.num_hidden_layers, self.blocks, BLOCK, mc.kv_heads_for(1),
                           mc.head_dim, self.attn.kv_cache_dtype, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if cfg.calculate_kv_scales:  # as the runner does: the calibration text, not TEXT
            ids = checkpoint_calibration_ids(ckpt, max_tokens, cfg.seed)
            calibrate_kv_scales(self.model, self.attn, ids, BLOCK, dtype, self.device)

    @torch.inference_mode()
    def step(self, ids: list[int], start: int, all_rows: bool) -> torch.Tensor:
        plan = StepPlan.build([SeqChunk(ids, start, list(range(self.blocks)), True)], BLOCK,
                              self.attn).to(self.device)
        hidden = self.model(plan.input_ids, plan.positions, self.pool.layers,
                            plan.metadata(self.attn))
        rows = hidden if all_rows else hidden[plan.logits_indices]
        return self.model.compute_logits(rows).float().log_softmax(-1)

    def prefill_logprobs(self, ids: list[int]) -> torch.Tensor:
        """Log-probabilities of the next token at every position, ``[T, vocab]`` (CPU)."""
        return self.step(ids, 0, True).cpu()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        lp = self.step(prompt, 0, False)
        out, pos = [], len(prompt)
        for _ in range(n):
            tok = int(lp[0].argmax())
            out.append(tok)
            lp = self.step([tok], pos, False)
            pos += 1
        return out


def tokens(a: argparse.Namespace) -> tuple[list[int], str]:
    text = TEXT.read_text()
    ckpt = open_checkpoint(a.model, a.load_format, a.seed)
    try:
        tok = ckpt.tokenizer()
        ids = list(tok(text)["input_ids"]) if tok is not None else None
    except Exception:  # noqa: BLE001 - dummy shapes have no tokenizer
        ids = None
    how = "the model's tokenizer"
    if ids is None:
        vocab = ckpt.config.vocab_size
        ids = [(b * 257 + 1000) % vocab for b in text.encode()]
        how = "bytes (no tokenizer: dummy weights)"
    while len(ids) < a.max_prompt_len:  # the text again, for long prompts
        ids = ids + ids
    return ids[:a.max_prompt_len], how


def compare(base: dict, mine: dict, positions: list[int], ids: list[int]) -> dict:
    lb, lm = base["lp"], mine["lp"]
    diffs, kls = [], []
    for p in positions:
        top = lb[p].topk(5).indices
        diffs += (lm[p, top] - lb[p, top]).abs().tolist()
        kls.append(float((lb[p].exp() * (lb[p] - lm[p])).sum()))
    diffs.sort()
    agree_prefill = float((lb.argmax(-1) == lm.argmax(-1)).float().mean())
    kl_all = (lb.exp() * (lb - lm)).sum(-1)  # every position of the prefill
    decode = []
    for gb, gm in zip(base["gen"], mine["gen"], strict=True):
        same = next((i for i, (x, y) in enumerate(zip(gb, gm, strict=False)) if x != y), len(gb))
        decode.append(same / len(gb))
    ratio = mine["ppl"] / base["ppl"]
    return {"positions": len(positions),
            "logprob_abs_diff_top5": {"mean": sum(diffs) / len(diffs),
                                      "p95": diffs[int(0.95 * (len(diffs) - 1))],
                                      "max": diffs[-1]},
            "kl_base_to_mode_mean": sum(kls) / len(kls),
            "kl_base_to_mode_all_positions": {"mean": float(kl_all.mean()),
                                              "p95": float(kl_all.quantile(0.95))},
            "greedy_agreement_prefill": agree_prefill,
            "greedy_decode_prefix_fraction": decode,
            "ppl_ratio": ratio, "ppl_within_2pct": abs(ratio - 1) <= PPL_TOLERANCE}


def perplexity(lp: torch.Tensor, ids: list[int]) -> float:
    """The perplexity of ``ids`` under next-token log-probabilities ``lp [T, vocab]``."""
    return math.exp(-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def arg_parser() -> argparse.ArgumentParser:
    """This tool's flags (``kv_scale_probe.py`` builds its models from them too)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--fp8-checkpoint", default=None,
                    help="an FP8 checkpoint of --model the fp8-weight modes serve as stored")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--kv-fp8-dtype", default="fp8",
                    help="the --kv-cache-dtype value of the fp8-kv and both modes")
    ap.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction,
                    default=None, help="the server's flag of that name (default: the "
                    "server's default, off)")
    ap.add_argument("--kv-cache-hadamard", action=argparse.BooleanOptionalAction,
                    default=None, help="the server's flag of that name, in the fp8-kv and "
                    "both modes (default: the server's default, on)")
    ap.add_argument("--fp8-weight-only-max-tokens", type=int, default=None)
    ap.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction, default=None,
                    help="the server's flag of that name (default: the server's default)")
    ap.add_argument("--max-prompt-len", type=int, default=1024,
                    help="tokens of the text in the prefill (at most 2000 advised)")
    ap.add_argument("--positions", type=int, default=32, help="positions compared (>= 30)")
    ap.add_argument("--decode-prompts", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", required=True)
    return ap


def main() -> int:
    ap = arg_parser()
    a = ap.parse_args()
    if a.positions < 30:
        ap.error("--positions must be >= 30")
    commit, dirty = git_commit(a.git_commit)
    probe = runner_config(a, "base")
    dev = torch.device(probe.device)
    R: dict = {"git_commit": commit, "git_dirty": dirty,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
               else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
               "torch": torch.__version__, "model": a.model or "embedded SmolLM2-135M-Instruct",
               "fp8_checkpoint": a.fp8_checkpoint,
               "load_format": a.load_format, "dtype": probe.dtype,
               "kernel_backend": probe.kernel_backend, "fp8_fast_accum": runner_config(a, "fp8-weights").fp8_fast_accum,
               "text": TEXT.name,
               "criterion": f"fp8 perplexity within {PPL_TOLERANCE:.0%} of base",
               "modes": {}, "skipped": {}}
    ids, how = tokens(a)
    R["tokens"] = {"count": len(ids), "how": how}
    positions = [round(i * (len(ids) - 2) / (a.positions - 1)) for i in range(a.positions)]
    cuts = [len(ids) * (i + 1) // (a.decode_prompts + 1) for i in range(a.decode_prompts)]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for mode in a.modes if "base" in a.modes else ["base", *a.modes]:
        try:
            cfg = runner_config(a, mode)
            t0 = time.perf_counter()
            m = Model(cfg, len(ids) + a.decode_tokens + BLOCK)
        except (ValueError, TypeError, KeyError, NotImplementedError) as e:
            if mode == "base":
                raise
            R["skipped"][mode] = f"{type(e).__name__}: {e}"
            print(f"{mode}: skipped ({e})", flush=True)
            continue
        lp = m.prefill_logprobs(ids)
        ppl = perplexity(lp, ids)
        gen = [m.greedy(ids[:c], a.decode_tokens) for c in cuts]
        results[mode] = {"lp": lp, "gen": gen, "ppl": ppl}
        row = {"quantization": cfg.quantization, "kv_cache_dtype": cfg.kv_cache_dtype,
               "calculate_kv_scales": cfg.calculate_kv_scales,
               "weight_bytes": m.weight_bytes, "perplexity": ppl,
               "seconds": round(time.perf_counter() - t0, 1)}
        if mode != "base":
            row.update(compare(results["base"], results[mode], positions, ids))
        R["modes"][mode] = row
        print(mode, json.dumps(row), flush=True)
        del m
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        out.write_text(json.dumps(R, indent=1) + "\n")
    out.write_text(json.dumps(R, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
