#!/usr/bin/env bash
# Two source trees benched against each other in ONE device call, for a change that no define
# can turn off (e.g. a device-code rewrite): the working tree ("new") and an older commit's tree
# unpacked beside it ("old"), each bench a gated `amk bench MODEL --random-init --dtype bfloat16
# --ctx 1024 --baselines cuda_graph --bandwidth 3000 --json` in its own process, the trees'
# order swapped in the second round.
#
#   here:        mkdir -p .carry/old && git archive OLD_SHA | tar -x -C .carry/old
#   device run:  bash eval/tree_ab.sh .carry/old OLD_SHA NEW_SHA MODEL [MODEL ...]
#                carry: [".whl", ".carry"]   timeout_s: 600
#
# AMK_TREE_AB_ARGS adds bench options to every bench (e.g. "--config /abs/path/int8_g128.json";
# a path must be absolute: the benches run in /tmp/amk-run).
#
# Writes $OUT/benches.tgz (b_{new,old}_MODEL_ROUND.json: each has its own gate, commit and its
# paired ratio to the CUDA-graph baseline) and $OUT/bench.err (progress); prints the medians.
# Exits 1 when a bench gave no latency (its gate failed, or it did not run).
set -uo pipefail
[ $# -ge 4 ] || { echo "usage: bash eval/tree_ab.sh OLD_DIR OLD_SHA NEW_SHA MODEL [MODEL ...]" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OLD=$(cd "$1" && pwd) OLD_SHA=$2 NEW_SHA=$3
shift 3
OUT=${OUT:-$REPO/out/tree_ab}
mkdir -p "$OUT"
bench() {  # TREE LABEL SHA MODEL ROUND
  (ROOT=$1
   source "$1/eval/device_env.sh"
   mkdir -p /tmp/amk-run && cd /tmp/amk-run || exit 1
   AMK_GIT_COMMIT=$3 timeout 150 python3 -m amk.cli bench "$4" --random-init --dtype bfloat16 --ctx 1024 \
     --baselines cuda_graph --bandwidth 3000 --json ${AMK_TREE_AB_ARGS:-} >"$OUT/b_$2_$4_$5.json" 2>>"$OUT/bench.err"
   echo "$2 $4 round $5: rc $?" >>"$OUT/bench.err")
}
for r in 1 2; do
  for m in "$@"; do
    if [ $r = 1 ]; then bench "$REPO" new "$NEW_SHA" "$m" $r; bench "$OLD" old "$OLD_SHA" "$m" $r
    else bench "$OLD" old "$OLD_SHA" "$m" $r; bench "$REPO" new "$NEW_SHA" "$m" $r; fi
  done
done
cd "$OUT" && tar czf benches.tgz b_*.json && rm -f b_*.json
python3 - <<'PY'
import json, sys, tarfile
failed = 0
with tarfile.open("benches.tgz") as t:
    for m in sorted(t.getmembers(), key=lambda m: m.name):
        try:
            d = json.load(t.extractfile(m))
            mk = d["variants"]["megakernel"]["median_us"]
            print(f"{m.name}: {d['status']} megakernel {mk:.1f} us, speedup vs cuda_graph {d['speedup']['cuda_graph']['median']:.4f}")
            failed += d["status"] != "ok"
        except Exception as e:  # a bench that failed its gate or printed no JSON (see bench.err)
            print(f"{m.name}: no result ({type(e).__name__})")
            failed += 1
sys.exit(1 if failed else 0)
PY
