"""RoPE scaling in GGUF files, as llama.cpp's converter (``convert_hf_to_gguf.py``) writes
it: Llama-3's as the tensor ``rope_freqs.weight`` (per rotated pair, the divisor of its
frequency), linear and YaRN as ``{arch}.rope.scaling.*`` metadata. Tiny random models
written as GGUF files the converter's way give transformers' logits; the same Llama-3 file
without its ``rope_freqs.weight`` does not; an unknown scaling type is refused by name."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from tests.model.test_rope_scaling import TOKENS as TOKENS_20
from tests.model.test_rope_scaling import tiny_qwen2
from tests.model.test_tiny_models import TOKENS as TOKENS_13
from tests.model.test_tiny_models import _hf_model, _logits
from tests.model.util import full_logits, load, save_gguf_file
from tpserve.model.layers.rotary import cos_sin_cache, inverse_frequencies
from tpserve.model.loader.gguf_file import iter_weights, num_weights, open_reader, read_config
from tpserve.model.rope_scaling import RopeScaling
from tpserve.model.runner_config import model_context
from tpserve.parallel.launch import run_ranks


def _converter_rope_freqs(hparams: dict) -> torch.Tensor:
    """``rope_freqs.weight`` as llama.cpp's converter computes it
    (``LlamaModel.generate_extra_tensors``), line for line. Note that it reads
    ``original_max_position_embeddings`` from the top level of ``config.json`` (8192 when
    absent, right for Llama-3.1/3.2/3.3, whose ``rope_scaling`` says 8192)."""
    rope_scaling = hparams["rope_scaling"]
    base = hparams.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    factor = rope_scaling.get("factor", 8.0)
    low_freq_factor = rope_scaling.get("low_freq_factor", 1.0)
    high_freq_factor = rope_scaling.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = ((old_context_len / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32)


def _converter_rope_metadata(w: gguf.GGUFWriter, rope: dict) -> None:
    """The ``rope.scaling.*`` keys llama.cpp's converter writes for transformers' ``rope``
    (``TextModel.set_gguf_parameters``)."""
    rope_type, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
        if (beta_fast := rope.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := rope.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(beta_slow)


def _write_gguf(hf, path, arch: str, rope: dict | None = None,
                rope_freqs: torch.Tensor | None = None) -> None:
    """``hf`` as a GGUF file of ``arch`` (``tests/model/util.save_gguf_file``), with
    ``rope`` (transformers' rope parameters) as the converter writes it and the converter's
    ``rope_freqs`` tensor when given."""
    save_gguf_file(hf, path, arch,
                   None if rope is None else lambda w: _converter_rope_metadata(w, rope),
                   None if rope_freqs is None else {"rope_freqs.weight": rope_freqs.numpy()})


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """The tiny Llama-3 (llama3 RoPE scaling, tied embeddings) as a ``llama`` GGUF with its
    ``rope_freqs.weight``, the same without it, and transformers' logits."""
    hf = _hf_model("llama3")
    rope = dict(hf.config.rope_parameters)
    assert rope["rope_type"] == "llama3"
    # its config.json as the converter reads it; the tiny model's original context (32) is
    # also given at the top level, where the converter looks for it
    hparams = {"hidden_size": hf.config.hidden_size, "head_dim": hf.config.head_dim,
               "num_attention_heads": hf.config.num_attention_heads,
               "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope,
               "original_max_position_embeddings": rope["original_max_position_embeddings"]}
    folder = tmp_path_factory.mktemp("llama3-gguf")
    with_freqs, without = folder / "with.gguf", folder / "without.gguf"
    _write_gguf(hf, with_freqs, "llama", rope_freqs=_converter_rope_freqs(hparams))
    _write_gguf(hf, without, "llama")
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS_13])).logits[0]
    return with_freqs, without, ref


def test_llama3_rope_freqs_read_into_the_config(llama3):
    path = llama3[0]
    cfg = read_config(open_reader(path), path)
    s = cfg.rope_scaling
    assert s is not None and s.rope_type == "freq_factors" and s.factor == 1.0
    assert len(s.freq_factors) == cfg.head_dim // 2
    assert s.freq_factors[0] == 1.0 and s.freq_factors[-1] == 8.0
    hash(cfg)  # still frozen and hashable
    # like llama3: the context is max_position_embeddings (context_length), not multiplied
    assert model_context(cfg) == cfg.max_position_embeddings == 256
    # the tensor is config, not a weight: the load's count leaves it out
    reader = open_reader(path)
    assert num_weights(reader) == len(reader.tensors) - 1
    assert "rope_freqs.weight" not in {n for n, _ in iter_weights(reader, cfg)}


@pytest.mark.parametrize("tp", [1, 2])
def test_llama3_gguf_equals_transformers(llama3, tp):
    path, _, ref = llama3
    results = run_ranks(_logits, tp, str(path), timeout_s=300)
    assert len(results) == tp
    for logits in results:
        assert (logits - ref).abs().max().item() < 1e-4


def test_llama3_gguf_without_rope_freqs_differs(llama3):
    """The check above can fail: without the tensor the model is plain RoPE, and wrong
    (by about 2e-3 here, 20x the tolerance: a tiny random model's attention is nearly
    uniform, so positions matter little)."""
    _, path, ref = llama3
    model, comm = load(str(path))
    assert model.cfg.rope_scaling is None
    assert (full_logits(model, comm, TOKENS_13) - ref).abs().max().item() > 1e-3




@pytest.mark.parametrize("rope,context", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, 32),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
      "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.25}, 32),
    ({"type": "linear", "factor": 3.0}, 96),
], ids=["yarn", "yarn-betas-attention", "linear"])
def test_qwen2_gguf_scaling_metadata_equals_transformers(tmp_path, rope, context):
    """A tiny Qwen2 with YaRN / linear scaling, written as a ``qwen2`` GGUF with the
    converter's ``rope.scaling.*`` keys, gives transformers' logits past the original
    context."""
    hf, ref = tiny_qwen2(rope)
    path = tmp_path / "qwen2.gguf"
    _write_gguf(hf, path, "qwen2", rope=rope)
    model, comm = load(str(path))
    s = model.cfg.rope_scaling
    assert s is not None and s.rope_type == rope.get("rope_type", rope.get("type"))
    assert s.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert model_context(model.cfg) == context
    assert (full_logits(model, comm, TOKENS_20) - ref).abs().max().item() < 1e-4


def _metadata_only(path, scaling: dict, tensors: dict | None = None):
    """A ``qwen2`` GGUF of a small shape with ``{arch}.rope.scaling.<key>`` = value for
    each of ``scaling`` (str as strings, the rest as float32 / uint32), and its config."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in [("block_count", 1), ("embedding_length", 64),
                       ("feed_forward_length", 64), ("attention.head_count", 4),
                       ("vocab_size", 32), ("context_length", 4096)]:
        w.add_uint32(f"qwen2.{key}", value)
    for key, value in scaling.items():
        name = f"qwen2.rope.scaling.{key}" if "." not in key else f"qwen2.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_float32(name, value)
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_config(open_reader(path), path)


@pytest.mark.parametrize("kind", ["longrope", "dynamic", "llama3"])
def test_unknown_scaling_type_is_refused_by_name(tmp_path, kind):
    with pytest.raises(ValueError, match=f"RoPE scaling type '{kind}'.*not supported"):
        _metadata_only(tmp_path / "m.gguf", {"type": kind, "factor": 4.0})


@pytest.mark.parametrize("scaling,expected", [
    ({}, None),
    ({"type": "none", "factor": 4.0}, None),
    ({"type": "linear"}, None),  # no factor: llama.cpp scales by 1
    ({"factor": 2.0}, RopeScaling(rope_type="linear", factor=2.0)),  # llama.cpp's default
    ({"rope.scale_linear": 2.0}, RopeScaling(rope_type="linear", factor=2.0)),  # old key
    ({"type": "yarn", "factor": 4.0},  # original: the context length; default mscale
     RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
                 attention_factor=0.1 * math.log(4.0) + 1)),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 1024, "attn_factor": 1.5},
     RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024,
                 attention_factor=1.5)),
])
def test_scaling_metadata_to_config(tmp_path, scaling, expected):
    s = _metadata_only(tmp_path / "m.gguf", scaling).rope_scaling
    if expected is None or expected.rope_type != "yarn":
        assert s == expected
        return
    assert s.attention_factor == pytest.approx(expected.attention_factor, rel=1e-6)
    assert s == RopeScaling(**{**expected.__dict__, "attention_factor": s.attention_factor})


@pytest.mark.parametrize("scaling,tensors,match", [
    ({"type": "linear", "factor": 2.0, "attn_factor": 1.2}, None, "without YaRN"),
    ({"type": "yarn", "factor": 4.0, "yarn_ext_factor": 0.5}, None, "extrapolation"),
    ({"type": "yarn", "factor": 4.0}, {"rope_freqs.weight": np.ones(8, np.float32)},
     "together with yarn"),
    ({}, {"rope_freqs.weight": np.ones(5, np.float32)}, "holds 5 factors"),
    ({}, {"rope_freqs.weight": np.zeros(8, np.float32)}, "not positive"),
    ({"type": "yarn", "factor": 4.0, "yarn_log_multiplier": 0.1}, None,
     "yarn_log_multiplier is not supported"),
])
def test_unsupported_combinations_are_refused(tmp_path, scaling, tensors, match):
    with pytest.raises(ValueError, match=match):
        _metadata_only(tmp_path / "m.gguf", scaling, tensors)


def test_inverse_frequencies_with_freq_factors():
    dim, theta = 16, 500000.0
    factors = (1.0, 1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 8.0)
    s = RopeScaling(rope_type="freq_factors", factor=1.0, freq_factors=factors)
    plain = inverse_frequencies(dim, theta, None)
    inv = inverse_frequencies(dim, theta, s)
    assert inv.dtype == torch.float32
    assert torch.equal(inv, plain / torch.tensor(factors))
    cache = cos_sin_cache(dim, 10, theta, s)
    angles = torch.outer(torch.arange(10, dtype=torch.float32), inv)
    assert torch.equal(cache, torch.cat((angles.cos(), angles.sin()), dim=-1))
    with pytest.raises(ValueError, match="7 RoPE frequency factors for a head of 16"):
        inverse_frequencies(dim, theta, RopeScaling(rope_type="freq_factors", factor=1.0,
                                                    freq_factors=factors[:7]))
