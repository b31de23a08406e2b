#!/usr/bin/env bash
# One device call for a performance change: GPU correctness tests first, then the per-task
# trace, then gated `amk bench` runs of the Llama-3.2-1B shape for the default config and
# any config files named in AMK_PERF_CONFIGS (each row correctness-gated, as always).
#
#   device run:  AMK_GIT_COMMIT=<git rev-parse HEAD here> bash eval/perf_session.sh
#                carry: [".whl"]   timeout_s: 590
#   (the device copy has no .git history of its own: without AMK_GIT_COMMIT the rows say "unknown")
#
# Knobs: AMK_PERF_STEPS (what to run, default "tests trace bench"), AMK_TRACE_SHAPES (shapes to trace,
# default llama-3.2-1b), AMK_PERF_CONFIGS (space-
# separated config JSON paths, relative to the repo), AMK_BENCH_BASELINES, AMK_BENCH_CTX.
# Results under $OUT: pytest.log, SHAPE/trace_step.json, perf_*.json, session.log.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/out/perf_session}
STEPS=${AMK_PERF_STEPS:-tests trace bench}
BASELINES=${AMK_BENCH_BASELINES:-cuda_graph,torch_compile,hf_eager}
CTX=${AMK_BENCH_CTX:-1024}
mkdir -p "$OUT"
LOG=$OUT/session.log
START=$SECONDS
log() { echo "[perf +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
ROOT=$REPO
source "$REPO/eval/device_env.sh" >>"$LOG" 2>&1
export AMK_GIT_COMMIT=${AMK_GIT_COMMIT:-$(cat "$REPO/.git_commit" 2>/dev/null || echo unknown)}
mkdir -p /tmp/amk-run && cd /tmp/amk-run || exit 1

for step in $STEPS; do
  case $step in
    tests)
      log "GPU tests"
      (cd "$REPO" && timeout -k 5 300 python3 -m pytest -m gpu tests/test_vm_gpu.py -x -q -p no:cacheprovider \
        -p no:randomly 2>&1 | tail -n 25 | tee "$OUT/pytest.log")
      ;;
    trace)
      for shape in ${AMK_TRACE_SHAPES:-llama-3.2-1b}; do
        log "trace step ($shape, ctx $CTX)"
        mkdir -p "$OUT/$shape"
        timeout -k 5 200 python3 -m amk.eval.trace_step --shape "$shape" --ctx "$CTX" --out "$OUT/$shape" 2>&1 \
          | sed -n '1,60p' | tee -a "$LOG"
      done
      ;;
    bench)
      for cfg in default ${AMK_PERF_CONFIGS:-}; do
        name=$(basename "$cfg" .json)
        args=()
        [ "$cfg" = default ] || args=(--config "$REPO/$cfg")
        log "amk bench llama-3.2-1b ($name)"
        timeout -k 5 170 python3 -m amk.cli bench llama-3.2-1b --random-init --dtype bfloat16 --ctx "$CTX" \
          --baselines "$BASELINES" "${args[@]}" --out "$OUT/perf_$name.json" 2>&1 | tail -n 30 | tee -a "$LOG"
        BASELINES=cuda_graph,hf_eager  # later configs: the cheap baseline (and the gate's yardstick)
      done
      ;;
  esac
done
log "done"
