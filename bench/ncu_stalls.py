"""Warp-stall summary of ``ncu --page source --print-source sass --csv`` files (one kernel
launch each): the share of each stall reason, the cp.async waits (``DEPBAR.LE``) with how
often they ran, and the six instructions with the most samples.

    python bench/ncu_stalls.py OUT.txt SASS.csv LABEL [SASS.csv LABEL ...]
"""

import collections
import csv
import sys


def summarize(path, label, out):
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    data = rows[2:]
    si = hdr.index("Warp Stall Sampling (All Samples)")
    src = hdr.index("Source")
    ex = hdr.index("Instructions Executed")
    cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "(Not" not in h]
    tot = sum(int(r[si] or 0) for r in data)
    agg = collections.Counter()
    for r in data:
        for i in cols:
            agg[hdr[i][6:]] += int(r[i] or 0)
    print(
        f"{label}: {tot} warp-state samples; by reason: "
        + ", ".join(f"{k} {v / tot:.1%}" for k, v in agg.most_common(8)),
        file=out,
    )
    waits = [(r[src].strip(), r[ex]) for r in data if "DEPBAR.LE" in r[src]]
    print(f"  cp.async waits (SASS, times executed): {waits}", file=out)
    for r in sorted(data, key=lambda r: -int(r[si] or 0))[:6]:
        st = sorted(((int(r[i] or 0), hdr[i][6:]) for i in cols), reverse=True)[:2]
        print(
            f"  {int(r[si]):5d} samples ({int(r[si]) / tot:.1%}) x{r[ex]:>6} {r[src].strip()[:48]:48s} {st[0][1]} {st[0][0]}, {st[1][1]} {st[1][0]}",
            file=out,
        )


if __name__ == "__main__":
    out = open(sys.argv[1], "w")
    for path, label in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
        summarize(path, label, out)
