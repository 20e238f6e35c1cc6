"""OpenAI request fields the server cannot honour (400 naming the field), and unknown
fields (logged once per name, then ignored, as vLLM does).

Decided per field of OpenAI's completions and chat completions APIs:
- refused when set to anything but their no-op value: ``best_of`` (only 1), ``suffix``
  (only empty), ``functions`` / ``function_call`` (deprecated: use ``tools``, which
  ``http/tools.py`` handles), ``audio``, ``modalities`` (only ``["text"]``),
  ``prediction`` (predicted outputs),
  ``web_search_options``, ``store`` (only false), ``verbosity`` (OpenAI answers 400 for
  models without it too); ``reasoning_effort`` is the chat template's
  (``http/reasoning_effort.py``: 400 where the template reads no such variable);
- accepted and ignored, as OpenAI documents them as advisory (they never change the
  output): ``metadata`` (only stored with ``store``), ``service_tier``,
  ``prompt_cache_key`` (prefix caching needs no key), ``safety_identifier``, ``user``.

vLLM's own request fields that need machinery this server does not have are refused the
same way when set to anything but their no-op value: ``priority`` (only 0, unless the
server runs ``--scheduling-policy priority``), ``logits_processors``,
``kv_transfer_params``, ``ec_transfer_params``, ``watermarking`` (only false),
``prompt_embeds`` (completions), ``vllm_xargs``, ``guided_decoding_backend`` (only xgrammar),
``guided_whitespace_pattern``. ``spaces_between_special_tokens`` is accepted either way:
transformers' tokenizers (5.x) never put a space between special tokens, which is what
``false`` asks and what vLLM's fast-tokenizer path gives for ``true`` too.
Beam search's fields (``use_beam_search``, ``length_penalty``) are checked by
``http/beam_search.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, MutableSet
from typing import Any

from pydantic import BaseModel

from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

logger = logging.getLogger(__name__)


def _noop_value(field: str, value: Any) -> bool:
    """Whether ``value`` of a refusable field asks for nothing the server cannot do."""
    if value is None:
        return True
    if field == "best_of":
        return value == 1
    if field == "suffix":
        return value == ""
    if field == "modalities":
        return list(value) == ["text"]
    if field == "store":
        return value is False
    if field == "priority":
        return value == 0
    if field in ("logits_processors", "kv_transfer_params", "ec_transfer_params",
                 "vllm_xargs", "background", "include", "top_logprobs", "watermarking",
                 "prompt_embeds"):
        return not value
    if field == "truncation":
        return value == "disabled"
    if field == "reasoning":  # the Responses API's options: none but effort set
        return all(v is None for k, v in value.items() if k != "effort")
    if field == "guided_decoding_backend":
        return value in ("", "auto", "xgrammar")
    return False


COMPLETION_REFUSED = {
    "best_of": "best_of other than 1 is not supported",
    "suffix": "suffix (insertion) is not supported",
    "prompt_embeds": "prompt_embeds is not supported: send the prompt as text or token ids",
}
CHAT_REFUSED = {
    "functions": "functions (deprecated) is not supported: use tools",
    "function_call": "function_call (deprecated) is not supported: use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only the 'text' modality is supported",
    "prediction": "predicted outputs (prediction) are not supported",
    "web_search_options": "web search is not supported",
    "store": "store is not supported: completions are not stored",
    "verbosity": "verbosity is not supported with this model",
}


VLLM_REFUSED = {
    "priority": "priority other than 0 needs --scheduling-policy priority: this server "
                "serves requests first come, first served",
    "logits_processors": "logits_processors are not supported",
    "kv_transfer_params": "kv_transfer_params (disaggregated serving) is not supported",
    "ec_transfer_params": "ec_transfer_params (encoder-cache transfer) is not supported",
    "watermarking": "watermarking is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "guided_decoding_backend": "only the xgrammar structured-output backend is available",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
}


def refuse_unsupported(req: SamplingRequest, priority_scheduling: bool = False) -> None:
    """400 naming the first field set to something the server cannot honour
    (``priority_scheduling``: the server honours ``priority``)."""
    if isinstance(req, CompletionRequest):
        refused = {**COMPLETION_REFUSED, **VLLM_REFUSED}
    elif isinstance(req, ChatCompletionRequest):
        refused = {**CHAT_REFUSED, **VLLM_REFUSED}
    else:
        refused = {}
    if priority_scheduling:
        refused.pop("priority", None)
    refuse_fields(req, refused)


def refuse_fields(req: BaseModel, refused: Mapping[str, str]) -> None:
    """400 with ``refused[field]`` for the first of those fields that ``req`` sets to
    anything but its no-op value (None, or ``_noop_value``'s)."""
    for field, message in refused.items():
        if not _noop_value(field, getattr(req, field)):
            raise APIError.bad_request(message, field)


def warn_unknown_fields(req: BaseModel, warned: MutableSet[str],
                        known: Collection[str] = ()) -> None:
    """Logs a warning for each unknown top-level field (not in ``known``) the first time
    it is seen by this app (``warned`` remembers the names); the fields themselves are
    ignored."""
    for name in req.model_extra or ():
        if name not in warned and name not in known:
            warned.add(name)
            logger.warning("the request field %r is not supported and is ignored "
                           "(logged once per field name)", name)
