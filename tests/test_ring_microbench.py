"""eval/ring_microbench.py's kernels compile for the H100 (no GPU needed; skipped without nvcc)."""
from __future__ import annotations

import subprocess

import pytest

from amk.eval.ring_microbench import SRC
from amk.vm import compile_check


def test_ring_microbench_kernels_compile_for_sm90(tmp_path):
    nvcc = compile_check.nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "ring_microbench.cu"
    src.write_text(SRC)
    done = subprocess.run([nvcc, "-c", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v", str(src), "-o",
                           str(tmp_path / "ring_microbench.o")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "stream_reg" in done.stderr and "stream_ring" in done.stderr  # ptxas reported both kernels
