#!/usr/bin/env bash
# Issue 40, the hf engine's decode under CUDA graphs (rollout.decode=graph), in one device call (~6 minutes):
#   bash bench/gpu_round40b.sh
# It installs polyrl, runs the GPU tests of the static / graph decode, bench/decode_graph.py (each decode mode's ms
# per generate call, tokens against dynamic), bench/profile_step.py in each mode (launches per step), then the tiny
# DAPO recipe seed 0 with rollout.decode=dynamic and =graph one after the other (wall, steps, last-10 reward).
# Logs and JSON go to $OUT or ./gpu_round40b_out.
set -uo pipefail
OUT=${OUT:-gpu_round40b_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/cuda/test_decode_graph_gpu.py \
  tests/cuda/test_decode_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "max \|dlogp\||FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -15
timeout 120 python3 bench/decode_graph.py --backend cuda --out "$OUT/decode_graph.json" > "$OUT/decode_graph.log" 2>&1
echo "decode_graph rc=$?"; tail -12 "$OUT/decode_graph.log"
for mode in dynamic graph; do  # launches and host syncs per step, and the step's split, in each mode
  timeout 60 python3 bench/profile_step.py recipes/gpt_oss_dapo_tiny.yaml rollout.decode=$mode --backend cuda \
    --steps 6 --profile-steps 2 --out "$OUT/profile_$mode.json" > "$OUT/profile_$mode.log" 2>&1
  echo "profile $mode rc=$?"; grep -E "^median|^per step|^start-up" "$OUT/profile_$mode.log"
done
for mode in dynamic graph; do
  timeout 110 python3 bench/recipe_tiny.py --backend cuda --recipes gpt_oss_dapo_tiny --seeds 0 \
    --set rollout.decode=$mode --out "$OUT/recipe_dapo_$mode.json" > "$OUT/recipe_$mode.log" 2>&1
  echo "recipe $mode rc=$?"; tail -1 "$OUT/recipe_$mode.log"
done
# The PPO recipe with one mini-batch a step (2 actor and 2 critic updates, not 4 and 4), if the call has time left:
# on 2 CPU cores seeds 0-4 ended at last-10 0.954-0.990 (bench/results/recipe_tiny_ppo_minibatch_2026-12-05.json);
# on the GPU the update is launch-bound, so halving the updates should show more than on the CPU.
if (( SECONDS < 430 )); then
  timeout $(( 590 - SECONDS )) python3 bench/recipe_tiny.py --backend cuda --recipes deepseek_ppo_tiny --seeds 0 \
    --set algorithm.mini_batch_size=128 --out "$OUT/recipe_ppo_mb128.json" > "$OUT/recipe_ppo_mb128.log" 2>&1
  echo "recipe ppo mini_batch_size=128 rc=$?"; tail -1 "$OUT/recipe_ppo_mb128.log"
fi
