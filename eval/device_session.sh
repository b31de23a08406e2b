#!/usr/bin/env bash
# One device call that checks and measures what the CPU cannot: the validator speed on one
# quiet core, the soundness campaign on many cores, and the GPU self-test of the VM.
#   device run: bash eval/device_session.sh     carry: [".whl"]   (results under $OUT)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out/device}
mkdir -p "$OUT"
source eval/device_env.sh
SCHEDULES=${AMK_FUZZ_SCHEDULES:-100000}
commit=$(cat .git_commit 2>/dev/null || echo unknown)
echo "== validator speed (core 0)"; taskset -c 0 python3 -m amk.eval.validator_speed --out "$OUT" 2>&1 | tail -8
echo "== fuzz $SCHEDULES schedules (background, cores 2-15)"
taskset -c 2-15 python3 -m amk.cli fuzz --schedules "$SCHEDULES" --workers 14 --seed 0 --out "$OUT/validator_soundness.json" \
  >"$OUT/fuzz.log" 2>&1 &
fuzz=$!
echo "== GPU self-test"; OUT="$OUT" taskset -c 1 bash eval/gpu_selftest.sh 2>&1 | tail -40
wait $fuzz; echo "fuzz rc=$?"; tail -30 "$OUT/fuzz.log"
