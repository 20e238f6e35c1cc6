"""Data parallelism (``--data-parallel-size N``, vLLM's ``-dp``): ``N`` engine replicas
behind one HTTP server, each a whole engine process (``engine_process``) with its own
``--tensor-parallel-size`` ranks, KV pool and scheduler.

Devices (``replicas.py``): replica ``r`` sees only GPUs ``r x tp .. r x tp + tp - 1``, so
each replica plans its memory from its own GPUs. On the CPU the replicas start one after
the other, so that each plans from the memory the ones before it left; on GPUs they start
together.

Routing (``route``), among the replicas whose backpressure has room for the request
(``EngineFront.fits``; where none has, the least busy answers 429): a request whose prompt
shares at least 30 % and 64 tokens with an earlier one (whole KV blocks) goes to the
replica that took that one, unless it is much busier than the least busy
(``prefix_affinity``); any other goes to the replica with the fewest sequences in flight
(``n`` a request, as vLLM's child requests; then the fewest prompt tokens, then in turn),
read from the replicas' own backpressure counters on the event loop thread, so the
requests of one burst spread over the replicas, and so do requests sent one at a time. The
prefix is remembered and the turn moves on only once the replica admitted the request (a
400 or 429 claims neither). The one-token requests of a beam search all go to one replica
(``pinned``). vLLM's ``X-data-parallel-rank`` header (an external router's choice) sends a
request to that replica without routing (``at_rank``; out of range: 400).

``DataParallelEngines`` is an ``EngineClient`` (and has ``start``, ``shutdown``, ``drain``,
``fail`` for ``serve``): ``stats`` merges the replicas' (``replica_stats``); a query goes to
every replica (an unload or the control queries must answer alike; the memory report is
merged), except ``memory_snapshot``, which goes to the replica it names (0 by default). A
runtime LoRA load takes one slot with one id on every replica or on none (``_lora_load``;
``lora_slots`` makes the replicas mean the same slot). A sleep or a weight reload that fails on one replica is taken back on the others
(``_all_or_none``), so the replicas never serve unlike weights or differ in state; a reload
needs every replica paused or asleep (``_reload``). Any replica's death is the server's
(``on_fatal``): /health turns 503 and the process exits non-zero, as with one engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.config import Config
from tpserve.server.engine.errors import EngineError, InvalidRequestError
from tpserve.server.engine.front import check_rank
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.queries import QUERY_TIMEOUT_S
from tpserve.server.engine_proxy import EngineProxy
from tpserve.server.prefix_affinity import MIN_SHARE, MIN_TOKENS, PrefixAffinity, choose
from tpserve.server.replica_stats import merge_memory, merge_stats
from tpserve.server.replicas import Replica

logger = logging.getLogger("tpserve")

# a query _all_or_none takes back where another replica failed: the query that undoes it
# on a replica, and what the client can do where that fails too
UNDO = {"sleep": (("wake_up", None, True), "POST /wake_up"),
        "reload_weights": (("reload_weights", "", True), "POST /reload_weights again")}


class DataParallelEngines:
    """The replicas as one ``EngineClient`` (module doc). Starts every replica's engine
    process (``cfg.replicas``) and waits until all are ready; if one fails to start, the
    others are shut down and its error is raised."""

    def __init__(self, cfg: Config, on_fatal: Callable[[str], None] | None = None):
        def start(replica: Replica) -> EngineProxy:
            return EngineProxy(cfg, on_fatal, replica)

        replicas = cfg.replicas
        together = all(r.visible_devices is not None for r in replicas)
        engines: list[EngineProxy] = []
        error: BaseException | None = None
        with ThreadPoolExecutor(len(replicas) if together else 1) as pool:
            for future in [pool.submit(start, r) for r in replicas]:
                try:
                    engines.append(future.result())
                except BaseException as e:  # noqa: BLE001 - the first is raised below
                    error = error or e
        if error is not None:
            for engine in engines:
                engine.shutdown(timeout=10.0)
            raise error
        self._adopt(engines, cfg.scheduler.block_size, cfg.scheduler.max_num_seqs)
        logger.info("%d engine replicas ready; a request goes to the one that took a prompt "
                    "sharing %d %% and %d tokens of its own, else to the one with the fewest "
                    "in flight", len(engines), round(100 * MIN_SHARE), MIN_TOKENS)

    def _adopt(self, engines: list[EngineProxy], block_size: int, max_num_seqs: int) -> None:
        """The started replicas, and the routing's state (tests pass fakes here)."""
        self.engines = engines
        for index, engine in enumerate(engines):
            engine.engine_index = index
        first = engines[0]
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self.vocab_size, self.tokenizer = first.vocab_size, first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self._turn = 0  # where the next tie between equally busy replicas starts
        self._affinity = PrefixAffinity(block_size)
        self._slack = max(1, max_num_seqs // 8)

    @property
    def accepting(self) -> bool:
        return all(e.accepting for e in self.engines)

    @property
    def dead_reason(self) -> str | None:
        return next((e.dead_reason for e in self.engines if e.dead_reason is not None), None)

    def is_healthy(self) -> bool:
        return all(e.is_healthy() for e in self.engines)

    def route(self, prompt: list[int], params: SamplingParams
              ) -> tuple[EngineProxy, Callable[[], None]]:
        """The replica a request of ``prompt`` goes to (module doc), and what to call once
        it admitted the request (``EngineFront.generate``'s ``admitted``): remember its
        prefix there and move the turn on, so that a request refused (400, 429) claims no
        prefix and no turn (event loop thread only).

        Only replicas with room for it (``EngineFront.fits``) are candidates, the owner
        of its prefix included; where none has room, the least busy one refuses it (429).
        The load is the sequences in flight (``n`` each, as vLLM's child requests)."""
        engines, n, turn = self.engines, len(self.engines), self._turn
        open_ = [i for i, e in enumerate(engines) if e.fits(len(prompt), params)]
        loads = [e.outstanding_seqs for e in engines]
        least = min(open_ or range(n), key=lambda i: (loads[i], engines[i].outstanding_tokens,
                                                      (i - turn) % n))
        chain = self._affinity.chain(prompt, params)
        owner = self._affinity.owner(chain, len(prompt))
        index = choose(loads, least, owner if owner in open_ else None, self._slack)

        def admitted() -> None:
            self._affinity.record(chain, index)
            if index == least:
                self._turn = (index + 1) % n

        return engines[index], admitted

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        # routed when the caller first awaits, so a burst's requests see each other
        engine, admitted = self.route(prompt_token_ids, params)
        outputs = engine.generate(request_id, prompt_token_ids, params, admitted)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        for e in self.engines:  # idempotent; unknown ids are ignored
            e.abort(request_id)

    def pinned(self, prompt_token_ids: list[int], params: SamplingParams) -> Pinned:
        """``EngineClient.pinned``: the replica a beam search sends every step to (routed
        as a request of its prompt would be; its first admitted request records the
        prefix), so that each step finds the beams' blocks in its prefix cache."""
        return Pinned(*self.route(prompt_token_ids, params))

    def at_rank(self, rank: int) -> EngineProxy:
        """``EngineClient.at_rank``: replica ``rank`` (vLLM's ``X-data-parallel-rank``
        header: an external router's choice), without routing."""
        check_rank(self, rank, len(self.engines))
        return self.engines[rank]

    def stats(self) -> dict[str, Any]:
        return merge_stats([e.stats() for e in self.engines])

    async def query(self, name: str | tuple, timeout: float = QUERY_TIMEOUT_S) -> Any:
        """Every replica's answer, as one (module doc)."""
        kind = name if isinstance(name, str) else name[0]
        if kind == "memory_snapshot":
            replica = 0 if isinstance(name, str) else name[1]
            if not 0 <= replica < len(self.engines):
                raise InvalidRequestError(f"replica {replica}: this server runs replicas "
                                          f"0..{len(self.engines) - 1}")
            return await self.engines[replica].query("memory_snapshot")
        if kind == "reload_weights":
            return await self._reload(name, timeout)
        if kind == "lora_load":
            return await self._lora_load(name, timeout)
        if kind == "sleep":
            answers = await self._all_or_none(name, timeout)
        else:
            answers = await asyncio.gather(*(e.query(name, timeout) for e in self.engines))
        if kind == "memory_report":
            return merge_memory(answers)
        if kind in ("sleep", "wake_up"):  # each replica's ranks' figures, in replica order
            return {**answers[0], "ranks": [r for a in answers for r in a["ranks"]]}
        if any(a != answers[0] for a in answers):
            raise EngineError(f"the replicas answered {name!r} differently: {answers}; "
                              "restart the server")
        return answers[0]

    async def _reload(self, query: tuple, timeout: float) -> dict[str, Any]:
        """A weight reload on every replica or on none (``_all_or_none``). Only while every
        replica is paused or asleep, and a replica the reload would resume stays paused
        until all have the new weights: no replica serves them before every one has them
        (or serves them after one failed). The answer has the slowest replica's time."""
        if not all(await asyncio.gather(*(e.query("is_paused", timeout)
                                          for e in self.engines))):
            raise InvalidRequestError(
                "with --data-parallel-size a weight reload needs every replica paused or "
                "asleep (POST /pause or /sleep first), so that none serves the new weights "
                "before every one has them")
        answers = await self._all_or_none(("reload_weights", query[1], False, True), timeout)
        await asyncio.gather(*(e.query("resume", timeout)
                               for e, a in zip(self.engines, answers, strict=True)
                               if a.pop("resumes")))
        return {**answers[0], "seconds": max(a["seconds"] for a in answers)}

    async def _lora_load(self, query: tuple, timeout: float) -> tuple[int, int]:
        """A runtime LoRA load on every replica into one slot with one id, or on none: if
        one refused it, or they took unlike slots (``lora_slots``: one's slot still
        serves requests of an unloaded adapter), those that loaded it unload it again and
        the load is refused, so that no replica keeps a slot the others do not know of."""
        tried = await asyncio.gather(*(e.query(query, timeout) for e in self.engines),
                                     return_exceptions=True)
        failed = [a for a in tried if isinstance(a, BaseException)]
        if not failed and all(a == tried[0] for a in tried):
            return tried[0]
        took = [(e, a) for e, a in zip(self.engines, tried, strict=True)
                if not isinstance(a, BaseException)]
        undone = await asyncio.gather(*(e.query(("lora_unload", *a), timeout) for e, a in took),
                                      return_exceptions=True)
        stuck = [u for u in undone if isinstance(u, BaseException)]
        if stuck:
            raise EngineError(f"a LoRA load failed on some replicas and could not be taken "
                              f"back on others ({stuck[0]}): their slots now differ; "
                              "restart the server")
        if failed:
            raise failed[0]
        raise InvalidRequestError(
            f"the replicas would load the adapter into unlike LoRA slots "
            f"({[a[0] for a in tried]}): a slot still serves requests of an unloaded "
            "adapter on some replica; retry (the next load is meant for another slot)")

    async def _all_or_none(self, query: tuple, timeout: float) -> list[Any]:
        """Every replica's answer to a sleep or a weight reload; if one failed, the
        replicas where it took effect take it back and the first error is raised, so the
        replicas never serve unlike weights or differ in state:
        - a sleep: those it put to sleep (not those asleep already: no ranks in their
          answer) wake to the state it found them in, paused or running;
        - a reload: those that read the new checkpoint read the one before it again.
        If a replica cannot take it back, an EngineError says that the replicas differ."""
        tried = await asyncio.gather(*(e.query(query, timeout) for e in self.engines),
                                     return_exceptions=True)
        failed = [a for a in tried if isinstance(a, BaseException)]
        if not failed:
            return tried
        undo, retry = UNDO[query[0]]
        took = [i for i, a in enumerate(tried)  # a sleep of one asleep already: no ranks
                if not isinstance(a, BaseException) and (query[0] != "sleep" or a["ranks"])]
        undone = await asyncio.gather(*(self.engines[i].query(undo, timeout) for i in took),
                                      return_exceptions=True)
        stuck = {i: u for i, u in zip(took, undone, strict=True) if isinstance(u, BaseException)}
        logger.warning("%s failed on %d replica(s) (%s); replica(s) %s took it back",
                       query[0], len(failed), failed[0], [i for i in took if i not in stuck])
        if stuck:
            raise EngineError(f"{query[0]} failed on {len(failed)} replica(s) ({failed[0]}), "
                              f"and replica(s) {sorted(stuck)} could not take it back "
                              f"({next(iter(stuck.values()))}): the replicas now differ; "
                              f"{retry}")
        raise failed[0]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for e in self.engines:
            e.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        with ThreadPoolExecutor(len(self.engines)) as pool:
            list(pool.map(lambda e: e.shutdown(timeout), self.engines))

    def drain(self, timeout: float) -> bool:
        with ThreadPoolExecutor(len(self.engines)) as pool:
            return all(list(pool.map(lambda e: e.drain(timeout), self.engines)))

    def fail(self, reason: str) -> None:
        for e in self.engines:
            e.fail(reason)


class Pinned:
    """A beam search's replica (``DataParallelEngines.pinned``): the ``EngineProxy``, whose
    first admitted request calls ``admitted`` (the routing's record of the prompt)."""

    def __init__(self, engine: EngineProxy, admitted: Callable[[], None]):
        self.engine = engine
        self._admitted: Callable[[], None] | None = admitted

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, in_job: bool = False) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request_id, prompt_token_ids, params, self._admit,
                                    in_job=in_job)

    def _admit(self) -> None:
        admitted, self._admitted = self._admitted, None
        if admitted is not None:
            admitted()
