"""eval/ring_microbench.py's kernels compile for the H100 (no GPU needed; skipped without nvcc)."""
from __future__ import annotations

from amk.eval.ring_microbench import SRC
from microbench_compile import ptxas_report_sm90


def test_ring_microbench_kernels_compile_for_sm90(tmp_path):
    report = ptxas_report_sm90(SRC, tmp_path, "ring_microbench")
    assert "stream_reg" in report and "stream_ring" in report  # ptxas reported both kernels
