"""Why the engine's decode attention is slower than ``tune_decode.py``'s (round 38: a
float32 decode step of qwen3-0.6b spends 165 us a layer in ``_decode_split_kernel``, where
the float32 sweep at batch 1 x 600 keys took 13 us): one eager decode step records the
arguments the back-end gives ``decode_attention`` in its first layer, prints their shapes,
strides and alignment, then times that launch (``measure.time_op``, the median of 50) as
given and with one input at a time replaced by a fresh tensor of the same shape.

    python bench/decode_args_probe.py --model qwen3-0.6b --dtype float32 [-- serve flags]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import time_op  # noqa: E402  (bench/measure.py)
from spec_step_probe import prefilled_runner  # noqa: E402  (bench/spec_step_probe.py)
from tune_decode import time_graph  # noqa: E402  (bench/tune_decode.py)

from tpserve.model.kernels import triton_decode_attention  # noqa: E402
from tpserve.model.plan import StepPlan  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402

# the positional arguments of decode_attention, by name
ARG_NAMES = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale", "out",
             "num_splits")


def describe(name: str, value) -> str:
    if isinstance(value, (tuple, list)):
        return "\n".join(describe(f"{name}[{i}]", v) for i, v in enumerate(value))
    if not isinstance(value, torch.Tensor):
        return f"{name} = {value!r}"
    return (f"{name}: {tuple(value.shape)} {value.dtype} strides {value.stride()} "
            f"contiguous {value.is_contiguous()} ptr % 128 = {value.data_ptr() % 128} "
            f"storage offset {value.storage_offset()}")


def first_call(runner: ModelRunner, plan: StepPlan) -> tuple[tuple, dict]:
    """The arguments of the first ``decode_attention`` call of one execution of ``plan``
    (the tensors themselves, not copies: their layout is what is timed)."""
    calls: list[tuple[tuple, dict]] = []
    original = triton_decode_attention.decode_attention

    def record(*args, **kwargs):
        if not calls:
            calls.append((args, dict(kwargs)))
        return original(*args, **kwargs)

    triton_decode_attention.decode_attention = record
    try:
        runner.execute(plan)
    finally:
        triton_decode_attention.decode_attention = original
    return calls[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--device", default="cuda")
    p.add_argument("flags", nargs="*", help="further serve flags (after --)")
    a = p.parse_args()
    dev = torch.device(a.device)
    runner, step = prefilled_runner(a.model, a.dtype, a.device, a.context,
                                    ["--enforce-eager", "--kernel-backend", "triton", *a.flags])
    args, kwargs = first_call(runner, step(1))
    for name, value in zip(ARG_NAMES, args, strict=True):
        print(describe(name, value), flush=True)
    for name, value in kwargs.items():
        print(describe(name, value), flush=True)
    q, k_cache, v_cache, tables, lens = args[:5]
    page = k_cache.shape[1]
    used = int(tables[0, :-(-int(lens[0]) // page)].max()) + 1
    fresh_k = torch.randn(used, *k_cache.shape[1:], dtype=k_cache.dtype, device=dev)
    perm = torch.randperm(used, device=dev).int()[None, :]
    plain = {k: v for k, v in kwargs.items() if k not in ("partials", "kv_scale")}
    q32 = torch.randn(q.shape[0], 32, q.shape[2], dtype=q.dtype, device=dev)
    runs = [  # (name, positional arguments, keywords)
        ("as given", args, kwargs),
        ("q fresh (randn)", (torch.randn_like(q), *args[1:]), kwargs),
        ("q and out cloned", (q.clone(), *args[1:6], args[6].clone(), *args[7:]), kwargs),
        ("caches: their first used blocks, cloned",
         (q, k_cache[:used].clone(), v_cache[:used].clone(), *args[3:]), kwargs),
        ("caches fresh (randn, used blocks)",
         (q, fresh_k, torch.randn_like(fresh_k), *args[3:]), kwargs),
        ("as given, no partials or kv_scale", args, plain),
        ("fresh q, caches and a permuted table, no keywords",
         (torch.randn_like(q), fresh_k, torch.randn_like(fresh_k), perm, *args[4:]), plain),
        ("the same with 32 q heads (tune_decode.py's shape)",
         (q32, fresh_k, torch.randn_like(fresh_k), perm, args[4], args[5],
          torch.empty_like(q32), args[7]), plain),
    ]
    for name, call, kw in runs:
        def launch(call=call, kw=kw):
            triton_decode_attention.decode_attention(*call, **kw)
        # on a CPU (the interpreter: a check of this script) the host clock, one launch
        us = time_graph(launch) if dev.type == "cuda" else time_op(launch, dev, 0, 1) * 1e6
        print(f"{us:9.1f} us  {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
