"""Compiled grammars for one model: the tokenizer's vocabulary info, built once, a cache of
compiled grammars keyed by ``(kind, value)``, and the worker thread that compiles the
grammars the cache does not hold, off the engine thread.

Threads and ownership:
- the engine thread calls ``request``, ``harvest``, ``cancel`` and ``close``; it alone
  reads and writes the cache and the table of compiles in flight (``_inflight``), so
  neither needs a lock;
- the worker thread (one ``ThreadPoolExecutor(max_workers=1)``, started on the first
  compile the cache cannot answer, shut down by ``close``) runs ``compile_now`` only,
  which touches nothing but the xgrammar compiler (thread-safe; it releases the GIL while
  it compiles, so the engine thread keeps stepping meanwhile);
- a compile's ``Future`` is created and owned here, and shared by every request that asks
  for the same ``(kind, value)`` while it is in flight; ``harvest`` moves each finished
  one's grammar into the cache (a failure is not cached: the futures still held by the
  requests that waited for it carry the ``GrammarError``) and forgets it, so no future
  outlives the next ``harvest`` or ``request`` after it finished.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.spec import GrammarError, clean_message

CACHE_ENTRIES = 256

Key = tuple[str, str]
# compile_hook(compile_now, spec) -> the compiled grammar: runs on the worker thread in
# place of compile_now(spec) (a test's gate or injected failure around the real compile)
CompileHook = Callable[[Callable[[StructuredOutput], xgr.CompiledGrammar], StructuredOutput],
                       xgr.CompiledGrammar]


def _key(spec: StructuredOutput) -> Key:
    return (spec.kind, spec.value)


class GrammarCompiler:
    """Compiles ``StructuredOutput`` constraints against the model's vocabulary.

    ``vocab_size`` must be the width of the model's logits (it may exceed the tokenizer's
    size; the extra ids are never allowed). The tokenizer info (~0.5 s for a 49k vocab) is
    built by ``prepare`` (the server calls it at start-up) or by the first compile. JSON
    output allows no free whitespace between tokens (compact separators ``", "`` and
    ``": "``): a small model at temperature > 0 can otherwise emit whitespace until
    ``max_tokens``. See the module docstring for which thread calls what.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_entries: int = CACHE_ENTRIES, *,
                 compile_hook: CompileHook | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.cache_entries = cache_entries
        self.compile_hook = compile_hook
        self._compiler: xgr.GrammarCompiler | None = None
        self._prepare_lock = threading.Lock()  # the engine thread and the worker may race
        self._cache: OrderedDict[Key, xgr.CompiledGrammar] = OrderedDict()
        self._inflight: dict[Key, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # ------------------------------------------------------------------ any thread
    def prepare(self) -> None:
        """Builds the tokenizer info and the xgrammar compiler, once."""
        with self._prepare_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                # the cache here replaces xgrammar's own
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_now(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Compiles ``spec`` on the calling thread, bypassing the cache; ``GrammarError``
        if refused. The worker runs this (through ``compile_hook`` when one is set)."""
        self.prepare()
        assert self._compiler is not None
        try:
            if spec.kind == "json":
                return self._compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":  # any object (xgrammar's builtin allows arrays)
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.value)
            return self._compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(clean_message(exc)) from exc

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""
        return xgr.GrammarMatcher(compiled)

    # --------------------------------------------------------------- engine thread
    def request(self, spec: StructuredOutput) -> xgr.CompiledGrammar | Future:
        """The cached grammar of ``spec`` at once, else the future of its compile on the
        worker (the one already in flight for the same ``(kind, value)``, if any). The
        future's result is the compiled grammar, or it raises ``GrammarError``."""
        self.harvest()
        key = _key(spec)
        hit = self._cached(key)
        if hit is not None:
            return hit
        future = self._inflight.get(key)
        if future is None:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="grammar-compile")
            future = self._executor.submit(self._run, spec)
            self._inflight[key] = future
        return future

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The grammar of ``spec`` from the cache, else compiled on this thread and cached
        (start-up and tests; the engine uses ``request``). ``GrammarError`` if refused."""
        self.harvest()
        key = _key(spec)
        hit = self._cached(key)
        if hit is not None:
            return hit
        compiled = self.compile_now(spec)
        self._put(key, compiled)
        return compiled

    def harvest(self) -> None:
        """Moves every finished compile's grammar into the cache and forgets its future
        (a failed or cancelled one is only forgotten)."""
        for key, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[key]
            if not future.cancelled() and future.exception() is None:
                self._put(key, future.result())

    def cancel(self, future: Future) -> None:
        """No request waits for ``future`` any more: a compile still queued is dropped; one
        running finishes and is cached by the next ``harvest``."""
        if future.cancel():
            self._inflight = {k: f for k, f in self._inflight.items() if f is not future}

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        """Drops queued compiles and stops the worker without waiting for a running one
        (it ends on its own; nothing reads its result). Idempotent."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._inflight.clear()

    # -------------------------------------------------------------------- private
    def _run(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        if self.compile_hook is not None:
            return self.compile_hook(self.compile_now, spec)
        return self.compile_now(spec)

    def _cached(self, key: Key) -> xgr.CompiledGrammar | None:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _put(self, key: Key, compiled: xgr.CompiledGrammar) -> None:
        self._cache[key] = compiled
        self._cache.move_to_end(key)
        if len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
