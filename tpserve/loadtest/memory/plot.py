"""The memory report as a PNG (matplotlib's Agg canvas): the plan's split per rank as a
stacked bar, and KV usage and fragmentation over the recent history."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

GiB = 1 << 30
STACK = ("weights", "activation_workspace", "cuda_graphs", "kv_pool", "non_torch",
         "other_processes", "free")
COLOURS = ("#4c72b0", "#dd8452", "#8172b3", "#55a868", "#937860", "#c44e52", "#dddddd")


def write_memory_plot(report: dict[str, Any], path: Path) -> bool:
    """Draws ``report`` to ``path``; False (with a warning) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"Warning: matplotlib is not installed, so {path} was not drawn",
              file=sys.stderr)
        return False
    fig = Figure(figsize=(12, 5), layout="constrained")
    bars, over_time = fig.subplots(1, 2, width_ratios=(1, 2))
    ranks = report["ranks"]
    x = [f"rank {r['rank']}" for r in ranks]
    bottom = [0.0] * len(ranks)
    for key, colour in zip(STACK, COLOURS, strict=False):
        height = [r["plan"][key] / GiB for r in ranks]
        bars.bar(x, height, bottom=bottom, color=colour, label=key.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, height, strict=False)]
    reserved = [r["allocator"]["reserved"] / GiB for r in ranks]
    if any(reserved):
        bars.scatter(x, reserved, marker="_", s=900, color="black", zorder=3,
                     label="allocator reserved now")
    bars.set_ylabel("GiB")
    bars.set_title(f"memory split on {report['device']}")
    # beside the bars, not over them: the KV pool fills most of the height
    handles, labels = bars.get_legend_handles_labels()
    bars.legend(handles[::-1], labels[::-1], fontsize="small", loc="upper left",
                bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    h = report["history"]
    t0 = h["time"][-1] if h["time"] else 0.0
    t = [v - t0 for v in h["time"]]
    over_time.plot(t, [100 * v for v in h["kv_usage"]], label="KV cache usage %")
    over_time.plot(t, [100 * v for v in h["fragmentation"]], label="fragmentation % (rank 0)")
    over_time.set_xlabel("seconds (0 = latest sample)")
    over_time.set_ylabel("%")
    over_time.set_ylim(0, 100)
    over_time.set_title("KV usage and allocator fragmentation")
    over_time.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True
