"""The ``tpserve soak`` flags, and ``SoakConfig``: the flags validated once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpserve.loadtest.session import SetupError
from tpserve.loadtest.soak.memory import read_rss_mib
from tpserve.loadtest.soak.plans import MAX_OUTPUT_TOKENS, MAX_PROMPT_WORDS


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tpserve soak`` flags to ``parser``."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, without /v1 (default: %(default)s)")
    server.add_argument("--api-key", default=None,
                        help="bearer token (default: the OPENAI_API_KEY environment variable)")
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    server.add_argument("--server-pid", type=int, default=None,
                        help="pid of the server's root process on this machine; the VmRSS of "
                             "it and all its descendants (engine process, workers), and their "
                             "GPU memory where NVML is available, is read after the warm-up "
                             "and after the soak (default: not checked)")

    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=2000,
                      help="requests of the soak, after the warm-up (default: %(default)s)")
    load.add_argument("--concurrency", type=int, default=32,
                      help="requests in flight at once (default: %(default)s)")
    load.add_argument("--warmup-requests", type=int, default=50,
                      help="requests of the same mix sent before the RSS baseline is read "
                           "(default: %(default)s)")
    load.add_argument("--max-tokens", type=int, default=MAX_OUTPUT_TOKENS,
                      help="max_tokens of each request is drawn from 1..this "
                           "(default: %(default)s)")
    load.add_argument("--max-prompt-words", type=int, default=MAX_PROMPT_WORDS,
                      help="each prompt has 1..this random words, about one token each "
                           "(default: %(default)s)")
    load.add_argument("--abort-fraction", type=float, default=0.2,
                      help="fraction of requests the client aborts at a random moment "
                           "(default: %(default)s)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the request mix (default: %(default)s)")

    checks = parser.add_argument_group("checks")
    checks.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds one request may take before it counts as hung "
                             "(default: %(default)s)")
    checks.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds to wait, after the last request, for /metrics to show "
                             "an idle server and a free KV pool (default: %(default)s)")
    checks.add_argument("--max-rss-growth-mib", type=float, default=200.0,
                        help="largest allowed growth of the server's RSS (summed over its "
                             "process tree) over the soak, in MiB (with --server-pid) "
                             "(default: %(default)s)")

    out = parser.add_argument_group("output")
    out.add_argument("--result-file", type=Path, default=None,
                     help="write the JSON result here")
    out.add_argument("--no-progress", dest="progress", action="store_false",
                     help="do not print progress lines")


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    api_key: str | None
    model: str | None
    server_pid: int | None
    num_requests: int
    concurrency: int
    warmup_requests: int
    max_tokens: int
    max_prompt_words: int
    abort_fraction: float
    seed: int
    request_timeout: float
    drain_timeout: float
    max_rss_growth_mib: float
    result_file: Path | None
    progress: bool

    def parameters(self) -> dict[str, Any]:
        """The flags as stored in the JSON result (never the API key)."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "server_pid": self.server_pid,
            "num_requests": self.num_requests,
            "concurrency": self.concurrency,
            "warmup_requests": self.warmup_requests,
            "max_tokens": self.max_tokens,
            "max_prompt_words": self.max_prompt_words,
            "abort_fraction": self.abort_fraction,
            "seed": self.seed,
            "request_timeout": self.request_timeout,
            "drain_timeout": self.drain_timeout,
            "max_rss_growth_mib": self.max_rss_growth_mib,
        }


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """Validate the parsed flags; raise SetupError naming the first bad one."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SetupError(message)

    base_url = args.base_url.rstrip("/").removesuffix("/v1").rstrip("/")
    need(base_url.startswith(("http://", "https://")),
         f"--base-url must start with http:// or https://, got {args.base_url!r}")
    need(args.num_requests >= 1, "--num-requests must be at least 1")
    need(args.concurrency >= 1, "--concurrency must be at least 1")
    need(args.warmup_requests >= 0, "--warmup-requests must be 0 or more")
    need(args.max_tokens >= 1, "--max-tokens must be at least 1")
    need(args.max_prompt_words >= 1, "--max-prompt-words must be at least 1")
    need(0.0 <= args.abort_fraction <= 1.0, "--abort-fraction must be in [0, 1]")
    need(args.request_timeout > 0, "--request-timeout must be positive")
    need(args.drain_timeout > 0, "--drain-timeout must be positive")
    need(args.max_rss_growth_mib > 0, "--max-rss-growth-mib must be positive")
    if args.server_pid is not None:
        try:
            read_rss_mib(args.server_pid)
        except (OSError, ValueError) as e:
            raise SetupError(f"--server-pid {args.server_pid}: cannot read its VmRSS "
                             f"({e})") from None
    if args.result_file is not None:
        folder = args.result_file.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SetupError(f"--result-file {args.result_file}: cannot create its folder "
                             f"({e})") from None
        need(os.access(folder, os.W_OK), f"--result-file: folder {folder} is not writable")
    return SoakConfig(
        base_url=base_url,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        model=args.model,
        server_pid=args.server_pid,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        warmup_requests=args.warmup_requests,
        max_tokens=args.max_tokens,
        max_prompt_words=args.max_prompt_words,
        abort_fraction=args.abort_fraction,
        seed=args.seed,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        max_rss_growth_mib=args.max_rss_growth_mib,
        result_file=args.result_file,
        progress=args.progress,
    )
