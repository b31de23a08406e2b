"""eval/gemv_bandwidth.py's argument parsing and its L2 rotation (no GPU needed)."""
from __future__ import annotations

import pytest

from amk.eval.gemv_bandwidth import L2_CLEAR_BYTES, copies_needed, parse_shape


def test_parse_shape_reads_rows_by_cols():
    assert parse_shape("128256x2048") == (128256, 2048)
    assert parse_shape("3072X2048") == (3072, 2048)
    for bad in ("128256", "0x5", "ax2", "1x2x3", "-1x4"):
        with pytest.raises(ValueError, match="ROWSxCOLS"):
            parse_shape(bad)


def test_copies_rotate_at_least_the_l2_clearing_bytes():
    small = 12 * 1024**2
    assert copies_needed(small) * small >= L2_CLEAR_BYTES
    assert (copies_needed(small) - 1) * small < L2_CLEAR_BYTES
    assert copies_needed(525 * 1024**2) == 1
