"""``tpserve --help`` lists vLLM's flags with their defaults; bad flags fail clearly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tpserve.server.cli import build_parser
from tpserve.server.config import config_from_args, parse_bytes

FLAGS = ["--tensor-parallel-size", "--dtype", "--max-model-len", "--max-num-seqs",
         "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
         "--kv-cache-memory", "--enable-prefix-caching", "--no-enable-prefix-caching",
         "--load-format", "--served-model-name", "--api-key", "--host", "--port",
         "--enforce-eager", "--seed", "--cuda-graph-max-tokens", "--max-mixed-tokens",
         "--async-scheduling", "--no-async-scheduling", "--engine-process",
         "--no-engine-process", "--tp-comm"]


def test_help_lists_every_flag_with_defaults():
    out = subprocess.run([sys.executable, "-m", "tpserve.server.cli", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in FLAGS:
        assert flag in text, flag
    assert "(default: 256)" in text and "(default: 2048)" in text and "(default: 0.9)" in text
    assert "loadtest" in text


def _cfg(*argv: str):
    parser, _ = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_config_tree_from_flags():
    cfg = _cfg("m.gguf", "-tp", "3", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
               "--served-model-name", "x", "--max-model-len", "4096")
    assert cfg.parallel.tensor_parallel_size == 3
    assert cfg.runner.kv_cache_memory == 2 * 2**30 and cfg.runner.max_model_len == 4096
    assert cfg.engine.enable_prefix_caching is False and cfg.served_model_name == "x"
    assert _cfg().served_model_name == "SmolLM2-135M-Instruct"
    assert _cfg("/models/Llama-3-8B/").served_model_name == "Llama-3-8B"
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1e9") == 10**9
    assert _cfg().engine.engine_process is True
    assert _cfg("--no-engine-process").engine.engine_process is False
    assert _cfg().runner.tp_comm == "allreduce"
    assert _cfg("--tp-comm", "allgather").runner.tp_comm == "allgather"


def test_tp_comm_is_validated():
    from tpserve.model.runner import RunnerConfig

    with pytest.raises(ValueError, match="--tp-comm must be one of allreduce, allgather; got "
                                         "'ring'"):
        RunnerConfig(tp_comm="ring")
    parser, _ = build_parser()
    with pytest.raises(SystemExit):  # argparse refuses it first on the command line
        parser.parse_args(["serve", "--tp-comm", "ring"])


@pytest.mark.parametrize("argv,message", [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in"),
    (["--block-size", "7"], "--block-size must be one of"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--port", "70000"], "--port must be in"),
])
def test_bad_flags_are_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)


@pytest.mark.parametrize("flags", [["--no-engine-process"], []],
                         ids=["in-process", "engine-process"])
def test_serve_refuses_a_missing_model_with_exit_2(tmp_path, flags):
    out = subprocess.run([sys.executable, "-m", "tpserve.server.cli", "serve",
                          str(tmp_path / "missing.gguf"), *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"model not found: {tmp_path / 'missing.gguf'}" in out.stderr
