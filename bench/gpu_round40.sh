#!/usr/bin/env bash
# Issue 40's GPU measurements in one device call (10 minutes at most), after `bash bench/gpu_peers.sh stash`
# (first call, carrying .whl_big/cu12.part.aa and .whl_b2). This call carries .whl_big/cu12.part.ab and .whl:
#   bash bench/gpu_round40.sh
# It installs polyrl (its entry points find the backends) and the peers, prints `polyrl backends` (the attention,
# log-prob and decode choices), runs the GPU tests of the FA4 dispatch, the cuBLAS log-prob path and the decode
# kernel, then bench/gpu_check.sh's steps 4 (op level only), 5, 6 and 10: op parity, bench/attention.py --quick,
# bench/logprob_linear.py and bench/model_step.py, each beside its peers. Logs and JSON go to $OUT (the device's return folder) or
# ./gpu_round40_out.
set -uo pipefail
OUT=${OUT:-gpu_round40_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
bash bench/gpu_peers.sh > "$OUT/peers.log" 2>&1; echo "peers rc=$?"; tail -4 "$OUT/peers.log"
. /tmp/site/peers_env.sh
python3 -m polyrl backends 2>&1 | tee "$OUT/backends.txt" | tail -25
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -n 3 tests/cuda/test_attention_choice.py \
  tests/cuda/test_attention_fa4_gpu.py tests/cuda/test_linear_logprobs_gpu.py tests/cuda/test_decode_gpu.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -25
GPU_CHECK_STEPS="4 5 6 10" GPU_PARITY_LEVELS=op GPU_CHECK_OUT="$OUT/gpu_check" timeout 420 bash bench/gpu_check.sh
