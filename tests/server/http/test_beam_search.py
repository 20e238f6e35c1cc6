"""Beam search's rule (``http/beam_search.py``: ``BeamSet``, ``beam_step_params``) on
log-probability tables written by hand, where each case has one right answer: a beam's
candidates are its ``2 x width`` likeliest tokens, ending ones finish, the score divides by
the length without the end token, ties go to the earlier beam and the likelier token."""

from __future__ import annotations

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.http.beam_search import Beam, BeamSet, beam_step_params

EOS = 2
NEG_INF = float("-inf")


def top(*pairs: tuple[int, float]) -> tuple[tuple[int, str, float], ...]:
    return tuple((t, f"<{t}>", lp) for t, lp in pairs)


def test_an_end_token_past_the_width_but_within_twice_it_is_a_candidate():
    beams = BeamSet(1, 1, frozenset({EOS}))
    beams.advance([top((5, -0.1), (EOS, -0.3), (7, -4.0))])  # EOS at rank 1 < 2 x 1
    assert [b.tokens for b in beams.live] == [(5,)]
    assert beams.finished == [Beam((EOS,), -0.3, finish_reason="stop")]
    beams.advance([top((6, -2.0), (8, -2.5))])
    assert [b.tokens for b in beams.live] == [(5, 6)]
    # the EOS beam: -0.3 / (1 + 1 - 1); the live one: -2.1 / (1 + 2)
    assert [(b.tokens, b.finish_reason) for b in beams.best()] == [((EOS,), "stop")]
    # rank 2 is past 2 x 1: token 7 was never a candidate
    assert all(7 not in b.tokens for b in beams.finished + beams.live)


def test_the_score_divides_by_the_length_without_the_end_token():
    def search(penalty: float) -> list[tuple[int, ...]]:
        beams = BeamSet(2, 3, frozenset({EOS}), length_penalty=penalty)
        beams.advance([top((10, -0.5), (11, -0.55), (12, -9.0))])
        # beam (10,) ends: -1.0 over 3 + 2 - 1 = 4 is -0.25; beam (11, 13) lives on with
        # -1.1 over 5, -0.22, and wins; counting the end token (-1.0 / 5 = -0.2) it would
        # lose
        beams.advance([top((EOS, -0.5), (14, -3.0)), top((13, -0.55), (15, -3.0))])
        return [b.tokens for b in beams.best()]

    assert search(1.0) == [(11, 13), (10, EOS)]
    assert search(0.0) == [(10, EOS), (11, 13)]  # by the sum alone


def test_ties_go_to_the_earlier_beam_then_the_likelier_token_and_masked_ones_are_dropped():
    beams = BeamSet(2, 4, frozenset({EOS}))
    beams.advance([top((20, -1.0), (21, -1.0), (22, NEG_INF), (23, NEG_INF))])
    assert [b.tokens for b in beams.live] == [(20,), (21,)]
    beams.advance([top((30, -1.0), (31, -2.0)), top((32, -1.0), (33, -1.5))])
    assert [b.tokens for b in beams.live] == [(20, 30), (21, 32)]
    assert beams.finished == []
    beams.advance([top((40, NEG_INF)), top((41, -0.5))])  # beam 0 has nothing left
    assert [b.tokens for b in beams.live] == [(21, 32, 41)]


def test_stop_token_ids_end_beams_with_their_id_as_the_reason_and_logprobs_are_kept():
    beams = BeamSet(1, 2, frozenset({EOS, 9}), stop_token_ids=frozenset({9}), asked=1)
    beams.advance([top((9, -0.2), (EOS, -0.4), (4, -0.5))])  # 9 and EOS ranks 0-1
    assert [(b.tokens, b.stop_reason) for b in beams.finished] == [((9,), 9), ((EOS,), None)]
    assert beams.live == []  # rank 2 is past 2 x 1
    assert beams.finished[0].logprobs[0].top == top((9, -0.2))
    assert beams.finished[0].logprobs[0].logprob == -0.2


def test_a_steps_requests_mask_ends_until_min_tokens_and_ask_for_twice_the_width():
    params = SamplingParams(n=3, max_tokens=10, min_tokens=2, temperature=0.8, top_p=0.5,
                            seed=7, logprobs=1)
    first, third = beam_step_params(params, 0), beam_step_params(params, 2)
    assert (first.n, first.max_tokens, first.min_tokens, first.logprobs) == (1, 1, 1, 6)
    assert (first.temperature, first.top_p, first.seed) == (0.0, 1.0, None)
    assert third.min_tokens == 0
    assert beam_step_params(SamplingParams(n=2, logprobs=9), 0).logprobs == 9
