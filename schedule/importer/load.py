"""`load_model` / `load_tokenizer`: a source string -> (ModelSpec, weights) or a tokenizer.

Every path ends the same way: a raw HF config is checked into a `ModelSpec`, then the
weights (read from safetensors, or random for `random_init`) are scanned against it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from amk.schedule.importer import cache
from amk.schedule.importer.checkpoint import check_weights
from amk.schedule.importer.errors import AmkError, ImportRefused, ModelLoadError, one_line
from amk.schedule.importer.gguf_source import CONVERTED_MARKER, gguf_config, gguf_to_dir
from amk.schedule.importer.quiet import quiet_transformers
from amk.schedule.importer.hf_config import spec_from_hf_config
from amk.schedule.importer.random_init import random_state_dict
from amk.schedule.importer.sources import Source, read_config, read_safetensors, resolve, tokenizer_dir
from amk.schedule.modelspec import ModelSpec

SourceArg = Optional[str | os.PathLike]


def _gguf_dir(src: Source, progress: bool) -> Path:
    """The converted directory of a GGUF source, refusing before the slow conversion."""
    return gguf_to_dir(src.path, progress, check=lambda cfg: spec_from_hf_config(cfg, name=src.name))


def _raw_config(src: Source, progress: bool) -> dict[str, Any]:
    if src.kind == "config":
        return read_config(src.path)
    if src.kind == "dir":
        return read_config(src.path / "config.json")
    entry = cache.entry_dir(src.path)
    return read_config(entry / "config.json") if entry.is_dir() else gguf_config(src.path, progress)


def _named_shape(source) -> Optional[dict]:
    """The HF config of a named benchmark shape (`amk.eval.shapes`), for `--random-init`."""
    if not isinstance(source, str) or "/" in source or source.endswith(".json"):
        return None
    from amk.eval.shapes import shape_config

    return shape_config(source)


def load_model(source: SourceArg = None, *, random_init: bool = False, seed: int = 0,
               dtype: Optional[str] = None, progress: bool = False, native_quant: bool = False):
    """Import a Llama-family model: `(spec, weights)` keyed by HF state-dict names.

    `random_init` takes only the source's config and draws deterministic weights from
    `seed`. `dtype` None keeps the checkpoint's dtype (float32 for random init and GGUF).
    `native_quant` (GGUF sources only) returns `(spec, weights, native)`: `weights` as
    always (every tensor, dequantized by transformers' GGUF loader), and `native`, a
    `NativeWeights` holding the file's Q8_0/Q4_0/Q4_1 matrices in the VM's I8/U4 layouts,
    undequantized (what `ScheduleConfig(quant="gguf")` lowers and binds).
    Raises `ImportRefused` for an unsupported model, `ModelLoadError` for an unreadable one.
    """
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ModelLoadError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    try:
        shape = _named_shape(source) if random_init else None
        if shape is not None:  # a named shape-only model (llama-3.2-1b, ...): config from the table
            spec = _random_init_spec(source)
            from amk.eval.shapes import random_weights_like

            weights = random_weights_like(spec, "cpu", "float32", seed=seed)
            spec, clean = check_weights(spec, weights, dtype)
            return spec, clean
        src = resolve(source, config_only=random_init)
        if native_quant and (random_init or src.kind != "gguf"):
            raise ImportRefused("native_quant (quant='gguf') needs a .gguf source with its weights; "
                                f"{source or 'the default model'} is a {'random-init config' if random_init else src.kind}")
        gguf_path = src.path if src.kind == "gguf" else None
        if random_init:
            spec = _random_init_spec(source, src, progress)
            weights = random_state_dict(spec.hf_config, seed)
        else:
            if src.kind == "config":  # a config.json beside its weights
                src = Source("dir", src.path.parent, src.name)
            if src.kind == "gguf":
                src = Source("dir", _gguf_dir(src, progress), src.name)
            # a directory this importer converted holds an already-normalised config: skipping
            # the normalisation skips importing transformers (seconds) on the cached path
            spec = spec_from_hf_config(read_config(src.path / "config.json"), name=src.name,
                                       normalized=(src.path / CONVERTED_MARKER).is_file())
            weights = read_safetensors(src.path)
        spec, clean = check_weights(spec, weights, dtype)
        if not native_quant:
            return spec, clean
        from amk.schedule.importer.gguf_native import read_native

        return spec, clean, read_native(gguf_path, spec, weights)
    except AmkError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {source or 'the default model'}: {one_line(exc)}") from None


def load_spec(source: SourceArg = None, *, dtype: Optional[str] = None, progress: bool = False) -> ModelSpec:
    """The spec `load_model(source, random_init=True, dtype=dtype)` returns, without drawing
    the weights (random init takes only the config; its weights are float32). For work that
    needs no weights, such as lowering and validating: an 8B shape's float32 weights are 32 GB."""
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ModelLoadError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    try:
        return _random_init_spec(source, progress=progress).model_copy(update={"dtype": dtype or "float32"})
    except AmkError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {source or 'the default model'}: {one_line(exc)}") from None


def _random_init_spec(source: SourceArg, src: Optional[Source] = None, progress: bool = False) -> ModelSpec:
    """The spec of `source`'s config (a named benchmark shape or a resolved source), before
    the weights' dtype is known."""
    shape = _named_shape(source) if src is None else None
    if shape is not None:
        return spec_from_hf_config(shape, name=str(source))
    src = src or resolve(source, config_only=True)
    return spec_from_hf_config(_raw_config(src, progress), name=src.name)


def load_tokenizer(source: SourceArg = None):
    """The HF tokenizer of `source`, or None where it has none (a bare config.json)."""
    from transformers import AutoTokenizer

    try:
        src = resolve(source)
        directory = {"dir": lambda: src.path, "config": lambda: src.path.parent,
                     "gguf": lambda: _gguf_dir(src, False)}[src.kind]()
        tok_dir = tokenizer_dir(directory)
        if tok_dir is None:
            return None
        with quiet_transformers(False):
            return AutoTokenizer.from_pretrained(str(tok_dir))
    except AmkError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {source or 'the default model'}: {one_line(exc)}") from None
