#!/usr/bin/env bash
# GPU self-test of the CUDA megakernel VM, for the lent GPU machine:
#     bash eval/gpu_selftest.sh                 # carry ".whl" (../shared/tools/device-wheels.sh)
# Runs `pytest -m gpu tests/test_vm_gpu.py -x -q` (override the flags with AMK_PYTEST_ARGS)
# after building the megakernel once for the live GPU, and prints a summary last.
# Logs under $OUT (default out/gpu_selftest): env.txt, build.txt, pytest.log, junit.xml.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu_selftest}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

source "$ROOT/eval/device_env.sh"

{
  date -u
  nvidia-smi 2>&1 | head -15
  $PY - <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("torch", "cupy", "pydantic", "transformers", "pytest", "platformdirs"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PYEOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Build once (NVRTC) so compile time is reported apart from the tests.
$PY - >"$OUT/build.txt" 2>&1 <<'PYEOF'
import time
from amk.vm import build
arch = build.device_arch(0)
for threads in (256, 512):
    t = time.time()
    path = build.compile_cubin(arch, threads=threads)
    print(f"sm_{arch} threads={threads}: {path.stat().st_size} bytes in {time.time() - t:.1f}s -> {path}")
PYEOF
build_rc=$?
cat "$OUT/build.txt"

ARGS=${AMK_PYTEST_ARGS:--x -q}
start=$(date +%s)
# shellcheck disable=SC2086
$PY -m pytest -m gpu tests/test_vm_gpu.py $ARGS -p no:cacheprovider -rfEs --junitxml="$OUT/junit.xml" \
  2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
took=$(( $(date +%s) - start ))

echo
echo "================ AMK GPU self-test summary ================"
echo "device : $(grep -m1 '^cuda' "$OUT/env.txt")"
echo "build  : $( [ $build_rc -eq 0 ] && echo ok || echo FAILED ) ($(grep -c threads= "$OUT/build.txt") cubins)"
echo "pytest : $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/pytest.log" | tail -1) in ${took}s (rc=$rc)"
grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" | head -20
echo "result : $( [ $rc -eq 0 ] && [ $build_rc -eq 0 ] && echo PASS || echo FAIL )"
echo "logs   : $OUT"
exit $(( rc != 0 || build_rc != 0 ))
