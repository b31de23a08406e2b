"""Branches of the device code that a program's build tests but never takes one way (gcov on the emulator).

    .venv/bin/python tests/emu_coverage.py --shape smollm2-135m --layers 2 [--config eval/configs/int8_g128.json]
    .venv/bin/python tests/emu_coverage.py --zoo llama-gqa-tied --queues 4 --threads 64 --steps 3 --json

The emulated megakernel (tests/emu_vm.py) is built with the loader's own defines for the program
(loader.build_defines: its dtypes, ops and specializations) and gcov's branch counters, runs a few
decode steps from position 0, and gcov's counts are read back. Listed: every line of the device sources
(vm/, instructions/) that ran and has a branch taken and another never taken, hottest first.

Why: code that never runs costs nothing by its size (eval/PERF_NOTES.md item 197), but a test on a path
that runs does (items 198, 243, 245, 250: a test and a branch at every element access, and the registers
the untaken side pins). A branch a program's build always takes one way is where a loader define could
leave the other side out. The list is a lead, not a verdict: the GPU programs have 132 queues of 256
threads and contexts of 1024 where this runs a few queues and steps (so the tasks' sizes, and the
attention's splits, differ), the emulator's arch header stands in for the CUDA one, error checks (a
report that never fires) are one-way by design, and the build inlines nothing (so that a line's branches
are its own function's, not those of every copy inlined elsewhere): a small accessor whose result is a
build constant (gemv.cuh AmkQRow::dtype under AMK_QCOMP_DTYPE) shows its callers' tests as one-way, where
the GPU build inlines it and folds them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_DIRS = ("vm", "instructions")  # the device sources' folders (tests/emu's stand-ins are not listed)
# (after EMU_FLAGS' -O1, which folds the tests of build constants): no inlining, so that gcov gives a line
# the branches of its own function only; atomic counters, so that 0 means never across the threads
COVERAGE_FLAGS = ("-fno-inline", "-fno-inline-small-functions", "-fno-inline-functions-called-once", "--coverage",
                  "-fprofile-update=atomic")


def _program(args):
    """(program, tensors) of --zoo (tests/vm_cases.lowered) or --shape (eval/shapes.py, random weights),
    lowered with --queues and --threads. (Run as a script, this file's folder is on sys.path: the test
    helpers vm_cases and emu_vm import from it.)"""
    from amk.schedule.config import ScheduleConfig

    cfg = ScheduleConfig.model_validate_json(Path(args.config).read_text()) if args.config else ScheduleConfig()
    over = {**cfg.model_dump(exclude_unset=True), "max_queues": args.queues, "threads_per_block": args.threads}
    dtype = over.pop("dtype", None) or args.dtype  # (a config's own dtype wins, as in `amk compile`)
    if args.zoo:
        from vm_cases import lowered

        return lowered(args.zoo, dtype=dtype, kv_capacity=max(args.steps, 8), **over)
    from amk.eval.shapes import random_weights_like, shape_config
    from amk.schedule.importer import spec_from_hf_config
    from amk.schedule.lower import bind_weights, lower
    from amk.schedule.targets import get_target

    hf = shape_config(args.shape)
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    spec = spec_from_hf_config(hf, name=args.shape, dtype=dtype)
    prog = lower(spec, ScheduleConfig(**over), get_target("h100"), kv_capacity=max(args.steps, 8))
    return prog, bind_weights(prog, spec, random_weights_like(spec, device="cpu", dtype=dtype))


def _check_model(args) -> None:
    """Refuse an unknown --shape or --zoo name, or a --config that is not a ScheduleConfig, before the
    child process builds anything."""
    from amk.eval.shapes import SHAPES
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.importer import zoo_configs

    if args.shape and args.shape.strip().lower() not in SHAPES:
        raise SystemExit(f"unknown --shape {args.shape!r}: one of {sorted(SHAPES)}")
    if args.zoo and args.zoo not in zoo_configs():
        raise SystemExit(f"unknown --zoo {args.zoo!r}: one of {sorted(zoo_configs())}")
    if args.config:
        try:
            ScheduleConfig.model_validate_json(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--config {args.config}: {e}") from None


def _build_defines(prog) -> dict[str, int]:
    from amk.vm.loader import build_defines

    warp = prog.target.warp_size
    return {**build_defines(prog, experiments={}), **({"AMK_WARP_SIZE": warp} if warp != 32 else {})}


def run_child(args) -> None:
    """Build (or reuse) the coverage build in --out and run the steps: gcov's counters are written when
    this process exits (the library does not export __gcov_dump)."""
    from emu_vm import EmuVM, build
    from vm_cases import PROMPT

    prog, tensors = _program(args)
    vm = EmuVM(prog, tensors, build(Path(args.out), _build_defines(prog), COVERAGE_FLAGS), spin_timeout_s=60.0)
    for pos in range(args.steps):
        vm.run_step(PROMPT[pos % len(PROMPT)], pos)


def one_way_lines(gcov_json: dict, root: Path = ROOT) -> list[dict]:
    """The lines of the device sources that ran with a branch never taken beside one taken, hottest
    first: {file, line, count, taken, never, source}. gcov_json: gcov_lines' (absolute file paths)."""
    found = []
    for f in gcov_json.get("files", []):
        path = Path(f["file"])
        try:
            rel = path.resolve().relative_to(root)
        except ValueError:
            continue
        if rel.parts[0] not in DEVICE_DIRS:
            continue
        text = path.read_text().splitlines()
        for ln in f.get("lines", []):
            counts = [b["count"] for b in ln.get("branches", []) if not b.get("throw")]
            taken = sum(c > 0 for c in counts)
            if ln["count"] > 0 and taken and taken < len(counts):
                found.append(dict(file=str(rel), line=ln["line_number"], count=ln["count"], taken=taken,
                                  never=len(counts) - taken, source=text[ln["line_number"] - 1].strip()))
    # one entry a line: gcov lists a header's line once per function that has it (template instances)
    merged: dict[tuple, dict] = {}
    for e in found:
        k = (e["file"], e["line"])
        if k in merged:
            merged[k]["count"] += e["count"]
        else:
            merged[k] = e
    return sorted(merged.values(), key=lambda e: (-e["count"], e["file"], e["line"]))


def gcov_lines(out: Path) -> dict:
    """gcov's JSON for the coverage build's counters in `out` (merged over its files)."""
    gcda = sorted(out.glob("*.gcda"))
    if not gcda:
        raise SystemExit(f"no gcov counters in {out} (did the steps run?)")
    files = []
    for g in gcda:
        r = subprocess.run(["gcov", "--json-format", "--stdout", "--branch-probabilities", str(g)],
                           capture_output=True, text=True, cwd=out)
        if r.returncode != 0:
            raise SystemExit(f"gcov failed on {g}: {r.stderr.strip()}")
        for chunk in r.stdout.splitlines():
            if chunk.strip():
                d = json.loads(chunk)
                files += [dict(f, file=str(Path(d.get("current_working_directory", out)) / f["file"]))
                          for f in d.get("files", [])]
    return {"files": files}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="a model shape of eval/shapes.py (random weights), e.g. smollm2-135m")
    src.add_argument("--zoo", help="a zoo model of tests/vm_cases.py (random weights), e.g. llama-gqa-tied")
    ap.add_argument("--config", help="a ScheduleConfig JSON file (e.g. eval/configs/int8_g128.json)")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (default bfloat16)")
    ap.add_argument("--layers", type=int, default=2, help="--shape: its layers (default 2; every layer runs the same code)")
    ap.add_argument("--queues", type=int, default=8, help="queues (emulated blocks) to lower for (default 8)")
    ap.add_argument("--threads", type=int, default=256, help="threads a block (default 256, the GPU builds')")
    ap.add_argument("--steps", type=int, default=2, help="decode steps from position 0 (default 2)")
    ap.add_argument("--top", type=int, default=40, help="lines to print (default 40; --json lists all)")
    ap.add_argument("--out", help="the build and counters folder (default: a new temporary one)")
    ap.add_argument("--json", action="store_true", help="print the lines as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(args)
        return
    _check_model(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="amk_emu_cov_"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.gcda"):  # counters add up across runs: start from none
        stale.unlink()
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(out)]
    for k in ("shape", "zoo", "config", "dtype", "layers", "queues", "threads", "steps"):
        v = getattr(args, k)
        if v is not None:
            child += [f"--{k}", str(v)]
    print(f"building and running the coverage build in {out} ...", file=sys.stderr)
    r = subprocess.run(child, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"the emulated steps failed (rc {r.returncode})")
    lines = one_way_lines(gcov_lines(out))
    if args.json:
        print(json.dumps({"lines": lines}, indent=1))
        return
    print(f"{len(lines)} device source lines ran with a branch never taken (count = times the line ran):")
    for e in lines[:args.top]:
        print(f"{e['count']:>12,}  {e['file']}:{e['line']}  ({e['never']} of {e['taken'] + e['never']} never)  {e['source'][:90]}")


if __name__ == "__main__":
    main()
