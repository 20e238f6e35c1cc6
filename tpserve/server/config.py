"""The one frozen config tree, built from the parsed command line (``arguments.py``), resolved
and validated once at start-up.

``Config`` = ``RunnerConfig`` (what every rank needs to build the model and KV pool)
+ ``ParallelConfig`` + ``SchedulerConfig`` (the step limits, prefix caching, the mixed-step
budget; the runner is sized by the same limits) + ``EngineConfig`` (rank 0's step loop and
its front) + ``ServerConfig`` (HTTP).

Every ``auto`` flag is resolved here, before anything is frozen: the device, the dtype,
the KV cache dtype (the model's), the kernel back-end (attention and ops),
``--quantization`` (the checkpoint's own method, else none),
``--max-model-len`` (from the checkpoint's config, read without its weights) and
``--max-mixed-tokens``. The tree holds concrete values only; no module resolves a default
later.
"""

from __future__ import annotations

import argparse
import math
import os
import ssl
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tpserve.model.cuda_graphs import mixed_buckets_for
from tpserve.model.generation_config import parse_overrides
from tpserve.model.kernels.backend import resolve_kernel_backend
from tpserve.model.kv_cache_dtype import resolve_kv_cache_dtype
from tpserve.model.kv_hadamard import resolve_kv_cache_hadamard
from tpserve.model.loader.build import DTYPES, resolve_dtype
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.loader.hf_overrides import canonical_overrides
from tpserve.model.loader.hub import fetch_model, is_repo_id, local_folder
from tpserve.model.lora.adapter import LoraConfig, LoraModule, read_adapter_layout
from tpserve.model.pooling import resolve_pooler_config, resolve_runner
from tpserve.model.quant.methods import STORED_ONLY, resolve_quantization
from tpserve.model.runner_config import RunnerConfig, resolve_max_model_len
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import ParallelConfig, torchrun_env
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.scheduler import SchedulerConfig
from tpserve.server.engine.speculative import SpeculativeConfig
from tpserve.server.http.cors import CorsConfig
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.reasoning import REASONING_PARSERS
from tpserve.server.http.request_log import RequestLog
from tpserve.server.port import check_port_free
from tpserve.server.replicas import ONLY, Replica, check_data_parallel, plan_replicas
from tpserve.server.tls import check_tls_files, check_tls_flags
from tpserve.server.vllm_compat import apply_vllm_compat


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # --api-key: a request must carry one of these keys (None: none needed); a str given
    # is taken as one key
    api_key: tuple[str, ...] | None = None
    max_request_body_bytes: int = 16 * 2**20
    log_level: str = "info"
    shutdown_timeout_s: float = 30.0
    generation_config: str = "auto"  # auto | vllm | FOLDER (model/generation_config.py)
    # --override-generation-config: generation_config.json keys over those defaults
    generation_overrides: tuple[tuple[str, float | int], ...] = ()
    log_requests: bool = True  # one access-log line per request
    log_stats_interval_s: float | None = 10.0  # the engine's stats line (None: off)
    served_model_aliases: tuple[str, ...] = ()  # more names (--served-model-name A B ...)
    # names a request may use that /v1/models does not list: a model path as given
    unlisted_model_names: tuple[str, ...] = ()
    cors: CorsConfig | None = None  # --allowed-origins (None: no CORS headers)
    chat_template: str | None = None  # a Jinja template replacing the model's
    enable_auto_tool_choice: bool = False  # tool_choice auto, parsed by tool_call_parser
    tool_call_parser: str | None = None  # a name in http/tool_parsers TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in http/reasoning REASONING_PARSERS
    # vLLM's HTTP-server flags: TLS (uvicorn's; a key and its certificate, or neither),
    # FastAPI's root_path, uvicorn's own log level, the docs routes, the chat answers'
    # role and the most logprobs a request may ask
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # the CAs client certificates are checked against
    ssl_cert_reqs: int = int(ssl.CERT_NONE)  # client certificates: 0 none, 1 optional, 2 required
    root_path: str | None = None
    uvicorn_log_level: str = "info"
    disable_fastapi_docs: bool = False
    response_role: str = "assistant"
    max_logprobs: int = SamplingParams.MAX_LOGPROBS
    # --download-dir: the Hugging Face cache that LoRA adapters named by repository id in
    # /v1/load_lora_adapter are fetched into (None: the default cache)
    download_dir: str | None = None
    metrics_namespace: str = "tpserve"  # /metrics' prefix: tpserve or vllm
    frontend: FrontendOptions = FrontendOptions()  # vLLM's frontend flags (http/frontend.py)

    def __post_init__(self) -> None:
        if self.api_key is not None:  # one key (a str) or several
            keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
            if not (keys and all(keys)):
                raise ValueError("--api-key: a key must not be empty")
            object.__setattr__(self, "api_key", keys)
        self._check_http()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")
        if self.shutdown_timeout_s < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.log_stats_interval_s is not None and not self.log_stats_interval_s > 0:
            raise ValueError(f"--log-stats-interval must be > 0, got {self.log_stats_interval_s}")

    def _check_http(self) -> None:
        """The vLLM HTTP-server flags, without reading files (``check_tls_files`` does)."""
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}"
                             f", got {self.uvicorn_log_level!r}")
        if not self.response_role.strip():
            raise ValueError("--response-role must not be empty")
        if not 0 <= self.max_logprobs <= SamplingParams.MAX_LOGPROBS:
            limit = SamplingParams.MAX_LOGPROBS
            raise ValueError(f"--max-logprobs must be in 0..{limit}, got {self.max_logprobs}: "
                             f"tpserve's engine returns at most {limit} log probabilities a "
                             "token, so the flag can only lower that limit")
        if self.root_path is not None and (not self.root_path.startswith("/")
                                           or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one (e.g. "
                             f"/api/v1), got {self.root_path!r}")
        check_tls_flags(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs,
                        self.ssl_cert_reqs)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config``'s keywords for TLS and uvicorn's log level."""
        return {"log_level": self.uvicorn_log_level, "ssl_keyfile": self.ssl_keyfile,
                "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs}


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

@dataclass(frozen=True, kw_only=True)
class Config:
    runner: RunnerConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    engine: EngineConfig
    server: ServerConfig
    # the engine processes and their GPUs (``replicas.py``): one without -dp
    replicas: tuple[Replica, ...] = (ONLY,)

    def __post_init__(self) -> None:
        self.scheduler.limits  # noqa: B018 - the runner's bounds (block sizes it supports)

    @property
    def served_model_name(self) -> str:
        if self.engine.served_model_name:
            return self.engine.served_model_name
        if self.runner.model is None:
            return "SmolLM2-135M-Instruct"
        return default_served_name(self.runner.model)


def default_served_name(model: str) -> str:
    """A model path's served name: its folder or file name (``/models/Llama-3/``:
    ``Llama-3``)."""
    return os.path.basename(os.path.normpath(model)) or model


def path_alias(model: str) -> tuple[str, ...]:
    """More names for a model given by path: the path as given (vLLM's served name),
    unless that is the default name itself."""
    return () if model == default_served_name(model) else (model,)


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the argument itself if it is a Jinja
    template (vLLM's rule); ValueError for neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def resolve_device(name: str) -> str:
    """``auto``: cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    return name


def default_max_mixed_tokens(runner: RunnerConfig, max_num_batched_tokens: int) -> int | None:
    """``--max-mixed-tokens`` left unset: the largest mixed-step CUDA graph when graphs are
    on (so mixed steps replay a graph), else no cap."""
    if not runner.uses_cuda_graphs:
        return None
    buckets = mixed_buckets_for(min(runner.cuda_graph_max_tokens, max_num_batched_tokens))
    return buckets[-1] if buckets else None


# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, read once here
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def partial_prefills(num: int, long: int | None, threshold: int,
                     max_model_len: int) -> dict[str, int]:
    """The scheduler's concurrent-prefill fields from vLLM's flags, with vLLM's defaults:
    with ``--max-num-partial-prefills`` above 1, a long prefill is one of more than 4 % of
    the context when no ``--long-prefill-token-threshold`` is given, and one long prompt
    at a time prefills unless ``--max-long-partial-prefills`` says otherwise."""
    if num > 1:
        threshold = threshold or max(1, max_model_len // 25)
        long = 1 if long is None else long
    return {"long_prefill_token_threshold": threshold, "max_num_partial_prefills": num,
            "max_long_partial_prefills": long or 0}


def resolve_kv_offloading(gib: float, prefix_caching: bool) -> int:
    """``--kv-offloading-size`` in bytes (0: off); the host tier is the prefix cache's."""
    if not (gib >= 0 and math.isfinite(gib)):
        raise ValueError(f"--kv-offloading-size must be >= 0 GiB, got {gib}")
    if gib and not prefix_caching:
        raise ValueError("--kv-offloading-size keeps evicted prefix-cache blocks in host "
                         "memory: it needs prefix caching (drop --no-enable-prefix-caching)")
    return int(gib * 2**30)


def resolve_cpu_offload(gib: float) -> int:
    """``--cpu-offload-gb`` in bytes (0: off)."""
    if not (gib >= 0 and math.isfinite(gib)):
        raise ValueError(f"--cpu-offload-gb must be a number of GiB >= 0, got {gib}")
    return int(gib * 2**30)


def resolve_lora(a: argparse.Namespace, dtype: str) -> LoraConfig | None:
    """``--enable-lora``'s adapters, each folder read and checked now (exit 2 naming the
    adapter, before any weight loads), and whether adapters may be loaded and unloaded
    while serving (``RUNTIME_LORA_ENV``); None without the flag. vLLM's ``--lora-dtype``
    must be auto or the model's resolved ``dtype``, ``--max-cpu-loras`` at least
    ``--max-loras``; ``--fully-sharded-loras`` is refused."""
    if not a.enable_lora:
        for flag, value in (("--lora-modules", a.lora_modules),
                            ("--max-cpu-loras", a.max_cpu_loras is not None),
                            ("--fully-sharded-loras", a.fully_sharded_loras)):
            if value:
                raise ValueError(f"{flag} needs --enable-lora")
        return None
    if a.fully_sharded_loras:
        raise ValueError("--fully-sharded-loras: not supported; tpserve shards each adapter "
                         "like the weight it modifies (A whole on column-parallel layers)")
    if a.lora_dtype != "auto" and DTYPES.get(a.lora_dtype) != DTYPES[dtype]:
        raise ValueError(f"--lora-dtype {a.lora_dtype}: the adapters are held in the model's "
                         f"dtype ({dtype}); use auto")
    modules = tuple(replace(m, path=local_folder(m.path, a.download_dir, a.hf_token))  # a repo id too
                    for m in map(LoraModule.parse, a.lora_modules or ()))
    for m in modules:
        if not Path(m.path).is_dir():
            raise ValueError(f"--lora-modules {m.name}={m.path}: not a folder (a PEFT adapter "
                             "folder, or a Hugging Face repository id)")
        try:
            read_adapter_layout(m.path, a.max_lora_rank)  # the header only: no tensor
        except ValueError as e:  # naming what it cannot apply
            raise ValueError(f"--lora-modules {m.name}: {e}") from None
    runtime = os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")
    slots = a.max_loras if a.max_loras is not None else max(1, len(modules))
    if a.max_cpu_loras is not None and a.max_cpu_loras < slots:
        raise ValueError(f"--max-cpu-loras {a.max_cpu_loras} must be at least --max-loras "
                         f"({slots}), as in vLLM")
    return LoraConfig(modules, slots, a.max_lora_rank, runtime_updates=runtime)


def config_from_args(a: argparse.Namespace) -> Config:
    """Builds, resolves and validates the whole tree; raises ValueError naming the flag
    (FileNotFoundError for a missing model). The checkpoint is opened for its config only
    (no weights are read)."""
    if a.model_flag is not None:
        if a.model is not None and a.model != a.model_flag:
            raise ValueError(f"the model is given twice: {a.model!r} and --model "
                             f"{a.model_flag!r}")
        a.model = a.model_flag
    apply_vllm_compat(a)
    names = a.served_model_name or [None]
    parallel = ParallelConfig(tensor_parallel_size=a.tensor_parallel_size,
                              collective_timeout_s=a.collective_timeout,
                              data_parallel_size=a.data_parallel_size)
    engine = EngineConfig(served_model_name=names[0],
                          check_integrity=a.check_integrity,
                          max_num_queued_requests=a.max_num_queued_requests,
                          max_num_queued_tokens=a.max_num_queued_tokens,
                          async_scheduling=a.async_scheduling,
                          engine_process=a.engine_process,
                          logprobs_mode=a.logprobs_mode,
                          enable_sleep_mode=a.enable_sleep_mode,
                          speculative=None if a.speculative_config is None else
                          SpeculativeConfig.from_json(a.speculative_config))
    server = ServerConfig(host=a.host, port=a.port, api_key=a.api_key,
                          max_request_body_bytes=a.max_request_body_bytes,
                          log_level=a.log_level, shutdown_timeout_s=a.shutdown_timeout,
                          generation_config=a.generation_config,
                          generation_overrides=tuple(
                              parse_overrides(a.override_generation_config).items()),
                          log_requests=not a.disable_log_requests,
                          served_model_aliases=tuple(names[1:]),
                          cors=None if not a.allowed_origins else CorsConfig(
                              allowed_origins=a.allowed_origins,
                              allowed_methods=a.allowed_methods,
                              allowed_headers=a.allowed_headers,
                              allow_credentials=a.allow_credentials),
                          log_stats_interval_s=(None if a.disable_log_stats
                                                else a.log_stats_interval),
                          chat_template=read_chat_template(a.chat_template),
                          enable_auto_tool_choice=a.enable_auto_tool_choice,
                          tool_call_parser=a.tool_call_parser,
                          reasoning_parser=a.reasoning_parser,
                          ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile,
                          ssl_ca_certs=a.ssl_ca_certs, ssl_cert_reqs=a.ssl_cert_reqs,
                          root_path=a.root_path or None,  # "": none
                          uvicorn_log_level=a.uvicorn_log_level,
                          disable_fastapi_docs=a.disable_fastapi_docs,
                          response_role=a.response_role, max_logprobs=a.max_logprobs,
                          download_dir=a.download_dir,
                          metrics_namespace=a.metrics_namespace,
                          frontend=FrontendOptions(
                              default_chat_template_kwargs=a.default_chat_template_kwargs
                              or {},
                              chat_template_content_format=a.chat_template_content_format,
                              trust_request_chat_template=a.trust_request_chat_template,
                              force_include_usage=a.enable_force_include_usage,
                              return_tokens_as_token_ids=a.return_tokens_as_token_ids,
                              exclude_tools_when_tool_choice_none=(
                                  a.exclude_tools_when_tool_choice_none),
                              request_id_headers=a.enable_request_id_headers,
                              stream_interval=a.stream_interval,
                              request_log=RequestLog(inputs=a.enable_log_requests,
                                                     outputs=a.enable_log_outputs,
                                                     max_len=a.max_log_len),
                              responses_store_size=a.responses_store_size,
                              control_endpoints=a.enable_sleep_mode))
    env = torchrun_env()
    serves_http = env is None or env[0] == 0  # spawned ranks, or torchrun's rank 0
    if serves_http:  # only the rank serving HTTP reads the TLS files
        check_tls_files(server.ssl_keyfile, server.ssl_certfile, server.ssl_ca_certs)
    if a.max_model_len is not None and a.max_model_len < 1:
        raise ValueError("--max-model-len must be >= 1")
    model_path = a.model or None  # "" (compose's default MODEL): the embedded model
    if model_path is not None and is_repo_id(model_path):  # vllm serve org/name
        if names[0] is None:
            engine = replace(engine, served_model_name=model_path)
        if serves_http:  # a taken port stops the start before the fetch
            check_port_free(a.host, a.port)
        model_path = fetch_model(model_path, a.revision, a.download_dir,
                                 weights=a.load_format != "dummy", token=a.hf_token)
    elif model_path is not None and names[0] is None:
        # vLLM serves a model under the argument as given (/models/x): requests may name
        # it so; its folder or file name stays the one listed and answered with
        server = replace(server, unlisted_model_names=path_alias(model_path))
    tokenizer = a.tokenizer
    if tokenizer is not None and is_repo_id(tokenizer):
        tokenizer = fetch_model(tokenizer, a.tokenizer_revision, a.download_dir,
                                weights=False, token=a.hf_token)
    elif a.tokenizer_revision is not None:
        raise ValueError("--tokenizer-revision needs a repository id as --tokenizer")
    hf_overrides = canonical_overrides(a.hf_overrides)
    device = resolve_device(a.device)
    check_data_parallel(parallel, engine.engine_process, env is not None)
    replicas = plan_replicas(parallel, device)  # ValueError when there are too few GPUs
    ckpt = open_checkpoint(model_path, a.load_format, a.seed, hf_overrides, tokenizer,
                           a.disable_sliding_window, a.generation_config)  # no weights read
    quantization = resolve_quantization(a.quantization, ckpt.quantization)
    # integer weights served as stored: their scales' dtype (fp16) decides auto on a GPU
    dtype = resolve_dtype(a.dtype, torch.device(device), quantization in STORED_ONLY)
    if a.reasoning_parser is not None:  # its tags must be tokens: checked before the load
        REASONING_PARSERS[a.reasoning_parser](ckpt.tokenizer())
    kv_cache_dtype = resolve_kv_cache_dtype(a.kv_cache_dtype, dtype)
    if a.enable_expert_parallel and not ckpt.config.num_experts:
        raise ValueError(f"--enable-expert-parallel: {ckpt.config.architecture} has no "
                         "experts (it is not a mixture of experts)")
    runner_kind = resolve_runner(a.runner, classifier=bool(ckpt.config.labels))
    task = getattr(a, "pooling_task", None)  # vLLM's --task / --convert (vllm_compat)
    if task is not None and (task == "classify") != bool(ckpt.config.labels):
        raise ValueError(
            f"--task/--convert {task}: this checkpoint is "
            + ("a sequence classifier, served by /classify, /score and /rerank" if
               ckpt.config.labels else "not a *ForSequenceClassification classifier "
               "(converting a causal LM's head into a classifier is not supported)"))
    if a.pooler_config is not None and runner_kind != "pooling":
        raise ValueError("--pooler-config needs --runner pooling")
    if engine.speculative is not None and runner_kind == "pooling":
        raise ValueError("--speculative-config: a pooling model generates no tokens")
    lora = resolve_lora(a, dtype)
    runner = RunnerConfig(
        model=model_path, load_format=a.load_format, hf_overrides=hf_overrides,
        tokenizer=tokenizer, generation_config=a.generation_config, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=a.calculate_kv_scales,
        kv_cache_hadamard=resolve_kv_cache_hadamard(a.kv_cache_hadamard, kv_cache_dtype,
                                                    ckpt.config.head_dim, ckpt.kv_scales,
                                                    ckpt.config.rotary_dim),
        seed=a.seed, device=device,
        kernel_backend=resolve_kernel_backend(a.kernel_backend, device),
        gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_memory=a.kv_cache_memory,
        num_gpu_blocks_override=a.num_gpu_blocks_override,
        kv_offloading_bytes=resolve_kv_offloading(a.kv_offloading_size,
                                                  a.enable_prefix_caching),
        cpu_offload_bytes=resolve_cpu_offload(a.cpu_offload_gb),
        enforce_eager=a.enforce_eager, cuda_graph_max_tokens=a.cuda_graph_max_tokens,
        disable_custom_all_reduce=a.disable_custom_all_reduce, tp_comm=a.tp_comm,
        expert_parallel=a.enable_expert_parallel,
        quantization=quantization,
        fp8_weight_only_max_tokens=a.fp8_weight_only_max_tokens,
        fp8_fast_accum=a.fp8_fast_accum, overlap_attention=a.overlap_attention,
        memory_history=a.memory_history, nvtx=a.nvtx, runner=runner_kind,
        disable_sliding_window=a.disable_sliding_window, lora=lora,
        pooler=resolve_pooler_config(a.pooler_config, ckpt.pooling(),
                                     ckpt.config.hidden_size,
                                     ckpt.config.matryoshka_dimensions, ckpt.config.labels,
                                     ckpt.config.problem_type)
        if runner_kind == "pooling" else None)
    model = ckpt.config
    max_mixed = a.max_mixed_tokens
    if max_mixed is None:
        max_mixed = default_max_mixed_tokens(runner, a.max_num_batched_tokens)
    max_model_len = resolve_max_model_len(a.max_model_len, model)
    scheduler = SchedulerConfig(
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=max_model_len, block_size=a.block_size, max_mixed_tokens=max_mixed,
        enable_prefix_caching=a.enable_prefix_caching, policy=a.scheduling_policy,
        **partial_prefills(a.max_num_partial_prefills, a.max_long_partial_prefills,
                           a.long_prefill_token_threshold, max_model_len))
    cfg = Config(runner=runner, parallel=parallel, scheduler=scheduler, engine=engine,
                 server=server, replicas=tuple(replicas))
    served = (cfg.served_model_name, *server.served_model_aliases,
              *server.unlisted_model_names)
    for m in lora.modules if lora is not None else ():
        if m.name in served:
            raise ValueError(f"--lora-modules: {m.name!r} is the served model's name")
    return cfg
