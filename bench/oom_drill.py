"""Out-of-memory drill (GPU): a real server, a real co-tenant, a real OOM.

``tpserve serve`` runs the dummy Llama-3-8B eagerly with many sequences per step. A
co-tenant process (``--hog``: this file run as a child) takes nearly all free device memory,
keeps taking whatever the server's allocator gives back, and holds it for ``--hold-s``
seconds; meanwhile a burst of ``--requests`` concurrent completions (temperature 1 with
top-k, top-p and min-p, logprobs) arrives, so the steps grow to ``--max-num-seqs`` sampled
rows.

Why the sampling step is the one that runs out of memory: the start-up profile runs one
forward at ``--max-num-batched-tokens`` and leaves its workspace in the caching allocator,
so the forward of any later step is served from that cache and a co-tenant cannot starve
it. The sampler's filters over ``[rows, vocab]`` float32 logits (sort values and int64
indices, softmax, cumulative sums, masks, the scatter back) need several times the logits
the profile measured; with ``--max-num-seqs 2048`` and a 128k vocabulary that is ~10 GB
against a ~5 GB cache, so the first step that samples most rows must get memory from the
device while the co-tenant holds it: a real ``torch.OutOfMemoryError`` inside sampling,
which the engine must survive (before issue 16 it escaped and failed the engine).

Recorded in the JSON (``--out``): every request's outcome (counts by finish reason or
error), ``/health`` after, ``tpserve:oom_recoveries_total`` (> 0 proves a real OOM, as no
fault hook is set), preemptions, the budget and free-memory series from ``/metrics``
during the run (the budget held while the co-tenant held memory, full again after), the
KV blocks at idle, the server's OOM log lines, and the exit code.

    python3 bench/oom_drill.py --out "$OUT/oom-drill.json" --git-commit SHA
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# ------------------------------------------------------------------------------ co-tenant
def hog(leave: int, hold_s: float) -> None:
    """The co-tenant: fills free device memory down to ``leave`` bytes, reports ``held``
    (one JSON line on stdout), keeps filling for ``hold_s`` seconds (memory the server
    gives back is taken too), then frees everything and reports ``released``."""
    import torch

    held: list[Any] = []

    def fill() -> int:
        took, chunk = 0, 1 << 30
        while chunk >= 2 * MiB:
            free, _ = torch.cuda.mem_get_info()
            size = min(chunk, free - leave)
            if size < 2 * MiB:
                break
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                took += size
            except torch.OutOfMemoryError:
                chunk //= 2
        return took

    t0 = time.monotonic()
    took = fill()
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"event": "held", "bytes": took, "free_after": free, "total": total,
                      "fill_s": round(time.monotonic() - t0, 3)}), flush=True)
    deadline = time.monotonic() + hold_s
    regrabbed = 0
    while time.monotonic() < deadline:
        regrabbed += fill()
        time.sleep(0.02)
    free_before = torch.cuda.mem_get_info()[0]
    held.clear()
    torch.cuda.empty_cache()
    print(json.dumps({"event": "released", "regrabbed_bytes": regrabbed,
                      "free_before_release": free_before,
                      "free_after_release": torch.cuda.mem_get_info()[0]}), flush=True)


# ------------------------------------------------------------------------------ the drill
def metrics(client: httpx.Client, base: str) -> dict[str, float]:
    """``tpserve:`` samples of /metrics (histogram series left out), summed over labels."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in client.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tpserve:") and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name = head.split("{")[0].removeprefix("tpserve:")
            if not name.endswith(("_bucket", "_sum", "_count", "_created")):
                out[name] += float(value)
    return dict(out)


async def one_request(client: httpx.AsyncClient, base: str, body: dict) -> dict[str, Any]:
    try:
        r = await client.post(base + "/v1/completions", json=body, timeout=300)
    except httpx.HTTPError as exc:
        return {"outcome": f"client error: {type(exc).__name__}"}
    if r.status_code != 200:
        return {"outcome": f"http {r.status_code}", "body": r.text[:300]}
    choice = r.json()["choices"][0]
    return {"outcome": f"finish:{choice['finish_reason']}",
            "tokens": r.json()["usage"]["completion_tokens"]}


async def burst(base: str, bodies: list[dict]) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(one_request(client, base, b) for b in bodies))


def watch(base: str, stop: list[bool], series: list[dict[str, Any]], t0: float) -> None:
    """Samples the budget, free memory and counters every 0.25 s until ``stop[0]``."""
    keys = ("step_token_budget", "device_memory_free_bytes", "oom_recoveries_total",
            "num_requests_running", "num_requests_waiting", "num_preemptions_total")
    with httpx.Client() as client:
        while not stop[0]:
            try:
                m = metrics(client, base)
                series.append({"t": round(time.monotonic() - t0, 2),
                               **{k: m.get(k) for k in keys}})
            except httpx.HTTPError:
                pass
            time.sleep(0.25)


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what} not within {timeout} s")


def bodies(rng: random.Random, n: int, args) -> list[dict]:
    extra = ({"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2}
             if args.penalties else {})
    return [{"prompt": [rng.randrange(100, 40000) for _ in range(args.prompt_len)],
             "max_tokens": args.output_len, "ignore_eos": True, "temperature": 1.0,
             "top_k": 50, "top_p": 0.9, "min_p": 0.01, "logprobs": args.logprobs, **extra}
            for _ in range(n)]


def raise_open_files_limit() -> None:
    """Thousands of concurrent connections: lift the soft limit on open files to the hard
    one (the server, started after, inherits it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(args) -> dict[str, Any]:
    import threading

    raise_open_files_limit()

    port = args.port
    base = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "tpserve.cli", "serve", args.model, "--load-format", "dummy",
             "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-queued-requests", str(2 * args.requests),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization),
             "--port", str(port), "--log-level", "info", "--disable-log-requests"]
    if args.cpu:  # a logic check of the drill itself, without a co-tenant
        serve[serve.index("bfloat16")] = "float32"
        serve += ["--device", "cpu", "--kv-cache-memory", "256MiB"]
    R: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                         "git_commit": args.git_commit, "serve_cmd": serve[1:],
                         "config": vars(args), "error": None}
    log_path = Path(args.out).with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
        hog_proc = None
        try:
            client = httpx.Client()

            def healthy() -> bool:
                if server.poll() is not None:
                    raise RuntimeError(f"server exited with {server.returncode}")
                try:
                    return client.get(base + "/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(healthy, 300, "server health")
            R["startup_s"] = round(time.monotonic() - t0, 1)
            warm = asyncio.run(burst(base, bodies(rng, 8, args)))  # small steps, every path
            R["warmup_outcomes"] = collections.Counter(w["outcome"] for w in warm)
            before = metrics(client, base)
            R["metrics_before"] = before
            # the co-tenant takes the device, then the burst arrives
            if not args.cpu:
                hog_proc = subprocess.Popen(
                    [sys.executable, __file__, "--hog", "--leave-mib", str(args.leave_mib),
                     "--hold-s", str(args.hold_s)], stdout=subprocess.PIPE, text=True)
                line = hog_proc.stdout.readline()
                R["hog_held"] = json.loads(line) if line else None
            t_burst = time.monotonic()
            series: list[dict[str, Any]] = []
            stop = [False]
            watcher = threading.Thread(target=watch, args=(base, stop, series, t_burst),
                                       daemon=True)
            watcher.start()
            results = asyncio.run(burst(base, bodies(rng, args.requests, args)))
            R["burst_s"] = round(time.monotonic() - t_burst, 2)
            if hog_proc is not None:
                rest = hog_proc.stdout.read()
                hog_proc.wait(timeout=60)
                R["hog_released"] = (json.loads(rest.strip().splitlines()[-1])
                                     if rest.strip() else None)
            R["outcomes"] = collections.Counter(r["outcome"] for r in results)
            R["full_answers"] = sum(r.get("tokens") == args.output_len for r in results)
            # after the co-tenant left: smaller bursts (the budget grows only at readings
            # taken by steps) until the budget is full again, at most six
            R["after_outcomes"] = collections.Counter()
            for _ in range(6):
                if metrics(client, base).get("step_token_budget") == args.max_num_batched_tokens:
                    break
                again = asyncio.run(burst(base, bodies(rng, args.requests // 8, args)))
                R["after_outcomes"].update(r["outcome"] for r in again)
            stop[0] = True
            watcher.join(timeout=10)
            R["series"] = series

            def idle() -> bool:
                m = metrics(client, base)
                return (m.get("num_requests_running") == 0 and m.get("num_requests_waiting") == 0
                        and m.get("kv_cache_usage_perc") == 0)

            wait_for(idle, 60, "idle with every KV block free")
            after = metrics(client, base)
            R["metrics_after"] = after
            R["health_after"] = client.get(base + "/health", timeout=10).status_code
            R["oom_recoveries"] = after.get("oom_recoveries_total", 0) - before.get(
                "oom_recoveries_total", 0)
            R["step_token_budget_after"] = after.get("step_token_budget")
            R["kv_blocks_free_after"] = after.get("kv_blocks_free")
            R["kv_blocks_total"] = after.get("kv_blocks_total")
            R["min_budget_during_hold"] = min((s["step_token_budget"] for s in series
                                               if s["step_token_budget"] is not None),
                                              default=None)
        except Exception as exc:  # noqa: BLE001 - recorded, the run still writes its JSON
            R["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if hog_proc is not None and hog_proc.poll() is None:
                hog_proc.kill()
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            R["server_rc"] = server.returncode
    text = log_path.read_text(errors="replace")
    R["server_oom_lines"] = [ln for ln in text.splitlines() if "out of device memory" in ln
                             or "budget hold" in ln][:40]
    R["server_log_tail"] = text.splitlines()[-30:]
    n = args.requests
    R["checks"] = {
        "every_request_finished_with_a_full_answer": R.get("full_answers") == n,
        "health_200_after": R.get("health_after") == 200,
        "a_real_oom_was_recovered": (R.get("oom_recoveries") or 0) > 0,
        "kv_blocks_all_free_at_idle": (R.get("kv_blocks_free_after") is not None
                                       and R.get("kv_blocks_free_after")
                                       == R.get("kv_blocks_total")),
        "budget_full_after_the_co_tenant_left": (R.get("step_token_budget_after")
                                                 == args.max_num_batched_tokens),
        "server_exit_0": R.get("server_rc") == 0,
    }
    R["ok"] = R["error"] is None and all(R["checks"].values())
    return R


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="result JSON (the server log goes beside it)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--model", default="llama3-8b",
                   help="dummy shape name, or a folder from bench_http.py prepare")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--max-num-seqs", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--leave-mib", type=int, default=1100,
                   help="free memory the co-tenant leaves (above the engine's 1 GiB floor, "
                        "so the live budget alone does not shrink the steps)")
    p.add_argument("--hold-s", type=float, default=10.0)
    p.add_argument("--penalties", action="store_true",
                   help="repetition/frequency/presence penalties in every request: the "
                        "sampler's [rows, vocab] occurrence counts, beyond the profiled step")
    p.add_argument("--logprobs", type=int, default=2, help="top logprobs per token")
    p.add_argument("--hog", action="store_true", help="(internal) be the co-tenant")
    p.add_argument("--cpu", action="store_true",
                   help="logic check on CPU: no co-tenant, so no OOM is expected")
    args = p.parse_args()
    if args.hog:
        hog(args.leave_mib * MiB, args.hold_s)
        return
    if not args.out:
        p.error("--out is required")
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    R = run(args)
    Path(args.out).write_text(json.dumps(R, indent=1, default=str) + "\n")
    print(json.dumps({k: R.get(k) for k in ("ok", "error", "checks", "outcomes",
                                            "oom_recoveries", "min_budget_during_hold",
                                            "step_token_budget_after", "burst_s")},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
