"""The WNA16 GEMM (GPTQ / AWQ integer weights, ``kernels/triton_wna16.py``) against the dense
``F.linear`` (cuBLAS) in the same dtype, on the Llama-3-8B projection shapes of one
tensor-parallel rank, timed inside CUDA graphs.

For each shape (qkv, o, gate_up, down; ``--tp N`` divides N of qkv / gate_up and K of o /
down, as the column- and row-parallel shards do) and M: ``F.linear`` with a dense ``[N, K]``
weight (``linear``), and the WNA16 kernel at its default launch (``wna16_blocks``) for each
of ``--bits``, group ``--group``, ``g_idx = k // group`` (``w4``, ``w8``) and, with
``--act-order``, a shuffled ``g_idx`` served sorted by group as at tp 1 (``w4_act``,
``w8_act``: ``wna16.sort_columns``, the activations read through ``perm``); ``--offset``: float
offsets after the scale (GGUF's ``Q4_1``) instead of integer zero points. ``--launch
dequant`` also times the dequantized weight times cuBLAS (the launch from
``DEQUANT_MIN_M`` rows) at every M. ``--sweep`` also times the
launches of ``candidates`` (``axes``: the default with one of block M / N / K, warps, stages
or the split, x0.5 / x1 / x2 of ``fill_split``, changed; ``grid``: every combination) and
``--launch`` given ``WoConfig`` strings, as ``w4[wna16,BM,BN,BK,SPLIT,WARPS,STAGES]`` (the
split resolved as the kernel cuts it; ``dequant,0,CHUNK,0,1,0``: the dequantized weight
``CHUNK`` output columns at a time through one scratch), and records the fastest as ``<variant>_best``
(``axes``: about 10-15 launches per variant and M; ``grid``: hundreds: narrow it with ``--m``,
``--shapes``, ``--bits`` and fill the Triton cache first with ``--compile-only`` workers).

Timing (``fp8_gemm.graph_us``): ``--calls`` calls in one CUDA graph, cycling over copies of
the weight totalling >= ``--rotate-mib`` (so each streams from HBM, not L2), the median of
``--replays`` replays. Each entry: ``us``; ``weight_gbps``: the weight bytes read (qweight +
scales + zeros, or the dense weight) per second; ``tflops`` (2 M N K); ``speedup``: the
``linear`` time over this one; ``max_abs_diff`` from ``quant.wna16.linear`` in the same dtype
(reported, not asserted; ``ref_absmax`` for scale).

    python bench/time_wna16.py --out results/h100-DATE-wna16.json --act-order --git-commit SHA
    python bench/time_wna16.py --out results/wna16-sweep.json --sweep --m 1 2 4 8 16 --bits 4
    python bench/time_wna16.py --compile-only --sweep --worker 3/8   # fill the Triton cache
    python bench/time_wna16.py --device cpu --smoke --sweep --act-order   # interpreted check

Prints one JSON line per (shape, M), then a table; ``--out`` is rewritten after every row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROW_PARALLEL = ("o", "down")  # their K is split over the ranks; the others' N
M_ALL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048]
SMOKE_SHAPES, SMOKE_M = {"tiny": (64, 256)}, [1, 5]
AXES = {"block_m": (1, 16, 32, 64, 128), "block_n": (16, 32, 64, 128, 256),
        "block_k": (64, 128, 256),
        "num_warps": (4, 8), "num_stages": (2, 3, 4)}
SPLIT_FACTORS = (0.5, 1, 2)


def resolve(cfg, m: int, n: int, k: int, sms: int, fill_split, factor: float = 1) -> str:
    """``cfg``'s string with the split as the kernel runs it: 0 -> ``fill_split`` times
    ``factor``, then cut to whole ``block_k`` steps with no empty chunk (``split_k``)."""
    if cfg.kind == "dequant":  # the dequantized weight times cuBLAS: no tiles
        return ",".join(map(str, cfg)) if cfg.block_n else "dequant"  # block_n: a chunk
    split = cfg.split or max(1, int(factor * fill_split(
        -(-m // cfg.block_m) * -(-n // cfg.block_n), k, cfg.block_k, sms, cfg.block_m)))
    steps = -(-k // cfg.block_k)
    chunk = -(-steps // max(1, min(split, steps))) * cfg.block_k
    return ",".join(map(str, cfg._replace(split=-(-k // chunk))))


def candidates(kern, m: int, n: int, k: int, sms: int, mode: str, dtype: torch.dtype
               ) -> list[str]:
    """``--sweep``'s launches for ``(M, N, K)`` (the default's excluded); tiles of more rows
    than ``max(16, M)`` rounded up to a power of two are left out (padding only), and the
    one-row GEMV above two rows (it reads the weight once a row)."""
    base = kern.wna16_blocks(m, n, k, sms, dtype)._replace(split=0)
    if base.kind == "dequant":  # sweep the fused kernel's largest tile against it
        base = kern.WoConfig("wna16", 64, 128, 128, 0, 8, 3)
    if mode == "grid":
        pairs = [(base._replace(**dict(zip(AXES, vals, strict=True))), f)
                 for vals in itertools.product(*AXES.values()) for f in SPLIT_FACTORS]
    else:
        pairs = [(base._replace(**{field: v}), 1) for field, vs in AXES.items() for v in vs]
        pairs += [(base, f) for f in SPLIT_FACTORS]
    top_m = max(16, 1 << (m - 1).bit_length())
    default = resolve(kern.wna16_blocks(m, n, k, sms, dtype), m, n, k, sms, kern.fill_split)
    out = []
    for cfg, f in pairs:
        spec = resolve(cfg, m, n, k, sms, kern.fill_split, f)
        if (cfg.block_m <= top_m and (cfg.block_m > 1 or m <= 2) and spec != default
                and spec not in out):
            out.append(spec)
    return out


def cpu_us(fns, replays: int) -> float:
    """Median µs of ``fns[0]`` called in a plain loop (the interpreter: no graphs)."""
    fns[0]()
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        fns[0]()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help=f"tiny shape {SMOKE_SHAPES}, M {SMOKE_M}")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--m", type=int, nargs="+", default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--offset", action="store_true",
                    help="float offsets added after the scale (W = q * s + z, GGUF's Q4_1; "
                         "with --group 32 and --bits 4 the embedded SmolLM2's blocks)")
    ap.add_argument("--act-order", action="store_true", help="also a shuffled g_idx")
    ap.add_argument("--sweep", nargs="?", const="axes", choices=["axes", "grid"])
    ap.add_argument("--launch", nargs="*", default=[], help="extra WoConfig strings to time")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--compile-only", action="store_true", help="run each launch once, untimed")
    ap.add_argument("--worker", default="0/1", help="i/n: this process's share of (shape, M)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--git-commit", default=None, help="the commit measured (else git here)")
    a = ap.parse_args()
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if dev.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import triton
    from fp8_gemm import copies_for, graph_us
    from measure import git_commit

    from tpserve.model.kernels import triton_wna16 as kern
    from tpserve.model.kernels.triton_fp8 import _sm_count
    from tpserve.model.quant.wna16 import consecutive_groups, linear, pack_rows, sort_columns

    shapes = SMOKE_SHAPES if a.smoke else {s: SHAPES[s] for s in a.shapes}
    ms = a.m or (SMOKE_M if a.smoke else M_ALL)
    wi, wn = (int(v) for v in a.worker.split("/"))
    sms, calls = _sm_count(dev), 1 if a.compile_only or dev.type == "cpu" else a.calls
    commit, dirty = git_commit(a.git_commit)
    meta = {"git_commit": commit, "dirty": dirty, "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda" else "cpu (Triton interpreter)", "torch": torch.__version__,
            "triton": triton.__version__, "dtype": a.dtype, "tp": a.tp, "group": a.group,
            "offset": a.offset,
            "timing": f"CUDA graph of {a.calls} calls, median of {a.replays} replays, weights "
                      f"rotated over >= {a.rotate_mib} MiB" if dev.type == "cuda" else
                      f"plain loop, median of {a.replays}", "rows": []}
    rows, task = meta["rows"], -1

    def timed(fns) -> float:
        return graph_us(fns, a.replays) if dev.type == "cuda" else cpu_us(fns, a.replays)

    def copies(nbytes: int) -> int:
        return 1 if calls == 1 else copies_for(nbytes, a.rotate_mib, calls)

    for name, (n, k) in shapes.items():
        if not a.smoke and a.tp > 1:
            n, k = (n, k // a.tp) if name in ROW_PARALLEL else (n // a.tp, k)
        assert k % a.group == 0, f"{name}: K {k} is not whole groups of {a.group}"
        gen = torch.Generator(device=dev).manual_seed(0)
        w16 = (torch.randn(n, k, generator=gen, device=dev) / k**0.5).to(dtype)
        dense = n * k * w16.element_size()
        # name -> (bits, [(qweight, scales, zeros, g_idx)] copies, (perm, runs), weight bytes)
        wvars = {}
        for bits in a.bits:
            q = pack_rows(torch.randint(0, 2**bits, (k, n), generator=gen, device=dev), bits)
            scales = ((torch.rand(k // a.group, n, generator=gen, device=dev) + 0.5) * 2
                      / (2**bits * k**0.5)).to(dtype)
            zeros = torch.randint(0, 2**bits, scales.shape, generator=gen, device=dev).to(dtype)
            if a.offset:  # GGUF Q4_1: the block's minimum, about -2**(bits-1) scales
                zeros = (-(2 ** (bits - 1)) * scales.float()
                         * (1 + 0.1 * torch.randn(scales.shape, generator=gen, device=dev))
                         ).to(dtype)
            g_idx = (torch.arange(k, device=dev) // a.group).int()
            nbytes = q.numel() * 4 + 2 * scales.numel() * scales.element_size()
            sets = [(q, scales, zeros)] + [(q.clone(), scales.clone(), zeros.clone())
                                           for _ in range(copies(nbytes) - 1)]
            groups = scales.shape[0]
            orders = {"": (sets, g_idx, None, consecutive_groups(g_idx, groups))}
            if a.act_order:  # served sorted by group, as Wna16Method serves it at tp 1
                shuffled = g_idx[torch.randperm(k, generator=gen, device=dev)].int()
                sorted_sets = []
                for qs, sc, zs in sets:
                    q2, g2, perm, runs = sort_columns(qs, shuffled, bits, groups)
                    sorted_sets.append((q2, sc, zs))
                orders["_act"] = (sorted_sets, g2, perm, runs)
            for suffix, (vsets, g, perm, runs) in orders.items():
                wvars[f"w{bits}{suffix}"] = (bits, [(*s, g.clone()) for s in vsets],
                                             (perm, runs), nbytes)
        w_c = [w16] + [w16.clone() for _ in range(copies(dense) - 1)]
        for m in ms:
            task += 1
            if task % wn != wi:
                continue
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            # the launch wna16_matmul picks for the variants in column order (act-order
            # ones without the code pairs: their scales are per column)
            default = resolve(kern.default_launch(m, n, k, sms, dtype, dev, a.offset,
                                                  (0, a.group), 8), m, n, k, sms,
                              kern.fill_split)
            row = {"shape": name, "m": m, "n": n, "k": k, "default_launch": default}

            def entry(fns, nbytes, ref=None, base_us=None, m=m, n=n, k=k):
                us = timed(fns)
                e = {"us": round(us, 2), "weight_gbps": round(nbytes / us / 1e3, 1),
                     "tflops": round(2 * m * n * k / us / 1e6, 3)}
                if ref is not None:
                    e["speedup"] = round(base_us / us, 3)
                    e["max_abs_diff"] = float((fns[0]().float() - ref).abs().max())
                return e

            if not a.compile_only:
                row["linear"] = entry([partial(F.linear, x, w_c[i % len(w_c)])
                                       for i in range(calls)], dense)
            extra = [s if s == "dequant" else
                     resolve(kern.WoConfig.parse(s), m, n, k, sms, kern.fill_split)
                     for s in a.launch]
            extra += candidates(kern, m, n, k, sms, a.sweep, dtype) if a.sweep else []
            for v, (bits, sets, (perm, runs), nbytes) in wvars.items():
                ref = (None if a.compile_only else
                       linear(x, *sets[0], bits, runs=runs, perm=perm,
                              offset=a.offset).float())
                results = {}  # launch -> its entry
                for launch in dict.fromkeys([default, *extra]):
                    cfg = None if launch == default else launch  # None: the served path
                    # one graph's calls, each on the next copy of the weight
                    fns = [partial(kern.wna16_matmul, x, *sets[i % len(sets)], bits, None, cfg,
                                   perm, runs, a.offset) for i in range(calls)]
                    try:
                        if a.compile_only:
                            fns[0]()
                            continue
                        results[launch] = entry(fns, nbytes, ref, row["linear"]["us"])
                    except Exception as exc:  # noqa: BLE001 - a launch that fails to compile
                        results[launch] = {"error": repr(exc)[:200]}
                    row[v if cfg is None else f"{v}[{launch}]"] = results[launch]
                if a.compile_only:
                    continue
                if "us" in row[v]:
                    row[v]["ref_absmax"] = float(ref.abs().max())
                ok = [(e["us"], launch) for launch, e in results.items() if "us" in e]
                if extra and ok:
                    us, launch = min(ok)
                    row[f"{v}_best"] = {"launch": launch, **results[launch], "vs_default":
                                        round(row[v]["us"] / us, 3) if "us" in row[v] else None}
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if a.compile_only:
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(meta, indent=1) + "\n")
        del w_c, wvars
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not a.compile_only:
        print_table(rows, [v for v in rows[0] if v[:1] == "w" and "[" not in v
                           and not v.endswith("_best")] if rows else [])


def print_table(rows: list[dict], names: list[str]) -> None:
    """Per (shape, M): linear µs, each variant's default-launch µs and speedup, then the best
    launch per variant; then per M the sum over the shapes (one layer's GEMMs)."""
    def cell(e):
        return f"{e['us']:9.1f} {e['speedup']:5.2f}x" if "us" in (e or {}) else f"{'-':>16}"

    print(f"{'shape':8} {'M':>5} {'linear us':>9} | " + " | ".join(f"{v + ' us':>16}"
                                                                  for v in names))
    for r in rows:
        print(f"{r['shape']:8} {r['m']:5} {r['linear']['us']:9.1f} | "
              + " | ".join(cell(r.get(v)) for v in names))
        for v in names:
            b = r.get(f"{v}_best")
            if b and b["launch"] != r["default_launch"]:
                print(f"{'':15} best {v}: {b['us']:.1f} us, {b['vs_default']}x the default, "
                      f"{b['launch']}")
    print("per-M sum over shapes (us): M  linear  " + "  ".join(names))
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]
        sums = [sum(r.get(v, {}).get("us", float("nan")) for r in rs) for v in ["linear", *names]]
        print(f"  {m:5} " + " ".join(f"{s:9.1f}" for s in sums))


if __name__ == "__main__":
    main()
