"""vLLM's engine metrics on a real server (embedded SmolLM2), in both process layouts (the
second with ``--metrics-namespace vllm``: every series named as vLLM names it):
prefix-cache queries and hits, request queue/prefill/decode times, tokens per step; no
speculative-decoding counters while speculation is off."""

from __future__ import annotations

import httpx
import pytest

from tests.server.serverproc import SMALL, ServerProcess

BLOCK_SIZE = 16
SHARED = ("A long shared preamble about the history of maps, rivers, mountains, towns and "
          "the people who walked between them, written so that two prompts begin alike. ") * 4
SUFFIXES = ("First question: which river is the longest?",
            "Second question: which mountain is the highest?")
ENGINE_HISTOGRAMS = ("request_queue_time_seconds", "request_prefill_time_seconds",
                     "request_decode_time_seconds")


@pytest.fixture(scope="module", params=[("--no-engine-process",),
                                        ("--engine-process", "--metrics-namespace", "vllm")],
                ids=["in-process", "engine-process-vllm-names"])
def server(request):
    s = ServerProcess(*SMALL, "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
                      *request.param)
    yield s
    assert s.stop() == 0, s.output()


def snapshot(server: ServerProcess) -> dict[str, float]:
    names = ["prefix_cache_queries_total", "prefix_cache_hits_total", "steps_total",
             "iteration_tokens_total_count", "iteration_tokens_total_sum",
             "request_success_total",
             *(f"{h}_count" for h in ENGINE_HISTOGRAMS)]
    return {n: server.metric(n) for n in names}


def test_prefix_cache_and_request_time_metrics(server):
    prompts = [SHARED + s for s in SUFFIXES]
    tokens = [httpx.post(server.base + "/tokenize", json={"prompt": p}, timeout=30
                         ).json()["tokens"] for p in prompts]
    common = next((i for i, (a, b) in enumerate(zip(*tokens, strict=False)) if a != b),
                  min(map(len, tokens)))
    assert common >= 4 * BLOCK_SIZE, "the shared prefix spans several blocks"
    # the second prompt finds the first one's full blocks of the shared prefix (and
    # always leaves one token of its own to compute)
    expected_hits = min(common // BLOCK_SIZE, (len(tokens[1]) - 1) // BLOCK_SIZE) * BLOCK_SIZE

    before = snapshot(server)
    for prompt in prompts:  # one after the other: the first is cached when the second comes
        r = httpx.post(server.base + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    after = snapshot(server)
    grew = {k: after[k] - before[k] for k in after}

    assert grew["request_success_total"] == 2
    assert grew["prefix_cache_queries_total"] == len(tokens[0]) + len(tokens[1])
    assert grew["prefix_cache_hits_total"] == expected_hits
    assert grew["iteration_tokens_total_count"] == grew["steps_total"] > 0
    # every prompt token not found in the cache was computed in some step
    assert grew["iteration_tokens_total_sum"] >= len(tokens[0]) + len(tokens[1]) - expected_hits
    for name in ENGINE_HISTOGRAMS:
        assert grew[f"{name}_count"] == 2, name
    # as vLLM's, the speculative-decoding counters exist only while speculation is on
    text = httpx.get(server.base + "/metrics", timeout=10).text
    prefix = server.metrics_prefix
    assert f"{prefix}spec_decode" not in text and f"{prefix}steps_total" in text
    if prefix == "vllm:":  # every series as vLLM names it, as its dashboards read them
        assert "tpserve:" not in text
        for name in ("num_requests_waiting", "kv_cache_usage_perc", "memory_bytes",
                     "time_to_first_token_seconds_count", "request_success_total"):
            assert f"\nvllm:{name}{{" in text, name
