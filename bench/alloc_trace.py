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


def trace_events(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """The snapshot's recorded events, every device's in turn (one device per process
    here): what ``since`` indices count."""
    return [e for dev in snap.get("device_traces", []) for e in dev]


def created_segments(snap: dict[str, Any], keep: int, since: int = 0
                     ) -> tuple[list[dict[str, Any]], int, int]:
    """``(segments created in the trace, segments freed in it, trace events)`` from trace
    index ``since`` on; each created one with its address, size, stream, pool (``"freed
    since"`` when gone from the snapshot), the size of the first allocation served from it,
    and its stack."""
    traces = trace_events(snap)[since:]
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


def _live_in(live: dict[int, dict[str, Any]], addr: int, size: int) -> list[tuple[int, dict]]:
    """The live allocations inside ``[addr, addr + size)``, by offset."""
    return sorted((a - addr, b) for a, b in live.items() if addr <= a < addr + size)


def segment_blockers(start: dict[str, Any], traces: list[dict[str, Any]], since: int,
                     keep: int) -> list[dict[str, Any]]:
    """Why each segment created at trace index ``since`` or later could not be served from
    the cache: the trace replayed from ``start`` (the snapshot taken when the history was
    turned on: its segments and their allocated blocks, whose stacks are unknown), and at
    each such ``segment_alloc`` every existing segment at least as large as the request,
    with its stream, its largest free run and the live allocations in it (offset, size,
    the trace index and stack of their allocation; ``None`` for those made before the
    history started). A segment big enough whose largest free run is smaller than the
    request is split by the allocations it lists: those are what fragmented it."""
    segs: dict[int, dict[str, Any]] = {}
    live: dict[int, dict[str, Any]] = {}
    for s in start.get("segments", []):
        segs[s["address"]] = {"size": s["total_size"], "stream": s.get("stream"),
                              "pool": s.get("segment_pool_id")}
        off = 0
        for b in s["blocks"]:
            if b["state"] != "inactive":
                live[s["address"] + off] = {"size": b["size"], "index": None, "stack": []}
            off += b["size"]
    out = []
    for i, e in enumerate(traces):
        act, addr, size = e.get("action"), e.get("addr"), e.get("size")
        if act == "alloc":
            live[addr] = {"size": size, "index": i, "stack": frames_of(e, keep)}
        elif act == "free_completed":
            live.pop(addr, None)
        elif act == "segment_free":
            segs.pop(addr, None)
        elif act == "segment_alloc":
            if i >= since:
                out.append({"index": i, "size": size, "stream": e.get("stream"),
                            "stack": frames_of(e, keep),
                            "candidates": [_candidate(a, s, live, keep)
                                           for a, s in sorted(segs.items())
                                           if s["size"] >= size]})
            segs[addr] = {"size": size, "stream": e.get("stream"), "pool": None}
    return out


def _candidate(addr: int, seg: dict[str, Any], live: dict[int, dict[str, Any]],
               keep: int) -> dict[str, Any]:
    """One segment at the moment another was created: its free runs and live blocks."""
    held = _live_in(live, addr, seg["size"])
    runs, end = [], 0
    for off, b in held:
        runs.append(off - end)
        end = max(end, off + b["size"])
    runs.append(seg["size"] - end)
    return {"address": addr, "total_size": seg["size"], "stream": seg["stream"],
            "pool": seg["pool"], "largest_free": max(runs),
            "free": seg["size"] - sum(b["size"] for _, b in held),
            "live": [{"offset": off, "size": b["size"], "index": b["index"],
                      "stack": b["stack"][:keep]} for off, b in held[:16]],
            "live_count": len(held)}
