"""Joules per call of the heavy kernels of an fp8 Llama-3-8B serving step (at the H200's
700 W cap, energy per step bounds throughput: ``bench/README.md`` rounds 15-16).

Per case: ``--calls`` calls captured in one CUDA graph (GEMM weights and attention caches
rotated over copies of >= ``--rotate-mib``, as in ``fp8_gemm.py``, so each call streams from
HBM), replayed ``--warmup`` s, then >= ``--seconds`` under ``gpu_power.PowerSampler``: mJ per
call = NVML energy / (replays x calls). ``idle`` sleeps instead; "above idle" = (W - idle W)
x seconds / calls, W = energy / seconds. Cases (llama3-8b): Triton W8A8 at M=64 and
``_scaled_mm`` at M=512 (fast accumulation, inputs pre-quantized as the fused kernels hand
them over), bf16 ``F.linear`` at both, ``paged_attention`` over 64 decodes of 1,024-1,280
context and over a 448-token chunk after 576 cached (fp8 and bf16 cache), the fused
``silu_and_mul_fp8`` / ``add_rms_norm_fp8`` at both M (not rotated). Step estimates are sums
of these isolated kernels over 32 layers (no RoPE + KV write, o-input quantizer, lm_head).

    python bench/energy_kernels.py --out bench/results/h200-DATE-energy-kernels.json
    TRITON_INTERPRET=1 python bench/energy_kernels.py --small --out /tmp/e.json  # CPU check

``--small``: tiny shapes on the CPU, each case once, no graph or NVML (energy fields null).
``--cases``: name prefixes to run. The JSON is rewritten after each case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_gemm import capture, copies_for  # noqa: E402
from gpu_power import PowerSampler  # noqa: E402
from measure import git_commit  # noqa: E402
from tune_decode import scattered_block_table  # noqa: E402

from tpserve.model.attention import triton_backend as tb  # noqa: E402
from tpserve.model.kernels import triton_decode_attention as dec  # noqa: E402
from tpserve.model.kernels import triton_fp8_fused, triton_w8a8  # noqa: E402
from tpserve.model.kernels.decode_launch import (  # noqa: E402
    FP8_LAUNCH,
    SPLIT_FIELDS,
    default_launch,
    default_num_splits,
)
from tpserve.model.quant.fp8 import DEFAULT_FAST_ACCUM, FP8, quantize_per_row  # noqa: E402

BF16 = torch.bfloat16
Fns = list[Callable[[], object]]


@dataclass(frozen=True)
class Shapes:
    """The cases' shapes: llama3-8b at tp 1 (``FULL``) or the CPU check's (``SMALL``)."""

    gemms: tuple[tuple[str, int, int], ...]  # (name, N, K)
    hidden: int
    hq: int
    hkv: int
    d: int
    page: int
    m_dec: int  # tokens of a decode step (= its decoding sequences)
    m_mix: int  # tokens of a mixed step (= m_dec decodes + the prefill chunk)
    dec_ctx: tuple[int, int]  # decode context lengths, inclusive range
    prefill: tuple[int, int]  # (cached, new) tokens of the prefill chunk
    layers: int
    max_seq_len: int  # the graphs' (max_model_len): sets the decode split count


FULL = Shapes((("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
               ("down", 4096, 14336)), 4096, 32, 8, 128, 16, 64, 512, (1024, 1280),
              (576, 448), 32, 2048)
SMALL = Shapes((("qkv", 512, 256), ("o", 256, 256), ("gate_up", 1024, 256), ("down", 256, 512)),
               256, 4, 2, 64, 16, 4, 16, (40, 80), (24, 12), 2, 128)


def per_call(ts: tuple[torch.Tensor, ...], rotate_mib: int, calls: int
             ) -> tuple[list[tuple], int]:
    """Each call's copy of ``ts`` (``ts`` and clones, >= ``rotate_mib`` in all, in turn), and
    the number of copies."""
    n = copies_for(sum(t.numel() * t.element_size() for t in ts), rotate_mib, calls)
    sets = [ts] + [tuple(t.clone() for t in ts) for _ in range(n - 1)]
    return [sets[i % n] for i in range(calls)], n


def gemm(kind: str, n: int, k: int, m: int):
    """Builder of GEMMs ``[m, k] x [n, k]^T``: bf16 ``F.linear``, the Triton W8A8 kernel's
    table launch or ``torch._scaled_mm`` (per-row / per-channel scales, as ``quant.fp8``)."""
    def build(dev: torch.device, calls: int, rotate_mib: int) -> tuple[Fns, dict]:
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=BF16, generator=g) / k ** 0.5
        x = torch.randn(m, k, device=dev, dtype=BF16, generator=g)
        if kind == "bf16":
            ws, copies = per_call((w,), rotate_mib, calls)
            return [lambda w=w: F.linear(x, w) for (w,) in ws], {"copies": copies}
        (wq, wscale), (xq, xs) = quantize_per_row(w), quantize_per_row(x)
        ws, copies = per_call((wq,), rotate_mib, calls)
        wscale, fast = wscale.view(-1), DEFAULT_FAST_ACCUM
        info = {"copies": copies, "fast_accum": fast}
        if kind == "w8a8":
            info["launch"] = ",".join(map(str, triton_w8a8.w8a8_blocks(m, n, k, fast)))
            return [lambda w=w: triton_w8a8.w8a8_linear(xq, xs, w, wscale, None, BF16, None,
                                                        fast) for (w,) in ws], info
        return [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=wscale.view(1, -1),
                                             out_dtype=BF16, use_fast_accum=fast)
                for (w,) in ws], info
    return build


def attention(s: Shapes, cache_dtype: torch.dtype, prefill: bool,
              launch: dict | None = None, splits: int | None = None):
    """Builder of ``paged_attention`` calls as the engine's graphs launch them: decode only
    (``m_dec`` sequences, contexts ``dec_ctx``) or the prefill chunk alone (no decode slots,
    its tile table padded as a mixed step's of ``m_mix`` tokens over ``m_dec`` slots).
    ``launch`` (decode only; ``--decode-sweep``): ``decode_attention`` called directly with
    these ``DecodeLaunch`` fields and ``splits`` (None: the default split count)."""
    def build(dev: torch.device, calls: int, rotate_mib: int) -> tuple[Fns, dict]:
        gen, g = torch.Generator().manual_seed(0), torch.Generator(device=dev).manual_seed(0)
        ctx = torch.randint(s.dec_ctx[0], s.dec_ctx[1] + 1, (s.m_dec,), generator=gen)
        seqs = [s.prefill] if prefill else [(c - 1, 1) for c in ctx.tolist()]  # (cached, new)
        lens = [c + n for c, n in seqs]
        nblk = [-(-n // s.page) for n in lens]
        shape = (sum(nblk), s.page, s.hkv, s.d)
        kc = (torch.randn(shape, device=dev, generator=g) * 2).to(cache_dtype)
        vc = torch.randn(shape, device=dev, generator=g).to(cache_dtype)
        kv_scale = torch.tensor([0.5, 0.25], device=dev) if cache_dtype == FP8 else None
        i32 = dict(dtype=torch.int32, device=dev)
        qsl = torch.tensor([sum(n for _, n in seqs[:i]) for i in range(len(seqs) + 1)], **i32)
        tokens = s.m_mix if prefill else s.m_dec
        q = torch.randn(tokens, s.hq, s.d, device=dev, generator=g).to(BF16)
        common = dict(slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
                      query_start_loc=qsl, seq_lens=torch.tensor(lens, **i32),
                      block_tables=scattered_block_table(nblk, None, gen).to(dev),
                      max_seq_len=s.max_seq_len)
        if prefill:
            tiles = tb.prefill_tiles([s.prefill[1]], 0)
            tiles += [-1] * (tb.max_prefill_tiles(s.m_mix, s.m_dec) - len(tiles))
            meta = tb.TritonMetadata(num_decodes=0, max_query_len=tokens, decode_slots=0,
                                     prefill_tiles=torch.tensor(tiles, **i32), **common)
            info = {"tiles": len(tiles)}
        else:
            meta = tb.TritonMetadata(num_decodes=s.m_dec, max_query_len=1, **common)
            info = {"splits": default_num_splits(cache_dtype, s.m_dec, s.hkv, s.max_seq_len),
                    "launch": default_launch(cache_dtype, s.m_dec, s.hkv)._asdict()}
        caches, copies = per_call((kc, vc), rotate_mib, calls)
        info.update(copies=copies, context_tokens=sum(lens))
        if launch is not None:
            n = splits or info["splits"]
            out = torch.empty_like(q)
            info.update(splits=n, launch=default_launch(cache_dtype, s.m_dec, s.hkv)
                        ._replace(**launch)._asdict())
            return [lambda c=c: dec.decode_attention(
                q, c[0], c[1], meta.block_tables, meta.seq_lens, s.d ** -0.5, out, n,
                kv_scale=kv_scale, **launch) for c in caches], info
        return [lambda c=c: tb.paged_attention(q, c[0], c[1], meta, s.d ** -0.5, kv_scale)
                for c in caches], info
    return build


def small_kernel(kind: str, m: int, width: int):
    """Builder of the fused fp8 quantizers: ``silu_and_mul_fp8`` of ``[m, width]``, or
    ``add_rms_norm_fp8`` of ``[m, width]`` (the residual form the layers' norms take)."""
    def build(dev: torch.device, calls: int, rotate_mib: int) -> tuple[Fns, dict]:
        g = torch.Generator(device=dev).manual_seed(0)
        x, res = (torch.randn(m, width, device=dev, dtype=BF16, generator=g) for _ in "xr")
        w = torch.rand(width, device=dev, generator=g).to(BF16) + 0.5
        if kind == "silu":
            return [lambda: triton_fp8_fused.silu_and_mul_fp8(x)] * calls, {}
        return [lambda: triton_fp8_fused.add_rms_norm_fp8(x, res, w, 1e-5)] * calls, {}
    return build


# --decode-sweep: fp8-cache decode launches, (name, DecodeLaunch fields replaced in
# FP8_LAUNCH, splits or None: the default count)
DECODE_SWEEP = (
    ("shipped", {}, None), ("splits1", {}, 1), ("splits4", {}, 4),
    ("k16_w1_s3", {"num_stages": 3}, None), ("lazy", {"lazy_rescale": True}, None),
    ("bf16_dot", {"fp16_dot": False, "scale_v": False}, None),
    ("k32_w1_s3", {"block_n": 32, "num_stages": 3, "bt_ahead": False}, None),
    ("k64_w4_s3", {"block_n": 64, "num_warps": 4, "num_stages": 3, "bt_ahead": False}, None),
    ("k128_w4_s2", {"block_n": 128, "num_warps": 4, "num_stages": 2, "bt_ahead": False}, None),
)


def cases(s: Shapes, decode_sweep: bool = False) -> list[tuple[str, str, Callable | None]]:
    """``(name, class, builder)`` in run order; the idle case (no builder) first; with
    ``decode_sweep`` the fp8 decode launches of ``DECODE_SWEEP`` as well."""
    out: list[tuple[str, str, Callable | None]] = [("idle", "idle", None)]
    if decode_sweep:
        base = {k: v for k, v in FP8_LAUNCH._asdict().items()
                if k not in SPLIT_FIELDS}
        out += [(f"decode_fp8_{name}", "decode_sweep",
                 attention(s, FP8, False, {**base, **kw}, n)) for name, kw, n in DECODE_SWEEP]
    gemms = [(f"w8a8_m{s.m_dec}", "w8a8", s.m_dec), (f"scaled_mm_m{s.m_mix}", "mm", s.m_mix),
             (f"bf16_m{s.m_dec}", "bf16", s.m_dec), (f"bf16_m{s.m_mix}", "bf16", s.m_mix)]
    out += [(f"{pre}_{g}", "gemm", gemm(kind, n, k, m)) for pre, kind, m in gemms
            for g, n, k in s.gemms]
    out += [(f"{step}_attn_{c}", f"{step}_attn", attention(s, dt, step == "prefill"))
            for step in ("decode", "prefill") for c, dt in (("fp8", FP8), ("bf16", BF16))]
    gate_up = dict((g, n) for g, n, _ in s.gemms)["gate_up"]
    out += [(f"{name}_m{m}", "small", small_kernel(kind, m, width)) for name, kind, width in
            (("silu_fp8", "silu", gate_up), ("add_rms_norm_fp8", "norm", s.hidden))
            for m in (s.m_dec, s.m_mix)]
    return out


def wait(ev: torch.cuda.Event, deadline: float) -> None:
    while not ev.query():
        if time.perf_counter() > deadline:
            raise TimeoutError("graph replays did not finish in time")
        time.sleep(1e-4)


def spin(graph: torch.cuda.CUDAGraph, seconds: float, chunk: int) -> tuple[int, float]:
    """Replays ``graph`` in chunks of ``chunk``, each queued before the previous one is
    awaited, until ``seconds`` have passed; ``(replays, seconds)`` once all have finished
    (TimeoutError past ``seconds + max(30, 10 x seconds)``)."""
    start = time.perf_counter()
    deadline = start + seconds + max(30.0, 10 * seconds)
    replays, prev = 0, None
    while prev is None or time.perf_counter() - start < seconds:
        for _ in range(chunk):
            graph.replay()
        replays += chunk
        ev = torch.cuda.Event()
        ev.record()
        if prev is not None:
            wait(prev, deadline)
        prev = ev
    wait(prev, deadline)
    return replays, time.perf_counter() - start


def measure(fns: Fns | None, dev: torch.device, a: argparse.Namespace,
            idle_w: float | None) -> dict:
    """One row: ``fns`` (None: idle) replayed from a graph under a PowerSampler on CUDA, or
    its first call run once on the CPU."""
    graph, chunk = None, 1
    if fns and dev.type == "cuda":
        graph = capture(fns)
        t0 = time.perf_counter()
        spin(graph, 0.0, 1)
        chunk = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-6)))  # ~50 ms a chunk
        spin(graph, a.warmup, chunk)
    with PowerSampler(dev, a.period) as power:
        t0 = time.perf_counter()
        if graph is not None:
            replays = spin(graph, a.seconds, chunk)[0]
        elif fns:  # --small: one call
            fns[0]()
            replays = 1
        else:  # idle
            time.sleep(a.seconds if dev.type == "cuda" else 0.1)
            replays = 0
        secs = time.perf_counter() - t0
    del graph
    p, calls = power.summary(), replays * len(fns or [0])
    row = {"calls": calls, "seconds": round(secs, 3),
           "us_per_call": round(secs * 1e6 / calls, 3) if calls else None,
           **dict.fromkeys(("mean_w", "energy_w", "sm_clock_p50", "at_sw_power_cap",
                            "energy_j", "mj_per_call", "mj_per_call_above_idle")), "power": p}
    if p.get("samples"):
        row.update(mean_w=p["power_w"]["mean"], sm_clock_p50=p["sm_clock_mhz"]["p50"],
                   at_sw_power_cap=p["clock_reason_fraction"]["sw_power_cap"])
    if p.get("energy_j") is not None and p.get("seconds"):
        row.update(energy_j=p["energy_j"], energy_w=round(p["energy_j"] / p["seconds"], 1))
        if calls:
            row["mj_per_call"] = round(p["energy_j"] * 1e3 / calls, 4)
            if idle_w is not None:
                row["mj_per_call_above_idle"] = round(
                    (row["energy_w"] - idle_w) * secs * 1e3 / calls, 4)
    return row


def step_estimates(rows: list[dict], s: Shapes) -> dict:
    """mJ (total, above idle) and us of a decode and a mixed step by kernel class, per KV
    cache dtype: the isolated kernels' rows summed over ``s.layers`` layers (None where a
    row is missing)."""
    by = {r["case"]: r for r in rows}
    out: dict = {"note": f"sums of isolated kernels, each measured alone, x {s.layers} "
                         "layers; without RoPE + KV write, the o input quantizer, embedding, "
                         "lm_head and sampling"}
    for cache in ("fp8", "bf16"):
        for step, m, gk in (("decode", s.m_dec, "w8a8"), ("mixed", s.m_mix, "scaled_mm")):
            parts = {"gemm": [f"{gk}_m{m}_{g}" for g, _, _ in s.gemms],
                     "decode_attn": [f"decode_attn_{cache}"],
                     "prefill_attn": [f"prefill_attn_{cache}"] if step == "mixed" else [],
                     "small": [f"add_rms_norm_fp8_m{m}"] * 2 + [f"silu_fp8_m{m}"]}
            est: dict = {"tokens": m, "layers": s.layers, "cases": parts}
            for key, field in (("mj", "mj_per_call"), ("mj_above_idle", "mj_per_call_above_idle"),
                               ("us", "us_per_call")):
                vals = {c: [by.get(n, {}).get(field) for n in names]
                        for c, names in parts.items() if names}
                est[key] = {c: round(sum(v) * s.layers, 2) if None not in v else None
                            for c, v in vals.items()}
                tot = list(est[key].values())
                est[key]["total"] = round(sum(tot), 2) if None not in tot else None
            total = est["mj"]["total"]
            est["mj_per_token"] = round(total / m, 3) if total is not None else None
            out[f"{step}_step_{cache}_cache"] = est
    return out


def print_summary(rows: list[dict], est: dict) -> None:
    cols = {"calls": "calls", "seconds": "s", "us_per_call": "us/call", "mean_w": "W sampled",
            "energy_w": "W energy", "sm_clock_p50": "SM MHz p50", "at_sw_power_cap": "at cap",
            "mj_per_call": "mJ/call", "mj_per_call_above_idle": "mJ >idle"}
    print(f"{'case':24}" + "".join(f"{h:>11}" for h in cols.values()))
    for r in rows:
        print(f"{r['case']:24}" + "".join(f"{r[c]:>11.6g}" if r.get(c) is not None else
                                          f"{'-':>11}" for c in cols)
              + (f"  {r['error'][:80]}" if "error" in r else ""))
    print(f"step estimates ({est['note']}):")
    for name, e in ((k, v) for k, v in est.items() if k != "note"):
        print(f"  {name:24} mJ {e['mj']}; above idle {e['mj_above_idle']['total']}; "
              f"us {e['us']['total']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", default=None, help="name prefixes to run (all)")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured replay time a case")
    ap.add_argument("--warmup", type=float, default=1.0, help="replay time before measuring")
    ap.add_argument("--calls", type=int, default=32, help="calls captured in one graph")
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--period", type=float, default=0.1, help="NVML sampling period, s")
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes on the CPU, each case once (idle: 0.1 s)")
    ap.add_argument("--commit", default=None, help="the commit measured (else git here)")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="also the fp8 decode launches of DECODE_SWEEP (right after idle)")
    a = ap.parse_args()
    if a.small and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--small runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
    if not a.small and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --small on the CPU)")
    dev, s = (torch.device("cpu"), SMALL) if a.small else (torch.device("cuda"), FULL)
    calls = 1 if a.small else a.calls
    commit, dirty = git_commit(a.commit)
    head = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "git_commit": commit,
            "git_dirty": dirty, "args": vars(a), "shapes": asdict(s)}
    rows: list[dict] = []
    idle_w = None
    for name, cls, build in cases(s, a.decode_sweep):
        if a.cases is not None and not any(name.startswith(p) for p in a.cases):
            continue
        row: dict = {"case": name, "class": cls}
        try:
            fns, info = build(dev, calls, a.rotate_mib) if build else (None, {})
            row.update(info)
            row.update(measure(fns, dev, a, idle_w))
            del fns
        except Exception as exc:  # noqa: BLE001 - a case that fails leaves its error, the run goes on
            row["error"] = repr(exc)[:300]
        if name == "idle":
            idle_w = row.get("energy_w")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "power"}), flush=True)
        est = step_estimates(rows, s)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({**head, "rows": rows, "step_estimates": est},
                                          indent=1) + "\n")
    print_summary(rows, step_estimates(rows, s))


if __name__ == "__main__":
    main()
