"""Which allocation created each CUDA caching-allocator segment, from a memory snapshot
taken with ``torch.cuda.memory._record_memory_history`` on (``segment_alloc`` events of
the recorded trace). Shared by ``segments_probe.py`` and ``bench_engine.py
--serving-memory-history``."""

from __future__ import annotations

from typing import Any


def frames_of(event: dict[str, Any], keep: int) -> list[str]:
    """The event's stack, innermost first, as ``file:line name`` (torch internals kept:
    the interesting frame is usually the first tpserve one)."""
    out = []
    for f in event.get("frames", [])[:keep]:
        out.append(f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}")
    return out


def created_segments(snap: dict[str, Any], keep: int) -> tuple[list[dict[str, Any]], int, int]:
    """``(segments created in the trace, segments freed in it, trace events)``; each created
    one with its address, size, stream, pool (``"freed since"`` when gone from the
    snapshot), the size of the first allocation served from it, and its stack."""
    traces = [e for dev in snap.get("device_traces", []) for e in dev]
    pools = {s["address"]: s.get("segment_type") for s in snap.get("segments", [])}
    created = []
    for i, e in enumerate(traces):
        if e.get("action") != "segment_alloc":
            continue
        # the allocation served from the new segment follows it in the trace
        nxt = next((t for t in traces[i + 1:i + 8] if t.get("action") == "alloc"), None)
        created.append({"address": e.get("addr"), "size": e.get("size"),
                        "stream": e.get("stream"),
                        "pool": pools.get(e.get("addr"), "freed since"),
                        "first_alloc_size": None if nxt is None else nxt.get("size"),
                        "stack": frames_of(e, keep)})
    freed = sum(1 for e in traces if e.get("action") == "segment_free")
    return created, freed, len(traces)
