"""eval/hop_microbench.py: its kernels compile for the H100 (no GPU needed; skipped without nvcc)
and its host reference is the recurrence the kernels compute."""
from __future__ import annotations

import numpy as np
import pytest

from amk.eval.hop_microbench import SRC, expected_last
from microbench_compile import ptxas_report_sm90


def test_hop_microbench_kernels_compile_for_sm90(tmp_path):
    report = ptxas_report_sm90(SRC, tmp_path, "hop_microbench")
    assert "hop_counter" in report and "hop_ll" in report  # ptxas reported both kernels


def test_expected_last_is_the_kernels_recurrence():
    """x_{s+1}[i] = (sum(x_s) + i + s) & 1023 in uint32, written out element by element."""
    x0 = np.array([1023, 5, 700, 2], dtype=np.uint32)
    x = [int(v) for v in x0]
    for s in range(3):
        total = sum(x) & 0xFFFFFFFF
        x = [(total + i + s) & 1023 for i in range(len(x))]
    assert expected_last(x0, 3).tolist() == x
    assert expected_last(x0, 0).tolist() == x0.tolist()
    assert expected_last(x0, 3).dtype == np.uint32


def test_parse_backoff_takes_four_nanosecond_settings():
    from amk.eval.hop_microbench import VM_BACKOFF, parse_backoff

    assert parse_backoff("16,16,256,0") == (16, 16, 256, 0)
    assert len(VM_BACKOFF) == 4
    for bad in ("16,16,256", "a,1,2,3", "-1,1,2,3", "1,2,3,4,5"):
        with pytest.raises(ValueError, match="MIN,PER,MAX,MOVING"):
            parse_backoff(bad)

