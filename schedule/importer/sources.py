"""Resolve a model source string to something on local disk, and read safetensors weights.

A source is: None / "smollm2-135m" (the embedded default), a directory with config.json
and *.safetensors, a `.gguf` file, a `config.json` (random init), or a hub id `org/name`
(the local HF cache first, then a download where the network allows).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from amk.schedule.importer.default_model import DEFAULT_NAME, default_gguf_path, is_default
from amk.schedule.importer.errors import ImportRefused, ModelLoadError, one_line

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
HUB_IGNORE = ["consolidated*", "original/*", "*.gguf"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

Kind = Literal["dir", "gguf", "config"]


@dataclass(frozen=True)
class Source:
    kind: Kind
    path: Path  # the directory, the .gguf file, or the config.json
    name: str


def resolve(source: str | os.PathLike | None, *, config_only: bool = False) -> Source:
    """Where `source` lives on disk (downloading a hub repo when it must and can)."""
    if source is None or is_default(str(source)):
        return Source("gguf", default_gguf_path(), DEFAULT_NAME)
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        return Source("dir", path, path.resolve().name)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".gguf":
            return Source("gguf", path, path.stem)
        if suffix == ".json":
            return Source("config", path, path.resolve().parent.name)
        if suffix == ".safetensors":
            return Source("dir", path.parent, path.resolve().parent.name)
        if suffix in PICKLE_SUFFIXES:
            raise ImportRefused(f"{path.name} is a pickle checkpoint; AMK never unpickles weights "
                                "(convert it to safetensors first)")
        raise ModelLoadError(f"unrecognised model file {path} "
                             "(expected a directory, .gguf, config.json or .safetensors)")
    if HUB_ID.match(text) and not text.endswith((".gguf", ".json")) and not text.startswith((".", "~")):
        return Source("config" if config_only else "dir", hub_snapshot(text, config_only=config_only), text)
    raise ModelLoadError(f"no such model: {text} (not a file, a directory, a hub id org/name or {DEFAULT_NAME!r})")


def hub_snapshot(repo_id: str, *, config_only: bool = False) -> Path:
    """A local snapshot of `repo_id`: from the HF cache, else downloaded; config.json path if config_only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    kwargs: dict[str, Any] = dict(allow_patterns=["config.json"] if config_only else HUB_PATTERNS,
                                  ignore_patterns=HUB_IGNORE)
    snap = None
    try:
        snap = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        if not config_only and not any(snap.glob("*.safetensors")):
            snap = None  # only a config was cached earlier; try for the weights
    except Exception:
        snap = None
    if snap is None:
        try:
            snap = Path(snapshot_download(repo_id, **kwargs))
        except GatedRepoError:  # a subclass of RepositoryNotFoundError: test it first
            raise ModelLoadError(f"hub repo {repo_id} is gated: accept its license and log in "
                                 "(hf auth login)") from None
        except RepositoryNotFoundError:
            raise ModelLoadError(f"hub repo {repo_id} not found (or private)") from None
        except Exception as exc:
            raise ModelLoadError(f"{repo_id} is not a local path, not in the local Hugging Face cache, and "
                                 f"could not be downloaded ({type(exc).__name__}: no network?)") from None
    if config_only:
        if not (snap / "config.json").is_file():
            raise ModelLoadError(f"hub repo {repo_id} has no config.json")
        return snap / "config.json"
    if not any(snap.glob("*.safetensors")):
        raise ImportRefused(f"hub repo {repo_id} has no *.safetensors weights "
                            "(AMK never loads pickle .bin/.pt checkpoints)")
    return snap


def read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"no config.json in {path.parent}") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {one_line(exc)}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return cfg


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint directory (the sharded index when there is one).

    Mistral's native `consolidated*.safetensors` duplicates the HF weights under other names
    and is not read.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {index}: {one_line(exc)}") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index.name} names missing shard(s): {', '.join(absent)}")
        return files
    files = sorted(f for f in directory.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if files:
        return files
    pickles = sorted(f.name for f in directory.iterdir() if f.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ImportRefused(f"{directory} holds only pickle checkpoints ({', '.join(pickles[:3])}); "
                            "AMK never unpickles weights (convert to safetensors first)")
    raise ModelLoadError(f"no *.safetensors weights in {directory} (pass random_init=True to use only its config)")


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every weight file in `directory` (never unpickles)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(directory):
        try:
            part = load_file(str(f))
        except Exception as exc:
            raise ModelLoadError(f"cannot read {f}: {one_line(exc)}") from None
        dup = sorted(set(part) & set(weights))
        if dup:
            raise ModelLoadError(f"tensor {dup[0]} appears in more than one weight file of {directory}")
        weights.update(part)
    return weights


def tokenizer_dir(directory: Path) -> Path | None:
    return directory if any((directory / f).is_file() for f in TOKENIZER_FILES) else None
