"""``--generation-config``: a model folder's generation_config.json -> sampling defaults."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.util import save_hf_folder
from tpserve.model.generation_config import (
    GenerationDefaults,
    parse_generation_config,
    resolve_generation_defaults,
)
from tpserve.model.loader.checkpoint import EMBEDDED_GENERATION_DEFAULTS, open_checkpoint

# as Llama-3-8B-Instruct ships it, plus the other fields tpserve reads
LLAMA3_FILE = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
               "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.40.0.dev0",
               "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 128}
LLAMA3_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                   "repetition_penalty": 1.1, "max_tokens": 128}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A real safetensors folder (tiny Llama) with its generation_config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, architectures=["LlamaForCausalLM"])
    folder = save_hf_folder(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("tiny"), 1)
    (folder / "generation_config.json").write_text(json.dumps(LLAMA3_FILE))
    return folder


def test_auto_reads_the_model_folders_file(model_folder):
    open_checkpoint(str(model_folder))  # the folder is a model tpserve serves
    found = resolve_generation_defaults("auto", str(model_folder), "auto")
    assert found.params == LLAMA3_DEFAULTS
    assert found.source == str(model_folder / "generation_config.json")
    assert "temperature=0.6" in found.describe()


def test_vllm_ignores_the_file(model_folder):
    assert resolve_generation_defaults("vllm", str(model_folder), "auto").params == {}
    assert resolve_generation_defaults("vllm", None, "auto").params == {}


def test_a_folder_argument_reads_that_folders_file(model_folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert resolve_generation_defaults(str(other), str(model_folder), "auto").params == {
        "temperature": 0.3}
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        resolve_generation_defaults(str(tmp_path / "missing"), str(model_folder), "auto")


def test_no_file_means_openai_defaults(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_generation_defaults("auto", str(tmp_path), "auto").params == {}
    assert resolve_generation_defaults("auto", "llama3-8b", "dummy").params == {}
    assert resolve_generation_defaults("auto", None, "dummy").params == {}


def test_the_embedded_model_has_its_measured_defaults():
    found = resolve_generation_defaults("auto", None, "auto")
    assert found.params == EMBEDDED_GENERATION_DEFAULTS == {"temperature": 0.0}


def test_null_and_unknown_keys_are_skipped():
    parsed = parse_generation_config({"temperature": None, "top_k": 50.0, "num_beams": 4}, "f")
    assert parsed == GenerationDefaults({"top_k": 50}, "f")
    assert isinstance(parsed.params["top_k"], int)


@pytest.mark.parametrize("data,message", [
    ({"temperature": -1}, "f.json: temperature must be in"),
    ({"top_p": 0}, "f.json: top_p must be in"),
    ({"temperature": "hot"}, "f.json: temperature must be a number"),
    ({"top_k": 2.5}, "f.json: top_k must be an integer"),
    ({"max_new_tokens": 0}, "f.json: max_tokens must be at least 1"),
    ({"repetition_penalty": True}, "f.json: repetition_penalty must be a number"),
])
def test_bad_values_stop_the_start_naming_the_file(data, message):
    with pytest.raises(ValueError, match=message):
        parse_generation_config(data, "f.json")


def test_a_file_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("{temperature: 0.6")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        resolve_generation_defaults(str(tmp_path), None, "auto")
