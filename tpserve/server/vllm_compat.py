"""vLLM command-line compatibility: flags a ``vllm serve`` command line carries that
tpserve takes as they are, because their only values here are the ones tpserve has
(``--trust-remote-code``, ``--tokenizer-mode auto``, ``--distributed-executor-backend
mp``, ...), or maps onto its own (``--disable-frontend-multiprocessing`` is
``--no-engine-process``). A value tpserve cannot honour is refused at start-up, naming the
flag and what to do instead, never ignored. tpserve's own spellings are in
``arguments.add_serve_arguments``; ``apply_vllm_compat`` runs first in ``config_from_args``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tpserve.model.loader.hf_overrides import canonical_overrides
from tpserve.server.flag_types import json_object

TOKENIZER_MODES = ("auto", "hf")  # transformers' tokenizers; "slow"/"mistral": refused
EXECUTOR_BACKENDS = ("mp", "uni")  # ranks are processes (one at tp 1); "ray": refused
STRUCTURED_BACKENDS = ("auto", "xgrammar")  # the one grammar engine tpserve has
MODEL_IMPLS = ("auto", "vllm")  # tpserve's own implementation; "transformers": refused
# vLLM's --task (older) and --convert, as --runner: generation, embeddings, or a sequence
# classifier's probabilities (its own checkpoint only: a causal LM is not converted)
TASKS = {"auto": None, "generate": "generate", "embed": "pooling", "embedding": "pooling",
         "classify": "pooling", "score": "pooling"}
CONVERTS = {"auto": None, "none": None, "embed": "pooling", "classify": "pooling"}
# vLLM's --reasoning-config keys (both spellings it has had) -> the tag each must name: the
# tags of every --reasoning-parser tpserve has
REASONING_TAGS = {"think_start_str": "<think>", "reasoning_start_str": "<think>",
                  "think_end_str": "</think>", "reasoning_end_str": "</think>"}
CLASSIFY_VALUES = ("classify", "score")
# vLLM flags for what tpserve does not do: flag -> (why, and what to do instead; the one
# value that asks for nothing, taken as it is, or None)
REFUSED = {
    "--compilation-config": ("tpserve does not use torch.compile; its CUDA graphs are set "
                             "by --cuda-graph-max-tokens (or off: --enforce-eager)", None),
    "--max-seq-len-to-capture": ("CUDA graphs are captured by step size: "
                                 "--cuda-graph-max-tokens", None),
    "--num-scheduler-steps": ("multi-step scheduling is not supported (vLLM's V1 engine "
                              "dropped it too); --async-scheduling overlaps the host's "
                              "work with the device instead", "1"),
    "--limit-mm-per-prompt": ("tpserve serves text-only models (a JSON object of zero "
                              "counts, e.g. '{\"image\": 0}', is taken: it asks for text "
                              "only)", None),
    "--kv-transfer-config": ("disaggregated prefill (KV transfer between instances) is not "
                             "supported", None),
    "--tool-parser-plugin": ("tool-call parsers are built in (--tool-call-parser); plugin "
                             "files are not loaded", None),
    "--logits-processors": ("logits-processor classes are not loaded; min_p, penalties, "
                            "logit_bias and allowed_token_ids are request fields", None),
    "--enable-prompt-embeds": ("prompts are text or token ids (prompt_embeds is refused)",
                               None),
    "--otlp-traces-endpoint": ("OpenTelemetry tracing is not supported; /metrics and the "
                               "access log report each request", None),
    "--collect-detailed-traces": ("OpenTelemetry tracing is not supported", None),
    "--worker-extension-cls": ("no worker extension code is loaded; a trainer's new "
                               "weights go through POST /reload_weights", None),
    "--headless": ("multi-node data parallelism is not supported: run one tpserve per node "
                   "behind a load balancer", None),
    "--data-parallel-address": ("multi-node data parallelism is not supported", None),
    "--data-parallel-start-rank": ("multi-node data parallelism is not supported", "0"),
    "--api-server-count": ("one HTTP server process serves every request (the engine runs "
                           "in its own)", "1"),
    "--prefix-caching-hash-algo": ("tpserve's prefix-cache block hashes are chained sha256",
                                   "sha256"),
    "--preemption-mode": ("a preempted sequence is recomputed, never swapped to CPU memory",
                          "recompute"),
    "--num-lookahead-slots": ("speculative decoding reserves its own slots "
                              "(--speculative-config)", "0"),
}
# vLLM flags that change nothing here: flag -> why (each is taken with or without a value)
NO_OPS = {
    "--disable-cascade-attn": "tpserve has no cascade attention",
    "--disable-chunked-mm-input": "tpserve serves text-only models",
    "--show-hidden-metrics-for-version": "tpserve hides no metrics",
    "--max-parallel-loading-workers": "each rank reads only its own shards, one tensor at a "
                                      "time",
}
# --structured-outputs-config's keys besides backend -> the values taken. JSON output is
# always compact (xgrammar's any_whitespace=False, what vLLM's disable_any_whitespace true
# asks of it); false only permits whitespace, so it holds too
STRUCTURED_TAKEN: dict[str, tuple[bool, ...]] = {
    "disable_fallback": (False,), "disable_any_whitespace": (True, False),
    "disable_additional_properties": (False,)}
# a switch of vLLM's, off by default: --X turns it on and --no-X off, as vLLM's
# BooleanOptionalAction flags (``add_argument(flag, **VLLM_SWITCH, help=...)``)
VLLM_SWITCH: dict[str, Any] = {"action": argparse.BooleanOptionalAction, "default": False}


def add_vllm_compat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "vLLM compatibility", "flags of `vllm serve` command lines, taken where their value is "
        "what tpserve does anyway (other values are refused with exit 2)")
    g.add_argument("--trust-remote-code", **VLLM_SWITCH,
                   help="changes nothing: tpserve never runs code from a checkpoint (its "
                        "architectures are built in)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="chunked prefill is always on (the --no- form is refused)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="only 1: tpserve shards a model by tensor parallelism")
    g.add_argument("--distributed-executor-backend", default=None,
                   help=f"{' or '.join(EXECUTOR_BACKENDS)}: tpserve's ranks are processes "
                        "(spawned, or torchrun's); ray is refused")
    g.add_argument("--tokenizer-mode", default="auto",
                   help=f"{' or '.join(TOKENIZER_MODES)}: transformers' (fast) tokenizer; "
                        "slow, mistral and custom are refused")
    g.add_argument("--guided-decoding-backend", "--structured-outputs-backend",
                   default="auto",
                   help=f"{' or '.join(STRUCTURED_BACKENDS)}: structured output runs on "
                        "xgrammar; other backends are refused")
    g.add_argument("--enable-log-requests", **VLLM_SWITCH,
                   help="log each request on submission: its prompt length and sampling "
                        "parameters at INFO, its prompt text and token ids at DEBUG (logger "
                        "tpserve.requests), beside the access log's line; conflicts with "
                        "--disable-log-requests")
    g.add_argument("--disable-frontend-multiprocessing", **VLLM_SWITCH,
                   help="the same as --no-engine-process: HTTP and the engine in one "
                        "process")
    g.add_argument("--task", default=None,
                   help=f"vLLM's older spelling of --runner: {', '.join(TASKS)} (embed: "
                        "--runner pooling)")
    g.add_argument("--convert", default=None,
                   help=f"{', '.join(CONVERTS)}: embed serves a decoder's pooled hidden "
                        "states (--runner pooling)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="at least --max-loras (checked): every adapter tpserve serves stays "
                        "in its device slot, so no CPU cache of more adapters is kept")
    g.add_argument("--lora-dtype", default="auto",
                   help="auto or the model's --dtype: the adapters are held in the model's "
                        "dtype (other values are refused)")
    g.add_argument("--fully-sharded-loras", **VLLM_SWITCH,
                   help="refused: tpserve shards each adapter like the weight it modifies "
                        "(column-parallel layers keep A whole)")
    for flag, (why, accepted) in REFUSED.items():
        names = (flag, "-O") if flag == "--compilation-config" else (flag,)
        g.add_argument(*names, nargs="?", const="", default=None, metavar="VALUE",
                       help=f"refused: {why}" + (f" ({flag} {accepted} is taken: it asks "
                                                 "for nothing)" if accepted else ""))
    g.add_argument("--reasoning-config", type=json_object, default=None, metavar="JSON",
                   help="vLLM's thinking tags for thinking_token_budget: taken when they "
                        "are the --reasoning-parser's own (<think> and </think>), which "
                        "tpserve uses without it; other tags are refused")
    g.add_argument("--enable-prompt-tokens-details", **VLLM_SWITCH,
                   help="changes nothing: every answer's usage has prompt_tokens_details "
                        "(its cached_tokens)")
    g.add_argument("--enable-server-load-tracking", **VLLM_SWITCH,
                   help="changes nothing: GET /load always counts the requests in flight")
    g.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="changes nothing: preempted sequences are recomputed, never swapped "
                        "to CPU memory (as in vLLM's V1 engine)")
    for flag, why in NO_OPS.items():
        g.add_argument(flag, nargs="?", const="", default=None, metavar="VALUE",
                       help=f"changes nothing: {why}")
    g.add_argument("--model-impl", default=None,
                   help=f"{' or '.join(MODEL_IMPLS)}: tpserve runs its own implementation of "
                        "each architecture (transformers' is refused)")
    g.add_argument("--data-parallel-size-local", type=int, default=None, metavar="N",
                   help="only --data-parallel-size: every replica runs on this host")
    g.add_argument("--disable-uvicorn-access-log", **VLLM_SWITCH,
                   help="the same as --disable-log-requests: no access-log line per request")
    g.add_argument("--rope-scaling", type=json_object, default=None, metavar="JSON",
                   help="vLLM's older spelling of --hf-overrides '{\"rope_scaling\": JSON}'")
    g.add_argument("--rope-theta", type=float, default=None,
                   help="vLLM's older spelling of --hf-overrides '{\"rope_theta\": X}'")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="one value: the same as --cuda-graph-max-tokens N (tpserve captures "
                        "its own step sizes up to it); a list of sizes is refused")
    g.add_argument("--structured-outputs-config", type=json_object, default=None,
                   metavar="JSON",
                   help="vLLM's structured-output settings: backend auto or xgrammar (as "
                        "--structured-outputs-backend), disable_any_whitespace true or "
                        "false (JSON output is always compact); the other keys only at "
                        "their defaults")


def apply_vllm_compat(a: argparse.Namespace) -> None:
    """Checks the compatibility flags and maps them onto tpserve's own (in ``a``);
    ValueError naming the flag for a value tpserve cannot honour."""
    for flag, (why, accepted) in REFUSED.items():
        value = getattr(a, flag.removeprefix("--").replace("-", "_"))
        if flag == "--limit-mm-per-prompt" and value is not None and _no_media(value):
            continue
        if value is not None and value != accepted:
            raise ValueError(f"{flag}{' ' + value if value else ''}: {why}")
    if not a.enable_chunked_prefill:
        raise ValueError("--no-enable-chunked-prefill: chunked prefill is always on "
                         "(--max-num-batched-tokens bounds a step)")
    if a.pipeline_parallel_size != 1:
        raise ValueError(f"--pipeline-parallel-size {a.pipeline_parallel_size}: pipeline "
                         "parallelism is not supported; use --tensor-parallel-size")
    _one_of("--distributed-executor-backend", a.distributed_executor_backend,
            EXECUTOR_BACKENDS, "ranks are spawned processes, or torchrun's")
    _one_of("--tokenizer-mode", a.tokenizer_mode, TOKENIZER_MODES,
            "tpserve uses transformers' tokenizer of the model (or --tokenizer)")
    if a.enable_log_requests and a.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each "
                         "other")
    if a.disable_frontend_multiprocessing:
        a.engine_process = False
    _one_of("--model-impl", a.model_impl, MODEL_IMPLS,
            "tpserve runs its own implementation of each architecture")
    local = a.data_parallel_size_local
    if local is not None and local != a.data_parallel_size:
        raise ValueError(f"--data-parallel-size-local {local}: multi-node data parallelism "
                         f"is not supported; every one of the --data-parallel-size "
                         f"{a.data_parallel_size} replicas runs on this host")
    if a.disable_uvicorn_access_log:
        a.disable_log_requests = True
    if a.structured_outputs_config is not None:
        a.guided_decoding_backend = _structured_outputs_config(a.structured_outputs_config,
                                                               a.guided_decoding_backend)
    _one_of("--guided-decoding-backend", a.guided_decoding_backend, STRUCTURED_BACKENDS,
            "structured output runs on xgrammar")
    if a.rope_scaling is not None or a.rope_theta is not None:
        a.hf_overrides = _rope_overrides(a.hf_overrides, a.rope_scaling, a.rope_theta)
    if a.cuda_graph_sizes is not None:
        if len(a.cuda_graph_sizes) != 1:
            raise ValueError(f"--cuda-graph-sizes {' '.join(map(str, a.cuda_graph_sizes))}: "
                             "tpserve captures its own step sizes; give the largest alone "
                             "(or --cuda-graph-max-tokens)")
        a.cuda_graph_max_tokens = a.cuda_graph_sizes[0]
    if a.reasoning_config is not None:
        _reasoning_config(a.reasoning_config, a.reasoning_parser)
    for flag, value, table in (("--task", a.task, TASKS), ("--convert", a.convert, CONVERTS)):
        _one_of(flag, value, tuple(table),
                "tpserve serves generation, embeddings or a sequence classifier")
        runner = table.get(value) if value is not None else None
        if runner is None:
            continue
        # checked against the checkpoint by config_from_args (``pooling_task``)
        a.pooling_task = "classify" if value in CLASSIFY_VALUES else "embed"
        if a.runner not in ("auto", runner):
            raise ValueError(f"{flag} {value} asks for --runner {runner}, but --runner is "
                             f"{a.runner}")
        a.runner = runner


def _no_media(value: str) -> bool:
    """Whether vLLM's ``--limit-mm-per-prompt`` JSON allows no item of any modality
    (``{"image": 0}``, or ``{"image": {"count": 0}}`` in vLLM's newer form): text only,
    what tpserve serves anyway."""
    try:
        limits = json.loads(value)
    except ValueError:
        return False
    if not isinstance(limits, dict):
        return False
    counts = [v.get("count") if isinstance(v, dict) else v for v in limits.values()]
    return all(type(c) is int and c == 0 for c in counts)


def _reasoning_config(cfg: dict[str, Any], parser: str | None) -> None:
    """Accepts vLLM's ``--reasoning-config`` when it names the tags tpserve's parsers use
    anyway (``thinking_token_budget`` counts between them); ValueError otherwise."""
    flag = "--reasoning-config"
    _known_keys(flag, cfg, tuple(REASONING_TAGS))
    for key, value in cfg.items():
        if value != REASONING_TAGS[key]:
            raise ValueError(f"{flag}: {key} {value!r} is not supported: tpserve's "
                             f"reasoning parsers mark the thinking with <think> and </think>")
    if parser is None:
        raise ValueError(f"{flag} needs --reasoning-parser (the tags of its thinking)")


def _structured_outputs_config(cfg: dict[str, Any], backend: str) -> str:
    """The backend vLLM's ``--structured-outputs-config`` names (default: ``backend``, the
    flag's); ValueError for a key tpserve does not take or a value outside
    ``STRUCTURED_TAKEN``'s."""
    flag = "--structured-outputs-config"
    _known_keys(flag, cfg, ("backend", *STRUCTURED_TAKEN))
    for key, taken in STRUCTURED_TAKEN.items():
        if key in cfg and cfg[key] not in taken:
            raise ValueError(f"{flag}: {key} {cfg[key]!r} is not supported (only "
                             f"{' or '.join(json.dumps(v) for v in taken)})")
    return cfg.get("backend", backend)


def _rope_overrides(overrides: str | None, scaling: dict[str, Any] | None,
                    theta: float | None) -> str:
    """``--hf-overrides`` with vLLM's older ``--rope-scaling`` / ``--rope-theta`` laid in;
    ValueError where --hf-overrides sets the same key."""
    merged = json.loads(canonical_overrides(overrides) or "{}")
    for key, value in (("rope_scaling", scaling), ("rope_theta", theta)):
        if value is None:
            continue
        if key in merged:
            raise ValueError(f"--{key.replace('_', '-')} and --hf-overrides both set {key}")
        merged[key] = value
    return json.dumps(merged)


def _known_keys(flag: str, cfg: dict[str, Any], accepted: tuple[str, ...]) -> None:
    """ValueError naming the keys of the JSON object ``cfg`` outside ``accepted``."""
    unknown = sorted(set(cfg) - set(accepted))
    if unknown:
        raise ValueError(f"{flag}: unknown or unsupported keys {unknown} (accepted: "
                         f"{', '.join(accepted)})")


def _one_of(flag: str, value: str | None, allowed: tuple[str, ...], why: str) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{flag} {value}: not supported ({why}); accepted: "
                         f"{', '.join(allowed)}")
