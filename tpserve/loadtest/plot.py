"""PNG plots of load-test results, drawn with matplotlib's Agg canvas (no display needed).

matplotlib is a dependency of tpserve, imported here lazily; where it is missing anyway
(a bare install with --no-deps) the plot is skipped with a warning while the JSON result
is still written.

An embeddings result has only the E2E latency histogram, and its lower panel shows the
latency against the input length (there is no output to plot over time); its sweep plot
shows E2E latency against the achieved request throughput.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tpserve.loadtest.report import is_embeddings

HISTOGRAMS = (
    ("ttfts", "TTFT"),
    ("tpots", "TPOT"),
    ("itls", "ITL"),
    ("e2els", "E2E latency"),
)


def write_plot(document: dict, path: Path) -> bool:
    """Draw the result document (one run, or a sweep) to path; False if it was skipped."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"Warning: matplotlib is not installed, so {path} was not drawn "
              "(pip install matplotlib); the JSON result is complete.", file=sys.stderr)
        return False
    if "results" in document:
        figure = _sweep_figure(Figure, document)
    else:
        figure = _run_figure(Figure, document)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return True


def _title(document: dict) -> str:
    parts = [document.get("model") or "?", document.get("endpoint") or "?",
             f"dataset {document.get('dataset')}"]
    if document.get("label"):
        parts.insert(0, document["label"])
    if document.get("interrupted"):
        parts.append("INTERRUPTED (partial)")
    return " | ".join(str(p) for p in parts)


def _run_figure(figure_class, result: dict):
    figure = figure_class(figsize=(14, 8), layout="constrained")
    histograms = [(key, name) for key, name in HISTOGRAMS if key in result]
    grid = figure.add_gridspec(2, len(histograms))
    for i, (key, name) in enumerate(histograms):
        values = result.get(key) or []
        if key == "itls":
            values = [x for request in values for x in request]
        values_ms = np.asarray(values, dtype=float) * 1000.0
        ax = figure.add_subplot(grid[0, i])
        if values_ms.size:
            ax.hist(values_ms, bins=40, color=f"C{i}")
            median, p99 = np.median(values_ms), np.percentile(values_ms, 99)
            ax.axvline(median, color="black", linestyle="--", label=f"median {median:.1f}")
            ax.axvline(p99, color="red", linestyle=":", label=f"p99 {p99:.1f}")
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} ({values_ms.size} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    ax = figure.add_subplot(grid[1, :])
    if is_embeddings(result):
        _latency_by_input_len(ax, result)
    else:
        _output_timeline(ax, result)
    figure.suptitle(_title(result))
    return figure


def _output_timeline(ax, result: dict) -> None:
    timeline = result.get("output_throughput_timeline") or {}
    rates = np.asarray(timeline.get("tokens_per_s") or [], dtype=float)
    width = float(timeline.get("bin_s") or 0.0)
    if rates.size and width > 0:
        times = (np.arange(rates.size) + 0.5) * width
        ax.plot(times, rates, marker=".", color="C4")
        ax.axhline(result["output_throughput"], color="gray", linestyle="--",
                   label=f"mean {result['output_throughput']:.1f} tok/s")
        ax.legend(fontsize="small")
    ax.set_title(f"Output throughput over time ({result['completed']} completed, "
                 f"{result['failed']} failed, rate {result['request_rate']} req/s)")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")


def _latency_by_input_len(ax, result: dict) -> None:
    lens = np.asarray(result.get("input_lens") or [], dtype=float)
    e2els_ms = np.asarray(result.get("e2els") or [], dtype=float) * 1000.0
    if lens.size and lens.size == e2els_ms.size:
        ax.scatter(lens, e2els_ms, s=12, color="C3")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"E2E latency by input length ({result['completed']} completed, "
                 f"{result['failed']} failed, rate {result['request_rate']} req/s)")
    ax.set_xlabel("input tokens")
    ax.set_ylabel("E2E latency (ms)")


def _sweep_figure(figure_class, document: dict):
    results = document["results"]
    figure = figure_class(figsize=(12, 5), layout="constrained")
    if results and is_embeddings(results[0]):
        panels, x_key, x_label = (("e2el", "E2EL"),), "request_throughput", "requests / s"
    else:
        panels = (("ttft", "TTFT"), ("tpot", "TPOT"))
        x_key, x_label = "output_throughput", "output tokens / s"
    throughput = [r[x_key] for r in results]
    for i, (key, name) in enumerate(panels):
        ax = figure.add_subplot(1, len(panels), i + 1)
        ax.plot(throughput, [r[f"median_{key}_ms"] for r in results], marker="o",
                label=f"median {name}")
        if all(f"p99_{key}_ms" in r for r in results):
            ax.plot(throughput, [r[f"p99_{key}_ms"] for r in results], marker="s",
                    linestyle="--", label=f"p99 {name}")
        for x, r in zip(throughput, results, strict=True):
            rate = r["request_rate"]
            ax.annotate(rate if isinstance(rate, str) else f"{rate:g}", (x, r[f"median_{key}_ms"]),
                        textcoords="offset points", xytext=(4, 4), fontsize="small")
        ax.set_title(f"{name} vs achieved throughput (labels: request rate)")
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"{name} (ms)")
        ax.legend(fontsize="small")
    first = results[0] if results else {}
    figure.suptitle(_title({**first, "interrupted": document.get("interrupted")}))
    return figure
