"""Command-line flags of ``tpserve loadtest`` and the frozen, validated config built from them."""

from __future__ import annotations

import argparse
import datetime
import math
import os
from dataclasses import dataclass
from pathlib import Path

from tpserve.loadtest.goodput import parse_goodput
from tpserve.loadtest.result_header import BACKEND_OF_ENDPOINT, parse_metadata

ENDPOINTS = ("completions", "chat", "embeddings")
# vLLM's spellings of the request kind: --endpoint as a path, and --backend.
ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                  "/v1/embeddings": "embeddings"}
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat",
            "openai-embeddings": "embeddings"}
# vLLM's --dataset-name values this load test knows, and the older names kept as aliases.
DATASETS = ("random", "sharegpt", "prefix-repetition", "custom")
DATASET_ALIASES = {"shared-prefix": "prefix-repetition", "prefix": "prefix-repetition",
                   "file": "custom"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PREFIX_LEN = 256  # --dataset-name prefix-repetition without --random-prefix-len
DEFAULT_OUTPUT_LEN = 128  # --random-output-len when not given
DEFAULT_TEMPERATURE = 0.0  # --temperature when not given: greedy, as vLLM's bench serve
# --percentile-metrics when not given: vLLM's defaults for generation and for pooling
DEFAULT_PERCENTILE_METRICS = {"generation": ("ttft", "tpot", "itl"), "embeddings": ("e2el",)}
# Parameters of generation only: refused with --endpoint embeddings when given, and left
# out of an embeddings result.
GENERATION_PARAMETERS = ("random_output_len", "sharegpt_output_len", "ignore_eos",
                         "temperature")


class ConfigError(ValueError):
    """A flag value that cannot work; the message says which flag and why."""


@dataclass(frozen=True)
class LoadtestConfig:
    """Everything one ``tpserve loadtest`` invocation needs, validated once.

    ``request_rates`` holds one rate per run: the single ``--request-rate`` or the
    ``--sweep-rates`` list (``math.inf`` = send everything at once). ``dataset`` is
    a canonical name of DATASETS; ``prefix_len`` > 0 gives every prompt the same
    prefix (the prefix-repetition dataset, or random with ``--random-prefix-len``).
    ``percentile_metrics`` and ``metric_percentiles`` choose the ``p{N}_{metric}_ms``
    keys and table rows, as vLLM's ``--percentile-metrics``/``--metric-percentiles``.

    With ``endpoint`` "embeddings" (vLLM's ``--backend openai-embeddings``) nothing is
    generated: the generation parameters (GENERATION_PARAMETERS) keep their defaults and
    are not used, and the only latency is the end-to-end one (e2el).
    """

    base_url: str
    model: str | None
    endpoint: str
    backend: str
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
    num_prefixes: int
    dataset_path: Path | None
    sharegpt_output_len: int | None
    ignore_eos: bool
    temperature: float
    seed: int
    num_warmups: int
    api_key: str | None
    result_file: Path | None
    timeout: float
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    goodput: dict[str, float] | None
    label: str | None
    metadata: tuple[tuple[str, str], ...]
    plot: bool
    progress: bool

    @property
    def embeddings(self) -> bool:
        """The requests are /v1/embeddings ones, which generate nothing."""
        return self.endpoint == "embeddings"

    @property
    def plot_file(self) -> Path | None:
        """The PNG written beside the JSON result: same folder, same stem."""
        if self.result_file is None or not self.plot:
            return None
        return self.result_file.with_suffix(".png")

    def parameters(self) -> dict:
        """The run's parameters as stored in the JSON result (never the API key); an
        embeddings run leaves out the parameters of generation."""
        parameters = {
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
            "prefix_len": self.prefix_len,
            "num_prefixes": self.num_prefixes,
            "sharegpt_output_len": self.sharegpt_output_len,
            "percentile_metrics": ",".join(self.percentile_metrics),
            "metric_percentiles": ",".join(f"{p:g}" for p in self.metric_percentiles),
            "goodput": None if self.goodput is None else dict(self.goodput),
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "seed": self.seed,
            "num_warmups": self.num_warmups,
            "timeout": self.timeout,
        }
        if self.embeddings:
            for name in GENERATION_PARAMETERS:
                del parameters[name]
        return parameters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tpserve loadtest`` flags to ``parser``."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, without /v1 (default: %(default)s)")
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    server.add_argument("--endpoint", type=_endpoint, default=None,
                        metavar="{" + ",".join(ENDPOINTS) + "}",
                        help="/v1/completions, /v1/chat/completions, or /v1/embeddings (a "
                             "--runner pooling server; vLLM's --backend openai-embeddings): "
                             "one non-streaming request per prompt, measured end to end, "
                             "without the flags of generation; the path itself is accepted "
                             "too, as vLLM's --endpoint (default: completions)")
    server.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                        help="vLLM's name of the request kind: openai (or vllm) = "
                             "--endpoint completions, openai-chat = chat, "
                             "openai-embeddings = embeddings")
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
    names = (*DATASETS, *DATASET_ALIASES)
    data.add_argument("--dataset-name", dest="dataset", choices=names, default="random",
                      metavar="{" + ",".join(DATASETS) + "}",
                      help="random words; a ShareGPT JSON file (--dataset-path); a shared "
                           "prefix plus random words (also: shared-prefix); or a JSONL file "
                           "of prompts (--dataset-path) (default: %(default)s)")
    data.add_argument("--dataset", dest="dataset", choices=names, default=argparse.SUPPRESS,
                      help=argparse.SUPPRESS)  # the old name of --dataset-name
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens (after the prefix, if any) (default: %(default)s)")
    data.add_argument("--input-len", dest="random_input_len", type=int,
                      default=argparse.SUPPRESS,
                      help="vLLM's general name: the same as --random-input-len")
    data.add_argument("--random-output-len", type=int, default=None,
                      help="max_tokens of each request; also the default for file "
                           f"prompts without output_len (default: {DEFAULT_OUTPUT_LEN})")
    data.add_argument("--output-len", dest="random_output_len", type=int,
                      default=argparse.SUPPRESS,
                      help="vLLM's general name: the same as --random-output-len")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="input and output lengths are drawn uniformly from "
                           "[len*(1-r), len*(1+r)] (default: %(default)s)")
    data.add_argument("--random-prefix-len", dest="prefix_len", type=int, default=None,
                      help="tokens of the prefix every prompt starts with (default: "
                           f"{DEFAULT_PREFIX_LEN} for prefix-repetition, 0 for random)")
    data.add_argument("--prefix-len", dest="prefix_len", type=int, default=argparse.SUPPRESS,
                      help=argparse.SUPPRESS)  # the old name of --random-prefix-len
    data.add_argument("--prefix-repetition-num-prefixes", dest="num_prefixes", type=int,
                      default=1,
                      help="prefix-repetition: how many different prefixes the prompts "
                           "share out, in a shuffled order (vLLM's flag; default: "
                           "%(default)s); more prefix tokens than the server's KV cache "
                           "holds measure what its prefix cache keeps")
    # vLLM's names of the prefix-repetition lengths
    data.add_argument("--prefix-repetition-prefix-len", dest="prefix_len", type=int,
                      default=argparse.SUPPRESS, help="the same as --random-prefix-len")
    data.add_argument("--prefix-repetition-suffix-len", dest="random_input_len", type=int,
                      default=argparse.SUPPRESS, help="the same as --random-input-len")
    data.add_argument("--prefix-repetition-output-len", dest="random_output_len", type=int,
                      default=argparse.SUPPRESS, help="the same as --random-output-len")
    data.add_argument("--dataset-path", type=Path, default=None,
                      help="sharegpt: a ShareGPT JSON file (a list of {\"conversations\": "
                           "[{\"from\": \"human\", ...}, {\"from\": \"gpt\", ...}]}); "
                           'custom: JSONL, one {"prompt": ..., "output_len": ...} a line, '
                           "output_len optional")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="max_tokens of every ShareGPT request (default: the token count "
                           "of the conversation's first gpt answer)")
    data.add_argument("--ignore-eos", action="store_true",
                      help="ask the server to generate max_tokens whatever the model says "
                           "(vLLM's ignore_eos extension)")
    data.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature sent with every request (default: "
                           f"{DEFAULT_TEMPERATURE}, greedy, as vLLM's bench serve)")

    out = parser.add_argument_group("output")
    out.add_argument("--save-result", action="store_true",
                     help="write the JSON result (--result-dir/--result-filename) and a PNG "
                          "with the same stem beside it")
    out.add_argument("--result-dir", type=Path, default=None,
                     help="folder of the result file (default: the current folder)")
    out.add_argument("--result-filename", default=None,
                     help="name of the result file (default: tpserve-{rate}qps"
                          "[-concurrency{N}][-{model}]-{YYYYmmdd-HHMMSS}.json, as vLLM's)")
    out.add_argument("--result-file", type=Path, default=None,
                     help=argparse.SUPPRESS)  # the old flag: the whole path, implies saving
    out.add_argument("--percentile-metrics", type=_metric_list, default=None,
                     help="comma-separated metrics of ttft,tpot,itl,e2el whose percentiles "
                          "are reported; only e2el for --endpoint embeddings (default: "
                          "ttft,tpot,itl; e2el for embeddings)")
    out.add_argument("--metric-percentiles", type=_percentile_list, default="99",
                     help="comma-separated percentiles reported for those metrics, e.g. "
                          "25,50,99 (default: %(default)s)")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE",
                     help="service level objectives, as vLLM's: ttft, tpot, e2el in "
                          "milliseconds, e.g. --goodput ttft:500 tpot:50; a request that "
                          "meets all of them is good, and request_goodput (good requests "
                          "per second) is reported")
    out.add_argument("--label", default=None,
                     help="free text stored in the JSON and shown in the plot title")
    out.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                     help="pairs stored as keys of the JSON result, as vLLM's, e.g. "
                          "--metadata gpu=H200 tp=2")
    out.add_argument("--no-plot", dest="plot", action="store_false",
                     help="write only the JSON result, no PNG")
    out.add_argument("--no-progress", "--disable-tqdm", dest="progress",
                     action="store_false",
                     help="hide the progress bar (--disable-tqdm: vLLM's name)")


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
    endpoint = _resolve_endpoint(args.endpoint, args.backend)
    embeddings = endpoint == "embeddings"
    if embeddings:
        _refuse_generation_flags(args)
    output_len = DEFAULT_OUTPUT_LEN if args.random_output_len is None else args.random_output_len
    need(output_len >= 1, "--random-output-len must be at least 1")
    if args.percentile_metrics is None:
        metrics = DEFAULT_PERCENTILE_METRICS["embeddings" if embeddings else "generation"]
    else:
        metrics = _as_metrics(args.percentile_metrics)
    need(not embeddings or metrics == ("e2el",),
         "--percentile-metrics can only be e2el with --endpoint embeddings: an embedding "
         "comes in one piece, so there is no TTFT, TPOT or ITL to measure")
    need(0.0 <= args.random_range_ratio < 1.0, "--random-range-ratio must be in [0, 1)")
    need(args.num_warmups >= 0, "--num-warmups must be 0 or more")
    need(args.timeout > 0, "--timeout must be positive")
    dataset = DATASET_ALIASES.get(args.dataset, args.dataset)
    prefix_len = args.prefix_len
    if prefix_len is None:
        prefix_len = DEFAULT_PREFIX_LEN if dataset == "prefix-repetition" else 0
    need(prefix_len >= 0, "--random-prefix-len must be 0 or more")
    if dataset == "prefix-repetition":
        need(prefix_len >= 1,
             "--random-prefix-len must be at least 1 with --dataset-name prefix-repetition")
    need(args.num_prefixes >= 1, "--prefix-repetition-num-prefixes must be at least 1")
    need(args.num_prefixes == 1 or prefix_len >= 1,
         "--prefix-repetition-num-prefixes needs a prefix: --dataset-name prefix-repetition "
         "or --random-prefix-len")
    if dataset in ("sharegpt", "custom"):
        need(args.dataset_path is not None, f"--dataset-name {dataset} needs --dataset-path")
        need(args.dataset_path.is_file(), f"--dataset-path {args.dataset_path} is not a file")
    else:
        need(args.dataset_path is None,
             "--dataset-path needs --dataset-name sharegpt or custom")
    need(args.sharegpt_output_len is None or args.sharegpt_output_len >= 1,
         "--sharegpt-output-len must be at least 1")
    sweep = args.sweep_rates is not None
    rates = tuple(args.sweep_rates) if sweep else (args.request_rate,)
    result_file = args.result_file
    if result_file is None and args.save_result:
        name = args.result_filename or default_result_filename(
            "sweep" if sweep else _rate_text(rates[0]), args.max_concurrency, args.model)
        result_file = (args.result_dir or Path(".")) / name
    if result_file is not None:
        need(result_file.suffix != ".png",
             "the result file is the JSON file; the PNG is written beside it")
    else:
        need(args.result_dir is None and args.result_filename is None,
             "--result-dir and --result-filename need --save-result")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    return LoadtestConfig(
        base_url=base_url,
        model=args.model,
        endpoint=endpoint,
        backend=args.backend or BACKEND_OF_ENDPOINT[endpoint],
        num_prompts=args.num_prompts,
        request_rates=rates,
        sweep=sweep,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        dataset=dataset,
        random_input_len=args.random_input_len,
        random_output_len=output_len,
        random_range_ratio=args.random_range_ratio,
        prefix_len=prefix_len,
        num_prefixes=args.num_prefixes,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
        ignore_eos=args.ignore_eos,
        temperature=DEFAULT_TEMPERATURE if args.temperature is None else args.temperature,
        seed=args.seed,
        num_warmups=args.num_warmups,
        api_key=api_key,
        result_file=result_file,
        timeout=args.timeout,
        percentile_metrics=metrics,
        metric_percentiles=_as_percentiles(args.metric_percentiles),
        goodput=_parsed(parse_goodput, args.goodput, embeddings),
        label=args.label,
        metadata=_parsed(parse_metadata, args.metadata),
        plot=args.plot,
        progress=args.progress,
    )


def _endpoint(text: str) -> str:
    """--endpoint: a name of ENDPOINTS or its path (vLLM's spelling)."""
    name = ENDPOINT_PATHS.get(text.rstrip("/") if text.startswith("/") else text, text)
    if name not in ENDPOINTS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(ENDPOINTS)} or {', '.join(ENDPOINT_PATHS)}, "
            f"got {text!r}")
    return name


def _parsed(parse, *args):
    """A flag's value through its parser (--goodput's, --metadata's); its ValueError a
    ConfigError."""
    try:
        return parse(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _resolve_endpoint(endpoint: str | None, backend: str | None) -> str:
    """The request kind of --endpoint and --backend; ConfigError when they disagree."""
    implied = BACKENDS[backend] if backend is not None else None
    if endpoint is not None and implied is not None and endpoint != implied:
        raise ConfigError(f"--backend {backend} sends {implied} requests, but --endpoint "
                          f"says {endpoint}")
    return endpoint or implied or "completions"


def _refuse_generation_flags(args: argparse.Namespace) -> None:
    """ConfigError naming every flag of generation given with --endpoint embeddings."""
    given = [flag for flag, value in (("--random-output-len", args.random_output_len),
                                      ("--sharegpt-output-len", args.sharegpt_output_len),
                                      ("--temperature", args.temperature))
             if value is not None]
    if args.ignore_eos:
        given.append("--ignore-eos")
    if given:
        raise ConfigError(
            f"{', '.join(given)} cannot be used with --endpoint embeddings: an embeddings "
            "request generates no tokens")


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


def default_result_filename(rate: str, max_concurrency: int | None, model: str | None) -> str:
    """vLLM's default result name: {backend}-{rate}qps[-concurrency{N}][-{model}]-{date}.json."""
    parts = [f"tpserve-{rate}qps"]
    if max_concurrency is not None:
        parts.append(f"concurrency{max_concurrency}")
    if model:
        parts.append(model.rstrip("/").split("/")[-1])
    parts.append(datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return "-".join(parts) + ".json"


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _metric_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(PERCENTILE_METRICS)}, got {text!r}")
    return names


def _percentile_list(text: str) -> tuple[float, ...]:
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part!r}") from None
        if not 0 < value <= 100:
            raise argparse.ArgumentTypeError(f"a percentile must be in (0, 100], got {part!r}")
        values.append(value)
    return tuple(dict.fromkeys(values))


def _as_metrics(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """argparse does not run ``type`` on a non-string default passed as given: accept both."""
    return _metric_list(value) if isinstance(value, str) else value


def _as_percentiles(value: str | tuple[float, ...]) -> tuple[float, ...]:
    return _percentile_list(value) if isinstance(value, str) else value
