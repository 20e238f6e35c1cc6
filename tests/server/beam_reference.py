"""The oracle of the beam-search tests (``test_beam_search_server.py``) and of
``bench/beam_search.py``: vLLM's beam search written over a transformers model's own
logits, one full forward a beam and step (no engine, no cache, no sampler)."""

from __future__ import annotations

import torch


def reference(model, prompt: list[int], width: int, steps: int, ends: set[int],
              length_penalty: float = 1.0) -> list[tuple[tuple[int, ...], float, str]]:
    """Beam search over the model's float32 log-probabilities: each live beam's ``2 x
    width`` most likely tokens are its candidates, best first (ties to the earlier beam,
    then the likelier token); ending ones finish, the ``width`` best others live on; the
    ``width`` best finished beams by ``sum / (prompt + output - end token) ** penalty``.
    Returns (tokens, summed logprob, finish reason), best first."""
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    done: list[tuple[tuple[int, ...], float, str]] = []
    for _ in range(steps):
        candidates = []
        for b, (tokens, total) in enumerate(live):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(tokens)])).logits[0, -1]
            values, ids = logits.float().log_softmax(-1).topk(2 * width)
            for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
                candidates.append((-(total + v), b, rank, t))
        candidates.sort()
        survivors = []
        for negative, b, _, t in candidates:
            grown = live[b][0] + (t,)
            if t in ends:
                done.append((grown, -negative, "stop"))
            elif len(survivors) < width:
                survivors.append((grown, -negative))
        live = survivors
    done += [(tokens, total, "length") for tokens, total in live]

    def score(beam):
        length = len(prompt) + len(beam[0]) - (beam[2] == "stop")
        return beam[1] / length ** length_penalty

    return sorted(done, key=lambda beam: -score(beam))[:width]
