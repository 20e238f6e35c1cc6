"""The thinking tags of a model and where one request's output starts: in its reasoning,
or in its answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tpserve.model.sampling_params import ThinkingBudget
from tpserve.server.http.http_errors import APIError


class ReasoningParser:
    """A model whose reasoning sits between ``start`` and ``end``, each one token of its
    vocabulary (the parser is refused at start-up otherwise, as vLLM refuses it).

    Where an output starts: after the prompt's last tag (the chat template opened the
    reasoning with ``start``, or closed it, e.g. ``enable_thinking: false``), else where
    ``opens_by_default`` says. An output that begins with ``start`` is reasoning either
    way (the tag is dropped); reasoning runs to the first ``end``, the rest is content."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # whether an output whose prompt holds no tag starts in its reasoning
    opens_by_default: ClassVar[bool]

    def __init__(self, tokenizer: Any):
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (self.start, self.end) if tag not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser {self.name} needs the tokens "
                             f"{' and '.join(missing)} in the model's vocabulary")
        self.start_id: int = vocab[self.start]
        self.end_id: int = vocab[self.end]
        # a tag the tokenizer calls special would be left out of the text by default
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        self.needs_special_tokens = self.start in special or self.end in special

    def plan(self, prompt_ids: Sequence[int], include: bool = True) -> ReasoningPlan:
        """How ``prompt_ids``'s output is split (``include``: whether the response carries
        the reasoning, vLLM's ``include_reasoning``)."""
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return ReasoningPlan(self, True, self.end_id, include)
            if token == self.end_id:  # thinking closed by the template: an answer only
                return ReasoningPlan(self, False, None, include)
        return ReasoningPlan(self, self.opens_by_default, self.end_id, include)


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1 and its distills (Llama, Qwen2), QwQ: their templates open the
    reasoning in the prompt, or the model writes ``<think>`` first; an output cut short
    before ``</think>`` is all reasoning."""

    name = "deepseek_r1"
    opens_by_default = True


class Qwen3Parser(ReasoningParser):
    """Qwen3-style hybrid models: an output reasons only when it begins with ``<think>``
    (or its prompt opened the reasoning); otherwise it is all content."""

    name = "qwen3"
    opens_by_default = False


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's split. ``grammar_after``: the token a structured-output grammar (or
    a tool call's) waits for before it applies (None: it applies from the first token,
    the prompt having closed the reasoning). ``grammar_after_if_first``: where the output
    starts in its answer (``opens`` false) it reasons only when it begins with the start
    tag, so the grammar waits only then, and otherwise constrains the first token."""

    parser: ReasoningParser
    opens: bool
    grammar_after: int | None
    include: bool = True

    @property
    def grammar_after_if_first(self) -> int | None:
        """The first token that makes the grammar wait for ``grammar_after`` (None: it
        waits whatever the output begins with, or never)."""
        if self.opens or self.grammar_after is None:
            return None
        return self.parser.start_id

    def budget(self, tokens: int) -> ThinkingBudget:
        """``thinking_token_budget``'s cap on this output: the thinking starts where the
        plan says the output does (400 for a budget ``ThinkingBudget`` refuses)."""
        try:
            return ThinkingBudget(tokens, self.parser.start_id, self.parser.end_id, self.opens)
        except ValueError as exc:
            raise APIError.bad_request(str(exc), "thinking_token_budget") from None
