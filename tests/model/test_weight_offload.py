"""``--cpu-offload-gb`` (``model/weight_offload.py``): the last decoder layers' weights held
in host memory and streamed through two device slots give exactly the logits of the model
with every weight resident, at tp 1 and tp 2 (gloo), unquantized and FP8-quantized at load
(each streamed layer processed on the device before it leaves); the device holds at least
the bytes asked fewer; the slots really are shared (a layer's weights are in its slot only
while it runs); and what cannot be offloaded is refused naming the limit. On a GPU, the
streamed copies ride a side stream and are captured in the CUDA graphs: a runner's graphs
and its eager steps give the resident runner's logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.model.util import CPU, full_logits, load, whole_and_stepped
from tpserve.model.attention.backend import select_attention
from tpserve.model.host_copy import distinct_storages
from tpserve.model.kernels.backend import select_ops
from tpserve.model.loader.build import build_model
from tpserve.model.loader.checkpoint import embedded_model_path, open_checkpoint
from tpserve.model.weight_offload import (
    SLOTS,
    LayerLayout,
    offloadable_bytes,
    offloaded_count,
    place_layers,
    resident_weight_bytes,
)
from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.state import TPGroup

MiB = 2**20


def _storage_bytes(model: nn.Module) -> int:
    """The bytes of the distinct storages ``model``'s parameters view."""
    return sum(s.nbytes() for s in distinct_storages(model.parameters()))
TOKENS = [5, 17, 300, 42, 9, 1200, 77, 31, 8, 64, 2048, 3, 19, 711, 40, 23, 99, 5]


def _offloaded(path: str, offload_bytes: int, group: TPGroup | None = None,
               quantization: str = "none"):
    group = group or TPGroup(0, 1, CPU, None)
    ckpt = open_checkpoint(path)
    method = None
    if quantization != "none":
        from tpserve.model.quant.methods import linear_method

        method = linear_method(quantization, "torch", CPU, torch.float32, 32, None)
    comm = Communicator(group)
    model = build_model(ckpt, comm, CPU, torch.float32, select_ops("torch"),
                        select_attention("torch", torch.float32), 512, quant_method=method,
                        cpu_offload_bytes=offload_bytes)
    return model, comm


@pytest.fixture(scope="module")
def resident():
    return load(str(embedded_model_path()))


@pytest.fixture(scope="module")
def streamed():
    return _offloaded(str(embedded_model_path()), 40 * MiB)


def test_streamed_layers_give_the_resident_logits(resident, streamed):
    (ref, comm), (model, comm2) = resident, streamed
    stream = model.weight_stream
    # SmolLM2's layers: 13.5 MiB each in float32; 5 out, 2 slots in: 40.5 MiB fewer
    layer = LayerLayout.of(ref.model.layers[-1]).weight_bytes
    assert (stream.first, stream.count) == (25, 5)
    saved = resident_weight_bytes(ref) - resident_weight_bytes(model)
    assert resident_weight_bytes(model) == _storage_bytes(model)  # the originals are gone
    assert offloadable_bytes(ref.model.layers) == 30 * layer - SLOTS * stream.layout.nbytes
    assert saved == 5 * layer - SLOTS * stream.layout.nbytes >= 40 * MiB
    assert stream.host_bytes == 5 * stream.layout.nbytes
    for a, b in zip(whole_and_stepped(ref, comm, TOKENS, 7, 5),
                    whole_and_stepped(model, comm2, TOKENS, 7, 5), strict=True):
        assert torch.equal(a, b)


def test_a_streamed_layer_is_in_its_slot_only_while_it_runs(resident, streamed):
    (ref, _), (model, comm) = resident, streamed
    stream, layers = model.weight_stream, model.model.layers
    first = stream.first
    # layers first and first + 2 share slot 0; first + 1 has slot 1
    ptr = lambda i: layers[i].mlp.down_proj.weight.untyped_storage().data_ptr()  # noqa: E731
    assert ptr(first) == ptr(first + 2) == stream.slots[0].data_ptr()
    assert ptr(first + 1) == stream.slots[1].data_ptr()
    assert all(ptr(i) != ptr(j) for i in range(first) for j in range(i))
    full_logits(model, comm, TOKENS)
    # after a forward slot 0 holds the last layer that ran on it (first + 4), not first
    names = dict(ref.model.layers[first + 4].named_parameters())
    for name, p in layers[first].named_parameters():
        assert torch.equal(p, names[name])
    assert not torch.equal(layers[first].mlp.down_proj.weight,
                           ref.model.layers[first].mlp.down_proj.weight)
    # the host copy holds each streamed layer's own weights
    stream.before(first)
    for name, p in layers[first].named_parameters():
        assert torch.equal(p, dict(ref.model.layers[first].named_parameters())[name])


def _tp2_logits(group, path):
    """This rank's logits from its FP8 shards, resident and streamed, and the streamed
    layers."""
    out = []
    for offload in (0, 20 * MiB):
        model, comm = _offloaded(path, offload, group, "fp8")
        out.append(full_logits(model, comm, TOKENS))
    stream = model.weight_stream
    return out, (stream.first, stream.count)


def test_tp2_streams_each_ranks_fp8_shards():
    """Each rank quantizes its streamed layers on the device before they leave it. (tp 2
    unquantized, through a server: tests/server/test_tp_serving.py.)"""
    for (resident, streamed), placed in run_ranks(_tp2_logits, 2, str(embedded_model_path()),
                                                  timeout_s=300):
        # a rank's layer: 1.8 MiB in fp8 with its scales (heads zero-padded to 12 and 4)
        assert placed == (17, 13)
        assert torch.equal(resident, streamed)


def test_more_than_the_layers_hold_is_refused():
    with pytest.raises(ValueError, match=r"--cpu-offload-gb 0.5: the 30 decoder layers hold "
                                         r"0\.40 GiB a rank, and two of them stay on the "
                                         r"device as staging slots, so at most 0\.37 GiB"):
        _offloaded(str(embedded_model_path()), 2**29)


def test_layers_laid_out_unlike_the_last_are_refused():
    def layers(*widths: int):
        return nn.ModuleList([nn.Linear(64, n, bias=False)
                              for n in widths or (64, 32, 64, 64, 64)])

    one = 64 * 64 * 4
    assert offloaded_count(LayerLayout.of(layers()[-1]), one) == 3
    assert offloadable_bytes(layers()) == one  # three alike at the end, two slots
    assert offloadable_bytes(layers()[:3]) == 0
    stream = place_layers(layers(), CPU, one, lambda i, layer: None)  # layers 2-4: alike
    assert (stream.first, stream.count) == (2, 3)
    with pytest.raises(ValueError, match="decoder layer 1's weights are laid out unlike the "
                                         "last layer's"):
        place_layers(layers(), CPU, 2 * one, lambda i, layer: None)
    # the ranks agree on the largest count any of them needs
    agreed = place_layers(layers(64, 32, 64, 64, 64, 64), CPU, one, lambda i, layer: None,
                          lambda count: count + 1)
    assert (agreed.first, agreed.count) == (2, 4)


def test_lora_with_offloading_is_refused():
    from tpserve.model.lora.adapter import LoraConfig
    from tpserve.model.runner_config import RunnerConfig

    with pytest.raises(ValueError, match="--cpu-offload-gb with --enable-lora"):
        RunnerConfig(cpu_offload_bytes=MiB,
                     lora=LoraConfig(modules=(), max_loras=1, max_lora_rank=8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream: GPU only")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_cuda_graphs_capture_the_streamed_copies(quantization):
    from dataclasses import replace

    from tests.model.util import graphs_and_eager
    from tpserve.model.plan import SeqChunk, StepLimits
    from tpserve.model.runner_config import RunnerConfig

    rc = RunnerConfig(model="smollm2-135m", load_format="dummy", dtype="bfloat16",
                      device="cuda", kernel_backend="triton", kv_cache_memory=256 * MiB,
                      cuda_graph_max_tokens=64, quantization=quantization)
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                        block_size=16)
    steps = [[SeqChunk(TOKENS, 0, [0, 1], True), SeqChunk(TOKENS[:9], 0, [2], True)],
             [SeqChunk([7], len(TOKENS), [0, 1], True), SeqChunk([8], 9, [2], True)],
             [SeqChunk([9], len(TOKENS) + 1, [0, 1], True), SeqChunk([3], 10, [2], True)]]
    held = []

    def check(runner):
        held.append((runner.model.weight_stream, runner.plan.weights,
                     _storage_bytes(runner.model)))

    resident, _ = graphs_and_eager(rc, limits, steps, check)
    graphs, eager = graphs_and_eager(replace(rc, cpu_offload_bytes=64 * MiB), limits, steps,
                                     check)
    for a, b, c in zip(resident, graphs, eager, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    (none, full, full_storages), _, (stream, less, storages), _ = held
    assert none is None and stream.host.is_pinned() and full - less >= 64 * MiB
    assert (full_storages, storages) == (full, less)


def test_sleep_keeps_streaming_and_what_would_load_around_it_is_refused(smollm2_tokenizer):
    """Level 1 copies the slots out and back (the host copy stays where it is): the same
    greedy tokens after the wake-up. Level 2 and a reload would load into the slots, so
    they are refused naming the flag."""
    from tests.server.engine.test_engine_core import run_to_end, submit, tokens_of
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.model.sampling_params import SamplingParams
    from tpserve.server.engine.config import EngineConfig
    from tpserve.server.engine.engine_core import EngineCore
    from tpserve.server.engine.errors import InvalidRequestError
    from tpserve.server.engine.queries import run_query
    from tpserve.server.engine.scheduler import SchedulerConfig

    cfg = RunnerConfig(model=str(embedded_model_path()), kv_cache_memory=16 * MiB,
                       cpu_offload_bytes=40 * MiB)
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                            block_size=16)
    core = EngineCore(ModelRunner(cfg, sched.limits, TPGroup(0, 1, CPU, None)),
                      smollm2_tokenizer, sched, EngineConfig(enable_sleep_mode=True))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def answer(rid: str) -> list[int]:
        outs = submit(core, rid, TOKENS, params)
        run_to_end(core)
        return tokens_of(outs)

    before = answer("a")
    host = core.runner.model.weight_stream.host.clone()
    for what in (("sleep", 2, "abort"), ("reload_weights", "")):
        with pytest.raises(InvalidRequestError, match="--cpu-offload-gb streams the last "
                                                      "layers' weights from host memory"):
            run_query(core, what)
    run_query(core, ("sleep", 1, "abort"))
    run_query(core, ("wake_up", None))
    assert answer("b") == before
    assert torch.equal(core.runner.model.weight_stream.host, host)
