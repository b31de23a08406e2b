"""Compile a stand-alone microbenchmark's CUDA source for the H100 with nvcc (no GPU needed)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from amk.vm import compile_check


def ptxas_report_sm90(src: str, tmp_path: Path, stem: str) -> str:
    """nvcc -c -arch=sm_90 -Xptxas -v of `src`; asserts it compiled and returns ptxas's report
    (stderr), which names every kernel. Skips the test where nvcc is not found."""
    nvcc = compile_check.nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    cu = tmp_path / f"{stem}.cu"
    cu.write_text(src)
    done = subprocess.run([nvcc, "-c", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v", str(cu), "-o",
                           str(tmp_path / f"{stem}.o")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr
