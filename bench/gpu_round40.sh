#!/usr/bin/env bash
# Issue 40's GPU measurements in one device call (10 minutes at most), after `bash bench/gpu_peers.sh stash`
# (first call, carrying .whl_big/cu12.part.aa and .whl_b2). This call carries .whl_big/cu12.part.ab and .whl:
#   bash bench/gpu_round40.sh
# It installs polyrl (its entry points find the backends) and the peers, prints `polyrl backends` (the attention,
# log-prob and decode choices), runs the GPU tests of the FA4 dispatch and both fused log-prob paths (with -s: each
# case's measured errors), the launch-config sweep of the Triton attention kernels beside FA4
# (bench/attention_sweep.py), then bench/gpu_check.sh's steps 6 and 10: bench/logprob_linear.py and
# bench/model_step.py, each beside its peers. Logs and JSON go to $OUT (the device's return folder) or
# ./gpu_round40_out.
set -uo pipefail
OUT=${OUT:-gpu_round40_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
bash bench/gpu_peers.sh > "$OUT/peers.log" 2>&1; echo "peers rc=$?"; tail -4 "$OUT/peers.log"
. /tmp/site/peers_env.sh
python3 -m polyrl backends > "$OUT/backends.txt" 2>&1; grep -iE "linear|fa4|triton|cublas" "$OUT/backends.txt" | head -12
timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/cuda/test_attention_fa4_gpu.py \
  tests/cuda/test_linear_logprobs_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^fa4|FAILED|ERROR|passed|failed|over the bar" "$OUT/tests.log" | tail -30
timeout 200 python3 bench/attention_sweep.py --out "$OUT/attention_sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; grep -vE "^  " "$OUT/sweep.log" | tail -20
GPU_CHECK_STEPS="6 10" GPU_CHECK_OUT="$OUT/gpu_check" timeout 230 bash bench/gpu_check.sh
