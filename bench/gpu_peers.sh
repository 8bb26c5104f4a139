#!/usr/bin/env bash
# Install the GPU peer kernels that bench/attention.py compares against (FlashAttention-4, FLA, Liger and the
# CuTe DSL underneath FA4) on the GPU machine, offline, from wheels carried in from the dev machine.
#
# The wheels live in ignored folders (never committed), sized so that each device call carries < 60 MiB:
#   .whl/       flash_attn_4, fla_core, liger_kernel, quack_kernels, nvidia_cutlass_dsl (+ libs_base, libs_core),
#               apache_tvm_ffi, torch_c_dlpack_ext, einops                                       (~12 MiB)
#   .whl_b2/    fallbacks installed only when the image lacks them: cuda_bindings 13.x, cuda_pathfinder,
#               protobuf, typing_extensions                                                        (~8.5 MiB)
#   .whl_big/   cu12.part.aa + cu12.part.ab: nvidia_cutlass_dsl_libs_cu12 (92 MB) cut by `split -b 46m`
#
# Two device calls:
#   1) carry .whl_big/cu12.part.aa and .whl_b2:   bash bench/gpu_peers.sh stash
#      (copies whatever wheels / parts are present to $STASH, default /tmp/gpu_peers_stash)
#   2) carry .whl_big/cu12.part.ab and .whl:      bash bench/gpu_peers.sh && . /tmp/site/peers_env.sh && ...
#      (joins the halves, checks the sha256, installs everything into $SITE, default /tmp/site, with
#      pip --target, writes $SITE/peers_env.sh and prints the PYTHONPATH line)
# The folders are rebuilt on the dev machine (network to PyPI) with:   bash bench/gpu_peers.sh download
# (the versions below; Python 3.12 manylinux wheels for the GPU image; the cu12 wheel's sha256 is checked, then split).
# A first half copied by hand to /tmp/cu12.part.aa is found too. Without both halves (or with a bad join)
# FA4 and its CuTe DSL stack are skipped and the benches report FA4 "not installed"; FLA and Liger still install.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=${GPU_PEERS_SITE:-/tmp/site}
STASH=${GPU_PEERS_STASH:-/tmp/gpu_peers_stash}
CU12_WHEEL=nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
CU12_SHA256=440b88739120c65d96c5f15bbe496a3bd7c26392874d5af6061d38497f84c70c
WHEEL_DIRS=(.whl .whl_b2 "$STASH")
PART_DIRS=(.whl_big "$STASH" /tmp)

if [[ "${1:-install}" == "download" ]]; then
    plat=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp)
    for n in 28 27 17 24 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
    plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
    mkdir -p .whl .whl_b2 .whl_big
    "$PY" -m pip download -q "${plat[@]}" -d .whl flash-attn-4==4.0.0b36 fla-core==0.6.0 liger-kernel==0.8.5 \
        cut-cross-entropy==25.1.1 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
        nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.1
    "$PY" -m pip download -q "${plat[@]}" -d .whl_b2 'cuda-bindings>=13,<14' cuda-pathfinder protobuf typing-extensions
    tmp=$(mktemp -d)
    "$PY" -m pip download -q "${plat[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu12==4.8.1
    echo "$CU12_SHA256  $tmp/$CU12_WHEEL" | sha256sum -c
    (cd .whl_big && rm -f cu12.part.* && split -b 46m "$tmp/$CU12_WHEEL" cu12.part.)
    rm -rf "$tmp"
    du -sh .whl .whl_b2 .whl_big; ls .whl .whl_b2 .whl_big
    exit 0
fi
if [[ "${1:-install}" == "stash" ]]; then
    mkdir -p "$STASH"
    shopt -s nullglob
    for f in .whl_big/cu12.part.* .whl/*.whl .whl_b2/*.whl; do cp -f "$f" "$STASH/"; done
    echo "stashed in $STASH:"
    ls -l "$STASH"
    exit 0
fi
[[ "${1:-install}" == "install" ]] || { echo "usage: $0 [install|stash|download]" >&2; exit 2; }

mkdir -p "$STASH"
# --- the cu12 libs: an already joined wheel, or the two halves from wherever they are --------------------
cu12=""
if [[ -f "$STASH/$CU12_WHEEL" ]] && echo "$CU12_SHA256  $STASH/$CU12_WHEEL" | sha256sum -c --status; then
    cu12="$STASH/$CU12_WHEEL"
else
    aa="" ab=""
    for d in "${PART_DIRS[@]}"; do
        [[ -z "$aa" && -f "$d/cu12.part.aa" ]] && aa="$d/cu12.part.aa"
        [[ -z "$ab" && -f "$d/cu12.part.ab" ]] && ab="$d/cu12.part.ab"
    done
    if [[ -n "$aa" && -n "$ab" ]]; then
        cat "$aa" "$ab" > "$STASH/$CU12_WHEEL"
        if echo "$CU12_SHA256  $STASH/$CU12_WHEEL" | sha256sum -c --status; then
            cu12="$STASH/$CU12_WHEEL"
            echo "joined $aa + $ab -> $cu12 (sha256 ok)"
        else
            echo "WARNING: $aa + $ab do not join to the expected wheel (sha256 mismatch); FA4 skipped" >&2
            rm -f "$STASH/$CU12_WHEEL"
        fi
    else
        echo "cu12 libs absent (part aa: ${aa:-missing}, part ab: ${ab:-missing}); FA4 and the CuTe DSL skipped"
    fi
fi

# --- every other wheel, one per file name, first folder wins ---------------------------------------------
declare -A seen=()
wheels=()
shopt -s nullglob
for d in "${WHEEL_DIRS[@]}"; do
    for f in "$d"/*.whl; do
        b=$(basename "$f")
        [[ "$b" == "$CU12_WHEEL" || -n "${seen[$b]:-}" ]] && continue
        seen[$b]=1
        wheels+=("$f")
    done
done

# Is a module importable by the image's own python (without our site)?
have() { env -u PYTHONPATH "$PY" -c "import $1" >/dev/null 2>&1; }
have_typing_extensions() {
    env -u PYTHONPATH "$PY" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as m
v = tuple(int(x) for x in m.version("typing_extensions").split(".")[:2])
raise SystemExit(0 if v >= (4, 13) else 1)
EOF
}

chosen=()
skipped=()
for f in "${wheels[@]}"; do
    b=$(basename "$f")
    name=${b%%-*}
    why=""
    case "$name" in
        flash_attn_4|quack_kernels|nvidia_cutlass_dsl|nvidia_cutlass_dsl_libs_*|apache_tvm_ffi|torch_c_dlpack_ext)
            [[ -n "$cu12" ]] || why="no cu12 libs" ;;
        cuda_bindings|cuda_pathfinder|protobuf)  # only the CuTe DSL needs these
            mod=$(case "$name" in cuda_bindings) echo cuda.bindings.driver ;; cuda_pathfinder) echo cuda.pathfinder ;;
                  *) echo google.protobuf ;; esac)
            if [[ -z "$cu12" ]]; then why="no cu12 libs"; elif have "$mod"; then why="image has it"; fi ;;
        typing_extensions)
            if have_typing_extensions; then why="image has >= 4.13"; fi ;;
        einops)
            if have einops; then why="image has it"; fi ;;
    esac
    if [[ -n "$why" ]]; then skipped+=("$name($why)"); else chosen+=("$f"); fi
done
[[ -n "$cu12" ]] && chosen+=("$cu12")
if [[ ${#chosen[@]} -eq 0 ]]; then
    echo "no wheels found in ${WHEEL_DIRS[*]}: nothing to install" >&2
    exit 1
fi

echo "installing into $SITE:"
printf '  %s\n' "${chosen[@]##*/}"
[[ ${#skipped[@]} -eq 0 ]] || echo "skipped: ${skipped[*]}"
rm -rf "$SITE"
mkdir -p "$SITE"
t0=$SECONDS
if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "${chosen[@]}"
else
    # No pip in the image: a wheel is a zip of its purelib/platlib tree (none of these has a .data folder).
    echo "pip unavailable: unzipping the wheels instead"
    "$PY" - "$SITE" "${chosen[@]}" <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
EOF
fi
echo "installed in $((SECONDS - t0)) s"

# FA4 imports `cutlass` from nvidia_cutlass_dsl/dsl_packages; the wheel adds that with a .pth file, which a
# --target install never runs, so it goes on PYTHONPATH by hand.
pp="$SITE"
[[ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ]] && pp="$pp:$SITE/nvidia_cutlass_dsl/dsl_packages"
cat > "$SITE/peers_env.sh" <<EOF
export PYTHONPATH=$pp\${PYTHONPATH:+:\$PYTHONPATH}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=\${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
EOF
echo
echo "# run this (or: . $SITE/peers_env.sh) before the benches:"
head -1 "$SITE/peers_env.sh"

# Smoke check, never fatal: what the benches will see.
PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF' || true
import importlib, importlib.metadata as md
for mod, dist in (("fla.ops.attn", "fla-core"), ("liger_kernel.ops", "liger-kernel"),
                  ("flash_attn.cute", "flash-attn-4"), ("cutlass", "nvidia-cutlass-dsl-libs-base")):
    try:
        importlib.import_module(mod)
        print(f"ok       {mod:18} {dist} {md.version(dist)}")
    except ImportError as e:
        print(f"missing  {mod:18} not installed: {e}")
    except Exception as e:  # e.g. the CuTe DSL finding no usable CUDA toolkit flavour
        print(f"broken   {mod:18} {type(e).__name__}: {str(e)[:300]}")
EOF
