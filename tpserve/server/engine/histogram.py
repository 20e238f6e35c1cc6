"""Engine-side histograms that travel in the flat ``stats()`` dict (floats only, so the
dict pickles over the engine process's pipe as it is) and become Prometheus histograms
at scrape time.

A histogram named ``h`` with bounds ``b0 < b1 < ...`` puts ``h:count``, ``h:sum`` and,
for each bound ``i``, ``h:le:i`` = the number of observations <= ``b_i`` (cumulative, as
Prometheus buckets) into the dict; observations above the last bound count only in
``h:count`` (the ``+Inf`` bucket).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

# vLLM's request_latency_buckets (queue, prefill, decode times)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# stats() histogram name -> (bounds, help text); exported under the tpserve: prefix
ENGINE_HISTOGRAMS = {
    "request_queue_time_seconds": (
        REQUEST_TIME_BUCKETS, "Seconds a request waited from arrival to first scheduled."),
    "request_prefill_time_seconds": (
        REQUEST_TIME_BUCKETS, "Seconds from a request's first scheduling to its first token."),
    "request_decode_time_seconds": (
        REQUEST_TIME_BUCKETS, "Seconds from a request's first token to its finish."),
    "iteration_tokens_total": (
        ITERATION_TOKEN_BUCKETS, "Tokens (prefill and decode) computed per engine step."),
}


class EngineHistogram:
    """Cumulative bucket counts, sum and count of one engine-side histogram."""

    def __init__(self, name: str, bounds: tuple[float, ...]):
        self.name = name
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.bounds):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def export(self) -> dict[str, float]:
        out = {f"{self.name}:count": self.count, f"{self.name}:sum": self.sum}
        running = 0
        for i, c in enumerate(self.counts):
            running += c
            out[f"{self.name}:le:{i}"] = running
        return out


def engine_histograms() -> dict[str, EngineHistogram]:
    """One empty histogram per ENGINE_HISTOGRAMS entry."""
    return {name: EngineHistogram(name, bounds)
            for name, (bounds, _) in ENGINE_HISTOGRAMS.items()}


def read_histogram(values: Mapping[str, float], name: str
                   ) -> tuple[list[tuple[str, float]], float] | None:
    """(Prometheus buckets [(le, cumulative count)...] ending with +Inf, sum) of ``name``
    in a stats dict, or None when the dict does not hold it."""
    if f"{name}:count" not in values:
        return None
    bounds, _ = ENGINE_HISTOGRAMS[name]
    buckets = [(_le(b), float(values[f"{name}:le:{i}"])) for i, b in enumerate(bounds)]
    buckets.append(("+Inf", float(values[f"{name}:count"])))
    return buckets, float(values[f"{name}:sum"])


def _le(bound: float) -> str:
    return repr(float(bound))
