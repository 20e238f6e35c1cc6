"""Granite (IBM's Llama with multipliers): a tiny random checkpoint written by transformers,
and the same model as a llama.cpp ``granite`` GGUF file (its multipliers as metadata, q/k
rows permuted as llama.cpp's converter permutes a Llama's), give transformers' logits in
float32 at tp 1 and 2; each multiplier changes transformers' answer, so equality tests it."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_tiny_models import TINY, TOKENS
from tests.model.util import full_logits, load, save_gguf_file, save_hf_folder, tiny_hf_model
from tpserve.model.config import ModelConfig
from tpserve.parallel.launch import run_ranks

MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                   attention_multiplier=0.0078125 * 16, logits_scaling=8.0)


def _hf_granite(**changes):
    import transformers as tf

    torch.manual_seed(60)
    cfg = tf.GraniteConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=True,
                           **{**MULTIPLIERS, **changes})
    # q/k times 8: scores of a few units, so the attention multiplier changes the answer
    return tiny_hf_model(cfg, "GraniteForCausalLM",
                         scaled=(("q_proj.weight", "k_proj.weight"), 8.0))


def _logits(group, path: str) -> torch.Tensor:
    model, comm = load(path, group)
    return full_logits(model, comm, TOKENS)


def _granite_metadata(w) -> None:
    for key, value in (("attention.scale", MULTIPLIERS["attention_multiplier"]),
                       ("embedding_scale", MULTIPLIERS["embedding_multiplier"]),
                       ("residual_scale", MULTIPLIERS["residual_multiplier"]),
                       ("logit_scale", MULTIPLIERS["logits_scaling"])):
        w.add_float32(f"granite.{key}", value)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_granite_equals_transformers(tmp_path, fmt):
    hf = _hf_granite()
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
    if fmt == "gguf":
        path = str(save_gguf_file(hf, tmp_path / "granite.gguf", "granite", _granite_metadata))
    else:
        path = str(save_hf_folder(hf, tmp_path / "granite"))
    for tp in (1, 2):
        for logits in run_ranks(_logits, tp, path):
            assert (logits - want).abs().max().item() < 1e-4, (fmt, tp)


def test_each_multiplier_matters():
    x = torch.tensor([TOKENS])
    with torch.no_grad():
        want = _hf_granite()(x).logits[0]
        for key in MULTIPLIERS:
            other = _hf_granite(**{key: 1.0})(x).logits[0]
            assert (other - want).abs().max() > 10 * 1e-4, key  # the tolerance above
    cfg = ModelConfig.from_hf(_hf_granite().config.to_dict())
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale,
            cfg.logits_scaling) == (12.0, 0.22, 0.125, 8.0)
