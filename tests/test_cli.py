"""``tpserve --help`` lists vLLM's flags with their defaults; bad flags fail clearly."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from tpserve.cli import build_parser
from tpserve.model.pooling import PoolerConfig
from tpserve.server.arguments import parse_bytes
from tpserve.server.config import config_from_args
from tpserve.server.http.request_log import RequestLog
from tpserve.server.replicas import Replica

FLAGS = ["--tensor-parallel-size", "--dtype", "--max-model-len", "--max-num-seqs",
         "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
         "--kv-cache-memory", "--enable-prefix-caching", "--no-enable-prefix-caching",
         "--load-format", "--served-model-name", "--api-key", "--host", "--port",
         "--enforce-eager", "--seed", "--cuda-graph-max-tokens", "--max-mixed-tokens",
         "--async-scheduling", "--no-async-scheduling", "--engine-process",
         "--no-engine-process", "--kv-cache-dtype", "--tp-comm",
         "--disable-custom-all-reduce", "--memory-history", "--nvtx", "--ssl-keyfile",
         "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--root-path",
         "--uvicorn-log-level", "--disable-fastapi-docs", "--response-role", "--max-logprobs",
         "--runner", "--pooler-config", "--task", "--convert", "--disable-sliding-window",
         "--config", "--enable-expert-parallel", "--enable-lora", "--lora-modules",
         "--max-loras", "--max-lora-rank", "--kv-offloading-size", "--kv-offloading-backend"]


def tpserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpserve.cli", *argv],
                          capture_output=True, text=True, timeout=120)


def test_serve_help_lists_every_flag_with_defaults():
    out = tpserve("serve", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in FLAGS:
        assert flag in text, flag
    assert "(default: 256)" in text and "(default: 2048)" in text and "(default: 0.9)" in text
    helps = option_helps(out.stdout)
    assert helps["--response-role"].endswith("(default: assistant)")
    assert helps["--max-logprobs"].endswith("(default: 20)")
    assert helps["--uvicorn-log-level"].endswith("(default: info)")
    assert helps["--ssl-cert-reqs"].endswith("(default: 0)")


def test_top_level_help_lists_the_commands_in_one_screen():
    for argv in ((), ("--help",)):
        out = tpserve(*argv)
        assert out.returncode == 0
        lines = out.stdout.splitlines()
        assert len(lines) <= 40, out.stdout
        for command in ("serve", "loadtest", "soak"):
            assert any(line.split()[:1] == [command] for line in lines), command
        assert "--max-model-len" not in out.stdout  # serve's flags are in serve --help


def option_helps(help_text: str) -> dict[str, str]:
    """The help of every option in an argparse help screen, by its first flag, joined
    into one line (an entry starts at two spaces' indent, its lines continue deeper)."""
    helps: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            head, _, rest = line.strip().partition("  ")
            flags = [f.split(" ")[0] for f in head.split(", ")]
            current = next((f for f in flags if f.startswith("--")), flags[0])
            helps[current] = [rest.strip()]
        elif current is not None and line.startswith("    ") and line.strip():
            helps[current].append(line.strip())
        else:
            current = None
    return {flag: " ".join(p for p in parts if p) for flag, parts in helps.items()}


@pytest.mark.parametrize("command", ["serve", "loadtest", "soak"])
def test_every_option_has_help_and_states_its_default_once(command):
    _, subs = build_parser()
    helps = option_helps(subs[command].format_help())
    assert "--help" in helps and len(helps) > 10
    for flag, text in helps.items():
        assert text, f"{command} {flag} has no help"
        assert text.count("default:") <= 1, f"{command} {flag}: {text}"
    if command == "serve":
        assert helps["--port"].endswith("(default: 8000)")
        assert helps["--max-model-len"].endswith("default: the model's")
    if command == "loadtest":
        assert helps["--request-rate"].count("inf") >= 1
        assert "(default: inf) (default: inf)" not in helps["--request-rate"]


def test_a_mistyped_flag_gets_the_closest_one():
    out = tpserve("serve", "--max-model-length", "5")
    assert out.returncode == 2
    assert ("unrecognized argument --max-model-length; did you mean --max-model-len?"
            in out.stderr)
    out = tpserve("loadtest", "--num-promtps", "5", "--no-such-thing-at-all")
    assert out.returncode == 2
    assert "unrecognized argument --num-promtps; did you mean --num-prompts?" in out.stderr
    assert "unrecognized argument --no-such-thing-at-all\n" in out.stderr
    # another vLLM flag that merely shares words with one gets no false lead
    out = tpserve("serve", "--hf-config-path", "x", "--scheduler-cls", "y")
    assert out.returncode == 2
    assert ("unrecognized argument --hf-config-path\nunrecognized argument --scheduler-cls\n"
            in out.stderr), out.stderr


def test_a_port_in_use_stops_the_start_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = tpserve("serve", "--port", str(port))
    assert out.returncode == 2
    assert (f"tpserve: error: port {port} on 127.0.0.1 is already in use; stop what listens "
            f"there or choose another --port") in out.stderr
    assert "loading" not in out.stderr and "memory plan" not in out.stderr


def _cfg(*argv: str):
    parser, _ = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_num_gpu_blocks_override_is_the_runners():
    assert _cfg().runner.num_gpu_blocks_override is None
    assert _cfg("--num-gpu-blocks-override", "100").runner.num_gpu_blocks_override == 100


def test_kv_offloading_size_is_gib_summed_over_ranks_and_needs_prefix_caching():
    assert _cfg().runner.kv_offloading_bytes == 0
    cfg = _cfg("--kv-offloading-size", "1.5", "--kv-offloading-backend", "native")
    assert cfg.runner.kv_offloading_bytes == 3 * 2**29
    with pytest.raises(ValueError, match="--kv-offloading-size must be >= 0 GiB, got -1.0"):
        _cfg("--kv-offloading-size", "-1")
    with pytest.raises(ValueError, match="it needs prefix caching"):
        _cfg("--kv-offloading-size", "1", "--no-enable-prefix-caching")
    with pytest.raises(SystemExit):  # vLLM's lmcache back-end: argparse refuses it
        _cfg("--kv-offloading-backend", "lmcache")


def test_config_tree_from_flags():
    cfg = _cfg("llama3-8b", "--load-format", "dummy", "-tp", "3", "--kv-cache-memory", "2GiB",
               "--no-enable-prefix-caching", "--served-model-name", "x", "--max-model-len",
               "4096")
    assert cfg.parallel.tensor_parallel_size == 3
    assert cfg.runner.kv_cache_memory == 2 * 2**30 and cfg.scheduler.max_model_len == 4096
    assert cfg.scheduler.enable_prefix_caching is False and cfg.served_model_name == "x"
    assert _cfg().served_model_name == "SmolLM2-135M-Instruct"
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1e9") == 10**9
    assert _cfg().engine.engine_process is True
    assert _cfg("--no-engine-process").engine.engine_process is False
    assert _cfg().runner.tp_comm == "allreduce"
    assert _cfg("--tp-comm", "allgather").runner.tp_comm == "allgather"
    assert _cfg().runner.expert_parallel is False
    assert _cfg("qwen3-30b-a3b", "--load-format", "dummy",
                "--enable-expert-parallel").runner.expert_parallel is True
    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM has no "
                                         "experts"):
        _cfg("--enable-expert-parallel")
    assert _cfg().runner.disable_custom_all_reduce is False
    assert _cfg("--disable-custom-all-reduce").runner.disable_custom_all_reduce is True
    # the replicas are resolved once, with the rest of the tree
    assert _cfg().replicas == (Replica(),)
    assert _cfg("-dp", "2", "--device", "cpu").replicas == (Replica(0, 2), Replica(1, 2))


def test_nvtx_and_memory_history_flow_into_the_runner_config():
    assert _cfg().runner.nvtx is False
    assert _cfg("--nvtx").runner.nvtx is True  # accepted on CPU: the ranges are a no-op
    assert _cfg().runner.memory_history == 0
    parser, _ = build_parser()
    assert parser.parse_args(["serve", "--memory-history"]).memory_history == 100_000
    assert parser.parse_args(["serve", "--memory-history", "5000"]).memory_history == 5000
    from tpserve.model.runner_config import RunnerConfig

    # the resolved tree on a GPU machine (the dataclass needs no device to be built)
    assert RunnerConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="bfloat16",
                        kernel_backend="triton", memory_history=5000).memory_history == 5000
    with pytest.raises(ValueError, match="--memory-history must be a number of events"):
        RunnerConfig(device="cuda", memory_history=-1)


def test_memory_history_is_refused_on_cpu_with_exit_2():
    proc = tpserve("serve", "--memory-history", "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "tpserve: error: --memory-history records the CUDA caching allocator's events, but "
        "this server runs on cpu (no CUDA device): leave the flag out, or serve on a GPU")


def test_tp_comm_is_validated():
    from tpserve.model.runner_config import RunnerConfig

    with pytest.raises(ValueError, match="--tp-comm must be one of allreduce, allgather; got "
                                         "'ring'"):
        RunnerConfig(tp_comm="ring")
    parser, _ = build_parser()
    with pytest.raises(SystemExit):  # argparse refuses it first on the command line
        parser.parse_args(["serve", "--tp-comm", "ring"])


def test_served_model_name_is_the_folder_name(tiny_folder):
    assert _cfg(str(tiny_folder) + "/").served_model_name == tiny_folder.name


def test_a_model_path_is_also_served_under_the_path_as_given(tiny_folder):
    """vLLM serves ``vllm serve /models/x`` under "/models/x" (its served name defaults to
    the model argument): requests may use that name too (unlisted: the folder name is the
    one listed and answered with), unless --served-model-name names the model."""
    given = str(tiny_folder) + "/"
    cfg = _cfg(given)
    assert (cfg.served_model_name, cfg.server.served_model_aliases,
            cfg.server.unlisted_model_names) == (tiny_folder.name, (), (given,))
    assert _cfg("--model", str(tiny_folder)).server.unlisted_model_names == (str(tiny_folder),)
    named = _cfg(given, "--served-model-name", "a", "b")
    assert (named.served_model_name, named.server.served_model_aliases,
            named.server.unlisted_model_names) == ("a", ("b",), ())
    assert _cfg().server.unlisted_model_names == ()  # the embedded model
    shape = _cfg("llama3-8b", "--load-format", "dummy")  # a name, not a path
    assert (shape.served_model_name, shape.server.unlisted_model_names) == ("llama3-8b", ())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_hf_folder

    return save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("Tiny-Llama"))


def test_every_auto_is_resolved_from_the_checkpoint_on_cpu(tiny_folder):
    """On this CPU machine, for the tiny checkpoint (max_position_embeddings 256): the
    frozen tree holds concrete values only."""
    cfg = _cfg(str(tiny_folder), "--device", "cpu")
    assert cfg.runner.device == "cpu" and cfg.runner.dtype == "float32"
    assert cfg.runner.kernel_backend == "torch" and cfg.runner.kv_cache_dtype == "float32"
    assert cfg.scheduler.max_model_len == 256  # the checkpoint's context
    assert cfg.scheduler.max_mixed_tokens is None  # no CUDA graphs on CPU: no cap
    assert cfg.scheduler.limits.max_model_len == 256 and cfg.scheduler.block_size == 16
    cfg = _cfg(str(tiny_folder), "--device", "cpu", "--dtype", "bf16", "--max-model-len", "100",
               "--max-mixed-tokens", "64", "--kernel-backend", "triton")
    assert cfg.runner.dtype == "bfloat16" and cfg.runner.kernel_backend == "triton"
    assert cfg.runner.kv_cache_dtype == "bfloat16"  # auto: the model's dtype
    assert cfg.scheduler.max_model_len == 100 and cfg.scheduler.max_mixed_tokens == 64
    cfg = _cfg(str(tiny_folder), "--device", "cpu", "--kv-cache-dtype", "bfloat16")
    assert cfg.runner.dtype == "float32" and cfg.runner.kv_cache_dtype == "bfloat16"
    shape = _cfg("llama3-8b", "--load-format", "dummy", "--device", "cpu")
    assert shape.scheduler.max_model_len == 131072


def test_vllm_command_lines_are_taken(tiny_folder):
    """What ``vllm serve`` command lines carry: ``--model``, several served names (the
    first one reported), and flags that change nothing here."""
    cfg = _cfg("--model", str(tiny_folder), "--served-model-name", "a", "b", "c",
               "--trust-remote-code", "--enable-chunked-prefill", "-pp", "1",
               "--disable-log-stats")
    assert cfg.runner.model == str(tiny_folder)
    assert (cfg.served_model_name, cfg.server.served_model_aliases) == ("a", ("b", "c"))
    assert cfg.server.log_stats_interval_s is None and cfg.server.cors is None
    assert cfg.server.metrics_namespace == "tpserve"
    assert _cfg(str(tiny_folder), "--metrics-namespace", "vllm"
                ).server.metrics_namespace == "vllm"
    over = _cfg(str(tiny_folder), "--override-generation-config",
                '{"temperature": 0.6, "max_new_tokens": 64}').server.generation_overrides
    assert over == (("temperature", 0.6), ("max_tokens", 64))
    # vLLM's --hf-token: a token, or bare for the stored one
    assert _cfg(str(tiny_folder), "--hf-token", "hf_x") == _cfg(str(tiny_folder))
    assert _cfg("--hf-token", "--model", str(tiny_folder)) == _cfg(str(tiny_folder))
    # a folder's generation_config.json: its eos ids end generations on every rank
    assert _cfg(str(tiny_folder), "--generation-config", str(tiny_folder)
                ).runner.generation_config == str(tiny_folder)
    cors = _cfg(str(tiny_folder), "--allowed-origins", '["*"]', "--allowed-methods",
                "GET,POST", "--allow-credentials").server.cors
    assert (cors.allowed_origins, cors.allowed_methods, cors.allowed_headers,
            cors.allow_credentials) == (("*",), ("GET", "POST"), ("*",), True)
    assert _cfg(str(tiny_folder), "--model", str(tiny_folder)).runner.model == str(tiny_folder)
    # values that are what tpserve does anyway, and the spellings it maps onto its own
    same = _cfg(str(tiny_folder), "--tokenizer-mode", "auto", "-dp", "1",
                "--distributed-executor-backend", "mp", "--guided-decoding-backend",
                "xgrammar", "--enable-log-requests", "--swap-space", "4",
                "--kv-cache-memory-bytes", "3MiB", "--disable-frontend-multiprocessing",
                "--cpu-offload-gb", "0", "--num-scheduler-steps", "1")
    assert same.server.log_requests and same.runner.kv_cache_memory == 3 * 2**20
    assert same.server.frontend.request_log == RequestLog(inputs=True)
    assert _cfg(str(tiny_folder)).server.frontend.request_log == RequestLog()
    assert _cfg(str(tiny_folder), "--enable-log-outputs", "--max-log-len", "7"
                ).server.frontend.request_log == RequestLog(outputs=True, max_len=7)
    assert _cfg(str(tiny_folder), "--logprobs-mode", "processed_logits"
                ).engine.logprobs_mode == "processed_logits"
    assert _cfg(str(tiny_folder)).engine.logprobs_mode == "raw_logprobs"
    assert _cfg(str(tiny_folder), "--long-prefill-token-threshold", "64"
                ).scheduler.max_chunk == 64
    assert _cfg(str(tiny_folder), "--responses-store-size", "5"
                ).server.frontend.responses_store_size == 5
    assert _cfg(str(tiny_folder), "--cpu-offload-gb", "0.5").runner.cpu_offload_bytes == 2**29
    assert same.runner.cpu_offload_bytes == 0
    assert _cfg(str(tiny_folder)).server.frontend.responses_store_size == 0
    sleepy = _cfg(str(tiny_folder), "--enable-sleep-mode")
    assert sleepy.engine.enable_sleep_mode and sleepy.server.frontend.control_endpoints
    assert not (same.engine.enable_sleep_mode or same.server.frontend.control_endpoints)
    assert not same.engine.engine_process and _cfg(str(tiny_folder)).engine.engine_process
    # vLLM's: a request's own chat_template is rendered only with this flag
    assert _cfg(str(tiny_folder), "--trust-request-chat-template"
                ).server.frontend.trust_request_chat_template
    assert not same.server.frontend.trust_request_chat_template


def test_more_vllm_spellings_map_onto_tpserves_own(tiny_folder):
    """vLLM flags that change nothing here are taken, and those with a tpserve equivalent
    set it: --rope-scaling / --rope-theta (--hf-overrides), one --cuda-graph-sizes
    (--cuda-graph-max-tokens), --disable-uvicorn-access-log (--disable-log-requests),
    --structured-outputs-config's backend; its disable_any_whitespace either way (vLLM's
    true asks xgrammar for compact JSON, which tpserve's grammar always is; false only
    permits whitespace)."""
    plain = _cfg(str(tiny_folder))
    for value in ("true", "false"):
        assert _cfg(str(tiny_folder), "--structured-outputs-config",
                    f'{{"backend": "xgrammar", "disable_any_whitespace": {value}}}') == plain
    same = _cfg(str(tiny_folder), "--disable-cascade-attn", "--disable-chunked-mm-input",
                "--show-hidden-metrics-for-version", "0.10", "--max-parallel-loading-workers",
                "2", "--api-server-count", "1",
                "--prefix-caching-hash-algo", "sha256", "--preemption-mode", "recompute",
                "--num-lookahead-slots", "0", "--model-impl", "vllm",
                "--data-parallel-start-rank", "0", "--data-parallel-size-local", "1",
                "--structured-outputs-config", '{"backend": "xgrammar"}')
    assert same == plain
    mapped = _cfg(str(tiny_folder), "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}',
                  "--rope-theta", "5000", "--hf-overrides", '{"max_position_embeddings": 512}',
                  "--cuda-graph-sizes", "64", "--disable-uvicorn-access-log")
    assert json.loads(mapped.runner.hf_overrides) == {
        "max_position_embeddings": 512, "rope_theta": 5000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert mapped.runner.cuda_graph_max_tokens == 64 and plain.runner.cuda_graph_max_tokens == 512
    assert not mapped.server.log_requests and plain.server.log_requests


def test_partial_prefill_flags_take_vllms_defaults(tiny_folder):
    """--max-num-partial-prefills above 1 makes a prefill of more than 4 % of the context
    long, and lets one long prompt prefill at a time, unless told otherwise (vLLM's)."""
    def caps(*argv: str) -> tuple[int, int, int]:
        s = _cfg(str(tiny_folder), *argv).scheduler
        return (s.max_num_partial_prefills, s.max_long_partial_prefills,
                s.long_prefill_token_threshold)

    assert caps() == (0, 0, 0)
    assert caps("--max-num-partial-prefills", "4") == (4, 1, 256 // 25)
    assert caps("--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2",
                "--long-prefill-token-threshold", "64") == (4, 2, 64)
    assert caps("--max-num-partial-prefills", "1") == (1, 0, 0)
    assert caps("--max-long-partial-prefills", "1", "--long-prefill-token-threshold",
                "8") == (0, 1, 8)


def test_runner_flags(tiny_folder):
    """--runner pooling, or vLLM's --task embed / --convert embed, builds a pooling runner
    with its pooler resolved; the default generates."""
    plain = _cfg(str(tiny_folder))
    assert plain.runner.runner == "generate" and plain.runner.pooler is None
    for argv in (["--runner", "pooling"], ["--task", "embed"], ["--convert", "embed"],
                 ["--task", "embedding", "--runner", "pooling"]):
        cfg = _cfg(str(tiny_folder), *argv)
        assert cfg.runner.runner == "pooling", argv
        assert cfg.runner.pooler == PoolerConfig(size=64), argv
        assert not cfg.runner.uses_cuda_graphs
    mean = _cfg(str(tiny_folder), "--runner", "pooling", "--pooler-config",
                '{"pooling_type": "mean", "normalize": false}').runner.pooler
    assert (mean.pooling_type, mean.normalize, mean.source) == ("MEAN", False,
                                                                "--pooler-config")
    assert _cfg(str(tiny_folder), "--task", "generate").runner.runner == "generate"


def test_a_sequence_classifier_runs_pooling(tmp_path):
    """A *ForSequenceClassification checkpoint: --runner auto and vLLM's --task classify /
    score, --convert classify serve it pooling with its labels; generate and embed are
    refused."""
    from tests.model.test_classifier import _hf_classifier
    from tests.model.util import save_hf_folder

    folder = str(save_hf_folder(_hf_classifier("llama"), tmp_path / "classifier"))
    for argv in ([], ["--task", "classify"], ["--task", "score"], ["--convert", "classify"]):
        pooler = _cfg(folder, *argv).runner.pooler
        assert pooler.labels == ("bad", "good", "neutral") and not pooler.normalize, argv
    for argv, message in ((["--runner", "generate"], "is a sequence classifier"),
                          (["--task", "embed"], "this checkpoint is a sequence classifier")):
        with pytest.raises(ValueError, match=message):
            _cfg(folder, *argv)


@pytest.mark.parametrize("argv,message", [
    (["--model", "other"], "the model is given twice"),
    (["--pooler-config", '{"pooling_type": "LAST"}'], "--pooler-config needs --runner pooling"),
    (["--runner", "generate", "--task", "embed"], "--task embed asks for --runner pooling, "
                                                  "but --runner is generate"),
    (["--convert", "classify"], "--task/--convert classify: this checkpoint is not a "
                                "\\*ForSequenceClassification classifier"),
    (["--task", "score"], "converting a causal LM's head into a classifier is not supported"),
    (["--task", "reward"], "--task reward: not supported"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}'],
     "pooling_type must be one of LAST, MEAN, CLS"),
    (["--runner", "pooling", "--pooler-config", '{"dimensions": 8}'],
     "--pooler-config: dimensions not supported"),
    (["--no-enable-chunked-prefill"], "chunked prefill is always on"),
    (["--pipeline-parallel-size", "2"], "pipeline parallelism is not supported; use "
                                        "--tensor-parallel-size"),
    (["--log-stats-interval", "0"], "--log-stats-interval must be > 0"),
    (["--override-generation-config", '{"do_sample": true}'],
     "--override-generation-config: do_sample cannot be overridden"),
    (["--override-generation-config", '{"temperature": -1}'],
     "--override-generation-config: temperature must be in"),
    (["--max-model-len", "257"], "--max-model-len 257 exceeds the model's context of 256"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--max-mixed-tokens", "0"], "--max-mixed-tokens must be >= 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
    (["--dtype", "int3"], "unknown --dtype 'int3'"),
    (["--data-parallel-size", "2", "--no-engine-process"],
     "--data-parallel-size 2 needs the engine process"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray: not "
                                                "supported .*; accepted: mp, uni"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: not supported"),
    (["--structured-outputs-backend", "outlines"], "--guided-decoding-backend outlines: not "
                                                   "supported .*accepted: auto, xgrammar"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
    (["-O3"], "--compilation-config 3: tpserve does not use torch.compile; .*"
              "--cuda-graph-max-tokens"),
    (["--cpu-offload-gb", "-1"], "--cpu-offload-gb must be a number of GiB >= 0, got -1.0"),
    (["--cpu-offload-gb", "nan"], "--cpu-offload-gb must be a number of GiB >= 0, got nan"),
    (["--cpu-offload-gb", "inf"], "--cpu-offload-gb must be a number of GiB >= 0, got inf"),
    (["--num-scheduler-steps", "8"], "--num-scheduler-steps 8: multi-step scheduling"),
    (["--max-seq-len-to-capture", "8192"], "--max-seq-len-to-capture 8192: CUDA graphs"),
    (["--limit-mm-per-prompt", '{"image": 2}'], "text-only models"),
    (["--limit-mm-per-prompt", '{"image": 0, "video": {"count": 1}}'], "text-only models"),
    (["--kv-offloading-size", "inf"], "--kv-offloading-size must be >= 0 GiB, got inf"),
    (["--kv-offloading-size", "nan"], "--kv-offloading-size must be >= 0 GiB, got nan"),
    (["--api-key", ""], "--api-key: a key must not be empty"),
    (["--kv-transfer-config", "{}"], "disaggregated prefill"),
    (["--tool-parser-plugin", "p.py"], "plugin files are not loaded"),
    (["--max-long-partial-prefills", "1"], "--max-long-partial-prefills needs "
                                          "--long-prefill-token-threshold"),
    (["--max-num-partial-prefills", "-1"], "--max-num-partial-prefills must be >= 0"),
    (["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"],
     "--max-long-partial-prefills 3 exceeds --max-num-partial-prefills 2"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override must be >= 1, got 0"),
    (["--num-gpu-blocks-override", "100", "--kv-cache-memory", "1GiB"],
     "--num-gpu-blocks-override and --kv-cache-memory both size the KV pool: give one"),
    (["--logits-processors", "my.Proc"], "logits-processor classes are not loaded"),
    (["--enable-prompt-embeds"], "--enable-prompt-embeds: prompts are text or token ids"),
    (["--otlp-traces-endpoint", "http://x:4317"], "OpenTelemetry tracing is not supported"),
    (["--worker-extension-cls", "a.B"], "POST /reload_weights"),
    (["--headless"], "--headless: multi-node data parallelism is not supported"),
    (["--data-parallel-size-local", "1", "-dp", "2"],
     "--data-parallel-size-local 1: multi-node data parallelism is not supported"),
    (["--api-server-count", "4"], "--api-server-count 4: one HTTP server process"),
    (["--prefix-caching-hash-algo", "xxhash"], "block hashes are chained sha256"),
    (["--preemption-mode", "swap"], "never swapped to CPU memory"),
    (["--model-impl", "transformers"], "--model-impl transformers: not supported"),
    (["--cuda-graph-sizes", "1", "2", "4"], "--cuda-graph-sizes 1 2 4: tpserve captures its "
                                           "own step sizes; give the largest alone"),
    (["--rope-theta", "1e4", "--hf-overrides", '{"rope_theta": 1}'],
     "--rope-theta and --hf-overrides both set rope_theta"),
    (["--rope-scaling", '{"rope_type": "linear", "factor": 2.0}', "--hf-overrides", "[1]"],
     "--hf-overrides must be a JSON object"),
    (["--structured-outputs-config", '{"backend": "guidance"}'],
     "--guided-decoding-backend guidance: not supported"),
    (["--structured-outputs-config", '{"disable_additional_properties": true}'],
     "--structured-outputs-config: disable_additional_properties True is not supported "
     r"\(only false\)"),
    (["--structured-outputs-config", '{"disable_any_whitespace": "yes"}'],
     "--structured-outputs-config: disable_any_whitespace 'yes' is not supported "
     r"\(only true or false\)"),
    (["--structured-outputs-config", '{"reasoning_parser": "x"}'],
     r"--structured-outputs-config: unknown or unsupported keys \['reasoning_parser'\]"),
    (["--default-chat-template-kwargs", '{"tools": []}'],
     "--default-chat-template-kwargs cannot set tools"),
    (["--reasoning-config", '{"think_start_str": "<think>", "think_end_str": "</think>"}'],
     "--reasoning-config needs --reasoning-parser"),
    (["--reasoning-config", '{"reasoning_start_str": "<seed:think>"}'],
     "--reasoning-config: reasoning_start_str '<seed:think>' is not supported"),
    (["--reasoning-config", '{"think_start_str": "<think>", "budget": 3}'],
     r"--reasoning-config: unknown or unsupported keys \['budget'\]"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
     "--speculative-config: method 'eagle' is not supported"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                              '"model": "draft"}'],
     "--speculative-config: model 'draft' is a draft model, which tpserve does not run"),
    (["--runner", "pooling", "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 2}'],
     "--speculative-config: a pooling model generates no tokens"),
])
def test_invalid_combinations_name_the_flag(tiny_folder, argv, message):
    with pytest.raises(ValueError, match=message):
        _cfg(str(tiny_folder), "--device", "cpu", *argv)


def test_the_speculative_config_is_vllms_json(tiny_folder):
    """``--speculative-config`` (vLLM's JSON object, method "ngram") reaches the engine's
    config, vLLM's defaults filled in (the lower bound defaults to the upper); without it
    speculation is off."""
    engine = _cfg(str(tiny_folder), "--device", "cpu", "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 3, '
                  '"prompt_lookup_max": 4}').engine
    spec = engine.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max,
            spec.prompt_lookup_min) == ("ngram", 3, 4, 4)
    assert _cfg(str(tiny_folder), "--device", "cpu").engine.speculative is None


def test_a_resolved_runner_config_refuses_auto():
    from tpserve.model.runner_config import RunnerConfig

    for field, flag in (("dtype", "--dtype"), ("device", "--device"),
                        ("kernel_backend", "--kernel-backend")):
        with pytest.raises(ValueError, match=f"{flag} must be one of .* once resolved"):
            RunnerConfig(**{field: "auto"})


@pytest.mark.parametrize("flags", [["--no-engine-process"], []],
                         ids=["in-process", "engine-process"])
def test_serve_refuses_a_missing_model_with_exit_2(tmp_path, flags):
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "serve",
                          str(tmp_path / "missing.gguf"), *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"model not found: {tmp_path / 'missing.gguf'}" in out.stderr


def test_serve_refuses_an_index_naming_a_shard_outside_the_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    (tmp_path / "x.safetensors").write_bytes(b"")
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "serve", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "names the shard '../x.safetensors', which is not a file inside the model " \
           "folder" in out.stderr


def test_a_reasoning_parser_needs_its_tags_in_the_vocabulary_before_the_load():
    proc = tpserve("serve", "--reasoning-parser", "qwen3", "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "tpserve: error: --reasoning-parser qwen3 needs the tokens <think> and </think> in "
        "the model's vocabulary")
    assert "loading SmolLM2" not in proc.stderr  # refused before the weights load


# ------------------------------------------------------------- vLLM's HTTP-server flags


def test_vllm_http_server_flags_reach_the_server_config(tmp_path):
    from tests.server.http.certs import self_signed

    server = _cfg().server
    assert (server.ssl_keyfile, server.ssl_certfile, server.ssl_ca_certs,
            server.ssl_cert_reqs) == (None, None, None, 0)
    assert (server.root_path, server.uvicorn_log_level, server.disable_fastapi_docs,
            server.response_role, server.max_logprobs) == (None, "info", False, "assistant", 20)
    assert server.scheme == "http" and server.uvicorn_options()["ssl_certfile"] is None
    key, cert = self_signed(tmp_path)
    server = _cfg("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs",
                  str(cert), "--ssl-cert-reqs", "2", "--root-path", "/api/v1",
                  "--uvicorn-log-level", "trace", "--disable-fastapi-docs",
                  "--response-role", "bot", "--max-logprobs", "5").server
    assert server.uvicorn_options() == {
        "log_level": "trace", "ssl_keyfile": str(key), "ssl_certfile": str(cert),
        "ssl_ca_certs": str(cert), "ssl_cert_reqs": 2}
    assert (server.scheme, server.root_path, server.disable_fastapi_docs,
            server.response_role, server.max_logprobs) == ("https", "/api/v1", True, "bot", 5)
    assert _cfg("--root-path", "").server.root_path is None


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    from tests.server.http.certs import self_signed

    folder = tmp_path_factory.mktemp("tls")
    key, cert = self_signed(folder)
    other_key, _ = self_signed(folder, "other")
    encrypted = folder / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:pw",
                    "-out", str(encrypted)], check=True, capture_output=True, timeout=60)
    return {"KEY": str(key), "CERT": str(cert), "OTHER_KEY": str(other_key),
            "ENCRYPTED": str(encrypted), "MISSING": str(folder / "missing.pem")}


@pytest.mark.parametrize("argv,message", [
    (["--ssl-keyfile", "KEY"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "CERT"], "--ssl-certfile needs --ssl-keyfile"),
    (["--ssl-keyfile", "MISSING", "--ssl-certfile", "CERT"], "--ssl-keyfile: no such file: "),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "MISSING"], "--ssl-certfile: no such file: "),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-ca-certs", "MISSING"],
     "--ssl-ca-certs: no such file: "),
    (["--ssl-keyfile", "OTHER_KEY", "--ssl-certfile", "CERT"],
     "--ssl-certfile .* and --ssl-keyfile .*: not a PEM certificate and its key"),
    (["--ssl-keyfile", "ENCRYPTED", "--ssl-certfile", "CERT"],
     "--ssl-keyfile: .* is encrypted \\(password-protected\\); give an unencrypted key"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-ca-certs", "KEY"],
     "--ssl-ca-certs .*: no PEM certificates"),
    (["--ssl-ca-certs", "CERT"], "--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 needs --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-cert-reqs", "1"],
     "--ssl-cert-reqs 1 checks client certificates against --ssl-ca-certs"),
    (["--root-path", "api"], "--root-path must start with '/' and not end with one"),
    (["--root-path", "/api/"], "--root-path must start with '/' and not end with one"),
    (["--response-role", " "], "--response-role must not be empty"),
    (["--max-logprobs", "21"], "--max-logprobs must be in 0..20, got 21: tpserve's engine "
                               "returns at most 20 log probabilities a token"),
    (["--max-logprobs", "-1"], "--max-logprobs must be in 0..20, got -1"),
])
def test_vllm_http_server_flags_are_checked_before_the_model_opens(tls_files, argv, message):
    argv = [tls_files.get(a, a) for a in argv]
    with pytest.raises(ValueError, match=message):
        _cfg("--model", "no-such-model.gguf", *argv)  # refused before the model is looked at


def test_only_the_rank_serving_http_reads_the_tls_files(monkeypatch, tmp_path):
    """Under torchrun the other nodes need not hold the key: rank 0 serves HTTP."""
    argv = ("--ssl-keyfile", str(tmp_path / "k.pem"), "--ssl-certfile", str(tmp_path / "c.pem"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _cfg(*argv).server.ssl_keyfile == str(tmp_path / "k.pem")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="--ssl-keyfile: no such file"):
        _cfg(*argv)


@pytest.mark.parametrize("argv", [["--uvicorn-log-level", "verbose"],
                                  ["--ssl-cert-reqs", "3"]])
def test_vllm_http_server_flag_choices(argv, capsys):
    parser, _ = build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve", *argv])
    assert exit_.value.code == 2 and f"argument {argv[0]}: invalid choice" in capsys.readouterr().err


def test_a_tls_flag_error_exits_2_naming_the_flag(tmp_path):
    proc = tpserve("serve", "--ssl-keyfile", str(tmp_path / "k.pem"), "--ssl-certfile",
                   str(tmp_path / "c.pem"), "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tpserve: error: --ssl-keyfile: no such file: '{tmp_path / 'k.pem'}'")


def test_config_file_flags_under_the_command_line(tiny_folder, tmp_path):
    """vLLM's --config FILE: YAML keys are flags (dashes or underscores), switches,
    --no- forms, lists and JSON objects map as on the command line, and the command
    line's flags (and model) win over the file's."""
    from tpserve.cli import parse_cli

    path = tmp_path / "serve.yaml"
    path.write_text(f"""
model: {tiny_folder}
max_num_seqs: 7
max-num-batched-tokens: 512
enable-prefix-caching: false
enforce-eager: true
disable-log-stats: false
served-model-name: [first, second]
hf-overrides: {{max_position_embeddings: 128}}
""")
    cfg = config_from_args(parse_cli(["serve", "--config", str(path), "--max-num-seqs", "9"]))
    assert cfg.scheduler.max_num_seqs == 9 and cfg.scheduler.max_num_batched_tokens == 512
    assert not cfg.scheduler.enable_prefix_caching and cfg.runner.enforce_eager
    assert cfg.server.log_stats_interval_s is not None
    assert cfg.served_model_name == "first" and cfg.server.served_model_aliases == ("second",)
    assert cfg.scheduler.max_model_len == 128 and cfg.runner.model == str(tiny_folder)
    other = tmp_path / "other"
    shutil.copytree(tiny_folder, other)
    assert config_from_args(parse_cli(["serve", str(other), "--config", str(path)])
                            ).runner.model == str(other)


@pytest.mark.parametrize(("text", "message"), [
    ("max-num-seqs: 4\nno-such-flag: 3", "'no-such-flag' is not a `tpserve serve` flag"),
    ("max-num-seqs: [1, 2]", "max-num-seqs takes one value, got a list [1, 2]"),
    ("host: [a, b]", "host takes one value, got a list ['a', 'b']"),
    ("- a\n- b", "a mapping of flag names to values is expected"),
    ("enforce-eager: 3", "enforce-eager is a switch: true or false, got 3"),
    ("config: other.yaml", "a config file cannot name another"),
    ("max-num-seqs: [1", "not YAML"),
])
def test_a_bad_config_file_exits_2_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = tpserve("serve", "--config", str(path))
    assert out.returncode == 2
    assert f"--config {path}: " in out.stderr and message in out.stderr, out.stderr


# ------------------------------------------------- vLLM's ways of writing a command line


def test_vllms_human_readable_integers(tiny_folder):
    """--max-model-len, --max-num-batched-tokens and --kv-cache-memory-bytes read numbers
    as vLLM's human_readable_int does: k/m/g/t x 1000 (decimals allowed), K/M/G/T x 1024;
    --max-model-len -1 or auto is the model's own; tpserve's --kv-cache-memory keeps its
    units (1g = 1 GiB)."""
    folder = str(tiny_folder)
    cfg = _cfg(folder, "--max-model-len", "0.2k", "--max-num-batched-tokens", "2K")
    assert (cfg.scheduler.max_model_len, cfg.scheduler.max_num_batched_tokens) == (200, 2048)
    assert _cfg(folder, "--max-num-batched-tokens", "1.5k").scheduler.max_num_batched_tokens \
        == 1500
    for auto in ("-1", "auto", "AUTO"):
        assert _cfg(folder, "--max-model-len", auto).scheduler.max_model_len == 256, auto
    for value, size in (("1g", 10**9), ("1G", 2**30), ("2t", 2 * 10**12), ("3MiB", 3 * 2**20),
                        ("1000", 1000)):
        assert _cfg(folder, "--kv-cache-memory-bytes", value).runner.kv_cache_memory == size
    assert _cfg(folder, "--kv-cache-memory", "1g").runner.kv_cache_memory == 2**30


@pytest.mark.parametrize("argv,message", [
    (["--max-model-len", "1.5K"], "argument --max-model-len: '1.5K': a binary suffix (K) "
                                  "takes an integer; did you mean 1.5k?"),
    (["--max-num-batched-tokens", "2KiB"], "argument --max-num-batched-tokens: invalid"),
    (["--kv-cache-memory", "inf"], "argument --kv-cache-memory: not a finite number of "
                                   "bytes: 'inf'"),
    (["--kv-cache-memory-bytes", "nan"], "argument --kv-cache-memory-bytes: not a finite "
                                         "number of bytes: 'nan'"),
    (["--max-request-body-bytes", "inf"], "argument --max-request-body-bytes: not a finite "
                                          "number of bytes: 'inf'"),
])
def test_a_bad_number_exits_2_naming_the_flag(argv, message, capsys):
    from tpserve.cli import parse_cli

    with pytest.raises(SystemExit) as exit_:
        parse_cli(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert "Traceback" not in err


def test_flag_names_may_have_underscores(tiny_folder):
    """vLLM's FlexibleArgumentParser takes --max_model_len as --max-model-len (before an
    '=' only: values keep their underscores)."""
    from tpserve.cli import dashed_flags, parse_cli

    args = parse_cli(["serve", str(tiny_folder), "--max_model_len", "64", "--max_num_seqs=3",
                      "--served_model_name", "my_model", "--enable_prefix_caching",
                      "--chat_template={{ messages_x }}"])
    cfg = config_from_args(args)
    assert (cfg.scheduler.max_model_len, cfg.scheduler.max_num_seqs) == (64, 3)
    assert cfg.served_model_name == "my_model" and cfg.server.chat_template == "{{ messages_x }}"
    assert dashed_flags(["serve", "a_b", "-tp", "2", "--x_y=a_b", "--", "--c_d"]) == [
        "serve", "a_b", "-tp", "2", "--x-y=a_b", "--", "--c_d"]


def test_api_key_before_the_model_is_refused_not_served_as_a_key(tiny_folder, capsys):
    """``--api-key`` takes several keys (vLLM's), so ``--api-key KEY MODEL`` made the
    model a key and served the embedded model: exit 2 saying so, where the last key names
    a model (a path that exists, or an org/name id); keys alone, or a model given, pass."""
    from tpserve.cli import parse_cli

    for model in (str(tiny_folder), "org/name"):
        with pytest.raises(SystemExit) as info:
            parse_cli(["serve", "--api-key", "secret", model])
        assert info.value.code == 2
        assert (f"--api-key took {model!r} as a key and no model was given: put the model "
                "before --api-key") in capsys.readouterr().err
    assert parse_cli(["serve", "--api-key", "k1", "k2"]).api_key == ["k1", "k2"]
    args = parse_cli(["serve", "--model", str(tiny_folder), "--api-key", "k", "org/name"])
    assert args.api_key == ["k", "org/name"]
    assert parse_cli(["serve", str(tiny_folder), "--api-key", "secret"]).model == str(
        tiny_folder)


def test_a_json_flag_given_key_by_key(tiny_folder):
    """vLLM's ``--speculative-config.method ngram`` form: the keys (nested ``a.b``, JSON
    values or text, the key's underscores kept) make one object, laid over the flag's own
    JSON where it is given too; ``--flag_name.key`` too."""
    from tpserve.cli import dotted_json_flags, parse_cli

    args = parse_cli(["serve", str(tiny_folder), "--speculative_config.method", "ngram",
                      "--speculative-config.num_speculative_tokens=4",
                      "--hf-overrides", '{"a": {"b": 1}, "c": 2}', "--hf-overrides.a.d", "x"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert json.loads(args.hf_overrides) == {"a": {"b": 1, "d": "x"}, "c": 2}
    cfg = config_from_args(args)
    assert cfg.engine.speculative.num_speculative_tokens == 4
    flags = {"--x"}
    assert dotted_json_flags(["serve", "--x", "{}", "--y.z", "1"], flags) == [
        "serve", "--x", "{}", "--y.z", "1"]  # no key by key: unchanged
    assert dotted_json_flags(["serve", "--x.a", "true", "--x.b.c=[1]", "m"], flags) == [
        "serve", "m", "--x", '{"a": true, "b": {"c": [1]}}']
    assert dotted_json_flags(["serve", "--x", "oops", "--x.a", "1"], flags) == [
        "serve", "--x", "oops"]  # the flag's own JSON check refuses it, naming the flag
    # a bare "--" and what follows it stay last (the merged flags go before it)
    assert dotted_json_flags(["serve", "--x.a", "2", "--", "m"], flags) == [
        "serve", "--x", '{"a": 2}', "--", "m"]
    assert parse_cli(["serve", "--hf-overrides.y", "2", "--", "m"]).model == "m"
    with pytest.raises(SystemExit):
        parse_cli(["serve", "--speculative-config", "[1]", "--speculative-config.method", "x"])


def test_vllms_switches_have_their_no_forms():
    """tpserve's switches that are vLLM's BooleanOptionalAction flags take --no-X too."""
    parser, _ = build_parser()
    for flag in ("--enforce-eager", "--enable-lora", "--trust-remote-code",
                 "--enable-auto-tool-choice", "--disable-log-requests",
                 "--disable-fastapi-docs", "--enable-log-requests"):
        dest = flag[2:].replace("-", "_")
        assert getattr(parser.parse_args(["serve", flag]), dest) is True, flag
        assert getattr(parser.parse_args(["serve", flag, "--no-" + flag[2:]]), dest) is False
        assert getattr(parser.parse_args(["serve"]), dest) is False, flag
    assert _cfg("--no-enforce-eager", "--no-trust-remote-code") == _cfg()


def test_several_api_keys_and_vllms_variable(monkeypatch, tmp_path):
    """vLLM's --api-key takes several keys (any is accepted), from the command line or a
    YAML list; without the flag, $TPSERVE_API_KEY, else vLLM's $VLLM_API_KEY."""
    from tpserve.cli import parse_cli

    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _cfg().server.api_key is None
    assert _cfg("--api-key", "k1", "k2").server.api_key == ("k1", "k2")
    path = tmp_path / "serve.yaml"
    path.write_text("api-key: [k1, k2]\n")
    assert config_from_args(parse_cli(["serve", "--config", str(path)])).server.api_key == (
        "k1", "k2")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert _cfg().server.api_key == ("v",)
    assert _cfg("--api-key", "k").server.api_key == ("k",)
    monkeypatch.setenv("TPSERVE_API_KEY", "t")
    assert _cfg().server.api_key == ("t",)
    help_text = " ".join(build_parser()[1]["serve"].format_help().split())
    assert "$TPSERVE_API_KEY, else $VLLM_API_KEY" in help_text


def test_the_api_key_middleware_accepts_any_of_the_keys():
    import asyncio

    from tpserve.server.http.middleware import ApiKeyMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def status(middleware, headers) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/models", "method": "GET", "headers": headers}
        asyncio.run(middleware(scope, None, send))
        return sent[0]["status"]

    several = ApiKeyMiddleware(app, api_key=("k1", "k2"), protected=lambda path: True)
    one = ApiKeyMiddleware(app, api_key="k1", protected=lambda path: True)
    for key, want in ((b"k1", 200), (b"k2", 200), (b"k3", 401), (b"k1k2", 401)):
        assert status(several, [(b"authorization", b"Bearer " + key)]) == want, key
        assert status(several, [(b"x-api-key", key)]) == want, key
    assert status(one, [(b"authorization", b"Bearer k2")]) == 401
    assert status(one, [(b"authorization", b"Bearer k1")]) == 200


def test_vllm_values_that_ask_for_what_tpserve_does(tiny_folder):
    """--limit-mm-per-prompt of zero items (text only) and --dtype float (vLLM's choice,
    float32) are taken."""
    folder = str(tiny_folder)
    plain = _cfg(folder)
    for limits in ('{"image": 0}', '{"image": 0, "video": 0}', '{"image": {"count": 0}}'):
        assert _cfg(folder, "--limit-mm-per-prompt", limits) == plain
    assert _cfg(folder, "--dtype", "float").runner.dtype == "float32"
    assert _cfg(folder, "--dtype", "half").runner.dtype == "float16"
