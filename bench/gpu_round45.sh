#!/usr/bin/env bash
# Issue 40, after the dK/dV kernel's HEADS_INNER flag (kv heads fastest in its 1-D grid; bench/launch_tail.py models
# a 14% tail for the default order at 4x4096): two device calls on one machine, the second within 30 s of the first.
#   1) carry .whl_big/cu12.part.aa and .whl_b2:   bash bench/gpu_round45.sh check     # about 8 minutes
#      stashes the first half of the peers' wheels (bench/gpu_peers.sh stash), times the dK/dV variants alone
#      (bench/attention_sweep.py --kernels dkdv --variants-only: the default and the Hopper pick beside the
#      heads-inner, prefetch-heads-inner, prefetch and TMA tiles, 4x4096 and 1x16384, causal with sinks), then runs
#      the quick check of the tree (bench/gpu_check.sh, steps 1 and 3, seed 0, two jobs).
#   2) carry .whl_big/cu12.part.ab and .whl:      bash bench/gpu_round45.sh table     # at most 9.5 minutes
#      issue 40's table with the peers (bench/gpu_round41.sh table: attention.py with FA4, logprob_linear.py with
#      Liger and Cut Cross-Entropy, model_step.py with transformers + FA4 and the fused loss's rows).
# If a heads-inner row beats the pick at both layouts, add HEADS_INNER to the dK/dV row of configs.HOPPER_PICKS (the
# variant name prefetch-heads-inner already maps its two flags) and run the quick check again.
# Logs and JSON go to $OUT (the device's return folder) or ./gpu_round45_out.
set -uo pipefail
PART=${1:-check}
case "$PART" in check|table) ;; *) echo "usage: bash bench/gpu_round45.sh check|table"; exit 2;; esac
OUT=${OUT:-gpu_round45_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$PART" = check ]; then
  bash bench/gpu_peers.sh stash | tail -2
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  mkdir -p "$OUT/sweep"
  timeout 240 python3 bench/attention_sweep.py --kernels dkdv --variants-only --layouts 4x4096,1x16384 \
    --out "$OUT/sweep/attention_sweep.json" > "$OUT/sweep/attention_sweep.log" 2>&1
  echo "attention_sweep rc=$?"; grep -E "dkdv|kernels fwd\+bwd" "$OUT/sweep/attention_sweep.log" | tail -40
  GPU_CHECK_OUT="$OUT/qc" GPU_CHECK_STEPS="1 3" GPU_CHECK_SEEDS=0 GPU_CHECK_JOBS=2 bash bench/gpu_check.sh 2>&1 \
    | tail -22
else
  OUT="$OUT" bash bench/gpu_round41.sh table
fi
