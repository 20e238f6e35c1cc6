"""Where data-parallel replicas run (``server/replicas.py``) and how their statistics
read as one engine's (``server/replica_stats.py``)."""

from __future__ import annotations

import pytest

from tpserve.parallel.state import ParallelConfig
from tpserve.server.replica_stats import REPLICAS, merge_memory, merge_stats
from tpserve.server.replicas import ONLY, Replica, plan_replicas


def test_each_replica_sees_its_own_gpus_of_the_visible_ones(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7")
    layout = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    assert plan_replicas(layout, "cuda") == [Replica(0, 2, "4,5"), Replica(1, 2, "6,7")]
    assert plan_replicas(ParallelConfig(data_parallel_size=3), "cuda") == [
        Replica(0, 3, "4"), Replica(1, 3, "5"), Replica(2, 3, "6")]
    with pytest.raises(ValueError, match="needs 6 GPUs, but 4 are visible"):
        plan_replicas(ParallelConfig(tensor_parallel_size=2, data_parallel_size=3), "cuda")
    assert plan_replicas(ParallelConfig(tensor_parallel_size=8), "cuda") == [ONLY]
    assert plan_replicas(ParallelConfig(data_parallel_size=2), "cpu") == [
        Replica(0, 2), Replica(1, 2)]  # the machine is shared


def _report(tp: int, free: int) -> dict:
    return {"device": "cuda:0", "tp": tp, "history": {"time": [free]},
            "ranks": [{"rank": k, "plan": {"free": free + k}} for k in range(tp)]}


def test_merged_stats_sum_the_replicas_and_keep_each_ones_own():
    a = {"num_requests_running": 2, "kv_blocks_total": 100, "kv_blocks_free": 50,
         "kv_cache_usage_perc": 0.5, "generation_tokens_total": 7,
         "ttft:le:0": 1, "ttft:count": 3, "spec_decode_num_accepted_tokens_per_pos": [3, 1],
         "lora": {"running": [1], "waiting": [], "max_lora": 2}, "memory": _report(2, 10)}
    b = {"num_requests_running": 1, "kv_blocks_total": 100, "kv_blocks_free": 100,
         "kv_cache_usage_perc": 0.0, "generation_tokens_total": 5,
         "ttft:le:0": 2, "ttft:count": 2, "spec_decode_num_accepted_tokens_per_pos": [4, 0],
         "lora": {"running": [2], "waiting": [1], "max_lora": 2}, "memory": _report(2, 20)}
    merged = merge_stats([a, b])
    assert merged["num_requests_running"] == 3 and merged["generation_tokens_total"] == 12
    assert merged["kv_blocks_total"] == 200 and merged["kv_cache_usage_perc"] == 0.25
    assert merged["ttft:le:0"] == 3 and merged["ttft:count"] == 5
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [7, 1]
    assert merged["lora"] == {"running": [1, 2], "waiting": [1], "max_lora": 2}
    assert [(r["rank"], r["replica"], r["plan"]["free"]) for r in merged["memory"]["ranks"]] \
        == [(0, 0, 10), (1, 0, 11), (2, 1, 20), (3, 1, 21)]
    assert merged["memory"]["history"] == {"time": [10]}  # replica 0's
    assert merged["memory"]["data_parallel_size"] == 2
    assert merged[REPLICAS][1]["generation_tokens_total"] == 5
    assert all("memory" not in own for own in merged[REPLICAS])
    # a replica that has not reported yet adds nothing
    assert merge_stats([a, {}])["generation_tokens_total"] == 7
    assert merge_stats([{}, {}]) == {}
    assert merge_memory([_report(1, 5)])["ranks"] == [{"rank": 0, "plan": {"free": 5},
                                                       "replica": 0}]
