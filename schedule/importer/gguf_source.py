"""A `.gguf` file -> a cached HF directory (config.json + model.safetensors + tokenizer).

transformers' GGUF loader reads the metadata into an HF config and dequantizes every
tensor to float32 (undoing llama.cpp's q/k row permutation); the result is written once
into the cache so later loads are plain safetensors reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from amk.schedule.importer import cache
from amk.schedule.importer.errors import ModelLoadError, one_line
from amk.schedule.importer.quiet import quiet_transformers

CONVERTED_MARKER = "amk_source.json"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[amk] {msg}", file=sys.stderr, flush=True)


def _read_config(path: Path, progress: bool):
    from transformers import AutoConfig

    try:
        with quiet_transformers(progress, gguf=True):
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {one_line(exc)}") from None


def _config_dict(config) -> dict[str, Any]:
    out = config.to_dict()
    out["model_type"] = config.model_type
    return out


def gguf_config(path: Path, progress: bool = False) -> dict[str, Any]:
    """The HF config dict a GGUF file's metadata describes (no tensors are read)."""
    return _config_dict(_read_config(path, progress))


def _convert(path: Path, out: Path, progress: bool, check: Callable[[dict[str, Any]], None]) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _read_config(path, progress)  # parsing GGUF metadata is slow (~10 s): once, shared
    check(_config_dict(config))
    _say(progress, f"dequantizing {path.name} to float32 (once; cached under {out.parent})")
    try:
        with quiet_transformers(progress, gguf=True):
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                         dtype="float32")
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {one_line(exc)}") from None
    state = model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" in state:
        del state["lm_head.weight"]  # shares storage with the embedding; save_file refuses aliases
    save_file({k: t.contiguous() for k, t in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config_dict(model.config)
    cfg["architectures"] = [type(model).__name__]
    cfg.pop("_name_or_path", None)
    cfg.pop("quantization_config", None)  # {"quant_method": "gguf"}: the weights are dequantized now
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    try:
        with quiet_transformers(progress, gguf=True):
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(out))
    except Exception as exc:  # the weights are still usable; load_tokenizer() will say None
        _say(True, f"warning: no tokenizer converted from {path.name}: {one_line(exc)}")
    # marks the directory as converted here: its config.json is transformers-normalised
    (out / CONVERTED_MARKER).write_text(json.dumps({"gguf": str(path.resolve())}))


def gguf_to_dir(path: Path, progress: bool = False,
                check: Callable[[dict[str, Any]], None] = lambda cfg: None) -> Path:
    """The cached HF directory converted from `path`, converting on the first call.

    `check(config_dict)` runs on the GGUF's config before the slow dequantization (it
    raises ImportRefused for an unsupported model).
    """
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return cache.cached(path, lambda out: _convert(path, out, progress, check))
