"""The does-not-fit advice: exact suggestion numbers from the pure function, and the
refusal a CPU runner gives through the reference path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.server.engine.test_engine_core import LIMITS
from tpserve.model.gpu_processes import GpuProcess, GpuProcesses, other_gpu_processes
from tpserve.model.memory import AllocatorReading, GiB, MemoryPlan
from tpserve.model.memory_advice import (
    FitInputs,
    Suggestion,
    allocation_failed,
    asked_bytes,
    explain_no_fit,
    explain_oom,
    explain_pool_oom,
    pool_flag,
    suggest_fits,
)
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.parallel.state import TPGroup

MiB = 1 << 20

# an H100-like rank: 80 GiB, 20 GiB held by another process, weights 36 GiB, workspace
# 8 GiB, graphs 1 GiB: 0.9 x 80 - 65 = 7 GiB for the KV pool = 3584 blocks of 2 MiB
GPU = FitInputs(
    device_type="cuda", total=80 * GiB, free_at_start=60 * GiB, utilization=0.9,
    kv_cache_memory=None, weights=36 * GiB, workspace=8 * GiB, cuda_graphs=1 * GiB,
    bytes_per_block=2 * MiB, block_size=16, max_model_len=100_000, kv_itemsize=2,
    max_num_seqs=256, tp=1, smaller_kv_dtypes=(("float8_e4m3", 1),),
    tp_options=((2, 18 * GiB, 1 * MiB), (4, 9 * GiB, 512 * 1024)),
    seq_options=((128, 3 * GiB), (64, 6 * GiB), (32, 7 * GiB)))


def test_gpu_suggestions_are_exact():
    assert GPU.num_blocks == 3584
    assert GPU.blocks_needed == 6250  # ceil(100000 / 16)
    # 0.97 x 80 GiB = 83322365542 bytes (floored) - 65 GiB = 13529146982 -> 6451 blocks
    assert suggest_fits(GPU) == [
        Suggestion("--max-model-len", "57344",
                   "the KV pool's 3584 blocks hold one sequence of 57344 tokens"),
        Suggestion("--gpu-memory-utilization", "0.97",
                   "6451 blocks = 103216 tokens of device memory"),
        # 64 is the largest halving that frees enough: 7 + 6 = 13 GiB = 6656 blocks
        Suggestion("--max-num-seqs", "64",
                   "workspace and graphs 6.00 GiB smaller: 6656 blocks = 106496 tokens"),
        Suggestion("--kv-cache-dtype", "float8_e4m3",
                   "blocks of 1048576 bytes instead of 2097152: 7168 blocks = 114688 tokens"),
        # 72 - 20 - 18 - 8 - 1 = 25 GiB of 1 MiB blocks
        Suggestion("--tensor-parallel-size", "2",
                   "18.00 GiB of weights per GPU: 25600 blocks = 409600 tokens per rank "
                   "(needs 2 GPUs)"),
    ]


def test_a_gguf_file_served_dequantized_is_told_what_as_stored_would_give():
    """A GGUF file served dequantized whose blocks ``--quantization gguf`` could hold (36
    GiB of weights, 12 GiB as stored): the suggestion gives the weights and the KV blocks
    as stored, after the KV cache dtype's and before tensor parallelism's; with
    ``--kv-cache-memory`` set the weights do not move the pool, so it is not offered."""
    from dataclasses import replace

    gguf = replace(GPU, stored_weights=12 * GiB)
    # 72 - 20 - 12 - 8 - 1 = 31 GiB of 2 MiB blocks
    want = Suggestion("--quantization", "gguf",
                      "the GGUF file's blocks as stored, about 12.00 GiB of weights per GPU "
                      "instead of 36.00 GiB: 15872 blocks = 253952 tokens")
    got = suggest_fits(gguf)
    assert got == [*suggest_fits(GPU)[:4], want, suggest_fits(GPU)[4]]
    assert want not in suggest_fits(replace(gguf, stored_weights=34 * GiB))  # still short
    assert want.flag not in {s.flag for s in suggest_fits(replace(gguf,
                                                                  kv_cache_memory=GiB))}


def test_streaming_weights_from_host_memory_is_suggested_where_the_layers_can_give_it():
    # short by 12.21 - 7 = 5.21 GiB: 5.3 GiB streamed leaves 12.3 GiB = 6297 blocks
    want = Suggestion("--cpu-offload-gb", "5.3",
                      "5.3 GiB of weights streamed from host memory (each step slower by "
                      "their copy): 6297 blocks = 100752 tokens")
    assert suggest_fits(replace(GPU, offloadable=30 * GiB)) == [*suggest_fits(GPU), want]
    assert want not in suggest_fits(replace(GPU, offloadable=5 * GiB))  # the layers can't
    assert want not in suggest_fits(replace(GPU, offloadable=30 * GiB,
                                            kv_cache_memory=7 * GiB))
    # weights of 50 GiB leave -7 GiB: 19.3 GiB streamed leave 12.3 GiB again
    heavy = replace(GPU, weights=50 * GiB, offloadable=40 * GiB)
    assert heavy.budget() == -7 * GiB and suggest_fits(heavy)[-1] == Suggestion(
        "--cpu-offload-gb", "19.3", "19.3 GiB of weights streamed from host memory (each "
        "step slower by their copy): 6297 blocks = 100752 tokens")


def test_nothing_fits_says_so():
    f = FitInputs(**{**GPU.__dict__, "free_at_start": 1 * GiB, "tp_options": (),
                     "smaller_kv_dtypes": (), "seq_options": ()})
    assert f.num_blocks == 0 and suggest_fits(f) == []
    text = explain_no_fit(f, GpuProcesses((GpuProcess(4242, "python serve", 79 * GiB),),
                                          "NVML"), "cuda:0", 0)
    assert "other processes on cuda:0 hold 79.00 GiB: pid 4242 (python serve) 79.00 GiB" \
        in text
    assert "no single flag makes it fit" in text


def test_kv_cache_memory_override_suggests_the_bytes_one_sequence_needs():
    f = FitInputs(**{**GPU.__dict__, "kv_cache_memory": 1 * GiB, "max_model_len": 8192,
                     "tp_options": (), "seq_options": (), "smaller_kv_dtypes": ()})
    # 8192 tokens = 512 blocks of 2 MiB = 1024 MiB; 1 GiB gives exactly that: lengthen
    assert f.num_blocks == 512 and f.blocks_needed == 512
    f = FitInputs(**{**f.__dict__, "max_model_len": 8193})
    assert suggest_fits(f) == [
        Suggestion("--max-model-len", "8192",
                   "the KV pool's 512 blocks hold one sequence of 8192 tokens"),
        Suggestion("--kv-cache-memory", "1026MiB", "513 blocks = 8208 tokens"),
    ]


def test_cpu_runner_refusal_names_the_numbers_and_the_fixes(tiny_llama):
    folder = tiny_llama
    # 8 KiB blocks (2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes); 64 KiB = 8
    with pytest.raises(MemoryError) as e:
        ModelRunner(RunnerConfig(model=folder, kv_cache_memory=64 * 1024), LIMITS,
                    TPGroup(0, 1, torch.device("cpu"), None))
    text = str(e.value)
    first, *rest = text.splitlines()
    assert first.startswith("the model does not fit on cpu (rank 0): weights ")
    assert first.endswith("leave 64.0 KiB for the KV pool = 8 blocks of 16 tokens, but one "
                          "sequence of --max-model-len 256 needs 16 blocks (128.0 KiB)")
    assert "  asked for: KV pool 128.0 KiB at least, --kv-cache-memory 64.0 KiB" in rest
    i = rest.index("  any one of these would make it fit:")
    assert rest[i + 1:] == [
        "    --max-model-len 128: the KV pool's 8 blocks hold one sequence of 128 tokens",
        "    --kv-cache-memory 1MiB: 128 blocks = 2048 tokens",
        "    --kv-cache-dtype bfloat16: blocks of 4096 bytes instead of 8192: 16 blocks = "
        "256 tokens",
        # the tiny model's 2 KV heads: one per rank at tp 2, so blocks halve too
        "    --tensor-parallel-size 2: 208.6 KiB of weights per GPU: 16 blocks = 256 tokens "
        "per rank (needs 2 GPUs)",
    ]


def test_oom_explanation():
    plan = MemoryPlan("cuda:0", 80 * GiB, 79 * GiB, 0.9, 36 * GiB, 8 * GiB, True, GiB,
                      30 * GiB, 15360, 16, 2 * MiB, 8192, "x", other_processes=GiB,
                      free=2 * GiB, after_warmup=AllocatorReading(70 * GiB, 75 * GiB, 9, 0, 0))
    msg = "CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of ..."
    assert asked_bytes(msg) == int(3.5 * GiB)
    text = explain_oom(msg, plan, AllocatorReading(70 * GiB, 76 * GiB, 9, 2, 1), 2 * GiB,
                       GpuProcesses((), "NVML bindings (nvidia-ml-py) not installed"), 8192)
    assert text.splitlines()[1:] == [
        "  asked for 3.50 GiB, free on the device 2.00 GiB of 80.00 GiB",
        "  this server holds: weights 36.00 GiB | activation workspace 8.00 GiB | "
        "cuda graphs 1.00 GiB | kv pool 30.00 GiB | non torch 2.00 GiB",
        "  allocator now: reserved 76.00 GiB, allocated 70.00 GiB, fragmentation 7.9 %, "
        "2 alloc retries, 1 OOMs",
        "  other processes: none named (NVML bindings (nvidia-ml-py) not installed)",
        # 1.5 GiB short: the KV pool gives that back at 0.9 - 1.5/80 = 0.88125 -> 0.88
        "  to leave steps more room: --gpu-memory-utilization 0.88 (the KV pool leaves "
        "1.50 GiB more headroom); or --max-num-batched-tokens 4096 (half the activation "
        "workspace of the largest step)",
    ]


def test_no_gpu_processes_off_cuda():
    assert other_gpu_processes(torch.device("cpu")) == GpuProcesses((), "not a CUDA device")


def test_num_gpu_blocks_override_sets_the_pool_in_blocks(tiny_llama, caplog):
    """vLLM's --num-gpu-blocks-override: exactly that many blocks, the plan saying why; too
    few for one sequence is refused naming the numbers; more than the plan leaves is
    allocated with a warning (as in vLLM)."""
    cpu = TPGroup(0, 1, torch.device("cpu"), None)
    runner = ModelRunner(RunnerConfig(model=tiny_llama, num_gpu_blocks_override=20), LIMITS,
                         cpu)
    assert runner.kv_pool.num_blocks == runner.plan.num_blocks == 20
    assert any("--num-gpu-blocks-override 20" in line for line in runner.plan.describe())
    # one sequence of --max-model-len 256 needs 16 blocks of 16 tokens
    with pytest.raises(ValueError, match=r"^--num-gpu-blocks-override 15: 15 blocks of 16 "
                       r"tokens hold 240 tokens, but one sequence of --max-model-len 256 "
                       r"needs 16 blocks; give at least 16 or a smaller --max-model-len$"):
        ModelRunner(RunnerConfig(model=tiny_llama, num_gpu_blocks_override=15), LIMITS, cpu)
    assert not [r for r in caplog.records if "exceeds" in r.getMessage()]
    # a utilization so small that the plan leaves nothing: the 16 blocks come all the same
    with caplog.at_level("WARNING", logger="tpserve.model.runner"):
        runner = ModelRunner(RunnerConfig(model=tiny_llama, num_gpu_blocks_override=16,
                                          gpu_memory_utilization=1e-9), LIMITS, cpu)
    assert runner.kv_pool.num_blocks == 16
    assert [r.getMessage() for r in caplog.records if "exceeds" in r.getMessage()] == [
        "--num-gpu-blocks-override 16 exceeds the 0 blocks the memory plan leaves for the KV "
        "pool (0.00 x available RAM - weights - workspace): it may not fit"]


# a CPU host of 24 GiB, 20 GiB available at start, SmolLM2-sized numbers
CPU = FitInputs(device_type="cpu", total=24 * GiB, free_at_start=20 * GiB, utilization=0.01,
                kv_cache_memory=None, weights=513 * MiB, workspace=154 * MiB, cuda_graphs=0,
                bytes_per_block=737280, block_size=16, max_model_len=8192, kv_itemsize=4,
                max_num_seqs=256, tp=1)


def test_cpu_refusal_names_the_available_ram_the_utilization_applied_to():
    """On CPU --gpu-memory-utilization is a fraction of the RAM available at start
    (kv_budget), not of the total; --kv-cache-memory, the flag CPU users size the pool
    with, is suggested whenever a size that holds one sequence fits in the room left."""
    text = explain_no_fit(CPU, GpuProcesses((), "not a CUDA device"), "cpu", 0)
    assert ("  asked for: KV pool 360.00 MiB at least, --gpu-memory-utilization 0.01 of "
            "20.00 GiB available RAM at start") in text.splitlines()
    # 8192 tokens = 512 blocks of 720 KiB = 360 MiB
    assert Suggestion("--kv-cache-memory", "360MiB", "512 blocks = 8192 tokens") \
        in suggest_fits(CPU)
    gpu = explain_no_fit(replace(GPU, max_model_len=10**7), GpuProcesses((), "x"), "cuda:0", 0)
    assert "--gpu-memory-utilization 0.90 of 80.00 GiB" in gpu


def test_the_cpu_allocators_failure_is_an_allocation_failure():
    msg = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
           "allocate memory: you tried to allocate 14745600000 bytes. Error code 12")
    assert asked_bytes(msg) == 14745600000
    assert allocation_failed(RuntimeError(msg))
    assert allocation_failed(torch.OutOfMemoryError("CUDA out of memory"))
    assert not allocation_failed(RuntimeError("shape mismatch"))
    assert not allocation_failed(ValueError("can't allocate memory"))


def test_pool_flag_names_what_sized_the_pool():
    assert pool_flag("--num-gpu-blocks-override 20000", 0.9) == \
        "--num-gpu-blocks-override 20000"
    assert pool_flag("--kv-cache-memory", 0.9) == "--kv-cache-memory"
    assert "--kv-cache-memory" in pool_flag("CPU default cap (4 GiB; set --kv-cache-memory)",
                                            0.9)
    assert pool_flag("0.90 x total - others - weights - workspace - graphs", 0.9) == \
        "--gpu-memory-utilization 0.90"


def test_a_pool_that_cannot_be_allocated_says_what_would_fit():
    f = replace(GPU, max_model_len=8192)  # 512 blocks of 2 MiB a sequence
    lines = explain_pool_oom(
        f, "--gpu-memory-utilization 0.90", 3584, "CUDA out of memory. Tried to allocate "
        "7.00 GiB. GPU 0 has ...\nmore", 5 * GiB, "cuda:0", 0,
        GpuProcesses((), "x")).splitlines()
    # 0.9 x 5 GiB = 2304 blocks of 2 MiB = 4608 MiB; 7 GiB - 4.5 GiB = 2.5 GiB less:
    # 0.9 - 2.5 / 80 = 0.86875 -> 0.86
    assert lines == [
        "the model does not fit on cuda:0 (rank 0): the KV pool of 3584 blocks of 16 tokens "
        "= 7.00 GiB (--gpu-memory-utilization 0.90) could not be allocated, 5.00 GiB free",
        "  the allocator: CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has ...",
        "  free at start: 60.00 GiB of 80.00 GiB; this server holds: weights 36.00 GiB | "
        "activation workspace 8.00 GiB | CUDA graphs (set aside) 1.00 GiB",
        "  a smaller pool fits in what is free: --kv-cache-memory 4608MiB (2304 blocks = "
        "36864 tokens); or --num-gpu-blocks-override 2304; or --gpu-memory-utilization 0.86",
    ]
    # free memory that would hold it: a process limit refused it
    text = explain_pool_oom(CPU, "--kv-cache-memory", 1000, "can't allocate memory",
                            10 * GiB, "cpu", 0, GpuProcesses((), "x"))
    assert "a limit on this process refused it" in text
    # nothing that holds one sequence is free
    text = explain_pool_oom(CPU, "--kv-cache-memory", 1000, "can't allocate memory",
                            100 * MiB, "cpu", 0, GpuProcesses((), "x"))
    assert "what is free holds no sequence of --max-model-len 8192 (512 blocks" in text


def _cpu_alloc_error(*args, **kwargs):
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                       "can't allocate memory: you tried to allocate 14745600000 bytes.")


@pytest.mark.parametrize("flags, flag", [
    ({"num_gpu_blocks_override": 20000}, "(--num-gpu-blocks-override 20000)"),
    ({"kv_cache_memory": 12 * GiB}, "(--kv-cache-memory)"),
    ({"gpu_memory_utilization": 0.01}, "(--gpu-memory-utilization 0.01)"),
    ({}, "(the CPU default cap of 4 GiB, which --kv-cache-memory overrides)"),
])
def test_a_kv_pool_that_cannot_be_allocated_is_a_memory_error(tiny_llama, monkeypatch,
                                                              flags, flag):
    """The allocator's error (CPU: a RuntimeError; CUDA: OutOfMemoryError) becomes the
    refusal's MemoryError (the CLI: exit 2, no traceback), naming the flag that sized it."""
    monkeypatch.setattr("tpserve.model.runner.KVPool", _cpu_alloc_error)
    with pytest.raises(MemoryError) as e:
        ModelRunner(RunnerConfig(model=tiny_llama, **flags), LIMITS,
                    TPGroup(0, 1, torch.device("cpu"), None))
    first = str(e.value).splitlines()[0]
    assert first.startswith("the model does not fit on cpu (rank 0): the KV pool of ")
    assert flag in first


@pytest.mark.parametrize("target, stage", [
    ("tpserve.model.runner.build_model", "loading the weights"),
    ("tpserve.model.runner.profile_workspace", "profiling the largest step")])
def test_weights_or_workspace_the_host_cannot_allocate_are_a_memory_error(
        tiny_llama, monkeypatch, target, stage):
    monkeypatch.setattr(target, _cpu_alloc_error)
    with pytest.raises(MemoryError, match=rf"^the model does not fit on cpu \(rank 0\): "
                       rf"{stage} ran out of memory \(asked for 13.73 GiB\)"):
        ModelRunner(RunnerConfig(model=tiny_llama), LIMITS,
                    TPGroup(0, 1, torch.device("cpu"), None))


def test_other_runtime_errors_are_not_taken_for_memory(tiny_llama, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr("tpserve.model.runner.KVPool", broken)
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        ModelRunner(RunnerConfig(model=tiny_llama), LIMITS,
                    TPGroup(0, 1, torch.device("cpu"), None))
