#!/usr/bin/env bash
# The one GPU check: run it on a CUDA machine (an H200 here) from the repository root, after any change to code
# that runs on a GPU (trainer, rollout, kernels, sharding). About 10 minutes on one H200:
#   1. the GPU tests (tests/cuda -m gpu: kernels vs the fp64 oracle, the trainer on cuda: DAPO, PPO, resume, export)
#   2. start-up and step profile of the tiny DAPO recipe, twice (the second run is "a machine that has run it once")
#   3. both tiny recipes through `polyrl run --backend cuda`, seeds 0 1 2 (bench/recipe_tiny.py; bars 30 s / 45 s)
#   4. `polyrl parity --backend cuda`
#   5. a quick attention benchmark beside the peers installed on the machine (FA4, FLA, flex, SDPA)
# Writes everything under ${GPU_CHECK_OUT:-gpu_check_out}/ and prints a summary; exit 1 if a step failed.
#
#   bash bench/gpu_check.sh            # all steps
#   GPU_CHECK_STEPS="1 3" bash bench/gpu_check.sh   # a subset
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu_check_out}
STEPS=${GPU_CHECK_STEPS:-"1 2 3 4 5"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=()
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME CMD...: run, tee the log, record the exit code and the wall time
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  status+=("$name rc=$rc $((SECONDS - t0))s")
}

if ! $PY -c "import polyrl" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
$PY - <<'EOF' | tee "$OUT/versions.txt"
import platform, torch, triton, transformers
print(f"gpu {torch.cuda.get_device_name(0)}; torch {torch.__version__}; cuda {torch.version.cuda}; triton "
      f"{triton.__version__}; transformers {transformers.__version__}; python {platform.python_version()}")
EOF

want 1 && step gpu_tests $PY -m pytest tests/cuda -m gpu -q -p no:cacheprovider
if want 2; then
  step profile_cold $PY bench/profile_step.py recipes/gpt_oss_dapo_tiny.yaml --backend cuda --steps 20 \
    --profile-steps 2 --out "$OUT/profile_cold.json"
  step profile_warm $PY bench/profile_step.py recipes/gpt_oss_dapo_tiny.yaml --backend cuda --steps 5 \
    --profile-steps 0 --out "$OUT/profile_warm.json"
fi
want 3 && step recipes $PY bench/recipe_tiny.py --backend cuda --out "$OUT/recipe_tiny_cuda.json"
want 4 && step parity $PY -m polyrl parity --backend cuda
want 5 && step attention $PY bench/attention.py --quick --out "$OUT/attention_quick.json"

echo "=== summary"
for s in "${status[@]}"; do echo "$s"; done | tee "$OUT/summary.txt"
grep -h "start-up" "$OUT"/profile_*.log 2>/dev/null | tee -a "$OUT/summary.txt"
grep -hE "^(gpt_oss|deepseek)" "$OUT/recipes.log" 2>/dev/null | tee -a "$OUT/summary.txt"
tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null | tee -a "$OUT/summary.txt"
for s in "${status[@]}"; do [[ $s == *"rc=0 "* ]] || exit 1; done
