"""Data-parallel routing and queries (``server/data_parallel.py``) over fake replicas: real
``EngineFront``s (validation, backpressure) whose transport holds each request until the
test finishes it. A request goes only to a replica with room for it (prefix owner
included), weighs ``n`` sequences, claims its prefix and the turn only once admitted;
``X-data-parallel-rank`` pins a replica; a runtime LoRA load is all or none."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.data_parallel import DataParallelEngines
from tpserve.server.engine.errors import (
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from tpserve.server.engine.front import EngineFront
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.engine_client import data_parallel_rank

BLOCK = 16


class FakeTransport:
    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.answers: list[Any] = []  # what the next queries answer (an exception: raised)
        self.asked: list[Any] = []

    def submit(self, request_id, prompt_token_ids, params, outputs) -> None:
        self.queues[request_id] = outputs

    def release(self, request_id) -> None:
        self.queues.pop(request_id, None)

    def abort(self, request_id) -> None:
        pass

    def query(self, query_id, name, answer) -> None:
        self.asked.append(name)
        value = self.answers.pop(0) if self.answers else None
        if isinstance(value, BaseException):
            answer.set_exception(value)
        else:
            answer.set_result(value)

    def forget_query(self, query_id) -> None:
        pass

    def is_alive(self) -> bool:
        return True


class FakeReplica(EngineFront):
    """max_num_seqs 3, no queue; 512 prompt tokens in flight at most."""

    def __init__(self) -> None:
        self.dead_reason = None
        self._init_front(FakeTransport(), "m", 4096, None, 50000, 3, 512, 0, 0, frozenset())

    def finish(self, request_id: str) -> None:
        self.transport.queues[request_id].put_nowait(
            RequestOutput(request_id, [], finished=True))


def _dp(n: int = 2) -> DataParallelEngines:
    dp = DataParallelEngines.__new__(DataParallelEngines)
    dp._adopt([FakeReplica() for _ in range(n)], BLOCK, 3)
    return dp


def _prompt(length: int, start: int = 1000) -> list[int]:
    return list(range(start, start + length))


async def _start(engine, rid: str, prompt: list[int], n: int = 1):
    """Starts a request up to its submission; returns its generator, or the error that
    refused it."""
    gen = engine.generate(rid, prompt, SamplingParams(max_tokens=4, n=n))
    task = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0)
    if task.done():
        return task.exception()
    return gen, task


def _where(dp: DataParallelEngines, rid: str) -> int:
    (index,) = [i for i, e in enumerate(dp.engines) if rid in e.transport.queues]
    return index


def test_a_replica_without_room_is_skipped_and_429_only_when_none_has_room():
    async def run():
        dp = _dp()
        await _start(dp, "a", _prompt(400))
        await _start(dp, "b", _prompt(10, 2000))
        await _start(dp, "c", _prompt(10, 3000))
        assert [_where(dp, r) for r in "abc"] == [0, 1, 1]
        # fewer requests on 0, but 400 + 200 tokens are over its 512: replica 1 takes it
        await _start(dp, "d", _prompt(200, 4000))
        assert _where(dp, "d") == 1
        # now 1 holds its 3 requests and 0 has no room for 200 tokens: 429
        refused = await _start(dp, "e", _prompt(200, 5000))
        assert isinstance(refused, EngineOverloadedError), refused
        assert "server is at capacity (1 requests, 400 prompt tokens" in str(refused)
        await _start(dp, "f", _prompt(50, 6000))
        assert _where(dp, "f") == 0
    asyncio.run(run())


def test_the_prefix_owner_at_capacity_does_not_take_it():
    async def run():
        dp = _dp()
        shared = _prompt(96)
        p = [shared + _prompt(8, 2000 + 10 * i) for i in range(4)]
        q = [_prompt(104, 5000 + 200 * i) for i in range(2)]
        for rid, prompt in (("p0", p[0]), ("q0", q[0]), ("p1", p[1]), ("q1", q[1]),
                            ("p2", p[2])):
            await _start(dp, rid, prompt)
        assert [_where(dp, r) for r in ("p0", "q0", "p1", "q1", "p2")] == [0, 1, 0, 1, 0]
        assert dp.engines[0].outstanding == 3  # the owner is full
        await _start(dp, "p3", p[3])
        assert _where(dp, "p3") == 1
    asyncio.run(run())


def test_n_weighs_the_load_in_sequences():
    async def run():
        dp = _dp()
        wide = await _start(dp, "wide", _prompt(4), n=8)
        await _start(dp, "a", _prompt(4, 2000))
        await _start(dp, "b", _prompt(4, 3000))
        # one request of 8 sequences on 0: both later ones go to 1
        assert [_where(dp, r) for r in ("wide", "a", "b")] == [0, 1, 1]
        assert [e.outstanding_seqs for e in dp.engines] == [8, 2]
        dp.engines[0].finish("wide")
        assert (await wide[1]).finished
        await wide[0].aclose()
        assert [e.outstanding_seqs for e in dp.engines] == [0, 2]
    asyncio.run(run())


def test_a_refused_request_claims_no_prefix_and_no_turn():
    async def run():
        dp = _dp()
        long = _prompt(4000)  # + max_tokens over the 4096-token context: 400
        refused = await _start(dp, "x", long + [1] * 100)
        assert isinstance(refused, PromptTooLongError)
        assert len(dp._affinity) == 0 and dp._turn == 0
        refused = await _start(dp, "y", _prompt(10, 2000) + [50001])  # outside the vocab
        assert isinstance(refused, InvalidRequestError) and dp._turn == 0
        await _start(dp, "a", _prompt(96))
        assert _where(dp, "a") == 0 and dp._turn == 1 and len(dp._affinity) == 6
    asyncio.run(run())


def test_a_beam_search_replica_records_its_prompt_once_admitted():
    async def run():
        dp = _dp()
        prompt = _prompt(96)
        pinned = dp.pinned(prompt, SamplingParams(max_tokens=1, n=2))
        assert len(dp._affinity) == 0  # nothing admitted yet
        assert pinned.eos_token_ids == frozenset() and pinned.tokenizer is None
        await _start(pinned, "s0-b0", prompt)
        assert _where(dp, "s0-b0") == 0
        assert len(dp._affinity) == 6 and dp._turn == 1
        await _start(dp, "again", prompt + [7] * 16)
        assert _where(dp, "again") == 0  # the beam search's prompt is replica 0's
    asyncio.run(run())


def test_the_data_parallel_rank_header_pins_a_replica():
    async def run():
        dp = _dp()
        for k in range(3):
            await _start(dp.at_rank(1), f"r{k}", _prompt(96))
        assert [_where(dp, f"r{k}") for k in range(3)] == [1, 1, 1]
        assert len(dp._affinity) == 0 and dp._turn == 0  # no routing
        refused = await _start(dp.at_rank(1), "full", _prompt(4, 3000))
        assert isinstance(refused, EngineOverloadedError)  # that replica's own backpressure
    asyncio.run(run())
    dp = _dp()
    for rank in (2, -1):
        with pytest.raises(InvalidRequestError,
                           match=rf"^data_parallel_rank {rank} is out of range \[0, 2\)\.$"):
            dp.at_rank(rank)
    one = FakeReplica()
    assert one.at_rank(0) is one
    with pytest.raises(InvalidRequestError, match=r"data_parallel_rank 1 is out of range \[0, 1\)"):
        one.at_rank(1)
    assert data_parallel_rank({"X-data-parallel-rank": "1"}) == 1
    assert data_parallel_rank({"X-data-parallel-rank": "one"}) is None  # as vLLM: ignored
    assert data_parallel_rank({}) is None


def _loads(dp: DataParallelEngines, *answers: Any) -> None:
    for engine, answer in zip(dp.engines, answers, strict=True):
        engine.transport.answers = [answer, None]  # the load's answer, then an unload's


def test_a_lora_load_is_on_every_replica_in_one_slot_or_on_none():
    async def run():
        dp = _dp()
        _loads(dp, (1, 5), (1, 5))
        assert await dp.query(("lora_load", "/a")) == (1, 5)
        assert [e.transport.asked for e in dp.engines] == [[("lora_load", "/a")]] * 2
        # replica 1 refuses: replica 0 unloads what it loaded
        dp = _dp()
        _loads(dp, (1, 6), InvalidRequestError("every one of the 2 LoRA slots"))
        with pytest.raises(InvalidRequestError, match="every one of the 2 LoRA slots"):
            await dp.query(("lora_load", "/a"))
        assert dp.engines[0].transport.asked == [("lora_load", "/a"), ("lora_unload", 1, 6)]
        assert dp.engines[1].transport.asked == [("lora_load", "/a")]
        # unlike slots: both unload, and the load is refused
        dp = _dp()
        _loads(dp, (1, 7), (2, 7))
        with pytest.raises(InvalidRequestError, match=r"unlike LoRA slots \(\[1, 2\]\)"):
            await dp.query(("lora_load", "/a"))
        assert [e.transport.asked[1:] for e in dp.engines] == [[("lora_unload", 1, 7)],
                                                               [("lora_unload", 2, 7)]]
        # an unload that fails too: the replicas differ, said so
        dp = _dp()
        dp.engines[0].transport.answers = [(1, 8), EngineError("boom")]
        dp.engines[1].transport.answers = [InvalidRequestError("no")]
        with pytest.raises(EngineError, match="could not be taken back on others"):
            await dp.query(("lora_load", "/a"))
    asyncio.run(run())


def test_a_request_no_idle_replica_admits_is_a_400_not_a_429():
    """n x prompt tokens over what a replica admits at once (512 here: queued tokens plus
    one step's budget): a 400 saying a retry cannot succeed, on an idle server too, where
    a 429 would send clients (the openai SDK retries 429s) retrying forever. vLLM has no
    such cap by default; its optional one refuses likewise."""
    async def run():
        dp = _dp()
        for prompt, n in ((_prompt(513), 1), (_prompt(300), 2)):
            refused = await _start(dp, "x", prompt, n=n)
            assert isinstance(refused, InvalidRequestError), refused
            assert f"({n} x {len(prompt)} = {n * len(prompt)}) exceed what this server " \
                   "admits at once (512" in str(refused)
        await _start(dp, "a", _prompt(256), n=2)  # 512: admitted
        assert _where(dp, "a") == 0
    asyncio.run(run())
