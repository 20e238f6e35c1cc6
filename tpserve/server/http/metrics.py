"""Prometheus metrics (vLLM's names, ``tpserve:`` prefix, or ``vllm:`` with
``--metrics-namespace vllm``) on a registry owned per app.

Engine-side values (gauges, counters, and the histograms the engine keeps itself: queue,
prefill and decode times, tokens per step) are read from ``engine.stats()`` at scrape
time by a custom collector;
per-request histograms are observed by the HTTP layer through ``RequestTracker``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tpserve.model.sleep import SLEEP_STATES  # vLLM's engine_sleep_state labels by level
from tpserve.server.engine.drafting import PER_POSITION  # a list: one counter a position
from tpserve.server.engine.histogram import ENGINE_HISTOGRAMS, REQUEST_TIME_BUCKETS, read_histogram
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.memory_metrics import memory_families

logger = logging.getLogger(__name__)

NAMESPACES = ("tpserve", "vllm")  # --metrics-namespace: the series' prefix before ":"
ENGINE_LABELS = ("model_name", "engine")  # every series: one per replica, as vLLM's
# stats() key of a data-parallel server: each replica's own stats (server/replica_stats.py)
REPLICAS = "replicas"

# stats() key -> help text; exported as gauges named prefix + key.
ENGINE_GAUGES = {
    "num_requests_running": "Number of requests currently running on the engine.",
    "num_requests_waiting": "Number of requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0..1).",
    "kv_blocks_total": "Total number of KV-cache blocks.",
    "kv_blocks_free": "Number of free KV-cache blocks.",
    "kv_blocks_cached": "Number of KV-cache blocks holding reusable cached prefixes.",
    "device_memory_allocated_bytes": "Device memory allocated by tensors, in bytes.",
    "device_memory_reserved_bytes": "Device memory reserved by the allocator, in bytes.",
    "device_memory_free_bytes": "Free device memory, in bytes.",
    "allocator_segments": "Segments the device allocator holds (one cudaMalloc each).",
    "step_token_budget": "Current per-step token budget of the scheduler.",
    "kv_offload_blocks_total": "KV blocks the host tier of the prefix cache holds at most, a "
                               "rank (--kv-offloading-size).",
    "kv_offload_blocks_used": "KV blocks held in the host tier of the prefix cache.",
    "engine_paused": "1 while the engine is paused or asleep (--enable-sleep-mode), else 0.",
}
# stats() key (cumulative) -> help text; exported as counters named prefix + key.
ENGINE_COUNTERS = {
    "num_preemptions_total": "Cumulative number of preemptions.",
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
    "steps_total": "Number of model steps the engine ran.",
    "oom_recoveries_total": "Steps that ran out of device memory and were dropped and "
                            "rescheduled under a reduced token budget.",
    "step_host_seconds_total": "Seconds the engine loop worked on the host (scheduling, "
                               "plans, launches, detokenization), waits for the device "
                               "excluded.",
    "device_wait_seconds_total": "Seconds the engine loop waited for the device to finish "
                                 "a step (near 0: the host is the bottleneck).",
    "prefix_cache_queries_total": "Prefix-cache queries: tokens of the sequences admitted.",
    "prefix_cache_hits_total": "Prefix-cache hits: tokens admitted sequences found cached.",
    "kv_offload_stored_blocks_total": "Cached KV blocks copied to the host tier as the "
                                      "device pool evicted them.",
    "kv_offload_loaded_blocks_total": "KV blocks copied back from the host tier for prefix "
                                      "hits (each saves computing block-size tokens).",
    "spec_decode_num_drafts_total": "Speculative decoding: drafts verified (one per "
                                    "sequence and step that had one).",
    "spec_decode_num_draft_tokens_total": "Speculative decoding: draft tokens verified.",
    "spec_decode_num_accepted_tokens_total": "Speculative decoding: draft tokens kept.",
    "spec_decode_paused_steps_total": "Speculative decoding: steps run overlapped, without "
                                      "drafts, because drafting had kept too few tokens "
                                      "(tpserve's draft backoff).",
}

# vLLM's bounds (vllm/v1/metrics/loggers.py), so queries written for vLLM (``le="0.5"``)
# read the same buckets: time to first token; end-to-end, as its request_latency_buckets
# (REQUEST_TIME_BUCKETS); between tokens, with three finer bounds below vLLM's first (a GPU
# decodes a token in a few milliseconds); token counts 1-2-5 up to the context
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


class EngineStatsCollector(Collector):
    """Exports ``stats()`` as gauges and (from cumulative values) counters at scrape time;
    with LoRA adapters, vLLM's ``lora_requests_info`` (the adapters with running and waiting
    requests, named by ``lora_names``: id -> name, as labels; the scrape time as value)."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], model_name: str,
                 lora_names: Callable[[], Mapping[int, str]] | None = None,
                 prefix: str = "tpserve:"):
        self.stats = stats
        self.model_name = model_name
        self.lora_names = lora_names
        self.prefix = prefix

    def _families(self, values: Mapping[str, Any] | None) -> Iterator[Metric]:
        # one series per engine replica, labelled as vLLM's ("engine": 0.. N-1; one
        # replica without --data-parallel-size): the replicas' own stats, or the engine's
        engines: list[Mapping[str, Any]] = (
            [] if values is None else list(values.get(REPLICAS) or [values]))
        for kind, docs in ((GaugeMetricFamily, ENGINE_GAUGES),
                           (CounterMetricFamily, ENGINE_COUNTERS)):
            for key, doc in docs.items():
                family = kind(self.prefix + key, doc, labels=ENGINE_LABELS)
                for e, v in enumerate(engines):
                    if key in v:
                        family.add_metric([self.model_name, str(e)], float(v[key]))
                if values is None or family.samples:
                    yield family
        if values is None or any(PER_POSITION in v for v in engines):
            family = CounterMetricFamily(
                self.prefix + PER_POSITION, "Speculative decoding: draft tokens kept, by their "
                "position in the draft (0: the first).", labels=(*ENGINE_LABELS, "position"))
            for e, v in enumerate(engines):
                for j, n in enumerate(v.get(PER_POSITION) or ()):
                    family.add_metric([self.model_name, str(e), str(j)], float(n))
            yield family
        family = GaugeMetricFamily(
            self.prefix + "engine_sleep_state", "1 for the engine's sleep state (awake; "
            "weights_offloaded: level 1; discard_all: level 2), 0 for the others.",
            labels=(*ENGINE_LABELS, "sleep_state"))
        for e, v in enumerate(engines):
            level = int(v.get("engine_sleep_level", 0))
            for i, state in enumerate(SLEEP_STATES):
                family.add_metric([self.model_name, str(e), state], float(level == i))
        yield family
        for key, (_, doc) in ENGINE_HISTOGRAMS.items():
            family = HistogramMetricFamily(self.prefix + key, doc, labels=ENGINE_LABELS)
            for e, v in enumerate(engines):
                read = read_histogram(v, key)
                if read is not None:
                    buckets, total = read
                    family.add_metric([self.model_name, str(e)], buckets, total)
            if values is None or family.samples:
                yield family
        yield from memory_families(None if values is None else values.get("memory", {}),
                                   self.model_name, self.prefix)
        yield self._cache_config_family(engines)
        lora = None if values is None else values.get("lora")
        if values is None or lora is not None:
            yield self._lora_family(lora)

    def _cache_config_family(self, engines: list[Mapping[str, Any]]) -> Metric:
        """vLLM's ``cache_config_info``: a gauge at 1 per engine whose labels are the
        engine's cache config (``stats()["cache_config"]``, strings) and ``engine``."""
        configs = [(e, v["cache_config"]) for e, v in enumerate(engines)
                   if v.get("cache_config")]
        keys = tuple(configs[0][1]) if configs else ()
        family = GaugeMetricFamily(self.prefix + "cache_config_info",
                                   "Information of the engine's cache config.",
                                   labels=(*keys, "engine"))
        for e, config in configs:
            family.add_metric([*(str(config.get(k, "")) for k in keys), str(e)], 1.0)
        return family

    def _lora_family(self, lora: Mapping[str, Any] | None) -> Metric:
        family = GaugeMetricFamily(self.prefix + "lora_requests_info",
                                   "Running stats on LoRA requests.", labels=LORA_INFO_LABELS)
        if lora is not None:
            names = self.lora_names() if self.lora_names is not None else {}

            def listed(ids) -> str:  # an unloaded adapter's requests: its id
                return ",".join(names.get(i, str(i)) for i in ids)
            family.add_metric([str(lora["max_lora"]), listed(lora["running"]),
                               listed(lora["waiting"])], time.time())
        return family

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        try:
            values = dict(self.stats())
        except Exception:  # a dead engine must not break /metrics
            logger.warning("engine.stats() failed; engine metrics omitted", exc_info=True)
            return iter(())
        return self._families(values)


class ServerMetrics:
    """All metrics of one app, on its own ``CollectorRegistry``, their names prefixed by
    ``namespace:`` (``tpserve``, or ``vllm`` for what was built to read vLLM's)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], Mapping[str, float]], model_name: str,
                 lora_names: Callable[[], Mapping[int, str]] | None = None,
                 namespace: str = "tpserve", max_model_len: int = 1_000_000,
                 engines: int = 1):
        """``engines``: the data-parallel replicas, each series' ``engine`` label (a
        request's: the replica that ran it, ``RequestOutput.engine_index``)."""
        assert namespace in NAMESPACES, namespace
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        prefix = namespace + ":"
        self.ttft = Histogram(prefix + "time_to_first_token_seconds",
                              "Time to first token in seconds.", ENGINE_LABELS,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(prefix + "inter_token_latency_seconds",
                             "Time between successive streamed outputs in seconds.", ENGINE_LABELS,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(prefix + "e2e_request_latency_seconds",
                             "End-to-end latency of each sequence in seconds.", ENGINE_LABELS,
                             buckets=REQUEST_TIME_BUCKETS, registry=r)
        self.prompt_tokens = Histogram(prefix + "request_prompt_tokens",
                                       "Number of prompt tokens per sequence.", ENGINE_LABELS,
                                       buckets=token_buckets(max_model_len), registry=r)
        self.generation_tokens = Histogram(prefix + "request_generation_tokens",
                                           "Number of generated tokens per sequence.",
                                           ENGINE_LABELS, buckets=token_buckets(max_model_len),
                                           registry=r)
        self.success = Counter(prefix + "request_success",
                               "Count of finished sequences by finish reason.",
                               (*ENGINE_LABELS, "finished_reason"), registry=r)
        for engine in map(str, range(engines)):  # zero-valued series from the start
            for histogram in (self.ttft, self.itl, self.e2e, self.prompt_tokens,
                              self.generation_tokens):
                histogram.labels(model_name, engine)
            for reason in ("stop", "length", "abort"):
                self.success.labels(model_name, engine, reason)
        r.register(EngineStatsCollector(stats, model_name, lora_names, prefix))

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's latencies and token counts as its outputs arrive, each of
    its ``n`` sequences as one request (as vLLM, whose engine runs each as a request of
    its own): its first token, the time between its outputs, and at its finish its
    end-to-end time, prompt and generated tokens and its finish reason, so every
    per-request series counts the same sequences."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic):
        self.m = metrics
        self.clock = clock
        self.start = clock()
        self.last_token_time: dict[int, float] = {}  # sequence index -> its last output
        self.generated: dict[int, int] = {}  # sequence index -> tokens so far
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        if self.done:
            return
        now = self.clock()
        labels = (self.m.model_name, str(out.engine_index))
        for d in out.deltas:
            if d.token_ids:
                last = self.last_token_time.get(d.index)
                if last is None:
                    self.m.ttft.labels(*labels).observe(now - self.start)
                else:
                    self.m.itl.labels(*labels).observe(now - last)
                self.last_token_time[d.index] = now
                self.generated[d.index] = self.generated.get(d.index, 0) + len(d.token_ids)
            if d.finish_reason is not None:
                self.m.success.labels(*labels, d.finish_reason).inc()
                self.m.e2e.labels(*labels).observe(now - self.start)
                self.m.prompt_tokens.labels(*labels).observe(out.num_prompt_tokens)
                self.m.generation_tokens.labels(*labels).observe(
                    self.generated.get(d.index, 0))
        if out.finished:
            self.done = True
