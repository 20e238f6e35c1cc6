"""The WNA16 kernels compile for Hopper (sm_90) on this machine, GPU or not: every launch
the wrappers make for fp16 / bf16 / fp32, 4 and 8 bits, scales per K step, per packed
row, per column and act-order sorted, at M = 1 (GEMV and 16-row dot), 33 and 170, with
float offsets (GGUF's Q4_1), the transposed product's launches as sm_90 wgmma, and the
fp16 GEMV's code pairs in PTX (``hopper_compile.py``).

The interpreter the other kernel tests use off CUDA cannot see an error that only the
compiler raises; the first H200 compile of the rewritten kernel failed on one
(``bench/README.md``, round 30), which this test finds without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_wna16_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.model.hopper_compile"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    # 3 dtypes x 2 widths x 4 layouts: M = 1 (GEMV and 16-row dot) and 33 fused, M = 170
    # dequantized; the GEMV's K split (three 128-column steps) reduced by triton_fp8's
    # kernel; then float offsets, 3 dtypes at M = 1, 33 (fused) and 170 (dequantized);
    # then GGUF's K-quant forms (groups of 16: 8 and 4 bits, offsets or a zero point), 3
    # dtypes x 4 at the same M; then the transposed product, 2 dtypes x 2 layouts x 4
    # tiles, each a wgmma; then the fp16 GEMV with code pairs, 2 widths x 3 layouts, split
    # in three
    assert compiled == {"_wna16_kernel": 72 + 6 + 24 + 16 + 6,
                        "_wna16_dequant_kernel": 24 + 3 + 12,
                        "_wo_reduce_kernel": 24 + 3 + 12 + 6}
