"""Session set-up shared by every test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _validator_compiled():
    """Compile (or load from numba's cache) the validator's fast path once, up front: on a
    fresh checkout the first validation compiles for ~25 s, which must not land inside a
    test that times a subprocess (the autotune kill/resume test, trial timeouts)."""
    from amk.eval.synthetic import warm_validator

    warm_validator()
    yield
