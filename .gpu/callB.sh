#!/usr/bin/env bash
# Final device call: the one GPU check on the final tree, one H200, in three parts that each leave their files.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core*.whl .whl/liger_kernel*.whl .whl/einops*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
T0=$SECONDS
GPU_CHECK_OUT=/tmp/gc1 GPU_CHECK_STEPS="1 3 8" GPU_CHECK_SEEDS=0 timeout 390 bash bench/gpu_check.sh > /tmp/gc1.log 2>&1; echo "part1 rc=$? $((SECONDS-T0))s" | tee /tmp/parts.txt
GPU_CHECK_OUT=/tmp/gc2 GPU_CHECK_STEPS="4" GPU_PARITY_LEVELS="op model step" timeout $((500-SECONDS)) bash bench/gpu_check.sh > /tmp/gc2.log 2>&1; echo "part2 rc=$? $((SECONDS-T0))s" | tee -a /tmp/parts.txt
GPU_CHECK_OUT=/tmp/gc3 GPU_CHECK_STEPS="4" GPU_PARITY_LEVELS="recipe" GPU_PARITY_STEPS=30 timeout $((568-SECONDS)) bash bench/gpu_check.sh > /tmp/gc3.log 2>&1; echo "part3 rc=$? $((SECONDS-T0))s" | tee -a /tmp/parts.txt
cp /tmp/gc1.log /tmp/gc2.log /tmp/gc3.log /tmp/parts.txt /tmp/gc1/ 2>/dev/null
tar czf $OUT/gpu_check.tgz -C /tmp gc1 gc2 gc3 2>/dev/null
cp /tmp/gc3/parity_recipe_cuda.png $OUT/ 2>/dev/null
cat /tmp/parts.txt; cat /tmp/gc1/summary.txt /tmp/gc2/summary.txt /tmp/gc3/summary.txt 2>/dev/null | grep -v "^$"; grep -E "passed|failed" /tmp/gc1/gpu_tests.log | tail -2; tail -12 /tmp/gc1/memory_plan.log 2>/dev/null
