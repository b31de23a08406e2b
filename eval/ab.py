"""A paired A/B benchmark: schedule configs and VM experiment defines, in one device call.

    python -m amk.eval.ab MODEL --arm base= --arm multi=eval/configs/rope_multi_run.json \\
        --arm ahead=@AMK_RECORD_AHEAD=1 [--rounds 2] [--ctx 1024] [--out ab.json]

Each `--arm` is LABEL=[CONFIG][@DEFINES]: a ScheduleConfig JSON file (empty: the default
config) and AMK_VM_DEFINES-style experiment defines ("AMK_A=1,AMK_B=0"; empty: none). The
first arm is the reference. Every build is compiled first, in parallel (`amk.eval.prewarm`,
one process per config), then each round runs one gated `amk bench MODEL --json` per arm, in
its own process, with the arms' order rotated from round to round (A B, then B A, ...) so
that a drift of the machine does not favour one arm. A bench whose correctness gate fails
gives no latency: its arm is reported FAIL for that round and left out of the ratios.

The summary pairs each arm with the reference round by round (ratio of the megakernel
medians of one round) and gives their mean; each bench's own paired ratio to its baseline
(`--baselines`, run interleaved in the same process) is kept too, as a check that does not
depend on the order of the processes. `--out` writes all of it, with every command, as JSON
(atomically, after every bench, so that a run cut short keeps what it measured: `complete`
says whether it finished). The rule of eval/PERF_NOTES.md holds: no latency without a PASS in the same
run, and a change is judged by paired rounds, not by one row against another call's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional


@dataclass(frozen=True)
class Arm:
    label: str
    config: Optional[str]  # a ScheduleConfig JSON file; None: the default
    defines: str  # "AMK_A=1,AMK_B=0"; "": none


def parse_arm(text: str) -> Arm:
    """LABEL=[CONFIG][@DEFINES] -> Arm; ValueError says what is wrong."""
    from amk.vm.loader import parse_defines

    label, eq, rest = text.partition("=")
    if not eq or not label.strip():
        raise ValueError(f"--arm {text!r}: expected LABEL=[CONFIG][@DEFINES], e.g. base= or x=cfg.json@AMK_A=1")
    config, _, defines = rest.partition("@")
    config, defines = config.strip() or None, defines.strip()
    if config is not None and not Path(config).is_file():
        raise ValueError(f"--arm {label}: no config file {config}")
    parse_defines(defines, f"--arm {label}")  # raises on a malformed define
    return Arm(label.strip(), config, defines)


def round_order(arms: list[Arm], r: int) -> list[Arm]:
    """Round r runs the arms rotated by r."""
    k = r % len(arms)
    return arms[k:] + arms[:k]


@dataclass(frozen=True)
class BenchArgs:
    model: str
    dtype: str = "bfloat16"
    ctx: int = 1024
    baselines: str = "cuda_graph"
    bandwidth: Optional[float] = None
    random_init: bool = True
    steps: int = 100
    timeout_s: float = 300.0


def bench_command(b: BenchArgs, arm: Arm) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one gated bench of `arm`."""
    argv = [sys.executable, "-m", "amk.cli", "bench", b.model, "--dtype", b.dtype, "--ctx", str(b.ctx),
            "--baselines", b.baselines, "--steps", str(b.steps), "--json"]
    if b.random_init:
        argv.append("--random-init")
    if b.bandwidth is not None:
        argv += ["--bandwidth", str(b.bandwidth)]
    if arm.config is not None:
        argv += ["--config", arm.config]
    env = dict(os.environ)
    env["AMK_VM_DEFINES"] = arm.defines
    return argv, env


def command_line(b: BenchArgs, arm: Arm) -> str:
    """The bench of `arm` as a shell line, its defines included (what a note cites)."""
    argv = bench_command(b, arm)[0]
    return (f"AMK_VM_DEFINES={arm.defines} " if arm.defines else "") + "python -m " + " ".join(argv[2:])


def _last_json(stdout: str) -> Optional[dict]:
    """The JSON document `amk bench --json` printed (stdout may hold other lines first)."""
    start = stdout.find("\n{")
    text = stdout if stdout.startswith("{") else (stdout[start + 1:] if start >= 0 else "")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def run_bench_process(b: BenchArgs, arm: Arm) -> dict:
    """One bench in its own process: {status: ok | gate_failed | error, ...}."""
    argv, env = bench_command(b, arm)
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=b.timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {b.timeout_s:.0f} s"}
    doc = _last_json(proc.stdout)
    if doc is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "error", "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return summarize_row(doc)


def summarize_row(doc: dict) -> dict:
    """What the A/B keeps of a bench row (or of a gate failure)."""
    if doc.get("status") != "ok":
        return {"status": "gate_failed" if doc.get("status") == "gate_failed" else "error",
                "error": doc.get("status", "no status")}
    mk = doc["variants"]["megakernel"]
    baselines = {k: v["median_us"] for k, v in doc["variants"].items() if k != "megakernel"}
    return {"status": "ok", "median_us": mk["median_us"], "p10_us": mk["p10_us"], "p90_us": mk["p90_us"],
            "pct_of_floor": mk.get("pct_of_floor"), "baselines_us": baselines,
            "speedup_vs_baselines": {k: v["median"] for k, v in doc.get("speedup", {}).items()},
            "gate": "PASS" if doc.get("correctness", {}).get("passed") else "?",
            "git_commit": doc.get("git_commit"), "gpu": doc.get("gpu")}


def prewarm(b: BenchArgs, arms: list[Arm], log: Callable[[str], None]) -> None:
    """Compile every arm's build at once: one prewarm process per distinct config."""
    by_config: dict[Optional[str], list[str]] = {}
    for a in arms:
        by_config.setdefault(a.config, [])
        if (a.defines or "-") not in by_config[a.config]:
            by_config[a.config].append(a.defines or "-")
    procs = []
    for config, variants in by_config.items():
        argv = [sys.executable, "-m", "amk.eval.prewarm", b.model, "--dtype", b.dtype, "-j", str(len(variants))]
        argv += ["--config", config] if config else []
        for v in variants:
            argv += ["--variant", v]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate()
        last = (out or "").strip().splitlines()[-1:] or [""]
        log(f"prewarm: {last[0]}" if p.returncode == 0 else f"prewarm failed (the benches compile their own): {last[0]}")


def run_ab(b: BenchArgs, arms: list[Arm], rounds: int,
           run: Callable[[BenchArgs, Arm], dict] = run_bench_process,
           log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
           on_bench: Callable[[dict], None] = lambda doc: None) -> dict:
    """Every round's benches, then the paired summary (see the module docstring). After each
    bench `on_bench` gets the document so far (`complete` false until the last bench), so that a
    run cut short by a time limit keeps the benches it finished."""
    results: list[dict[str, dict]] = []

    def doc(complete: bool) -> dict:
        return {"model": b.model, "bench": asdict(b), "arms": [asdict(a) for a in arms],
                "commands": {a.label: command_line(b, a) for a in arms}, "complete": complete,
                "rounds": results, "summary": summarize(arms, results)}

    for r in range(rounds):
        got: dict[str, dict] = {}
        results.append(got)
        for arm in round_order(arms, r):
            res = run(b, arm)
            got[arm.label] = res
            shown = f"{res['median_us']:.1f} us" if res["status"] == "ok" else f"{res['status'].upper()}: {res.get('error', '')}"
            log(f"round {r + 1}/{rounds} {arm.label}: {shown}")
            on_bench(doc(False))
    return doc(True)


def summarize(arms: list[Arm], results: list[dict[str, dict]]) -> dict:
    """Per arm: its medians by round, their mean, and (past the first) the ratios to the
    reference's median of the same round, with their mean."""
    ref = arms[0].label
    out = {}

    def ok_in(r: dict, label: str) -> bool:  # (an arm of an unfinished round may not have run yet)
        return label in r and r[label]["status"] == "ok"

    for a in arms:
        med = [r[a.label]["median_us"] if ok_in(r, a.label) else None for r in results]
        ok = [m for m in med if m is not None]
        row = {"medians_us": med, "mean_us": sum(ok) / len(ok) if ok else None,
               "failed_rounds": sum(a.label in r and not ok_in(r, a.label) for r in results)}
        if a.label != ref:
            ratios = [m / r[ref]["median_us"] for m, r in zip(med, results) if m is not None and ok_in(r, ref)]
            row["ratios_to_ref"] = ratios
            row["mean_ratio_to_ref"] = sum(ratios) / len(ratios) if ratios else None
        out[a.label] = row
    return out


def format_summary(doc: dict) -> str:
    arms, s = doc["arms"], doc["summary"]
    n = len(doc["rounds"])
    head = f"{'arm':<14}{'config':<36}{'defines':<28}" + "".join(f"{'r' + str(i + 1):>10}" for i in range(n))
    lines = [head + f"{'mean':>10}  vs {arms[0]['label']}"]
    for a in arms:
        row = s[a["label"]]
        cells = "".join(f"{m:>10.1f}" if m is not None else f"{'FAIL' if a['label'] in r else 'not run':>10}"
                        for m, r in zip(row["medians_us"], doc["rounds"]))
        mean = f"{row['mean_us']:>10.1f}" if row["mean_us"] is not None else f"{'-':>10}"
        vs = "-"
        if row.get("mean_ratio_to_ref") is not None:
            vs = f"{100 * (row['mean_ratio_to_ref'] - 1):+.2f} % (" + ", ".join(f"{x:.4f}" for x in row["ratios_to_ref"]) + ")"
        lines.append(f"{a['label']:<14}{(a['config'] or '-'):<36}{(a['defines'] or '-'):<28}{cells}{mean}  {vs}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from amk.commands.common import write_atomic
    from amk.eval.shapes import shape_config

    ap = argparse.ArgumentParser(prog="python -m amk.eval.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="what `amk bench` takes: a shape name (eval/shapes.py) or a checkpoint")
    ap.add_argument("--arm", action="append", required=True, help="LABEL=[CONFIG][@DEFINES]; the first is the reference")
    ap.add_argument("--rounds", type=int, default=2, help="benches of every arm (default 2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--baselines", default="cuda_graph", help="run in each bench, paired with the megakernel")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s for the floor (default: each bench measures)")
    ap.add_argument("--steps", type=int, default=100, help="timed rounds of each bench")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per bench")
    ap.add_argument("--no-prewarm", action="store_true", help="let each bench compile its build itself")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the rounds and the summary (atomic)")
    a = ap.parse_args(argv)
    try:
        arms = [parse_arm(t) for t in a.arm]
    except ValueError as exc:
        ap.error(str(exc))
    if len({x.label for x in arms}) != len(arms):
        ap.error("arm labels must differ")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    b = BenchArgs(model=a.model, dtype=a.dtype, ctx=a.ctx, baselines=a.baselines, bandwidth=a.bandwidth,
                  random_init=shape_config(a.model) is not None, steps=a.steps, timeout_s=a.timeout)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if not a.no_prewarm:
        prewarm(b, arms, log)
    def save(d: dict) -> None:
        if a.out is not None:
            write_atomic(a.out, json.dumps(d, indent=2, sort_keys=True) + "\n")

    doc = run_ab(b, arms, a.rounds, log=log, on_bench=save)  # the file follows every bench
    print(format_summary(doc))
    save(doc)
    if a.out is not None:
        print(f"wrote {a.out}")
    return 0 if all(r["status"] == "ok" for rr in doc["rounds"] for r in rr.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
