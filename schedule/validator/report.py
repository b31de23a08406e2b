"""Violation collection shared by every check of the validator."""

from __future__ import annotations

from amk.schedule.ir import Violation

# check name -> the property group it belongs to (the certificate lists all of them)
CHECK_GROUPS: dict[str, str] = {
    "schema": "well-formed",
    "ids": "well-formed",
    "reference": "well-formed",
    "capacity": "well-formed",
    "arity": "well-formed",
    "params": "well-formed",
    "kind": "well-formed",
    "dtype": "well-formed",
    "threshold": "deadlock-free",
    "self-wait": "deadlock-free",
    "dataflow-cycle": "deadlock-free",
    "queue-coverage": "deadlock-free",
    "queue-order-deadlock": "deadlock-free",
    "coresidency": "deadlock-free",
    "partial-wait": "race-free",
    "scope": "race-free",
    "read-after-write": "race-free",
    "write-after-read": "race-free",
    "write-after-write": "race-free",
    "kv-read-before-append": "race-free",
    "tile-overlap": "race-free",
    "tile-gap": "race-free",
    "uninitialized-read": "race-free",
    "self-alias": "race-free",
    "out-of-bounds": "memory-safe",
    "kv-range": "memory-safe",
    "quant-shape": "memory-safe",
    "complete": "complete",
}

MAX_REPORTED_PER_CHECK = 25  # a broken program can have millions of bad pairs; keep results readable


class Report:
    """Accumulates violations, at most MAX_REPORTED_PER_CHECK per check name."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.counts: dict[str, int] = {}

    def add(self, check: str, reason: str, *, tasks=(), buffers=(), counters=(), cycle=None) -> None:
        assert check in CHECK_GROUPS, check
        n = self.counts.get(check, 0)
        self.counts[check] = n + 1
        if n < MAX_REPORTED_PER_CHECK:
            self.violations.append(
                Violation(check=check, reason=reason, tasks=[int(t) for t in tasks],
                          buffers=[int(b) for b in buffers], counters=[int(c) for c in counters], cycle=cycle)
            )

    @property
    def ok(self) -> bool:
        return not self.counts
