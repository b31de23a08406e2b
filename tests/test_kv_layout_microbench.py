"""eval/kv_layout_microbench.py: its kernel compiles for the H100 (no GPU needed; skipped without
nvcc), and its arguments are checked before any GPU work."""
from __future__ import annotations

import pytest

from amk.eval.kv_layout_microbench import SRC, _args
from microbench_compile import ptxas_report_sm90


def test_kv_layout_kernel_compiles_for_sm90(tmp_path):
    assert "kv_read" in ptxas_report_sm90(SRC, tmp_path, "kv_layout_microbench")


def test_arguments():
    a = _args([])
    assert (a.kv_heads, a.splits, a.rows, a.unroll) == (8, 16, 528, [1, 4, 8])
    for bad in (["--rows", "0"], ["--layers", "0"], ["--unroll", "9"], ["--unroll", "0"]):
        with pytest.raises(SystemExit):
            _args(bad)
