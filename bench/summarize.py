"""Merges one day's engine, HTTP and Hugging Face runs into the single result the issue
asks for, with every target and whether it was met.

    python bench/summarize.py --engine E.json --http H.json --hf F.json --out S.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def summarize(engine: dict, http: dict, hf: dict) -> dict:
    lt = http["loadtest"]
    serving = engine["serving"]
    hf_tps = hf["hf_baseline"]["output_tok_per_s"]
    http_tps = lt["output_throughput"]
    b1 = engine["decode_batch1"]
    out = {
        "git_commit": engine["git_commit"],
        "device": engine["device"],
        "torch": engine["torch"],
        "limits": engine["limits"],
        "model": {"shape": engine["config"]["model"], "dtype": engine["config"]["dtype"],
                  "tp": 1},
        "decode_batch1": {k: b1[k] for k in ("tok_per_s", "tpot_ms", "mbu")},
        "serving": {
            "concurrency": serving["concurrency"], "num_prompts": serving["num_prompts"],
            "input_len": serving["input_len"], "output_len": serving["output_len"],
            "output_tok_per_s": serving["output_tok_per_s"],
            **{f"{m}_ms": {"p50": serving[f"{m}_ms"]["p50"], "p99": serving[f"{m}_ms"]["p99"]}
               for m in ("ttft", "tpot", "itl")},
        },
        "serving_http": {
            "output_tok_per_s": http_tps,
            "ratio_vs_engine": round(http_tps / serving["output_tok_per_s"], 4),
            **{f"{m}_ms": {"p50": lt[f"median_{m}_ms"], "p99": lt[f"p99_{m}_ms"]}
               for m in ("ttft", "tpot", "itl")},
            "git_commit": http["git_commit"],
        },
        "hf_baseline": {"output_tok_per_s": hf_tps, "git_commit": hf["git_commit"],
                        "cache": hf.get("cache_used")},
        "ratio_vs_hf": round(serving["output_tok_per_s"] / hf_tps, 3),
        "prefill": {k: engine["prefill"][k] for k in ("tok_per_s", "mfu")},
        "startup_s": engine["startup_s"],
        "startup_http_s": http["startup_s"],
        "new_segments_after_warmup": engine["new_segments_after_warmup"],
        "new_segments_http": http.get("new_segments"),  # None: an older run did not record
        "kv_waste": engine["kv_waste"]["mean"],
    }
    tpot_ratio = serving["tpot_ms"]["p50"] / b1["tpot_ms"]
    targets = {
        "decode_batch1_mbu": (b1["mbu"], ">= 0.80", b1["mbu"] >= 0.80),
        "serving_output_tok_per_s": (serving["output_tok_per_s"], ">= 6500",
                                     serving["output_tok_per_s"] >= 6500),
        "ratio_vs_hf": (out["ratio_vs_hf"], ">= 4", out["ratio_vs_hf"] >= 4),
        "median_tpot_over_batch1": (round(tpot_ratio, 3), "<= 2", tpot_ratio <= 2),
        "http_over_engine": (out["serving_http"]["ratio_vs_engine"], ">= 0.85",
                             out["serving_http"]["ratio_vs_engine"] >= 0.85),
        "prefill_mfu": (out["prefill"]["mfu"], ">= 0.6", out["prefill"]["mfu"] >= 0.6),
        "startup_s": (out["startup_s"], "<= 60", out["startup_s"] <= 60),
        "new_segments_after_warmup": (out["new_segments_after_warmup"], "== 0",
                                      out["new_segments_after_warmup"] == 0),
        "kv_waste": (out["kv_waste"], "<= 0.02", out["kv_waste"] <= 0.02),
    }
    if out["new_segments_http"] is not None:
        targets["new_segments_http"] = (out["new_segments_http"], "== 0",
                                        out["new_segments_http"] == 0)
    out["targets"] = {k: {"value": v, "target": t, "met": m} for k, (v, t, m) in targets.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", required=True)
    p.add_argument("--http", required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    doc = summarize(_load(a.engine), _load(a.http), _load(a.hf))
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name, t in doc["targets"].items():
        print(f"{name:28s} {t['value']!s:>10} {t['target']:>8}  {'met' if t['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
