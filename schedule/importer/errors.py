"""The importer's two failures: a model AMK will not run, and a model that could not be read."""

from __future__ import annotations

from amk.errors import AmkError


class ImportRefused(AmkError):
    """The model is readable but uses something AMK does not implement.

    `reasons` lists every problem found; each names the config field or tensor precisely.
    """

    def __init__(self, reasons: str | list[str], *, model: str | None = None):
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        self.model = model
        head = f"cannot import {model}: " if model else "cannot import model: "
        super().__init__(head + "; ".join(self.reasons))


class ModelLoadError(AmkError):
    """The source could not be found or read (missing path, truncated file, no network)."""


def one_line(exc: BaseException, limit: int = 240) -> str:
    """A short one-line description of a foreign exception, for a ModelLoadError message."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"
