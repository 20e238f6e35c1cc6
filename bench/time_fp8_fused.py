"""The fused SiLU-gate + per-token fp8 quantizer (``kernels/triton_fp8_fused.py``) on
Llama-3-8B's gate/up output, timed inside CUDA graphs: the row held in registers (the
default up to ``ROW_BLOCK_MAX`` columns) against the chunked two-pass kernel, and the bf16
SiLU gate (``triton_activation``) that the fp8 kernel replaces.

Timing as in ``fp8_gemm.py``: ``--calls`` calls back to back in one graph, the median of
``--replays`` replays; the calls cycle over copies of the input totalling >= ``--rotate-mib``
so that the input comes from HBM. GB/s counts the input read once and the output written.

    python bench/time_fp8_fused.py --out bench/results/h200-DATE-fp8-fused.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_gemm import copies_for, graph_us  # noqa: E402  (bench/fp8_gemm.py)
from measure import git_commit  # noqa: E402

from tpserve.model.kernels import triton_activation, triton_fp8_fused  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 64, 512, 2048, 8192])
    ap.add_argument("--d", type=int, default=14336, help="gate columns (Llama-3-8B, tp 1)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    commit, dirty = git_commit(a.commit)
    rows = []
    for m in a.m:
        g = torch.Generator(device=dev).manual_seed(0)
        n = copies_for(m * 2 * a.d * 2, a.rotate_mib, a.calls)
        xs = [torch.randn(m, 2 * a.d, device=dev, dtype=torch.bfloat16, generator=g)
              for _ in range(n)]
        variants = {
            "fp8_row_in_registers": (lambda x: triton_fp8_fused.silu_and_mul_fp8(x), 1),
            "fp8_chunked": (lambda x: triton_fp8_fused.silu_and_mul_fp8(x, row_block_max=0), 1),
            "bf16_gate": (triton_activation.silu_and_mul, 2),
        }
        row = {"m": m, "d": a.d}
        ref = triton_fp8_fused.silu_and_mul_fp8(xs[0], row_block_max=0)
        got = triton_fp8_fused.silu_and_mul_fp8(xs[0])
        row["codes_equal"] = bool(torch.equal(ref[0].view(torch.uint8), got[0].view(torch.uint8))
                                  and torch.equal(ref[1], got[1]))
        for name, (fn, out_bytes) in variants.items():
            fns = [lambda x=xs[i % n], fn=fn: fn(x) for i in range(a.calls)]
            us = graph_us(fns, a.replays)
            nbytes = m * 2 * a.d * 2 + m * a.d * out_bytes
            row[name] = {"us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "commit": commit, "git_dirty": dirty,
           "timing": f"CUDA graph of {a.calls} calls, median of {a.replays} replays, inputs "
                     f"rotated over >= {a.rotate_mib} MiB", "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
