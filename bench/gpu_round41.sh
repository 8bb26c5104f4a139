#!/usr/bin/env bash
# Issue 40, after grouped_experts (the reference experts kernel whose gathers do not scatter in the backward): device
# calls on the machine the quick check left warm (the first two need no peers):
#   bash bench/gpu_round41.sh experts    # 4.6 minutes on an H100 (6f6b711) with the experts bench cut at 240 s; up to 8 now
#   bash bench/gpu_round41.sh recipes    # 5.5 minutes on an H100 (6f6b711)
#   bash bench/gpu_round41.sh peers      # about 6 minutes, after the peers' stash call (below)
#   bash bench/gpu_round41.sh startup    # 2 minutes on an H100 (6f6b711), carrying .whl_spy (below)
#   bash bench/gpu_round41.sh sweep      # a few minutes: the launch-config sweep, FA4 beside it if the peers part ran
#   bash bench/gpu_round41.sh table      # at most 9.5 minutes after the peers' stash call: issue 40's table
# experts:
#   1. bench/experts_path.py at GPT-OSS-20B width (2 layers, 32 experts, top-4, bf16, 16384 tokens): polyrl's experts
#      path (its bias gradients segmented sums since 6f6b711's 16 indexing_backward_kernel launches a tiny DAPO step)
#      beside transformers' grouped_mm path and beside polyrl's with a one-hot-matmul bias gradient, same run, the
#      ratios, how far each agrees with transformers' (output and every gradient) and which equal polyrl's;
#   2. bench/profile_step.py on the tiny DAPO recipe (cuda, 20 steps, 3 profiled): the step split and the top kernels
#      (indexing_backward_kernel was about 30% of the GPU time on c178864), the host<-device syncs by call site (the
#      profile's 1,446 a step count every item(), CPU tensors' too) and a cProfile of the trainer build (9 s of the
#      14 s start-up on c178864: imports, or something else?);
# recipes:
#   3. bench/recipe_tiny.py, both tiny recipes, seeds 0-4, one run at a time: walls against the 30 s / 45 s goals and
#      the last-10 rewards (>= 0.9).
# peers (FA4 and the other peers carried in: `bash bench/gpu_peers.sh download` here first, then one call carrying
# .whl_big/cu12.part.aa and .whl_b2 runs `bash bench/gpu_peers.sh stash`, and within 30 s this part, carrying
# .whl_big/cu12.part.ab and .whl; about 6 minutes):
#   4. bench/attention_mla.py: DeepSeek-V3's layout (128 heads, head dims 192 / 128, causal, no sinks), polyrl's
#      Triton kernel beside FA4 (polyrl's wrapper and direct): its Measurement line, if FA4 is faster, goes into
#      polyrl.backends.cuda.attention_choice.MEASURED so the cuda backend runs FA4 there;
#   5. bench/model_step.py: the real-width step (2 GPT-OSS layers, 128 experts, 16k tokens) beside transformers + FA4
#      with its labels= loss, after grouped_experts (1.008x the time, 0.497x the memory on c178864).
# table (the peers carried in as for the peers part): issue 40's table, each benchmark one run with its peers:
#   8. bench/attention.py, 4x4096 and 1x16384, causal and window 128: polyrl's Triton kernel, the cuda backend's
#      pick (polyrl-selected) and FA4; bench/logprob_linear.py at 16k tokens beside Liger / Cut Cross-Entropy;
#      bench/model_step.py (2 GPT-OSS layers at full width, 4k and 16k tokens, beside transformers + FA4).
# startup (the py-spy wheel carried in .whl_spy, fetched here with `python3 -m pip download --no-deps --only-binary=:all:
# --platform manylinux1_x86_64 -d .whl_spy py-spy==0.4.3`):
#   6. the tiny DAPO recipe, seed 0, recorded whole by py-spy (--idle, 100 Hz), on a machine that has not run it yet
#      (cold: Triton compiles) and again (warm), each split by bench/spy_split.py into interpreter start and imports,
#      the CLI, the build (by callee), the steps, checkpoints and exit. On c178864 about 20 s of the 29.8 s wall was
#      outside the steps against about 6 s on 2 CPU cores: which part grows on the GPU?
# sweep:
#   7. bench/attention_sweep.py at 4x4096 and 1x16384 (causal): every candidate of the three Triton kernels, among
#      them three 128-key dK/dV configs that compile without spills (docs/performance.md, "the compiled code"), and
#      each kernel's variants on their listed tiles (attention_sweep.VARIANT_CANDIDATES: dK/dV's PREFETCH, the TMA
#      loads of all three; measured on an H100 on 2026-12-07).
# Logs and JSON go to $OUT (the device's return folder) or ./gpu_round41_out.
set -uo pipefail
PART=${1:-experts}
case "$PART" in experts|recipes|peers|startup|sweep|table) ;;
  *) echo "usage: bash bench/gpu_round41.sh experts|recipes|peers|startup|sweep|table"; exit 2;; esac
OUT=${OUT:-gpu_round41_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
if [ "$PART" = experts ]; then
  timeout 420 python3 bench/experts_path.py --backend cuda --tokens 16384 --out "$OUT/experts_path_16384.json" \
    > "$OUT/experts_path_16384.log" 2>&1
  echo "experts_path rc=$?"; tail -7 "$OUT/experts_path_16384.log"
  timeout 150 python3 bench/profile_step.py polyrl/recipes/gpt_oss_dapo_tiny.yaml --backend cuda --steps 20 \
    --profile-steps 3 --sync-sources 3 --profile-build --out "$OUT/profile_dapo.json" > "$OUT/profile_dapo.log" 2>&1
  echo "profile rc=$?"; grep -E "start-up|median over|per step|indexing|Self CUDA time" "$OUT/profile_dapo.log" | head -12
  grep -A12 "host<-device syncs:" "$OUT/profile_dapo.log"
  grep -A30 "trainer build, cProfile" "$OUT/profile_dapo.log" | cut -c1-150 | tail -22
elif [ "$PART" = recipes ]; then
  bash bench/bytecode.sh | tee "$OUT/bytecode.txt"
  timeout 540 python3 bench/recipe_tiny.py --backend cuda --recipes gpt_oss_dapo_tiny deepseek_ppo_tiny \
    --seeds 0 1 2 3 4 --jobs 1 --out "$OUT/recipe_tiny.json" > "$OUT/recipe_tiny.log" 2>&1
  echo "recipes rc=$?"; grep -E "^(gpt_oss|deepseek)" "$OUT/recipe_tiny.log" | tail -12
elif [ "$PART" = peers ]; then
  bash bench/gpu_peers.sh > "$OUT/peers.log" 2>&1; echo "peers rc=$?"; tail -3 "$OUT/peers.log"
  . /tmp/site/peers_env.sh
  timeout 200 python3 bench/attention_mla.py --out "$OUT/attention_mla.json" > "$OUT/attention_mla.log" 2>&1
  echo "attention_mla rc=$?"; tail -14 "$OUT/attention_mla.log"
  timeout 300 python3 bench/model_step.py --out "$OUT/model_step.json" > "$OUT/model_step.log" 2>&1
  echo "model_step rc=$?"; tail -24 "$OUT/model_step.log"
elif [ "$PART" = table ]; then
  bash bench/gpu_peers.sh > "$OUT/peers.log" 2>&1; echo "peers rc=$?"; tail -3 "$OUT/peers.log"
  . /tmp/site/peers_env.sh
  timeout 200 python3 bench/attention.py --layouts 4x4096,1x16384 --windows none,128 --no-accuracy \
    --impls polyrl,polyrl-selected,fa4 --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
  echo "attention rc=$?"; grep -vE "^ {20}" "$OUT/attention.log" | tail -22
  timeout 120 python3 bench/logprob_linear.py --T 16384 --out "$OUT/logprob_linear.json" > "$OUT/logprob_linear.log" 2>&1
  echo "logprob_linear rc=$?"; tail -12 "$OUT/logprob_linear.log"
  timeout 200 python3 bench/model_step.py --out "$OUT/model_step.json" > "$OUT/model_step.log" 2>&1
  echo "model_step rc=$?"; tail -24 "$OUT/model_step.log"
elif [ "$PART" = startup ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl_spy/*.whl || exit 1
  # As the machine comes (GPU_CHECK_BYTECODE=0 for bench/bytecode.sh), or byte-compiled first: the split says
  # which part the missing .pyc files cost (docs/performance.md). At most 8 files come back from a call.
  bash bench/bytecode.sh | tee "$OUT/run.log"
  for t in cold warm; do
    rm -rf "/tmp/startup_$t"; S=$SECONDS
    timeout 90 /tmp/spy/bin/py-spy record --idle -r 100 -f raw -o "$OUT/spy_$t.txt" -- python3 -m polyrl run \
      recipes/gpt_oss_dapo_tiny.yaml --seed 0 --backend cuda --output "/tmp/startup_$t" --no-progress \
      >> "$OUT/run.log" 2>&1
    echo "$t: rc=$? wall $((SECONDS - S)) s" | tee -a "$OUT/run.log"
    cp "/tmp/startup_$t/metrics.jsonl" "$OUT/metrics_$t.jsonl" 2>/dev/null
    python3 bench/spy_split.py "$OUT/spy_$t.txt" --out "$OUT/spy_split_$t.json"; gzip -f "$OUT/spy_$t.txt"
  done
  python3 -X importtime -c "import polyrl.core.trainer, polyrl.backends.cuda" 2> "$OUT/importtime.txt"
  echo "imports by cumulative us:"; sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -25
elif [ "$PART" = sweep ]; then
  if [ -f /tmp/site/peers_env.sh ]; then . /tmp/site/peers_env.sh; fi
  timeout 420 python3 bench/attention_sweep.py --out "$OUT/attention_sweep.json" > "$OUT/attention_sweep.log" 2>&1
  echo "attention_sweep rc=$?"; grep -E "dkdv|kernels fwd\+bwd" "$OUT/attention_sweep.log" | tail -34
fi
