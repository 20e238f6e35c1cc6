"""``TurnBatch`` (``engine/front.py``): the requests submitted in one turn of the event loop
reach the engine as one list at the end of that turn, and a command sent after them
(``flush`` first) never overtakes them."""

from __future__ import annotations

import asyncio

from tpserve.server.engine.front import TurnBatch


def test_one_turns_requests_are_delivered_together_at_its_end():
    delivered: list[list[str]] = []

    async def main() -> None:
        batch = TurnBatch(delivered.append)
        for name in ("a", "b", "c"):
            batch.add(name)
        assert delivered == []  # not before the turn ends
        await asyncio.sleep(0)
        assert delivered == [["a", "b", "c"]]
        batch.add("d")
        await asyncio.sleep(0)
        assert delivered == [["a", "b", "c"], ["d"]]

    asyncio.run(main())


def test_a_flush_delivers_at_once_and_keeps_the_order_of_commands():
    sent: list = []

    async def main() -> None:
        batch = TurnBatch(lambda adds: sent.append(("add", adds)))

        def abort(rid: str) -> None:  # as the transports send every other command
            batch.flush()
            sent.append(("abort", rid))

        batch.add("a")
        batch.add("b")
        abort("b")
        batch.add("c")
        await asyncio.sleep(0)  # the turn's callback finds only "c"; the flushed ones once
        await asyncio.sleep(0)
        assert sent == [("add", ["a", "b"]), ("abort", "b"), ("add", ["c"])]

    asyncio.run(main())

