"""Command-line flags of ``tpserve loadtest`` and the frozen, validated config built from them."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

ENDPOINTS = ("completions", "chat")
DATASETS = ("random", "prefix", "file")


class ConfigError(ValueError):
    """A flag value that cannot work; the message says which flag and why."""


@dataclass(frozen=True)
class LoadtestConfig:
    """Everything one ``tpserve loadtest`` invocation needs, validated once.

    ``request_rates`` holds one rate per run: the single ``--request-rate`` or the
    ``--sweep-rates`` list (``math.inf`` = send everything at once).
    """

    base_url: str
    model: str | None
    endpoint: str
    num_prompts: int
    request_rates: tuple[float, ...]
    sweep: bool
    burstiness: float
    max_concurrency: int | None
    dataset: str
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    prefix_len: int
    dataset_path: Path | None
    ignore_eos: bool
    temperature: float
    seed: int
    num_warmups: int
    api_key: str | None
    result_file: Path | None
    timeout: float
    label: str | None
    plot: bool
    progress: bool

    @property
    def plot_file(self) -> Path | None:
        """The PNG written beside the JSON result: same folder, same stem."""
        if self.result_file is None or not self.plot:
            return None
        return self.result_file.with_suffix(".png")

    def parameters(self) -> dict:
        """The run's parameters as stored in the JSON result (never the API key)."""
        return {
            "label": self.label,
            "base_url": self.base_url,
            "endpoint": self.endpoint,
            "dataset": self.dataset,
            "dataset_path": None if self.dataset_path is None else str(self.dataset_path),
            "num_prompts": self.num_prompts,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "random_input_len": self.random_input_len,
            "random_output_len": self.random_output_len,
            "random_range_ratio": self.random_range_ratio,
            "prefix_len": self.prefix_len if self.dataset == "prefix" else 0,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "seed": self.seed,
            "num_warmups": self.num_warmups,
            "timeout": self.timeout,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tpserve loadtest`` flags to ``parser``."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, without /v1 (default: %(default)s)")
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    server.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                        help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    server.add_argument("--api-key", default=None,
                        help="bearer token (default: the OPENAI_API_KEY environment variable)")
    server.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take in all before it counts as "
                             "failed (default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100,
                      help="requests per run (default: %(default)s)")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="mean requests per second; inf sends them all at once "
                           "(default: inf)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the gamma-distributed inter-arrival times (mean "
                           "1/rate): 1 is Poisson, <1 burstier, >1 more regular "
                           "(default: %(default)s)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (default: no limit)")
    load.add_argument("--sweep-rates", type=_rate_list, default=None,
                      help="comma-separated request rates to run one after another, e.g. "
                           "1,2,4,inf; replaces --request-rate")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests sent and discarded before each run (default: 0)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of prompts and arrival times (default: %(default)s)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random",
                      help="random words; a shared prefix plus random words; or a JSONL "
                           "file (default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens (after the prefix for --dataset prefix) "
                           "(default: %(default)s)")
    data.add_argument("--random-output-len", type=int, default=128,
                      help="max_tokens of each request; also the default for file "
                           "prompts without output_len (default: %(default)s)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="input and output lengths are drawn uniformly from "
                           "[len*(1-r), len*(1+r)] (default: %(default)s)")
    data.add_argument("--prefix-len", type=int, default=256,
                      help="tokens of the prefix every prompt of --dataset prefix starts "
                           "with (default: %(default)s)")
    data.add_argument("--dataset-path", type=Path, default=None,
                      help='JSONL file for --dataset file: one {"prompt": ..., '
                           '"output_len": ...} object a line, output_len optional')
    data.add_argument("--ignore-eos", action="store_true",
                      help="ask the server to generate max_tokens whatever the model says "
                           "(vLLM's ignore_eos extension)")
    data.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature sent with every request (default: "
                           "%(default)s, greedy, as vLLM's bench serve)")

    out = parser.add_argument_group("output")
    out.add_argument("--result-file", type=Path, default=None,
                     help="write the JSON result here and a PNG with the same stem beside it")
    out.add_argument("--label", default=None,
                     help="free text stored in the JSON and shown in the plot title")
    out.add_argument("--no-plot", dest="plot", action="store_false",
                     help="write only the JSON result, no PNG")
    out.add_argument("--no-progress", dest="progress", action="store_false",
                     help="hide the progress bar")


def config_from_args(args: argparse.Namespace) -> LoadtestConfig:
    """Validate the parsed flags; raise ConfigError naming the first bad one."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    base_url = args.base_url.rstrip("/")
    base_url = base_url.removesuffix("/v1").rstrip("/")
    need(base_url.startswith(("http://", "https://")),
         f"--base-url must start with http:// or https://, got {args.base_url!r}")
    need(args.num_prompts >= 1, "--num-prompts must be at least 1")
    need(args.burstiness > 0 and math.isfinite(args.burstiness),
         "--burstiness must be a positive number")
    need(args.max_concurrency is None or args.max_concurrency >= 1,
         "--max-concurrency must be at least 1")
    need(args.random_input_len >= 1, "--random-input-len must be at least 1")
    need(args.random_output_len >= 1, "--random-output-len must be at least 1")
    need(0.0 <= args.random_range_ratio < 1.0, "--random-range-ratio must be in [0, 1)")
    need(args.num_warmups >= 0, "--num-warmups must be 0 or more")
    need(args.timeout > 0, "--timeout must be positive")
    if args.dataset == "prefix":
        need(args.prefix_len >= 1, "--prefix-len must be at least 1 with --dataset prefix")
    if args.dataset == "file":
        need(args.dataset_path is not None, "--dataset file needs --dataset-path")
        need(args.dataset_path.is_file(), f"--dataset-path {args.dataset_path} is not a file")
    else:
        need(args.dataset_path is None, "--dataset-path needs --dataset file")
    if args.result_file is not None:
        need(args.result_file.suffix != ".png",
             "--result-file names the JSON file; the PNG is written beside it")
    sweep = args.sweep_rates is not None
    rates = tuple(args.sweep_rates) if sweep else (args.request_rate,)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    return LoadtestConfig(
        base_url=base_url,
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        request_rates=rates,
        sweep=sweep,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        dataset=args.dataset,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len,
        dataset_path=args.dataset_path,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        num_warmups=args.num_warmups,
        api_key=api_key,
        result_file=args.result_file,
        timeout=args.timeout,
        label=args.label,
        plot=args.plot,
        progress=args.progress,
    )


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be positive, got {text!r}")
    return value


def _rate_list(text: str) -> list[float]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--sweep-rates needs at least one rate")
    return [_rate(p) for p in parts]
