"""Options shared by the commands that take a model, and loading a Megakernel from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from amk.commands.common import fail

MODEL = typer.Argument(None, help="HF hub id, local dir (config.json + safetensors), .gguf file, or config.json "
                       "with --random-init. Default: the embedded SmolLM2-135M-Instruct (`smollm2-135m`).")
CONFIG = typer.Option(None, "--config", help="ScheduleConfig JSON file (see `amk schema`) or a preset name.")
TARGET = typer.Option(None, "--target", help="GPU target record or arch: h100, sm_90, a100, gfx942, ... (default h100).")
DTYPE = typer.Option(None, "--dtype", help="Program dtype: float32, bfloat16 or float16 (default: the checkpoint's).")
RANDOM_INIT = typer.Option(False, "--random-init", help="Take only the config; where weights are needed, draw deterministic random ones.")
SEED = typer.Option(0, "--seed", help="Seed for --random-init.")
KV_CAPACITY = typer.Option(2048, "--kv-capacity", min=1, help="KV-cache rows (maximum prompt + generated tokens).")


def load_config(spec: Optional[str]):
    from pydantic import ValidationError

    from amk.schedule.config import PRESETS, ScheduleConfig

    if spec is None:
        return None
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    try:
        return ScheduleConfig.model_validate_json(path.read_text())
    except OSError as exc:
        fail(f"cannot read config {path}: {exc.strerror or exc} (presets: {', '.join(PRESETS)})")
    except ValidationError as exc:
        e = exc.errors()[0]
        fail(f"config {path} is invalid at '{'.'.join(map(str, e['loc']))}': {e['msg']}")
    except json.JSONDecodeError as exc:
        fail(f"config {path} is not JSON: {exc}")


def build_program(model, config, target, dtype, random_init, kv_capacity, progress: bool = True):
    """`amk.api.compile_program` (no weights bound; none drawn for random init) with every
    expected failure turned into a one-line error."""
    from amk.api import compile_program

    return _one_line_errors(lambda cfg: compile_program(model, cfg, target, dtype=dtype, random_init=random_init,
                                                        kv_capacity=kv_capacity, progress=progress), config)


def build(model, config, target, dtype, random_init, seed, kv_capacity, progress: bool = True):
    """`amk.compile` with every expected failure turned into a one-line error."""
    from amk.api import compile as amk_compile

    return _one_line_errors(lambda cfg: amk_compile(model, cfg, target, dtype=dtype, random_init=random_init, seed=seed,
                                                    kv_capacity=kv_capacity, progress=progress), config)


def _one_line_errors(make, config):
    from amk.errors import AmkError

    cfg = load_config(config)
    try:
        return make(cfg)
    except AmkError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, code=1)
