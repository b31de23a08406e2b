"""What every subcommand shares: one-line errors, JSON output, atomic file writes."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """A one-line error on stderr and a non-zero exit; never a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _umask() -> int:
    mask = os.umask(0o22)  # (reading the umask means setting it: put it straight back)
    os.umask(mask)
    return mask


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename: readers never
    see half a file, even after a crash. The file gets the mode a plain open() would give it
    (mkstemp's temporary is private, 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
