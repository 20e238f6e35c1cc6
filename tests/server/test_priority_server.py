"""``--scheduling-policy priority`` through the real openai client: requests' ``priority``
orders them (lower first) and a waiting request preempts a running one of a later
priority. (Without the flag a non-zero priority is refused with 400: test_app.py.)"""

from __future__ import annotations

import threading

import pytest

from tests.server.serverproc import ServerProcess


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "1",
                      "--max-model-len", "1024", "--no-engine-process",
                      "--log-stats-interval", "0.5", log_level="info")
    yield s
    assert s.stop() == 0, s.output()


def test_a_higher_priority_overtakes_the_running_request(server):
    """One seat: a long request of priority 5 streams; two more arrive (priority 0, then
    -1). Each preempts what runs at a later priority, so they finish in priority order,
    and the long one still ends with every token it was asked for."""
    client = server.client()
    model = client.models.list().data[0].id
    finished: list[str] = []
    lock = threading.Lock()
    started = threading.Event()
    errors: list[BaseException] = []

    def run(name: str, priority: int, max_tokens: int, stream: bool = False) -> None:
        try:
            kwargs = dict(model=model, prompt=f"Tell me a story about {name}.",
                          max_tokens=max_tokens, temperature=0,
                          extra_body={"priority": priority, "ignore_eos": True})
            if stream:
                usage = None
                for chunk in client.completions.create(
                        stream=True, stream_options={"include_usage": True}, **kwargs):
                    started.set()
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
            else:
                r = client.completions.create(**kwargs)
                usage = r.usage.completion_tokens
            with lock:
                finished.append(name)
            assert usage == max_tokens, (name, usage)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    long = threading.Thread(target=run, args=("low", 5, 160, True))
    long.start()
    assert started.wait(120)
    before = server.metric("num_preemptions_total")
    mid = threading.Thread(target=run, args=("mid", 0, 8))
    mid.start()
    high = threading.Thread(target=run, args=("high", -1, 8))
    high.start()
    for t in (long, mid, high):
        t.join(300)
    assert not errors, errors
    assert finished[-1] == "low" and set(finished) == {"low", "mid", "high"}
    assert server.metric("num_preemptions_total") > before
    # the engine's stats lines saw the queue and the preemptions
    lines = [line for line in server.output().splitlines() if "tpserve: engine: " in line]
    assert any("running 1, waiting 1 reqs" in line or "running 1, waiting 2 reqs" in line
               for line in lines), lines
    assert any("preemptions 0" not in line for line in lines), lines

