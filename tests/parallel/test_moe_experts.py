"""``ParallelExperts``: the grouped products over tokens sorted by expert equal a loop over
experts in float64 (the oracle), unsharded and summed over 2 and 3 gloo ranks (a width of
10 padded to 16, 8 and 8 columns per rank: the grouped product's 16-byte alignment), with experts no token chose, every token on
one expert, and duplicate rows; its loader refuses what does not fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.model.kernels.torch_ops import grouped_mm
from tpserve.model.layers.moe import expert_param, route
from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.moe import DOWN, GATE, UP, ParallelExperts
from tpserve.parallel.state import TPGroup

E, H, WIDTH, T, K = 6, 16, 10, 9, 2


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _weights(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, WIDTH, H, generator=g), torch.randn(E, WIDTH, H, generator=g),
            torch.randn(E, H, WIDTH, generator=g))


def _oracle(x, ids, weights, gate, up, down) -> torch.Tensor:
    """A loop over experts: each one's tokens gathered, run, weighted, added back."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for e in range(E):
        token, j = torch.where(ids == e)
        xe = x[token].double()
        h = F.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)
        out.index_add_(0, token, (h @ down[e].double().T) * weights[token, j, None].double())
    return out


def _routings() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, 1] -= 100.0  # expert 1 gets no token
    weights, ids = route(logits, K, True)
    assert 1 not in ids.tolist() and len(set(ids.flatten().tolist())) == E - 1
    one = torch.stack([torch.full((T,), 4), torch.full((T,), 4)], 1)  # twice the same one
    return {"routed": (x, ids, weights),
            "one_expert": (x, one, torch.rand(T, K, generator=g)),
            "one_token": (x[:1], ids[:1], weights[:1])}


def _partial_sums(group: TPGroup) -> dict[str, torch.Tensor]:
    comm = Communicator(group)
    experts = ParallelExperts(E, H, WIDTH, comm, torch.float32)
    gate, up, down = _weights()
    for e in range(E):
        for part, w in ((GATE, gate[e]), (UP, up[e]), (DOWN, down[e])):
            experts.weight_loader(experts.w2 if part == DOWN else experts.w13, w, (e, part))
    # a shard each, 16 columns at tp 1 (10 aligned to 8), 8 at tp 2 and 3 (5 and 4 aligned)
    assert experts.w13.shape == (E, 2 * (16 if comm.world_size == 1 else 8), H)
    return {name: comm.all_reduce(experts(x, ids, w, _silu_and_mul, grouped_mm))
            for name, (x, ids, w) in _routings().items()}


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_experts_equal_a_loop_over_experts(tp):
    gate, up, down = _weights()
    want = {name: _oracle(x, ids, w, gate, up, down)
            for name, (x, ids, w) in _routings().items()}
    for got in run_ranks(_partial_sums, tp):
        for name, value in got.items():
            torch.testing.assert_close(value.double(), want[name], atol=1e-4, rtol=1e-5,
                                       msg=name)


def test_route_is_transformers_softmax_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, 0.0, 0.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [1, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_expert_names_and_refusals():
    assert expert_param("model.layers.3.mlp.experts.7.gate_proj.weight") == (
        "model.layers.3.mlp.experts.w13", (7, GATE))
    assert expert_param("model.layers.0.mlp.experts.12.w2.weight") == (
        "model.layers.0.mlp.experts.w2", (12, DOWN))
    assert expert_param("model.layers.0.mlp.experts.1.w3.weight")[1] == (1, UP)
    assert expert_param("model.layers.0.mlp.gate.weight") is None
    assert expert_param("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    experts = ParallelExperts(E, H, WIDTH, Communicator(TPGroup(0, 1, torch.device("cpu"),
                                                                 None)), torch.float32)
    with pytest.raises(ValueError, match="expert 6 of a model with 6 experts"):
        experts.weight_loader(experts.w13, torch.zeros(WIDTH, H), (6, GATE))
    with pytest.raises(ValueError, match=r"shape \(10, 15\), expected \(10, 16\)"):
        experts.weight_loader(experts.w13, torch.zeros(WIDTH, H - 1), (0, UP))


def test_expert_ranges_cover_every_expert_once():
    from tpserve.parallel.moe import expert_range

    assert [expert_range(5, 3, r) for r in range(3)] == [(0, 2), (2, 2), (4, 1)]
    assert [expert_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [expert_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    with pytest.raises(ValueError, match="2 experts for 4 ranks"):
        ParallelExperts(2, H, WIDTH, Communicator(TPGroup(0, 4, torch.device("cpu"), None)),
                        torch.float32, expert_parallel=True)
