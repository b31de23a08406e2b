"""Validator speed benchmark: validations per second of ~300-task programs and the time to
validate a 20,000-task layered program (the size of a Llama-3.1-8B decode step), every check
on, on one core, each given in its compact form (`schedule/compact.py`, what the validator
reads) and as a pydantic Program. A Program is frozen and keeps the compact form it was built
with (`compact.keep_compact`), so validating one reads that form; what making it costs is
paid once, when the program is built, and the build row reports it (the time to build one
~300-task program, the part of it that is the compact form, and built-then-validated
programs per second). The
~300-task rate is measured twice: one program validated over and over (the validator's memos
of per-params rule tables warm after the first call, as in a search over one model's
schedules) and a stream of distinct programs of the same shape, each with a vocabulary size
the validator has never seen (the embedding, LM-head and argmax params are new, so their
entry rows, from `form.operand_rules`, and the program's entry table are built every call; the
other params' rows are reused). (A new norm epsilon would not do: the memos key floats that the rules read only as
"present and positive" by that class.) A breakdown row splits one warm compact validation into
the checks, the program digest and the rest. Writes paper_results/validator_speed.json and .md.

    python -m amk.eval.validator_speed [--out paper_results] [--repeats 5]

Pin it to one core for the published figure: `taskset -c 0 python -m amk.eval.validator_speed`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from amk.eval.provenance import cpu_name, git_commit
from amk.eval.synthetic import layered_program
from amk.schedule.compact import compact, keep_compact
from amk.schedule.validate import fast_path_on, program_hash, validate
from amk.schedule.validator import fast


def _numba_version() -> str | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


def _timed(fn, repeats: int) -> list[float]:
    """Seconds per call of fn, each after a garbage collection: the programs just built are
    examined then, not in the first full collection that the timed calls' allocations set off
    (a pass over every object of hundreds of programs: a cost of building them, not of
    validating them)."""
    out = []
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(repeats: int = 5, extra: dict | None = None) -> dict:
    small = layered_program(layers=4, width=36, hidden=36 * 32)
    big = layered_program(layers=75, width=132, hidden=132 * 32)
    small_cp, big_cp = compact(small), compact(big)
    for prog in (small, big):
        res = validate(prog)
        if not res.accepted:
            raise SystemExit(f"benchmark program rejected: {res.summary()}")
    batch = 200
    rows = {}
    # the compact form (what the validator reads), then the pydantic Program (which keeps its compact form)
    def rate_row(form: str, memos: str, times: list[float]) -> dict:
        rates = sorted(batch / t for t in times)
        return {"tasks": len(small.tasks), "form": form, "memos": memos,
                "validations_per_second_median": statistics.median(rates),
                "validations_per_second_min": rates[0], "validations_per_second_max": rates[-1], "target_per_second": 2000}

    for name, prog in (("small_program", small_cp), ("small_program_objects", small)):
        rows[name] = rate_row("compact" if prog is small_cp else "Program", "warm (one program, validated again and again)",
                              _timed(lambda: [validate(prog) for _ in range(batch)], repeats))
    # distinct programs: the same shape, a vocabulary size never seen before in each (a fresh set per repeat)
    fresh = itertools.count(1)
    for name, form in (("small_programs_distinct", "compact"), ("small_programs_distinct_objects", "Program")):
        times = []
        for _ in range(repeats):
            progs = [layered_program(layers=4, width=36, hidden=36 * 32, vocab=128 + next(fresh)) for _ in range(batch)]
            if form == "compact":
                progs = [compact(p) for p in progs]
            results: list = []
            times += _timed(lambda: results.extend(validate(p) for p in progs), 1)
            if not all(r.accepted for r in results):
                raise SystemExit("a distinct benchmark program was rejected")
        rows[name] = rate_row(form, "cold: each program's rule table and its vocabulary-sized params are new to the validator",
                              times)
    rows["small_program_breakdown"] = breakdown(small_cp, repeats)
    rows["small_program_build"] = build_cost(small, fresh, repeats)
    cert = validate(big_cp).certificate
    for name, prog in (("large_program", big_cp), ("large_program_objects", big)):
        times = sorted(_timed(lambda: validate(prog), repeats))
        rows[name] = {"tasks": len(big.tasks), "form": "compact" if prog is big_cp else "Program",
                      "seconds_median": statistics.median(times), "seconds_min": times[0], "seconds_max": times[-1],
                      "target_seconds": 1.0, "ordering_checks": cert.conflicting_pairs_checked, "checks_run": len(cert.checks)}
    for name, prog in (extra or {}).items():
        times = sorted(_timed(lambda: validate(prog), repeats))
        rows[name] = {"tasks": len(prog.tasks), "seconds_median": statistics.median(times), "accepted": validate(prog).accepted}
    return rows


def breakdown(cp, repeats: int = 5, calls: int = 200) -> dict:
    """Where one validation of `cp` (compact form, memos warm) goes, in microseconds per call
    (medians over the repeats, each part timed on its own): the fast path's checks
    (`fast.verify`: the compiled kernels and the Python that feeds them), the certificate's
    program digest (`program_hash`), and the rest of `validate()` (parsing, certificate)."""
    def per_call(fn) -> float:
        return statistics.median(_timed(lambda: [fn() for _ in range(calls)], repeats)) / calls * 1e6

    whole, checks, digest = per_call(lambda: validate(cp)), per_call(lambda: fast.verify(cp)), per_call(lambda: program_hash(cp))
    return {"tasks": cp.num_tasks, "validate_us": whole, "checks_us": checks, "digest_us": digest,
            "rest_us": whole - checks - digest}


def build_cost(prog, fresh, repeats: int = 5, calls: int = 50) -> dict:
    """What building a ~300-task Program costs (microseconds, medians over the repeats): the
    whole build (`layered_program`: pydantic validation of every object, then its compact
    form), the compact form alone (`keep_compact`: made again, as its build did), and
    programs built and then validated per second (distinct programs, memos cold). Garbage
    collection is paused while timing, as validate() pauses it (with it on, a build costs
    2-4x as much, by how large the heap is)."""
    def per_call(fn) -> float:
        gc.disable()
        try:
            return statistics.median(_timed(lambda: [fn() for _ in range(calls)], repeats)) / calls * 1e6
        finally:
            gc.enable()

    def build():
        return layered_program(layers=4, width=36, hidden=36 * 32, vocab=128 + next(fresh))

    both = per_call(lambda: validate(build()).accepted or sys.exit("a built benchmark program was rejected"))
    return {"tasks": len(prog.tasks), "build_us": per_call(build), "compact_form_us": per_call(lambda: keep_compact(prog)),
            "built_and_validated_per_second": 1e6 / both}


def render_md(doc: dict) -> str:
    rows, affinity = doc["results"], doc["machine"]["cores_allowed"]
    lines = [f"# Validator speed\n\nCommand: `{doc['command']}` (commit {doc['commit'][:12]}, {doc['machine']['cpu']}, "
             f"{affinity} core(s) allowed, fast path {'on' if doc['machine'].get('fast_path') else 'OFF'})\n",
             "| program | form | tasks | result | target |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        if "validations_per_second_median" in r:
            memos = r.get("memos", "warm").split(":")[0].split(" ")[0]
            lines.append(f"| {name} | {r['form']}, memos {memos} | {r['tasks']} | "
                         f"{r['validations_per_second_median']:.0f} validations/s (median; {r['validations_per_second_min']:.0f}-"
                         f"{r['validations_per_second_max']:.0f} over the repeats) | 2000/s |")
        elif "form" in r:
            lines.append(f"| {name} | {r['form']} | {r['tasks']} | {r['seconds_median']:.3f} s (median; "
                         f"{r['seconds_min']:.3f}-{r['seconds_max']:.3f}) | 1.0 s |")
    b = rows.get("small_program_breakdown")
    if b:
        lines.append(f"\nOne validation of the {b['tasks']}-task compact program, us per call (each part timed on its own): "
                     f"{b['validate_us']:.0f} in all = checks (`fast.verify`) {b['checks_us']:.0f} + program digest "
                     f"{b['digest_us']:.0f} + the rest {b['rest_us']:.0f}.")
    c = rows.get("small_program_build")
    if c:
        lines.append(f"\nBuilding one {c['tasks']}-task Program (not part of a validation): {c['build_us']:.0f} us, of which "
                     f"its compact form (kept with it, what validate() reads) {c['compact_form_us']:.0f} us; built and then "
                     f"validated: {c['built_and_validated_per_second']:.0f} programs/s.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("paper_results"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = measure(args.repeats)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    doc = {"command": "python -m amk.eval.validator_speed " + " ".join(argv or sys.argv[1:]),
           "commit": git_commit(), "machine": {"cpu": cpu_name(), "cores_allowed": affinity, "python": platform.python_version(),
                                               "fast_path": fast_path_on(), "numba": _numba_version()},
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
