"""Beam search over HTTP (``use_beam_search``): its answers against a beam search over
transformers' logits of the same model, and its time against greedy decoding and against
transformers' own ``generate(num_beams=...)``.

Starts ``python -m tpserve.cli serve`` (the embedded SmolLM2 unless ``--model``), then, one
request at a time, for each prompt: greedy decoding of ``--tokens`` tokens, then beam search
at each ``--widths`` width (``ignore_eos``, so every beam runs the full length and the
times compare). With ``--hf``: the same prompts through ``tests/server/test_beam_search_server
.reference`` (transformers' logits, the same rule; the beams must be equal) and through
transformers' ``generate(num_beams=W, num_return_sequences=W)`` for its time (its early
stopping differs; only its time is compared). Each tpserve request also records the
engine's steps and their host and device-wait time from /metrics. Writes one JSON file.

    python bench/beam_search.py --dtype float32 --hf --git-commit SHA --out beam.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea,",
           "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"]
# PROMPTS as the SmolLM2 tokenizer encodes them (checked with --hf)
PROMPT_IDS = [[504, 3575, 282, 4649, 314], [1604, 3987, 46477, 24, 94, 727],
              [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28],
              [1, 4093, 198, 5820, 1296, 7626, 30, 2, 198, 1, 520, 9531, 198]]


def _complete(http: httpx.Client, prompt: list[int], tokens: int, width: int | None
              ) -> tuple[float, list[list[int]]]:
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if width is not None:
        body.update(n=width, use_beam_search=True)
    t0 = time.perf_counter()
    r = http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return seconds, [c["token_ids"] for c in r.json()["choices"]]


ENGINE_COUNTERS = ("steps_total", "step_host_seconds_total", "device_wait_seconds_total",
                   "prompt_tokens_total", "generation_tokens_total", "prefix_cache_hits_total")


def _counters(http: httpx.Client) -> dict[str, float]:
    """The engine's cumulative counters (summed over replicas) from /metrics."""
    out = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for line in http.get("/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0].removeprefix("tpserve:")
        if not line.startswith("#") and name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _timed(http: httpx.Client, prompt: list[int], tokens: int, width: int | None
           ) -> tuple[float, list[list[int]], dict[str, float]]:
    """``_complete`` and what the engine spent on it: its steps, the host's ms a step
    (scheduling, planning, launching, reading back: not waiting) and the ms a step spent
    waiting for the device."""
    before = _counters(http)
    seconds, tokens_out = _complete(http, prompt, tokens, width)
    after = _counters(http)
    d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
    steps = max(d["steps_total"], 1.0)
    return seconds, tokens_out, {
        "steps": int(d["steps_total"]), "prompt_tokens": int(d["prompt_tokens_total"]),
        "cache_hits": int(d["prefix_cache_hits_total"]),
        "host_ms_per_step": round(1e3 * d["step_host_seconds_total"] / steps, 3),
        "device_wait_ms_per_step": round(1e3 * d["device_wait_seconds_total"] / steps, 3)}


def _serve(args: argparse.Namespace, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tpserve.cli", "serve", *([args.model] if args.model else []),
           "--dtype", args.dtype, "--port", str(args.port), "--served-model-name", "m",
           *shlex.split(args.serve_flags)]
    server = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited {server.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not become healthy in 300 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a path (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve-flags", default="--max-model-len 2048")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hf", action="store_true", help="compare with transformers (SmolLM2)")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--git-commit", default=os.environ.get("TPSERVE_GIT_COMMIT", "?"))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tok = None
    prompts = PROMPT_IDS  # without --hf, no tokenizer (nor the embedded model) is needed
    if args.hf:
        from transformers import AutoTokenizer

        from tpserve.model.loader.checkpoint import embedded_model_path

        gguf = embedded_model_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        prompts = [tok(text).input_ids for text in PROMPTS]
        assert prompts == PROMPT_IDS
    out = Path(args.out)
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": args.git_commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": args.dtype, "tokens": args.tokens,
        "widths": args.widths, "rows": []}
    server = _serve(args, out.with_suffix(".server.log"))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600) as http:
            _complete(http, prompts[0], 4, 2)  # warm-up
            for i, prompt in enumerate(prompts):
                row: dict[str, Any] = {"prompt": i, "prompt_tokens": len(prompt)}
                row["greedy_s"], _, row["greedy_engine"] = _timed(http, prompt, args.tokens,
                                                                  None)
                for width in args.widths:
                    seconds, beams, engine = _timed(http, prompt, args.tokens, width)
                    row[f"beam{width}_s"] = round(seconds, 4)
                    row[f"beam{width}_engine"] = engine
                    row[f"beam{width}_tokens"] = beams
                row["greedy_s"] = round(row["greedy_s"], 4)
                record["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("tokens")}),
                      flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        record["server_rc"] = server.wait(timeout=60)
    if args.hf:
        _hf(record, prompts, args, tok)
    for row in record["rows"]:
        for width in args.widths:
            row.pop(f"beam{width}_tokens", None)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}), flush=True)
    return 0


def _hf(record: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace,
        tok: Any) -> None:
    """transformers' side (module doc): equal beams, and ``generate``'s time."""
    from transformers import AutoModelForCausalLM

    from tests.server.beam_reference import reference
    from tpserve.model.loader.checkpoint import embedded_model_path

    gguf = embedded_model_path()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, args.dtype)).to(device)
    model.eval()

    class OnDevice:  # the reference calls model(ids) with CPU tensors
        def __call__(self, ids):
            return model(ids.to(device))

    equal = total = 0
    for row, prompt in zip(record["rows"], prompts, strict=True):
        for width in args.widths:
            want = [list(t) for t, _, _ in reference(OnDevice(), prompt, width, args.tokens,
                                                     set())]
            got = row[f"beam{width}_tokens"]
            row[f"beam{width}_equal_to_reference"] = got == want
            equal += got == want
            total += 1
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4, num_beams=width, do_sample=False)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                               num_beams=width, num_return_sequences=width, do_sample=False)
                if device == "cuda":
                    torch.cuda.synchronize()
            row[f"hf_beam{width}_s"] = round(time.perf_counter() - t0, 4)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("tokens")}),
              flush=True)
    record["beams_equal_to_reference"] = f"{equal} of {total}"


if __name__ == "__main__":
    raise SystemExit(main())
