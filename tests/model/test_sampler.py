"""Sampler: exact expectations for greedy, filters, penalties, min_tokens, logprobs, seeds.

Every case goes through the engine's path: ``Sampler.sample`` then ``to_host().resolve()``.
The processed logits (after penalties and min_tokens) are observed through full-vocabulary
``processed_logprobs`` of greedy rows, which are their ``log_softmax`` (a shift of each
row, exact in float32 for the small values used here)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from tpserve.model.sampler import Sampler, SamplerOutput, apply_filters, small_pool_rows
from tpserve.model.sampling_params import SamplingParams

V = 64
NO_EOS: frozenset[int] = frozenset()


def run(sampler, logits, params, gens=None, prompts=None, outputs=None,
        eos=NO_EOS) -> SamplerOutput:
    """One step as the engine runs it: sample on the device, copy to the host, resolve."""
    n = logits.shape[0]
    return sampler.sample(
        logits,
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        gens if gens is not None else [None] * n,
        eos,
    ).to_host().resolve()


def processed(logits, params, prompts, outputs, eos=NO_EOS) -> torch.Tensor:
    """The log_softmax of the logits after penalties and min_tokens, read from the
    full-vocabulary processed logprobs of a greedy ``sample`` (the input is checked
    untouched)."""
    before = logits.clone()
    vocab = logits.shape[-1]
    full = [dataclasses.replace(p, temperature=0.0, logprobs=vocab) for p in params]
    out = run(Sampler(logprobs_mode="processed_logprobs"), logits, full, prompts=prompts,
              outputs=outputs, eos=eos)
    assert torch.equal(logits, before)  # the input is not modified
    rows = torch.empty(logits.shape, dtype=torch.float32)
    for i, top in enumerate(out.top_logprobs):
        assert len(top) == vocab
        for token, lp in top:
            rows[i, token] = lp
    return rows


def same_up_to_shift(got: torch.Tensor, expected_logits: torch.Tensor) -> bool:
    """``got`` (log-probabilities) equals ``log_softmax(expected_logits)`` row by row."""
    ref = torch.log_softmax(expected_logits.float(), -1)
    finite = torch.isfinite(ref)
    return (torch.equal(finite, torch.isfinite(got))
            and torch.allclose(got[finite], ref[finite], atol=1e-6, rtol=0))


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(8, V, generator=g) * 3


def test_greedy_is_argmax(logits):
    out = run(Sampler(), logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_go_to_lowest_id():
    x = torch.zeros(1, V)
    x[0, [7, 3, 40]] = 5.0
    out = run(Sampler(), x, [SamplingParams(temperature=0.0)])
    assert out.token_ids == [3]


def test_greedy_accepts_half_precision(logits):
    out = run(Sampler(), logits.to(torch.bfloat16), [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.to(torch.bfloat16).float().argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=1e-6, min_p=0.5),
    ],
)
def test_degenerate_filters_equal_greedy(logits, params):
    sampler = Sampler(seed=7)
    greedy = logits.argmax(-1).tolist()
    for _ in range(3):
        assert run(sampler, logits, [params] * 8).token_ids == greedy


def test_filters_keep_exact_sets():
    # probs (temperature 1): 0.5, 0.25, 0.125, 0.0625, 0.0625
    x = torch.log(torch.tensor([[0.0625, 0.25, 0.5, 0.0625, 0.125]] * 4))
    out = apply_filters(
        x,
        top_k=torch.tensor([2, 5, 5, 5]),
        top_p=torch.tensor([1.0, 0.7, 0.8, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.2]),
    )
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in out]
    assert kept == [{1, 2}, {1, 2}, {1, 2, 4}, {1, 2, 4}]
    assert torch.equal(out[torch.isfinite(out)], x[torch.isfinite(out)])


def test_sampling_respects_filters():
    x = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]])).repeat(500, 1)
    out = run(Sampler(seed=3), x, [SamplingParams(temperature=1.0, top_k=2)] * 500)
    assert set(out.token_ids) == {1, 2}


def test_distribution_with_fixed_seed():
    p = 0.25
    x = torch.log(torch.tensor([[1 - p, p]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    first = run(Sampler(seed=0), x, params).token_ids
    again = run(Sampler(seed=0), x, params).token_ids
    other = run(Sampler(seed=1), x, params).token_ids
    assert first == again  # deterministic for a fixed seed
    assert first != other
    # mean 1000, sd ~27: a 4.4 sd band, and the count itself is fixed by the seed
    assert 880 <= sum(first) <= 1120
    assert 880 <= sum(other) <= 1120


def test_temperature_sharpens():
    x = torch.log(torch.tensor([[0.6, 0.4]])).repeat(2000, 1)
    hot = sum(run(Sampler(seed=5), x, [SamplingParams(temperature=1.0)] * 2000).token_ids)
    cold = sum(run(Sampler(seed=5), x, [SamplingParams(temperature=0.1)] * 2000).token_ids)
    assert 700 <= hot <= 900  # expected 800
    assert 10 <= cold <= 70  # p(1) = 0.4^10 / (0.6^10 + 0.4^10) ~ 0.017: expected 34


def test_a_tiny_temperature_is_vllms_least_and_samples_real_tokens():
    """vLLM's rule: a temperature in (0, 0.01) is 0.01 (divided by 1e-38 the logits
    overflowed float32 to inf, and the NaN softmax sampled token 0 every time)."""
    assert [SamplingParams(temperature=t).temperature for t in (1e-40, 1e-38, 0.005)] == [
        0.01] * 3
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5
                                                                     ).temperature == 0.5
    x = torch.tensor([[0.0, 1.0, 3.0, 2.0]]).repeat(200, 1)
    out = run(Sampler(seed=0), x, [SamplingParams(temperature=1e-38)] * 200)
    assert set(out.token_ids) == {2}  # the likeliest: 0.01 leaves the rest ~e^-100 behind


def test_vllms_seed_minus_one_and_repetition_penalty_bounds():
    """``seed: -1`` is no seed (vLLM's, llama.cpp's); ``repetition_penalty`` is any finite
    value above 0, as vLLM's (it was capped at 2)."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(repetition_penalty=2.5).repetition_penalty == 2.5
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)


def test_seeded_row_independent_of_batch(logits):
    sampler = Sampler(seed=0)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=0.8, top_p=0.9)
    steps = 6

    def tokens_of_seeded_row(batch_rows, position):
        gen = sampler.new_request_generator(42)
        got = []
        for step in range(steps):
            rows = list(batch_rows)
            rows.insert(position, logits[0])
            x = torch.stack(rows)
            params = [other] * len(rows)
            params[position] = seeded
            gens = [sampler.new_request_generator(None)] * len(rows)
            gens[position] = gen
            out = run(sampler, x, params, gens=gens)
            got.append(out.token_ids[position])
            batch_rows = [r.roll(step + 1) for r in batch_rows]
        return got

    alone = tokens_of_seeded_row([], 0)
    assert tokens_of_seeded_row([logits[1], logits[2]], 0) == alone
    assert tokens_of_seeded_row([logits[3], logits[4], logits[5]], 2) == alone
    assert tokens_of_seeded_row([logits[6]], 1) == alone
    assert len(set(alone)) > 1  # it is really sampling, not stuck on one token


def test_two_seeded_rows_same_seed_same_tokens(logits):
    sampler = Sampler()
    x = torch.stack([logits[0], logits[1], logits[0]])
    params = [SamplingParams(temperature=1.0, seed=9)] * 3
    gens = [sampler.new_request_generator(9) for _ in range(3)]
    for _ in range(4):
        out = run(sampler, x, params, gens=gens)
        assert out.token_ids[0] == out.token_ids[2]


def test_new_request_generator():
    sampler = Sampler()
    assert sampler.new_request_generator(None) is None
    a, b = sampler.new_request_generator(5), sampler.new_request_generator(5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_seeds_wrap_mod_2_64():
    """The API takes seeds in [-2**63, 2**64); sibling i samples from seed + i, which can
    pass 2**64 (it used to kill the engine thread with an overflow)."""
    sampler = Sampler()

    def draw(seed: int) -> torch.Tensor:
        return torch.rand(4, generator=sampler.new_request_generator(seed))

    assert torch.equal(draw(2**64), draw(0))
    assert torch.equal(draw(2**64 - 1 + 127), draw(126))
    assert torch.equal(draw(-5), draw(2**64 - 5))  # what torch does with negative seeds


def test_top_k_past_int64_is_no_top_k(logits):
    """Any top_k >= V keeps every token; one past int64 used to overflow the tensor."""
    sampler = Sampler()

    def tokens(top_k: int) -> list[int]:
        gens = [sampler.new_request_generator(3 + i) for i in range(8)]
        params = [SamplingParams(temperature=1.0, top_k=top_k)] * 8
        return run(sampler, logits, params, gens=gens).token_ids

    assert tokens(2**70) == tokens(V)


def test_repetition_penalty_exact():
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.0, 3.0]])
    p = SamplingParams(repetition_penalty=2.0)
    out = processed(x, [p], [[0, 1]], [[4, 2, 2]])
    assert same_up_to_shift(out, torch.tensor([[1.0, -4.0, 0.5, -1.0, 0.0, 3.0]]))


def test_frequency_and_presence_penalties_exact():
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt tokens do not count for frequency / presence
    out = processed(x, [p], [[0, 0, 1]], [[2, 2, 2, 3]])
    assert same_up_to_shift(
        out, torch.tensor([[2.0, -2.0, 1.0 - 1.5 - 0.25, -1.0 - 0.5 - 0.25, 0.5]]))


def test_all_penalties_combined_and_rows_independent():
    x = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    out = processed(x, [p, SamplingParams()], [[1], [1]], [[0, 0], [0, 0]])
    # repetition first (2 -> 1, -2 -> -4), then 2 x 1.0 + 0.5 on token 0
    assert same_up_to_shift(out[:1], torch.tensor([[1.0 - 2.5, -4.0, 1.0]]))
    assert same_up_to_shift(out[1:], x[1:])


def test_penalties_change_sampled_token():
    x = torch.tensor([[5.0, 4.0, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    out = run(Sampler(), x, [p], outputs=[[0]])
    assert out.token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids():
    x = torch.zeros(2, 8)
    x[:, 2] = 10.0  # EOS
    x[:, 5] = 9.0  # stop token
    x[:, 1] = 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,))
    masked = processed(x, [p, p], [[], []], [[1, 1], [1, 1, 1]], eos=frozenset({2}))
    assert masked[0, 2] == -math.inf and masked[0, 5] == -math.inf
    assert same_up_to_shift(masked[1:], x[1:])  # min_tokens reached
    out = run(Sampler(), x, [p, p], outputs=[[1, 1], [1, 1, 1]], eos=frozenset({2}))
    assert out.token_ids == [1, 2]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert run(Sampler(), x[:1], [ignore], outputs=[[]], eos=frozenset({2})).token_ids == [5]


def test_allowed_token_ids_mask_every_other_token(logits):
    """vLLM's ``allowed_token_ids``: the row's distribution is the logits' softmax over the
    allowed ids only (every other token -inf, logprobs renormalized), greedy or sampled; a
    row without the field in the same step is untouched."""
    allowed = (3, 7, 12)
    logits = logits[:2, :16]  # processed() reads every logprob: at most 20 ids
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    masked = processed(logits, [greedy, SamplingParams(temperature=0.0)], [[], []],
                       [[], []])
    expected = torch.full_like(logits[0], -math.inf)
    expected[list(allowed)] = logits[0, list(allowed)]
    assert same_up_to_shift(masked[:1], expected[None])
    assert same_up_to_shift(masked[1:], logits[1:2])
    want = allowed[int(logits[0, list(allowed)].argmax())]
    assert run(Sampler(), logits[:1], [greedy]).token_ids == [want]
    hot = SamplingParams(temperature=5.0, allowed_token_ids=allowed, seed=1)
    drawn = {run(Sampler(seed=s), logits[:1], [hot]).token_ids[0] for s in range(40)}
    assert drawn <= set(allowed) and len(drawn) > 1
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=())


def test_bad_words_ban_the_token_that_would_complete_them():
    """A one-token bad word is never sampled; a longer one's last token only right after
    the output ends with the rest of it."""
    x = torch.zeros(3, 8)
    x[:, 4] = 3.0  # the favourite
    x[:, 6] = 2.0
    p = SamplingParams(temperature=0.0, bad_words_token_ids=((1, 2, 4), (6,)))
    masked = processed(x, [p, p, p], [[], [], []], [[1, 2], [2, 1], [0, 1, 2]])
    assert masked[0, 4] == -math.inf and masked[2, 4] == -math.inf  # output ends 1, 2
    assert masked[1, 4] > -math.inf  # output ends 2, 1: the word cannot be completed
    assert bool((masked[:, 6] == -math.inf).all())
    out = run(Sampler(), x, [p, p, p], outputs=[[1, 2], [2, 1], [0, 1, 2]])
    assert out.token_ids == [0, 4, 0]
    assert p.needs_output_history
    assert not SamplingParams(bad_words_token_ids=((6,),)).needs_output_history


def test_logprobs_values_and_top(logits):
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.9, logprobs=0), SamplingParams(temperature=1.0,
                                                                          logprobs=20)]
    x = logits[:4]
    out = run(Sampler(seed=2), x, params)
    ref = torch.log_softmax(x.float(), -1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-6)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0, 20]
    for i, top in enumerate(out.top_logprobs):
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        expected = ref[i].topk(len(top)).values.tolist() if top else []
        assert values == pytest.approx(expected, abs=1e-6)
        for tok, lp in top:
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-6)
    assert out.top_logprobs[0][0][0] == out.token_ids[0]


@pytest.mark.parametrize("others", [(5, None, 0), (None,), (20, 3)])
def test_logprob_token_ids_list_those_tokens_in_their_order(logits, others):
    """vLLM's ``logprob_token_ids``: a row's listed pairs are exactly those tokens' logprobs
    in the order asked (wider or narrower than the other rows' top lists, with rows that
    ask top ones or none beside it); the other rows and the sampled tokens do not change."""
    chosen = (63, 0, 17, 5, 40, 2, 9)
    params = [SamplingParams(temperature=0.0, logprobs=1, logprob_token_ids=chosen),
              SamplingParams(temperature=0.0, logprobs=0, logprob_token_ids=(7,))]
    params += [SamplingParams(temperature=0.0, logprobs=k) for k in others]
    x = logits[:len(params)]
    out = run(Sampler(), x, params)
    alone = run(Sampler(), x, [SamplingParams(temperature=0.0, logprobs=p.logprobs)
                               for p in params])
    ref = torch.log_softmax(x.float(), -1)
    assert out.token_ids == alone.token_ids == x.argmax(-1).tolist()
    assert out.logprobs == alone.logprobs
    for row, ids in ((0, chosen), (1, (7,))):
        assert [t for t, _ in out.top_logprobs[row]] == list(ids)
        assert [lp for _, lp in out.top_logprobs[row]] == pytest.approx(
            ref[row, list(ids)].tolist(), abs=1e-6)
    assert out.top_logprobs[2:] == alone.top_logprobs[2:]


def test_logprob_token_ids_need_logprobs():
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=(1,))
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprobs=0, logprob_token_ids=())


def full_values(out: SamplerOutput, row: int, vocab: int) -> list[float]:
    """Row ``row``'s values of every token, read from its full-vocabulary top list."""
    got = dict(out.top_logprobs[row])
    assert len(got) == vocab
    return [got[i] for i in range(vocab)]


@pytest.mark.parametrize("greedy", [False, True])
def test_each_logprobs_mode_reports_its_values(greedy):
    """vLLM's four ``--logprobs-mode`` values on one row with a penalty, a logit bias,
    temperature and top-k: raw ones are the model's logits as they came; processed ones
    those the token was picked from (a sampled row's after temperature and top-k, with -inf
    where top-k dropped a token; a greedy row's after the penalty and the bias only); the
    sampled token and its own value agree with the lists, and the input is untouched."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    before = x.clone()
    p = SamplingParams(temperature=0.0 if greedy else 0.5, top_k=0 if greedy else 2,
                       frequency_penalty=1.0, logit_bias=((3, 2.0),), logprobs=5)
    after = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5])  # token 0 penalized, token 3 biased
    # top-2 of three tied at 1.0 keeps the two lowest ids (ties ranked by id)
    drawn = after if greedy else torch.tensor([2.0, 2.0, -math.inf, -math.inf, -math.inf])
    want = {"raw_logits": x[0], "raw_logprobs": torch.log_softmax(x[0], -1),
            "processed_logits": drawn, "processed_logprobs": torch.log_softmax(drawn, -1)}
    for mode, ref in want.items():
        for sampler, params in ((Sampler(seed=0, logprobs_mode=mode), p),
                                (Sampler(seed=0), dataclasses.replace(p, logprobs_mode=mode))):
            out = run(sampler, x, [params], outputs=[[0]])
            assert torch.equal(x, before)
            got = full_values(out, 0, 5)
            assert got == pytest.approx(ref.tolist(), abs=1e-6), mode
            token = out.token_ids[0]
            assert out.logprobs[0] == pytest.approx(ref[token].item(), abs=1e-6)
            assert math.isfinite(out.logprobs[0])
            assert token in ((0,) if greedy else (0, 1))  # greedy: the tie's lowest id


@pytest.mark.parametrize("greedy_rows", [(1, 3, 5), (), (0, 1, 2, 3, 4, 5)],
                         ids=["mixed", "all-sampled", "all-greedy"])
def test_rows_of_different_modes_in_one_step(greedy_rows):
    """Rows naming different modes (and rows asking none) in one step: each row reports
    exactly what it reports alone, with sampled and greedy rows mixed or not, bfloat16
    logits."""
    modes = ["raw_logits", "processed_logprobs", "processed_logits", None, "raw_logprobs",
             "processed_logprobs"]
    vocab = SamplingParams.MAX_LOGPROBS
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0 if i in greedy_rows else 0.8, top_p=0.9, seed=i,
                             repetition_penalty=1.3, logprobs=vocab if m else None,
                             logprobs_mode=m) for i, m in enumerate(modes)]
    outputs = [[3, 4]] * 6
    mixed = run(Sampler(), x, params, outputs=outputs,
                gens=[Sampler().new_request_generator(i) for i in range(6)])
    for i, p in enumerate(params):
        alone = run(Sampler(), x[i:i + 1], [p], outputs=outputs[:1],
                    gens=[Sampler().new_request_generator(i)])
        assert mixed.token_ids[i] == alone.token_ids[0]
        if p.logprobs is not None:
            assert mixed.top_logprobs[i] == alone.top_logprobs[0]
            assert mixed.logprobs[i] == alone.logprobs[0]
    raw = x.float()
    assert full_values(mixed, 0, vocab) == raw[0].tolist()
    assert full_values(mixed, 4, vocab) == pytest.approx(
        torch.log_softmax(raw[4], -1).tolist(), abs=1e-6)
    assert mixed.top_logprobs[3] == []
    if 2 not in greedy_rows:
        assert -math.inf in full_values(mixed, 2, vocab)  # top-p dropped some


def test_a_logprobs_mode_is_one_of_vllms():
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs=1, logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs mode"):
        Sampler(logprobs_mode="processed")


def test_mixed_batch_shapes_and_empty():
    sampler = Sampler()
    assert run(sampler, torch.zeros(0, V), []).token_ids == []
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, V), [SamplingParams()], [[]], [[]], [None], NO_EOS)


def test_argmax_rows_equals_argmax_with_ties():
    from tpserve.model.sampler import argmax_rows
    gen = torch.Generator().manual_seed(0)
    for vocab in (128256, 49152, 1000, 151936):
        x = torch.randint(-3, 4, (5, vocab), generator=gen).float()  # many ties
        x[2, 77] = 10.0
        x[3, vocab - 1] = 10.0
        x[4] = 0.0  # all tied: index 0
        got = argmax_rows(x)
        assert torch.equal(got, x.argmax(dim=-1)), vocab
        assert got[2] == 77 and got[3] == vocab - 1 and got[4] == 0


@pytest.mark.parametrize("vocab", [128256, 1000])
def test_plain_greedy_step_takes_the_same_tokens_as_the_float32_pipeline(vocab):
    """A step of plain greedy rows takes the argmax of the logits as they are (no float32
    copy); every token equals the one the full pipeline picks for the same row when
    another row in the step asks for logprobs (which forces the float32 path), bf16 ties
    included, also for logits that are a column slice (a padded vocabulary's view)."""
    gen = torch.Generator().manual_seed(5)
    wide = (torch.randint(-4, 5, (6, vocab + 24), generator=gen) / 4).to(torch.bfloat16)
    wide[1, 9] = wide[1, 300] = 2.0  # a tie: the lower id wins
    wide[2, :] = 0.0  # all tied: id 0
    x = wide[:, :vocab]  # not contiguous
    greedy = SamplingParams(temperature=0.0)
    fast = run(Sampler(), x, [greedy] * 6)
    full = run(Sampler(), x, [greedy] * 5 + [SamplingParams(temperature=0.0, logprobs=1)])
    assert fast.token_ids == full.token_ids == x.float().argmax(-1).tolist()
    assert fast.token_ids[1] == 9 and fast.token_ids[2] == 0
    assert fast.logprobs is None
    # rows the pipeline would change still go through it: a bias moves the argmax
    biased = run(Sampler(), x, [greedy] * 5 + [SamplingParams(temperature=0.0,
                                                               logit_bias=((7, 100.0),))])
    assert biased.token_ids[:5] == fast.token_ids[:5] and biased.token_ids[5] == 7


def test_warm_up_runs_every_path_and_changes_no_draw():
    """The allocator warm-up samples each row count through every path and leaves the
    shared generator where it was: the next draw equals a fresh sampler's."""
    vocab = 1000
    assert small_pool_rows(vocab, 64) == range(1, 65)  # 4,000 bytes a row
    assert list(small_pool_rows(128256, 64)) == [1, 2]  # Llama-3: two rows fit in 1 MiB
    warmed, fresh = Sampler(seed=3), Sampler(seed=3)
    warmed.warm_up(vocab, range(1, 4))
    warmed.warm_up(vocab, range(1, 3), torch.bfloat16)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0)] * 4
    args = (logits, params, [[1]] * 4, [[]] * 4, [None] * 4, frozenset())
    assert warmed.sample(*args).to_host().resolve() == fresh.sample(*args).to_host().resolve()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares the CUDA sampler: GPU only")
def test_the_sampler_on_the_gpu_takes_the_cpu_tokens():
    """The pipeline's masks and biases on CUDA (pinned, non-blocking index copies): greedy
    rows with allowed_token_ids, bad words, logit_bias, min_tokens and penalties take the
    same tokens and logprobs as on the CPU."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 1000, generator=g) * 4
    params = [SamplingParams(temperature=0.0, allowed_token_ids=(3, 500, 999), logprobs=2),
              SamplingParams(temperature=0.0, bad_words_token_ids=((1, 2, int(x[1].argmax())),
                                                                   (int(x[1].topk(2)[1][1]),))),
              SamplingParams(temperature=0.0, logit_bias=((10, 50.0),), logprobs=5),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(int(x[3].argmax()),)),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                             logprobs=1)]
    outputs = [[], [1, 2], [], [4], [int(x[4].argmax())] * 3]
    cpu = run(Sampler(), x, params, outputs=outputs)
    gpu = run(Sampler(device=torch.device("cuda")), x.cuda(), params, outputs=outputs)
    assert gpu.token_ids == cpu.token_ids
    assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)
    assert cpu.token_ids[0] in (3, 500, 999) and cpu.token_ids[2] == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's caching allocator: GPU only")
@pytest.mark.parametrize("vocab,dtype,mode", [(128256, torch.bfloat16, "raw_logprobs"),
                                              (32000, torch.float32, "processed_logprobs")])
def test_after_the_warm_up_steps_reserve_no_new_memory(vocab, dtype, mode):
    """The allocator warm-up covers every path of the rows it warms (``small_pool_rows``):
    afterwards, random mixes of greedy, sampled, filtered, penalized, seeded rows and rows
    of every logprobs mode (beam search's processed ones beside the server's) reserve no
    new memory in either pool."""
    sampler = Sampler(0, "cuda", mode)
    rows = small_pool_rows(vocab, 256)
    sampler.warm_up(vocab, rows, dtype)
    torch.cuda.synchronize()

    def reserved() -> tuple[int, int]:
        stats = torch.cuda.memory_stats()
        return (stats["reserved_bytes.small_pool.current"],
                stats["reserved_bytes.large_pool.current"])

    every = dict(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                 frequency_penalty=0.1, presence_penalty=0.1, min_tokens=4,
                 logit_bias=((1, 1.0),))
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.8, logprobs=5, **every),
             SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.1,
                            logprobs_mode="processed_logprobs"),
             SamplingParams(temperature=0.0, logprobs=20),
             SamplingParams(temperature=0.7, top_p=0.9, logprobs=2),
             SamplingParams(temperature=0.7, logprobs=1, logprob_token_ids=(1, 2, 3)),
             SamplingParams(temperature=0.7, top_k=5, logprobs=3, logprobs_mode="raw_logits"),
             SamplingParams(temperature=0.0, logprobs=3, logprobs_mode="processed_logits"),
             SamplingParams(temperature=0.8, logprobs=5, logprobs_mode="processed_logprobs",
                            **every)]
    noise = torch.Generator("cuda").manual_seed(1)
    pick = random.Random(0)
    before = reserved()
    for m in rows:
        logits = torch.randn(m, vocab, generator=noise, device="cuda").to(dtype)
        for _ in range(100):
            params = [pick.choice(kinds) for _ in range(m)]
            seeded = pick.random() < 0.5
            gens = [sampler.new_request_generator(i) if seeded and not p.greedy else None
                    for i, p in enumerate(params)]
            sampler.sample(logits, params, [[2, 3]] * m, [[5]] * m, gens,
                           frozenset({0})).to_host().resolve()
            assert reserved() == before, (m, params, seeded)
