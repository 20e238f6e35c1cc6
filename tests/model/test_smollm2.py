"""The embedded SmolLM2 GGUF: our logits equal transformers' at tp 1 and tp 3, and greedy
decoding through the paged KV pool matches transformers' generate() token for token. At tp 2
and 4 (9 query / 3 KV heads padded with zero heads to 12 / 4) logits and greedy tokens equal
tp 1's, also sequence parallel (``--tp-comm allgather``) at tp 2."""

from __future__ import annotations

import pytest
import torch

from tests.model.util import full_logits, greedy, load
from tpserve.parallel.launch import run_ranks

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "<|im_start|>user\nWrite a haiku about GPUs.<|im_end|>\n<|im_start|>assistant\n",
    "Paged attention stores the KV cache in fixed-size blocks, so",
]


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    model, tok = hf_smollm2
    ids = [tok(p).input_ids for p in PROMPTS]
    with torch.no_grad():
        logits = [model(torch.tensor([i])).logits[0] for i in ids]
    return ids, logits


@pytest.fixture(scope="module")
def tp1(smollm2_path):
    """Our model at tp 1, loaded once for the module: every run below gets a fresh KV pool
    and the forward keeps no state, so the tests share it."""
    return load(str(smollm2_path))


def _logits_on_rank(group, path, ids_list):
    model, comm = load(path, group)
    return [full_logits(model, comm, ids) for ids in ids_list]


def test_logits_equal_transformers_tp1(tp1, reference):
    ids, ref = reference
    model, comm = tp1
    for i, r in zip(ids, ref, strict=True):
        ours = full_logits(model, comm, i)
        assert ours.shape == r.shape
        assert (ours - r).abs().max().item() < 1e-3


@pytest.mark.slow
def test_logits_equal_transformers_tp3(smollm2_path, reference):
    ids, ref = reference
    per_rank = run_ranks(_logits_on_rank, 3, str(smollm2_path), ids, timeout_s=400)
    for rank_logits in per_rank:  # every rank ends with the full-vocabulary logits
        for ours, r in zip(rank_logits, ref, strict=True):
            assert (ours - r).abs().max().item() < 1e-3


def test_greedy_32_tokens_identical_to_transformers(tp1, hf_smollm2):
    hf, tok = hf_smollm2
    model, comm = tp1
    for prompt in PROMPTS[1:3]:  # prompts whose first 32 greedy tokens hold no EOS
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32,
                              do_sample=False)[0, len(ids):].tolist()
        assert len(ref) == 32
        assert greedy(model, comm, ids, 32) == ref
    ids = tok(PROMPTS[0]).input_ids
    assert tok.decode(greedy(model, comm, ids, 2)) == " Paris."


def _padded_run(group, path, ids_list, greedy_ids, n, tp_comm):
    model, comm = load(path, group, tp_comm=tp_comm)
    return [full_logits(model, comm, ids) for ids in ids_list], greedy(model, comm,
                                                                       greedy_ids, n)


@pytest.fixture(scope="module")
def tp1_padded_reference(tp1, smollm2_tokenizer):
    """tp 1's logits of the first two prompts and 12 greedy tokens of the second: what every
    padded tp size must reproduce (computed once, not once per parametrization)."""
    model, comm = tp1
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS[:2]]
    return ids, [full_logits(model, comm, i) for i in ids], greedy(model, comm, ids[1], 12)


@pytest.mark.parametrize("tp,tp_comm", [(2, "allreduce"), (4, "allreduce"), (2, "allgather")])
def test_zero_padded_heads_equal_tp1(smollm2_path, tp1_padded_reference, tp, tp_comm):
    ids, want_logits, want_tokens = tp1_padded_reference
    per_rank = run_ranks(_padded_run, tp, str(smollm2_path), ids, ids[1], 12, tp_comm,
                         timeout_s=500)
    for logits, tokens in per_rank:
        for ours, want in zip(logits, want_logits, strict=True):
            assert (ours - want).abs().max().item() < 1e-3
        assert tokens == want_tokens
