"""Validator speed benchmark: validations per second of ~300-task programs and the time to
validate a 20,000-task layered program (the size of a Llama-3.1-8B decode step), every check
on, on one core. Writes paper_results/validator_speed.json and .md.

    python -m amk.eval.validator_speed [--out paper_results] [--repeats 5]

Pin it to one core for the published figure: `taskset -c 0 python -m amk.eval.validator_speed`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from amk.eval.provenance import cpu_name, git_commit
from amk.eval.synthetic import layered_program
from amk.schedule.validate import validate


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(repeats: int = 5, extra: dict | None = None) -> dict:
    small = layered_program(layers=4, width=36, hidden=36 * 32)
    big = layered_program(layers=75, width=132, hidden=132 * 32)
    for prog in (small, big):
        res = validate(prog)
        if not res.accepted:
            raise SystemExit(f"benchmark program rejected: {res.summary()}")
    batch = 200
    per_batch = _timed(lambda: [validate(small) for _ in range(batch)], repeats)
    rates = sorted(batch / t for t in per_batch)
    big_times = sorted(_timed(lambda: validate(big), repeats))
    cert = validate(big).certificate
    rows = {
        "small_program": {"tasks": len(small.tasks), "validations_per_second_median": statistics.median(rates),
                          "validations_per_second_min": rates[0], "validations_per_second_max": rates[-1],
                          "target_per_second": 2000},
        "large_program": {"tasks": len(big.tasks), "seconds_median": statistics.median(big_times),
                          "seconds_min": big_times[0], "seconds_max": big_times[-1], "target_seconds": 1.0,
                          "ordering_checks": cert.conflicting_pairs_checked, "checks_run": len(cert.checks)},
    }
    for name, prog in (extra or {}).items():
        times = sorted(_timed(lambda: validate(prog), repeats))
        rows[name] = {"tasks": len(prog.tasks), "seconds_median": statistics.median(times), "accepted": validate(prog).accepted}
    return rows


def render_md(doc: dict) -> str:
    rows, affinity = doc["results"], doc["machine"]["cores_allowed"]
    s, b = rows["small_program"], rows["large_program"]
    return (f"# Validator speed\n\nCommand: `{doc['command']}` (commit {doc['commit'][:12]}, {doc['machine']['cpu']}, "
            f"{affinity} core(s) allowed)\n\n| program | tasks | result | target |\n|---|---|---|---|\n"
            f"| layered ~300 | {s['tasks']} | {s['validations_per_second_median']:.0f} validations/s (median) | 2000/s |\n"
            f"| layered 20k | {b['tasks']} | {b['seconds_median']:.3f} s (median) | 1.0 s |\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("paper_results"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = measure(args.repeats)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    doc = {"command": "python -m amk.eval.validator_speed " + " ".join(argv or sys.argv[1:]),
           "commit": git_commit(), "machine": {"cpu": cpu_name(), "cores_allowed": affinity, "python": platform.python_version()},
           "results": rows}
    from amk.commands.common import write_atomic

    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "validator_speed.json", json.dumps(doc, indent=2) + "\n")
    md = render_md(doc)
    write_atomic(args.out / "validator_speed.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
