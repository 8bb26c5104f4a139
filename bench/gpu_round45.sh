#!/usr/bin/env bash
# Issue 40, the launch orders (bench/launch_tail.py models a 14% tail for the dK/dV kernel's default order at 4x4096,
# none with HEADS_INNER, and 3-4% for the forward and dQ without HEAVY_FIRST, which their picks have not been timed
# with): two device calls on one machine, the second within 30 s of the first.
#   1) carry .whl_big/cu12.part.aa and .whl_b2:   bash bench/gpu_round45.sh check     # about 8 minutes
#      stashes the first half of the peers' wheels (bench/gpu_peers.sh stash), times the order variants alone
#      (bench/attention_sweep.py --variants-only --variants ...: each kernel's default and Hopper pick beside
#      heavy-first / tma-heavy-first for the forward and dQ, heads-inner / prefetch-heads-inner for dK/dV, 4x4096
#      and 1x16384, causal with sinks), then runs the quick check of the tree (bench/gpu_check.sh, steps 1 and 3,
#      seed 0, two jobs).
#   2) carry .whl_big/cu12.part.ab and .whl:      bash bench/gpu_round45.sh table     # at most 9.5 minutes
#      issue 40's table with the peers (bench/gpu_round41.sh table: attention.py with FA4, logprob_linear.py with
#      Liger and Cut Cross-Entropy, model_step.py with transformers + FA4 and the fused loss's rows).
# Where an order variant beats a kernel's pick at both layouts, add its flag to that kernel's row of
# configs.HOPPER_PICKS (HEAVY_FIRST for the forward / dQ, HEADS_INNER for dK/dV; the sweep names two-flag rows such
# as prefetch-heads-inner) and run the quick check again.
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
  timeout 240 python3 bench/attention_sweep.py --variants-only --layouts 4x4096,1x16384 \
    --variants heavy-first,tma-heavy-first,heads-inner,prefetch-heads-inner \
    --out "$OUT/sweep/attention_sweep.json" > "$OUT/sweep/attention_sweep.log" 2>&1
  echo "attention_sweep rc=$?"; grep -E " ms |kernels fwd\+bwd" "$OUT/sweep/attention_sweep.log" | tail -40
  GPU_CHECK_OUT="$OUT/qc" GPU_CHECK_STEPS="1 3" GPU_CHECK_SEEDS=0 GPU_CHECK_JOBS=2 bash bench/gpu_check.sh 2>&1 \
    | tail -22
else
  OUT="$OUT" bash bench/gpu_round41.sh table
fi
