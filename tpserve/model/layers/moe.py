"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite-MoE) on
tensor-parallel experts, and the checkpoint names of its tensors.

Each token's router logits (a replicated ``[E, H]`` product, in the model's dtype) go
through a float32 softmax; the ``k`` most probable experts take the token, weighted by
their probabilities (renormalized to sum 1 where ``norm_topk_prob``), as transformers
routes. Every rank routes every token alike (the router and its input are replicated), runs
its columns of the chosen experts (``parallel.moe.ParallelExperts``) and, with Qwen2-MoE's
shared expert, adds that expert's partial sums times its sigmoid gate; the block's one
all-reduce (or reduce-scatter, sequence parallel) sums both.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model.config import ModelConfig
from tpserve.model.kernels.backend import Ops
from tpserve.parallel.comm import Communicator
from tpserve.parallel.moe import DOWN, GATE, UP, ParallelExperts
from tpserve.parallel.shard import as_source, copy_into

# Mixtral's names of an expert's parts (w1 the gate, w3 the up, w2 the down projection)
# and Qwen's
_PARTS = {"w1": GATE, "w3": UP, "w2": DOWN, "gate_proj": GATE, "up_proj": UP,
          "down_proj": DOWN}
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                     r"\.weight$")
# every expert stacked in one tensor per part: transformers 5's own layout (gate and up
# fused, no ``.weight``) and llama.cpp's (``ffn_gate_exps``, ...: one part each)
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)"
                      r"(\.weight)?$")
_STACKED_PARTS = {"gate_up_proj": None, "gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}


# other names of a mixture of experts' tensors -> ours (Mixtral's and Granite-MoE's block
# ``block_sparse_moe`` is ``mlp``; Granite-MoE's router and stacked experts)
_RENAMED = ((".block_sparse_moe.", ".mlp."), (".mlp.router.layer.weight", ".mlp.gate.weight"),
            (".mlp.router.weight", ".mlp.gate.weight"),
            (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".mlp.output_linear.weight", ".mlp.experts.down_proj"))


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as ``SparseMoeBlock`` names it (``_RENAMED``)."""
    for theirs, ours in _RENAMED:
        name = name.replace(theirs, ours)
    return name


def expert_param(name: str) -> tuple[str, tuple[int, str] | str | None] | None:
    """A checkpoint's expert tensor (``...mlp.experts.7.gate_proj.weight``; Mixtral's
    ``block_sparse_moe`` already renamed ``mlp``) -> the ``ParallelExperts`` parameter that
    holds it and its ``(expert, part)`` shard id; a tensor of every expert stacked
    (``...mlp.experts.gate_up_proj``, ``down_proj``; a GGUF file's ``gate_proj``, ...)
    -> its parameter and its part (None: gate and up), loaded by
    ``ParallelExperts.load_stacked``; None for any other name."""
    m = _EXPERT.match(name)
    if m is not None:
        part = _PARTS[m.group(3)]
        return f"{m.group(1)}.{'w2' if part == DOWN else 'w13'}", (int(m.group(2)), part)
    m = _STACKED.match(name)
    if m is not None:
        part = _STACKED_PARTS[m.group(2)]
        return f"{m.group(1)}.{'w2' if part == DOWN else 'w13'}", part
    return None


class ExpertLoading:
    """A checkpoint's expert tensors loaded into ``model``'s ``ParallelExperts``, and which
    ``(expert, part)``s each parameter has got: it counts as loaded (``complete``) once
    every expert's every part has, so a checkpoint missing one expert is refused."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], num_experts: int):
        self.model = model
        self.params = params  # model.named_parameters(), as the caller already holds them
        self.num_experts = num_experts
        self.parts: dict[str, set[tuple[int, str]]] = {}

    def load(self, name: str, source) -> bool:
        """Loads ``name`` if it is an expert tensor (``expert_param``); False otherwise."""
        found = expert_param(name)
        if found is None:
            return False
        param_name, part = found
        param = self.params.get(param_name)
        if param is None:
            raise ValueError("no place in the model (a dense layer's MLP)")
        experts = self.model.get_submodule(param_name.rpartition(".")[0])
        if isinstance(part, tuple):  # one expert's part
            param.weight_loader(param, source, part)
            done = [part]
        else:  # every expert stacked: one part, or (None) gate and up
            experts.load_stacked(param, source, part)
            kinds = (part,) if part is not None else (GATE, UP)
            done = [(e, k) for e in range(self.num_experts) for k in kinds]
        self.parts.setdefault(param_name, set()).update(done)
        return True

    def complete(self) -> set[str]:
        """The expert parameters every expert's every part of which was loaded."""
        return {name for name, parts in self.parts.items()
                if len(parts) == self.num_experts * (1 if name.endswith(".w2") else 2)}


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_k`` experts by softmax probability (float32) -> (weights, ids),
    both ``[T, top_k]``, the weights summing to 1 per row with ``renormalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class _Replicated(nn.Module):
    """A weight every rank holds whole (the router, the shared expert's gate)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source, shard_id=None) -> None:
        """The whole tensor; a one-row weight may come as a vector (llama.cpp's
        ``ffn_gate_inp_shexp``)."""
        value = as_source(source).read()
        if param.shape[0] == 1 and value.dim() == 1:
            value = value[None]
        copy_into(param, value, "replicated weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """The MLP of one of ``ModelConfig.moe_layers``; parameters named as transformers names
    them (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``) but for the
    experts' fused ``w13`` / ``w2`` (``expert_param``). ``reduce``: ``all_reduce`` or
    ``reduce_scatter`` (the decoder layer's mode)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, dtype: torch.dtype,
                 reduce: str, shared_expert: nn.Module | None = None, quant_method=None,
                 expert_parallel: bool = False):
        super().__init__()
        self.comm = comm
        self.ops = ops
        self.reduce = reduce
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = _Replicated(cfg.num_experts, cfg.hidden_size, dtype)
        self.experts = ParallelExperts(cfg.num_experts, cfg.hidden_size,
                                       cfg.moe_intermediate_size, comm, dtype, quant_method,
                                       expert_parallel)
        self.shared_expert = shared_expert  # its down projection returns partial sums
        if shared_expert is not None:
            self.shared_expert_gate = _Replicated(1, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        y = self.experts(x, ids, weights, self.ops.silu_and_mul, self.ops.grouped_mm)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.reduce == "all_reduce":
            return self.comm.all_reduce(y)
        return self.comm.reduce_scatter(y)


def experts_line(model: nn.Module, cfg: ModelConfig, weights: int) -> str:
    """The start-up log's line on a mixture of experts: its routing, and the share of this
    rank's ``weights`` bytes its experts hold (the rest is read by every token; of the
    experts, a token reads ``k / E``)."""
    experts = sum(p.numel() * p.element_size() + (s.numel() * s.element_size()
                                                    if s is not None else 0)
                  for m in model.modules() if isinstance(m, ParallelExperts)
                  for p, s in ((m.w13, m.w13_scale), (m.w2, m.w2_scale)))
    gib = 2**30
    return (f"mixture of experts: {cfg.num_experts} experts, {cfg.num_experts_per_tok} per "
            f"token, in {len(cfg.moe_layers)} of {cfg.num_hidden_layers} layers"
            + (f", a shared expert {cfg.shared_expert_intermediate_size} wide"
               if cfg.shared_expert_intermediate_size else "")
            + f"; experts {experts / gib:.2f} GiB of the rank's {weights / gib:.2f} GiB of "
            f"weights, a token reading {cfg.num_experts_per_tok / cfg.num_experts:.1%} of them")
