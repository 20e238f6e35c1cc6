"""The start-up capacity lines: full-length sequences counted in whole blocks, and vLLM's
"KV cache size" and "Maximum concurrency" lines."""

from __future__ import annotations

from tpserve.model.memory import MemoryPlan

PER_BLOCK = 16 * 46080  # SmolLM2-135M, float32 KV


def _plan(num_blocks: int, max_model_len: int) -> MemoryPlan:
    return MemoryPlan(device="cpu", total=1 << 34, free_at_start=1 << 33, utilization=0.9,
                      weights=0, workspace=0, workspace_measured=False, cuda_graphs=0,
                      kv_pool=num_blocks * PER_BLOCK, num_blocks=num_blocks, block_size=16,
                      bytes_per_block=PER_BLOCK, max_model_len=max_model_len, kv_source="t")


def test_concurrency_counts_whole_blocks_per_sequence():
    # 1026 tokens take 65 blocks: 129 blocks hold one such sequence, though 2064 tokens
    plan = _plan(129, 1026)
    assert plan.blocks_per_sequence == 65
    assert plan.max_concurrent_full_sequences == 1
    assert _plan(130, 1026).max_concurrent_full_sequences == 2
    assert plan.max_concurrency == 129 / 65  # vLLM's get_max_concurrency_for_kv_cache_config


def test_the_capacity_lines_are_vllms_too():
    lines = _plan(129, 1026).describe()
    assert lines[-3].endswith("; 1 concurrent sequences at max length 1026")
    assert lines[-2:] == ["  KV cache size: 2,064 tokens",
                          "  Maximum concurrency for 1,026 tokens per request: 1.98x"]
