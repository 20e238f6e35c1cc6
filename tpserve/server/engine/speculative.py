"""Speculative decoding by prompt lookup (vLLM's ``--speculative-config`` method "ngram").

A decoding sequence whose last ``n`` tokens occurred earlier in its prompt or output
(``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) guesses that the tokens
which followed that occurrence (the latest one) follow again: its draft, at most
``num_speculative_tokens`` of them. The step then computes the sequence's last token and
its draft as one chunk and samples every position: row ``j`` under the history extended by
the draft's first ``j`` tokens, with the request's whole sampling pipeline (penalties,
min_tokens, bad words, logit bias, temperature and filters). The draft's tokens are kept
while each equals the token sampled before it, and the first sampled token that differs
(or the one after a wholly kept draft) is kept too: one to ``k + 1`` tokens a step.

Why the tokens are distributed exactly as without speculation: row ``j``'s distribution
``p`` is the model's at that position given the tokens kept so far, and a draft token ``d``
is a point mass ``q``. Speculative sampling accepts ``d`` with probability ``min(1,
p(d)/q(d)) = p(d)`` and otherwise draws from ``p`` with ``d`` removed and renormalized.
Drawing ``x ~ p`` and keeping ``d`` when ``x == d``, else ``x``, does exactly that. Greedy
rows are the case of a point-mass ``p``: the kept tokens are the greedy ones.

What gets no draft (decodes as before): structured output (its grammar matcher would have
to advance through the draft and roll back), seeded random sampling (a seeded request
draws once per token it keeps, whatever its batch; a draft's rejected rows would spend
draws), pooling, and a sequence whose draft would pass ``max_tokens`` or the model's
length. The engine runs synchronously while it drafts (a draft needs the tokens of the step
before; above ``disable_by_batch_size`` running sequences it drafts nothing and steps
overlap again), and a step samples at most ``max_num_seqs`` rows, so the memory plan,
the receive buffers and the CUDA graphs sized at start-up hold every step.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM: a "model" that names the ngram method
# vLLM's spellings of the same knobs; every other key of --speculative-config is refused
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size")
# vLLM's other methods, refused as needing a second model or heads trained for it
OTHER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp",
                 "deepseek_mtp")
_ITEM = array("i").itemsize  # token ids as C ints: a byte search finds an n-gram


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """``--speculative-config``: drafts of at most ``num_speculative_tokens`` tokens, from
    n-grams of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens (the longest first);
    none while more than ``disable_by_batch_size`` sequences run (None: no bound), where
    steps overlap again (asynchronous scheduling), as drafts would find few spare rows and
    the device is busy anyway."""

    method: str = "ngram"
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        flag = "--speculative-config"
        _check_method(self.method)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":  # the one optional bound
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag}: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{flag}: prompt_lookup_min {self.prompt_lookup_min} is above "
                             f"prompt_lookup_max {self.prompt_lookup_max}")

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's JSON object: ``method`` "ngram" and ``num_speculative_tokens`` are
        required; either of ``prompt_lookup_min`` and ``prompt_lookup_max`` defaults to the
        other, both to 5 (vLLM's defaults). As vLLM's ``SpeculativeConfig``, a ``model`` of
        "ngram" or "[ngram]" stands for the method where none is given, and "[ngram]" is
        "ngram"; any other ``model`` is a draft model, refused."""
        flag = "--speculative-config"
        model = value.get("model")
        method = value.get("method", model if model in NGRAM_MODELS else None)
        if method is None:
            raise ValueError(f"{flag}: \"method\" is required (supported: "
                             f"{', '.join(METHODS)})" + ("" if model is None else
                             f"; model {model!r} would be a draft model, which tpserve "
                             "does not run"))
        method = "ngram" if method == "[ngram]" else method
        _check_method(method)  # before the keys: another method's keys are its own
        if model is not None and model not in NGRAM_MODELS:
            raise ValueError(f"{flag}: model {model!r} is a draft model, which tpserve does "
                             "not run (method ngram drafts from the prompt; leave model out)")
        unknown = sorted(set(value) - set(KEYS) - {"model"})
        if unknown:
            raise ValueError(f"{flag}: unknown or unsupported keys {unknown}; accepted: "
                             f"{', '.join(KEYS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{flag}: \"num_speculative_tokens\" is required")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low = high if low is None else low
        high = low if high is None else high
        return cls(method=method, num_speculative_tokens=value["num_speculative_tokens"],
                   prompt_lookup_max=5 if high is None else high,
                   prompt_lookup_min=5 if low is None else low,
                   disable_by_batch_size=value.get("disable_by_batch_size"))

    def describe(self) -> str:
        limit = self.disable_by_batch_size
        return (f"{self.method}: up to {self.num_speculative_tokens} draft tokens from "
                f"{self.prompt_lookup_min}-{self.prompt_lookup_max}-grams"
                + ("" if limit is None else f", none above {limit} running sequences"))


def _check_method(method: str) -> None:
    if method not in METHODS:
        why = ("it needs a draft model or trained heads, which tpserve does not run"
               if method in OTHER_METHODS else "tpserve drafts by prompt lookup only")
        raise ValueError(f"--speculative-config: method {method!r} is not supported "
                         f"({why}); supported: {', '.join(METHODS)}")


def lookup_draft(tokens: Tokens[int], k: int, longest: int, shortest: int) -> tuple[int, ...]:
    """The ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (``longest`` down to ``shortest`` tokens) that ``k`` tokens followed;
    where none did, the tokens (fewer) after the latest occurrence of the longest suffix
    that occurred before at all; ``()`` when none did. In a repeating stretch the latest
    occurrence overlaps the suffix and gives only the tokens up to the end, where an
    earlier one (or a shorter suffix's) gives ``k``. An occurrence counts if at least one
    token follows it, so the suffix itself never matches."""
    count = len(tokens)
    if k < 1 or count < 2:
        return ()
    ids = array("i", tokens).tobytes()
    lengths = range(min(longest, count - 1), shortest - 1, -1)
    for end in (count - k, count - 1):  # k tokens follow, then at least one
        for n in lengths:
            at = _latest(ids, ids[-n * _ITEM:], end)
            if at >= 0:
                return tuple(tokens[at + n:at + n + k])
    return ()


def _latest(ids: bytes, pattern: bytes, end: int) -> int:
    """The first token of the latest occurrence of ``pattern`` (whole tokens) within the
    first ``end`` tokens of ``ids``, or -1."""
    stop = end * _ITEM
    while stop >= len(pattern):
        at = ids.rfind(pattern, 0, stop)
        if at < 0:
            return -1
        if at % _ITEM == 0:  # aligned on a token
            return at // _ITEM
        stop = at + len(pattern) - 1  # occurrences starting before this byte
    return -1


def kept_tokens(draft: Tokens[int], sampled: Tokens[int]) -> list[int]:
    """The tokens a step keeps for a sequence: ``sampled`` (``len(draft) + 1`` rows) up
    to and including the first row whose token differs from the draft's (all of them when
    every draft token was sampled)."""
    assert len(sampled) == len(draft) + 1, (len(sampled), len(draft))
    kept = 0
    while kept < len(draft) and sampled[kept] == draft[kept]:
        kept += 1
    return list(sampled[:kept + 1])


def draft_for(seq: Any, config: SpeculativeConfig, max_model_len: int,
              seeded: bool) -> tuple[int, ...]:
    """``seq``'s draft (a decoding ``Sequence`` whose tokens are all read back), or ``()``
    where it gets none: structured output, pooling, seeded random sampling, or no room
    left under ``max_tokens`` or ``max_model_len`` for a draft token and the one after."""
    params = seq.params
    if params.structured is not None or params.pooling is not None or (
            seeded and not params.greedy):
        return ()
    room = min(config.num_speculative_tokens,
               params.max_tokens - seq.num_output_tokens - 1,
               max_model_len - seq.num_tokens - 1)
    if room < 1:
        return ()
    return lookup_draft(seq.all_token_ids, room, config.prompt_lookup_max,
                        config.prompt_lookup_min)


@dataclass(frozen=True)
class SampleRows:
    """A step's sampled rows: ``first[i]`` is the first row of the step's ``i``-th
    sampling sequence (one row, or one per position of its last token and draft), and the
    sampler's inputs per row: the request's parameters, prompt and generator, and the
    output so far, extended by the draft tokens before the row."""

    first: list[int]
    params: list[Any]
    prompts: list[list[int]]
    outputs: list[list[int]]
    generators: list[Any]


def sample_rows(sampling: list[Any], generators: list[Any],
                drafts: Mapping[int, tuple[int, ...]]) -> SampleRows:
    """The rows of ``sampling`` (sequences) with their ``generators``, where ``drafts``
    (seq_id -> draft) gives some of them a draft."""
    rows = SampleRows([], [], [], [], [])
    for seq, gen in zip(sampling, generators, strict=True):
        rows.first.append(len(rows.params))
        draft = drafts.get(seq.seq_id, ())
        for j in range(len(draft) + 1):
            rows.params.append(seq.params)
            rows.prompts.append(seq.prompt_token_ids)
            rows.outputs.append(seq.output_token_ids + list(draft[:j]) if j
                                else seq.output_token_ids)
            rows.generators.append(gen)
    return rows
