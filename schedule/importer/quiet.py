"""Keep transformers quiet (progress bars, info logs) unless the caller asked for progress."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator


@contextlib.contextmanager
def quiet_transformers(progress: bool, gguf: bool = False) -> Iterator[None]:
    """Silence transformers' progress bars and info logs unless `progress`."""
    from transformers.utils import logging as hf_logging

    was_enabled, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    gguf_utils = bar = None
    if not progress:
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        if gguf:  # the GGUF loader calls tqdm directly
            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            bar = gguf_utils.tqdm
            gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)
        if bar is not None:
            gguf_utils.tqdm = bar
