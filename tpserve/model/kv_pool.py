"""The preallocated paged KV pool: every layer's K and V blocks in one allocation, in the
KV cache dtype (``--kv-cache-dtype``; the model's dtype by default), which the attention
back-end writes and reads."""

from __future__ import annotations

import torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (K and V) on one rank, in KV dtype ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class KVPool:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype`` (the
    KV cache dtype), allocated once; the layout both attention back-ends read.

    Block ``b`` of every layer holds the same ``block_size`` token positions of one
    sequence; which sequence is the block manager's business. Slot ``s`` is block
    ``s // block_size``, offset ``s % block_size``. Never reallocated while serving; sleep
    mode (``sleep.py``) empties its storage and refills it in place, zeroed.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # CPU: untouched pages cost nothing until used; GPU: zeroed once.
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.buffer = alloc(shape, dtype=dtype, device=device)
        self.layers = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
