"""Where a measurement came from: the git commit and the machine, for paper_results/."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def git_commit(root: Path | None = None) -> str:
    """HEAD (+dirty when tracked files changed) of this checkout, or of the tree at `root`;
    for this checkout, AMK_GIT_COMMIT where the tree has no .git (a copy shipped to a lent
    GPU machine). "unknown" where there is no git repository."""
    if root is None and os.environ.get("AMK_GIT_COMMIT"):
        return os.environ["AMK_GIT_COMMIT"]
    here = Path(root) if root is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               check=True, cwd=here).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git, no repo: say so
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
