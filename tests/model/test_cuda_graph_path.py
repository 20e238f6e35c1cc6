"""The padded static-buffer paths that CUDA graphs replay (pure decode per batch bucket,
mixed steps per token bucket) give the logits of the plain forward (run eagerly here on
CPU; on CUDA the same paths are captured; the kernels' padded launch shapes are tested in
test_triton_kernels.py), also sequence parallel at tp 3 with buckets rounded up to
multiples of tp. The CPU comparisons also run over an FP8 cache with non-unit scales (the
scales are static per-layer buffers, read by the captured kernels on the device)."""

from __future__ import annotations

import pytest
import torch

from tests.model.util import load, new_pool, run
from tpserve.model.cuda_graphs import DECODE, MIXED, StepGraphs, buckets_for, mixed_buckets_for
from tpserve.model.plan import SeqChunk, StepPlan
from tpserve.parallel.launch import run_ranks


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets_for(40) == [1, 2, 4, 8, 16, 32, 40]
    assert mixed_buckets_for(0) == []
    assert mixed_buckets_for(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert mixed_buckets_for(100) == [16, 32, 64, 100]
    # sequence parallel at tp 3: every bucket a multiple of 3 (the largest may pass the cap)
    assert buckets_for(8, 3) == [3, 6, 9]
    assert buckets_for(40, 4) == [4, 8, 16, 32, 40]
    assert mixed_buckets_for(100, 3) == [18, 33, 66, 102]


KV_DTYPES = [torch.float32, torch.float8_e4m3fn]


def _load(folder: str, kv_dtype: torch.dtype):
    """The tiny model over a ``kv_dtype`` cache; FP8 with distinct non-unit scales."""
    model, comm = load(folder, kv_dtype=kv_dtype)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.kv_scale.copy_(torch.tensor([0.03 + 0.01 * i, 0.02 - 0.005 * i]))
    return model, comm


def _same_cache(before: torch.Tensor, padded: torch.Tensor, plain: torch.Tensor) -> None:
    """The padded path wrote exactly where the plain one did (bitwise: a padding row that
    wrote anything fails), and the same values up to the CPU matmul's rounding, which may
    depend on the row count (one e4m3 step for an FP8 cache, whose codes may round apart)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[before.element_size()]

    def changed(t):  # element by element, bitwise
        return (t.view(bits) != before.view(bits)).flatten()

    assert torch.equal(changed(padded), changed(plain))
    a, b = padded.float(), plain.float()
    rel = 2**-3 if padded.dtype == torch.float8_e4m3fn else 1e-5
    assert ((a - b).abs() <= rel * b.abs() + 1e-6).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_padded_decode_equals_plain_forward(tiny_llama, kv_dtype):
    model, comm = _load(tiny_llama, kv_dtype)
    pool = new_pool(model, comm, num_blocks=32, block_size=4)
    pool.buffer.zero_()  # the pool is uninitialised memory; NaN garbage would fail the compare
    seqs = [[5, 9, 13, 200, 31, 77, 2], [7, 7, 100], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    tables = [[3, 17, 4], [9], [21, 0, 30]]
    run(model, pool, [SeqChunk(s, 0, t, True) for s, t in zip(seqs, tables, strict=True)])
    graphs = StepGraphs(model, pool, model.attn_backend, max_num_seqs=8,
                        max_blocks_per_seq=16,
                        max_model_len=64, device=torch.device("cpu"))
    step = [SeqChunk([42 + i], len(s), t + [31 - i], True)
            for i, (s, t) in enumerate(zip(seqs, tables, strict=True))]
    plan = StepPlan.build(step, 4, model.attn_backend)
    assert graphs.select(plan) == ("decode", 4)
    before = pool.buffer.clone()
    got = graphs.run(plan)
    written = pool.buffer.clone()
    # the same step through the plain path, on the same cache contents
    pool.buffer.copy_(before)
    want = run(model, pool, step)
    assert got.shape == want.shape == (3, 256)
    assert (got - want).abs().max().item() < 1e-5
    _same_cache(before, written, pool.buffer)  # padding rows wrote nothing
    mixed = StepPlan.build([step[0], SeqChunk([1, 2], 0, [5], True)], 4, model.attn_backend)
    assert not graphs.can_run(mixed)  # no mixed buckets were asked for


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_padded_mixed_step_equals_plain_forward(tiny_llama, kv_dtype):
    """Decodes, a chunk over a cached prefix, a fresh prompt and a chunk that samples
    nothing, padded to the 32-token bucket."""
    model, comm = _load(tiny_llama, kv_dtype)
    pool = new_pool(model, comm, num_blocks=32, block_size=4)
    pool.buffer.zero_()  # the pool is uninitialised memory; NaN garbage would fail the compare
    seqs = [[5, 9, 13, 200, 31, 77, 2], [7, 7, 100], [3, 1, 4, 1, 5, 9, 2, 6]]
    tables = [[3, 17, 4], [9], [21, 0, 30]]
    run(model, pool, [SeqChunk(s, 0, t, True) for s, t in zip(seqs, tables, strict=True)])
    graphs = StepGraphs(model, pool, model.attn_backend, max_num_seqs=6,
                        max_blocks_per_seq=16,
                        max_model_len=64, device=torch.device("cpu"), max_mixed_tokens=32)
    step = [SeqChunk([42], 7, tables[0] + [31], True),
            SeqChunk([43], 3, tables[1], True),
            SeqChunk([11, 12, 13, 14, 15], 8, tables[2] + [6, 7], True),
            SeqChunk(list(range(20, 29)), 0, [10, 11, 12], True),
            SeqChunk([50, 51, 52], 0, [13], False)]
    plan = StepPlan.build(step, 4, model.attn_backend)
    assert plan.num_tokens == 19 and plan.num_decodes == 2
    assert graphs.select(plan) == (MIXED, 32)
    before = pool.buffer.clone()
    got = graphs.run(plan)
    written = pool.buffer.clone()
    pool.buffer.copy_(before)
    want = run(model, pool, step)
    assert got.shape == want.shape == (4, 256)
    assert (got - want).abs().max().item() < 1e-5
    _same_cache(before, written, pool.buffer)  # padding tokens wrote nothing
    # past the largest bucket:
    assert not graphs.can_run(StepPlan.build([SeqChunk(list(range(33)), 0, list(range(9)),
                                                       True)], 4, model.attn_backend))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_drafted_chunk_is_served_as_decodes_of_its_positions(tiny_llama, kv_dtype):
    """Speculative decoding: a decode followed by its draft samples every position
    (``SeqChunk.sample_rows``). The plan makes each of those positions a single-token
    sequence over the same blocks, of length ``num_computed + j + 1``, so beside a plain
    decode the step is a decode step (bucket 6), and beside a prefill chunk a mixed step
    whose decode slots hold them. Through the static buffers both give, at every drafted
    position, the logits a prefill of the whole sequence gives there (the prefill path, an
    oracle the expansion does not touch)."""
    model, comm = _load(tiny_llama, kv_dtype)
    pool = new_pool(model, comm, num_blocks=32, block_size=4)
    pool.buffer.zero_()
    seqs, tables = [[5, 9, 13, 200, 31, 77, 2], [7, 7, 100]], [[3, 17, 4], [9]]
    run(model, pool, [SeqChunk(s, 0, t, True) for s, t in zip(seqs, tables, strict=True)])
    graphs = StepGraphs(model, pool, model.attn_backend, max_num_seqs=6,
                        max_blocks_per_seq=16, max_model_len=64, device=torch.device("cpu"),
                        max_mixed_tokens=32)
    draft = [42, 13, 200, 31]
    step = [SeqChunk([43], 3, tables[1], True),
            SeqChunk(draft, 7, tables[0] + [31], True, sample_rows=4)]
    prefill = SeqChunk(list(range(20, 29)), 0, [10, 11, 12], True)
    plan = StepPlan.build(step, 4, model.attn_backend)
    assert plan.num_decodes == 5 and plan.max_query_len == 1
    assert plan.seq_lens.tolist() == [4, 8, 9, 10, 11]
    assert plan.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.block_tables.tolist() == [tables[1] + [0] * 3] + [tables[0] + [31]] * 4
    assert plan.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert graphs.select(plan) == (DECODE, 6)
    mixed = StepPlan.build(step + [prefill], 4, model.attn_backend)
    assert mixed.num_decodes == 5 and mixed.seq_lens.tolist() == [4, 8, 9, 10, 11, 9]
    assert graphs.select(mixed) == (MIXED, 16)
    before = pool.buffer.clone()
    got = {}
    for name, p in (("decode", plan), ("mixed", mixed)):
        got[name] = graphs.run(p)
        pool.buffer.copy_(before)
    # the oracle: each sequence prefilled whole (its last 1 and 4 positions sampled), then
    # the new prompt
    whole = [SeqChunk(seqs[1] + [43], 0, tables[1], True),
             SeqChunk(seqs[0] + draft, 0, tables[0] + [31], True, sample_rows=4)]
    want = run(model, pool, whole + [prefill])
    assert got["decode"].shape == (5, 256) and got["mixed"].shape == (6, 256)
    assert (got["decode"] - want[:5]).abs().max().item() < 1e-5
    assert (got["mixed"] - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="5 sampled rows of 4 tokens"):
        StepPlan.build([SeqChunk([1, 2, 3, 4], 7, tables[0] + [31], True, sample_rows=5)], 4,
                       model.attn_backend)


def _sequence_parallel_graph_paths(group, folder: str) -> dict[str, object]:
    """On each of 3 gloo ranks, ``--tp-comm allgather``: a decode of 2 sequences (bucket 3,
    one padding sequence) and a 19-token mixed step (bucket 33) through the static
    buffers, against the plain forward on the same cache."""
    model, comm = load(folder, group, tp_comm="allgather")
    pool = new_pool(model, comm, num_blocks=32, block_size=4)
    pool.buffer.zero_()
    seqs, tables = [[5, 9, 13, 200, 31, 77, 2], [7, 7, 100]], [[3, 17, 4], [9]]
    run(model, pool, [SeqChunk(s, 0, t, True) for s, t in zip(seqs, tables, strict=True)])
    graphs = StepGraphs(model, pool, model.attn_backend, max_num_seqs=8, max_blocks_per_seq=16,
                        max_model_len=64, device=torch.device("cpu"), max_mixed_tokens=32,
                        token_multiple=3)
    decode = [SeqChunk([42], 7, tables[0] + [31], True), SeqChunk([43], 3, tables[1], True)]
    mixed = decode + [SeqChunk(list(range(20, 37)), 0, [10, 11, 12, 13, 14], True)]
    out: dict[str, object] = {"buffers": graphs.seq_lens.shape[0]}
    for name, step in (("decode", decode), ("mixed", mixed)):
        plan = StepPlan.build(step, 4, model.attn_backend)
        out[name + "_bucket"] = graphs.select(plan)
        before = pool.buffer.clone()
        got = graphs.run(plan)
        written = pool.buffer.clone()
        pool.buffer.copy_(before)
        want = run(model, pool, step)
        out[name] = (got - want).abs().max().item()
        out[name + "_writes"] = (written - pool.buffer).abs().max().item()
    return out


def test_sequence_parallel_buckets_are_multiples_of_tp(tiny_llama):
    for res in run_ranks(_sequence_parallel_graph_paths, 3, tiny_llama, timeout_s=300):
        assert res["buffers"] == 9  # decode buckets 3, 6, 9 for max_num_seqs 8
        assert res["decode_bucket"] == ("decode", 3)
        assert res["mixed_bucket"] == (MIXED, 33)
        for name in ("decode", "mixed", "decode_writes", "mixed_writes"):
            assert res[name] < 1e-5, (name, res[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b"])
def test_captured_graphs_equal_eager_steps_on_the_gpu(kv_cache_dtype, overlap, model):
    """On a GPU: the same steps (a prefill, mixed steps with a pending token filled in on
    the device, pure decodes, drafted chunks sampling every position) through captured
    graphs and through the eager forward; with ``overlap`` the captured runner runs decode beside prefill attention on two streams.
    Qwen3's shape adds the q/k head norms fused into the RoPE kernel; it runs in float32
    (28 layers of bf16 rounding at another GEMM shape move a few of its 607,744 logits by
    two bf16 steps, 0.037, round 23)."""
    from dataclasses import replace

    from tpserve.model.plan import StepLimits
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.parallel.state import TPGroup

    dev = torch.device("cuda", 0)
    cfg = RunnerConfig(model=model, load_format="dummy",
                       dtype="float32" if model.startswith("qwen3") else "bfloat16",
                       kv_cache_dtype=kv_cache_dtype, device="cuda", kernel_backend="triton",
                       kv_cache_memory=64 * 2**20, cuda_graph_max_tokens=128)
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                        block_size=16)
    runners = [ModelRunner(replace(cfg, overlap_attention=overlap), limits,
                           TPGroup(0, 1, dev, None)),
               ModelRunner(replace(cfg, enforce_eager=True), limits, TPGroup(0, 1, dev, None))]
    assert runners[0].graphs is not None and runners[1].graphs is None
    a, b, c = list(range(5, 45)), list(range(100, 107)), list(range(200, 300))
    steps = [
        ([SeqChunk(a, 0, [0, 1, 2], True), SeqChunk(b, 0, [3], True),
          SeqChunk(c, 0, [4, 5, 6, 7, 8, 9, 10], True)], None),                  # eager: 147
        ([SeqChunk([7], 40, [0, 1, 2], True), SeqChunk([-1], 7, [3], True, 1),
          SeqChunk([9], 100, [4, 5, 6, 7, 8, 9, 10], True),
          SeqChunk(list(range(50, 80)), 0, [11, 12], True)], ("mixed", 64)),
        ([SeqChunk([3], 41, [0, 1, 2], True), SeqChunk([4], 8, [3], True),
          SeqChunk([-1], 101, [4, 5, 6, 7, 8, 9, 10], True, 2),
          SeqChunk([6], 30, [11, 12], True)], ("decode", 4)),
        # speculative decoding: a draft after a's token, every position sampled (each
        # position a decode: StepPlan.build), then one beside a new prompt
        ([SeqChunk([5], 9, [3], True),
          SeqChunk([8, 9, 10, 11], 42, [0, 1, 2], True, sample_rows=4)], ("decode", 8)),
        ([SeqChunk([6], 10, [3], True), SeqChunk([12, 13], 46, [0, 1, 2], True, sample_rows=2),
          SeqChunk(list(range(300, 310)), 0, [13], True)], ("mixed", 16)),
    ]
    outs = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        for chunks, kind in steps:
            plan = StepPlan.build(chunks, 16, runner.attn)
            if runner.graphs is not None:
                assert runner.graphs.select(plan) == kind
            logits = runner.execute(plan)
            out.append(logits.clone())
            # the same "sampled" tokens for both (argmax of random weights could differ)
            runner.store_sampled(torch.arange(11, 11 + logits.shape[0], device=dev))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
def test_a_step_that_scores_its_prompt_runs_eagerly_on_the_gpu():
    """A prefill whose rows score the prompt (``SeqChunk.prompt_targets``) would fit a
    mixed graph, which computes only the sampled row's logits: the runner runs it eagerly,
    and each scored row equals the log-softmax of the logits a prefill ending there samples
    from (bf16, so within bf16's rounding); the step's own sampled logits are unchanged."""
    from tpserve.model.plan import StepLimits
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.parallel.state import TPGroup

    dev = torch.device("cuda", 0)
    cfg = RunnerConfig(model="smollm2-135m", load_format="dummy", dtype="bfloat16",
                       device="cuda", kernel_backend="triton", kv_cache_memory=64 * 2**20,
                       cuda_graph_max_tokens=128)
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                        block_size=16)
    runner = ModelRunner(cfg, limits, TPGroup(0, 1, dev, None))
    a = list(range(5, 45))
    scored = StepPlan.build([SeqChunk(a, 0, [0, 1, 2], True, -1, tuple(a[1:]), 20)], 16,
                            runner.attn)
    plain = StepPlan.build([SeqChunk(a, 0, [3, 4, 5], True)], 16, runner.attn)
    assert runner.graphs.select(scored) == (MIXED, 64)
    got_logits = runner.execute(scored).float()
    got = runner.prompt_logprobs.to_host()
    torch.cuda.synchronize()  # the copies are not waited for
    assert got.logprobs.shape == (39,) and got.top_ids.shape == (39, 20)
    torch.testing.assert_close(got_logits, runner.execute(plain).float(), atol=3e-2, rtol=0)
    assert runner.prompt_logprobs is None  # a plain step clears them
    for i in (0, 7, 20, 38):
        ref = runner.execute(StepPlan.build([SeqChunk(a[:i + 1], 0, [6, 7, 8], True)], 16,
                                            runner.attn))
        lp = torch.log_softmax(ref.float()[0], -1).cpu()
        assert abs(got.logprobs[i].item() - lp[a[i + 1]].item()) < 5e-2, i
        assert abs(got.top_logprobs[i, 0].item() - lp.max().item()) < 5e-2, i
