"""Peak device memory of one sampler step, per logprobs mode (GPU only).

256 rows of bfloat16 logits over Llama 3's 128,256 ids, every row asking 5 logprobs, with
temperature alone and with top-k / top-p: ``torch.cuda.max_memory_allocated`` above the
logits, after one warm step of the same batch. Prints one JSON document.

    python3 bench/sampler_memory.py [ROWS] [VOCAB]
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tpserve.model.sampler import Sampler
from tpserve.model.sampling_params import LOGPROBS_MODES, SamplingParams


def peak_mib(rows: int, vocab: int, mode: str, filters: bool) -> float:
    sampler = Sampler(0, "cuda", mode)
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    knobs = dict(top_k=50, top_p=0.9) if filters else {}
    params = [SamplingParams(temperature=0.8, logprobs=5, **knobs)] * rows
    args = (logits, params, [[1]] * rows, [[]] * rows, [None] * rows, frozenset())
    sampler.sample(*args).to_host().resolve()  # warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sampler.sample(*args).to_host().resolve()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 128256
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    out = {"device": torch.cuda.get_device_name(), "commit": commit, "rows": rows,
           "vocab": vocab, "logits_mib": round(rows * vocab * 2 / 2**20, 1),
           "peak_mib_above_logits": {
               f"{mode} {'top-k/top-p' if f else 'temperature'}": peak_mib(rows, vocab, mode, f)
               for f in (True, False) for mode in LOGPROBS_MODES}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
