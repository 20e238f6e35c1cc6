"""The attention seam: one back-end object per implementation, chosen once at start-up
(``select_attention``) and handed to the model's attention layers.

A back-end owns
- its metadata: what its kernels need beyond the common ``AttentionMetadata``. The part
  that must come from the host (the step's shape) is built on rank 0 by ``plan_extra``,
  travels in the plan as ``StepPlan.attn_extra`` (int64, opaque to everything else) and
  becomes the back-end's metadata on every rank through ``metadata``;
- the KV cache dtype (``kv_cache_dtype``, any of bf16/fp16/fp32/fp8-e4m3 whatever the
  model's dtype): ``rope_and_write_kv`` rounds K/V into the cache's dtype, ``forward``
  reads it back. An FP8 cache is scaled by the layer's ``kv_scale`` (``[2]`` float32 device
  tensor, K's then V's; the convention is ``model/kv_cache_dtype``'s), which both methods
  take and other dtypes ignore. With ``k_hadamard`` (``--kv-cache-hadamard``,
  ``model/kv_hadamard``) q and K are rotated by a Hadamard matrix after RoPE, so the cache
  holds rotated K. The layout is the pool's (``KVPool``), shared by both back-ends;
- its static buffers for CUDA graphs (``graph_state``): what ``StepGraphs`` copies a
  step's back-end metadata into, and the capture-shaped metadata its graphs bake in.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kernels.torch_ops import HeadNorm
from tpserve.model.kv_hadamard import partial_rotary_refusal

ATTENTION_BACKENDS = {"torch": "tpserve.model.attention.torch_backend",
                      "triton": "tpserve.model.attention.triton_backend"}


class GraphAttentionState:
    """A back-end's static buffers for mixed-step CUDA graphs; the default has none (the
    torch reference is never captured: it reads sizes on the host)."""

    def reset(self) -> None:
        """Neutral values before capture: nothing is read or written through them."""

    def fill(self, meta: AttentionMetadata, extra: torch.Tensor) -> None:
        """Copies one real step's back-end inputs (its common metadata and its
        ``attn_extra``) into the static buffers."""

    def mixed_metadata(self, static: AttentionMetadata, bucket: int) -> AttentionMetadata:
        """The metadata a mixed-step graph of ``bucket`` tokens bakes in: ``static`` has
        every sequence slot (``num_decodes`` 0, padding sequences of length 0)."""
        return static


class AttentionBackend(ABC):
    """RoPE + KV write and paged attention over the pool (see the module docstring)."""

    name: str

    def __init__(self, kv_cache_dtype: torch.dtype, k_hadamard: bool = False,
                 overlap: bool = False,
                 queries: tuple[torch.dtype, torch.device] | None = None):
        self.kv_cache_dtype = kv_cache_dtype
        self.k_hadamard = k_hadamard
        self.overlap = overlap  # decode and prefill attention at once, where it can
        # queries (the model's activation dtype and device): for a back-end whose launch
        # shapes depend on them (Triton's prefill tiles); ignored here

    def check_model(self, head_dim: int, rotary_dim: int, head_norm: bool) -> None:
        """ValueError, naming the flag to change, when this back-end cannot serve heads of
        ``head_dim`` whose first ``rotary_dim`` dims RoPE rotates (with ``head_norm``: after
        Qwen3's q/k head norm). Here: the Hadamard rotation with partial RoPE (refused on
        both back-ends, as ``resolve_kv_cache_hadamard`` refuses it)."""
        if self.k_hadamard and rotary_dim != head_dim:
            raise ValueError(partial_rotary_refusal(rotary_dim, head_dim))

    def plan_extra(self, query_lens: list[int], num_decodes: int) -> list[int]:
        """Rank 0, host: what the kernels need beyond the common plan for a step whose
        sequences have ``query_lens`` new tokens, the first ``num_decodes`` decoding."""
        return []

    def max_plan_extra(self, num_tokens: int, num_seqs: int) -> int:
        """An upper bound on ``len(plan_extra(...))`` for any step within the limits."""
        return 0

    def metadata(self, common: AttentionMetadata, extra: torch.Tensor | None = None
                 ) -> AttentionMetadata:
        """This back-end's metadata for a step (``extra`` is the plan's ``attn_extra``;
        None: derive it, which may read the device: tests and tools only)."""
        return common

    def graph_state(self, max_num_seqs: int, max_tokens: int, device: torch.device
                    ) -> GraphAttentionState:
        return GraphAttentionState()

    @abstractmethod
    def rope_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, kv_scale: torch.Tensor | None = None,
                          head_norm: HeadNorm | None = None) -> torch.Tensor:
        """``head_norm`` (Qwen3's q/k head RMSNorm) when given, RoPE on q and k (and the
        Hadamard rotation with ``k_hadamard``), K/V written to their slots in the cache's
        dtype (FP8: divided by ``kv_scale``, saturated at ±448); returns the rotated q."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scale: torch.Tensor | None = None,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Causal attention of the new tokens ``q [T, Hq, D]`` over their sequences'
        cached context (their own K/V already written; FP8 read as ``q * kv_scale``);
        with a sliding ``window`` W (the layer's, fixed at build: graphs capture it), a
        token at position p attends to positions p - W + 1 .. p only (transformers' mask);
        with ``softcap`` c (Gemma 2's ``attn_logit_softcapping``, fixed at build likewise;
        None: off, else a finite c > 0, ValueError otherwise) each logit
        ``s = q.k * scale`` becomes ``c * tanh(s / c)`` before the mask and the softmax
        (transformers' eager attention). Returns ``[T, Hq, D]``."""


def select_attention(backend: str, kv_cache_dtype: torch.dtype, k_hadamard: bool = False,
                     overlap: bool = False,
                     queries: tuple[torch.dtype, torch.device] | None = None
                     ) -> AttentionBackend:
    """The back-end of a resolved name (``torch`` or ``triton``); ``overlap``
    (``--overlap-attention``) and ``queries`` (the model's dtype and device: the prefill
    tiles' height) are the Triton back-end's, which the torch one ignores."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention back-end {backend!r}; choose one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    module = importlib.import_module(ATTENTION_BACKENDS[backend])
    return module.BACKEND(kv_cache_dtype, k_hadamard, overlap, queries)
