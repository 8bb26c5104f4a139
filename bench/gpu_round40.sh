#!/usr/bin/env bash
# Issue 40's GPU measurements in one device call (10 minutes at most), after `bash bench/gpu_peers.sh stash`
# (first call, carrying .whl_big/cu12.part.aa and .whl_b2). This call carries .whl_big/cu12.part.ab and .whl:
#   bash bench/gpu_round40.sh
# It installs polyrl and the peers, prints `polyrl backends` (the attention / log-prob / decode choices), runs the
# GPU tests of the FA4 dispatch, the cuBLAS log-prob path and the decode kernel, `polyrl parity --level op`, then
# bench/attention.py --quick, bench/logprob_linear.py and bench/model_step.py, each beside its peers. Logs and JSON
# go to $OUT (the device's return folder) or ./gpu_round40_out.
set -uo pipefail
OUT=${OUT:-gpu_round40_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pipe.log 2>&1 || tail -5 $OUT/pipe.log
bash bench/gpu_peers.sh > $OUT/peers.log 2>&1; echo "peers rc=$? $((SECONDS-t0))s"; tail -4 $OUT/peers.log
. /tmp/site/peers_env.sh
python3 -m polyrl backends 2>&1 | tee $OUT/backends.txt | tail -25
echo "== tests $((SECONDS-t0))s"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -n 3 tests/cuda/test_attention_choice.py tests/cuda/test_attention_fa4_gpu.py tests/cuda/test_linear_logprobs_gpu.py tests/cuda/test_decode_gpu.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -25
echo "== op parity $((SECONDS-t0))s"
timeout 90 python3 -m polyrl parity --backend cuda --level op --output $OUT/parity_op.json > $OUT/parity_op.log 2>&1; echo "parity rc=$?"; tail -8 $OUT/parity_op.log
echo "== attention $((SECONDS-t0))s"
timeout 100 python3 bench/attention.py --quick --out $OUT/attention.json > $OUT/attention.log 2>&1; echo "rc=$?"; tail -22 $OUT/attention.log
echo "== logprob $((SECONDS-t0))s"
timeout 100 python3 bench/logprob_linear.py --out $OUT/logprob.json > $OUT/logprob.log 2>&1; echo "rc=$?"; tail -16 $OUT/logprob.log
echo "== model_step $((SECONDS-t0))s"
timeout $((560-(SECONDS-t0))) python3 bench/model_step.py --out $OUT/model_step.json > $OUT/model_step.log 2>&1; echo "rc=$?"; tail -22 $OUT/model_step.log
echo "== end $((SECONDS-t0))s"
