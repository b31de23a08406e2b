"""Paired validator speed: this checkout against another source tree (an older commit), each
in its own process, alternated round by round on one core, so that a busy or drifting
machine weighs on both alike. `validator_speed` gives one version's absolute rates; this
gives the ratio between two, with its spread.

Each round runs, in a fresh process per tree, the benchmark's two ~300-task streams through
`validate()` (only the APIs both trees have): cold (distinct programs, each with a
vocabulary size new to the validator, built just before the timed pass) and warm (one
program again and again). Per tree: the mean microseconds a validation over each round's
programs; per round the ratio base / head (above 1: head is faster); medians over rounds.

    git worktree add /tmp/base <rev>   # (or git archive <rev> | tar x -C /tmp/base)
    taskset -c 0 python -m amk.eval.validator_ab /tmp/base --rounds 6 [--base-commit REV] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# the child: only what every tree has (layered_program, compact, validate); prints one JSON line
_CHILD = r"""
import gc, itertools, json, sys, time
from amk.eval.synthetic import layered_program
from amk.schedule.compact import compact
from amk.schedule.validate import validate
programs, seed = int(sys.argv[1]), int(sys.argv[2])
shape = dict(layers=4, width=36, hidden=36 * 32)
fresh = itertools.count(seed)
for p in [compact(layered_program(**shape, vocab=next(fresh))) for _ in range(5)]:
    validate(p)  # numba's cached machine code loaded, memos of the common params made
def mean_us(progs):
    gc.collect()
    gc.disable()
    t = time.perf_counter()
    ok = all(validate(p).accepted for p in progs)
    dt = time.perf_counter() - t
    gc.enable()
    if not ok:
        raise SystemExit("a benchmark program was rejected")
    return dt / len(progs) * 1e6
cold = mean_us([compact(layered_program(**shape, vocab=next(fresh))) for _ in range(programs)])
one = compact(layered_program(**shape, vocab=100))
validate(one)
warm = mean_us([one] * programs)
print(json.dumps({"cold_us": cold, "warm_us": warm}))
"""


def _shim(root: Path, into: Path) -> Path:
    """A folder whose `amk` package is the tree at `root` (its top-level folders are amk's
    subpackages, as pyproject.toml maps them), for PYTHONPATH."""
    pkg = into / "amk"
    pkg.mkdir(parents=True)
    init = root / "amk" / "__init__.py"
    pkg.joinpath("__init__.py").write_text(
        f"__path__ = [{str(root / 'amk')!r}, {str(root)!r}]\nexec(compile(open({str(init)!r}).read(), {str(init)!r}, 'exec'))\n")
    return into


def _run(shim: Path, programs: int, seed: int) -> dict:
    # (an empty PYTHONPATH entry would put the working directory, the temp folder, on sys.path)
    paths = [str(shim), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONSAFEPATH="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(programs), str(seed)], env=env, capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"the run of the tree behind {shim} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path, help="the other source tree (its top-level folders as in this repo)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--programs", type=int, default=400, help="validations a stream, a round")
    ap.add_argument("--base-commit", help="the commit the other tree holds, for the record (default: asked of git there)")
    ap.add_argument("--out", type=Path, help="write the rows and medians here as JSON")
    args = ap.parse_args(argv)
    head = Path(__file__).resolve().parent.parent
    base = args.base.resolve()
    if not (base / "schedule" / "validate.py").is_file():
        ap.error(f"{base} holds no schedule/validate.py: not a source tree of this project")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shims = {"base": _shim(base, Path(tmp) / "base"), "head": _shim(head, Path(tmp) / "head")}
        for r in range(args.rounds):
            seed = 1000 + r * 10 * args.programs  # each round's vocabularies new to both trees
            order = ("base", "head") if r % 2 == 0 else ("head", "base")  # neither always first
            got = {name: _run(shims[name], args.programs, seed) for name in order}
            row = {"round": r, **{f"{n}_{k}": v for n in ("base", "head") for k, v in got[n].items()},
                   "cold_ratio": got["base"]["cold_us"] / got["head"]["cold_us"],
                   "warm_ratio": got["base"]["warm_us"] / got["head"]["warm_us"]}
            rows.append(row)
            print(f"round {r}: cold base {row['base_cold_us']:.0f} us / head {row['head_cold_us']:.0f} us "
                  f"(x{row['cold_ratio']:.3f}); warm {row['base_warm_us']:.0f} / {row['head_warm_us']:.0f} "
                  f"(x{row['warm_ratio']:.3f})", flush=True)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    for stream in ("cold", "warm"):
        ratios = sorted(r[f"{stream}_ratio"] for r in rows)
        print(f"{stream}: base {summary[f'base_{stream}_us']:.0f} us, head {summary[f'head_{stream}_us']:.0f} us a validation "
              f"(medians); base/head x{summary[f'{stream}_ratio']:.3f} (rounds {ratios[0]:.3f}-{ratios[-1]:.3f})")
    if args.out:
        from amk.commands.common import write_atomic
        from amk.eval.provenance import cpu_name, git_commit

        doc = {"command": "python -m amk.eval.validator_ab " + " ".join(argv or sys.argv[1:]), "head_commit": git_commit(),
               "base": str(base), "base_commit": args.base_commit or git_commit(base), "cpu": cpu_name(),
               "cores_allowed": len(os.sched_getaffinity(0)), "rows": rows, "medians": summary}
        write_atomic(args.out, json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
