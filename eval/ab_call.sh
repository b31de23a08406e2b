#!/usr/bin/env bash
# Paired A/Bs on a lent GPU in ONE device call: each argument group runs `python -m amk.eval.ab`
# (prewarm, then gated benches in rotated rounds), one model after another, under one budget.
#
#   device run:  AMK_GIT_COMMIT=<sha> bash eval/ab_call.sh \
#                  "smollm2-135m --arm base= --arm ce0=@AMK_COMBINE_EARLY=0" \
#                  "llama-3.2-1b --arm base= --arm k12=eval/configs/kv_splits_12.json"
#                carry: [".whl"]   timeout_s: 600   (the wheels: ../shared/tools/device-wheels.sh)
#   <sha>: HEAD's, written into the command here: `git rev-parse` on the device machine has reported
#   the session's first commit, not the tree it ran (session 43), and every row records this value.
#
# Each group is MODEL followed by amk.eval.ab's own arguments; config paths are relative to the
# repository root. Every group gets --bandwidth 3000 unless it names one, and writes
# $OUT/ab_<n>_<model>.json (after every bench: a call cut short keeps what it measured). Its
# progress, the environment's setup and the GPU's clocks go to the one $OUT/ab_call.log: N groups
# bring back N + 1 files (a device call returns at most 8; session 46 lost a third group's files
# when each group wrote three). A group is skipped once less than AMK_AB_MIN_LEFT_S (150 s) of
# AMK_AB_BUDGET_S (540 s) is left; its benches each get what remains of the budget at most.
# The tables come last in the output, so the reply's tail holds them.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/out/ab_call}
BUDGET_S=${AMK_AB_BUDGET_S:-540}
MIN_LEFT_S=${AMK_AB_MIN_LEFT_S:-150}
START=$SECONDS
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: bash eval/ab_call.sh \"MODEL --arm L=[CFG][@DEFINES] ...\" ..." >&2; exit 2; }
export AMK_GIT_COMMIT=${AMK_GIT_COMMIT:-$(cat "$REPO/.git_commit" 2>/dev/null || git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}
ROOT=$REPO
LOG="$OUT/ab_call.log"
: >"$LOG"
source "$REPO/eval/device_env.sh" >>"$LOG" 2>&1 || { echo "eval/device_env.sh failed (see ab_call.log)"; exit 1; }
# outside the repository root, so that its amk/ folder does not shadow the package shim;
# config paths are made absolute below
mkdir -p /tmp/amk-run && cd /tmp/amk-run || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$LOG"

n=0
status=0
tables=()
for group in "$@"; do
  n=$((n + 1))
  read -r -a words <<<"$group"
  model=${words[0]}
  args=()
  for w in "${words[@]:1}"; do  # --arm LABEL=CFG[@DEFINES]: a relative CFG is the repo's
    if [[ $w == *=* && $w != -* ]]; then
      label=${w%%=*} rest=${w#*=}
      cfg=${rest%%@*}
      [[ -n $cfg && $cfg != /* ]] && w="$label=$REPO/$rest"
    fi
    args+=("$w")
  done
  [[ " ${args[*]} " == *" --bandwidth "* ]] || args+=(--bandwidth 3000)
  left=$((BUDGET_S - (SECONDS - START)))
  tag="ab_${n}_${model//[^A-Za-z0-9._-]/_}"
  if [ "$left" -lt "$MIN_LEFT_S" ]; then
    echo "[ab_call] skipped group $n ($model): ${left}s of the ${BUDGET_S}s budget left"; status=1
    continue
  fi
  echo "[ab_call +$((SECONDS - START))s] $model ${args[*]} (at most ${left}s)"
  echo "== group $n ($tag): $model ${args[*]}" >>"$LOG"
  timeout -k 10 "$left" python3 -m amk.eval.ab "$model" "${args[@]}" --timeout "$left" --out "$OUT/$tag.json" \
    >>"$LOG" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || { status=1; echo "[ab_call] group $n exited $rc (see ab_call.log)"; tail -n 5 "$LOG"; }
  tables+=("$OUT/$tag.json")
done
echo "[ab_call] done in $((SECONDS - START))s"
for t in ${tables[@]+"${tables[@]}"}; do  # from the JSON: a group cut short still shows its finished benches
  echo "== $(basename "$t" .json)"
  python3 -c "import json, sys; from amk.eval.ab import format_summary; print(format_summary(json.load(open(sys.argv[1]))))" \
    "$t" 2>/dev/null || echo "(no benches finished)"
done
exit $status
