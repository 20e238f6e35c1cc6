"""Engine queries: questions the HTTP side asks the engine, answered on the engine thread
between steps (where the runner and its collectives may be used).

The path is the same in both process layouts: ``EngineFront.query(name)`` gives the
question an id and a future and hands it to its transport; in process
(``StepLoopTransport``) it goes into the ``StepLoop``'s inbox, with the engine process
(``engine_proxy.PipeTransport``) it goes down the command pipe as ``("query", id, name)``
and the engine process's command reader puts it into the same inbox. The engine thread
runs ``run_query`` after the step in flight and replies (``("reply", id, value, error)``
on the output pipe); the front waits at most ``QUERY_TIMEOUT_S``. A reply that arrives
after its timeout is dropped.

Queries:
- ``memory_report``: every rank's allocator figures gathered now (a collective at tp > 1),
  then the memory report (what ``GET /memory?fresh=true`` serves);
- ``memory_snapshot`` or ``("memory_snapshot", replica)``: rank 0's allocator segments
  and recorded events as the pickle https://pytorch.org/memory_viz reads (needs
  ``--memory-history``); a data-parallel server sends it to that replica's engine alone
  (``data_parallel``), so an engine that gets a replica other than 0 runs without data
  parallelism and refuses it;
- ``("lora_load", path)``: every rank loads the LoRA adapter folder into a free slot
  (``lora_slots``); answers ``(slot, id)``;
- ``("lora_unload", slot, id)``: frees that adapter's slot;
- the control queries of ``--enable-sleep-mode`` (``control.py``): pause, resume,
  is_paused, sleep, wake_up, is_sleeping, reset_prefix_cache.

A query with arguments is a tuple, its name first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpserve.server.engine.control import CONTROL_QUERIES
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.errors import InvalidRequestError

QUERY_TIMEOUT_S = 60.0


def fresh_memory_report(core: EngineCore) -> dict[str, Any]:
    core.memory.refresh(core.block_manager.usage)
    return core.memory.report()


def memory_snapshot(core: EngineCore, replica: int = 0) -> bytes:
    if replica != 0:
        raise InvalidRequestError(f"replica {replica}: this server runs one engine "
                                  "(replica 0; --data-parallel-size runs more)")
    if not core.runner.cfg.memory_history:
        raise InvalidRequestError(
            "the allocator's history is not recorded: start the server with "
            "--memory-history [N] (CUDA only) to record the last N allocator events on "
            "every rank, then fetch GET /memory/snapshot")
    return core.runner.allocator_snapshot()


def _lora_slots(core: EngineCore):
    if core.lora_slots is None:
        raise InvalidRequestError("this server serves no LoRA adapters: start it with "
                                  "--enable-lora")
    return core.lora_slots


def lora_load(core: EngineCore, path: str) -> tuple[int, int]:
    slots = _lora_slots(core)
    if core.pause.state == "asleep":  # the layers' storages are empty
        raise InvalidRequestError("the engine is asleep: POST /wake_up before loading a "
                                  "LoRA adapter")
    live = (s.params.lora_slot for s in core.requests.values())
    slot, lora_id = slots.reserve(s for s in live if s is not None)
    try:
        core.runner.load_lora_adapter(slot, path)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    slots.commit(slot, lora_id)
    return slot, lora_id


def lora_unload(core: EngineCore, slot: int, lora_id: int) -> None:
    _lora_slots(core).unload(slot, lora_id)


QUERIES: dict[str, Callable[..., Any]] = {
    "memory_report": fresh_memory_report,
    "memory_snapshot": memory_snapshot,
    "lora_load": lora_load,
    "lora_unload": lora_unload,
    **CONTROL_QUERIES,
}


def run_query(core: EngineCore, name: str | tuple) -> Any:
    """Engine thread only. Raises ``InvalidRequestError`` for an unknown name or a query
    this server cannot answer."""
    name, args = (name[0], name[1:]) if isinstance(name, tuple) else (name, ())
    fn = QUERIES.get(name)
    if fn is None:
        raise InvalidRequestError(f"unknown engine query {name!r}; known: "
                                  f"{', '.join(sorted(QUERIES))}")
    return fn(core, *args)
