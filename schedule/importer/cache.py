"""The converted-model cache: one directory per source file, written atomically.

`$AMK_CACHE_DIR` (default `platformdirs.user_cache_dir("amk")`) / models / <stem>-<key>,
where the key hashes the source's absolute path, size and mtime and the cache format. A
directory is filled under a temporary name and renamed into place, so a directory that
exists is complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

FORMAT_VERSION = 1


def cache_root() -> Path:
    env = os.environ.get("AMK_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("amk"))


def entry_dir(source: Path) -> Path:
    """Where the conversion of `source` lives (whether or not it exists yet)."""
    st = source.stat()
    ident = f"{FORMAT_VERSION}|{source.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{source.stem}-{key}"


def cached(source: Path, fill: Callable[[Path], None]) -> Path:
    """The cache directory for `source`, calling `fill(tmp_dir)` to create it on a miss."""
    final = entry_dir(source)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        fill(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first; its copy is as good as ours
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
