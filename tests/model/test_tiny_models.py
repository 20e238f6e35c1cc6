"""Tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints written as sharded Hugging Face
folders: our logits equal transformers' at tp 1, 2 and 4 (tp 4 replicates the 2 KV heads)
and at tp 3 (zero padding: 4 -> 6 query heads, 2 -> 3 KV heads with their biases, MLP
128 -> 129). The Qwen3 model's heads are wider than ``hidden / heads`` (4 x 32 > 64), as
in Qwen3-0.6B, and each q and k head is RMS-normed before RoPE."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.model.util import (
    full_logits,
    hf_checkpoints,
    load,
    save_gguf_file,
    save_hf_folder,
    tiny_hf_model,
)
from tpserve.parallel.launch import run_ranks

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=256, rms_norm_eps=1e-5)


def _hf_model(kind: str):
    import transformers as tf

    torch.manual_seed({"llama": 0, "llama3": 1, "qwen2": 2, "mistral": 3, "qwen3": 4}[kind])
    if kind == "llama":
        cfg = tf.LlamaConfig(**TINY, rope_theta=10000.0)
    elif kind == "llama3":
        cfg = tf.LlamaConfig(**TINY, rope_theta=500000.0, tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32})
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**TINY, rope_theta=10000.0)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=32, rope_theta=1000000.0,
                             tie_word_embeddings=True)
    else:
        cfg = tf.MistralConfig(**TINY, rope_theta=10000.0, sliding_window=None)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM",
                          "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen3": "Qwen3ForCausalLM"}[kind]]
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # make biases and norms non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder, reference logits); each tiny checkpoint is written once."""
    return hf_checkpoints(tmp_path_factory, _hf_model, lambda kind: TOKENS)


def _logits(group, folder):
    model, comm = load(folder, group)
    return full_logits(model, comm, TOKENS)


def test_folder_is_sharded_with_index(checkpoints):
    import json
    import pathlib

    folder = pathlib.Path(checkpoints("llama")[0])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral", "qwen3"])
def test_tp1_equals_transformers(checkpoints, kind):
    folder, ref = checkpoints(kind)
    model, comm = load(folder)
    assert (full_logits(model, comm, TOKENS) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind,tp", [("llama", 2), ("llama", 4), ("llama3", 2),
                                     ("qwen2", 2), ("qwen2", 3), ("mistral", 2),
                                     ("qwen3", 2), ("qwen3", 3)])
def test_tensor_parallel_equals_transformers(checkpoints, kind, tp):
    folder, ref = checkpoints(kind)
    results = run_ranks(_logits, tp, folder, timeout_s=300)
    assert len(results) == tp
    for logits in results:
        assert (logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("tp", [1, 3])
def test_qwen3_gguf_equals_transformers(checkpoints, tmp_path, tp):
    """A Qwen3 GGUF (q/k norms as ``attn_q_norm``/``attn_k_norm``) gives transformers'
    logits, at tp 3 with padded heads too."""
    _, ref = checkpoints("qwen3")
    path = tmp_path / "qwen3.gguf"
    save_gguf_file(_hf_model("qwen3"), path, "qwen3")
    results = run_ranks(_logits, tp, str(path), timeout_s=300)
    assert len(results) == tp
    for logits in results:
        assert (logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("part", ["model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.1.self_attn.v_proj.weight",
                                  "model.layers.0.mlp.gate_proj.weight",
                                  "model.layers.1.mlp.up_proj.weight"])
def test_a_folder_lacking_one_part_of_a_fused_weight_is_refused(checkpoints, tmp_path, part):
    """A checkpoint whose shards lack one part of a fused parameter (k or v of qkv_proj,
    gate or up of gate_up_proj), its index still naming it: refused naming that tensor, as
    a missing unfused one is, never served with the part's rows left as uninitialised
    memory (vLLM's default loader refuses parameters a checkpoint leaves unloaded, but
    counts a fused one loaded at its first part)."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(checkpoints("llama")[0], tmp_path / "llama"))
    for shard in folder.glob("*.safetensors"):
        state = load_file(str(shard))
        if state.pop(part, None) is not None:
            save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"llama: checkpoint lacks 1 tensors, e.g. "
                                         rf"\['{part}'\]"):
        load(str(folder))


def test_a_gguf_file_lacking_attn_k_is_refused(tmp_path):
    """A GGUF file without one layer's ``attn_k``: refused naming it by its Hugging Face
    name, like a folder's missing part."""
    hf = _hf_model("llama")
    lacking = "model.layers.1.self_attn.k_proj.weight"
    state = {k: v for k, v in hf.state_dict().items() if k != lacking}
    path = save_gguf_file(hf, tmp_path / "m.gguf", "llama", state=state)
    with pytest.raises(ValueError, match=rf"m.gguf: checkpoint lacks 1 tensors, e.g. "
                                         rf"\['{lacking}'\]"):
        load(str(path))


def test_llama_gguf_with_attention_biases_equals_transformers(tmp_path):
    """A Llama with ``attention_bias: true``, which llama.cpp's converter writes with
    ``attn_output.bias`` (bo) beside bq/bk/bv: the GGUF file gives transformers' logits,
    as its safetensors folder does (vLLM's Llama reads both biases from the config)."""
    import transformers as tf

    torch.manual_seed(5)
    hf = tiny_hf_model(tf.LlamaConfig(**TINY, attention_bias=True), "LlamaForCausalLM",
                       biases=True)
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
    for path in (save_hf_folder(hf, tmp_path / "folder"),
                 save_gguf_file(hf, tmp_path / "m.gguf", "llama")):
        model, comm = load(str(path))
        assert model.cfg.o_bias and model.cfg.qkv_bias
        assert (full_logits(model, comm, TOKENS) - want).abs().max().item() < 1e-4
