#!/usr/bin/env bash
# Issue 40, after grouped_experts (the reference experts kernel whose gathers do not scatter in the backward): one
# device call, no peers needed, about 7 minutes on an H100. Run it after the quick check on the same warm machine:
#   bash bench/gpu_round41.sh
# 1. bench/experts_path.py at GPT-OSS-20B width (2 layers, 32 experts, top-4, bf16, 4096 and 16384 tokens):
#    polyrl's experts path beside transformers' grouped_mm path, same run, and the ratio;
# 2. bench/profile_step.py on the tiny DAPO recipe (cuda, 20 steps, 3 profiled): the step split and the top kernels
#    (indexing_backward_kernel was about 30% of the GPU time on c178864) and the host<-device syncs by call site
#    (the profile's 1,446 a step count every item(), CPU tensors' too);
#    and a cProfile of the trainer build (9 s of the 14 s start-up on c178864: imports, or something else?);
# 3. bench/recipe_tiny.py, both tiny recipes, seeds 0-4, one run at a time: walls against the 30 s / 45 s goals and the
#    last-10 rewards (>= 0.9).
# Logs and JSON go to $OUT (the device's return folder) or ./gpu_round41_out.
set -uo pipefail
OUT=${OUT:-gpu_round41_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
for t in 4096 16384; do
  timeout 120 python3 bench/experts_path.py --backend cuda --tokens "$t" --out "$OUT/experts_path_$t.json" \
    > "$OUT/experts_path_$t.log" 2>&1
  echo "experts_path $t rc=$?"; tail -3 "$OUT/experts_path_$t.log"
done
timeout 120 python3 bench/profile_step.py polyrl/recipes/gpt_oss_dapo_tiny.yaml --backend cuda --steps 20 \
  --profile-steps 3 --sync-sources 3 --profile-build --out "$OUT/profile_dapo.json" > "$OUT/profile_dapo.log" 2>&1
echo "profile rc=$?"; grep -E "start-up|median over|per step|indexing|Self CUDA time" "$OUT/profile_dapo.log" | head -12
grep -A12 "host<-device syncs:" "$OUT/profile_dapo.log"
grep -A30 "trainer build, cProfile" "$OUT/profile_dapo.log" | cut -c1-150 | tail -22
timeout 360 python3 bench/recipe_tiny.py --backend cuda --recipes gpt_oss_dapo_tiny deepseek_ppo_tiny \
  --seeds 0 1 2 3 4 --jobs 1 --out "$OUT/recipe_tiny.json" > "$OUT/recipe_tiny.log" 2>&1
echo "recipes rc=$?"; grep -E "^(gpt_oss|deepseek)" "$OUT/recipe_tiny.log" | tail -12
