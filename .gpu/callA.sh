#!/usr/bin/env bash
# Device call A (one H200): the GPU tests (xdist: Triton compiles in parallel), the fused log-prob bench, the main job, attention variants.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core*.whl .whl/liger_kernel*.whl .whl/einops*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
T0=$SECONDS
timeout 240 python3 -m pytest tests/cuda -m gpu -q -p no:cacheprovider -n 8 > $OUT/gpu_tests.log 2>&1; echo "gpu_tests rc=$? $((SECONDS-T0))s" >> $OUT/summary.txt
timeout 100 python3 bench/logprob_linear.py --out $OUT/logprob_linear.json > $OUT/logprob_linear.log 2>&1; echo "logprob_linear rc=$? $((SECONDS-T0))s" >> $OUT/summary.txt
timeout 130 python3 -m polyrl run recipes/gpt_oss_dapo_tiny.yaml --backend cuda --seed 0 --output /tmp/dapo1 --no-progress > $OUT/dapo_cuda.log 2>&1; echo "dapo_cuda rc=$? $((SECONDS-T0))s" >> $OUT/summary.txt; cp /tmp/dapo1/metrics.jsonl $OUT/dapo_cuda_metrics.jsonl
timeout $((570-SECONDS)) python3 bench/attention.py --variants --max-wall-s 100 --out $OUT/attention_variants.json > $OUT/attention_variants.log 2>&1; echo "attention rc=$? $((SECONDS-T0))s" >> $OUT/summary.txt
cat $OUT/summary.txt; grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -5; tail -4 $OUT/dapo_cuda.log
