"""First contact as the README shows it, against real servers of the embedded SmolLM2: the
model's own sampling defaults (``--generation-config``), one access-log line per request,
log lines instead of a progress bar off a terminal, and a SIGTERM that exits 0 without a
leaked-semaphore warning."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess

README_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
STORY = "Once upon a time"


@pytest.fixture(scope="module")
def server():
    """The README's `tpserve serve` (engine process, --generation-config auto), logging
    at info."""
    s = ServerProcess(*SMALL, log_level="info")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server_vllm_defaults():
    """OpenAI's defaults, no access log, the engine in the HTTP process."""
    s = ServerProcess(*SMALL, "--generation-config", "vllm", "--disable-log-requests",
                      "--no-engine-process", log_level="info")
    yield s
    s.stop()


def client(s: ServerProcess) -> openai.OpenAI:
    return s.client(timeout=openai.DEFAULT_TIMEOUT)


def story_texts(s: ServerProcess, **fields) -> set[str]:
    """The continuations of STORY for seeds 0-4, one request per seed, sent together (the
    engine batches them; each request samples with its own seed)."""
    c = client(s)

    def story(seed: int) -> str:
        return c.completions.create(model=MODEL, prompt=STORY, max_tokens=16, seed=seed,
                                    **fields).choices[0].text

    with ThreadPoolExecutor(5) as pool:
        return set(pool.map(story, range(5)))


def access_lines(s: ServerProcess, path: str) -> list[str]:
    return [line.split("tpserve.access: ", 1)[1] for line in s.output().splitlines()
            if f"tpserve.access: POST {path} " in line]


def wait_for_lines(s: ServerProcess, path: str, count: int, timeout: float = 30.0
                   ) -> list[str]:
    """The access lines of ``path`` once there are ``count`` (a line is written just
    after its response has been sent)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = access_lines(s, path)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_the_readme_example_answers_paris_for_every_seed(server):
    c = client(server)

    def answer(seed: int) -> str:
        return c.chat.completions.create(model=MODEL, messages=README_MESSAGES,
                                         seed=seed).choices[0].message.content

    with ThreadPoolExecutor(10) as pool:  # ten requests in flight at once: one batch
        answers = list(pool.map(answer, range(10)))
    for seed, content in enumerate(answers):
        assert "Paris" in content, (seed, content)


def test_the_defaults_are_on_the_model_card_and_in_the_log(server):
    card = httpx.get(server.base + "/v1/models", timeout=10).json()["data"][0]
    assert card["default_sampling_params"] == {"temperature": 0.0}
    assert [m.id for m in client(server).models.list()] == [MODEL]
    assert ("default sampling parameters (the embedded SmolLM2's measured defaults): "
            "temperature=0.0") in server.output()


def test_a_requests_temperature_overrides_the_default(server):
    assert len(story_texts(server)) == 1  # greedy: the seed does not matter
    assert len(story_texts(server, temperature=1.0)) > 1


def test_generation_config_vllm_reverts_to_openai_defaults(server_vllm_defaults):
    s = server_vllm_defaults
    card = httpx.get(s.base + "/v1/models", timeout=10).json()["data"][0]
    assert card["default_sampling_params"] == {}
    assert len(story_texts(s)) > 1  # temperature 1: each seed its own continuation
    assert len(story_texts(s, temperature=0)) == 1
    assert "default sampling parameters (--generation-config vllm): OpenAI's defaults" in (
        s.output())
    assert "tpserve.access" not in s.output()  # --disable-log-requests


def test_the_access_log_counts_an_echoed_prompt_as_its_usage(server):
    """``echo`` with ``max_tokens: 0``: the line counts no completion token, as the usage
    does (the one token the engine samples is dropped)."""
    before = len(access_lines(server, "/v1/completions"))
    r = client(server).completions.create(model=MODEL, prompt=STORY, max_tokens=0, echo=True)
    assert r.usage.completion_tokens == 0 and r.choices[0].text == STORY
    lines = wait_for_lines(server, "/v1/completions", before + 1)
    assert lines[before].startswith(f"POST /v1/completions 200 prompt_tokens="
                                    f"{r.usage.prompt_tokens} completion_tokens=0 "), lines


def test_one_access_log_line_per_request(server):
    c = client(server)
    before = len(access_lines(server, "/v1/completions"))
    expected = []
    for max_tokens in (3, 4):
        r = c.completions.create(model=MODEL, prompt=STORY, max_tokens=max_tokens,
                                 extra_body={"ignore_eos": True})
        expected.append(f"POST /v1/completions 200 prompt_tokens={r.usage.prompt_tokens} "
                        f"completion_tokens={max_tokens}")
    stream = c.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True,
                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    prompt_tokens = httpx.post(server.base + "/tokenize", json={"prompt": "Hello"},
                               timeout=10).json()["count"]
    expected.append(f"POST /v1/completions 200 prompt_tokens={prompt_tokens} "
                    f"completion_tokens=5")
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt=STORY, max_tokens=0)
    expected.append("POST /v1/completions 400 prompt_tokens=- completion_tokens=-")

    lines = wait_for_lines(server, "/v1/completions", before + len(expected))
    new = lines[before:]
    assert [line.rsplit(" latency_ms=", 1)[0] for line in new] == expected
    for line in new:
        assert float(line.rsplit(" latency_ms=", 1)[1]) >= 0
    assert '"POST /v1/completions HTTP/1.1"' not in server.output()  # uvicorn's log is off


def test_weights_loading_logs_lines_not_a_bar(server):
    out = server.output()
    assert "\r" not in out
    assert "loading SmolLM2-135M-Instruct.Q4_1.gguf: 272 tensors" in out
    assert "loaded SmolLM2-135M-Instruct.Q4_1.gguf: 272 tensors in " in out


def test_sagemaker_invocations_answer_as_the_route_the_body_names(server):
    """``POST /invocations`` (SageMaker, as vLLM serves it): a chat body is answered as
    chat completions, a prompt as completions, an ``input`` by the Responses API, streams
    too; a body naming no API, or not an object, is a 400; an invalid chat body gets the
    chat route's own 400. ``/ping`` (GET and POST) is the health check."""
    chat = {"model": MODEL, "messages": README_MESSAGES, "max_tokens": 8, "temperature": 0}
    text = {"model": MODEL, "prompt": STORY, "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=server.base, timeout=60) as h:
        for body, route, obj in ((chat, "/v1/chat/completions", "chat.completion"),
                                 (text, "/v1/completions", "text_completion")):
            got, want = h.post("/invocations", json=body), h.post(route, json=body)
            assert got.status_code == want.status_code == 200, got.text
            assert got.json()["object"] == obj
            assert got.json()["choices"] == want.json()["choices"]
        answer = h.post("/invocations", json={"model": MODEL, "input": STORY, "temperature": 0,
                                              "max_output_tokens": 8})
        assert answer.status_code == 200 and answer.json()["object"] == "response"
        with h.stream("POST", "/invocations", json={**chat, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        streamed = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                           for d in data[:-1] if json.loads(d)["choices"])
        assert streamed == h.post("/v1/chat/completions", json=chat).json()[
            "choices"][0]["message"]["content"]
        for bad in ({"model": MODEL, "question": "?"}, [1, 2]):
            r = h.post("/invocations", json=bad)
            assert r.status_code == 400, r.text
            assert set(r.json()) == {"error"}
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert "could not tell which API" in h.post(
            "/invocations", json={"question": "?"}).json()["error"]["message"]
        wrong = {**chat, "max_tokens": "many"}
        assert h.post("/invocations", json=wrong).json() == \
            h.post("/v1/chat/completions", json=wrong).json()
        assert h.get("/ping").status_code == h.post("/ping").status_code == 200
    lines = wait_for_lines(server, "/invocations", 8)
    assert len(lines) == 8 and sum(" 200 " in line for line in lines) == 4, lines


@pytest.mark.parametrize("name", ["server", "server_vllm_defaults"])
def test_sigterm_exits_0_without_a_leaked_semaphore(request, name):
    s = request.getfixturevalue(name)
    assert s.stop() == 0
    out = s.output()
    assert "drained: all requests finished" in out
    assert "leaked semaphore" not in out and "resource_tracker" not in out, out[-2000:]



def test_ctrl_c_during_start_up_exits_130_without_a_traceback():
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the model
    loads, before the server's own handler is installed: one line and exit 130 (a shell's
    code for SIGINT), no traceback, the engine process gone with it."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tpserve.cli", "serve", "--port", "0",
                             "--log-level", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = []
    try:
        for line in proc.stdout:  # until the weights start loading
            out.append(line)
            if "loading " in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        out.extend(proc.stdout)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(out)
    assert code == 130, text[-2000:]
    assert text.rstrip().endswith("tpserve: interrupted during start-up"), text[-2000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]
