"""Random WNA16 operands in the served layout, for the kernel tests
(``test_triton_wna16.py``) and the sm_90 compile check (``hopper_compile.py``). Imports no
Triton: each caller sets ``TRITON_INTERPRET`` as it needs before Triton is imported."""

from __future__ import annotations

import torch

from tpserve.model.quant.wna16 import consecutive_groups, pack_rows, sort_columns

# how the groups are served: in column order with ``runs`` (the kernels read a scale row
# per K step or per packed row), without (one per column), act-order sorted by group
# (``perm``, ``runs``) or left unsorted (a row-parallel rank's: one per column)
LAYOUTS = ["grouped", "columns", "act-order", "act-order-unsorted"]


def operands(m: int, n: int, k: int, bits: int, dtype: torch.dtype, seed: int,
             layout: str = "grouped", group: int = 32, device: torch.device | str = "cpu"):
    """Random codes, positive scales, integer zero points anywhere in the code range (the
    served layout's contract) and activations ``x [M, K]``, in the served layout of
    ``layout`` (``LAYOUTS``) on ``device``: ``(x, qweight, scales, zeros, g_idx, perm,
    runs)``."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (k, n), generator=g)
    groups = -(-k // group)
    g_idx = torch.arange(k) // group
    if layout.startswith("act-order"):
        g_idx = g_idx[torch.randperm(k, generator=g)]
    scales = (torch.rand(groups, n, generator=g) + 0.5) * 2 / (2**bits * k**0.5)
    zeros = torch.randint(0, 2**bits + 1, (groups, n), generator=g).float()
    x = torch.randn(m, k, generator=g)
    qweight, g_idx = pack_rows(codes, bits), g_idx.to(torch.int32)
    perm = runs = None
    if layout == "grouped":
        runs = consecutive_groups(g_idx, groups)
        assert runs is not None
    elif layout == "act-order":
        qweight, g_idx, perm, runs = sort_columns(qweight, g_idx, bits, groups, chunk=k * 7)
        assert perm is not None and runs == (0, group)
    return (x.to(dtype).to(device), qweight.to(device), scales.to(dtype).to(device),
            zeros.to(dtype).to(device), g_idx.to(device),
            None if perm is None else perm.to(device), runs)
