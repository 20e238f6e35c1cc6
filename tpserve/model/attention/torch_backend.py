"""The torch reference attention back-end: the CPU path and the oracle of the Triton one.
It needs nothing beyond the common metadata (it reads sizes on the host), so it is never
captured in a CUDA graph."""

from __future__ import annotations

import torch

from tpserve.model.attention.backend import AttentionBackend
from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kernels import torch_ops


class TorchAttention(AttentionBackend):
    name = "torch"

    def rope_and_write_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                          meta: AttentionMetadata, kv_scale=None,
                          head_norm=None) -> torch.Tensor:
        q, _ = torch_ops.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache,
                                           v_cache, meta.slot_mapping, kv_scale,
                                           hadamard=self.k_hadamard, head_norm=head_norm)
        return q

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scale=None, window=None, softcap=None) -> torch.Tensor:
        return torch_ops.paged_attention(q, k_cache, v_cache, meta, scale, kv_scale, window,
                                         softcap)


BACKEND = TorchAttention
