"""The one frozen config tree, built from the command line, resolved and validated once at
start-up.

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
import json
import os
import ssl
from dataclasses import dataclass, replace
from typing import Any

import torch

from tpserve.model.cuda_graphs import mixed_buckets_for
from tpserve.model.generation_config import parse_overrides
from tpserve.model.kernels.backend import resolve_kernel_backend
from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPE_CHOICES, resolve_kv_cache_dtype
from tpserve.model.kv_hadamard import resolve_kv_cache_hadamard
from tpserve.model.loader.build import resolve_dtype
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.loader.hf_overrides import canonical_overrides
from tpserve.model.loader.hub import fetch_model, is_repo_id
from tpserve.model.quant.fp8 import DEFAULT_FAST_ACCUM, DEFAULT_WEIGHT_ONLY_MAX_TOKENS
from tpserve.model.quant.methods import QUANTIZATION_CHOICES, resolve_quantization
from tpserve.model.runner_config import RunnerConfig, resolve_max_model_len
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import ParallelConfig, torchrun_env
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from tpserve.server.http.cors import CorsConfig, parse_list
from tpserve.server.http.reasoning import REASONING_PARSERS
from tpserve.server.http.tool_parsers import TOOL_PARSERS
from tpserve.server.port import check_port_free
from tpserve.server.tls import SSL_CERT_REQS, check_tls_files, check_tls_flags
from tpserve.server.vllm_compat import add_vllm_compat_arguments, apply_vllm_compat


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 2**20
    log_level: str = "info"
    shutdown_timeout_s: float = 30.0
    generation_config: str = "auto"  # auto | vllm | FOLDER (model/generation_config.py)
    # --override-generation-config: generation_config.json keys over those defaults
    generation_overrides: tuple[tuple[str, float | int], ...] = ()
    log_requests: bool = True  # one access-log line per request
    log_stats_interval_s: float | None = 10.0  # the engine's stats line (None: off)
    served_model_aliases: tuple[str, ...] = ()  # more names (--served-model-name A B ...)
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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        self.scheduler.limits  # noqa: B018 - the runner's bounds (block sizes it supports)

    @property
    def served_model_name(self) -> str:
        if self.engine.served_model_name:
            return self.engine.served_model_name
        if self.runner.model is None:
            return "SmolLM2-135M-Instruct"
        return os.path.basename(os.path.normpath(self.runner.model)) or self.runner.model


def json_object(value: str) -> dict[str, Any]:
    """A flag's JSON object."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return parsed


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


def parse_bytes(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1e9`` or a plain integer number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower()
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


MEMORY_HISTORY_ENTRIES = 100_000  # --memory-history without N


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig(max_model_len=1)
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face model folder, a repository id (org/name: fetched "
                        "into the Hugging Face cache, and its served name), a .gguf file, or "
                        "(with --load-format dummy) a shape name; default (or empty): the "
                        "embedded SmolLM2-135M-Instruct")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as the positional argument takes it (the spelling of "
                        "vLLM's api_server)")
    p.add_argument("--revision", default=None,
                   help="with a Hugging Face repository id as the model: the branch, tag "
                        "or commit to serve (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="with a repository id: where to keep its files (default: the "
                        "Hugging Face cache, $HF_HOME); HF_TOKEN for gated ones, "
                        "HF_HUB_OFFLINE=1 to use the cache only")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="a JSON object of config.json keys laid over the model's (vLLM's), "
                        "e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}'; top-level keys "
                        "replace the file's; not for GGUF files")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder or Hugging Face repository id to use instead of "
                        "the model's (vLLM's; e.g. the original repository of a GGUF file)")
    p.add_argument("--tokenizer-revision", default=None,
                   help="with a repository id as --tokenizer: its branch, tag or commit")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="number of ranks (GPUs) the model is sharded over")
    p.add_argument("--tp-comm", default="allreduce", choices=["allreduce", "allgather"],
                   help="how tensor-parallel layers communicate: allreduce (every rank holds "
                        "every token; row-parallel layers all-reduce) or allgather (sequence "
                        "parallel: tokens sharded between layers, all-gather before and "
                        "reduce-scatter after each tensor-parallel block)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="dtype of the KV cache (auto: the model's --dtype). fp8 (= fp8_e4m3): "
                        "e4m3 with a float32 scale per layer for K and for V, from the "
                        "checkpoint's k_scale/v_scale (or kv_scale) tensors, else 1.0 or, "
                        "with --calculate-kv-scales, calibrated at start-up; values past "
                        "±448 x scale saturate; half the bytes of bf16, twice the tokens")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="with --kv-cache-dtype fp8 and a checkpoint without KV scales: "
                        "compute each layer's K and V scale at start-up from one prefill of "
                        "a fixed text (its largest |K| and |V| x 2 / 448) instead of 1.0; "
                        "for models whose K or V reach past 448 or stay far below 1")
    p.add_argument("--kv-cache-hadamard", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="rotate q and K by a Hadamard matrix after RoPE, so the cache holds "
                        "rotated K (attention scores are unchanged; FP8's rounding error is "
                        "spread over each head's channels: fp8 cache perplexity on SmolLM2 at "
                        "2,000 tokens +2.73%% -> +0.69%% on an H200); default: on with "
                        "--kv-cache-dtype fp8 when the head dim is a power of two up to 512 "
                        "and the checkpoint has no KV scales (chosen for unrotated K)")
    p.add_argument("--quantization", "-q", default="auto",
                   choices=list(QUANTIZATION_CHOICES),
                   help="weight quantization of the linear layers: auto (the checkpoint's "
                        "own: fp8 for an FP8 checkpoint, whose e4m3 weights and scales are "
                        "served as stored; else none), none, or fp8 (e4m3 weights with "
                        "per-output-channel scales, quantized at load unless the checkpoint "
                        "is FP8, whose per-tensor, per-channel or block scales are kept; "
                        "activations scaled per token (per token and block column group for "
                        "block scales, or by the checkpoint's static scales); FP8 matrix "
                        "products on Hopper). none on an FP8 checkpoint is refused")
    p.add_argument("--fp8-weight-only-max-tokens", type=int,
                   default=DEFAULT_WEIGHT_ONLY_MAX_TOKENS,
                   help="with --quantization fp8: steps of at most this many tokens multiply "
                        "the fp8 weights by unquantized activations (memory-bound decode "
                        "kernel); larger steps quantize activations and use FP8 products")
    p.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction,
                   default=DEFAULT_FAST_ACCUM,
                   help="with --quantization fp8: the FP8 products (the Triton kernel up to "
                        "64 tokens, cuBLAS above) keep the tensor cores' own running sums "
                        "(default; ~7 %% faster GEMMs); --no-fp8-fast-accum promotes them "
                        "into float32")
    p.add_argument("--overlap-attention", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="Triton kernels on CUDA: in a step with both decodes and prefill, run "
                        "decode attention on a second CUDA stream beside prefill attention "
                        "(one memory-bound and one compute-bound kernel share the GPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (chunked prefill splits longer prompts)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV cache block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory (on CPU: of available RAM) to use")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_bytes,
                   default=None,
                   help="KV pool size in bytes (e.g. 2GiB); overrides the plan; default: "
                        "planned from --gpu-memory-utilization")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse KV blocks of shared prompt prefixes")
    p.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"],
                   help="how to read MODEL: auto (by the path), safetensors, gguf, or dummy "
                        "(random weights of a real shape)")
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="sampling defaults for fields a request omits: auto = the model "
                        "folder's generation_config.json (the embedded model: its own), "
                        "vllm = OpenAI's defaults, or a folder holding that file")
    p.add_argument("--override-generation-config", type=json_object, default=None,
                   metavar="JSON",
                   help="sampling defaults over --generation-config's, as a JSON object of "
                        "generation_config.json keys (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens), e.g. '{\"temperature\": 0.6}'")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id(s) in the API, the first the one answers report; default: "
                        "the model's repository id, folder or file name")
    p.add_argument("--api-key", default=os.environ.get("TPSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1; default: "
                        "$TPSERVE_API_KEY, else no key")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port to listen on; checked before the model loads")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="all-reduce through NCCL only (by default small all-reduces between "
                        "GPUs of one host go over peer-to-peer memory)")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=512,
                   help="capture mixed prefill+decode steps of up to this many tokens "
                        "(0: pure-decode graphs only)")
    p.add_argument("--max-mixed-tokens", type=int, default=None,
                   help="token budget of a step while sequences decode (default: "
                        "--cuda-graph-max-tokens when graphs are on, else no cap)")
    p.add_argument("--scheduling-policy", default=d.policy, choices=list(SCHEDULING_POLICIES),
                   help="fcfs: requests run in arrival order; priority: a request's "
                        "`priority` field orders them (lower first, arrival order within "
                        "one), and a waiting request that does not fit preempts running "
                        "ones of a later priority (they recompute later)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each step before reading back the previous step's tokens")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (rank 0's model, scheduler and step loop, and the "
                        "spawning of the other ranks) in its own process, so that HTTP does "
                        "not share the GIL with it (--no-engine-process: one process, the "
                        "engine in a thread); ignored under torchrun")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="where the model runs: auto = CUDA when available, else CPU")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention and norm kernels: auto = Triton on CUDA, torch otherwise")
    p.add_argument("--max-request-body-bytes", type=parse_bytes, default=16 * 2**20,
                   help="larger request bodies get 413 (e.g. 16MiB)")
    p.add_argument("--max-num-queued-requests", type=int, default=1024,
                   help="requests waiting beyond --max-num-seqs before new ones get 429")
    p.add_argument("--max-num-queued-tokens", type=int, default=1 << 20,
                   help="prompt tokens (times n) waiting beyond one step's budget before 429")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish")
    p.add_argument("--collective-timeout", type=float, default=120.0,
                   help="seconds any collective may wait before the rank gives up")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) replacing "
                        "the model's")
    p.add_argument("--allowed-origins", type=parse_list, default=None, metavar="LIST",
                   help="origins browsers may call the API from (CORS), a JSON list or "
                        "comma-separated, e.g. '[\"*\"]'; default: no CORS headers (vLLM "
                        "allows every origin by default)")
    p.add_argument("--allowed-methods", type=parse_list, default=("*",), metavar="LIST",
                   help="with --allowed-origins: the methods allowed (default: all)")
    p.add_argument("--allowed-headers", type=parse_list, default=("*",), metavar="LIST",
                   help="with --allowed-origins: the request headers allowed (default: all)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="with --allowed-origins: allow credentials (cookies, auth headers)")
    # vLLM's HTTP-server flags (ServerConfig checks them)
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="serve HTTPS: the PEM private key (unencrypted), with --ssl-certfile")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS: the PEM certificate (chain), with --ssl-keyfile (a file "
                        "holding both may be given to both)")
    p.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="with HTTPS: the CA certificates client certificates are checked "
                        "against (--ssl-cert-reqs)")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   choices=list(SSL_CERT_REQS),
                   help="with HTTPS: client certificates, as Python's ssl module numbers "
                        "them: 0 not asked (CERT_NONE), 1 checked if sent (CERT_OPTIONAL), "
                        "2 required (CERT_REQUIRED); 1 and 2 need --ssl-ca-certs")
    p.add_argument("--root-path", default=None, metavar="PATH",
                   help="FastAPI's root_path, behind a proxy that serves the API under a "
                        "path prefix (e.g. /api/v1): routes answer with and without it, and "
                        "/openapi.json and /docs name it")
    p.add_argument("--uvicorn-log-level", default="info", choices=list(UVICORN_LOG_LEVELS),
                   help="threshold of uvicorn's own loggers (--log-level sets tpserve's)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /openapi.json, /docs (Swagger UI) or /redoc")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role chat answers carry (message and first stream delta) when "
                        "the request's add_generation_prompt is true")
    p.add_argument("--max-logprobs", type=int, default=SamplingParams.MAX_LOGPROBS, metavar="N",
                   help="the most logprobs (completions), top_logprobs (chat) or "
                        "prompt_logprobs a request may ask; more gets 400 naming the field. "
                        f"At most {SamplingParams.MAX_LOGPROBS}, the engine's own limit: the "
                        "flag can only lower it (vLLM's -1, no cap, is refused)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto': the model decides whether to call tools, "
                        "and --tool-call-parser finds the calls in its output")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (Qwen2, <tool_call>...), "
                        "llama3_json (Llama 3 JSON) or mistral ([TOOL_CALLS]...)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="a thinking model's format: chat answers carry what it writes "
                        "between <think> and </think> as `reasoning` (and vLLM's older "
                        "`reasoning_content`), the rest as content; structured output and "
                        "tool calls apply after </think>. deepseek_r1 (DeepSeek-R1 and its "
                        "distills, QwQ: reasoning unless the prompt closed it) or qwen3 "
                        "(reasoning only when the output begins with <think>)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="logging threshold")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per request (method, path, status, tokens, "
                        "latency)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine line (throughput, queues, KV cache use, prefix "
                        "cache hits, preemptions)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between the engine's stats lines (logged only while it "
                        "works or holds requests)")
    p.add_argument("--check-integrity", action="store_true",
                   help="check the KV pool accounting after every step (debugging)")
    p.add_argument("--memory-history", type=int, nargs="?", const=MEMORY_HISTORY_ENTRIES,
                   default=0, metavar="N",
                   help="record the CUDA caching allocator's events (allocations, frees, "
                        "segments, with Python stacks) on every rank from start-up, keeping "
                        f"the last N ({MEMORY_HISTORY_ENTRIES} when N is left out); "
                        "GET /memory/snapshot or `tpserve memory --snapshot FILE` dumps rank "
                        "0's for https://pytorch.org/memory_viz. Costs host time on every "
                        "allocation; CUDA only; default: off")
    p.add_argument("--nvtx", action="store_true",
                   help="named NVTX ranges (schedule, prepare, forward, sample, finalize, "
                        "each collective) for Nsight Systems timelines; host-side markers, "
                        "not recorded into CUDA graphs; a no-op off CUDA")
    add_vllm_compat_arguments(p)


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
                              collective_timeout_s=a.collective_timeout)
    engine = EngineConfig(served_model_name=names[0],
                          check_integrity=a.check_integrity,
                          max_num_queued_requests=a.max_num_queued_requests,
                          max_num_queued_tokens=a.max_num_queued_tokens,
                          async_scheduling=a.async_scheduling,
                          engine_process=a.engine_process)
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
                          response_role=a.response_role, max_logprobs=a.max_logprobs)
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
                                 weights=a.load_format != "dummy")
    tokenizer = a.tokenizer
    if tokenizer is not None and is_repo_id(tokenizer):
        tokenizer = fetch_model(tokenizer, a.tokenizer_revision, a.download_dir,
                                weights=False)
    elif a.tokenizer_revision is not None:
        raise ValueError("--tokenizer-revision needs a repository id as --tokenizer")
    hf_overrides = canonical_overrides(a.hf_overrides)
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, torch.device(device))
    ckpt = open_checkpoint(model_path, a.load_format, a.seed, hf_overrides,
                           tokenizer)  # its config: no weights
    if a.reasoning_parser is not None:  # its tags must be tokens: checked before the load
        REASONING_PARSERS[a.reasoning_parser](ckpt.tokenizer())
    kv_cache_dtype = resolve_kv_cache_dtype(a.kv_cache_dtype, dtype)
    runner = RunnerConfig(
        model=model_path, load_format=a.load_format, hf_overrides=hf_overrides,
        tokenizer=tokenizer, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=a.calculate_kv_scales,
        kv_cache_hadamard=resolve_kv_cache_hadamard(a.kv_cache_hadamard, kv_cache_dtype,
                                                    ckpt.config.head_dim, ckpt.kv_scales,
                                                    ckpt.config.rotary_dim),
        seed=a.seed, device=device,
        kernel_backend=resolve_kernel_backend(a.kernel_backend, device),
        gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_memory=a.kv_cache_memory,
        enforce_eager=a.enforce_eager, cuda_graph_max_tokens=a.cuda_graph_max_tokens,
        disable_custom_all_reduce=a.disable_custom_all_reduce, tp_comm=a.tp_comm,
        quantization=resolve_quantization(a.quantization, ckpt.quantization),
        fp8_weight_only_max_tokens=a.fp8_weight_only_max_tokens,
        fp8_fast_accum=a.fp8_fast_accum, overlap_attention=a.overlap_attention,
        memory_history=a.memory_history, nvtx=a.nvtx)
    model = ckpt.config
    max_mixed = a.max_mixed_tokens
    if max_mixed is None:
        max_mixed = default_max_mixed_tokens(runner, a.max_num_batched_tokens)
    scheduler = SchedulerConfig(
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=resolve_max_model_len(a.max_model_len, model),
        block_size=a.block_size, max_mixed_tokens=max_mixed,
        enable_prefix_caching=a.enable_prefix_caching, policy=a.scheduling_policy)
    return Config(runner=runner, parallel=parallel, scheduler=scheduler, engine=engine,
                  server=server)
