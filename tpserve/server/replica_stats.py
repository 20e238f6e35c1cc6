"""One engine's view of several replicas' statistics (``--data-parallel-size``).

``merge_stats`` folds the replicas' ``stats()`` dicts into one of the same shape, so
``/metrics``, the stats log line and ``/memory`` read a data-parallel server as one
engine: counters, gauges and histogram buckets are summed (their sums are what a
Prometheus query over vLLM's per-engine series computes), the KV cache usage is recomputed
from the summed blocks, the per-position speculative counts are summed by position, and
the LoRA request lists are united. ``merge_memory`` keeps every rank's line of every
replica, renumbered ``replica x tp + rank`` (the rank's GPU, in the order of
``CUDA_VISIBLE_DEVICES``), each marked with its ``replica``; the plan-wide fields and the
recent history are replica 0's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tpserve.server.engine.drafting import PER_POSITION
from tpserve.server.http.metrics import REPLICAS  # each replica's own (no "memory")


def merge_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The replicas' ``stats()`` as one (module doc), with each replica's own under
    ``REPLICAS`` (without its memory report) for the per-engine series of /metrics; a
    replica that has not reported yet (an empty dict) adds nothing."""
    own = [{k: v for k, v in s.items() if k != "memory"} for s in stats]
    stats = [s for s in stats if s]
    if not stats:
        return {}
    out: dict[str, Any] = {REPLICAS: own}
    for key in stats[0]:
        values = [s[key] for s in stats if key in s]
        if key == "memory":
            out[key] = merge_memory(values)
        elif key == "lora":
            out[key] = {"running": sorted({i for v in values for i in v["running"]}),
                        "waiting": sorted({i for v in values for i in v["waiting"]}),
                        "max_lora": values[0]["max_lora"]}
        elif key == PER_POSITION:
            out[key] = [sum(v[j] for v in values) for j in range(len(values[0]))]
        elif isinstance(values[0], bool) or not isinstance(values[0], int | float):
            out[key] = values[0]
        else:
            out[key] = sum(values)
    if out.get("kv_blocks_total"):
        out["kv_cache_usage_perc"] = 1 - out["kv_blocks_free"] / out["kv_blocks_total"]
    return out


def merge_memory(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The replicas' memory reports as one: every rank line of every replica (module
    doc), the rest replica 0's, with ``data_parallel_size``."""
    merged = dict(reports[0])
    merged["ranks"] = [
        {**line, "rank": replica * report["tp"] + line["rank"], "replica": replica}
        for replica, report in enumerate(reports) for line in report["ranks"]]
    merged["data_parallel_size"] = len(reports)
    return merged
