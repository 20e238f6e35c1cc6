"""When each request of a run is sent: gamma-distributed inter-arrival times."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times of n requests in seconds after the run's start (the first at 0).

    Gaps are drawn from a gamma distribution with shape ``burstiness`` and mean
    ``1/rate``: burstiness 1 gives a Poisson process, smaller values burstier traffic,
    larger values more regular traffic. An infinite rate sends everything at once.
    """
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
