"""``--generation-config``: a model folder's generation_config.json -> sampling defaults,
and its ``eos_token_id`` -> the model's end-of-generation ids."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.util import save_hf_folder
from tpserve.model.generation_config import (
    EMBEDDED_GENERATION_DEFAULTS,
    GenerationDefaults,
    generation_config_folder,
    parse_generation_config,
    resolve_generation_defaults,
)
from tpserve.model.loader.checkpoint import open_checkpoint

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


def test_the_files_eos_ids_join_the_configs(model_folder, tmp_path):
    """vLLM adds generation_config.json's ``eos_token_id`` (an id or a list) to every
    request's stop tokens, reading the model's file under ``auto`` and ``vllm`` alike and a
    ``--generation-config`` folder's file instead: the checkpoint's eos ids are config.json's
    (Llama's 2) then the file's new ones, whatever else it holds."""
    llama3 = (2, 128001, 128009)
    assert open_checkpoint(str(model_folder)).config.eos_token_ids == llama3
    assert open_checkpoint(str(model_folder), generation_config="vllm"
                           ).config.eos_token_ids == llama3
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 107}))
    assert open_checkpoint(str(model_folder), generation_config=str(other)
                           ).config.eos_token_ids == (2, 107)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, None]}))
    with pytest.raises(ValueError, match=r"other/generation_config.json: eos_token_id must be "
                                         r"a token id or a list of token ids, got \[2, None\]"):
        open_checkpoint(str(model_folder), generation_config=str(other))
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert open_checkpoint(str(model_folder), generation_config=str(other)
                           ).config.eos_token_ids == (2,)


def test_which_folders_file_each_setting_reads(model_folder, tmp_path):
    """The one rule for the sampling defaults and the eos ids: a folder argument names its
    own file; ``auto`` and ``vllm`` the model folder's, a GGUF file's folder's; the
    embedded model and dummy shapes have none."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    for setting in ("auto", "vllm"):
        assert generation_config_folder(setting, str(model_folder)) == model_folder
        assert generation_config_folder(setting, str(gguf)) == tmp_path
        assert generation_config_folder(setting, None) is None
        assert generation_config_folder(setting, "llama3-8b") is None
    assert generation_config_folder(str(tmp_path), str(model_folder)) == tmp_path
    assert open_checkpoint(None).config.eos_token_ids == (2,)  # no file: the GGUF's own


def test_an_eos_id_only_the_file_names_ends_generation(tmp_path, smollm2_tokenizer):
    """EngineCore on a tiny Llama whose LM head is all zeros (every logit ties, so greedy
    decoding picks token 0), with config.json's eos 2 and generation_config.json's [2, 0]:
    token 0 ends the sequence (finish reason stop) as vLLM's stop token does
    (gemma-2-it's <end_of_turn>, 107, is named only there), ignored under ``ignore_eos``
    and held off by ``min_tokens`` like the model's own EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.model.sampling_params import SamplingParams
    from tpserve.parallel.state import TPGroup
    from tpserve.server.engine.config import EngineConfig
    from tpserve.server.engine.engine_core import EngineCore
    from tpserve.server.engine.request_state import RequestState
    from tpserve.server.engine.scheduler import SchedulerConfig

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=2, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]))
    with torch.no_grad():
        hf.lm_head.weight.zero_()
    folder = save_hf_folder(hf, tmp_path / "tiny", 1)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                            block_size=16)
    runner = ModelRunner(RunnerConfig(model=str(folder), kv_cache_memory=1 << 20),
                         sched.limits, TPGroup(0, 1, torch.device("cpu"), None))
    core = EngineCore(runner, smollm2_tokenizer, sched, EngineConfig())
    assert core.eos_token_ids == {2, 0}

    def run(**params) -> tuple[list[int], str]:
        outs = []
        core.add(RequestState("r", [5, 9, 3], SamplingParams(temperature=0, max_tokens=6,
                                                             **params), outs.append))
        while core.has_unfinished:
            core.step()
        tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
        return tokens, outs[-1].deltas[-1].finish_reason

    assert run(ignore_eos=True) == ([0] * 6, "length")
    assert run() == ([0], "stop")
    assert run(min_tokens=3) == ([1, 1, 1, 0], "stop")
