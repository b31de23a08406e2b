#!/usr/bin/env bash
# The decode benchmark on a lent H100 in ONE device call: about 4-7 minutes; the runs stop by
# AMK_BENCH_BUDGET_S=440 s after the start (each model gets what is left, up to its own cap),
# so the whole call stays under 8 minutes.
#
#   device run:  bash eval/gpu_bench.sh        carry: [".whl"]  timeout_s: 540
#   (commit: $AMK_GIT_COMMIT, else the file .git_commit in the repo root, else git)
#
# 1. setup + preflight (seconds): eval/device_env.sh (carried wheels, the amk package shim),
#    GPU + CuPy + pydantic present, `amk bench` registered
# 2. HBM bandwidth (device-to-device copy)                        -> $OUT/bandwidth.json
# 3. amk bench, bfloat16, ctx 1024, baselines cuda_graph,torch_compile,hf_eager, each run bounded
#    by what is left of the budget, in this order:
#      llama-3.1-8b (shape, random weights drawn on the GPU), llama-3.2-1b (shape),
#      SmolLM2-135M: the checkpoint at $AMK_SMOL if set, else its shape with random weights
#    -> $OUT/perf_h100.json (one row per model, merged), $OUT/bench.log (tables, progress, errors)
#
# Knobs: AMK_BENCH_BASELINES (drop torch_compile to save its compile time), AMK_BENCH_CTX,
# AMK_BENCH_BUDGET_S, AMK_BENCH_MODELS (e.g. "llama-3.2-1b smollm2-135m"), AMK_KERNEL_CACHE
# (a carried cubin cache: .carry/kernels is used when present).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/out/gpu_bench}
BUDGET_S=${AMK_BENCH_BUDGET_S:-440}
BASELINES=${AMK_BENCH_BASELINES:-cuda_graph,torch_compile,hf_eager}
CTX=${AMK_BENCH_CTX:-1024}
MODELS=${AMK_BENCH_MODELS:-llama-3.1-8b llama-3.2-1b smollm2-135m}
START=$SECONDS
mkdir -p "$OUT"
LOG=$OUT/bench.log
RESULTS=$OUT/perf_h100.json
export PYTHONUNBUFFERED=1
log() { echo "[gpu_bench +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------- setup
if [ -z "${AMK_KERNEL_CACHE:-}" ] && [ -d "$REPO/.carry/kernels" ]; then
  export AMK_KERNEL_CACHE=$REPO/.carry/kernels  # a cubin cache built ahead (vm/build.py keys it by source)
fi
if [ -z "${AMK_GIT_COMMIT:-}" ]; then
  AMK_GIT_COMMIT=$(cat "$REPO/.git_commit" 2>/dev/null || git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
  export AMK_GIT_COMMIT
fi
# carried wheels + the `amk` package mapped onto the repo's folders (PYTHONPATH shim)
ROOT=$REPO
source "$REPO/eval/device_env.sh" >>"$LOG" 2>&1 || die "eval/device_env.sh failed"
# Python runs outside the repository root: with the root as the current directory its amk/
# folder would be found before the shim, and amk.schedule, amk.vm, ... would not resolve.
mkdir -p /tmp/amk-run && cd /tmp/amk-run || die "no /tmp/amk-run"

# ---------------------------------------------------------------- preflight (fails in seconds)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader >>"$LOG" 2>&1
python3 - >>"$LOG" 2>&1 <<'EOF' || die "preflight failed (see the lines above in $OUT/bench.log)"
import importlib, sys
import torch
assert torch.cuda.is_available(), "torch sees no CUDA GPU"
for mod in ("cupy", "pydantic", "typer", "transformers", "amk.vm.loader", "amk.eval.bench", "amk.commands.bench_cmd"):
    importlib.import_module(mod)
print(f"preflight ok: {torch.cuda.get_device_name()} torch {torch.__version__} python {sys.version.split()[0]}")
EOF
python3 -m amk.cli bench --help >/dev/null 2>&1 \
  || die "'amk bench' is not registered: add app.command(\"bench\")(bench_cmd.bench_command) in amk/commands/__init__.py"
tail -n 2 "$LOG"

# ---------------------------------------------------------------- bandwidth
python3 -m amk.eval.peak_bandwidth --json >"$OUT/bandwidth.json" 2>>"$LOG" || die "bandwidth measurement failed"
BW=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['gbps'])" "$OUT/bandwidth.json") \
  || die "cannot read $OUT/bandwidth.json"
log "HBM bandwidth (copy, read+write): $BW GB/s"

# ---------------------------------------------------------------- benchmarks
declare -A CAP=([llama-3.1-8b]=210 [llama-3.2-1b]=120 [smollm2-135m]=160)
STATUS=()
FAILED=0
for m in $MODELS; do
  left=$((BUDGET_S - (SECONDS - START)))
  cap=${CAP[$m]:-180}
  t=$((cap < left ? cap : left))
  if [ "$t" -lt 45 ]; then
    log "skipped $m: only ${left}s of the ${BUDGET_S}s budget left"; STATUS+=("$m: skipped (budget)"); FAILED=1
    continue
  fi
  if [ "$m" = smollm2-135m ] && [ -n "${AMK_SMOL:-}" ]; then src=("$AMK_SMOL"); else src=("$m" --random-init); fi
  log "amk bench ${src[*]} --dtype bfloat16 --ctx $CTX --baselines $BASELINES (timeout ${t}s)"
  timeout -k 10 "$t" python3 -m amk.cli bench "${src[@]}" --dtype bfloat16 --ctx "$CTX" --bandwidth "$BW" \
    --baselines "$BASELINES" --out "$RESULTS" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) what="ok" ;; 1) what="REFUSED (gate failed / below floor / error: see log)" ;;
    3) what="measured, but a baseline failed (see log)" ;; 124|137) what="TIMED OUT after ${t}s" ;;
    *) what="failed (exit $rc)" ;;
  esac
  log "$m: $what"; STATUS+=("$m: $what")
  [ "$rc" -eq 0 ] || FAILED=1
done

log "done in $((SECONDS - START))s; results: $RESULTS"
for s in ${STATUS[@]+"${STATUS[@]}"}; do echo "  $s"; done | tee -a "$LOG"
# a compact last table (the reply shows the end of the output)
python3 - "$RESULTS" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError):
    sys.exit("no results file")
print(f"{'model':<16} {'floor us':>9} {'megakernel':>11} {'% floor':>8} {'best baseline':>24} {'speedup':>8}")
for r in rows:
    v, b = r["variants"], r["faster_baseline"]
    print(f"{r['model']:<16} {r['floor_us']:>9.1f} {v['megakernel']['median_us']:>11.1f} "
          f"{r['megakernel_pct_of_floor']:>7.1f}% {b + ' ' + format(v[b]['median_us'], '.1f'):>24} "
          f"{r['speedup_vs_faster_baseline']:>7.2f}x")
EOF
exit $FAILED
