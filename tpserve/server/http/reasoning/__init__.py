"""Reasoning parsers (vLLM's ``--reasoning-parser NAME``): a thinking model's output split
into ``reasoning`` (between ``<think>`` and ``</think>``) and the answer's ``content``, on
chat completions, whole and streamed; a structured-output grammar or tool call applies to
the answer only."""

from __future__ import annotations

from tpserve.server.http.reasoning.parser import (
    DeepSeekR1Parser,
    Qwen3Parser,
    ReasoningParser,
    ReasoningPlan,
)
from tpserve.server.http.reasoning.split import ReasoningSplit

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningPlan", "ReasoningSplit"]
