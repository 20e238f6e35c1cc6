"""Fetch ``/memory`` and print it: one row per plan component, one column per rank, then
the allocator's live figures and the plan's disagreement with them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from tpserve.loadtest.memory.plot import write_memory_plot

GiB = 1 << 30
# the plan's lines in stacking order (the server's ``COMPONENTS``)
PLAN_ROWS = ("weights", "activation_workspace", "cuda_graphs", "kv_pool", "non_torch",
             "other_processes", "free")
LIVE_ROWS = ("allocated", "reserved")
SNAPSHOT_EXTRA_S = 60.0  # the server waits up to 60 s for the engine's snapshot


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server to read /memory from")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--png", type=Path, default=Path("memory.png"),
                   help="where to draw the stacked split per rank and KV usage and "
                        "fragmentation over time")
    p.add_argument("--json", type=Path, default=None,
                   help="also save the /memory document here")
    p.add_argument("--snapshot", type=Path, default=None, metavar="FILE",
                   help="instead of the table and plot: save rank 0's allocator snapshot "
                        "(GET /memory/snapshot; the server needs --memory-history) to FILE, "
                        "the pickle https://pytorch.org/memory_viz opens")
    p.add_argument("--replica", type=int, default=0,
                   help="with --snapshot: the data-parallel replica whose rank 0 is read")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="HTTP timeout in seconds (a snapshot may take up to 60 s more)")


def fetch_report(base_url: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/memory", headers=headers, timeout=timeout)
    r.raise_for_status()
    return r.json()


def fetch_snapshot(base_url: str, api_key: str | None, timeout: float,
                   replica: int = 0) -> bytes:
    """``/memory/snapshot``'s bytes (of data-parallel replica ``replica``); RuntimeError
    with the server's message on an error."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/memory/snapshot", headers=headers,
                  params={"replica": replica} if replica else None,
                  timeout=timeout + SNAPSHOT_EXTRA_S)
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise RuntimeError(f"HTTP {r.status_code}: {message}")
    return r.content


def format_table(report: dict[str, Any]) -> str:
    """The report as text: GiB per component and rank, allocator figures, fragmentation."""
    ranks = report["ranks"]
    head = f"{'':<22}" + "".join(f"{'rank ' + str(r['rank']):>12}" for r in ranks)
    lines = [f"memory on {report['device']} (tp {report['tp']}), GiB", head]

    def row(name: str, values: list[float], fmt: str = "{:>12.2f}") -> None:
        lines.append(f"{name:<22}" + "".join(fmt.format(v) for v in values))

    for key in PLAN_ROWS:
        row(key.replace("_", " "), [r["plan"][key] / GiB for r in ranks])
    row("total", [r["plan"]["total"] / GiB for r in ranks])
    row("plan (held)", [r["plan"]["held"] / GiB for r in ranks])
    lines.append("allocator now")
    for key in LIVE_ROWS:
        row("  " + key, [r["allocator"][key] / GiB for r in ranks])
    row("  fragmentation %", [100 * r["allocator"]["fragmentation"] for r in ranks],
        "{:>12.1f}")
    row("  alloc retries", [r["allocator"]["num_alloc_retries"] for r in ranks], "{:>12.0f}")
    row("  OOMs", [r["allocator"]["num_ooms"] for r in ranks], "{:>12.0f}")
    if all(r["plan_disagreement"] is not None for r in ranks):
        row("  reserved vs plan %", [100 * r["plan_disagreement"] for r in ranks],
            "{:>+12.1f}")
    row("  read seconds ago", [r["age_s"] for r in ranks], "{:>12.1f}")
    host = report.get("host_tier")
    if host:
        lines.append(f"host tier of the prefix cache: {host['bytes'] / GiB:.2f} GiB a rank "
                     f"({host['blocks']} blocks, {host['tokens']} tokens"
                     f"{', pinned' if host['pinned'] else ''})")
    streamed = report.get("weights_offloaded")  # --cpu-offload-gb; absent: older servers
    if streamed:
        first, last = streamed["layers"]
        lines.append(f"weights offloaded to host memory: {streamed['host_bytes'] / GiB:.2f} "
                     f"GiB a rank, decoder layers {first}-{last} streamed through "
                     f"{streamed['slots']} device slots of {streamed['slot_bytes'] / GiB:.3f} "
                     f"GiB{', pinned' if streamed['pinned'] else ''}")
    sleep = report.get("sleep")  # sleep mode (--enable-sleep-mode); absent: older servers
    if sleep and sleep["state"] != "awake":
        asleep = [name for name, key in (("weights", "weights_asleep"),
                                         ("KV cache", "kv_cache_asleep")) if sleep[key]]
        lines.append(f"asleep at level {sleep['level']} ({sleep['state']}): "
                     f"{' and '.join(asleep) or 'nothing'} given back"
                     + (f"; weights held in host memory: "
                        f"{sleep['host_copy_bytes'] / GiB:.2f} GiB a rank"
                        if sleep["host_copy_bytes"] else ""))
    h = report["history"]
    if h["time"]:
        span = h["time"][-1] - h["time"][0]
        lines.append(f"history: {len(h['time'])} samples over {span:.0f} s; KV usage now "
                     f"{100 * h['kv_usage'][-1]:.1f} % (peak {100 * max(h['kv_usage']):.1f} %)")
    return "\n".join(lines)


def memory_main(args: argparse.Namespace) -> int:
    if args.snapshot is not None:
        try:
            data = fetch_snapshot(args.base_url, args.api_key, args.timeout, args.replica)
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"tpserve memory: cannot read {args.base_url}/memory/snapshot: {e}",
                  file=sys.stderr)
            return 1
        args.snapshot.write_bytes(data)
        print(f"snapshot: {args.snapshot} ({len(data)} bytes); open it at "
              "https://pytorch.org/memory_viz")
        return 0
    try:
        report = fetch_report(args.base_url, args.api_key, args.timeout)
    except httpx.HTTPError as e:
        print(f"tpserve memory: cannot read {args.base_url}/memory: {e}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if write_memory_plot(report, args.png):
        print(f"plot: {args.png}")
    return 0
