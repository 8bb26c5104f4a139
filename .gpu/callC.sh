#!/usr/bin/env bash
# Final device call on two H200s: the one GPU check's steps split over the two GPUs, then the two-GPU drill.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core*.whl .whl/liger_kernel*.whl .whl/einops*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
T0=$SECONDS
( export CUDA_VISIBLE_DEVICES=1; GPU_CHECK_OUT=/tmp/gc1 GPU_CHECK_STEPS="1 3" GPU_CHECK_SEEDS=0 timeout 400 bash bench/gpu_check.sh > /tmp/gc1.log 2>&1; echo "gpu1 (tests, recipes) rc=$? $((SECONDS-T0))s" >> /tmp/parts.txt ) &
A=$!
( export CUDA_VISIBLE_DEVICES=0; GPU_CHECK_OUT=/tmp/gc2 GPU_CHECK_STEPS="8 4" GPU_PARITY_LEVELS="op model step" timeout 200 bash bench/gpu_check.sh > /tmp/gc2.log 2>&1; echo "gpu0 (plan, parity osm) rc=$? $((SECONDS-T0))s" >> /tmp/parts.txt
  GPU_CHECK_OUT=/tmp/gc3 GPU_CHECK_STEPS="4" GPU_PARITY_LEVELS="recipe" GPU_PARITY_STEPS=30 timeout $((400-SECONDS)) bash bench/gpu_check.sh > /tmp/gc3.log 2>&1; echo "gpu0 (parity recipe) rc=$? $((SECONDS-T0))s" >> /tmp/parts.txt ) &
B=$!
wait $A $B
GPU_CHECK_OUT=/tmp/gc4 GPU_CHECK_STEPS="7" timeout $((570-SECONDS)) bash bench/gpu_check.sh > /tmp/gc4.log 2>&1; echo "both (two_gpu drill) rc=$? $((SECONDS-T0))s" >> /tmp/parts.txt
cp /tmp/gc1.log /tmp/gc2.log /tmp/gc3.log /tmp/gc4.log /tmp/parts.txt /tmp/gc1/ 2>/dev/null
tar czf $OUT/gpu_check.tgz -C /tmp gc1 gc2 gc3 gc4 2>/dev/null
cp /tmp/gc3/parity_recipe_cuda.png $OUT/ 2>/dev/null
cat /tmp/parts.txt; cat /tmp/gc*/summary.txt 2>/dev/null | grep -v "^$"; tail -12 /tmp/gc2/memory_plan.log 2>/dev/null
