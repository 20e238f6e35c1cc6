"""The peer-to-peer all-reduce (symmetric memory) against the plain sum.

It needs one GPU per rank (PyTorch refuses symmetric buffers of two ranks on one device,
seen on the one-GPU H200 machine); speed is measured by ``bench/bench_tp.py``. On CPU,
``create`` declines and the communicator keeps gloo (every other parallel test).
"""

from __future__ import annotations

import pytest
import torch

from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.p2p_all_reduce import P2PAllReduce, P2PLimits
from tpserve.parallel.state import TPGroup

LIMITS = P2PLimits(one_shot_max_bytes=64 * 1024, two_shot_max_bytes=1 << 20)
# (elements, dtype): one-shot (8 KiB: one token of an 8B model in bf16), its limit, two-shot
CASES = [(4096, torch.bfloat16), (16384, torch.float32), (32768, torch.bfloat16),
         (131072, torch.float32), (524288, torch.bfloat16)]


def test_create_declines_without_cuda():
    cpu = torch.device("cpu")
    assert P2PAllReduce.create(None, 2, cpu, single_host=True) is None
    assert P2PAllReduce.create(None, 1, cpu, single_host=True) is None


def _sums(group: TPGroup) -> list[float]:
    device = torch.device("cuda", group.rank)
    torch.cuda.set_device(device)
    p2p = P2PAllReduce.rendezvous(group.group, group.world_size, device, LIMITS)
    comm = Communicator(group, p2p)
    errors = []
    for n, dtype in CASES:
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(dtype)
              for r in range(group.world_size)]
        want = torch.stack([x.float() for x in xs]).sum(0)
        x = xs[group.rank].to(device)
        assert p2p.handles(x)
        got = comm.all_reduce(x)
        errors.append((got.float().cpu() - want).abs().max().item())
        assert torch.equal(x.cpu(), xs[group.rank])  # the input is left unchanged
    # inside a CUDA graph: capture once, replay with new inputs in the same static buffer
    static = torch.zeros(4096, dtype=torch.bfloat16, device=device)
    comm.all_reduce(static)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = comm.all_reduce(static)
    for step in range(3):
        static.fill_(float(group.rank + step))
        graph.replay()
        want = sum(r + step for r in range(group.world_size))
        errors.append((out.float() - want).abs().max().item())
    torch.cuda.synchronize()
    return errors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="peer-to-peer memory: 2+ GPUs")
@pytest.mark.parametrize("tp", [2])
def test_p2p_all_reduce_equals_the_sum(tp):
    for errors in run_ranks(_sums, tp, timeout_s=240):
        # bf16 inputs summed in fp32 inside the kernel, rounded to bf16 once
        assert max(errors) <= 0.0625, errors
