"""Grammar bitmasks and logit_bias in the sampler, on CPU: the torch unpacking against
xgrammar's own kernel, and exact effects on the sampled tokens."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import xgrammar as xgr

from tpserve.model.sampler import Sampler
from tpserve.model.sampling_params import SamplingParams
from tpserve.model.token_bitmask import TokenBitmask, apply_token_bitmask_, unpack_bitmask

V = 1000  # not a multiple of 32: the last word is partly padding


def _bits(allowed: list[set[int]]) -> torch.Tensor:
    bits = torch.zeros(len(allowed), (V + 31) // 32, dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            bits[r, t // 32] |= 1 << (t % 32)
    # int32 with the same bit pattern (bit 31 set -> negative)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def test_unpack_matches_the_set_bits():
    allowed = [{0, 31, 32, 999}, set(range(0, V, 7)), set()]
    got = unpack_bitmask(_bits(allowed), V)
    for r, tokens in enumerate(allowed):
        assert set(torch.nonzero(got[r]).flatten().tolist()) == tokens


def test_apply_matches_xgrammar_on_the_listed_rows_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    bits = torch.randint(-2**31, 2**31 - 1, (2, (V + 31) // 32), generator=g,
                         dtype=torch.int64).to(torch.int32)
    ours = logits.clone()
    apply_token_bitmask_(ours, TokenBitmask(bits, torch.tensor([3, 1])))
    ref = logits.clone()
    full = torch.zeros(4, bits.shape[1], dtype=torch.int32)  # xgrammar: one row per logit row
    full[3], full[1] = bits[0], bits[1]
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=V, indices=[3, 1])
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])


def _sample(logits, params, bitmask=None):
    n = len(params)
    return Sampler(0).sample(logits, params, [[1]] * n, [[]] * n, [None] * n, frozenset({0}),
                             bitmask).resolve()


def test_bitmask_restricts_greedy_and_random_rows():
    logits = torch.zeros(3, V)
    logits[:, 5] = 10.0  # the unconstrained favourite
    allowed = {7, 700}
    mask = TokenBitmask(_bits([allowed, allowed]), torch.tensor([0, 2]))
    out = _sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0),
                           SamplingParams(temperature=1.0, seed=3)], mask)
    assert out.token_ids[0] == 7  # ties go to the lowest allowed id
    assert out.token_ids[1] == 5  # row 1 is free
    assert out.token_ids[2] in allowed


def test_logprobs_describe_the_masked_distribution():
    logits = torch.zeros(1, V)
    mask = TokenBitmask(_bits([{3, 4}]), torch.tensor([0]))
    out = _sample(logits, [SamplingParams(temperature=0, logprobs=2,
                                          logprobs_mode="processed_logprobs")], mask)
    assert out.token_ids == [3]
    assert out.logprobs[0] == pytest.approx(math.log(0.5))
    assert {t for t, _ in out.top_logprobs[0]} == {3, 4}
    # raw logprobs (the default) see the grammar too, as vLLM's (it masks before sampling)
    raw = _sample(logits, [SamplingParams(temperature=0, logprobs=2)], mask)
    assert raw.token_ids == [3] and raw.logprobs[0] == pytest.approx(math.log(0.5))
    assert {t for t, _ in raw.top_logprobs[0]} == {3, 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_logprobs_see_the_grammar_not_a_forced_token(dtype):
    """Row 0 is a grammar's ({3, 4}), row 2 a thinking budget's forced end tag (token 9,
    listed after the grammars: ``grammar_rows``), row 1 free. Raw logprobs: row 0 the
    grammar's distribution, row 2 the model's own (uniform) though it must take token 9;
    processed ones: the masked rows all their mass on what their masks allow. Rows asking
    processed beside raw ones change nothing of either."""
    logits = torch.zeros(3, V, dtype=dtype)
    bits = _bits([{3, 4}, {9}])
    mask = TokenBitmask(bits, torch.tensor([0, 2]), grammar_rows=1)
    raw = SamplingParams(temperature=0, logprobs=2)
    processed = dataclasses.replace(raw, logprobs_mode="processed_logprobs")
    for params in ([raw] * 3, [raw, processed, raw], [processed, raw, processed]):
        out = _sample(logits, params, mask)
        assert out.token_ids == [3, 0, 9]
        want = {"raw_logprobs": [math.log(0.5), -math.log(V), -math.log(V)],
                "processed_logprobs": [math.log(0.5), -math.log(V), 0.0]}
        assert out.logprobs == pytest.approx(
            [want[p.logprobs_mode or "raw_logprobs"][i] for i, p in enumerate(params)],
            abs=1e-5)
    assert mask.grammar_part().rows.tolist() == [0]
    assert TokenBitmask(bits, torch.tensor([0, 2]), grammar_rows=0).grammar_part() is None
    assert TokenBitmask(bits, torch.tensor([0, 2])).grammar_part().rows.tolist() == [0, 2]


def test_logit_bias_adds_to_the_logits():
    logits = torch.zeros(2, V)
    logits[:, 5] = 1.0
    out = _sample(logits, [SamplingParams(temperature=0, logit_bias=((9, 2.0),)),
                           SamplingParams(temperature=0, logit_bias=((5, -100.0),))])
    assert out.token_ids == [9, 0]
    biased = SamplingParams(temperature=0, logprobs=0, logit_bias=((9, 0.5), (5, -0.5)),
                            logprobs_mode="processed_logprobs")
    out = _sample(logits[:1], [biased])
    # logits: token 9 -> 0.5, token 5 -> 0.5, the rest 0: ties go to the lowest id
    assert out.token_ids == [5]
    assert out.logprobs[0] == pytest.approx(0.5 - math.log(2 * math.exp(0.5) + V - 2))
    # raw logprobs (the default) are the model's: token 5 at 1.0, the bias unseen
    raw = _sample(logits[:1], [dataclasses.replace(biased, logprobs_mode=None)])
    assert raw.token_ids == [5]
    assert raw.logprobs[0] == pytest.approx(1.0 - math.log(math.exp(1.0) + V - 1))


@pytest.mark.parametrize("bias", [100.5, -101, math.nan, math.inf])
def test_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, bias),))
