"""How one soak request ended, and the checks that decide it from the server's answer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tpserve.loadtest.soak.plans import RequestPlan

COMPLETED, ERRORED, ABORTED, FAILED = "completed", "errored", "aborted", "failed"
OUTCOMES = (COMPLETED, ERRORED, ABORTED, FAILED)
FINISH_REASONS = frozenset({"stop", "length"})
MAX_DETAIL_CHARS = 300


@dataclass(frozen=True)
class Outcome:
    """How one request ended; ``status`` is the HTTP status of an error answer."""

    kind: str
    detail: str = ""
    status: int | None = None


def clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def envelope_message(obj: object) -> str | None:
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
        message = envelope_message(json.loads(text))
    except json.JSONDecodeError:
        message = None
    if status >= 400 and message is not None:
        return Outcome(ERRORED, clip(f"HTTP {status}: {message}"), status)
    return Outcome(FAILED, clip(f"HTTP {status} without OpenAI's error envelope: {text!r}"),
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
        return Outcome(FAILED, clip(f"malformed JSON body: {raw[:200]!r}"))
    if not isinstance(obj, dict):
        return Outcome(FAILED, clip(f"body is not an object: {obj!r}"))
    expected = "chat.completion" if plan.chat else "text_completion"
    if obj.get("object") != expected:
        return Outcome(FAILED, f"object is {obj.get('object')!r}, expected {expected!r}")
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != plan.n:
        return Outcome(FAILED, clip(f"expected {plan.n} choices, got {choices!r}"))
    if sorted(c.get("index") for c in choices if isinstance(c, dict)) != list(range(plan.n)):
        return Outcome(FAILED, clip(f"choice indices are not 0..{plan.n - 1}: {choices!r}"))
    for c in choices:
        if c.get("finish_reason") not in FINISH_REASONS:
            return Outcome(FAILED, f"choice {c.get('index')} finish_reason is "
                                   f"{c.get('finish_reason')!r}")
        text = (c.get("message") or {}).get("content") if plan.chat else c.get("text")
        if not isinstance(text, str) and not (plan.chat and text is None):
            return Outcome(FAILED, clip(f"choice {c.get('index')} has no text: {c!r}"))
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
