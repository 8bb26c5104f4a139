#!/usr/bin/env bash
# Bring vLLM 0.26.0 (CUDA) to a GPU machine that has no network, for the vllm rollout engine: run it HERE, where
# PyPI is reachable, then copy OUTDIR to the GPU machine (docs/rollout.md, "vLLM on an offline GPU machine").
#
#   bash bench/vllm_carry.sh OUTDIR        # ~4 min, xz dominates
#
# What it writes, for a machine whose image has Python 3.12 and torch 2.11.0+cu130 (vLLM 0.20.0-0.26.0 pin
# torch==2.11.0; their PyPI wheels are CUDA 13 builds that load beside that torch):
#   OUTDIR/vllm026trim.tar.xz.part00, part01 (50 MiB each), part02 (~6 MiB): the vLLM wheel's files without what
#     an H200 does not use with polyrl's models (FlashAttention-2, the Rust frontend, FlashMLA, Blackwell-only
#     fmha, deep_gemm builds for other Pythons), xz-packed and split, so that no part is over 50 MiB;
#   OUTDIR/wheels/*.whl (~32 MiB): the dependencies such an image lacks for offline `vllm.LLM`.
# On the GPU machine (see docs/rollout.md for a machine that receives at most ~60 MiB at a time):
#   mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site OUTDIR/wheels/*.whl
#   cat OUTDIR/vllm026trim.tar.xz.part0* | python3 -c 'import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode="r|xz").extractall("/tmp/site")'
#   export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1
# (the cuda backend sets VLLM_USE_FLASHINFER_SAMPLER=0 itself: FlashInfer is not carried).
set -euo pipefail
OUT=${1:?usage: bench/vllm_carry.sh OUTDIR}
mkdir -p "$OUT"/wheels
OUT=$(cd "$OUT" && pwd)  # absolute: the packing below runs in a scratch directory
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for n in 28 27 17 31 26 24; do P+=(--platform "manylinux_2_${n}_x86_64"); done
P+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
if [[ ! -e "$OUT/vllm026trim.tar.xz.part00" ]]; then
  pip download -q "${P[@]}" -d "$W" vllm==0.26.0
  mkdir "$W/t"
  (cd "$W/t" && unzip -q ../vllm-0.26.0-*.whl \
    && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_flashmla_C.abi3.so \
             vllm/_flashmla_extension_C.abi3.so vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so \
    && rm -rf vllm/third_party/fmha_sm100 \
    && tar -cf - vllm vllm-0.26.0.dist-info | xz -9 -T0 > "$OUT/vllm026trim.tar.xz")
  split -b 50M -d "$OUT/vllm026trim.tar.xz" "$OUT/vllm026trim.tar.xz.part"
  rm "$OUT/vllm026trim.tar.xz"
fi
# the dependencies the H200 image lacks (pinned: the set measured to import and run `vllm.LLM` offline)
pip download -q "${P[@]}" -d "$OUT/wheels" pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 \
  annotated-types==0.8.0 typing-extensions==4.16.0 cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 \
  cachetools==8.0.2 blake3==1.0.11 setproctitle==1.3.8 mistral_common==1.13.1 pydantic-extra-types==2.11.1 \
  pycountry==26.2.16 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 \
  openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 xgrammar==0.2.6 apache-tvm-ffi==0.1.10 \
  fastapi==0.136.3 starlette==1.10.0 compressed-tensors==0.17.0 loguru==0.7.3
ls -l "$OUT" "$OUT"/wheels
du -sh "$OUT"
