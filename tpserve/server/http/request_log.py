"""vLLM's request and output logging (``--enable-log-requests``, ``--enable-log-outputs``,
``--max-log-len``), beside the access log's one line per HTTP request.

With ``inputs`` on, every engine request (each prompt of a request, each beam search) logs
on submission, at INFO, its id, prompt length and sampling parameters (its LoRA adapter's
slot among them), and at DEBUG its prompt text and token ids. With ``outputs`` on, each
choice logs, when it finishes, its text, token ids and finish reason at INFO. ``max_len`` cuts every text to that
many characters and every id list to that many ids (None: whole), as vLLM's
``--max-log-len`` does. Nothing is decoded unless its line is written.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.outputs import RequestOutput

logger = logging.getLogger("tpserve.requests")


@dataclass(frozen=True, kw_only=True)
class RequestLog:
    """What is logged of each engine request (module docstring)."""

    inputs: bool = False
    outputs: bool = False
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_len is not None and self.max_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_len}")

    def cut(self, items: Sequence[Any]) -> Sequence[Any]:
        """``items`` (text or ids) cut to ``max_len``."""
        return items if self.max_len is None else items[:self.max_len]


def log_request(log: RequestLog, request_id: str, prompt_ids: list[int],
                params: SamplingParams, tokenizer: Any) -> OutputLog | None:
    """Logs an engine request on submission (as ``log.inputs`` says); returns what logs
    its choices as they finish (``log.outputs``), or None."""
    if log.inputs:
        logger.info("request %s: prompt_tokens=%d params=%s", request_id, len(prompt_ids),
                    params)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s prompt: %r prompt_token_ids: %s", request_id,
                         log.cut(tokenizer.decode(log.cut(prompt_ids))),
                         list(log.cut(prompt_ids)))
    # an embedding's output is a vector, and no text: nothing to log
    return OutputLog(log, request_id) if log.outputs and params.pooling is None else None


class OutputLog:
    """One engine request's choices, gathered from its outputs (``on_output``, each output
    once, in order) and logged one line each as it finishes."""

    def __init__(self, log: RequestLog, request_id: str):
        self.log, self.request_id = log, request_id
        self._texts: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}

    def on_output(self, out: RequestOutput) -> None:
        for d in out.deltas:
            self._texts.setdefault(d.index, []).append(d.text)
            self._ids.setdefault(d.index, []).extend(d.token_ids)
            if d.finish_reason is not None:
                logger.info("response %s choice %d: output %r output_token_ids %s "
                            "finish_reason %s", self.request_id, d.index,
                            self.log.cut("".join(self._texts.pop(d.index))),
                            list(self.log.cut(self._ids.pop(d.index))), d.finish_reason)
