"""Dummy weights are a pure function of (seed, tensor name, index): every rank reads its
shard of the same full tensor, so a dummy model's logits do not depend on the tensor-parallel
size (what the multi-GPU correctness runs compare)."""

from __future__ import annotations

import pytest
import torch

from tests.model.util import full_logits, load
from tpserve.model.loader.dummy import HashedSource, hf_tensors, shape_config
from tpserve.parallel.launch import run_ranks

CPU = torch.device("cpu")
TOKENS = [1, 504, 3575, 282, 4649, 314, 17, 9000, 42]


def test_slices_are_slices_of_the_one_full_tensor():
    w = HashedSource("model.layers.3.mlp.up_proj.weight", (300, 70), 7, CPU)
    full = w.read()
    assert full.shape == (300, 70) and full.dtype == torch.float32
    assert torch.equal(w.read(0, 100, 50), full[100:150])
    assert torch.equal(w.read(1, 10, 20), full[:, 10:30])
    assert abs(full.std().item() - 0.02) < 0.002 and full.abs().max().item() <= 0.0347
    other = HashedSource("model.layers.3.mlp.down_proj.weight", (300, 70), 7, CPU).read()
    reseeded = HashedSource("model.layers.3.mlp.up_proj.weight", (300, 70), 8, CPU).read()
    assert not torch.equal(full, other) and not torch.equal(full, reseeded)
    bias = HashedSource("model.layers.0.self_attn.q_proj.bias", (77,), 7, CPU)
    assert torch.equal(bias.read(0, 7, 9), bias.read()[7:16])
    assert torch.equal(HashedSource("model.norm.weight", (5,), 7, CPU).read(), torch.ones(5))


def test_hf_tensor_list_matches_the_shape():
    cfg = shape_config("llama3-8b")
    tensors = dict(hf_tensors(cfg))
    assert len(tensors) == 2 + 9 * 32 + 1
    assert tensors["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert tensors["lm_head.weight"] == (128256, 4096)
    assert sum(torch.Size(s).numel() for s in tensors.values()) == 8_030_261_248


def _dummy_logits(group):
    model, comm = load("smollm2-135m", group, "dummy")
    return full_logits(model, comm, TOKENS)


@pytest.mark.slow
def test_dummy_logits_do_not_depend_on_tensor_parallel_size():
    model, comm = load("smollm2-135m", None, "dummy")
    want = full_logits(model, comm, TOKENS)
    assert want.abs().max().item() > 0
    for logits in run_ranks(_dummy_logits, 3, timeout_s=400):
        assert (logits - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("name,params", [("qwen3-0.6b", 596_049_920),
                                         ("qwen3-8b", 8_190_735_360)])
def test_qwen3_shapes_are_transformers_tensors(name, params):
    """A dummy Qwen3 shape lists exactly the tensors (names and shapes, the q/k head norms
    included) transformers builds from the same config.json, with the parameter counts
    of Qwen3-0.6B (tied embeddings) and Qwen3-8B."""
    import transformers as tf

    from tpserve.model.loader.dummy import shape_hf_config

    hf_cfg = tf.Qwen3Config(**{k: v for k, v in shape_hf_config(name).items()
                               if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = tf.Qwen3ForCausalLM(hf_cfg)
    want = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        del want["lm_head.weight"]
    tensors = dict(hf_tensors(shape_config(name)))
    assert tensors == want
    assert sum(torch.Size(s).numel() for s in tensors.values()) == params


def _transformers_shapes(d: dict, cls) -> dict[str, tuple[int, ...]]:
    """Every tensor (name -> shape) transformers' ``cls`` builds, on the meta device, from
    the config.json contents ``d`` of a dummy shape."""
    with torch.device("meta"):
        hf = cls(cls.config_class(**{k: v for k, v in d.items()
                                     if k not in ("architectures", "model_type")}))
    return {n: tuple(t.shape) for n, t in hf.state_dict().items()}


@pytest.mark.parametrize("name,params,window", [("phi-3-mini", 3_821_079_552, 2047),
                                                ("mistral-7b", 7_241_732_096, 4096)])
def test_windowed_shapes_are_transformers_tensors(name, params, window):
    """The dummy Phi-3-mini (heads of 96, fused tensors) and Mistral-7B-v0.1 shapes list
    exactly the tensors transformers builds from the same config.json, with their
    parameter counts, and keep their sliding windows (which do not cap the context)."""
    import transformers as tf

    from tpserve.model.loader.dummy import shape_hf_config
    from tpserve.model.runner_config import resolve_max_model_len

    d = shape_hf_config(name)
    want = _transformers_shapes(
        d, tf.Phi3ForCausalLM if name == "phi-3-mini" else tf.MistralForCausalLM)
    cfg = shape_config(name)
    tensors = dict(hf_tensors(cfg))
    if name == "phi-3-mini":  # heads of 96: the Triton kernels tile them as 128
        assert cfg.head_dim == 96
    assert tensors == want
    assert sum(torch.Size(s).numel() for s in tensors.values()) == params
    assert cfg.window_of(0) == window
    assert resolve_max_model_len(None, cfg) == d["max_position_embeddings"]


@pytest.mark.parametrize("name,params,windows", [
    ("gemma-2-9b", 9_241_705_984, [4096, None]),
    ("gemma-3-12b", 11_766_034_176, [1024] * 5 + [None])])
def test_gemma_shapes_are_transformers_tensors(name, params, windows):
    """The dummy Gemma 2 9B and Gemma 3 12B (its language model) shapes list exactly the
    tensors transformers builds from the same config.json (four norms a layer, Gemma 3's
    q/k head norms), with their parameter counts; their norm weights are 0 (``1 + w``: a
    scale of 1); Gemma 3 serves its 131,072 positions (the linear factor already counted)."""
    import transformers as tf

    from tpserve.model.loader.dummy import iter_weights, shape_hf_config
    from tpserve.model.runner_config import resolve_max_model_len

    d = shape_hf_config(name)
    want = _transformers_shapes(
        d, tf.Gemma2ForCausalLM if name == "gemma-2-9b" else tf.Gemma3ForCausalLM)
    del want["lm_head.weight"]  # tied
    cfg = shape_config(name)
    assert dict(hf_tensors(cfg)) == want
    assert sum(torch.Size(s).numel() for s in want.values()) == params
    assert [cfg.window_of(i) for i in range(len(windows))] == windows
    assert resolve_max_model_len(None, cfg) == d["max_position_embeddings"]
    norms = [src for n, src in iter_weights(cfg, 0, CPU) if n.endswith("norm.weight")]
    assert len(norms) == cfg.num_hidden_layers * (6 if cfg.qk_norm else 4) + 1
    assert all(torch.equal(src.read(), torch.zeros(src.shape)) for src in norms[:8])
