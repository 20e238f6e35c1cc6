"""Compiled grammars for one model: the tokenizer's vocabulary info, built once, and a
cache of compiled grammars keyed by ``(kind, value)``. Engine thread only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import xgrammar as xgr

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.spec import GrammarError, clean_message

CACHE_ENTRIES = 256


class GrammarCompiler:
    """Compiles ``StructuredOutput`` constraints against the model's vocabulary.

    ``vocab_size`` must be the width of the model's logits (it may exceed the tokenizer's
    size; the extra ids are never allowed). The tokenizer info (~0.5 s for a 49k vocab) is
    built by ``prepare`` (the server calls it at start-up) or on first use. JSON output
    allows no free whitespace between tokens (compact separators ``", "`` and ``": "``): a
    small model at temperature > 0 can otherwise emit whitespace until ``max_tokens``.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_entries: int = CACHE_ENTRIES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.cache_entries = cache_entries
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()

    def prepare(self) -> None:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None)
            # the cache here replaces xgrammar's own
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (LRU-cached); ``GrammarError`` if refused."""
        key = (spec.kind, spec.value)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        self.prepare()
        assert self._compiler is not None
        try:
            if spec.kind == "json":
                compiled = self._compiler.compile_json_schema(spec.value, any_whitespace=False)
            elif spec.kind == "json_object":  # any object (xgrammar's builtin allows arrays)
                compiled = self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.value)
            else:
                compiled = self._compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(clean_message(exc)) from exc
        self._cache[key] = compiled
        if len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar."""
        return xgr.GrammarMatcher(self.compile(spec))
