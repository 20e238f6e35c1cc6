"""The whole soak: warm-up, baseline, the load, then the checks; ``soak_main`` and ``main``
(the ``tpserve soak`` and ``python -m tpserve.loadtest.soak`` entry points)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from tpserve.loadtest.session import SetupError, resolve_model
from tpserve.loadtest.soak.flags import SoakConfig, add_soak_arguments, config_from_args
from tpserve.loadtest.soak.memory import compare, read_tree
from tpserve.loadtest.soak.outcomes import FAILED, Outcome
from tpserve.loadtest.soak.plans import make_plans
from tpserve.loadtest.soak.report import format_summary, tally
from tpserve.loadtest.soak.sender import SoakSender, run_plans
from tpserve.loadtest.soak.server_state import health_status, wait_until_idle

EXIT_OK, EXIT_FAILED, EXIT_SETUP = 0, 1, 2
CONNECT_TIMEOUT_S = 30.0


def _log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def _progress(label: str, total: int, enabled: bool) -> Callable[[int], None] | None:
    if not enabled:
        return None
    step = max(1, total // 10)

    def report(done: int) -> None:
        if done % step == 0 or done == total:
            _log(f"{label}: {done}/{total} requests ended")

    return report


async def run_soak(config: SoakConfig) -> dict[str, Any]:
    """The whole soak; returns the JSON document (``passed`` says whether every check held)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout,
                            connect=min(config.request_timeout, CONNECT_TIMEOUT_S))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = config.model or await resolve_model(client, config.base_url)
        sender = SoakSender(client, config.base_url, model, config.request_timeout)
        rng = np.random.default_rng(config.seed)
        sizes = {"max_tokens": config.max_tokens, "max_prompt_words": config.max_prompt_words}
        warm_plans = make_plans(rng, config.warmup_requests, config.abort_fraction, **sizes)
        plans = make_plans(rng, config.num_requests, config.abort_fraction,
                           first_index=config.warmup_requests, **sizes)
        started = time.monotonic()

        warm_outcomes: list[Outcome] = []
        if warm_plans:
            _log(f"model {model!r}: {len(warm_plans)} warm-up requests")
            warm_outcomes = await run_plans(sender, warm_plans, config.concurrency)
        warm_idle = await wait_until_idle(client, config.base_url, config.drain_timeout)
        before = None if config.server_pid is None else read_tree(config.server_pid)

        _log(f"{len(plans)} requests, {config.concurrency} in flight")
        outcomes = await run_plans(sender, plans, config.concurrency,
                                   _progress("soak", len(plans), config.progress))
        duration = time.monotonic() - started
        pool = await wait_until_idle(client, config.base_url, config.drain_timeout)
        health = await health_status(client, config.base_url)
        after = None if config.server_pid is None else read_tree(config.server_pid)

    counts = tally(plans, outcomes)
    warm_counts = tally(warm_plans, warm_outcomes)
    rss = None
    if before is not None and after is not None:
        rss = compare(config.server_pid, before, after, config.max_rss_growth_mib)
    checks = {
        "outcomes": counts[FAILED] == 0 and warm_counts[FAILED] == 0,
        "pool_free": bool(pool["ok"]),
        "healthy": health == 200,
        "rss": None if rss is None else rss["ok"],
    }
    return {
        **config.parameters(),
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(duration, 2),
        "counts": counts,
        "warmup": {**warm_counts, "pool_after": warm_idle},
        "pool": pool,
        "health_status": health,
        "rss": rss,
        "checks": checks,
        "passed": all(v is not False for v in checks.values()),
    }




def soak_main(args: argparse.Namespace) -> int:
    """Run ``tpserve soak`` with parsed flags; returns the exit status."""
    try:
        config = config_from_args(args)
        doc = asyncio.run(run_soak(config))
    except SetupError as e:
        print(f"tpserve soak: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print("tpserve soak: interrupted; nothing written", file=sys.stderr)
        return 130
    print(format_summary(doc))
    if config.result_file is not None:
        config.result_file.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"Result written to {config.result_file}")
    return EXIT_OK if doc["passed"] else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """``python -m tpserve.loadtest.soak``: the same as ``tpserve soak``."""
    parser = argparse.ArgumentParser(
        prog="tpserve soak",
        description="Soak-test a server with mixed and aborted requests, then check that it "
                    "is idle with a free KV pool and no runaway memory growth.")
    add_soak_arguments(parser)
    return soak_main(parser.parse_args(argv))
