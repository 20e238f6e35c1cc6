"""``--hf-overrides`` and ``--tokenizer`` where a checkpoint is opened: overrides laid over
``config.json`` change the model exactly as the same keys in the file would (logits equal
transformers' model of the overridden config), for a folder, a dummy folder and a dummy
shape; a GGUF file refuses them; anything but a JSON object is refused naming the flag;
``--tokenizer`` replaces the checkpoint's tokenizer, and a folder without a tokenizer is
refused."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.test_tiny_models import TOKENS, _hf_model
from tests.model.util import full_logits, load, save_hf_folder
from tpserve.model.attention.backend import select_attention
from tpserve.model.kernels.backend import select_ops
from tpserve.model.loader.build import build_model
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.loader.hf_overrides import apply_overrides, canonical_overrides
from tpserve.parallel.comm import Communicator
from tpserve.parallel.state import TPGroup

LINEAR = {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}


def test_canonical_overrides():
    assert canonical_overrides(None) is None and canonical_overrides("{}") is None
    assert canonical_overrides('{"b": 1, "a": {"y": 2, "x": 1}}') == \
        '{"a": {"x": 1, "y": 2}, "b": 1}'
    for bad, match in [("[1, 2]", "must be a JSON object of config.json keys, got list"),
                       ("rope", "must be a JSON object: Expecting value"),
                       ('"x"', "must be a JSON object of config.json keys, got str")]:
        with pytest.raises(ValueError, match="^--hf-overrides " + match):
            canonical_overrides(bad)


def test_top_level_keys_replace_the_files():
    config = {"a": 1, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    got = apply_overrides(config, canonical_overrides(json.dumps(LINEAR)))
    assert got == {"a": 1, **LINEAR}
    assert config["rope_scaling"]["rope_type"] == "llama3"  # the input is left alone


def test_overrides_change_the_model_as_the_file_would(tmp_path):
    """The tiny Llama's folder with linear RoPE scaling given as an override: its logits
    are transformers' for the config with that scaling, and differ from the file's own."""
    import transformers as tf

    hf = _hf_model("llama")
    folder = str(save_hf_folder(hf, tmp_path / "llama"))
    cfg = hf.config.to_dict() | LINEAR
    ref_model = tf.LlamaForCausalLM(tf.LlamaConfig.from_dict(cfg)).eval()
    ref_model.load_state_dict(hf.state_dict())
    with torch.no_grad():
        want = ref_model(torch.tensor([TOKENS])).logits[0]
        plain = hf(torch.tensor([TOKENS])).logits[0]
    overrides = canonical_overrides(json.dumps(LINEAR))
    ckpt = open_checkpoint(folder, "auto", 0, overrides)
    assert ckpt.config.rope_scaling.rope_type == "linear"
    group = TPGroup(0, 1, torch.device("cpu"), None)
    comm = Communicator(group)
    model = build_model(ckpt, comm, torch.device("cpu"), torch.float32, select_ops("torch"),
                        select_attention("torch", torch.float32), 512)
    got = full_logits(model, comm, TOKENS)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - plain).abs().max().item() > 1e-3  # the override did change the model
    base, _ = load(folder)
    assert (full_logits(base, comm, TOKENS) - plain).abs().max().item() < 1e-4


def test_overrides_reach_dummy_shapes_and_folders(tmp_path):
    overrides = canonical_overrides('{"max_position_embeddings": 1000, "num_hidden_layers": 3}')
    shape = open_checkpoint("smollm2-135m", "dummy", 0, overrides).config
    assert (shape.max_position_embeddings, shape.num_hidden_layers) == (1000, 3)
    folder = save_hf_folder(_hf_model("qwen2"), tmp_path / "qwen2")
    cfg = open_checkpoint(str(folder), "dummy", 0, overrides).config
    assert (cfg.max_position_embeddings, cfg.num_hidden_layers, cfg.qkv_bias) == (1000, 3, True)


def test_a_gguf_file_refuses_overrides(smollm2_path):
    with pytest.raises(ValueError, match="--hf-overrides: SmolLM2-135M-Instruct.Q4_1.gguf is "
                                         "a GGUF file, whose config comes from its metadata"):
        open_checkpoint(str(smollm2_path), "auto", 0, '{"rope_theta": 1.0}')


def test_tokenizer_replaces_the_checkpoints(tmp_path, smollm2_path, smollm2_tokenizer):
    folder = tmp_path / "tok"
    smollm2_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "<<{{ messages[0]['content'] }}>>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    ckpt = open_checkpoint(str(smollm2_path), "auto", 0, None, str(folder))
    tok = ckpt.tokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<<hi>>"
    with pytest.raises(FileNotFoundError, match="--tokenizer: .* is not a tokenizer folder"):
        open_checkpoint(str(smollm2_path), "auto", 0, None, str(tmp_path))
