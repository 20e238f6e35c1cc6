"""vLLM command-line compatibility: flags a ``vllm serve`` command line carries that
tpserve takes as they are, because their only values here are the ones tpserve has
(``--trust-remote-code``, ``--tokenizer-mode auto``, ``--distributed-executor-backend
mp``, ...), or maps onto its own (``--disable-frontend-multiprocessing`` is
``--no-engine-process``). A value tpserve cannot honour is refused at start-up, naming the
flag and what to do instead, never ignored. tpserve's own spellings are in
``arguments.add_serve_arguments``; ``apply_vllm_compat`` runs first in ``config_from_args``."""

from __future__ import annotations

import argparse
from typing import Any

from tpserve.server.flag_types import json_object

TOKENIZER_MODES = ("auto", "hf")  # transformers' tokenizers; "slow"/"mistral": refused
EXECUTOR_BACKENDS = ("mp", "uni")  # ranks are processes (one at tp 1); "ray": refused
STRUCTURED_BACKENDS = ("auto", "xgrammar")  # the one grammar engine tpserve has
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
    "--limit-mm-per-prompt": ("tpserve serves text-only models", None),
    "--kv-transfer-config": ("disaggregated prefill (KV transfer between instances) is not "
                             "supported", None),
    "--tool-parser-plugin": ("tool-call parsers are built in (--tool-call-parser); plugin "
                             "files are not loaded", None),
}


def add_vllm_compat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "vLLM compatibility", "flags of `vllm serve` command lines, taken where their value is "
        "what tpserve does anyway (other values are refused with exit 2)")
    g.add_argument("--trust-remote-code", action="store_true",
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
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request on submission: its prompt length and sampling "
                        "parameters at INFO, its prompt text and token ids at DEBUG (logger "
                        "tpserve.requests), beside the access log's line; conflicts with "
                        "--disable-log-requests")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
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
    g.add_argument("--fully-sharded-loras", action="store_true",
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
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="changes nothing: every answer's usage has prompt_tokens_details "
                        "(its cached_tokens)")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="changes nothing: GET /load always counts the requests in flight")
    g.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="changes nothing: preempted sequences are recomputed, never swapped "
                        "to CPU memory (as in vLLM's V1 engine)")


def apply_vllm_compat(a: argparse.Namespace) -> None:
    """Checks the compatibility flags and maps them onto tpserve's own (in ``a``);
    ValueError naming the flag for a value tpserve cannot honour."""
    for flag, (why, accepted) in REFUSED.items():
        value = getattr(a, flag.removeprefix("--").replace("-", "_"))
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
    _one_of("--guided-decoding-backend", a.guided_decoding_backend, STRUCTURED_BACKENDS,
            "structured output runs on xgrammar")
    if a.enable_log_requests and a.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each "
                         "other")
    if a.disable_frontend_multiprocessing:
        a.engine_process = False
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


def _reasoning_config(cfg: dict[str, Any], parser: str | None) -> None:
    """Accepts vLLM's ``--reasoning-config`` when it names the tags tpserve's parsers use
    anyway (``thinking_token_budget`` counts between them); ValueError otherwise."""
    flag = "--reasoning-config"
    unknown = sorted(set(cfg) - set(REASONING_TAGS))
    if unknown:
        raise ValueError(f"{flag}: unknown or unsupported keys {unknown} (accepted: "
                         f"{', '.join(REASONING_TAGS)})")
    for key, value in cfg.items():
        if value != REASONING_TAGS[key]:
            raise ValueError(f"{flag}: {key} {value!r} is not supported: tpserve's "
                             f"reasoning parsers mark the thinking with <think> and </think>")
    if parser is None:
        raise ValueError(f"{flag} needs --reasoning-parser (the tags of its thinking)")


def _one_of(flag: str, value: str | None, allowed: tuple[str, ...], why: str) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{flag} {value}: not supported ({why}); accepted: "
                         f"{', '.join(allowed)}")
