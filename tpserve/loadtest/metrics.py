"""From a RunRecord to the result dictionary, with vLLM ``bench serve`` key names.

Only successful requests enter the token totals and latency statistics; failed ones
are counted and their messages tallied in ``errors``. Statistics of an empty set are
0.0. Mean, median and std are given for every latency; ``p{N}_{metric}_ms`` only for
the chosen metrics and percentiles (vLLM's ``--percentile-metrics`` and
``--metric-percentiles``). Per-request lists (seconds) are kept so that plots can be redrawn from the JSON.

``request_goodput`` (vLLM's key) is the successful requests per second that met every
``--goodput`` objective (TTFT, TPOT, E2E latency, in ms; a request with fewer than two
output tokens has a TPOT of 0 there, as in vLLM); None when no objective was given.

An embeddings run (``summarize_embeddings``) has the keys of vLLM's pooling result: no
output tokens, TTFT, TPOT or ITL, only input tokens and the end-to-end latency.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from tpserve.loadtest.goodput import meets
from tpserve.loadtest.runner import RunRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")
TIMELINE_BINS = 60


def percentile_key(metric: str, percentile: float) -> str:
    """vLLM's key: p99_ttft_ms, p99.9_ttft_ms."""
    return f"p{percentile:g}_{metric}_ms"


def summarize(
    record: RunRecord,
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
    percentiles: tuple[float, ...] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> dict:
    """The measured metrics of one run (parameters are added by the caller)."""
    ok = [r for r in record.results if r.success]
    duration = record.duration
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out = {
        **_counts(record),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": _per_second(len(ok), duration),
        "request_goodput": _goodput(ok, goodput, duration),
        "output_throughput": _per_second(total_out, duration),
        "total_token_throughput": _per_second(total_in + total_out, duration),
    }
    for name in LATENCIES:
        out |= _latency_stats(name, samples[name],
                              percentiles if name in percentile_metrics else ())
    out["errors"] = _errors(record)
    out["requests_without_usage"] = sum(1 for r in ok if not r.usage_reported)
    out["output_throughput_timeline"] = output_timeline(record)
    out["input_lens"] = [r.prompt_tokens for r in ok]
    out["target_input_lens"] = [r.target_input_len for r in ok]
    out["output_lens"] = [r.output_tokens for r in ok]
    out["ttfts"] = samples["ttft"]
    out["tpots"] = samples["tpot"]
    out["e2els"] = samples["e2el"]
    out["itls"] = [list(r.itl) for r in ok]
    return out


def summarize_embeddings(record: RunRecord, percentiles: tuple[float, ...] = (99.0,),
                         goodput: dict[str, float] | None = None) -> dict:
    """The measured metrics of one embeddings run: counts, input tokens (total, mean, per
    second as vLLM's ``total_token_throughput``), request throughput and the end-to-end
    latency with its ``p{N}_e2el_ms``; per-request input lengths and latencies."""
    ok = [r for r in record.results if r.success]
    duration = record.duration
    total_in = sum(r.prompt_tokens for r in ok)
    return {
        **_counts(record),
        "total_input_tokens": total_in,
        "mean_input_tokens": total_in / len(ok) if ok else 0.0,
        "request_throughput": _per_second(len(ok), duration),
        "request_goodput": _goodput(ok, goodput, duration),
        "total_token_throughput": _per_second(total_in, duration),
        **_latency_stats("e2el", [r.latency for r in ok], percentiles),
        "errors": _errors(record),
        "input_lens": [r.prompt_tokens for r in ok],
        "target_input_lens": [r.target_input_len for r in ok],
        "e2els": [r.latency for r in ok],
    }


def _goodput(ok: list, slos: dict[str, float] | None, duration: float) -> float | None:
    """Requests per second of ok that met every objective of slos (ms); None without."""
    if slos is None:
        return None
    return _per_second(sum(1 for r in ok if meets(r, slos)), duration)


def _counts(record: RunRecord) -> dict:
    completed = sum(1 for r in record.results if r.success)
    return {
        "request_rate": _json_rate(record.request_rate),
        "interrupted": record.interrupted,
        "completed": completed,
        "failed": len(record.results) - completed,
        "cancelled": record.cancelled,
        "not_sent": record.not_sent,
        "duration": record.duration,
    }


def _latency_stats(name: str, samples_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """mean, median, std and the given percentiles of samples_s, in milliseconds."""
    values_ms = np.asarray(samples_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": _stat(np.mean, values_ms),
           f"median_{name}_ms": _stat(np.median, values_ms),
           f"std_{name}_ms": _stat(np.std, values_ms)}
    for p in percentiles:
        out[percentile_key(name, p)] = _stat(lambda v, p=p: np.percentile(v, p), values_ms)
    return out


def _errors(record: RunRecord) -> list[dict]:
    """The failed requests' messages with their counts, most frequent first."""
    failed = Counter(r.error for r in record.results if not r.success)
    return [{"message": message, "count": count} for message, count in failed.most_common()]


def output_timeline(record: RunRecord) -> dict:
    """Output tokens per second over the run, in TIMELINE_BINS equal bins.

    A request's usage count is spread evenly over its timed chunks, so chunks that
    carry several tokens are still counted right in total.
    """
    width = max(record.duration, 1e-9) / TIMELINE_BINS
    tokens = np.zeros(TIMELINE_BINS)
    for r in record.results:
        if r.success and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            bins = np.minimum((np.asarray(r.chunk_times) / width).astype(int), TIMELINE_BINS - 1)
            np.add.at(tokens, bins, per_chunk)
    return {"bin_s": width, "tokens_per_s": (tokens / width).tolist()}


def _per_second(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def _stat(fn, values: np.ndarray) -> float:
    return float(fn(values)) if values.size else 0.0


def _json_rate(rate: float) -> float | str:
    """JSON has no infinity: an unlimited rate is written "inf", as vLLM does."""
    return "inf" if math.isinf(rate) else rate
