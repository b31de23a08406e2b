"""Step counters on stderr for long generate loops: rewritten in place on a terminal; in a
log or a pipe, a line at every quarter (a carriage-return stream there reads as one line)."""

from __future__ import annotations

import sys


class StepProgress:
    """`tick()` after each of `total` steps; `close()` ends the line on a terminal."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream=None):
        self.label, self.total, self.enabled, self.done = label, total, enabled, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._marks = {max(1, -(-total * q // 4)) for q in (1, 2, 3, 4)}  # steps that print off a terminal

    def tick(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        text = f"{self.label} {self.done}/{self.total}"
        if self.tty:
            print(f"\r{text}", end="", file=self.stream, flush=True)
        elif self.done in self._marks:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=self.stream)
