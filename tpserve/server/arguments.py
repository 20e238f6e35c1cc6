"""``tpserve serve``'s command line: every flag with its help and default
(``add_serve_arguments``) and the parsers of flag values; ``config.config_from_args``
turns the parsed flags into the frozen config tree."""

from __future__ import annotations

import argparse
import math
import os
import re
import ssl

from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPE_CHOICES
from tpserve.model.pooling import RUNNER_CHOICES
from tpserve.model.quant.fp8 import DEFAULT_FAST_ACCUM, DEFAULT_WEIGHT_ONLY_MAX_TOKENS
from tpserve.model.quant.methods import QUANTIZATION_CHOICES
from tpserve.model.sampling_params import LOGPROBS_MODES, SamplingParams
from tpserve.server.config import UVICORN_LOG_LEVELS
from tpserve.server.engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from tpserve.server.flag_types import json_object
from tpserve.server.http.cors import parse_list
from tpserve.server.http.frontend import CONTENT_FORMATS
from tpserve.server.http.reasoning import REASONING_PARSERS
from tpserve.server.http.tool_parsers import TOOL_PARSERS
from tpserve.server.tls import SSL_CERT_REQS
from tpserve.server.vllm_compat import VLLM_SWITCH, add_vllm_compat_arguments


def parse_bytes(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1e9`` or a plain integer number of bytes; inf and nan are
    refused (argparse names the flag)."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower()
    number, mult = t, 1
    for suffix, m in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            number, mult = t[: -len(suffix)], m
            break
    value = float(number)  # ValueError: argparse's "invalid value" naming the flag
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number of bytes: {text!r}")
    return int(value * mult)


# vLLM's human-readable integers (its arg_utils.human_readable_int): a lowercase suffix is
# decimal and may follow a decimal number (0.2k = 200), an uppercase one binary and
# follows an integer only (2K = 2048)
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(text: str) -> int:
    """``25.6k`` (25,600), ``2K`` (2,048), ``1g`` (10**9), ``1G`` (2**30) or an integer,
    as vLLM reads ``--max-num-batched-tokens`` and ``--kv-cache-memory-bytes``."""
    t = text.strip()
    match = _HUMAN_INT.fullmatch(t)
    if match is None:
        return int(t)  # ValueError: argparse's "invalid value" naming the flag
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix ({suffix}) takes an integer; did you mean "
            f"{number}{suffix.lower()}?")
    return int(number) * _BINARY_SUFFIXES[suffix]


def max_model_len_value(text: str) -> int | None:
    """``--max-model-len``: a human-readable integer, or -1 / auto for the model's own
    context (None), as vLLM's ``human_readable_int_or_auto``."""
    if text.strip() == "-1" or text.strip().lower() == "auto":
        return None
    return human_readable_int(text)


def vllm_bytes(text: str) -> int:
    """``--kv-cache-memory-bytes``: vLLM's human-readable integer (``8G`` = 8 GiB, ``8g``
    = 8e9 bytes) where it is one, else ``parse_bytes``' forms (``8GiB``, ``8GB``)."""
    if _HUMAN_INT.fullmatch(text.strip()) or text.strip().isdigit():
        return human_readable_int(text)
    return parse_bytes(text)


def api_key_default() -> str | None:
    """``--api-key``'s default: $TPSERVE_API_KEY, else vLLM's $VLLM_API_KEY (empty: none)."""
    return os.environ.get("TPSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


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
    p.add_argument("--hf-token", nargs="?", const=True, default=None, metavar="TOKEN",
                   help="vLLM's: the Hugging Face token for a gated repository (the model, "
                        "--tokenizer, --lora-modules); without a value the one "
                        "`hf auth login` stored (default: $HF_TOKEN, else that one)")
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
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each an engine process sharding the model over "
                        "its own --tensor-parallel-size GPUs (replica r on GPUs r*tp.."
                        "r*tp+tp-1); each request goes to the replica with the fewest "
                        "requests in flight")
    p.add_argument("--tp-comm", default="allreduce", choices=["allreduce", "allgather"],
                   help="how tensor-parallel layers communicate: allreduce (every rank holds "
                        "every token; row-parallel layers all-reduce) or allgather (sequence "
                        "parallel: tokens sharded between layers, all-gather before and "
                        "reduce-scatter after each tensor-parallel block)")
    p.add_argument("--enable-expert-parallel", **VLLM_SWITCH,
                   help="a mixture of experts: each rank holds 1/tp of the experts whole "
                        "(tp must divide their number) instead of 1/tp of every expert's "
                        "columns; the same one all-reduce per layer (vLLM's flag)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 (half), "
                        "float32 (float)")
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
                        "own: fp8, gptq or awq for such a checkpoint, whose weights and "
                        "scales are served as stored; else none), none, fp8 (e4m3 weights with "
                        "per-output-channel scales, quantized at load unless the checkpoint "
                        "is FP8, whose per-tensor, per-channel or block scales are kept; "
                        "activations scaled per token (per token and block column group for "
                        "block scales, or by the checkpoint's static scales); FP8 matrix "
                        "products on Hopper), gptq, awq or compressed-tensors (a GPTQ / AWQ / "
                        "pack-quantized checkpoint's 4- or 8-bit weights with group scales "
                        "and zero points, multiplied in the model's dtype; gptq_marlin and "
                        "awq_marlin name the same), gguf (a GGUF file whose decoder linear "
                        "weights are of types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or Q2_K .. Q6_K, "
                        "mixed by tensor as in Q4_K_M or not, held at 4 or 8 bits a "
                        "weight instead of dequantized at load, which auto does). none on a "
                        "quantized safetensors checkpoint is refused")
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
    p.add_argument("--max-model-len", type=max_model_len_value, default=None,
                   help="context length (prompt + output), as vLLM reads it: an integer, "
                        "with k/m (x1000, x10^6: 0.5k = 500) or K/M (x1024, x2^20: 2K = "
                        "2048); -1 or auto: the model's; default: the model's")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=human_readable_int,
                   default=d.max_num_batched_tokens,
                   help="token budget of one step (chunked prefill splits longer prompts); "
                        "k or K suffixes as --max-model-len")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV cache block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory (on CPU: of available RAM) to use")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV pool size in bytes (e.g. 2GiB); overrides the plan; default: "
                        "planned from --gpu-memory-utilization")
    p.add_argument("--kv-cache-memory-bytes", type=vllm_bytes, dest="kv_cache_memory",
                   default=None, metavar="BYTES",
                   help="vLLM's spelling of --kv-cache-memory, its value read as vLLM reads "
                        "it: k/m/g/t are powers of 1000 (8g = 8*10^9 bytes), K/M/G/T of "
                        "1024 (8G = 8 GiB); --kv-cache-memory's forms (8GiB) are taken too")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV pool size in blocks of --block-size tokens, on every rank "
                        "(vLLM's; e.g. to test preemption with a small pool); overrides the "
                        "plan; default: planned from --gpu-memory-utilization")
    p.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                   help="host memory, in GiB summed over the tensor-parallel ranks, for a "
                        "second tier of the prefix cache: cached KV blocks evicted from the "
                        "device are kept there and copied back on a later hit instead of "
                        "computed again (pinned on GPUs); default 0: off")
    p.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="GIB",
                   help="per rank, at least this many GiB of weights held in host memory "
                        "instead of device memory: the last decoder layers' weights are "
                        "pinned in host memory and streamed to the device each forward "
                        "(slower steps; serves a model larger than the device, or leaves "
                        "the room to the KV cache); default 0: off")
    p.add_argument("--kv-offloading-backend", default="native", choices=["native"],
                   help="how KV blocks are offloaded: native (tpserve's own host tier; "
                        "vLLM's lmcache back-end is not available)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse KV blocks of shared prompt prefixes")
    p.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"],
                   help="how to read MODEL: auto (by the path), safetensors, gguf, or dummy "
                        "(random weights of a real shape)")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="flags from a YAML file of flag: value pairs (vLLM's --config); flags "
                        "given on the command line win over the file's")
    p.add_argument("--disable-sliding-window", **VLLM_SWITCH,
                   help="attend to the whole context in every layer of a model with a "
                        "sliding window (Mistral-7B-v0.1, Phi-3-mini-4k, ...), its context "
                        "then capped at the window (vLLM's flag)")
    p.add_argument("--runner", default="auto", choices=list(RUNNER_CHOICES),
                   help="generate: completions and chat; pooling: /v1/embeddings only, the "
                        "model's final hidden states pooled (no LM head is loaded; "
                        "Qwen3-Embedding, e5-mistral and other decoder embedding models); "
                        "auto = generate")
    p.add_argument("--enable-lora", **VLLM_SWITCH,
                   help="serve LoRA adapters (--lora-modules) beside the base model, a request "
                        "choosing one by its model name (vLLM's flag)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="the adapters: NAME=PATH (a PEFT adapter folder) or a JSON object "
                        "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapter slots on the device; default: one per --lora-modules entry")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank the slots hold (a larger one is refused)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help="with --runner pooling: {\"pooling_type\": \"LAST\"|\"MEAN\"|"
                        "\"CLS\", \"normalize\": true|false} over the checkpoint's "
                        "sentence-transformers modules (modules.json), else LAST, normalized")
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
    p.add_argument("--api-key", nargs="+", default=api_key_default(), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1, KEY any of those given "
                        "(vLLM's list); default: $TPSERVE_API_KEY, else $VLLM_API_KEY, else "
                        "no key")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port to listen on; checked before the model loads")
    p.add_argument("--enforce-eager", **VLLM_SWITCH,
                   help="never capture CUDA graphs")
    p.add_argument("--disable-custom-all-reduce", **VLLM_SWITCH,
                   help="all-reduce through NCCL only (by default small all-reduces between "
                        "GPUs of one host go over peer-to-peer memory)")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=512,
                   help="capture mixed prefill+decode steps of up to this many tokens "
                        "(0: pure-decode graphs only)")
    p.add_argument("--max-mixed-tokens", type=int, default=None,
                   help="token budget of a step while sequences decode (default: "
                        "--cuda-graph-max-tokens when graphs are on, else no cap)")
    p.add_argument("--max-num-partial-prefills", type=int, default=0, metavar="N",
                   help="at most N sequences get a prefill chunk in one step (vLLM's; 0: no "
                        "cap); above 1, a prefill with more than --long-prefill-token-"
                        "threshold tokens left (default then: 4 %% of the context) is long")
    p.add_argument("--max-long-partial-prefills", type=int, default=None, metavar="M",
                   help="at most M of those are long (default 1 with --max-num-partial-"
                        "prefills above 1, else no cap): a long prompt that finds them taken "
                        "is passed over, so shorter prompts behind it start at once instead "
                        "of queueing behind long ones")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="one prompt's prefill chunk takes at most N tokens a step, so "
                        "prompts arriving together share steps instead of queueing behind "
                        "the longest (vLLM's; 0: only the step's budget caps it)")
    p.add_argument("--scheduling-policy", default=d.policy, choices=list(SCHEDULING_POLICIES),
                   help="fcfs: requests run in arrival order; priority: a request's "
                        "`priority` field orders them (lower first, arrival order within "
                        "one), and a waiting request that does not fit preempts running "
                        "ones of a later priority (they recompute later)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each step before reading back the previous step's tokens")
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help='speculative decoding by prompt lookup, as vLLM\'s: {"method": '
                        '"ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
                        '"prompt_lookup_min": M}; a decoding sequence whose last N..M '
                        'tokens occurred before drafts the K that followed, verified in '
                        'one step (same tokens and distribution; steps run synchronously '
                        'while drafting; "disable_by_batch_size": B drafts nothing above B '
                        'running sequences)')
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
                   help="prompt tokens (times n) waiting beyond one step's budget before "
                        "429 (one request over it and the budget alone: 400)")
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
    p.add_argument("--allow-credentials", **VLLM_SWITCH,
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
    p.add_argument("--disable-fastapi-docs", **VLLM_SWITCH,
                   help="no /openapi.json, /docs (Swagger UI) or /redoc")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role chat answers carry (message and first stream delta) when "
                        "the request's add_generation_prompt is true")
    p.add_argument("--max-logprobs", type=int, default=SamplingParams.MAX_LOGPROBS, metavar="N",
                   help="the most logprobs (completions), top_logprobs (chat) or "
                        "prompt_logprobs a request may ask; more gets 400 naming the field. "
                        f"At most {SamplingParams.MAX_LOGPROBS}, the engine's own limit: the "
                        "flag can only lower it (vLLM's -1, no cap, is refused)")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=LOGPROBS_MODES[0],
                   help="what logprobs report (vLLM's): raw_logprobs, the model's own "
                        "distribution before penalties, logit bias and temperature (the "
                        "default); processed_logprobs, that of the logits the token was "
                        "picked from (after them, and after top-k/top-p/min-p); raw_logits "
                        "and processed_logits, those logits themselves. Raw ones see a "
                        "structured output's grammar, as vLLM's do. Prompt logprobs are "
                        "always raw; beam search ranks by, and reports, processed logprobs")
    # vLLM's frontend flags (http/frontend.py; ServerConfig.frontend)
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   metavar="JSON",
                   help="template variables every chat request gets (e.g. "
                        '\'{"enable_thinking": false}\'); a request\'s chat_template_kwargs '
                        "override them")
    p.add_argument("--chat-template-content-format", default="auto",
                   choices=list(CONTENT_FORMATS),
                   help="message content as the chat template reads it: a string (string), "
                        "OpenAI's list of text parts (openai), or auto: the list for a "
                        "template that loops over a message's content, else a string")
    p.add_argument("--trust-request-chat-template", **VLLM_SWITCH,
                   help="render a request's own chat_template (without it such a request "
                        "is refused with 400: a template is code the server runs)")
    p.add_argument("--enable-force-include-usage", **VLLM_SWITCH,
                   help="a streamed answer ends with its usage even without "
                        "stream_options.include_usage")
    p.add_argument("--return-tokens-as-token-ids", **VLLM_SWITCH,
                   help="logprob tokens are named token_id:<id> unless a request sets "
                        "return_tokens_as_token_ids: false")
    p.add_argument("--exclude-tools-when-tool-choice-none", **VLLM_SWITCH,
                   help="a request with tool_choice none does not show its tools to the "
                        "chat template either")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="a stream's chunks carry at least N new tokens of some choice (the "
                        "first and the last go at once); a request's stream_interval may "
                        "ask more")
    p.add_argument("--enable-request-id-headers", **VLLM_SWITCH,
                   help="every response carries X-Request-Id: the request's own header, "
                        "else a new id")
    p.add_argument("--responses-store-size", type=int, default=0, metavar="N",
                   help="keep the last N Responses API answers in memory (unless a request "
                        "says store: false), for previous_response_id and GET/DELETE "
                        "/v1/responses/{id} (vLLM's VLLM_ENABLE_RESPONSES_API_STORE; "
                        "default 0: none kept)")
    p.add_argument("--enable-sleep-mode", **VLLM_SWITCH,
                   help="serve vLLM's control endpoints: POST /sleep?level=1|2&mode=abort|"
                        "wait|keep (give back the weights', KV pool's and CUDA graphs' device "
                        "memory; level 1 keeps the weights in host memory, level 2 reads "
                        "the checkpoint again at wake-up), POST /wake_up[?tags=weights|"
                        "kv_cache], GET /is_sleeping, POST /pause?mode=...&clear_cache=, "
                        "POST /resume, GET /is_paused, POST /reset_prefix_cache, POST "
                        "/reload_weights {\"path\": ...} (a checkpoint of the same model read "
                        "in place) and POST /collective_rpc for reload_weights (vLLM serves "
                        "them with VLLM_SERVER_DEV_MODE=1; behind --api-key)")
    p.add_argument("--enable-log-outputs", **VLLM_SWITCH,
                   help="log each choice's text, token ids and finish reason when it "
                        "finishes (INFO, logger tpserve.requests)")
    p.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="the logged prompts and outputs of --enable-log-requests and "
                        "--enable-log-outputs are cut to N characters and N token ids "
                        "(default: whole)")
    p.add_argument("--enable-auto-tool-choice", **VLLM_SWITCH,
                   help="allow tool_choice 'auto': the model decides whether to call tools, "
                        "and --tool-call-parser finds the calls in its output")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (Qwen2 / Qwen3, "
                        "<tool_call>...), llama3_json (Llama 3 JSON), mistral "
                        "([TOOL_CALLS]...), pythonic (Llama 3.2 / 4: [f(x=1), g()]), "
                        "granite (<|tool_call|>[...]), phi4_mini_json (functools[...]) or "
                        "qwen3_coder (Qwen3-Coder: <function=f><parameter=x>...)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="a thinking model's format: chat answers carry what it writes "
                        "between <think> and </think> as `reasoning` (and vLLM's older "
                        "`reasoning_content`), the rest as content; structured output and "
                        "tool calls apply after </think>. deepseek_r1 (DeepSeek-R1 and its "
                        "distills, QwQ: reasoning unless the prompt closed it) or qwen3 "
                        "(reasoning only when the output begins with <think>)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="logging threshold")
    p.add_argument("--disable-log-requests", **VLLM_SWITCH,
                   help="no access-log line per request (method, path, status, tokens, "
                        "latency)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine line (throughput, queues, KV cache use, prefix "
                        "cache hits, preemptions)")
    p.add_argument("--metrics-namespace", default="tpserve", choices=["tpserve", "vllm"],
                   help="the prefix of /metrics' series (vLLM's metric names either way): "
                        "vllm names them vllm:num_requests_waiting, ... as vLLM does, so "
                        "dashboards, autoscalers and gateways built for vLLM read this server "
                        "unchanged")
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
