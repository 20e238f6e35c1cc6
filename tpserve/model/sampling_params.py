"""Per-request sampling parameters (OpenAI / vLLM semantics), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpserve.model.pooling import POOLING_TYPES

STRUCTURED_KINDS = ("json", "json_object", "regex", "grammar", "structural_tag")
# what ``logprobs`` report (vLLM's ``--logprobs-mode``; ``sampler.py`` defines each): the
# first is the default
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def check_logprobs_mode(mode: str, what: str) -> None:
    """ValueError naming ``what`` unless ``mode`` is one of ``LOGPROBS_MODES``."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"{what} must be one of {LOGPROBS_MODES}, got {mode!r}")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output: ``kind`` is ``json`` (``value`` is a JSON schema as
    text), ``json_object`` (any JSON object; ``value`` is empty), ``regex`` (a pattern the
    whole output matches), ``grammar`` (an EBNF grammar in xgrammar's dialect) or
    ``structural_tag`` (xgrammar's structural tag as JSON text: ``{"type": "structural_tag",
    "format": ...}``; free text with constrained tags, e.g. tool calls). Pure data: the
    engine compiles it (cached by ``(kind, value)``)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")


@dataclass(frozen=True)
class ThinkingBudget:
    """A reasoning model's thinking capped at ``tokens`` (vLLM's ``thinking_token_budget``):
    once that many tokens follow the start of the thinking, ``end_id`` is the only token
    that can be sampled. The thinking starts where ``--reasoning-parser`` says it does: at
    the first output token when ``opens`` (the prompt opened it, or the model's outputs
    always begin in it), or after an output that begins with ``start_id``. Pure data: the
    engine counts (``server/engine/thinking.py``)."""

    tokens: int
    start_id: int
    end_id: int
    opens: bool

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"thinking_token_budget must be at least 0, got {self.tokens}")


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's ``repetition_detection``: the output ends (finish reason ``repetition``) once
    its last ``n`` tokens, for some ``n`` from ``min_pattern_size`` (0: 1) to
    ``max_pattern_size``, are the same ``n`` tokens ``min_count`` times in a row. Pure
    data: the stop rules check it (``server/engine/repetition.py``)."""

    max_pattern_size: int
    min_pattern_size: int = 0
    min_count: int = 0

    MAX_PATTERN_SIZE = 1024  # the longest pattern checked (engine-thread work per token)

    def __post_init__(self) -> None:
        if self.max_pattern_size > self.MAX_PATTERN_SIZE:
            raise ValueError(f"repetition_detection: max_pattern_size must be at most "
                             f"{self.MAX_PATTERN_SIZE}, got {self.max_pattern_size}")
        if not 0 <= self.min_pattern_size <= self.max_pattern_size or self.max_pattern_size < 1:
            raise ValueError("repetition_detection needs 1 <= max_pattern_size and 0 <= "
                             f"min_pattern_size <= max_pattern_size, got {self.max_pattern_size} "
                             f"and {self.min_pattern_size}")
        if self.min_count < 2:
            raise ValueError(f"repetition_detection needs min_count >= 2, got {self.min_count}")

    @property
    def shortest(self) -> int:
        return max(self.min_pattern_size, 1)


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (``--runner pooling``): its prompt is pooled, nothing is
    sampled. ``pooling_type`` is the server's (``model.pooling.PoolerConfig``);
    ``normalize`` the request's or the server's; ``dimensions`` (Matryoshka) keeps the
    first entries of the vector, None: all."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``logprobs`` is None (no logprobs) or the number of top alternatives to
    return beside the sampled token's own logprob (0 = only the sampled token);
    ``prompt_logprobs`` the same for every prompt token after the first (the completions
    API's ``echo`` with ``logprobs``): the model's raw log-probability of each prompt token
    given the ones before it, and that many top alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's: with logprobs, the log-probabilities of exactly these tokens (in this order)
    # at each position instead of the top ``logprobs`` ones
    logprob_token_ids: tuple[int, ...] | None = None
    # which values those are (one of ``LOGPROBS_MODES``); None: the engine's
    # (``--logprobs-mode``). Beam search asks for ``processed_logprobs``: its ranking
    # must see the penalties and the logit bias
    logprobs_mode: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    # vLLM's: only these token ids may be sampled (every other logit set to -inf)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words as token sequences: a sequence's last token is banned whenever the
    # output ends with the rest of it (a one-token sequence: always)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: prefix-cache hits only between requests with the same salt
    cache_salt: str | None = None
    structured: StructuredOutput | None = None
    # the grammar applies only after this token has been sampled (the end of a reasoning
    # model's thinking, ``--reasoning-parser``): the tokens up to it are free; None: from
    # the first token
    structured_after: int | None = None
    # with ``structured_after``: the grammar waits for it only when the output's first
    # token is this one (a thinking model whose outputs think only when they begin with
    # its start tag); any other first token is the grammar's own, so the first token may
    # be this one or any the grammar allows. None: it waits from the first token
    structured_after_if_first: int | None = None
    # the thinking's length cap (a reasoning model's ``thinking_token_budget``); None: none
    thinking: ThinkingBudget | None = None
    # ends the output when its tail repeats (vLLM's ``repetition_detection``); None: never
    repetition: RepetitionDetection | None = None
    # scheduling, not sampling (carried here so it travels with the request): under
    # --scheduling-policy priority a lower value is served first (vLLM's ``priority``)
    priority: int = 0
    # an embedding request: the prompt is pooled instead of continued (n 1, max_tokens
    # unused: nothing is sampled)
    pooling: PoolingParams | None = None
    # the LoRA adapter the request runs under: its slot (``LoraConfig.modules`` order, fixed
    # at start-up); None: the base model. Not sampling either; it travels with the request
    lora_slot: int | None = None
    # that adapter's id (``server/engine/lora_slots``): the prefix cache keys on it
    lora_id: int | None = None

    MAX_N = 128
    MAX_LOGPROBS = 20
    MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap
    MAX_LOGIT_BIAS = 100.0
    # vLLM's _MAX_TEMP: a temperature above 0 and below it is raised to it (logits divided
    # by 1e-38 overflow float32 to inf, and the softmax's NaNs sampled token 0 each time)
    MIN_TEMPERATURE = 1e-2

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{field} {why}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        if 0.0 < self.temperature < self.MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", self.MIN_TEMPERATURE)
        if self.seed == -1:  # vLLM's (and llama.cpp's) "no seed"
            object.__setattr__(self, "seed", None)
        if not 1 <= self.n <= self.MAX_N:
            raise bad("n", f"must be between 1 and {self.MAX_N}, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:  # vLLM's bound (finite, checked above)
            raise bad("repetition_penalty", f"must be above 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise bad("prompt_logprobs",
                      f"must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.logprob_token_ids is not None and (
                self.logprobs is None or not self.logprob_token_ids
                or len(self.logprob_token_ids) > self.MAX_LOGPROB_TOKEN_IDS
                or min(self.logprob_token_ids) < 0):
            raise bad("logprob_token_ids", f"must be 1 to {self.MAX_LOGPROB_TOKEN_IDS} token "
                      "ids, and needs logprobs")
        if self.logprobs_mode is not None:
            check_logprobs_mode(self.logprobs_mode, "logprobs_mode")
        if any(not s for s in self.stop):
            raise bad("stop", "strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        for token, bias in self.logit_bias:
            if token < 0:
                raise bad("logit_bias", f"keys must be non-negative token ids, got {token}")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias)
                    and -self.MAX_LOGIT_BIAS <= bias <= self.MAX_LOGIT_BIAS):
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias!r} "
                          f"for token {token}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.lora_slot is not None and self.lora_slot < 0:
            raise bad("lora_slot", f"must be a slot >= 0, got {self.lora_slot}")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad("cache_salt", "must not be empty")
        if any(not w or min(w) < 0 for w in self.bad_words_token_ids):
            raise bad("bad_words_token_ids", "must be non-empty token id sequences")
        if self.structured_after is not None and (self.structured is None
                                                  or self.structured_after < 0):
            raise bad("structured_after", "needs structured output and a token id")
        if self.structured_after_if_first is not None and (
                self.structured_after is None or self.structured_after_if_first < 0):
            raise bad("structured_after_if_first", "needs structured_after and a token id")
        if self.thinking is not None and (
                (self.allowed_token_ids is not None
                 and self.thinking.end_id not in self.allowed_token_ids)
                or any(w[-1] == self.thinking.end_id for w in self.bad_words_token_ids)):
            raise bad("thinking_token_budget", "needs the end of the thinking allowed (it is "
                      "left out of allowed_token_ids or ends a bad word)")
        if self.structured is not None and self.min_tokens > 0:
            # the grammar may allow only EOS where min_tokens forbids it
            raise bad("min_tokens", "cannot be combined with structured output")
        if self.pooling is not None and (self.n != 1 or self.structured is not None
                                         or self.logprobs is not None
                                         or self.prompt_logprobs is not None):
            raise bad("pooling", "takes one sequence and no sampling constraints or logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling reads the row's output tokens on the host (penalties, bad words
        of more than one token): the engine then finalizes each step before the next."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition, frequency or presence penalty applies (they need the
        row's token history)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
