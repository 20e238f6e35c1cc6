"""``tpserve soak``: many mixed requests, some cut off by the client; then the server must be idle.

The soak sends ``--num-requests`` requests (after a warm-up) with ``--concurrency`` in
flight: random-word prompts of 1..``--max-prompt-words`` (300) words, max_tokens
1..``--max-tokens`` (64), completions and chat, streamed and whole, some with ``n=2``,
some with stop strings, and a fraction that the client aborts at a random moment (closing
the stream after a random number of events, or cancelling the request task after a random
delay). It then checks that

* every request ended with a full answer (each choice has finish_reason ``stop`` or
  ``length``, usage is sane, a stream ends with ``data: [DONE]``) or with an explicit
  error (HTTP 4xx/5xx in OpenAI's error envelope, or an SSE error event); anything else
  (no answer within ``--request-timeout``, a stream cut short, malformed JSON, a broken
  connection) is a failure;
* within ``--drain-timeout`` of the last request, the server's ``/metrics`` shows no
  running and no waiting request and a free KV pool (``tpserve:kv_cache_usage_perc`` 0);
* ``GET /health`` still answers 200 (a dead engine would turn every request into an
  explicit 503, which alone would pass);
* with ``--server-pid``, the server's resident memory (VmRSS) grew by less than
  ``--max-rss-growth-mib`` between the end of the warm-up and the end of the soak.

Exit status: 0 when every check holds, 1 when one does not, 2 when the soak could not
start (bad flag, server unreachable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tpserve.loadtest.datasets import random_words
from tpserve.loadtest.session import SetupError, resolve_model
from tpserve.loadtest.sse import iter_events

EXIT_OK, EXIT_FAILED, EXIT_SETUP = 0, 1, 2

COMPLETED, ERRORED, ABORTED, FAILED = "completed", "errored", "aborted", "failed"
OUTCOMES = (COMPLETED, ERRORED, ABORTED, FAILED)
FINISH_REASONS = frozenset({"stop", "length"})

MAX_PROMPT_WORDS = 300
MAX_OUTPUT_TOKENS = 64
STOP_STRINGS = (".", "\n", ",", " the", "!", "?", " and")
TEMPERATURES = (0.0, 0.7, 1.0)
P_CHAT, P_STREAM, P_N2, P_STOP, P_SYSTEM, P_USAGE = 0.5, 0.5, 0.15, 0.3, 0.2, 0.5
MAX_ABORT_DELAY_S = 2.0
IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
METRIC_PREFIX = "tpserve:"
CONNECT_TIMEOUT_S = 30.0
POLL_S = 0.25
MAX_LISTED_FAILURES = 20
MAX_DETAIL_CHARS = 300


# ----------------------------------------------------------------------------- flags


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tpserve soak`` flags to ``parser``."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, without /v1 (default: %(default)s)")
    server.add_argument("--api-key", default=None,
                        help="bearer token (default: the OPENAI_API_KEY environment variable)")
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    server.add_argument("--server-pid", type=int, default=None,
                        help="pid of the server process on this machine; its VmRSS is read "
                             "after the warm-up and after the soak (default: not checked)")

    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=2000,
                      help="requests of the soak, after the warm-up (default: %(default)s)")
    load.add_argument("--concurrency", type=int, default=32,
                      help="requests in flight at once (default: %(default)s)")
    load.add_argument("--warmup-requests", type=int, default=50,
                      help="requests of the same mix sent before the RSS baseline is read "
                           "(default: %(default)s)")
    load.add_argument("--max-tokens", type=int, default=MAX_OUTPUT_TOKENS,
                      help="max_tokens of each request is drawn from 1..this "
                           "(default: %(default)s)")
    load.add_argument("--max-prompt-words", type=int, default=MAX_PROMPT_WORDS,
                      help="each prompt has 1..this random words, about one token each "
                           "(default: %(default)s)")
    load.add_argument("--abort-fraction", type=float, default=0.2,
                      help="fraction of requests the client aborts at a random moment "
                           "(default: %(default)s)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the request mix (default: %(default)s)")

    checks = parser.add_argument_group("checks")
    checks.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds one request may take before it counts as hung "
                             "(default: %(default)s)")
    checks.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds to wait, after the last request, for /metrics to show "
                             "an idle server and a free KV pool (default: %(default)s)")
    checks.add_argument("--max-rss-growth-mib", type=float, default=200.0,
                        help="largest allowed growth of the server's RSS over the soak, in "
                             "MiB (with --server-pid) (default: %(default)s)")

    out = parser.add_argument_group("output")
    out.add_argument("--result-file", type=Path, default=None,
                     help="write the JSON result here")
    out.add_argument("--no-progress", dest="progress", action="store_false",
                     help="do not print progress lines")


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    api_key: str | None
    model: str | None
    server_pid: int | None
    num_requests: int
    concurrency: int
    warmup_requests: int
    max_tokens: int
    max_prompt_words: int
    abort_fraction: float
    seed: int
    request_timeout: float
    drain_timeout: float
    max_rss_growth_mib: float
    result_file: Path | None
    progress: bool

    def parameters(self) -> dict[str, Any]:
        """The flags as stored in the JSON result (never the API key)."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "server_pid": self.server_pid,
            "num_requests": self.num_requests,
            "concurrency": self.concurrency,
            "warmup_requests": self.warmup_requests,
            "max_tokens": self.max_tokens,
            "max_prompt_words": self.max_prompt_words,
            "abort_fraction": self.abort_fraction,
            "seed": self.seed,
            "request_timeout": self.request_timeout,
            "drain_timeout": self.drain_timeout,
            "max_rss_growth_mib": self.max_rss_growth_mib,
        }


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """Validate the parsed flags; raise SetupError naming the first bad one."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SetupError(message)

    base_url = args.base_url.rstrip("/").removesuffix("/v1").rstrip("/")
    need(base_url.startswith(("http://", "https://")),
         f"--base-url must start with http:// or https://, got {args.base_url!r}")
    need(args.num_requests >= 1, "--num-requests must be at least 1")
    need(args.concurrency >= 1, "--concurrency must be at least 1")
    need(args.warmup_requests >= 0, "--warmup-requests must be 0 or more")
    need(args.max_tokens >= 1, "--max-tokens must be at least 1")
    need(args.max_prompt_words >= 1, "--max-prompt-words must be at least 1")
    need(0.0 <= args.abort_fraction <= 1.0, "--abort-fraction must be in [0, 1]")
    need(args.request_timeout > 0, "--request-timeout must be positive")
    need(args.drain_timeout > 0, "--drain-timeout must be positive")
    need(args.max_rss_growth_mib > 0, "--max-rss-growth-mib must be positive")
    if args.server_pid is not None:
        try:
            read_rss_mib(args.server_pid)
        except (OSError, ValueError) as e:
            raise SetupError(f"--server-pid {args.server_pid}: cannot read its VmRSS "
                             f"({e})") from None
    if args.result_file is not None:
        folder = args.result_file.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SetupError(f"--result-file {args.result_file}: cannot create its folder "
                             f"({e})") from None
        need(os.access(folder, os.W_OK), f"--result-file: folder {folder} is not writable")
    return SoakConfig(
        base_url=base_url,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        model=args.model,
        server_pid=args.server_pid,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        warmup_requests=args.warmup_requests,
        max_tokens=args.max_tokens,
        max_prompt_words=args.max_prompt_words,
        abort_fraction=args.abort_fraction,
        seed=args.seed,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        max_rss_growth_mib=args.max_rss_growth_mib,
        result_file=args.result_file,
        progress=args.progress,
    )


# ----------------------------------------------------------------------------- the mix


@dataclass(frozen=True)
class RequestPlan:
    """One request of the soak and, if the client is to abort it, when."""

    index: int
    chat: bool
    stream: bool
    n: int
    max_tokens: int
    prompt: str
    num_words: int
    system: str | None = None
    stop: str | list[str] | None = None
    temperature: float = 1.0
    seed: int | None = None
    include_usage: bool = False
    abort_after_events: int | None = None  # streams: close after this many SSE events
    abort_after_s: float | None = None  # cancel the request task after this delay

    @property
    def abort_planned(self) -> bool:
        return self.abort_after_events is not None or self.abort_after_s is not None

    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "n": self.n,
                                "temperature": self.temperature, "stream": self.stream}
        if self.chat:
            messages = [{"role": "user", "content": self.prompt}]
            if self.system is not None:
                messages.insert(0, {"role": "system", "content": self.system})
            body["messages"] = messages
        else:
            body["prompt"] = self.prompt
        if self.stop is not None:
            body["stop"] = self.stop
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    def describe(self) -> str:
        parts = [f"#{self.index}", "chat" if self.chat else "completions",
                 "stream" if self.stream else "whole", f"n={self.n}",
                 f"max_tokens={self.max_tokens}", f"words={self.num_words}"]
        if self.stop is not None:
            parts.append(f"stop={self.stop!r}")
        if self.abort_after_events is not None:
            parts.append(f"abort after {self.abort_after_events} events")
        if self.abort_after_s is not None:
            parts.append(f"abort after {self.abort_after_s:.2f}s")
        return " ".join(parts)


def make_plans(rng: np.random.Generator, count: int, abort_fraction: float,
               first_index: int = 0, max_tokens: int = MAX_OUTPUT_TOKENS,
               max_prompt_words: int = MAX_PROMPT_WORDS) -> list[RequestPlan]:
    """``count`` random requests of the soak's mix."""
    plans = []
    for i in range(count):
        chat = bool(rng.random() < P_CHAT)
        stream = bool(rng.random() < P_STREAM)
        num_words = int(rng.integers(1, max_prompt_words + 1))
        tokens = int(rng.integers(1, max_tokens + 1))
        stop: str | list[str] | None = None
        if rng.random() < P_STOP:
            picked = [STOP_STRINGS[j] for j in rng.choice(len(STOP_STRINGS),
                                                          size=int(rng.integers(1, 3)),
                                                          replace=False)]
            stop = picked[0] if len(picked) == 1 and rng.random() < 0.5 else picked
        system = None
        if chat and rng.random() < P_SYSTEM:
            system = " ".join(random_words(rng, int(rng.integers(1, 20))))
        temperature = float(TEMPERATURES[int(rng.integers(len(TEMPERATURES)))])
        seed = int(rng.integers(0, 2**31)) if rng.random() < 0.5 else None
        abort_after_events = abort_after_s = None
        if rng.random() < abort_fraction:
            if stream and rng.random() < 0.5:
                abort_after_events = int(rng.integers(0, tokens + 2))
            else:
                abort_after_s = float(rng.uniform(0.0, MAX_ABORT_DELAY_S))
        plans.append(RequestPlan(
            index=first_index + i, chat=chat, stream=stream,
            n=2 if rng.random() < P_N2 else 1, max_tokens=tokens,
            prompt=" ".join(random_words(rng, num_words)), num_words=num_words,
            system=system, stop=stop, temperature=temperature, seed=seed,
            include_usage=bool(rng.random() < P_USAGE),
            abort_after_events=abort_after_events, abort_after_s=abort_after_s))
    return plans


# ----------------------------------------------------------------------------- one request


@dataclass(frozen=True)
class Outcome:
    """How one request ended; ``status`` is the HTTP status of an error answer."""

    kind: str
    detail: str = ""
    status: int | None = None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def _envelope_message(obj: object) -> str | None:
    """The message of OpenAI's error envelope {"error": {"message", "type", ...}}, else None."""
    if not isinstance(obj, dict):
        return None
    error = obj.get("error")
    if not isinstance(error, dict):
        return None
    message, kind = error.get("message"), error.get("type")
    if not isinstance(message, str) or not isinstance(kind, str):
        return None
    return message


def error_outcome(status: int, raw: bytes) -> Outcome:
    """A non-200 answer: an explicit error if it is 4xx/5xx in the envelope, else a failure."""
    text = raw.decode("utf-8", errors="replace")
    try:
        message = _envelope_message(json.loads(text))
    except json.JSONDecodeError:
        message = None
    if status >= 400 and message is not None:
        return Outcome(ERRORED, _clip(f"HTTP {status}: {message}"), status)
    return Outcome(FAILED, _clip(f"HTTP {status} without OpenAI's error envelope: {text!r}"),
                   status)


def _usage_problem(plan: RequestPlan, usage: object) -> str | None:
    if not isinstance(usage, dict):
        return f"usage is not an object: {usage!r}"
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or prompt < 1:
        return f"usage.prompt_tokens is {prompt!r}"
    if not isinstance(completion, int) or not 0 <= completion <= plan.n * plan.max_tokens:
        return (f"usage.completion_tokens is {completion!r}, expected 0..{plan.n} x "
                f"{plan.max_tokens}")
    if usage.get("total_tokens") != prompt + completion:
        return f"usage.total_tokens is {usage.get('total_tokens')!r}, not {prompt + completion}"
    return None


def check_whole(plan: RequestPlan, raw: bytes) -> Outcome:
    """A 200 answer to a non-streamed request."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Outcome(FAILED, _clip(f"malformed JSON body: {raw[:200]!r}"))
    if not isinstance(obj, dict):
        return Outcome(FAILED, _clip(f"body is not an object: {obj!r}"))
    expected = "chat.completion" if plan.chat else "text_completion"
    if obj.get("object") != expected:
        return Outcome(FAILED, f"object is {obj.get('object')!r}, expected {expected!r}")
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != plan.n:
        return Outcome(FAILED, _clip(f"expected {plan.n} choices, got {choices!r}"))
    if sorted(c.get("index") for c in choices if isinstance(c, dict)) != list(range(plan.n)):
        return Outcome(FAILED, _clip(f"choice indices are not 0..{plan.n - 1}: {choices!r}"))
    for c in choices:
        if c.get("finish_reason") not in FINISH_REASONS:
            return Outcome(FAILED, f"choice {c.get('index')} finish_reason is "
                                   f"{c.get('finish_reason')!r}")
        text = (c.get("message") or {}).get("content") if plan.chat else c.get("text")
        if not isinstance(text, str) and not (plan.chat and text is None):
            return Outcome(FAILED, _clip(f"choice {c.get('index')} has no text: {c!r}"))
    problem = _usage_problem(plan, obj.get("usage"))
    if problem is not None:
        return Outcome(FAILED, problem)
    return Outcome(COMPLETED)


@dataclass
class StreamCheck:
    """Follows the chunks of one stream: indices, one finish_reason per choice, usage."""

    plan: RequestPlan
    finished: dict[int, str] = field(default_factory=dict)
    usage: object = None

    def add(self, chunk: object) -> str | None:
        """None if the chunk is well-formed, else what is wrong with it."""
        if not isinstance(chunk, dict):
            return f"chunk is not an object: {chunk!r}"
        expected = "chat.completion.chunk" if self.plan.chat else "text_completion"
        if chunk.get("object") != expected:
            return f"chunk object is {chunk.get('object')!r}, expected {expected!r}"
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return f"chunk has no choices list: {chunk!r}"
        for c in choices:
            index = c.get("index") if isinstance(c, dict) else None
            if not isinstance(index, int) or not 0 <= index < self.plan.n:
                return f"chunk choice index {index!r} is not in 0..{self.plan.n - 1}"
            if index in self.finished:
                return f"choice {index} continued after finish_reason {self.finished[index]!r}"
            reason = c.get("finish_reason")
            if reason is not None:
                if reason not in FINISH_REASONS:
                    return f"choice {index} finish_reason is {reason!r}"
                self.finished[index] = reason
        if chunk.get("usage") is not None:
            if choices:
                return "usage chunk carries choices"
            self.usage = chunk["usage"]
        return None

    def at_done(self) -> Outcome:
        missing = [i for i in range(self.plan.n) if i not in self.finished]
        if missing:
            return Outcome(FAILED, f"[DONE] before a finish_reason for choices {missing}")
        if self.plan.include_usage:
            if self.usage is None:
                return Outcome(FAILED, "include_usage was asked but no usage chunk came")
            problem = _usage_problem(self.plan, self.usage)
            if problem is not None:
                return Outcome(FAILED, problem)
        return Outcome(COMPLETED)


class SoakSender:
    """Sends RequestPlans and classifies how each ended; never raises but CancelledError."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, timeout: float):
        self._client = client
        self._base_url = base_url
        self._model = model
        self._timeout = timeout

    async def send(self, plan: RequestPlan) -> Outcome:
        cancel_at = plan.abort_after_s
        limit = self._timeout if cancel_at is None else min(cancel_at, self._timeout)
        try:
            return await asyncio.wait_for(self._attempt(plan), limit)
        except asyncio.TimeoutError:
            if cancel_at is not None and cancel_at < self._timeout:
                return Outcome(ABORTED, f"request task cancelled after {cancel_at:.2f}s")
            return Outcome(FAILED, f"no complete answer within {self._timeout:g}s (hang)")
        except httpx.TimeoutException as e:
            return Outcome(FAILED, f"timeout ({type(e).__name__})")
        except httpx.HTTPError as e:
            return Outcome(FAILED, _clip(f"transport error {type(e).__name__}: {e}"))
        except Exception as e:  # anything else is a failure of the soak, never a crash
            return Outcome(FAILED, _clip(f"{type(e).__name__}: {e}"))

    async def _attempt(self, plan: RequestPlan) -> Outcome:
        url = self._base_url + plan.path()
        async with self._client.stream("POST", url, json=plan.body(self._model)) as response:
            if response.status_code != 200:
                return error_outcome(response.status_code, await response.aread())
            if plan.stream:
                return await self._read_stream(plan, response)
            raw = await response.aread()
        return check_whole(plan, raw)

    async def _read_stream(self, plan: RequestPlan, response: httpx.Response) -> Outcome:
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            return Outcome(FAILED, f"stream answered with content-type {content_type!r}")
        check = StreamCheck(plan)
        events = 0
        async for event in iter_events(response.aiter_lines()):
            if plan.abort_after_events is not None and events >= plan.abort_after_events:
                return Outcome(ABORTED, f"stream closed by the client after {events} events")
            events += 1
            data = event.data.strip()
            if data == "[DONE]":
                return check.at_done()
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                return Outcome(FAILED, _clip(f"malformed stream chunk: {data[:200]!r}"))
            if event.event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                message = _envelope_message(chunk)
                if message is None:
                    return Outcome(FAILED, _clip(f"error event without the envelope: {data!r}"))
                return Outcome(ERRORED, _clip(f"SSE error event: {message}"))
            problem = check.add(chunk)
            if problem is not None:
                return Outcome(FAILED, _clip(problem))
        if plan.abort_after_events is not None and events >= plan.abort_after_events:
            return Outcome(ABORTED, f"stream closed by the client after {events} events")
        return Outcome(FAILED, f"stream ended after {events} events without [DONE] or an "
                               "error event")


async def run_plans(sender: SoakSender, plans: list[RequestPlan], concurrency: int,
                    on_done: Callable[[int], None] | None = None) -> list[Outcome]:
    """Send every plan with at most ``concurrency`` in flight; outcomes in plan order."""
    outcomes: list[Outcome | None] = [None] * len(plans)
    position = 0
    done = 0

    async def worker() -> None:
        nonlocal position, done
        while position < len(plans):
            i = position
            position += 1
            outcomes[i] = await sender.send(plans[i])
            done += 1
            if on_done is not None:
                on_done(done)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(plans)))))
    assert all(o is not None for o in outcomes)
    return [o for o in outcomes if o is not None]


# ----------------------------------------------------------------------------- checks


def read_rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` from /proc/<pid>/status, in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                value, unit = line.split()[1:3]
                if unit.lower() != "kb":
                    raise ValueError(f"unexpected VmRSS unit {unit!r}")
                return int(value) / 1024
    raise ValueError(f"no VmRSS line in /proc/{pid}/status")


def metric_value(text: str, name: str) -> float | None:
    """Sum of every sample of ``tpserve:<name>`` in a Prometheus text page; None if absent."""
    full = METRIC_PREFIX + name
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(full):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == full:
            total += float(value)
            found = True
    return total if found else None


async def wait_until_idle(client: httpx.AsyncClient, base_url: str, timeout: float
                          ) -> dict[str, Any]:
    """Polls /metrics until no request runs or waits and the KV pool is free, or timeout."""
    start = time.monotonic()
    values: dict[str, float | None] = {}
    error = None
    while True:
        try:
            response = await client.get(f"{base_url}/metrics", timeout=min(timeout, 10.0))
            response.raise_for_status()
            values = {name: metric_value(response.text, name) for name in IDLE_GAUGES}
            error = None
        except (httpx.HTTPError, ValueError) as e:
            error = _clip(f"{type(e).__name__}: {e}")
        idle = error is None and all(v == 0 for v in values.values())
        waited = time.monotonic() - start
        if idle or waited >= timeout:
            return {"ok": idle, "waited_s": round(waited, 3), "error": error, **values}
        await asyncio.sleep(POLL_S)


async def health_status(client: httpx.AsyncClient, base_url: str) -> int | str:
    """The status of GET /health (200 while the engine lives), or why there was none."""
    try:
        return (await client.get(f"{base_url}/health", timeout=10.0)).status_code
    except httpx.HTTPError as e:
        return _clip(f"{type(e).__name__}: {e}")


def tally(plans: list[RequestPlan], outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts by outcome, errors by status, the mix, and the first failures."""
    counts = Counter(o.kind for o in outcomes)
    errors = Counter("sse" if o.status is None else str(o.status)
                     for o in outcomes if o.kind == ERRORED)
    failures = [f"{p.describe()}: {o.detail}"
                for p, o in zip(plans, outcomes, strict=True) if o.kind == FAILED]
    error_examples = [f"{p.describe()}: {o.detail}"
                      for p, o in zip(plans, outcomes, strict=True) if o.kind == ERRORED]
    return {
        "total": len(outcomes),
        **{kind: counts.get(kind, 0) for kind in OUTCOMES},
        "errors_by_status": dict(sorted(errors.items())),
        "mix": {
            "chat": sum(p.chat for p in plans),
            "completions": sum(not p.chat for p in plans),
            "streamed": sum(p.stream for p in plans),
            "n2": sum(p.n == 2 for p in plans),
            "with_stop": sum(p.stop is not None for p in plans),
            "aborts_planned": sum(p.abort_planned for p in plans),
        },
        "failures": failures[:MAX_LISTED_FAILURES],
        "error_examples": error_examples[:5],
    }


# ----------------------------------------------------------------------------- the soak


def _log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def _progress(label: str, total: int, enabled: bool) -> Callable[[int], None] | None:
    if not enabled:
        return None
    step = max(1, total // 10)

    def report(done: int) -> None:
        if done % step == 0 or done == total:
            _log(f"{label}: {done}/{total} requests ended")

    return report


async def run_soak(config: SoakConfig) -> dict[str, Any]:
    """The whole soak; returns the JSON document (``passed`` says whether every check held)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout,
                            connect=min(config.request_timeout, CONNECT_TIMEOUT_S))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = config.model or await resolve_model(client, config.base_url)
        sender = SoakSender(client, config.base_url, model, config.request_timeout)
        rng = np.random.default_rng(config.seed)
        sizes = {"max_tokens": config.max_tokens, "max_prompt_words": config.max_prompt_words}
        warm_plans = make_plans(rng, config.warmup_requests, config.abort_fraction, **sizes)
        plans = make_plans(rng, config.num_requests, config.abort_fraction,
                           first_index=config.warmup_requests, **sizes)
        started = time.monotonic()

        warm_outcomes: list[Outcome] = []
        if warm_plans:
            _log(f"model {model!r}: {len(warm_plans)} warm-up requests")
            warm_outcomes = await run_plans(sender, warm_plans, config.concurrency)
        warm_idle = await wait_until_idle(client, config.base_url, config.drain_timeout)
        rss_before = None if config.server_pid is None else read_rss_mib(config.server_pid)

        _log(f"{len(plans)} requests, {config.concurrency} in flight")
        outcomes = await run_plans(sender, plans, config.concurrency,
                                   _progress("soak", len(plans), config.progress))
        duration = time.monotonic() - started
        pool = await wait_until_idle(client, config.base_url, config.drain_timeout)
        health = await health_status(client, config.base_url)
        rss_after = None if config.server_pid is None else read_rss_mib(config.server_pid)

    counts = tally(plans, outcomes)
    warm_counts = tally(warm_plans, warm_outcomes)
    rss = None
    if rss_before is not None and rss_after is not None:
        growth = rss_after - rss_before
        rss = {"pid": config.server_pid, "baseline_mib": round(rss_before, 1),
               "after_mib": round(rss_after, 1), "growth_mib": round(growth, 1),
               "limit_mib": config.max_rss_growth_mib,
               "ok": growth < config.max_rss_growth_mib}
    checks = {
        "outcomes": counts[FAILED] == 0 and warm_counts[FAILED] == 0,
        "pool_free": bool(pool["ok"]),
        "healthy": health == 200,
        "rss": None if rss is None else rss["ok"],
    }
    return {
        **config.parameters(),
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(duration, 2),
        "counts": counts,
        "warmup": {**warm_counts, "pool_after": warm_idle},
        "pool": pool,
        "health_status": health,
        "rss": rss,
        "checks": checks,
        "passed": all(v is not False for v in checks.values()),
    }


def format_summary(doc: dict[str, Any]) -> str:
    c, pool, rss = doc["counts"], doc["pool"], doc["rss"]
    mix = c["mix"]
    errors = ", ".join(f"{k}: {v}" for k, v in c["errors_by_status"].items())
    lines = [
        "=" * 22 + " tpserve soak " + "=" * 22,
        f"Model:                 {doc['model']} at {doc['base_url']}",
        f"Requests:              {c['total']} ({doc['warmup_requests']} warm-up before, "
        f"{doc['warmup'][FAILED]} of them failed)",
        f"  completed:           {c[COMPLETED]}",
        f"  errored (explicit):  {c[ERRORED]}" + (f" ({errors})" if errors else ""),
        f"  aborted by client:   {c[ABORTED]}",
        f"  FAILED:              {c[FAILED]}",
        f"Mix:                   chat {mix['chat']}, completions {mix['completions']}, "
        f"streamed {mix['streamed']}, n=2 {mix['n2']}, with stop {mix['with_stop']}, "
        f"aborts planned {mix['aborts_planned']}",
        f"Duration:              {doc['duration_s']:.1f} s",
        "Pool after the soak:   " + (
            "idle" if pool["ok"] else "NOT IDLE") + f" after {pool['waited_s']:.1f} s ("
        + ", ".join(f"{k} {pool.get(k)}" for k in IDLE_GAUGES)
        + (f"; {pool['error']}" if pool.get("error") else "") + ")",
        f"Health after the soak: {doc['health_status']}",
    ]
    if rss is None:
        lines.append("Server RSS:            not checked (no --server-pid)")
    else:
        lines.append(f"Server RSS:            {rss['baseline_mib']:.1f} MiB after warm-up, "
                     f"{rss['after_mib']:.1f} MiB after, growth {rss['growth_mib']:.1f} MiB "
                     f"(limit {rss['limit_mib']:g})" + ("" if rss["ok"] else " TOO MUCH"))
    for failure in c["failures"]:
        lines.append(f"  failure: {failure}")
    lines.append(f"Result:                {'PASS' if doc['passed'] else 'FAIL'}")
    return "\n".join(lines)


def soak_main(args: argparse.Namespace) -> int:
    """Run ``tpserve soak`` with parsed flags; returns the exit status."""
    try:
        config = config_from_args(args)
        doc = asyncio.run(run_soak(config))
    except SetupError as e:
        print(f"tpserve soak: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print("tpserve soak: interrupted; nothing written", file=sys.stderr)
        return 130
    print(format_summary(doc))
    if config.result_file is not None:
        config.result_file.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"Result written to {config.result_file}")
    return EXIT_OK if doc["passed"] else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """``python -m tpserve.loadtest.soak``: the same as ``tpserve soak``."""
    parser = argparse.ArgumentParser(
        prog="tpserve soak",
        description="Soak-test a server with mixed and aborted requests, then check that it "
                    "is idle with a free KV pool and no runaway memory growth.")
    add_soak_arguments(parser)
    return soak_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
