"""Compile the megakernel builds that a benchmark session will run, in parallel, into the
kernel cache, so that the timed commands after it find them built.

    python -m amk.eval.prewarm MODEL [--config F] [--dtype bfloat16] [--variant DEFINES ...] [--trace] [-j N]

MODEL is what `amk bench` takes (a shape name of eval/shapes.py such as llama-3.2-1b, or a
checkpoint); each `--variant` is one set of AMK_VM_DEFINES-style experiment defines
("AMK_A=1,AMK_B=0"; "-" or none: no extra defines), built the way the CudaVM builds that
program (`vm.loader.build_defines`). One NVRTC compile of the specialized megakernel takes
~40-60 s of one core; a device call that benches N variants one after another spends N of
them before its first timing, so build them here at once (one process each, up to -j) with
the same $AMK_KERNEL_CACHE. $AMK_VM_DEFINES is ignored here: name the variants.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

from amk.errors import AmkError


def program_for(model: str, config_path: Optional[str], dtype: str, target: Optional[str] = None):
    """The program `amk bench MODEL --random-init --dtype DTYPE --config F` runs on `target`
    (None: the default record, as the bench on an unknown GPU; its build defines do not
    depend on the context length)."""
    from amk.eval.shapes import shape_config
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.importer import load_spec, spec_from_hf_config
    from amk.schedule.lower import lower
    from amk.schedule.targets import get_target

    config = ScheduleConfig.model_validate_json(Path(config_path).read_text()) if config_path else None
    shape = shape_config(model)
    spec = spec_from_hf_config(shape, name=model, dtype=dtype) if shape else load_spec(model, dtype=dtype)
    return lower(spec, config, get_target(target))


def builds(program, variants: list[str], trace: bool = False) -> list[tuple[str, dict[str, int]]]:
    """(variant, its build defines) for each variant, duplicates dropped."""
    from amk.vm.loader import PackedProgram, build_defines, parse_defines

    packed = PackedProgram(program)
    out, seen = [], set()
    for v in variants or ["-"]:
        defines = build_defines(program, packed, trace=trace,
                                experiments={} if v.strip() in ("", "-") else parse_defines(v, "--variant"))
        key = tuple(sorted(defines.items()))
        if key not in seen:
            seen.add(key)
            out.append((v, defines))
    return out


def _compile(job: tuple) -> float:
    from amk.vm import build

    arch, threads, min_blocks, defines = job
    t = time.perf_counter()
    build.compile_cubin(arch, threads=threads, min_blocks=min_blocks, defines=defines)
    return time.perf_counter() - t


def _machine(arch: Optional[int]) -> tuple[int, Optional[str]]:
    """(NVRTC arch, target record) of this machine's GPU, as the bench picks them; without
    one, `arch` (default 90) and the default record."""
    import torch

    if not torch.cuda.is_available():
        return arch or 90, None
    from amk.eval.bench import _device_target
    from amk.vm import build

    return arch or build.device_arch(torch.cuda.current_device()), _device_target("cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m amk.eval.prewarm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="shape name (eval/shapes.py) or checkpoint, as `amk bench` takes it")
    ap.add_argument("--config", default=None, help="ScheduleConfig JSON file")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variant", action="append", default=[], help='experiment defines "AMK_A=1,AMK_B=0" ("-": none)')
    ap.add_argument("--trace", action="store_true", help="the traced builds (amk.eval.trace_step)")
    ap.add_argument("--arch", type=int, default=None, help="NVRTC arch, e.g. 90 (default: the GPU's, else 90)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: one per build, up to the cores)")
    a = ap.parse_args(argv)
    arch, target = _machine(a.arch)
    try:
        program = program_for(a.model, a.config, a.dtype, target)
        todo = builds(program, a.variant, a.trace)
    except (AmkError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    jobs = [(arch, program.threads_per_block, program.blocks_per_cu, d) for _, d in todo]
    n = max(1, min(a.jobs or len(jobs), len(jobs), os.cpu_count() or 1))
    t0 = time.perf_counter()
    if n == 1:
        seconds = [_compile(j) for j in jobs]
    else:  # spawn: the children only compile, and never inherit a CUDA context
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as ex:
            seconds = list(ex.map(_compile, jobs))
    for (variant, defines), s in zip(todo, seconds):
        extra = ",".join(f"{k}={v}" for k, v in sorted(defines.items()))
        print(f"built sm_{arch} {a.model} [{variant}] in {s:.0f} s: {extra}")
    print(f"{len(jobs)} build(s) in {time.perf_counter() - t0:.0f} s with {n} process(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
