#!/usr/bin/env bash
# Byte code as a pip install leaves it, before timing start-up on the GPU image: that image sets
# PYTHONDONTWRITEBYTECODE=1 and ships 5,614 of its site-packages' 25,127 modules without a .pyc, so every process
# compiled them again (about 5 s of each tiny recipe run's start-up on an H100, 6f6b711; docs/performance.md).
# Compiles site-packages and polyrl/ once (8 s on 16 cores), as `pip install` does by default; a no-op where the
# interpreter writes byte code itself, or with GPU_CHECK_BYTECODE=0 (the machine as it comes).
#   bash bench/bytecode.sh [python]      # prints one line saying what it did
PY=${1:-python3}
if [[ ${GPU_CHECK_BYTECODE:-1} == 0 ]]; then
  echo "bytecode: left as the machine has it (GPU_CHECK_BYTECODE=0)"; exit 0
fi
if ! $PY -c "import sys; sys.exit(not sys.flags.dont_write_bytecode)"; then
  echo "bytecode: nothing to do (the interpreter writes its own)"; exit 0
fi
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
t0=$SECONDS
# -q prints only the files that fail (a package's deliberately broken test data, say): counted, not fatal
failed=$($PY -m compileall -q -j 0 "$SITE" "$(dirname "$0")/../polyrl" 2>&1 | grep -c '^\*\*\*')
echo "bytecode: compiled $SITE and polyrl/ in $((SECONDS - t0)) s ($failed files not compilable):" \
  "PYTHONDONTWRITEBYTECODE is set here"
