"""A small fake OpenAI-compatible streaming server for load-test tests.

Tokens are words: a prompt has 1 (BOS) + len(prompt.split()) tokens, and a chat prompt
CHAT_TEMPLATE_TOKENS more. Every request streams ``max_tokens`` one-word chunks (or
``eos_after`` of them when ignore_eos is not set), then a usage chunk and [DONE].
Failures can be injected on every k-th request: a 500 response, or an error event in
the stream after two tokens. The server counts what it received and generated, under a
lock, so that tests can compare the load test's report with the server's own count.

``/v1/embeddings`` answers one input with a base64 float32 vector of EMBEDDING_DIM values
(after ``token_delay`` seconds); on every k-th request (``fail_every``) it fails by
``fail_mode``: "http" a 500, or one of EMBEDDING_FAULTS, a 200 answer that is wrong.

The load test sends one initial test request before its run (vLLM's "initial test run").
With ``initial_test`` (the default) the server's first generation or embeddings request
is taken as that one: answered at once and correctly (no delay, no injected failure),
kept in ``stats.initial_test_body`` and left out of every other count, so that the
counts are those of the measured requests.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"
CHAT_TEMPLATE_TOKENS = 5
TOKENS_BEFORE_STREAM_ERROR = 2
DONE = "data: [DONE]\n\n"
EMBEDDING_DIM = 8
EMBEDDING_FAULTS = ("empty", "not_base64", "odd_bytes", "two_items", "nan", "no_usage")


@dataclass
class FakeServerOptions:
    """How the fake server behaves; may be changed while it runs."""

    fail_every: int = 0
    fail_mode: str = "http"  # "http": a 500; "stream": an error mid-stream; EMBEDDING_FAULTS
    token_delay: float = 0.0
    eos_after: int | None = None
    tokenize: bool = True
    tokenize_messages: bool = True
    api_key: str | None = None
    initial_test: bool = True
    include_usage: bool = True  # end each stream with its usage chunk
    chat_field: str = "content"  # the delta field of a chat chunk's word ("reasoning", ...)
    no_choices: bool = False  # stream only the usage chunk and [DONE], no token


@dataclass
class FakeServerStats:
    """What the server saw; guard with ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    succeeded: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    completed_tokens: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    prompts: list[str] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    initial_test_body: dict | None = None


def count_tokens(text: str) -> int:
    return 1 + len(text.split())


def build_app(options: FakeServerOptions, stats: FakeServerStats) -> FastAPI:
    app = FastAPI()

    def is_initial_test(body: dict) -> bool:
        """Whether body is the load test's initial test request (see the docstring)."""
        with stats.lock:
            if options.initial_test and stats.initial_test_body is None:
                stats.initial_test_body = body
                return True
        return False

    def unauthorized(request: Request) -> JSONResponse | None:
        if options.api_key and request.headers.get("authorization") != f"Bearer {options.api_key}":
            return JSONResponse({"error": {"message": "bad api key", "type": "auth"}}, 401)
        return None

    @app.get("/v1/models")
    async def models(request: Request):
        return unauthorized(request) or {"object": "list",
                                         "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        if not options.tokenize:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = await request.json()
        if "messages" in body:
            if not options.tokenize_messages:
                return JSONResponse({"error": {"message": "no chat tokenize"}}, 400)
            n = count_tokens(body["messages"][-1]["content"]) + CHAT_TEMPLATE_TOKENS
        else:
            n = count_tokens(body["prompt"])
        return {"count": n, "tokens": list(range(n)), "max_model_len": 4096}

    async def generate(request: Request, chat: bool):
        if (denied := unauthorized(request)) is not None:
            return denied
        body = await request.json()
        if chat:
            prompt = body["messages"][-1]["content"]
            prompt_tokens = count_tokens(prompt) + CHAT_TEMPLATE_TOKENS
        else:
            prompt = body["prompt"]
            prompt_tokens = count_tokens(prompt)
        if is_initial_test(body):
            return StreamingResponse(events(chat, prompt_tokens, body.get("max_tokens", 16),
                                            None, counted=False),
                                     media_type="text/event-stream")
        with stats.lock:
            stats.requests += 1
            number = stats.requests
            stats.prompts.append(prompt)
            stats.bodies.append(body)
        failing = options.fail_every > 0 and number % options.fail_every == 0
        if failing and options.fail_mode == "http":
            return JSONResponse(
                {"error": {"message": "injected failure", "type": "InternalServerError",
                           "param": None, "code": 500}}, 500)
        n = body.get("max_tokens", 16)
        if options.eos_after is not None and not body.get("ignore_eos"):
            n = min(n, options.eos_after)
        fail_after = TOKENS_BEFORE_STREAM_ERROR if failing else None
        return StreamingResponse(
            stream(chat, prompt_tokens, n, fail_after), media_type="text/event-stream")

    async def stream(chat: bool, prompt_tokens: int, n: int, fail_after: int | None):
        """events(), counted in flight until just before [DONE] is sent (so that a client
        never sees [DONE] while the request still counts)."""
        with stats.lock:
            stats.in_flight += 1
            stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        finished = False
        try:
            async for event in events(chat, prompt_tokens, n, fail_after):
                if event == DONE:
                    finished = True
                    with stats.lock:
                        stats.in_flight -= 1
                yield event
        finally:
            if not finished:
                with stats.lock:
                    stats.in_flight -= 1

    async def events(chat: bool, prompt_tokens: int, n: int, fail_after: int | None,
                     counted: bool = True):
        rid = f"cmpl-{time.monotonic_ns()}"
        kind = "chat.completion.chunk" if chat else "text_completion"
        if options.no_choices and counted:
            n = 0
        elif chat:
            yield _sse({"id": rid, "object": kind, "model": MODEL_ID,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n):
            if fail_after is not None and i == fail_after:
                yield _sse({"error": {"message": "injected stream error",
                                      "type": "InternalServerError", "code": 500}})
                yield DONE
                return
            if options.token_delay and counted:
                await asyncio.sleep(options.token_delay)
            word = f" w{i}"
            choice = ({"index": 0, "delta": {options.chat_field: word}, "finish_reason": None}
                      if chat
                      else {"index": 0, "text": word, "finish_reason": None})
            if counted:
                with stats.lock:
                    stats.generated_tokens += 1
            yield _sse({"id": rid, "object": kind, "model": MODEL_ID, "choices": [choice]})
        if counted:
            with stats.lock:
                stats.succeeded += 1
                stats.prompt_tokens += prompt_tokens
                stats.completed_tokens += n
        if options.include_usage:
            yield _sse({"id": rid, "object": kind, "model": MODEL_ID, "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                  "total_tokens": prompt_tokens + n}})
        yield DONE

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        body = await request.json()
        if is_initial_test(body):
            return embedding_answer(count_tokens(body["input"]), None)
        with stats.lock:
            stats.requests += 1
            number = stats.requests
            stats.prompts.append(body["input"])
            stats.bodies.append(body)
        if options.token_delay:
            await asyncio.sleep(options.token_delay)
        fault = (options.fail_mode if options.fail_every > 0
                 and number % options.fail_every == 0 else None)
        if fault == "http":
            return JSONResponse({"error": {"message": "injected failure",
                                           "type": "InternalServerError", "code": 500}}, 500)
        prompt_tokens = count_tokens(body["input"])
        answer = embedding_answer(prompt_tokens, fault)
        if fault is None:
            with stats.lock:
                stats.succeeded += 1
                stats.prompt_tokens += prompt_tokens
        return answer

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def embedding_answer(prompt_tokens: int, fault: str | None) -> dict:
    """An embeddings answer for one input; wrong as EMBEDDING_FAULTS' ``fault`` says."""
    values = [float("nan")] * EMBEDDING_DIM if fault == "nan" else [0.5] * EMBEDDING_DIM
    encoded = base64.b64encode(array.array("f", values).tobytes()).decode("ascii")
    encoded = {"empty": "", "not_base64": "not base64!",
               "odd_bytes": base64.b64encode(b"12345").decode("ascii")}.get(fault, encoded)
    item = {"index": 0, "object": "embedding", "embedding": encoded}
    answer: dict = {"object": "list", "model": MODEL_ID,
                    "data": [item, {**item, "index": 1}] if fault == "two_items" else [item],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                              "total_tokens": prompt_tokens}}
    if fault == "no_usage":
        del answer["usage"]
    return answer


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@dataclass
class FakeServer:
    base_url: str
    options: FakeServerOptions
    stats: FakeServerStats


@contextlib.contextmanager
def run_fake_server(**options) -> Iterator[FakeServer]:
    """Serve the fake on 127.0.0.1 at a free port in a background thread."""
    opts = FakeServerOptions(**options)
    stats = FakeServerStats()
    config = uvicorn.Config(build_app(opts, stats), host="127.0.0.1", port=0,
                            log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake OpenAI server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield FakeServer(f"http://127.0.0.1:{port}", opts, stats)
    finally:
        server.should_exit = True
        thread.join(timeout=20)
