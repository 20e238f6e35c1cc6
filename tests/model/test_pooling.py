"""``model/pooling.py`` and the model side of ``--runner pooling``: the pooler config from
sentence-transformers files and ``--pooler-config`` (each refusal names what it refuses),
Matryoshka sizes, the rows a step pools, the finished vector; a base model's checkpoint
(tensors without ``model.``, no LM head) loads into a headless model at tp 1 and 2 with
every tensor in place, and a generative runner refuses it, naming the flag."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.model.test_tiny_models import TINY
from tests.model.util import save_hf_folder
from tpserve.model.config import ModelConfig
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.pooling import (
    PoolerConfig,
    finish_embedding,
    parse_pooler_config,
    pool_rows,
    read_sentence_transformers,
    resolve_pooler_config,
)
from tpserve.parallel.launch import run_ranks

ST = "sentence_transformers.models."


def write_st(folder, modules, pooling=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": ST + kind}
         for i, (kind, path) in enumerate(modules)]))
    if pooling is not None:
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, **pooling}))
    return folder


LAST = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
MEAN = {"pooling_mode_mean_tokens": True}


def test_sentence_transformers_files(tmp_path):
    assert read_sentence_transformers(None) is None
    assert read_sentence_transformers(tmp_path) is None
    full = write_st(tmp_path / "a", [("Transformer", ""), ("Pooling", "1_Pooling"),
                                     ("Normalize", "2_Normalize")], LAST)
    assert read_sentence_transformers(full) == {"pooling_type": "LAST", "normalize": True}
    plain = write_st(tmp_path / "b", [("Transformer", ""), ("Pooling", "1_Pooling")], MEAN)
    assert read_sentence_transformers(plain) == {"pooling_type": "MEAN", "normalize": False}
    cls = write_st(tmp_path / "c", [("Pooling", "1_Pooling")], {"pooling_mode_cls_token": True})
    assert read_sentence_transformers(cls)["pooling_type"] == "CLS"


@pytest.mark.parametrize(("modules", "pooling", "message"), [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")], LAST,
     "module '2' of type 'sentence_transformers.models.Dense' is not supported"),
    ([("Pooling", "1_Pooling")], {**LAST, **MEAN},
     r"exactly one of .* \(got pooling_mode_lasttoken, pooling_mode_mean_tokens\)"),
    ([("Pooling", "1_Pooling")], {"pooling_mode_max_tokens": True},
     "got pooling_mode_max_tokens"),
    ([("Pooling", "1_Pooling")], {**LAST, "include_prompt": False}, "include_prompt false"),
    ([("Pooling", "1_Pooling")], None, "the Pooling module's .*config.json is missing"),
])
def test_sentence_transformers_refusals(tmp_path, modules, pooling, message):
    with pytest.raises(ValueError, match=message):
        read_sentence_transformers(write_st(tmp_path, modules, pooling))


def test_pooler_config_precedence(tmp_path, tiny_llama):
    assert resolve_pooler_config(None, None, 64, None) == PoolerConfig(size=64)
    assert open_checkpoint(tiny_llama).pooling() is None
    folder = tmp_path / "st"
    shutil.copytree(tiny_llama, folder)
    write_st(folder, [("Pooling", "1_Pooling")], MEAN)
    declared = open_checkpoint(str(folder)).pooling()
    assert declared == ({"pooling_type": "MEAN", "normalize": False},
                        "the checkpoint's sentence-transformers modules")
    st = resolve_pooler_config(None, declared, 64, ())
    assert (st.pooling_type, st.normalize, st.matryoshka) == ("MEAN", False, ())
    both = resolve_pooler_config('{"normalize": true, "pooling_type": "cls"}', declared, 64,
                                 None)
    assert (both.pooling_type, both.normalize) == ("CLS", True)
    assert both.describe() == ("64-dimensional embeddings, CLS pooling, normalized (the "
                               "checkpoint's sentence-transformers modules and "
                               "--pooler-config)")


@pytest.mark.parametrize(("code", "declared"), [
    (None, None), (0, None), (1, ({"pooling_type": "MEAN"}, "the GGUF file's pooling_type")),
    (2, ({"pooling_type": "CLS"}, "the GGUF file's pooling_type")),
    (3, ({"pooling_type": "LAST"}, "the GGUF file's pooling_type")),
    (4, "pooling_type 4 .rank"), (7, "unknown pooling_type 7")])
def test_a_gguf_files_pooling_type(tmp_path, code, declared):
    """llama.cpp's ``qwen3.pooling_type`` (Qwen3-Embedding GGUF files declare LAST)."""
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_gguf_file

    def metadata(w):
        if code is not None:
            w.add_uint32("qwen3.pooling_type", code)

    path = save_gguf_file(_hf_model("qwen3"), tmp_path / "m.gguf", "qwen3", metadata)
    ckpt = open_checkpoint(str(path))
    if isinstance(declared, str):
        with pytest.raises(ValueError, match=f"m.gguf: {declared}"):
            ckpt.pooling()
    else:
        assert ckpt.pooling() == declared


@pytest.mark.parametrize(("text", "message"), [
    ("[1]", "a JSON object is expected"), ("{", "not JSON"),
    ('{"pooling_type": 3}', "pooling_type must be a string"),
    ('{"pooling_type": "STEP"}', "must be one of LAST, MEAN, CLS, got 'STEP'"),
    ('{"normalize": "yes"}', "normalize must be true or false"),
    ('{"softmax": true, "step_tag_id": 1}', "softmax, step_tag_id not supported"),
])
def test_pooler_config_flag_refusals(text, message):
    with pytest.raises(ValueError, match=message):
        parse_pooler_config(text)


def test_dimensions():
    none = PoolerConfig(size=64)
    assert none.check_dimensions(None) is None
    assert "does not support Matryoshka" in none.check_dimensions(8)
    anything = PoolerConfig(size=64, matryoshka=())
    assert anything.check_dimensions(1) is None and anything.check_dimensions(64) is None
    assert "at most the model's 64" in anything.check_dimensions(65)
    assert "at least 1" in anything.check_dimensions(0)
    listed = PoolerConfig(size=64, matryoshka=(16, 32))
    assert listed.check_dimensions(32) is None
    assert "supports dimensions [16, 32] only, got 24" in listed.check_dimensions(24)


def test_matryoshka_keys_of_config_json():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 64,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_hf(base).matryoshka_dimensions is None
    assert ModelConfig.from_hf({**base, "is_matryoshka": True}).matryoshka_dimensions == ()
    assert ModelConfig.from_hf({**base, "matryoshka_dimensions": [32, 64]}
                               ).matryoshka_dimensions == (32, 64)
    with pytest.raises(ValueError, match="matryoshka_dimensions must be a list"):
        ModelConfig.from_hf({**base, "matryoshka_dimensions": [0]})
    # a base model's architecture takes its causal LM's flags
    assert ModelConfig.from_hf({**base, "architectures": ["Qwen3Model"]}).qk_norm
    assert ModelConfig.from_hf({**base, "architectures": ["Qwen2Model"]}).qkv_bias


def test_pool_rows_per_type():
    # (first row, rows, first position, final, type) of four chunks in one step
    chunks = [(0, 1, 40, True, "LAST"), (1, 16, 0, False, "LAST"), (17, 5, 0, True, "CLS"),
              (22, 3, 16, False, "MEAN"), (25, 4, 16, True, "CLS")]
    pool, out = pool_rows(chunks)
    assert out == [0, -1, 1, 2, -1]
    assert pool.rows.tolist() == [0, 17, 22, 23, 24]
    assert pool.segments.tolist() == [0, 1, 2, 2, 2] and pool.count == 3
    empty, none = pool_rows([(0, 8, 0, False, "LAST")])
    assert none == [-1] and empty.count == 0 and empty.rows.numel() == 0


def test_finish_embedding():
    v = torch.tensor([3.0, 4.0, 12.0])
    assert finish_embedding(v, 1, "LAST", False, None) == [3.0, 4.0, 12.0]
    assert finish_embedding(v, 2, "MEAN", False, None) == [1.5, 2.0, 6.0]
    assert finish_embedding(v, 2, "MEAN", True, 2) == pytest.approx([0.6, 0.8])
    assert finish_embedding(v, 1, "CLS", True, None) == pytest.approx([3 / 13, 4 / 13, 12 / 13])


def _base_folder(tmp_path):
    """A tiny Llama saved as its base model (``LlamaModel``: no ``model.`` prefix, no LM
    head), as embedding checkpoints are."""
    import transformers as tf

    torch.manual_seed(5)
    model = tf.LlamaModel(tf.LlamaConfig(**TINY)).eval()
    model.config.architectures = ["LlamaModel"]
    return save_hf_folder(model, tmp_path / "base"), model


@torch.no_grad()
def _headless_hidden(group, folder: str, ids: list[int]) -> torch.Tensor:
    from tests.model.util import load, new_pool
    from tpserve.model.plan import SeqChunk, StepPlan

    model, comm = load(folder, group, lm_head=False)
    assert model.lm_head is None
    pool = new_pool(model, comm)
    plan = StepPlan.build([SeqChunk(ids, 0, [0], True)], pool.block_size, model.attn_backend)
    return model(plan.input_ids, plan.positions, pool.layers,
                 plan.metadata(model.attn_backend))


def test_a_base_model_checkpoint_loads_headless(tmp_path):
    folder, hf = _base_folder(tmp_path)
    ids = [3, 17, 200, 45, 9, 88, 131, 7]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).last_hidden_state[0]
    for world in (1, 2):
        for got in run_ranks(_headless_hidden, world, str(folder), ids):
            assert torch.allclose(got, want, atol=1e-5), world
    ckpt = open_checkpoint(str(folder))
    assert ckpt.config.architecture == "LlamaModel"
    with pytest.raises(ValueError, match="the checkpoint has no LM head .* served with "
                                         "--runner pooling"):
        from tests.model.util import load

        load(str(folder))


def test_a_gguf_embedding_file_loads_headless(tmp_path):
    """A qwen3 GGUF file (no output.weight, as Qwen3-Embedding's) in a pooling runner's
    model at tp 1 and 2: its hidden states equal transformers'."""
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_gguf_file

    hf = _hf_model("qwen3")
    path = save_gguf_file(hf, tmp_path / "emb.gguf", "qwen3",
                          lambda w: w.add_uint32("qwen3.pooling_type", 3))
    ids = [3, 17, 200, 45, 9, 88, 131, 7]
    with torch.no_grad():
        want = hf.model(torch.tensor([ids])).last_hidden_state[0]
    for world in (1, 2):
        for got in run_ranks(_headless_hidden, world, str(path), ids):
            assert torch.allclose(got, want, atol=1e-5), world


def test_the_routes_a_pooling_server_answers():
    """The start-up log names them: a classifier is not an embedding server."""
    assert PoolerConfig(size=64).routes == "/v1/embeddings, /score and /rerank"
    assert PoolerConfig(labels=("a", "b")).routes == "/classify, /score and /rerank"
