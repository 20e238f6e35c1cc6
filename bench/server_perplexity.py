"""FP8 accuracy through the server: the perplexity of the shipped public-domain text
(``tests/data/pride_and_prejudice_ch1.txt``) as a client measures it, with the completions
API's ``echo`` (``logprobs: 0``, ``max_tokens: 0``: every prompt token scored by the
model), for each mode's ``tpserve serve`` started here in turn: ``base`` (no flags),
``fp8-weights`` (``--quantization fp8``), ``fp8-kv`` (``--kv-cache-dtype fp8``) and
``both``. The same figures ``fp8_accuracy.py`` gets from the model directly; this is the
check a user can run against any server (lm-eval's perplexity tasks send the same request).

    python bench/server_perplexity.py --out bench/results/cpu-DATE-server-perplexity.json
    python bench/server_perplexity.py MODEL --modes base both --server-arg=--dtype=bfloat16 ...

Writes one JSON: per mode the perplexity, its ratio to base and the per-token logprob
differences against base (mean and max |difference|), with the commit and device.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import git_commit  # noqa: E402  (bench/measure.py)

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "pride_and_prejudice_ch1.txt"
MODES = {"base": [], "fp8-weights": ["--quantization", "fp8"],
         "fp8-kv": ["--kv-cache-dtype", "fp8"],
         "both": ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]}
PPL_TOLERANCE = 0.02
START_TIMEOUT_S = 600.0
SCORE_TIMEOUT_S = 1800.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str | None, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Starts ``tpserve serve`` and waits (at most START_TIMEOUT_S) until /health is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "tpserve.cli", "serve", *([model] if model else []),
           "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise TimeoutError(f"no healthy server after {START_TIMEOUT_S:.0f} s: see {log}")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=30)


def score(base: str, max_tokens: int) -> tuple[list[int], list[float]]:
    """The text's first ``max_tokens`` tokens (the server's tokenizer) and the logprob of
    each after the first, from one echo request."""
    with httpx.Client(base_url=base, timeout=SCORE_TIMEOUT_S) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        ids = http.post("/tokenize", json={"model": model, "prompt": TEXT.read_text()}
                        ).json()["tokens"]
        while len(ids) < max_tokens:  # the text again, for long prompts
            ids = ids + ids
        ids = ids[:max_tokens]
        r = http.post("/v1/completions", json={"model": model, "prompt": ids, "echo": True,
                                               "logprobs": 0, "max_tokens": 0,
                                               "temperature": 0})
        r.raise_for_status()
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    if lps[0] is not None or len(lps) != len(ids):
        raise RuntimeError(f"unexpected echo logprobs: {len(lps)} for {len(ids)} tokens")
    return ids, lps[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--max-tokens", type=int, default=1024, help="tokens of text scored")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more flag for every server (repeat it)")
    ap.add_argument("--logs", default=None, help="folder for the servers' logs (default: "
                                                  "beside --out)")
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    logs = Path(a.logs) if a.logs else out.parent
    logs.mkdir(parents=True, exist_ok=True)
    modes: dict[str, dict] = {}
    scored: dict[str, list[float]] = {}
    ids: list[int] = []
    for mode in a.modes:
        flags = [*MODES[mode], *a.server_arg]
        log = logs / f"{out.stem}-{mode}.log"
        t0 = time.monotonic()
        proc, base = serve(a.model, flags, log)
        try:
            ids, lps = score(base, a.max_tokens)
        finally:
            code = stop(proc)
        scored[mode] = lps
        ppl = math.exp(-sum(lps) / len(lps))
        modes[mode] = {"flags": flags, "perplexity": ppl, "server_exit": code,
                       "seconds": round(time.monotonic() - t0, 1)}
        print(f"{mode}: perplexity {ppl:.4f} ({len(lps)} tokens scored)", flush=True)
    if "base" in scored:
        for mode, entry in modes.items():
            diffs = [abs(x - y) for x, y in zip(scored[mode], scored["base"], strict=True)]
            ratio = entry["perplexity"] / modes["base"]["perplexity"]
            entry.update(ppl_ratio=ratio, ppl_within_2pct=abs(ratio - 1) <= PPL_TOLERANCE,
                         logprob_abs_diff={"mean": sum(diffs) / len(diffs), "max": max(diffs)})
    sha, dirty = git_commit(a.git_commit)
    doc = {"git_commit": sha, "git_dirty": dirty,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": f"{platform.machine()} host, servers as started (see flags)",
           "model": a.model or "embedded SmolLM2-135M-Instruct", "text": TEXT.name,
           "tokens_scored": len(ids) - 1, "how": "completions echo, logprobs 0, max_tokens 0",
           "criterion": "fp8 perplexity within 2% of base", "modes": modes}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({m: {k: v for k, v in e.items() if k != "flags"}
                      for m, e in modes.items()}, indent=1))


if __name__ == "__main__":
    main()
