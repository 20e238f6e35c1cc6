"""Human-readable summary tables and the JSON result file.

An embeddings result (``"endpoint": "embeddings"``) is shown as vLLM shows a pooling one:
input tokens and throughputs, then the end-to-end latency; no generated tokens, TTFT, TPOT
or ITL.
"""

from __future__ import annotations

import json
from pathlib import Path

from tpserve.loadtest.metrics import percentile_key

WIDTH = 50
MAX_ERRORS_SHOWN = 5
SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_summary(result: dict, percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
                   percentiles: tuple[float, ...] = (99.0,)) -> str:
    """The summary table of one run, in the layout of vLLM's ``bench serve``: one section
    per chosen metric with its mean, median and chosen percentiles."""
    lines = [_rule(" Load Test Result ", "=")]
    if result.get("label"):
        lines.append(_row("Label:", result["label"]))
    lines += [
        _row("Request rate (req/s):", result["request_rate"]),
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
    ]
    if result["interrupted"]:
        lines += [
            _row("Interrupted:", "yes"),
            _row("Cancelled in flight:", result["cancelled"]),
            _row("Not sent:", result["not_sent"]),
        ]
    lines.append(_row("Benchmark duration (s):", f"{result['duration']:.2f}"))
    lines += _embeddings_rows(result) if is_embeddings(result) else _generation_rows(result)
    if result.get("request_goodput") is not None:
        at = next(i for i, line in enumerate(lines) if line.startswith("Request throughput"))
        lines.insert(at + 1, _row("Request goodput (req/s):",
                                  f"{result['request_goodput']:.2f}"))
    for key, short, title in SECTIONS:
        if key not in percentile_metrics or f"mean_{key}_ms" not in result:
            continue
        lines.append(_rule(title, "-"))
        for stat, name in (("mean", "Mean"), ("median", "Median")):
            lines.append(_row(f"{name} {short} (ms):", f"{result[f'{stat}_{key}_ms']:.2f}"))
        for p in percentiles:
            lines.append(_row(f"P{p:g} {short} (ms):",
                              f"{result[percentile_key(key, p)]:.2f}"))
    lines.append("=" * WIDTH)
    errors = result["errors"]
    if errors:
        lines.append("Errors (count: message):")
        lines += [f"  {e['count']}: {e['message']}" for e in errors[:MAX_ERRORS_SHOWN]]
        if len(errors) > MAX_ERRORS_SHOWN:
            lines.append(f"  ... and {len(errors) - MAX_ERRORS_SHOWN} other messages")
    if result.get("requests_without_usage"):
        lines.append(f"Warning: {result['requests_without_usage']} responses had no usage; "
                     "their output tokens were counted as chunks, their input tokens "
                     "as the prompts' known lengths")
    return "\n".join(lines)


def is_embeddings(result: dict) -> bool:
    """Whether result is of an --endpoint embeddings run."""
    return result.get("endpoint") == "embeddings"


def _generation_rows(result: dict) -> list[str]:
    return [
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        _row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        _row("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]


def _embeddings_rows(result: dict) -> list[str]:
    return [
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Mean input tokens:", f"{result['mean_input_tokens']:.2f}"),
        _row("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        _row("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]


def format_sweep(results: list[dict]) -> str:
    """One line per rate: throughput against median and p99 TTFT and TPOT ("-" where
    p99 was not asked for); for embeddings, against median and p99 E2EL."""
    if results and is_embeddings(results[0]):
        header = (f"{'rate':>8} {'req/s':>8} {'in tok/s':>10} {'E2EL p50':>9} "
                  f"{'E2EL p99':>9} {'failed':>7}")
        return _sweep_table(results, header, lambda r: (
            f"{r['total_token_throughput']:>10.1f} {r['median_e2el_ms']:>9.1f} "
            f"{_maybe(r.get('p99_e2el_ms'), '.1f'):>9}"))
    header = (f"{'rate':>8} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'failed':>7}")
    return _sweep_table(results, header, lambda r: (
        f"{r['output_throughput']:>10.1f} "
        f"{r['median_ttft_ms']:>9.1f} {_maybe(r.get('p99_ttft_ms'), '.1f'):>9} "
        f"{r['median_tpot_ms']:>9.2f} {_maybe(r.get('p99_tpot_ms'), '.2f'):>9}"))


def _sweep_table(results: list[dict], header: str, middle) -> str:
    """The sweep's lines: a rate, its request throughput, ``middle(result)``'s columns,
    its failures."""
    width = len(header)
    lines = [" Sweep (latencies in ms) ".center(width, "="), header]
    for r in results:
        rate = r["request_rate"]
        rate_text = rate if isinstance(rate, str) else f"{rate:g}"
        lines.append(f"{rate_text:>8} {r['request_throughput']:>8.2f} {middle(r)} "
                     f"{r['failed']:>7}")
    lines.append("=" * width)
    return "\n".join(lines)


def write_json(path: Path, document: dict) -> None:
    """Write document as strict JSON (no NaN/Infinity), creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _maybe(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rule(title: str, fill: str) -> str:
    return title.center(WIDTH, fill)


def _row(name: str, value: object) -> str:
    return f"{name:<40}{value!s}"
