"""vLLM's goodput in the load test: ``--goodput KEY:VALUE ...`` service level objectives
(milliseconds of TTFT, TPOT, end-to-end latency) and whether a request met them all (a
request of fewer than two output tokens has a TPOT of 0 there, as in vLLM)."""

from __future__ import annotations

import math
from typing import Any

# --goodput's SLO names (vLLM's): milliseconds of TTFT, TPOT, end-to-end latency
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None, embeddings: bool) -> dict[str, float] | None:
    """--goodput KEY:VALUE ... as {metric: milliseconds} (None: no flag); ValueError when
    malformed, or an objective other than e2el with ``embeddings``."""
    if items is None:
        return None
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: expected KEY:VALUE with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not (ms >= 0 and math.isfinite(ms)):
            raise ValueError(f"--goodput {item!r}: the value must be a number of "
                             "milliseconds, 0 or more")
        slos[key] = ms
    if embeddings and set(slos) - {"e2el"}:
        raise ValueError("--goodput can only set e2el with --endpoint embeddings")
    return slos


def meets(result: Any, slos: dict[str, float]) -> bool:
    """Whether a successful request's result met every objective of ``slos`` (ms)."""
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos.items())
