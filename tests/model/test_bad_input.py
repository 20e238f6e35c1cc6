"""Bad input at load time: each a clear error naming the problem."""

from __future__ import annotations

import json
import re

import pytest

from tpserve.model.loader.build import resolve_dtype
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.loader.dummy import shape_config


def test_missing_model_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model not found: {missing}"):
        open_checkpoint(str(missing))


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(FileNotFoundError, match="has no \\*.safetensors files"):
        open_checkpoint(str(tmp_path))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        open_checkpoint(str(tmp_path))


def _folder_with_index(folder, *shards: str):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}))
    return folder


@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/x.safetensors",
                                   "sub/../../x.safetensors", ""])
def test_index_shard_paths_must_stay_inside_the_folder(tmp_path, shard):
    folder = _folder_with_index(tmp_path / "model", "model-00001.safetensors", shard)
    (tmp_path / "x.safetensors").write_bytes(b"")  # exists, but outside the folder
    with pytest.raises(ValueError, match=f"names the shard '{re.escape(shard)}', which is "
                                         "not a file inside the model folder"):
        open_checkpoint(str(folder))


def test_index_shard_in_a_subfolder_is_fine(tmp_path):
    folder = _folder_with_index(tmp_path / "model", "sub/model-00001.safetensors")
    with pytest.raises(FileNotFoundError, match="sub/model-00001.safetensors is named in the "
                                                "index but missing"):
        open_checkpoint(str(folder))


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        open_checkpoint(str(tmp_path))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="unknown architecture 'GPTNeoXForCausalLM'.*"
                                         "LlamaForCausalLM"):
        open_checkpoint(str(tmp_path), "dummy")


def test_any_tp_is_served_with_zero_padding(smollm2_path):
    """Head counts and the MLP width that tp does not divide are zero-padded, not refused;
    only a tp below 1 is."""
    cfg = open_checkpoint(str(smollm2_path)).config
    for tp in (1, 2, 3, 4, 5, 9, 12):
        cfg.check_tensor_parallel(tp)
    assert cfg.describe_padding(3) is None
    assert cfg.describe_padding(2) == ("tp 2: padding 9 q heads -> 12, 3 KV heads -> 4 "
                                       "(+33% attention FLOPs and KV cache per rank)")
    assert (cfg.kv_heads_for(2), cfg.kv_heads_for(4), cfg.kv_heads_for(9)) == (2, 1, 1)
    assert cfg.intermediate_per_rank(9) == 171  # 1536 -> 1539 columns
    assert "MLP width 1536 -> 1539" in cfg.describe_padding(9)
    llama = shape_config("llama3-8b")
    llama.check_tensor_parallel(3)
    assert llama.describe_padding(3).startswith("tp 3: padding 32 q heads -> 36, 8 KV heads "
                                                "-> 9")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size must be >= 1, got 0"):
        cfg.check_tensor_parallel(0)


def test_unknown_formats_and_dtypes():
    with pytest.raises(ValueError, match="unknown --load-format 'pickle'"):
        open_checkpoint(None, "pickle")
    with pytest.raises(FileNotFoundError, match="dummy needs a shape name .*llama3-8b"):
        open_checkpoint("gpt5", "dummy")
    with pytest.raises(ValueError, match="unknown --dtype 'int3'"):
        import torch

        resolve_dtype("int3", torch.device("cpu"))


def test_dummy_shapes_are_real_shapes():
    cfg = shape_config("llama3-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (4096, 32, 8)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert shape_config("llama3-70b").num_hidden_layers == 80
