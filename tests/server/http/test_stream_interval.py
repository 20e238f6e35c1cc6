"""vLLM's ``stream_interval`` and ``--stream-interval`` (``http/stream_interval.py``): the
merge of outputs, and streams over a real uvicorn server and the fake engine, read by the
openai client: the first chunk at once, then chunks of at least the interval's tokens,
the last whatever is left; the text and tokens those of an unbatched stream."""

from __future__ import annotations

import openai
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob
from tpserve.server.http.app import build_app
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.stream_interval import merged

MODEL = "smol"
MESSAGES = [{"role": "user", "content": "Hi!"}]


def test_merged_joins_each_choice_in_order():
    lp = [TokenLogprob(i, str(i), -float(i)) for i in range(4)]
    a = RequestOutput("r", [CompletionDelta(0, "a", (1,), (lp[0],), prompt_logprobs=(lp[3],)),
                            CompletionDelta(1, "x", (7,), (lp[1],))], 5, 2, 3)
    b = RequestOutput("r", [CompletionDelta(1, "y", (8,), (lp[2],), "stop", 8),
                            CompletionDelta(2, "z", (9,), None)], 5, 4, 3, finished=True)
    m = merged(a, b)
    assert (m.num_output_tokens, m.finished) == (4, True)
    by = {d.index: d for d in m.deltas}
    assert (by[0].text, by[0].token_ids, by[0].prompt_logprobs) == ("a", (1,), (lp[3],))
    assert (by[1].text, by[1].token_ids, by[1].logprobs) == ("xy", (7, 8), (lp[1], lp[2]))
    assert (by[1].finish_reason, by[1].stop_reason) == ("stop", 8)
    assert by[2].logprobs is None and by[2].token_ids == (9,)


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)


def serve(engine, interval: int = 1):
    return running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                             frontend=FrontendOptions(stream_interval=interval)))


def chunk_tokens(chunks) -> list[list[int]]:
    return [c.choices[0].model_extra["token_ids"] for c in chunks
            if c.choices and c.choices[0].model_extra.get("token_ids")]


@pytest.mark.parametrize("server, asked, sizes", [
    (1, None, [1] * 10), (1, 4, [1, 4, 4, 1]), (3, None, [1, 3, 3, 3]), (3, 2, [1, 3, 3, 3]),
    (1, 20, [1, 9])])
def test_chunks_carry_the_interval(engine, server, asked, sizes):
    """The larger of the request's interval and the server's applies; chat and completions
    alike, and the tokens and text are those of the unbatched stream."""
    extra = {"return_token_ids": True, **({"stream_interval": asked} if asked else {})}
    with serve(engine, server) as url:
        c = client(url)
        whole = c.completions.create(model=MODEL, prompt="x", max_tokens=10,
                                     extra_body={"return_token_ids": True}).choices[0]
        chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=10,
                                           stream=True, extra_body=extra))
        got = chunk_tokens(chunks)
        assert [len(t) for t in got] == sizes
        assert sum(got, []) == whole.model_extra["token_ids"]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.text
        chat = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                              stream=True, extra_body=extra))
        assert [len(t) for t in chunk_tokens(chat)] == sizes


def test_a_bad_interval_is_refused(engine):
    with serve(engine) as url:
        with pytest.raises(openai.BadRequestError) as info:
            client(url).completions.create(model=MODEL, prompt="x", max_tokens=3,
                                           stream=True, extra_body={"stream_interval": 0})
        assert info.value.body["param"] == "stream_interval"
    with pytest.raises(ValueError, match="--stream-interval"):
        FrontendOptions(stream_interval=0)
