"""A "thinking" SmolLM2 for the reasoning-parser tests: the embedded model with the tokens
``<think>`` and ``</think>`` added to its tokenizer (not special, as DeepSeek-R1's and
Qwen3's are) and to its weights.

Each new token's embedding is a copy of a word's (``<think>`` of ``The``, ``</think>`` of
`` is``) and its LM-head row that word's row times 1.25 (the head is untied). So wherever
the embedded model's greedy choice is that word (with a positive logit), this model writes
the tag instead, and goes on as if it had written the word: "What is the capital of
France?" is answered ``<think> capital of France</think> Paris.``, exactly and
deterministically, from real weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model.util import embedded_state, save_embedded_folder
from tpserve.model.loader.checkpoint import open_checkpoint

TAGS = (("<think>", "The"), ("</think>", "Ġis"))  # (tag, the word whose rows it copies)
HEAD_SCALE = 1.25


def write_thinking_smollm2(folder: Path) -> Path:
    ckpt = open_checkpoint(None)
    state = embedded_state(ckpt)
    tokenizer = ckpt.tokenizer()
    embed = state["model.embed_tokens.weight"]
    head = state.pop("lm_head.weight", embed)  # tied in SmolLM2
    words = [tokenizer.convert_tokens_to_ids(word) for _, word in TAGS]
    tokenizer.add_tokens([tag for tag, _ in TAGS], special_tokens=False)
    state["model.embed_tokens.weight"] = torch.cat([embed, embed[words]])
    state["lm_head.weight"] = torch.cat([head, HEAD_SCALE * head[words]])
    vocab_size = len(tokenizer)
    assert state["lm_head.weight"].shape[0] == vocab_size
    return save_embedded_folder(folder, ckpt, state, tokenizer, vocab_size=vocab_size,
                                tie_word_embeddings=False)
