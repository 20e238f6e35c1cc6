"""Per-rank memory metrics from the engine's memory report (``stats()["memory"]``):

- ``tpserve:memory_bytes{component, rank}``: the start-up plan's lines (weights,
  activation_workspace, cuda_graphs, kv_pool, non_torch, other_processes, free) and the
  allocator's live ``allocated`` and ``reserved`` bytes;
- ``tpserve:memory_fragmentation{rank}``: ``(reserved - allocated) / reserved``;
- ``tpserve:memory_plan_disagreement{rank}``: ``(reserved - plan) / plan``;
- ``tpserve:allocator_alloc_retries_total{rank}``, ``tpserve:allocator_ooms_total{rank}``.

Rank 0's live figures are at most a couple of seconds old; other ranks' at most
``rank_interval_s`` (see ``server/engine/memory_monitor.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tpserve.model.memory import COMPONENTS


def memory_families(report: Mapping[str, Any] | None, model_name: str,
                    prefix: str = "tpserve:") -> Iterator[Metric]:
    """The families above (named with ``prefix``, ``--metrics-namespace``); empty samples
    when ``report`` is None (describe)."""
    labels = ("model_name", "rank")
    by_component = GaugeMetricFamily(
        prefix + "memory_bytes", "Device memory by component and rank: the start-up plan's "
        "lines and the caching allocator's live allocated/reserved bytes.",
        labels=("model_name", "component", "rank"))
    frag = GaugeMetricFamily(prefix + "memory_fragmentation",
                             "(reserved - allocated) / reserved of the caching allocator.",
                             labels=labels)
    disagree = GaugeMetricFamily(prefix + "memory_plan_disagreement",
                                 "(allocator reserved - plan) / plan on each rank.",
                                 labels=labels)
    retries = CounterMetricFamily(prefix + "allocator_alloc_retries",
                                  "cudaMalloc retries after freeing the allocator's cache.",
                                  labels=labels)
    ooms = CounterMetricFamily(prefix + "allocator_ooms",
                               "Out-of-memory errors raised by the caching allocator.",
                               labels=labels)
    for r in (report or {}).get("ranks", []):
        rank = str(r["rank"])
        for component in COMPONENTS:
            by_component.add_metric([model_name, component, rank], float(r["plan"][component]))
        a = r["allocator"]
        for key in ("allocated", "reserved"):
            by_component.add_metric([model_name, key, rank], float(a[key]))
        frag.add_metric([model_name, rank], float(a["fragmentation"]))
        if r["plan_disagreement"] is not None:
            disagree.add_metric([model_name, rank], float(r["plan_disagreement"]))
        retries.add_metric([model_name, rank], float(a["num_alloc_retries"]))
        ooms.add_metric([model_name, rank], float(a["num_ooms"]))
    for family in (by_component, frag, disagree, retries, ooms):
        if report is None or family.samples:
            yield family
