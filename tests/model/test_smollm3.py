"""SmolLM3 (Hugging Face's Llama with NoPE layers: every fourth layer rotates nothing): a
tiny random checkpoint written by transformers gives transformers' logits in float32 at
tp 1 and 2, prefilled whole, in chunks and decoded; the NoPE layers change the answer; on
the Triton ops (the RoPE kernel reading the identity table's one row at stride 0) it
equals the torch reference."""

from __future__ import annotations

import torch

from tests.model.test_tiny_models import TINY
from tests.model.util import hf_checkpoints, load, tiny_hf_model, whole_and_stepped
from tpserve.model.config import ModelConfig
from tpserve.parallel.launch import run_ranks

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 33, 71, 140, 2, 60, 61, 8]


def _hf_smollm3(interval: int = 2):
    import transformers as tf

    torch.manual_seed(61)
    cfg = tf.SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, rope_theta=10000.0,
                           no_rope_layer_interval=interval, pad_token_id=0)
    # q/k times 8: attention scores of a few units, so positions matter
    return tiny_hf_model(cfg, "SmolLM3ForCausalLM",
                         scaled=(("q_proj.weight", "k_proj.weight"), 8.0))


def _steps(group, folder: str) -> list[torch.Tensor]:
    model, comm = load(folder, group)
    return whole_and_stepped(model, comm, TOKENS, 7, 8)


def test_smollm3_equals_transformers(tmp_path_factory):
    checkpoints = hf_checkpoints(tmp_path_factory, lambda kind: _hf_smollm3(),
                                 lambda kind: TOKENS)
    folder, want = checkpoints("smollm3")
    cfg = ModelConfig.from_hf(_hf_smollm3().config.to_dict())
    assert cfg.nope_layers == (1, 3) and cfg.tie_word_embeddings
    with torch.no_grad():  # every layer rotating: another answer, so NoPE is tested
        everywhere = _hf_smollm3(interval=10**6)
        everywhere.load_state_dict(_hf_smollm3().state_dict())
        assert (everywhere(torch.tensor([TOKENS])).logits[0] - want).abs().max() > 1e-3
    for tp in (1, 2):
        for whole, stepped in run_ranks(_steps, tp, folder):
            assert (whole - want).abs().max().item() < 1e-4, tp
            assert (stepped - want).abs().max().item() < 1e-4, tp
