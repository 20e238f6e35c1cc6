"""The engine's periodic stats line: what one interval's readings say, and silence while
the engine is idle. (A real server's lines: test_priority_server.py.)"""

from __future__ import annotations

import pytest

from tpserve.server.stats_log import StatsLogger, stats_line

IDLE = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
        "kv_blocks_total": 100, "kv_blocks_free": 100, "prompt_tokens_total": 50,
        "generation_tokens_total": 20, "num_preemptions_total": 1,
        "prefix_cache_queries_total": 64, "prefix_cache_hits_total": 16}


def test_an_idle_interval_logs_nothing():
    assert stats_line(IDLE, dict(IDLE), 10.0) is None


def test_the_line_reports_the_interval_and_the_state_now():
    now = {**IDLE, "num_requests_running": 3, "num_requests_waiting": 2,
           "kv_cache_usage_perc": 0.25, "kv_blocks_free": 75,
           "prompt_tokens_total": 50 + 400, "generation_tokens_total": 20 + 120,
           "num_preemptions_total": 1 + 2, "prefix_cache_queries_total": 64 + 400,
           "prefix_cache_hits_total": 16 + 100}
    assert stats_line(IDLE, now, 4.0) == (
        "engine: prompt 100.0 tok/s, generation 30.0 tok/s | running 3, waiting 2 reqs | "
        "KV cache 25.0 % used (25 of 100 blocks) | prefix cache hits 25.0 % | "
        "preemptions 2")
    # requests held but no tokens this interval (e.g. waiting for blocks): still a line
    stalled = {**IDLE, "num_requests_waiting": 1}
    assert stats_line(IDLE, stalled, 10.0).startswith(
        "engine: prompt 0.0 tok/s, generation 0.0 tok/s | running 0, waiting 1 reqs")
    assert "prefix cache hits - |" in stats_line(IDLE, stalled, 10.0)
    # under speculative decoding, the share of the interval's draft tokens kept
    spec = {**now, "spec_decode_num_draft_tokens_total": 80,
            "spec_decode_num_accepted_tokens_total": 60}
    assert stats_line({**IDLE, "spec_decode_num_draft_tokens_total": 40,
                       "spec_decode_num_accepted_tokens_total": 30}, spec, 4.0).endswith(
        "preemptions 2 | draft acceptance 75.0 % of 40 tokens")
    # with a host tier: how full it is now, and the interval's stores and loads
    tier = {"kv_offload_blocks_total": 400, "kv_offload_blocks_used": 100,
            "kv_offload_stored_blocks_total": 30, "kv_offload_loaded_blocks_total": 12}
    assert stats_line({**IDLE, **tier}, {**now, **tier, "kv_offload_blocks_used": 130,
                                          "kv_offload_stored_blocks_total": 60,
                                          "kv_offload_loaded_blocks_total": 20},
                      4.0).endswith("preemptions 2 | host tier 32.5 % used, 30 blocks stored, "
                                    "8 loaded")


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="--log-stats-interval must be > 0"):
        StatsLogger(lambda: IDLE, 0)
