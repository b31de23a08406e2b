"""Compile the megakernel for AMD targets to AMDGCN assembly with clang, warnings as errors.

    python -m amk.vm.hip_compile_check            # gfx942, gfx950
    python -m amk.vm.hip_compile_check gfx942     # one arch
    python -m amk.vm.hip_compile_check gfx942 -D AMK_GEMV_LOADS_AHEAD=1   # a build define (~90 s an arch)

No GPU and no ROCm install needed: Debian's `clang-19` and `libamdhip64-dev` (HIP headers)
suffice (`make hip-tools`). Device code only (`--cuda-device-only -S`), without the ROCm
device libraries (`-nogpulib`: math calls stay external symbols, which assembly allows).
Besides compiling cleanly, the assembly must hold the counter primitives in both memory
scopes (`SCOPED_ATOMICS`), as LLVM's gfx94x memory model emits them. An arch the compiler
does not know (clang-19 predates gfx950) is reported as skipped, never as passed.
tests/test_vm_compile_hip.py runs the same check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHS = ("gfx942", "gfx950")
DEFAULT_THREADS = 256
CLANG_NAMES = ("clang-19", "clang")

# what the counter signal/wait must compile to (vm/arch_hip.h, vm/arch_hip_gfx94.h)
SCOPED_ATOMICS = {
    "device-scope release: L2 write-back": r"buffer_wbl2\s+sc1",
    "device-scope acquire: L2 invalidate": r"buffer_inv\s+sc1",
    "XCD-scope acquire: L1 invalidate only": r"buffer_inv\s+sc0\b",
    "agent-coherent counter load": r"global_load_dword\s+[^\n]*\ssc1\b",
    "counter increment": r"global_atomic_add\b",
}


def clang_path() -> str | None:
    """A clang with the AMDGPU backend: $AMK_HIP_CLANG, else clang-19, else clang."""
    override = os.environ.get("AMK_HIP_CLANG")
    if override:
        return override
    for name in CLANG_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def clang_knows(clang: str, arch: str) -> bool:
    """Whether this clang accepts `--offload-arch=arch` (compiles an empty HIP file)."""
    proc = subprocess.run([clang, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib",
                           "-nogpuinc", "-S", "-o", os.devnull, "-"], input="", capture_output=True, text=True)
    return proc.returncode == 0


def clang_command(clang: str, arch: str, out: Path, threads: int = DEFAULT_THREADS,
                  defines: dict[str, int] | None = None) -> list[str]:
    from amk.vm.build import MAIN_SOURCE, source_dirs

    vm_dir, ins_dir = source_dirs()
    return [clang, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib", "-S", "-O3",
            "-std=c++17", f"-DAMK_BLOCK_THREADS={threads}", *(f"-D{k}={v}" for k, v in (defines or {}).items()),
            "-Wall", "-Wextra", "-Werror", f"-I{vm_dir}", f"-I{ins_dir}", str(vm_dir / MAIN_SOURCE), "-o", str(out)]


def missing_atomics(asm: str) -> list[str]:
    return [what for what, pattern in SCOPED_ATOMICS.items() if not re.search(pattern, asm)]


def hip_compile(arch: str, threads: int = DEFAULT_THREADS,
                defines: dict[str, int] | None = None) -> tuple[bool, str, str]:
    """(ok, report, assembly). ok is False on an error, a warning, or a missing scoped atomic."""
    clang = clang_path()
    if clang is None:
        raise FileNotFoundError("clang-19 not found (make hip-tools)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "megakernel.s"
        cmd = clang_command(clang, arch, out, threads, defines)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        asm = out.read_text() if proc.returncode == 0 and out.exists() else ""
    output = (proc.stdout + proc.stderr).strip()
    missing = missing_atomics(asm) if asm else []
    ok = proc.returncode == 0 and not output and not missing
    report = f"$ {' '.join(cmd)}\n{output}" + (f"\nmissing in the assembly: {missing}" if missing else "")
    return ok, report, asm


def main(argv: list[str]) -> int:
    import argparse

    from amk.vm.compile_check import bad_defines, parse_defines, report

    ap = argparse.ArgumentParser(prog="python -m amk.vm.hip_compile_check", description=(__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archs", nargs="*", metavar="gfxNNN", help=f"default: {' '.join(ARCHS)}")
    ap.add_argument("-D", "--define", action="append", default=[], metavar="AMK_NAME=INT",
                    help="an extra integer define (as $AMK_VM_DEFINES or a program's VM knobs give the loader's builds)")
    a = ap.parse_args(argv)
    bad = [x for x in a.archs if not (x.startswith("gfx") and x[3:].isalnum())]
    bad += bad_defines(a.define)
    if bad:
        print(f"error: not an AMD architecture or NAME=INT: {' '.join(bad)}", file=sys.stderr)
        return 2
    defines = parse_defines(a.define)
    tag = f" {' '.join(a.define)}" if a.define else ""
    clang = clang_path()
    if clang is None:
        print("clang-19 not found: install it with `make hip-tools`")
        return 1

    def results():
        for arch in a.archs or ARCHS:
            if not clang_knows(clang, arch):
                print(f"{arch}: skipped ({clang} does not know this target)")
                continue
            ok, out, _ = hip_compile(arch, defines=defines)
            yield f"{arch}{tag}", ok, out

    return report(results())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
