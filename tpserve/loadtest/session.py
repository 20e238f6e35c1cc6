"""A whole load test: find the model and tokenizer, build prompts, warm up, run each rate.

Each rate of a sweep gets fresh prompts (seed + rate index), so that a server's prefix
cache filled by one rate does not flatter the next. Warm-up requests use extra prompts
of the same dataset and are not measured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from dataclasses import dataclass

import httpx

from tpserve.loadtest.args import LoadtestConfig
from tpserve.loadtest.client import RequestSender, Sender
from tpserve.loadtest.datasets import (
    PromptSpec,
    file_dataset,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)
from tpserve.loadtest.embeddings_client import EmbeddingsSender
from tpserve.loadtest.interrupt import Interrupted, unless_stopped
from tpserve.loadtest.runner import RunRecord, run_once
from tpserve.loadtest.token_count import TokenCounter, choose_counter

CONNECT_TIMEOUT_S = 30.0


class SetupError(Exception):
    """The load test cannot start: server not reachable, no model, bad dataset."""


@dataclass(frozen=True)
class Session:
    """What a load test measured: one RunRecord per rate that ran (maybe none)."""

    model: str | None
    tokenizer: str | None
    tokenizer_id: str | None  # vLLM's: the served model's, when its /tokenize counted
    records: tuple[RunRecord, ...]
    interrupted: bool


def make_client(config: LoadtestConfig) -> httpx.AsyncClient:
    """One pooled client for the whole test; no connection limit, so that the
    concurrency is the load test's, not the pool's."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(config.timeout, connect=min(config.timeout, CONNECT_TIMEOUT_S)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET /v1/models."""
    url = f"{base_url}/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SetupError(f"cannot get the model name from {url} ({type(e).__name__}: {e}); "
                         "is the server up? Or pass --model") from None


async def build_prompts(
    config: LoadtestConfig, counter: TokenCounter, n: int, seed: int
) -> list[PromptSpec]:
    """n prompts of the configured dataset."""
    if config.dataset == "custom":
        assert config.dataset_path is not None
        specs = file_dataset(config.dataset_path, n, config.random_output_len)
        return await _with_counted_lengths(counter, specs)
    if config.dataset == "sharegpt":
        assert config.dataset_path is not None
        return await sharegpt_dataset(counter, config.dataset_path, n,
                                      config.sharegpt_output_len, seed)
    if config.prefix_len > 0:
        return await prefix_dataset(counter, n, config.prefix_len, config.random_input_len,
                                    config.random_output_len, config.random_range_ratio, seed,
                                    config.num_prefixes)
    return await random_dataset(counter, n, config.random_input_len, config.random_output_len,
                                config.random_range_ratio, seed)


async def _with_counted_lengths(counter: TokenCounter, specs: list[PromptSpec]
                                ) -> list[PromptSpec]:
    """specs with target_input_len set to the counter's count of each prompt (once per
    distinct prompt): the input tokens of a request whose stream has no usage. A prompt
    the server will not tokenize (too long, say) keeps None: its request tells."""
    lengths: dict[str, int | None] = {}
    for spec in specs:
        if spec.prompt not in lengths:
            try:
                lengths[spec.prompt] = await counter.count(spec.prompt)
            except (httpx.HTTPStatusError, ValueError, KeyError, TypeError):
                lengths[spec.prompt] = None
    return [dataclasses.replace(s, target_input_len=lengths[s.prompt]) for s in specs]


async def initial_test(sender: Sender, spec: PromptSpec) -> None:
    """Send one request (spec's prompt, max_tokens 1) before the run, as vLLM's
    ``bench serve`` does; SetupError when it fails, so that a server that is down or
    refuses the requests stops the test at once instead of measuring only failures."""
    _log("initial test request")
    probe = dataclasses.replace(spec, output_len=1)
    result = await sender.send(probe, time.perf_counter())
    if not result.success:
        raise SetupError(f"initial test request failed: {result.error}; is the server "
                         "up and are --base-url, --endpoint and --model right?")


def make_sender(config: LoadtestConfig, client: httpx.AsyncClient, model: str) -> Sender:
    """The request kind of ``--endpoint``: embeddings, or streaming (chat) completions."""
    if config.embeddings:
        return EmbeddingsSender(client, config.base_url, model, config.timeout)
    return RequestSender(client, config.base_url, model, config.endpoint, config.ignore_eos,
                         config.timeout, config.temperature)


async def run_session(config: LoadtestConfig, stop: asyncio.Event) -> Session:
    """Run every rate of config until done or until stop is set."""
    model = tokenizer = tokenizer_id = None
    records: list[RunRecord] = []
    async with make_client(config) as client:
        try:
            model = config.model or await unless_stopped(
                resolve_model(client, config.base_url), stop)
            try:
                counter = await unless_stopped(
                    choose_counter(client, config.base_url, model, config.endpoint == "chat"),
                    stop)
            except httpx.TransportError as e:
                raise SetupError(f"cannot reach {config.base_url} ({type(e).__name__}: "
                                 f"{e}); is the server up?") from None
            tokenizer, tokenizer_id = counter.name, counter.tokenizer_id
            _log(f"model {model!r}; prompt lengths by {tokenizer}")
            sender = make_sender(config, client, model)
            for index, rate in enumerate(config.request_rates):
                records.append(await _run_rate(config, counter, sender, index, rate, stop))
                if records[-1].interrupted:
                    break
        except Interrupted:
            pass
    return Session(model=model, tokenizer=tokenizer, tokenizer_id=tokenizer_id,
                   records=tuple(records), interrupted=stop.is_set())


async def _run_rate(
    config: LoadtestConfig,
    counter: TokenCounter,
    sender: Sender,
    index: int,
    rate: float,
    stop: asyncio.Event,
) -> RunRecord:
    total = config.num_prompts + config.num_warmups
    _log(f"building {total} prompts ({config.dataset} dataset)")
    prompts = await unless_stopped(build_prompts(config, counter, total, config.seed + index),
                                   stop)
    measured, warmups = prompts[: config.num_prompts], prompts[config.num_prompts:]
    if index == 0:
        await unless_stopped(initial_test(sender, measured[0]), stop)
    if warmups:
        _log(f"{len(warmups)} warm-up requests")
        warm = await run_once(sender, warmups, math.inf, 1.0, config.max_concurrency,
                              config.seed, stop)
        failed = [r for r in warm.results if not r.success]
        if failed:
            _log(f"warning: {len(failed)} of {len(warmups)} warm-up requests failed, "
                 f"e.g. {failed[0].error}")
        if warm.interrupted:
            raise Interrupted
    return await run_once(sender, measured, rate, config.burstiness, config.max_concurrency,
                          config.seed + index, stop, progress=config.progress,
                          desc=f"rate {rate:g} req/s")


def _log(message: str) -> None:
    print(f"[loadtest] {message}", file=sys.stderr)
