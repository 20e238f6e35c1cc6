"""``tpserve serve --quantization fp8`` of the embedded SmolLM2 through the real openai
client: a coherent greedy answer, and next-token log-probabilities close to the
unquantized model's (computed here, in process, on the same prompts).

Bound (SmolLM2-135M, measured): over the tokens both the server's fp8 top 5 and the
unquantized top 5 contain, |log p_fp8 - log p| <= 1.5 nats everywhere and <= 0.35 on
average (measured on this text: mean 0.17-0.19, max 1.08); the greedy token agrees at most
positions. A 135M-parameter model is far more sensitive to fp8 than an 8B one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.util import full_logits, load
from tests.server.serverproc import SMALL, ServerProcess
from tpserve.model.loader.checkpoint import open_checkpoint

TEXT = Path(__file__).parents[1] / "data" / "pride_and_prejudice_ch1.txt"
CUTS = list(range(12, 97, 12))  # 8 positions: prefill steps of 12..96 tokens


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*SMALL, "--quantization", "fp8", "--no-engine-process",
                      log_level="info")
    yield s
    assert s.stop() == 0, s.output()


def test_start_up_reports_fp8_weights(server):
    out = server.output()
    assert "weights" in out, out


def test_greedy_answer_is_coherent(server):
    r = server.client().chat.completions.create(
        model=server.client().models.list().data[0].id, temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_next_token_logprobs_are_close_to_the_unquantized_model(server):
    tok = open_checkpoint(None, "auto").tokenizer()
    ids = tok(TEXT.read_text())["input_ids"][:max(CUTS)]
    client = server.client()
    r = client.completions.create(model=client.models.list().data[0].id,
                                  prompt=[ids[:c] for c in CUTS], max_tokens=1,
                                  temperature=0, logprobs=5)
    assert len(r.choices) == len(CUTS)
    model, comm = load(None)
    with torch.no_grad():
        base = full_logits(model, comm, ids).float().log_softmax(-1)
    diffs, agree = [], 0
    for choice in sorted(r.choices, key=lambda c: c.index):
        pos = CUTS[choice.index] - 1
        served = choice.logprobs.top_logprobs[0]
        top = base[pos].topk(5).indices.tolist()
        agree += tok.decode([top[0]]) == choice.logprobs.tokens[0]
        common = [(served[tok.decode([t])], base[pos, t].item()) for t in top
                  if tok.decode([t]) in served]
        assert len(common) >= 3, (pos, served, [tok.decode([t]) for t in top])
        diffs += [abs(a - b) for a, b in common]
    assert max(diffs) <= 1.5, diffs
    assert sum(diffs) / len(diffs) <= 0.35, diffs
    assert agree >= len(CUTS) // 2
