"""Token sampling on rank 0: penalties, min_tokens, logprobs, greedy and random sampling.

Pipeline, per row of ``logits`` (computed in float32 on the logits' device; a step whose
rows are all greedy, unconstrained and untouched by steps 1-3 takes the argmax of the
logits as they are, which is the same token):

1. penalties (``logits_processors.penalize_``): repetition penalty over prompt + output tokens
   (Hugging Face style: positive logits divided, negative ones multiplied), then frequency
   (``x count``) and presence (``x [count > 0]``) penalties over output tokens only;
2. min_tokens (``mask_min_tokens_``): while the output is shorter than ``min_tokens``,
   every EOS id and every ``stop_token_ids`` entry is set to -inf (``ignore_eos`` or not);
   bad words (``ban_bad_words_``): the last token of each ``bad_words_token_ids`` sequence
   whose other tokens end the output is set to -inf;
   then ``logit_bias`` is added, every token outside a row's ``allowed_token_ids`` is set
   to -inf, and the grammar bitmask of structured-output rows (built by the engine) sets
   every token the grammar forbids to -inf;
3. logprobs, in the row's ``logprobs_mode`` or else the sampler's (vLLM's
   ``--logprobs-mode``; ``sampling_params.LOGPROBS_MODES``): ``raw_logprobs`` (the default)
   is the ``log_softmax`` of the model's logits before step 1 but for the grammar mask of
   a structured-output row (vLLM masks them before its sampler; a thinking budget's forced
   end tag is not a grammar: ``TokenBitmask.grammar_rows``); ``processed_logprobs`` that
   of the logits the token was picked from: after steps 1-2, and for a sampled row after
   temperature and the top-k / top-p / min-p filters of step 5 too (a token they drop
   reads -inf);
   ``raw_logits`` and ``processed_logits`` are those logits themselves. The sampled
   token's value is never -inf (it is allowed, and kept by the filters);
4. greedy rows (``temperature == 0``): argmax, ties going to the lowest token id;
5. other rows: divide by temperature, keep the top-k tokens, then the smallest prefix (by
   descending probability) whose mass reaches ``top_p`` (the top token is always kept),
   then drop tokens whose probability is below ``min_p x`` the top probability, and draw
   with an exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d. per token, which picks
   token ``i`` with probability exactly ``p_i``.

Reproducibility invariant: a row that comes with its own generator draws its noise from that
generator only, exactly one ``[V]`` draw per sampled (non-greedy) step, so its tokens depend
only on its seed, its logits and its step count, never on the other rows, their order or
their number. Rows without a generator share the sampler's generator in one batched draw.
Generators must live on the logits' device.

Allocator warm-up (``Sampler.warm_up``, CUDA): torch's caching allocator serves requests of
at most 1 MiB (``SMALL_POOL_BYTES``) from 2 MiB small-pool segments and larger ones from the
large pool. A ``[rows, vocab]`` float32 intermediate is small exactly when rows <= 1 MiB /
(4 x vocab) (two rows for Llama-3's 128,256 ids), and the random path holds about five at
once (the copy, the scaled logits, probabilities, noise, their ratio; more with filters)
where greedy holds one or two. Raw logprobs reuse the copy once the tokens are drawn (or,
beside processed rows, gather their own rows). So the first steps that sample one or two
rows at
temperature > 0 would create small-pool segments mid-serving unless warm-up ran those shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tpserve.model.host_copy import to_device, to_host_async
from tpserve.model.logits_processors import process_
from tpserve.model.sampling_params import LOGPROBS_MODES, SamplingParams, check_logprobs_mode
from tpserve.model.token_bitmask import TokenBitmask, apply_token_bitmask_


@dataclass
class SamplerOutput:
    """The sampled tokens of one step, one entry per logits row.

    ``logprobs`` holds the sampled token's logprob for every row, or is None when no row asked
    for logprobs. ``top_logprobs[i]`` lists ``params[i].logprobs`` ``(token_id, logprob)``
    pairs in descending logprob order (an empty list for rows that did not ask), or with
    ``params[i].logprob_token_ids`` those tokens' pairs in that order; it is None exactly
    when ``logprobs`` is.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PendingSample:
    """A step's sampled tokens (and logprobs) still on the device, or on their way to the
    host: ``to_host`` starts non-blocking copies into pinned memory (on CUDA), after which
    ``resolve`` is valid once the device has passed the copies (e.g. after an event
    recorded behind them has completed; resolving earlier waits for them)."""

    token_ids: torch.Tensor                 # int64 [M]
    logprobs: torch.Tensor | None = None    # float32 [M]
    top_values: torch.Tensor | None = None  # float32 [M, k_max]
    top_ids: torch.Tensor | None = None     # int64 [M, k_max]
    top_counts: list[int] | None = None     # how many of the k_max each row asked for

    def to_host(self) -> PendingSample:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_host_async(t)

        return PendingSample(move(self.token_ids), move(self.logprobs), move(self.top_values),
                             move(self.top_ids), self.top_counts)

    def resolve(self) -> SamplerOutput:
        tokens = self.token_ids.tolist()
        if self.logprobs is None:
            return SamplerOutput(token_ids=tokens)
        top: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if self.top_values is not None:
            values_l, ids_l = self.top_values.tolist(), self.top_ids.tolist()
            for i, k in enumerate(self.top_counts):
                top[i] = list(zip(ids_l[i][:k], values_l[i][:k], strict=True))
        return SamplerOutput(token_ids=tokens, logprobs=self.logprobs.tolist(),
                             top_logprobs=top)


SMALL_POOL_BYTES = 1 << 20  # torch's caching allocator: requests up to this use the small pool


def small_pool_rows(vocab_size: int, max_rows: int) -> range:
    """Row counts whose ``[rows, vocab_size]`` float32 tensors the small pool serves."""
    return range(1, min(max_rows, SMALL_POOL_BYTES // (4 * vocab_size)) + 1)


def apply_filters(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p, then min-p on temperature-scaled float32 ``logits`` ``[M, V]``.

    ``top_k``, ``top_p`` and ``min_p`` are ``[M]`` tensors; ``top_k >= V`` disables top-k,
    ``top_p >= 1`` top-p and ``min_p == 0`` min-p. Returns a new tensor where dropped tokens
    are -inf. Ties are ranked by token id (stable sort), so the top-ranked token — always
    kept — is the greedy one.
    """
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    ordered = ordered.masked_fill(rank >= top_k.unsqueeze(1), -math.inf)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 at rank 0
    # top_p == 1 must keep everything even if rounding pushes the running mass past 1.
    limit = torch.where(top_p >= 1.0, torch.full_like(top_p, math.inf), top_p)
    ordered = ordered.masked_fill(mass_before >= limit.unsqueeze(1), -math.inf)
    floor = ordered[:, :1] + torch.log(min_p).unsqueeze(1)  # p_i >= min_p * p_max, in logits
    ordered = ordered.masked_fill(ordered < floor, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _plain_greedy(p: SamplingParams, output_token_ids: Sequence[int]) -> bool:
    """A greedy row that asks for no logprobs and whose logits no pipeline step changes
    (no penalty, no logit_bias, past its ``min_tokens``)."""
    return (p.greedy and p.logprobs is None and not p.logit_bias and not p.has_penalties
            and p.allowed_token_ids is None and not p.bad_words_token_ids
            and len(output_token_ids) >= p.min_tokens)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for 2-D ``x`` (ties to the lowest index), in two passes when rows are
    long: one long row otherwise reduces in a single block (~27 us for 128k logits on an
    H200). Groups are contiguous, so the first maximal group's first maximum is the first
    maximum of the row."""
    n, v = x.shape
    groups = 256
    if v < 32 * groups or v % groups:
        return x.argmax(dim=-1)
    vals, idx = x.reshape(n, groups, v // groups).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return (best * (v // groups) + idx.gather(1, best)).squeeze(1)


class Sampler:
    """Turns one step's logits into tokens (and logprobs) following the module pipeline:
    ``sample`` leaves the results on the device; the caller reads them with
    ``to_host().resolve()``.

    Holds the generator shared by unseeded requests, seeded once from ``seed``, and the
    ``logprobs_mode`` of rows that name none; the object is otherwise stateless, so one
    instance serves every step of every request.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 logprobs_mode: str = LOGPROBS_MODES[0]) -> None:
        check_logprobs_mode(logprobs_mode, "logprobs mode")
        self.logprobs_mode = logprobs_mode
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def new_request_generator(self, seed: int | None) -> torch.Generator | None:
        """A private generator for a request with ``seed`` (None for unseeded requests)."""
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        # torch takes seeds in [-2**63, 2**64); it maps a negative one to itself mod 2**64,
        # so wrapping changes no accepted seed and keeps ``seed + sibling`` from overflowing.
        gen.manual_seed(seed % 2**64)
        return gen

    def warm_up(self, vocab_size: int, rows: Iterable[int],
                dtype: torch.dtype = torch.float32) -> None:
        """Samples random logits of each row count in ``rows`` through every path (greedy;
        temperature; top-k, top-p, min-p with penalties, min_tokens, logit_bias and
        logprobs; seeded rows; greedy and sampled rows mixed), reading the results back, so
        the caching allocator holds the blocks those steps need before serving starts.
        ``dtype`` is the logits' (raw rows beside processed ones gather a float32 copy of
        their own rows from them). The shared generator is restored afterwards: warm-up changes
        no request's draws."""
        state = self.generator.get_state()
        noise = torch.Generator(device=self.device)
        noise.manual_seed(0)
        plain = SamplingParams(temperature=1.0)
        everything = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                    logprobs=5, repetition_penalty=1.1,
                                    frequency_penalty=0.1, presence_penalty=0.1,
                                    min_tokens=4, logit_bias=((1, 1.0),))
        greedy = SamplingParams(temperature=0.0)
        beam = SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.1,
                              logprobs_mode="processed_logprobs")  # beam search's steps
        try:
            for m in rows:
                logits = torch.randn(m, vocab_size, generator=noise, device=self.device
                                     ).to(dtype)
                seeded = [self.new_request_generator(i) for i in range(m)]
                for params, gens in ((greedy, [None] * m), (plain, [None] * m),
                                     (everything, [None] * m), (plain, seeded),
                                     (everything, seeded[:1] + [None] * (m - 1)),
                                     (beam, [None] * m)):
                    batches = [[params] * m] + ([[params] + [greedy] * (m - 1)]
                                                if m > 1 else [])
                    for batch in batches:
                        self.sample(logits, batch, [[2, 3]] * m, [[5]] * m, gens,
                                    frozenset({0})).to_host().resolve()
                if m > 1:  # rows of the sampler's mode beside beam search's processed ones
                    self.sample(logits, [everything] + [beam] * (m - 1), [[2, 3]] * m,
                                [[5]] * m, [None] * m, frozenset({0})).to_host().resolve()
        finally:
            self.generator.set_state(state)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: frozenset[int],
        bitmask: TokenBitmask | None = None,
    ) -> PendingSample:
        """The pipeline without reading anything back: results stay on the device. Only
        the lengths of ``output_token_ids`` are read unless a row has penalties.
        ``bitmask`` (grammar masks of the constrained rows) is applied after logit_bias."""
        n = logits.shape[0]
        if not len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators) == n:
            raise ValueError("sampler: one params/prompt/output/generator entry per logits row")
        if n == 0:
            return PendingSample(torch.zeros(0, dtype=torch.int64))
        if bitmask is None and all(map(_plain_greedy, params, output_token_ids)):
            # nothing below would change these logits: their argmax as they are (widening
            # to float32 is exact and monotonic, so the winner and its ties are the same)
            # without the [rows, vocab] float32 copy
            return PendingSample(argmax_rows(logits))
        x = logits.to(torch.float32, copy=True)
        process_(x, params, prompt_token_ids, output_token_ids, eos_token_ids, bitmask)
        # the rows that asked for logprobs, each with its mode
        modes = {i: p.logprobs_mode or self.logprobs_mode
                 for i, p in enumerate(params) if p.logprobs is not None}
        processed = {i for i, m in modes.items() if m.startswith("processed")}

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) < n:
            tokens = argmax_rows(x)
        if random_rows:
            sampled, drawn = self._sample(
                x, random_rows, [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
            if len(random_rows) == n:
                tokens = sampled
            else:
                tokens[to_device(random_rows, torch.long, x.device)] = sampled
            if processed.intersection(random_rows):
                # a sampled row's processed values are those it was drawn from (the
                # greedy rows' tokens were taken from x before this write)
                if len(random_rows) == n:
                    x = drawn
                else:
                    x[to_device(random_rows, torch.long, x.device)] = drawn

        if not modes:
            return PendingSample(tokens)
        return self._with_logprobs(self._values(x, logits, modes, bitmask), tokens, params)

    @staticmethod
    def _values(x: torch.Tensor, logits: torch.Tensor, modes: dict[int, str],
                bitmask: TokenBitmask | None) -> torch.Tensor:
        """The ``[M, V]`` values the logprobs are read from, row ``i`` in mode ``modes[i]``:
        ``x`` (the processed logits, no longer needed for the tokens) with the raw rows
        written over by the model's ``logits`` under the grammar mask (all of ``x`` when
        every row asking is raw, so no second copy is held). Rows not in ``modes`` hold
        either."""
        from_raw = [i for i, m in modes.items() if m.startswith("raw")]
        if from_raw:
            if len(from_raw) == len(modes):
                x.copy_(logits)
            else:
                rows = to_device(from_raw, torch.long, x.device)
                x[rows] = logits[rows].float()
            grammar = None if bitmask is None else bitmask.grammar_part()
            if grammar is not None:  # a processed row holds these -inf already
                apply_token_bitmask_(x, grammar)
        as_logits = [i for i, m in modes.items() if m.endswith("logits")]
        if len(as_logits) == len(modes):
            return x
        values = x.log_softmax(dim=-1)
        if as_logits:
            rows = to_device(as_logits, torch.long, x.device)
            values[rows] = x[rows]
        return values

    def _sample(
        self,
        x: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draws one token for each of ``rows`` of the processed logits ``x``; returns the
        tokens and the logits they were drawn from (after temperature and the filters)."""
        device, vocab = x.device, x.shape[-1]
        temps = to_device([p.temperature for p in params], torch.float32, device)
        sub = x if len(rows) == x.shape[0] else x.index_select(
            0, to_device(rows, torch.long, device))
        sub = sub / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            sub = apply_filters(
                sub,
                # top_k >= vocab keeps every token; clamping keeps huge values in int64.
                to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                          torch.long, device),
                to_device([p.top_p for p in params], torch.float32, device),
                to_device([p.min_p for p in params], torch.float32, device),
            )
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [j for j, g in enumerate(generators) if g is None]
        if len(shared) == len(rows):
            noise.exponential_(generator=self.generator)
        else:
            if shared:
                draw = torch.empty(len(shared), vocab, dtype=torch.float32, device=device)
                draw.exponential_(generator=self.generator)
                noise[to_device(shared, torch.long, device)] = draw
            for j, gen in enumerate(generators):
                if gen is not None:
                    noise[j].exponential_(generator=gen)
        # A zero draw would turn 0 / 0 into NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        return argmax_rows(probs / noise), sub

    @staticmethod
    def _with_logprobs(
        logprobs: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> PendingSample:
        """The sampled tokens' values and each row's listed ones (``logprobs``: ``[M, V]``,
        in each row's mode): its top ``logprobs``, or, with ``logprob_token_ids``, those
        tokens' in their order (gathered, all rows padded to one width)."""
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k_top = min(max((p.logprobs or 0 for p in params if p.logprob_token_ids is None),
                        default=0), logprobs.shape[-1])
        counts = [min(p.logprobs or 0, k_top) if p.logprob_token_ids is None
                  else len(p.logprob_token_ids) for p in params]
        k_max = max(counts)
        if k_max == 0:
            return PendingSample(tokens, chosen, top_counts=counts)
        if k_top:
            values, ids = logprobs.topk(k_top, dim=-1, sorted=True)
            values = torch.nn.functional.pad(values, (0, k_max - k_top))
            ids = torch.nn.functional.pad(ids, (0, k_max - k_top))
        else:
            values = logprobs.new_zeros((len(params), k_max))
            ids = tokens.new_zeros((len(params), k_max))
        picked = [i for i, p in enumerate(params) if p.logprob_token_ids is not None]
        if picked:
            rows = to_device(picked, torch.long, logprobs.device)
            wanted = to_device([list(params[i].logprob_token_ids)
                                + [0] * (k_max - counts[i]) for i in picked],
                               torch.long, logprobs.device)
            values[rows] = logprobs[rows].gather(1, wanted)
            ids[rows] = wanted
        return PendingSample(tokens, chosen, values, ids, counts)
