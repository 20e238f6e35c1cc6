"""Triton ops for the CUDA path: the same functions, signatures and semantics as torch_ops.

Each op lives in its own ``triton_*`` module; this module is the drop-in namespace
(``ops = triton_ops if cuda else torch_ops``) and composes ``paged_attention`` from the
decode and prefill kernels. Differences from the reference, all within rounding:
``rope_and_write_kv`` rotates ``q`` and ``k`` in place (and returns them); attention rounds
probabilities to the input dtype before the P.V matmul.
"""

from __future__ import annotations

import torch

from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kernels.triton_activation import silu_and_mul
from tpserve.model.kernels.triton_decode_attention import decode_attention, decode_num_splits
from tpserve.model.kernels.triton_norm import add_rms_norm, rms_norm
from tpserve.model.kernels.triton_prefill_attention import prefill_attention
from tpserve.model.kernels.triton_rope import rope_and_write_kv

__all__ = ["add_rms_norm", "paged_attention", "rms_norm", "rope_and_write_kv", "silu_and_mul"]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the new tokens ``q [T, Hq, D]`` over their sequences' cached context.

    The K/V of the new tokens must already be in the cache. The first ``meta.decode_slots``
    rows go to the split-K decode kernel, then the prefill kernel works through
    ``meta.prefill_tiles`` (and overwrites any prefill row a padding decode slot zeroed).
    Both launch shapes come from host ints and tensor sizes only, so any step is CUDA-graph
    capturable once its buffers are static. Rows no tile or slot covers (padding tokens)
    are left unwritten.
    """
    out = torch.empty_like(q)
    slots = meta.num_decode_slots
    if slots:
        splits = decode_num_splits(slots, k_cache.shape[2], meta.max_seq_len)
        decode_attention(q[:slots], k_cache, v_cache, meta.block_tables[:slots],
                         meta.decode_lens(), scale, out[:slots], splits)
    if meta.num_seqs > meta.num_decodes:
        prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, meta.tiles(), scale, out)
    return out
