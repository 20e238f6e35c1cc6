#!/usr/bin/env bash
# Nsight Compute over the serving step's heaviest kernels (bench/ncu_kernels.py) on the GPU
# machine. Carry .whl.
#   bash bench/run_ncu.sh OUT SHA
# OUT.tgz holds: the script's log (case order), ncu's details page of every launch, its raw
# metrics (csv), and the SASS with per-instruction stall samples of each decode-attention
# split launch (csv).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "all"
step "ncu: $NCU"
timeout 400 "$NCU" --clock-control none --profile-from-start off --nvtx --set full \
  --import-source no -o "$out/rep" python3 bench/ncu_kernels.py > "$out/ncu-run.log" 2>&1
tail -30 "$out/ncu-run.log" | cut -c1-300
step "reports"
ncu_reports "$out/rep.ncu-rep" "$out/" "$(grep -c "decode .* splits" "$out/ncu-run.log")"
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots Busy" \
  "$out/details.txt" | cut -c1-160 | head -400
round_pack
