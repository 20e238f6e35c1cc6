"""The soak's counts (``tally``) and its printed summary (``format_summary``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tpserve.loadtest.soak.outcomes import ABORTED, COMPLETED, ERRORED, FAILED, OUTCOMES, Outcome
from tpserve.loadtest.soak.plans import RequestPlan
from tpserve.loadtest.soak.server_state import IDLE_GAUGES

MAX_LISTED_FAILURES = 20


def tally(plans: list[RequestPlan], outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts by outcome, errors by status, the mix, and the first failures."""
    counts = Counter(o.kind for o in outcomes)
    errors = Counter("sse" if o.status is None else str(o.status)
                     for o in outcomes if o.kind == ERRORED)
    failures = [f"{p.describe()}: {o.detail}"
                for p, o in zip(plans, outcomes, strict=True) if o.kind == FAILED]
    error_examples = [f"{p.describe()}: {o.detail}"
                      for p, o in zip(plans, outcomes, strict=True) if o.kind == ERRORED]
    return {
        "total": len(outcomes),
        **{kind: counts.get(kind, 0) for kind in OUTCOMES},
        "errors_by_status": dict(sorted(errors.items())),
        "mix": {
            "chat": sum(p.chat for p in plans),
            "completions": sum(not p.chat for p in plans),
            "streamed": sum(p.stream for p in plans),
            "n2": sum(p.n == 2 for p in plans),
            "with_stop": sum(p.stop is not None for p in plans),
            "aborts_planned": sum(p.abort_planned for p in plans),
        },
        "failures": failures[:MAX_LISTED_FAILURES],
        "error_examples": error_examples[:5],
    }




def format_summary(doc: dict[str, Any]) -> str:
    c, pool, rss = doc["counts"], doc["pool"], doc["rss"]
    mix = c["mix"]
    errors = ", ".join(f"{k}: {v}" for k, v in c["errors_by_status"].items())
    lines = [
        "=" * 22 + " tpserve soak " + "=" * 22,
        f"Model:                 {doc['model']} at {doc['base_url']}",
        f"Requests:              {c['total']} ({doc['warmup_requests']} warm-up before, "
        f"{doc['warmup'][FAILED]} of them failed)",
        f"  completed:           {c[COMPLETED]}",
        f"  errored (explicit):  {c[ERRORED]}" + (f" ({errors})" if errors else ""),
        f"  aborted by client:   {c[ABORTED]}",
        f"  FAILED:              {c[FAILED]}",
        f"Mix:                   chat {mix['chat']}, completions {mix['completions']}, "
        f"streamed {mix['streamed']}, n=2 {mix['n2']}, with stop {mix['with_stop']}, "
        f"aborts planned {mix['aborts_planned']}",
        f"Duration:              {doc['duration_s']:.1f} s",
        "Pool after the soak:   " + (
            "idle" if pool["ok"] else "NOT IDLE") + f" after {pool['waited_s']:.1f} s ("
        + ", ".join(f"{k} {pool.get(k)}" for k in IDLE_GAUGES)
        + (f"; {pool['error']}" if pool.get("error") else "") + ")",
        f"Health after the soak: {doc['health_status']}",
    ]
    if rss is None:
        lines.append("Server RSS:            not checked (no --server-pid)")
    else:
        lines.extend(memory_lines(rss))
    for failure in c["failures"]:
        lines.append(f"  failure: {failure}")
    lines.append(f"Result:                {'PASS' if doc['passed'] else 'FAIL'}")
    return "\n".join(lines)


def memory_lines(rss: dict[str, Any]) -> list[str]:
    """The tree's RSS (total, then each process), the largest grower when the check fails,
    and GPU memory."""
    lines = [f"Server RSS:            {rss['baseline_mib']:.1f} MiB after warm-up, "
             f"{rss['after_mib']:.1f} MiB after, growth {rss['growth_mib']:.1f} MiB "
             f"(limit {rss['limit_mib']:g}) over {len(rss['processes'])} processes"
             + ("" if rss["ok"] else " TOO MUCH")]
    for p in rss["processes"]:
        role = " (root)" if p["root"] else ""
        lines.append(f"  pid {p['pid']} {p['name']}{role}: {p['baseline_mib']} -> "
                     f"{p['after_mib']} MiB ({p['growth_mib']:+.1f})")
    if not rss["ok"]:
        top = rss["largest_growth"]
        lines.append(f"  most growth: {top['name']} (pid {top['pid']}), "
                     f"{top['growth_mib']:+.1f} MiB")
    gpu = rss["gpu"]
    if gpu["measured"]:
        lines.append(f"Server GPU memory:     {gpu['baseline_mib']:.1f} MiB after warm-up, "
                     f"{gpu['after_mib']:.1f} MiB after, growth {gpu['growth_mib']:.1f} MiB "
                     f"(reported, not checked; {gpu['note']})")
    else:
        lines.append(f"Server GPU memory:     {gpu['note']}")
    return lines
