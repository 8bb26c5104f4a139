#!/usr/bin/env bash
# The one GPU check: run it on a CUDA machine (an H200 here) from the repository root, after any change to code
# that runs on a GPU (trainer, rollout, kernels, sharding). All steps took about 12 minutes on one H200 before step 10 (step 10 not timed yet):
#   1. the GPU tests (tests/cuda -m gpu: kernels vs the fp64 oracle, every attention kernel path, the fused
#      lm_head log-prob kernel, the trainer on cuda: DAPO, PPO, resume, export), $GPU_TEST_WORKERS at a time
#   2. start-up and step profile of the tiny DAPO recipe, twice (the second run is "a machine that has run it once",
#      with a cProfile of the trainer's build and the host<-device syncs of 3 steps by call site)
#   3. both tiny recipes through `polyrl run --backend cuda`, seeds $GPU_CHECK_SEEDS (bench/recipe_tiny.py)
#   4. `polyrl parity --backend cuda`, all four levels or $GPU_PARITY_LEVELS (recipe level: $GPU_PARITY_STEPS steps,
#      seeds $GPU_PARITY_SEEDS), JSON report and the recipe-level curves as a PNG
#   5. a quick attention benchmark beside the peers installed on the machine (FA4, FLA, flex, SDPA)
#   6. the fused lm_head + log-prob benchmark at GPT-OSS-20B width beside Liger / Cut Cross-Entropy when installed
#   7. with two or more GPUs: one GPU against two (bench/two_gpu.py: curves, step time, memory, SIGKILL drill)
#   8. the memory plan against a measured run: the 2-layer GPT-OSS-20B-width recipe (bench/memory_plan.py)
#   9. the vllm rollout engine, where vLLM is importable (bench/vllm_carry.sh brings it to an offline machine):
#      its life per model (bench/vllm_engine.py: build, sync s/GiB, probe in prefill and decode, sleep / wake),
#      then the tiny recipes on rollout.engine=vllm, seeds $GPU_CHECK_SEEDS (bench/recipe_tiny.py --set; 5 cores a job:
#      an engine's cold build on the CI's 2 cores takes minutes), one run at a time whatever GPU_CHECK_JOBS says:
#      vLLM's sleep asserts on the GPU's free memory, which another process's engine moves (docs/rollout.md)
#  10. two GPT-OSS layers at full width, fwd+bwd at 4k and 16k tokens: the trainer's loss path (polyrl attention +
#      fused log-prob) beside transformers with FA4 / flex and its labels= loss, with the ratios (bench/model_step.py)
# Before step 1: bench/bytecode.sh compiles the byte code the GPU image leaves out (GPU_CHECK_BYTECODE=0: not).
# Writes everything under ${GPU_CHECK_OUT:-gpu_check_out}/ and prints a summary; exit 1 if a step failed.
#
#   bash bench/gpu_check.sh            # all steps
#   GPU_CHECK_STEPS="1 3" bash bench/gpu_check.sh   # a subset
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu_check_out}
STEPS=${GPU_CHECK_STEPS:-"1 2 3 4 5 6 7 8 9 10"}
SEEDS=${GPU_CHECK_SEEDS:-"0 1 2"}
# pytest-xdist processes sharing the GPU: Triton compiles in parallel. 8 ran out of memory on an H200 (139 GiB) and
# 3 on an H100 (80 GiB), so the default is 3 from 100,000 MiB of GPU memory up and 2 below.
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
WORKERS=${GPU_TEST_WORKERS:-$(( ${GPU_MIB:-0} >= 100000 ? 3 : 2 ))}
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

# Installed from this tree (its entry points are how the backends are found; `import polyrl` alone succeeds from
# the repository root without them): install when the distribution is absent or another tree's.
if ! $PY - 2>/dev/null <<'EOF'; then
import importlib.metadata as m, pathlib, polyrl, sys
d = m.distribution("polyrl")
sys.exit(0 if pathlib.Path(polyrl.__file__).resolve().is_relative_to(pathlib.Path.cwd().resolve())
         and d.entry_points.select(group="polyrl.backends") else 1)
EOF
  $PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
$PY - <<'EOF' | tee "$OUT/versions.txt"
import platform, torch, triton, transformers
print(f"gpu {torch.cuda.get_device_name(0)}; torch {torch.__version__}; cuda {torch.version.cuda}; triton "
      f"{triton.__version__}; transformers {transformers.__version__}; python {platform.python_version()}")
EOF
bash bench/bytecode.sh "$PY" | tee "$OUT/bytecode.txt"  # the image's missing .pyc files, as pip would compile them

if want 1; then
  if $PY -c "import xdist" 2>/dev/null && [[ $WORKERS -gt 1 ]]; then
    step gpu_tests $PY -m pytest tests/cuda -m gpu -q -p no:cacheprovider -n "$WORKERS"
  else
    step gpu_tests $PY -m pytest tests/cuda -m gpu -q -p no:cacheprovider
  fi
fi
if want 2; then
  step profile_cold $PY bench/profile_step.py recipes/gpt_oss_dapo_tiny.yaml --backend cuda --steps 20 \
    --profile-steps 2 --out "$OUT/profile_cold.json"
  step profile_warm $PY bench/profile_step.py recipes/gpt_oss_dapo_tiny.yaml --backend cuda --steps 5 \
    --profile-steps 0 --profile-build --sync-sources 3 --out "$OUT/profile_warm.json"
fi
# shellcheck disable=SC2086
want 3 && step recipes $PY bench/recipe_tiny.py --backend cuda --seeds $SEEDS --jobs "${GPU_CHECK_JOBS:-1}" --out "$OUT/recipe_tiny_cuda.json"
if want 4; then
  plot=()
  $PY -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/parity_recipe_cuda.png")
  levels=()
  for l in ${GPU_PARITY_LEVELS:-}; do levels+=(--level "$l"); done  # default: all four
  [[ " ${GPU_PARITY_LEVELS:-recipe} " == *" recipe "* ]] || plot=()
  step parity $PY -m polyrl parity --backend cuda "${levels[@]}" --steps "${GPU_PARITY_STEPS:-40}" \
    --seeds "${GPU_PARITY_SEEDS:-0,1}" --jobs 8 --output "$OUT/parity_cuda.json" "${plot[@]}"
fi
want 5 && step attention $PY bench/attention.py --quick --out "$OUT/attention_quick.json"
want 6 && step logprob_linear $PY bench/logprob_linear.py --out "$OUT/logprob_linear.json"
want 10 && step model_step $PY bench/model_step.py --out "$OUT/model_step.json"
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
if want 7 && [[ $ngpu -ge 2 ]]; then
  step two_gpu $PY bench/two_gpu.py --recipes gpt_oss_dapo_tiny --no-profile --set trainer.total_steps=40 \
    --out "$OUT/two_gpu.json"
elif want 7; then
  echo "=== two_gpu: not run: $ngpu GPU(s) on this machine" | tee -a "$OUT/not_run.txt"
fi
want 8 && step memory_plan $PY bench/memory_plan.py --out "$OUT/memory_plan.json"
if want 9 && $PY -c "import vllm" 2>/dev/null; then
  step vllm_engine $PY bench/vllm_engine.py --backend cuda ${GPU_VLLM_MODELS:-} --out "$OUT/vllm_engine.json"
  # shellcheck disable=SC2086
  step vllm_recipes $PY bench/recipe_tiny.py --backend cuda --set rollout.engine=vllm --recipes ${GPU_VLLM_RECIPES:-gpt_oss_dapo_tiny deepseek_ppo_tiny_vllm} \
    --seeds $SEEDS --jobs 1 --cores-per-job 5 --out "$OUT/recipe_tiny_cuda_vllm.json"  # one vllm engine per GPU: docs/rollout.md
elif want 9; then
  echo "=== vllm: not run: vllm is not importable here (bench/vllm_carry.sh, docs/rollout.md)" | tee -a "$OUT/not_run.txt"
fi

echo "=== summary"
for s in "${status[@]}"; do echo "$s"; done | tee "$OUT/summary.txt"
cat "$OUT/not_run.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
grep -h "start-up" "$OUT"/profile_*.log 2>/dev/null | tee -a "$OUT/summary.txt"
grep -hE "^(gpt_oss|deepseek)" "$OUT/recipes.log" 2>/dev/null | tee -a "$OUT/summary.txt"
grep -hE "^(gpt_oss|deepseek)" "$OUT/vllm_engine.log" "$OUT/vllm_recipes.log" 2>/dev/null | sed 's/^/vllm: /' | tee -a "$OUT/summary.txt"
tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null | tee -a "$OUT/summary.txt"
for s in "${status[@]}"; do [[ $s == *"rc=0 "* ]] || exit 1; done
