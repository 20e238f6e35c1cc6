"""Speculative decoding by prompt lookup (``--speculative-config`` method "ngram") measured
against the same engine without it: one runner, one engine per mode, the same prompts.

For each workload and concurrency it records output tokens per second, steps, the drafts
and kept draft tokens, and how many requests' greedy tokens equal the run without
speculation (in float32 they must all; in bf16 a verification chunk and a decode compute a
position with different kernels, so random weights' near-ties may flip).

Workloads of a dummy shape (random token ids; the dummy model copies nothing, so what the
drafts find is whatever its own outputs repeat):
- ``random``: random prompts;
- ``repeat``: a random 32-token segment repeated to the prompt length.
Workloads of a real model (``--model PATH`` or ``embedded``: SmolLM2), chat prompts over
paragraphs of the text shipped with the tests (``tests/data/pride_and_prejudice_ch1.txt``):
- ``copy``: "Repeat the following passage word for word" (output quotes the input);
- ``answer``: a question about the passage (output in the model's own words).

    python bench/spec_decode.py --model llama3-8b --dtype bfloat16 --out RESULT.json
    python bench/spec_decode.py --model embedded --device cpu --dtype float32 --out R.json
    python bench/spec_decode.py --small --device cpu --out /tmp/s.json   # logic check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_sections import StubTokenizer, run_closed_loop  # noqa: E402
from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.loader.checkpoint import embedded_model_path, open_checkpoint  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.engine.speculative import SpeculativeConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b",
                   help="a dummy shape, or a checkpoint (folder, .gguf; embedded: SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--small", action="store_true", help="SmolLM2's shape, few tokens")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"))
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    return p.parse_args()


TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "pride_and_prejudice_ch1.txt"
ASK = {"copy": "Repeat the following passage word for word.\n\n{}",
       "answer": "Read the passage, then say in two sentences what it tells about the "
                 "characters.\n\n{}"}


def text_prompts(tokenizer, workload: str, count: int) -> list[list[int]]:
    """Chat prompts over the shipped text's paragraphs of 40-120 words, one per request."""
    paragraphs = [p.strip().replace("\n", " ") for p in TEXT.read_text().split("\n\n")]
    chosen = [p for p in paragraphs if 40 <= len(p.split()) <= 120][:count]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": ASK[workload].format(p)}],
                                           add_generation_prompt=True, tokenize=False)
             for p in chosen]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def prompts_for(workload: str, count: int, length: int, vocab: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if workload == "random":
            out.append([rng.randrange(vocab) for _ in range(length)])
        else:
            seg = [rng.randrange(vocab) for _ in range(32)]
            out.append((seg * (length // 32 + 1))[:length])
    return out


def run(core: EngineCore, prompts, output_len: int, concurrency: int, eos: bool = False):
    """``engine_sections.run_closed_loop`` at ``concurrency``, greedy, ``output_len`` tokens
    (``eos``: or up to EOS): (tokens per request in prompt order, wall seconds, steps)."""
    done, wall, steps = run_closed_loop(core, prompts, output_len, concurrency, None, None,
                                        "spec", ignore_eos=not eos)
    tokens = {int(tr.rid.rsplit("-", 1)[1]): tr.tokens for tr in done}
    return [tokens[i] for i in range(len(prompts))], wall, steps


def main() -> int:
    a = parse_args()
    if a.small:
        a.model, a.input_len, a.output_len, a.requests = "smollm2-135m", 64, 16, 4
    device = torch.device(a.device)
    real = a.model == "embedded" or Path(a.model).exists()
    if a.model == "embedded":
        a.model = str(embedded_model_path())
    argv = ["serve", a.model, "--load-format", "auto" if real else "dummy", "--dtype",
            a.dtype, "--device", device.type,
            "--max-model-len", str(a.input_len + a.output_len + 64),
            "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]
    if device.type == "cpu":
        argv += ["--kv-cache-memory", "256MiB"]
    parser, _ = build_parser()
    cfg = config_from_args(parser.parse_args(argv))
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, TPGroup(0, 1, device, None))
    spec = SpeculativeConfig(num_speculative_tokens=a.k, prompt_lookup_min=a.lookup[0],
                             prompt_lookup_max=a.lookup[1])
    tokenizer = open_checkpoint(a.model).tokenizer() if real else StubTokenizer()

    def core(mode: str) -> EngineCore:
        """A fresh engine on the shared runner: its own block manager, so no prefix-cache
        hit can name blocks another engine has written since."""
        return EngineCore(runner, tokenizer, cfg.scheduler, dataclasses.replace(
            cfg.engine, speculative=spec if mode == "ngram" else None))

    vocab = runner.model_config.vocab_size
    commit = a.git_commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True).stdout.strip()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    R = {"commit": commit, "device": device_name, "model": a.model, "dtype": a.dtype,
         "speculative": dataclasses.asdict(spec), "input_len": a.input_len,
         "output_len": a.output_len, "requests": a.requests, "runs": []}
    for mode in ("plain", "ngram"):  # warm-up: every kernel and step shape once
        run(core(mode), prompts_for("repeat", 2, a.input_len, vocab, 99), 16, 2)
    for workload in ("copy", "answer") if real else ("random", "repeat"):
        prompts = text_prompts(tokenizer, workload, a.requests) if real else \
            prompts_for(workload, a.requests, a.input_len, vocab, 0)
        for conc in a.concurrency:
            plain_tokens = None
            for mode in ("plain", "ngram"):
                engine = core(mode)
                tokens, wall, steps = run(engine, prompts, a.output_len, conc, real)
                c = {k: v for k, v in engine.counters.items() if k.startswith("spec_decode")}
                out = sum(map(len, tokens))
                row = {"workload": workload, "concurrency": conc, "mode": mode,
                       "out_tok_s": round(out / wall, 1), "wall_s": round(wall, 3),
                       "steps": steps, "tokens_per_step": round(out / steps, 3), **c}
                if plain_tokens is None:
                    plain_tokens = tokens
                else:
                    row["requests_equal_to_plain"] = sum(
                        x == y for x, y in zip(tokens, plain_tokens, strict=True))
                    drafted = c["spec_decode_num_draft_tokens_total"]
                    kept = c["spec_decode_num_accepted_tokens_total"]
                    row["acceptance"] = round(kept / drafted, 3) if drafted else None
                R["runs"].append(row)
                print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(R, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
