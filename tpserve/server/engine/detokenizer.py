"""Incremental detokenization of one output sequence, with stop-string handling.

Decoding: the token list is a few trailing prompt tokens (context, so that the first output
token's leading space comes out as it would in the middle of a text) followed by the output
tokens. The context is the shortest suffix of 4 to 23 prompt tokens whose decode holds no
U+FFFD (as vLLM primes its detokenizer): it starts on a character's first byte, so a prompt
ending in byte-fallback characters (its last few tokens start inside one) has a context too.
Without such a suffix (a prompt of fewer than 4 tokens, or U+FFFD in each), it is the last
5 tokens, or none if their decode ends in U+FFFD (a prompt cut inside a character, whose
bytes the output's first ones would complete). Each step decodes only a small window
``ids[prefix:]`` and takes the text beyond ``decode(ids[prefix:read])``; the offsets move
forward once the window's new text is complete. Text ending in U+FFFD (an incomplete
multi-byte character) is held back until a later token completes it; only at
:meth:`IncrementalDetokenizer.flush` does an incomplete tail come out, as the U+FFFD a full
decode would show too.

Stop strings: the decoded characters form one stream. The stop fires at the first character
position where any stop string is complete (if several complete there, the longest wins), so
the result does not depend on how the text was split into tokens. Text that could still be
the beginning of a stop string is held back, so nothing is ever emitted and then retracted,
and nothing after a stop string is ever emitted. What is held back: the longest end of the
text that begins a stop string, while the stop strings hold at most ``EXACT_HOLD_CHARS``
characters in all; past that (a request sending thousands of long stop strings, where that
search costs the engine thread time quadratic in their lengths on every token), vLLM's
fixed hold-back of the longest stop string's length less one. With ``min_tokens`` (as vLLM) a stop string
counts only where it ends past the text of the first ``min_tokens`` output tokens.

Invariant: the concatenation of every returned piece equals ``output_text`` and equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` cut before the matched stop string
(or after it with ``include_stop_str_in_output``). This holds exactly for byte-level BPE
tokenizers; for SentencePiece ("▁"-prefixed) tokenizers the text may keep the first token's
leading space, which a standalone decode of the output strips.
"""

from __future__ import annotations

from typing import Any

from tpserve.model.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"
_CONTEXT_TOKENS = range(4, 24)  # the prompt suffixes tried as context, shortest first
_FALLBACK_CONTEXT = 5  # the context without a whole-character suffix
# stop strings of at most this many characters in all get the exact hold-back (its search
# costs up to about this many string comparisons a token); more get vLLM's fixed one
EXACT_HOLD_CHARS = 4096


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, token by token (see the module doc)."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = tuple(params.stop)
        # None: hold back exactly what may begin a stop string; else this many characters
        self._fixed_hold = None if sum(map(len, self._stops)) <= EXACT_HOLD_CHARS else (
            max(map(len, self._stops)) - 1)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._count = 0  # output tokens added
        self._min_end = 0  # a stop string must end past _text[:_min_end] (min_tokens)
        context = self._context(prompt_token_ids)
        self._ids: list[int] = context
        self._prefix = 0  # window start: decode(ids[prefix:read]) is text already taken
        self._read = len(context)  # ids before this have all their text in _text
        self._pending = 0  # chars past decode(ids[prefix:read]) already taken (held U+FFFD)
        self._text = ""  # every complete character decoded so far
        self._scanned = 0  # _text[:_scanned] has been searched for stop strings
        self._emitted = 0  # _text[:_emitted] has been returned
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched; later tokens are ignored."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    @property
    def output_text(self) -> str:
        """All text returned so far (after :meth:`flush`, the whole output text)."""
        return self._text[: self._emitted]

    def add_token(self, token_id: int) -> str:
        """Adds one output token; returns the newly confirmed text (possibly "")."""
        if self._flushed:
            raise RuntimeError("add_token after flush")
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._text += self._decode_step(final=False)
        self._count += 1
        if self._count <= self._min_tokens:
            self._min_end = len(self._text)
        return self._confirm(final=False)

    def flush(self) -> str:
        """At finish: returns everything held back (still cut at a stop string if one matches)."""
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        self._text += self._decode_step(final=True)
        return self._confirm(final=True)

    def _context(self, prompt: list[int]) -> list[int]:
        """The prompt tokens the output is decoded after (see the module doc)."""
        for n in _CONTEXT_TOKENS:
            if n > len(prompt):
                break
            suffix = list(prompt[-n:])
            if _INCOMPLETE not in self._decode(suffix):
                return suffix
        tail = list(prompt[-_FALLBACK_CONTEXT:])
        # a prompt cut inside a character would merge with the output's first bytes
        return [] if tail and self._decode(tail).endswith(_INCOMPLETE) else tail

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_step(self, final: bool) -> str:
        """New complete characters of the current window (all of them when ``final``)."""
        taken = self._decode(self._ids[self._prefix : self._read])
        new = self._decode(self._ids[self._prefix :])[len(taken) :]
        if not new:
            return ""  # e.g. a skipped special token: keep the window for context
        if final or not new.endswith(_INCOMPLETE):
            delta = new[self._pending :]
            self._prefix, self._read, self._pending = self._read, len(self._ids), 0
            return delta
        stable = new.rstrip(_INCOMPLETE)
        delta = stable[self._pending :]
        self._pending = max(self._pending, len(stable))
        return delta

    def _confirm(self, final: bool) -> str:
        """Checks the new text for stop strings; returns what can now be emitted."""
        text = self._text
        match = self._first_stop()
        if match is not None:
            start, stop = match
            cut = start + len(stop) if self._include_stop else start
            self._stop_reason = stop
        else:
            cut = len(text) if final else len(text) - (
                self._partial_stop_len() if self._fixed_hold is None else self._fixed_hold)
        self._scanned = len(text)
        cut = max(cut, self._emitted)
        piece = text[self._emitted : cut]
        self._emitted = cut
        return piece

    def _first_stop(self) -> tuple[int, str] | None:
        """The stop string completed earliest in the unscanned text, as ``(start, stop)``."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = self._text.find(stop, max(self._emitted, self._scanned - len(stop) + 1,
                                              self._min_end - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
