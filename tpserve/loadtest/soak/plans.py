"""The soak's request mix: ``RequestPlan`` (one request and when the client aborts it) and
``make_plans``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpserve.loadtest.datasets import random_words

MAX_PROMPT_WORDS = 300
MAX_OUTPUT_TOKENS = 64
STOP_STRINGS = (".", "\n", ",", " the", "!", "?", " and")
TEMPERATURES = (0.0, 0.7, 1.0)
P_CHAT, P_STREAM, P_N2, P_STOP, P_SYSTEM, P_USAGE = 0.5, 0.5, 0.15, 0.3, 0.2, 0.5
MAX_ABORT_DELAY_S = 2.0


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
