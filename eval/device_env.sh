# Source on the lent GPU machine: installs the carried wheels (.whl/) and maps the repo onto
# the `amk` package without installing it (the top-level folders are amk's subpackages).
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
SITE=/tmp/amk_site
# (re)installed whenever the set of carried wheels differs from the one installed last on this
# machine, so a wheel added while the machine stays warm is installed too
WHEELS=$(cd "$ROOT" && ls .whl/*.whl 2>/dev/null | sort | tr '\n' ' ')
if [ -n "$WHEELS" ] && [ "$(cat "$SITE/.amk_wheels" 2>/dev/null)" != "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
    && echo "$WHEELS" > "$SITE/.amk_wheels" || echo "warning: wheel install failed"
fi
SHIM=/tmp/amk_shim
mkdir -p "$SHIM/amk"
cat >"$SHIM/amk/__init__.py" <<PYEOF
__path__ = [r"$ROOT/amk", r"$ROOT"]
exec(compile(open(r"$ROOT/amk/__init__.py").read(), r"$ROOT/amk/__init__.py", "exec"))
PYEOF
export PYTHONPATH="$SHIM:$SITE:${PYTHONPATH:-}"
export AMK_KERNEL_CACHE=${AMK_KERNEL_CACHE:-/tmp/amk_kernels}
export PYTHONUNBUFFERED=1
# never let the working directory shadow the shim: ./amk is only part of the package
export PYTHONSAFEPATH=1
