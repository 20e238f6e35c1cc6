"""``TokenTexts``: the text of each token as log-probability entries show it (special tokens
by name), read as vLLM reads it:

- A token's own text is ``tokenizer.decode([id], skip_special_tokens=False)`` with the
  leading spaces a SentencePiece decoder strips from a text's first token put back, one
  for each leading space marker of its piece (``leading_space_marker``): "▁It" is " It",
  as in the middle of a text. Byte-level tokenizers have no marker and are untouched.
  Decoded once per id and kept: a request asking for 20 top log-probabilities needs 21
  such texts a token, at 64 running requests 3.45 ms of host time a step in decodes
  (2.6 us each, on the development machine's CPU), 0.37 ms in lookups once kept.
- An own text ending in U+FFFD (the token holds part of a UTF-8 character: byte-level
  BPE's emoji and CJK, SentencePiece's byte fallback) is replaced by the token's share of
  the text at its position: decoded after the fewest (1 to 4) tokens before it with which
  the decode no longer ends in U+FFFD, less the decode of those tokens that come before
  their trailing run of own texts ending in U+FFFD (the run starts the character: its
  bytes are this token's share). A token that only starts a character gets "", the one
  that completes it the whole character (with whatever the starting ones held before
  it), so the texts of a sequence's tokens spell its text and offsets summed from them
  index it; "" too when no context completes it. Per position, never kept: only such
  texts pay for it.

Bounded by the vocabulary. Belongs to the engine thread (``EngineCore.token_texts``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"
_MAX_CONTEXT = 4  # tokens tried as context, as vLLM: a UTF-8 character has at most 4 bytes


class TokenTexts:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._marker = leading_space_marker(tokenizer)

    def __call__(self, token_id: int, ids: Sequence[int] = (), end: int = 0) -> str:
        """``token_id``'s text at the position after ``ids[:end]`` (the sequence's output
        tokens for sampled log-probabilities, the prompt's for prompt log-probabilities)."""
        text = self._own(token_id)
        if text.endswith(_INCOMPLETE):
            return self._share(token_id, ids, end)
        return text

    def __len__(self) -> int:
        return len(self._texts)

    def _own(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if self._marker is not None:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
                text = with_leading_spaces(piece, text, self._marker)
            self._texts[token_id] = text
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _share(self, token_id: int, ids: Sequence[int], end: int) -> str:
        for n in range(1, min(end, _MAX_CONTEXT) + 1):
            context = list(ids[end - n:end])
            whole = self._decode(context + [token_id])
            if whole.endswith(_INCOMPLETE):
                continue
            # the context's tail of tokens ending in U+FFFD starts this token's character:
            # their bytes are this token's share, what comes before them is not
            clean = n
            while clean and self._own(context[clean - 1]).endswith(_INCOMPLETE):
                clean -= 1
            before = self._decode(context[:clean]) if clean else ""
            # the common prefix, not len(before): a decoder may write the joint differently
            return whole[len(os.path.commonprefix((before, whole))):]
        return ""


def leading_space_marker(tokenizer: Any) -> str | None:
    """The piece prefix that stands for a space in a SentencePiece-style tokenizer ("▁"),
    whose decoder drops a text's first space: a Metaspace decoder's or pre-tokenizer's
    replacement, or what a decoder's ``Replace`` turns into " " (Llama-2's and Mistral's
    legacy ``tokenizer.json``, which has no pre-tokenizer). None for every other tokenizer
    (byte-level BPE keeps a token's spaces) and for one without a ``tokenizers`` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for part in (getattr(backend, "decoder", None), getattr(backend, "pre_tokenizer", None)):
        if part is not None:
            marker = _marker_in(json.loads(part.__getstate__()))
            if marker is not None:
                return marker
    return None


def _marker_in(config: dict[str, Any]) -> str | None:
    kind = config.get("type")
    if kind == "Metaspace":
        return config.get("replacement", "\u2581")
    if kind == "Replace" and config.get("content") == " ":
        return config.get("pattern", {}).get("String")
    for part in config.get("decoders", config.get("pretokenizers", ())):
        marker = _marker_in(part)
        if marker is not None:
            return marker
    return None


def with_leading_spaces(piece: str | None, text: str, marker: str) -> str:
    """``text`` (a token's decode) with a space in front for each of ``piece``'s leading
    markers that it lacks (None: an id the vocabulary lacks, ``text`` as it is)."""
    if piece is None:
        return text
    missing = (len(piece) - len(piece.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
