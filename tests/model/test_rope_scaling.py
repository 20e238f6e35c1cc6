"""RoPE scaling (linear, YaRN, Llama-3; LongRoPE in ``test_phi3``): our cos|sin tables
equal transformers' rotary embedding, unsupported types are refused by name, the model's
context follows vLLM's rule, and a tiny random Qwen2 with YaRN gives transformers' logits
past its original context."""

from __future__ import annotations

import math

import pytest
import torch

from tests.model.util import full_logits, load, save_hf_folder
from tpserve.model.config import ModelConfig
from tpserve.model.layers.rotary import cos_sin_cache, inverse_frequencies
from tpserve.model.rope_scaling import RopeScaling
from tpserve.model.runner_config import model_context, resolve_max_model_len

POSITIONS = 1024


def _hf_rotary(rope: dict, head_dim: int, theta: float, max_positions: int, **top_level):
    """transformers' Qwen2 rotary embedding for ``rope`` (a ``rope_scaling`` dict)."""
    import transformers as tf
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = tf.Qwen2Config(hidden_size=2 * head_dim, num_attention_heads=2,
                         num_key_value_heads=1, rope_theta=theta,
                         max_position_embeddings=max_positions, rope_scaling=dict(rope),
                         **top_level)
    return Qwen2RotaryEmbedding(cfg)


def _hf_table(emb, n: int) -> torch.Tensor:
    """transformers' cos and sin at positions 0..n-1 in our layout (the first half of each:
    its second half repeats it)."""
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)


def _our_config(rope: dict, head_dim: int, theta: float, max_positions: int, key: str,
                **top_level) -> ModelConfig:
    """``ModelConfig.from_hf`` with ``rope`` under ``key`` (``rope_scaling``, or
    transformers 5's ``rope_parameters``, which also carries ``rope_theta``)."""
    d = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 2 * head_dim,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": max_positions, **top_level}
    if key == "rope_scaling":
        d.update(rope_scaling=dict(rope), rope_theta=theta)
    else:
        d.update(rope_parameters={**rope, "rope_theta": theta})
    return ModelConfig.from_hf(d)


# (rope_scaling, head_dim, rope_theta, max_position_embeddings)
CASES = {
    "linear": ({"rope_type": "linear", "factor": 2.5}, 64, 10000.0, 4096),
    "linear-legacy-type": ({"type": "linear", "factor": 4}, 128, 1e6, 16384),
    "yarn-qwen2.5": ({"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 32768}, 128, 1e6, 32768),
    "yarn-tiny": ({"rope_type": "yarn", "factor": 4.0,
                   "original_max_position_embeddings": 8}, 16, 10000.0, 32),
    "yarn-legacy-type": ({"type": "yarn", "factor": 2.0,
                          "original_max_position_embeddings": 2048}, 64, 10000.0, 4096),
    "yarn-mscale-deepseek": ({"rope_type": "yarn", "factor": 40, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                              "original_max_position_embeddings": 4096}, 64, 10000.0, 163840),
    "yarn-mscale-ratio": ({"rope_type": "yarn", "factor": 40, "mscale": 1.0,
                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
                          64, 10000.0, 163840),
    "yarn-mscale-alone": ({"rope_type": "yarn", "factor": 8.0, "mscale": 0.5,
                           "original_max_position_embeddings": 512}, 64, 10000.0, 4096),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5,
                               "original_max_position_embeddings": 512}, 64, 10000.0, 4096),
    "yarn-betas-no-truncate": ({"rope_type": "yarn", "factor": 16.0, "beta_fast": 16,
                                "beta_slow": 2, "truncate": False,
                                "original_max_position_embeddings": 1024}, 64, 500000.0, 16384),
    "yarn-null-factor": ({"rope_type": "yarn", "factor": None,
                          "original_max_position_embeddings": 128}, 32, 10000.0, 512),
    "yarn-no-original": ({"rope_type": "yarn", "factor": 2.0}, 32, 10000.0, 256),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
               64, 500000.0, 256),
}


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_table_equals_transformers(case, key):
    rope, head_dim, theta, max_pos = CASES[case]
    emb = _hf_rotary(rope, head_dim, theta, max_pos)
    cfg = _our_config(rope, head_dim, theta, max_pos, key)
    assert cfg.rope_scaling.rope_type == rope.get("rope_type", rope.get("type"))
    assert cfg.rope_scaling.attention_factor == pytest.approx(emb.attention_scaling, abs=1e-12)
    inv = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(inv, emb.inv_freq, rtol=0, atol=1e-9)
    ours = cos_sin_cache(cfg.head_dim, POSITIONS, cfg.rope_theta, cfg.rope_scaling)
    assert ours.dtype == torch.float32 and ours.shape == (POSITIONS, head_dim)
    assert (ours - _hf_table(emb, POSITIONS)).abs().max().item() <= 1e-6


def test_top_level_original_context_wins():
    """Phi-3's place for ``original_max_position_embeddings``: transformers' rotary
    embedding takes it over the rope parameters' (its standardisation), and so do we."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    emb = _hf_rotary(rope, 32, 10000.0, 512, original_max_position_embeddings=64)
    cfg = _our_config(rope, 32, 10000.0, 512, "rope_scaling",
                      original_max_position_embeddings=64)
    assert cfg.rope_scaling.original_max_position_embeddings == 64
    ours = cos_sin_cache(32, POSITIONS, 10000.0, cfg.rope_scaling)
    assert (ours - _hf_table(emb, POSITIONS)).abs().max().item() <= 1e-6


def test_yarn_scales_the_table():
    """The YaRN cases are not plain RoPE in disguise: slow frequencies are divided by the
    factor, fast ones kept, and cos^2 + sin^2 is the attention factor squared."""
    rope, head_dim, theta, max_pos = CASES["yarn-qwen2.5"]
    s = _our_config(rope, head_dim, theta, max_pos, "rope_scaling").rope_scaling
    plain = inverse_frequencies(head_dim, theta, None)
    inv = inverse_frequencies(head_dim, theta, s)
    assert inv[0] == plain[0] and torch.allclose(inv[-1], plain[-1] / s.factor)
    table = cos_sin_cache(head_dim, 64, theta, s)
    half = head_dim // 2
    norm = table[:, :half] ** 2 + table[:, half:] ** 2
    torch.testing.assert_close(norm, torch.full_like(norm, s.attention_factor ** 2))
    assert s.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def _llama3_inverse_frequencies_before(dim: int, theta: float, factor: float, low: float,
                                       high: float, old: int) -> torch.Tensor:
    """The Llama-3 frequencies as ``layers/rotary.py`` computed them before the other
    scaling types came: the oracle that the Llama-3 path is unchanged."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


@pytest.mark.parametrize("dim,theta,old", [(128, 500000.0, 8192), (64, 500000.0, 32)])
def test_llama3_path_unchanged(dim, theta, old):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 2 * dim,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "rope_theta": theta, "max_position_embeddings": 16 * old,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": old}}
    s = ModelConfig.from_hf(d).rope_scaling
    assert s == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=old)
    before = _llama3_inverse_frequencies_before(dim, theta, 8.0, 1.0, 4.0, old)
    assert torch.equal(inverse_frequencies(dim, theta, s), before)
    freqs = torch.outer(torch.arange(POSITIONS, dtype=torch.float32), before)
    assert torch.equal(cos_sin_cache(dim, POSITIONS, theta, s),
                       torch.cat((freqs.cos(), freqs.sin()), dim=-1))


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "mrope", "mrope_section": [16, 24, 24]},
])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unsupported_type_is_refused_by_name(rope, key):
    name = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ValueError, match=rf"'{name}' is not supported \(supported: default, "
                                         r"linear, llama3, yarn, longrope\)"):
        _our_config(rope, 64, 10000.0, 4096, key)


@pytest.mark.parametrize("rope", [None, {"rope_type": "default"}, {"type": "default"}])
def test_default_rope_has_no_scaling(rope):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    if rope is not None:
        d["rope_parameters"] = {**rope, "rope_theta": 1e6}
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_scaling is None
    assert cfg.rope_theta == (1e6 if rope else 10000.0)


@pytest.mark.parametrize("max_pos,rope,window,context", [
    (32768, None, None, 32768),
    (32768, None, 4096, 32768),  # a sliding window does not cap it
    # llama3: max_position_embeddings is already the long context
    (131072, CASES["llama3"][0], None, 131072),
    (4096, {"rope_type": "linear", "factor": 4.0}, None, 16384),
    (4096, {"type": "linear", "factor": 2.5}, None, 10240),
    # yarn: the original context times the factor, whatever max_position_embeddings says
    (32768, CASES["yarn-qwen2.5"][0], None, 131072),
    (40960, CASES["yarn-qwen2.5"][0], None, 131072),  # Qwen3's config with YaRN added
    (163840, CASES["yarn-mscale-ratio"][0], None, 163840),
    (4096, {"rope_type": "yarn", "factor": 2.0}, None, 8192),  # original: max_pos
    (32, CASES["yarn-tiny"][0], 16, 32),
])
def test_model_context(max_pos, rope, window, context):
    d = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 64,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "max_position_embeddings": max_pos, "sliding_window": window,
         "use_sliding_window": window is not None}
    if rope is not None:
        d["rope_scaling"] = rope
    cfg = ModelConfig.from_hf(d)
    assert model_context(cfg) == context
    assert resolve_max_model_len(None, cfg) == context
    assert resolve_max_model_len(context - 1, cfg) == context - 1
    with pytest.raises(ValueError, match=f"exceeds the model's context of {context} tokens"):
        resolve_max_model_len(context + 1, cfg)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5)
# 20 tokens: 12 past the original context of 8
TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 5, 77, 140, 33, 210, 8, 61]


def tiny_qwen2(rope: dict):
    """A tiny random transformers Qwen2 (32 positions) with ``rope`` as its
    ``rope_scaling``, non-trivial biases and norms, and its logits over ``TOKENS``."""
    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.Qwen2Config(**TINY, rope_theta=10000.0, max_position_embeddings=32,
                         rope_scaling=dict(rope))
    cfg.architectures = ["Qwen2ForCausalLM"]
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert hf.model.rotary_emb.rope_type == rope.get("rope_type", rope.get("type"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        return hf, hf(torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
     "beta_fast": 8, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
    {"type": "linear", "factor": 3.0},
], ids=["yarn", "yarn-mscale", "linear"])
def test_tiny_qwen2_equals_transformers(tmp_path, rope):
    hf, ref = tiny_qwen2(rope)
    model, comm = load(str(save_hf_folder(hf, tmp_path / "qwen2")))
    assert model.cfg.rope_scaling is not None
    assert (full_logits(model, comm, TOKENS) - ref).abs().max().item() < 1e-4
