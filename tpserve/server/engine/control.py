"""The engine queries behind vLLM's control endpoints (``--enable-sleep-mode``; the routes
are ``http/control_routes.py``, the states ``pause.py``, the ranks' side ``model/sleep.py``):

- ``("pause", mode, clear_cache)``, ``"resume"``, ``"is_paused"``;
- ``("sleep", level, mode)``, ``("wake_up", tags[, undo])``, ``"is_sleeping"``: as vLLM,
  level 0 only stops the steps (a pause keeping the caches; tag ``scheduling`` names it at
  wake-up), a wake-up that leaves nothing asleep resumes a pause too, and the engine counts
  as sleeping while paused;
- ``("reset_prefix_cache", running, external)``;
- ``("reload_weights", path[, undo, hold])``: a checkpoint of the same model read in place.

``undo`` takes back a sleep or a reload that another data-parallel replica could not make,
and ``hold`` keeps a replica a reload would resume paused until every replica has the new
weights (``server/data_parallel.py``).

A pause or sleep of mode ``wait`` answers once the requests it waits for have ended (a
``pause.Deferred``); the others answer at once. Each runs on the engine thread between
steps, like every query.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tpserve.model.reload import reload_refusal
from tpserve.model.sleep import SLEEP_LEVELS, WAKE_TAGS, SleepError, level2_refusal
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.errors import ConflictError, EngineError, InvalidRequestError
from tpserve.server.engine.pause import (
    ASLEEP,
    DRAINING,
    PAUSE_MODES,
    PAUSED,
    RUNNING,
    Deferred,
)

logger = logging.getLogger(__name__)

SCHEDULING = "scheduling"  # vLLM's wake-up tag of level 0: the steps, no memory
ENGINE_SLEEP_LEVELS = (0, *SLEEP_LEVELS)
ENGINE_WAKE_TAGS = (*WAKE_TAGS, SCHEDULING)


class EngineMemoryError(EngineError):
    """The device (or host) had too little free memory to wake up (or to sleep at level 1);
    the engine stays as it was."""

    status = 503
    type = "service_unavailable"


def _enabled(core: EngineCore) -> None:
    if not core.enable_sleep_mode:
        raise InvalidRequestError("pausing and sleep mode are off: start the server with "
                                  "--enable-sleep-mode")


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got "
                                  f"{mode!r}")


def _engine_error(e: SleepError) -> EngineError:
    return EngineMemoryError(str(e)) if e.out_of_memory else EngineError(str(e))


def _stop(core: EngineCore, mode: str, then: Callable[[], Any]) -> Any:
    """Stops the steps by ``mode`` (``pause.py``), then ``then()`` (its answer is the
    query's): now, or once the requests in flight have ended (``wait``). If ``then``
    fails, the engine goes back to the state it was in (running: the held requests enter)."""
    pause = core.pause
    before_state = pause.state
    core.settle()
    if mode == "abort":  # the requests in flight; those held since a pause stay held
        for rid, state in list(core.requests.items()):
            if state not in pause.held:
                core.abort(rid)

    def run_then() -> Any:
        pause.state = PAUSED
        try:
            return then()
        except BaseException:
            if before_state == RUNNING:
                core.resume()
            else:
                pause.state = before_state
            raise

    if mode != "wait":
        return run_then()
    epoch = pause.begin_draining()
    waited = [s for s in core.requests.values() if s not in pause.held]

    def finish() -> Any:
        if pause.epoch != epoch or pause.state != DRAINING:
            raise ConflictError("the pause was called off by /resume before it completed")
        core.settle()
        return run_then()

    return Deferred(lambda: pause.epoch != epoch or all(s.done for s in waited), finish)


def pause(core: EngineCore, mode: str = "abort", clear_cache: bool = True) -> Any:
    _enabled(core)
    _check_mode(mode)
    if core.pause.state in (PAUSED, ASLEEP):
        return {"is_paused": True}
    if core.pause.state == DRAINING:  # joins the pause under way (vLLM's returns at once)
        epoch = core.pause.epoch

        def joined() -> dict[str, Any]:
            if core.pause.epoch != epoch or core.pause.state not in (PAUSED, ASLEEP):
                raise ConflictError("the pause was called off by /resume before it completed")
            return {"is_paused": True}

        return Deferred(lambda: core.pause.epoch != epoch or core.pause.state != DRAINING,
                        joined)

    def then() -> dict[str, Any]:
        if clear_cache and mode != "keep":  # kept requests hold their blocks
            _reset_cache(core, host=False)
        logger.info("engine paused (mode %s)", mode)
        return {"is_paused": True}

    return _stop(core, mode, then)


def resume(core: EngineCore) -> dict[str, Any]:
    _enabled(core)
    if core.pause.state == ASLEEP:
        raise InvalidRequestError("the engine is asleep: POST /wake_up resumes it")
    if core.pause.state != RUNNING:
        core.resume()
        logger.info("engine resumed")
    return {"is_paused": False}


def is_paused(core: EngineCore) -> bool:
    """Paused, asleep, or pausing (mode wait: new requests already wait), as vLLM says."""
    return core.pause.state != RUNNING


def sleep(core: EngineCore, level: int = 1, mode: str = "abort") -> Any:
    _enabled(core)
    _check_mode(mode)
    if level not in ENGINE_SLEEP_LEVELS:
        raise InvalidRequestError(f"level must be 0, 1 or 2, got {level}")
    if level == 0:
        return _sleep_scheduling(core, mode)
    runner = core.runner
    if core.pause.state == ASLEEP:
        if runner.sleep_state.level == level:
            return {"is_sleeping": True, "level": level, "ranks": []}
        raise InvalidRequestError(f"the engine already sleeps at level "
                                  f"{runner.sleep_state.level}: POST /wake_up first")
    if core.pause.state == DRAINING:
        raise InvalidRequestError("a pause or sleep of mode wait is under way: POST /resume "
                                  "first")
    if core.pause.state == PAUSED and mode == "wait":
        raise InvalidRequestError("the engine is paused, so its requests cannot end: sleep "
                                  "with mode abort or keep, or POST /resume first")
    was_paused = core.pause.state == PAUSED
    why = (level2_refusal(runner) if level == 2 else None) or runner.sleep_state.refusal()
    if why is not None:
        raise InvalidRequestError(f"sleep level {level} is not possible here: {why}"
                                  + ("; level 1 keeps a host copy" if level == 2 else ""))

    def then() -> dict[str, Any]:
        if mode == "keep":  # the pool's content is lost: they are computed again
            core.counters["num_preemptions_total"] += len(core.scheduler.preempt_all())
        # the host tier's blocks stay valid while the weights are kept (level 1); level 2
        # reads the checkpoint again at wake-up, which a trainer may have overwritten
        _reset_cache(core, host=level == 2)
        try:
            ranks = runner.sleep(level)
        except SleepError as e:
            raise _engine_error(e) from None
        core.pause.state = ASLEEP
        core.pause.paused_before_sleep = was_paused
        _log(f"asleep at level {level}", ranks)
        return {"is_sleeping": True, "level": level, "ranks": ranks}

    return _stop(core, mode, then)


def _sleep_scheduling(core: EngineCore, mode: str) -> Any:
    """vLLM's level 0: the steps stop as a pause of ``mode`` stops them, the caches kept;
    nothing changes in memory. A wake-up or ``/resume`` resumes."""
    def answer() -> dict[str, Any]:
        asleep = core.pause.state == ASLEEP
        return {"is_sleeping": True, "level": core.runner.sleep_state.level if asleep else 0,
                "ranks": []}

    paused = pause(core, mode, clear_cache=False)
    if isinstance(paused, Deferred):
        return Deferred(paused.ready, lambda: (paused.finish(), answer())[1])
    return answer()


def wake_up(core: EngineCore, tags: tuple[str, ...] | None = None,
            undo: bool = False) -> dict[str, Any]:
    """Takes back what ``tags`` name (default all; ``scheduling`` names no memory); once
    nothing sleeps the engine resumes, a pause or a level-0 sleep too (as vLLM), or, with
    ``undo`` (data parallelism taking back a sleep that another replica could not make),
    goes back to the state the sleep found: paused, or running."""
    _enabled(core)
    unknown = [t for t in tags or () if t not in ENGINE_WAKE_TAGS]
    if unknown:
        raise InvalidRequestError(f"unknown wake-up tag(s) {', '.join(map(repr, unknown))}; "
                                  f"known: {', '.join(ENGINE_WAKE_TAGS)}")
    tags = tuple(t for t in tags if t != SCHEDULING) if tags else WAKE_TAGS
    if core.pause.state != ASLEEP:
        if core.pause.state != RUNNING and not undo:
            core.resume()
            logger.info("engine resumed by a wake-up")
        return {"is_sleeping": False, "ranks": []}
    if not tags:  # only "scheduling": the memory still sleeps, so the steps wait too
        return {"is_sleeping": True, "ranks": []}
    try:
        ranks = core.runner.wake_up("weights" in tags, "kv_cache" in tags)
    except SleepError as e:
        raise _engine_error(e) from None
    state = core.runner.sleep_state
    asleep = [t for t, a in zip(WAKE_TAGS, (state.weights_asleep, state.kv_asleep),
                                strict=True) if a]
    _log("woke up " + (", ".join(tags) + "; still asleep: " + ", ".join(asleep)
                       if asleep else "whole"), ranks)
    if not asleep and undo and core.pause.paused_before_sleep:
        core.pause.state = PAUSED  # its held requests stay held
    elif not asleep:
        core.resume()
    return {"is_sleeping": bool(asleep), "ranks": ranks}


def is_sleeping(core: EngineCore) -> bool:
    """``is_paused``: vLLM's engine sleeps while paused at all (its level 0 is a pause)."""
    return is_paused(core)


def reload_weights(core: EngineCore, path: str = "", undo: bool = False,
                   hold: bool = False) -> dict[str, Any]:
    """The checkpoint at ``path`` (empty: the one served, read again; ``undo``: the one
    served before the last reload) into the weights in place (``model/reload.py``), then
    the prefix cache reset, the host tier's too (its blocks were computed with the old
    weights; after a failed attempt as well). Only while no request holds KV blocks: idle,
    paused (mode abort or wait), or asleep: the weights then wake up from it (and the
    engine resumes if nothing else sleeps; with ``hold`` it stays paused instead and the
    answer's ``resumes`` says so: data parallelism resumes it once every replica has the
    new weights). An undo may put the weights back to sleep: the engine is asleep again."""
    _enabled(core)
    core.settle()
    used = core.block_manager.num_used_blocks
    if used:
        raise InvalidRequestError(
            f"requests hold {used} KV blocks computed with the current weights: POST "
            "/pause?mode=abort (or wait), or /sleep, first")
    why = reload_refusal(core.runner)
    if why is not None:
        raise InvalidRequestError(f"the weights cannot be read again in place: {why}")
    state = core.runner.sleep_state
    try:
        answer = core.runner.reload_weights(path, undo)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    finally:  # ReloadLostError goes on up: the engine fails
        _reset_cache(core, host=True)
    logger.info("weights read from %s in %.2f s", answer["description"], answer["seconds"])
    asleep = state.weights_asleep or state.kv_asleep
    resumes = core.pause.state == ASLEEP and not asleep
    if asleep:
        core.pause.state = ASLEEP
    elif resumes and hold:
        core.pause.state = PAUSED  # its held requests stay held
    elif resumes:
        core.resume()
    return {"status": "reloaded", "is_sleeping": asleep, **answer,
            **({"resumes": resumes} if hold else {})}


def reset_prefix_cache(core: EngineCore, running: bool = False,
                       external: bool = False) -> bool:
    """vLLM's: forgets the cached blocks; ``running`` (``reset_running_requests``) first
    preempts the running requests (recomputed at their next step), else a running request's
    blocks refuse it; ``external`` (``reset_external``) forgets the host tier's too."""
    core.settle()
    if running:
        core.counters["num_preemptions_total"] += len(core.scheduler.preempt_all())
    _reset_cache(core, host=external)
    return True


def _reset_cache(core: EngineCore, host: bool) -> None:
    """The device prefix cache forgotten (``host``: the host tier's too); refused while a
    request holds blocks."""
    bm = core.block_manager
    if bm.num_used_blocks:
        raise InvalidRequestError(
            f"{bm.num_used_blocks} KV blocks are held by requests; the prefix cache can be "
            "reset only when none are (pause with mode abort or wait, or pass "
            "reset_running_requests=true)")
    copies = bm.take_copies()
    if copies.needed and not host:  # stores listed at eviction: the kept tier gets them
        core.runner.copy_kv(*copies)
    bm.reset_prefix_cache(host=host)


def _log(what: str, ranks: list[dict[str, float]]) -> None:
    gib = 2 ** 30
    logger.info("engine %s in %.2f s: weights %.2f GiB, KV cache %.2f GiB, CUDA graphs "
                "%.2f GiB over %d rank(s)%s", what, max(r["seconds"] for r in ranks),
                sum(r["weights_bytes"] for r in ranks) / gib,
                sum(r["kv_cache_bytes"] for r in ranks) / gib,
                sum(r["cuda_graph_bytes"] for r in ranks) / gib, len(ranks),
                "" if not any(r["host_copy_bytes"] for r in ranks) else
                "; %.2f GiB of weights held in host memory"
                % (sum(r["host_copy_bytes"] for r in ranks) / gib))


CONTROL_QUERIES = {
    "pause": pause,
    "resume": resume,
    "is_paused": is_paused,
    "sleep": sleep,
    "wake_up": wake_up,
    "is_sleeping": is_sleeping,
    "reset_prefix_cache": reset_prefix_cache,
    "reload_weights": reload_weights,
}
