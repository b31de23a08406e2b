"""`amk fuzz`: the validator soundness campaign (validator vs the execution oracle)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from amk.commands.common import emit_json, fail


def fuzz_command(
    schedules: int = typer.Option(2000, "--schedules", "-n", min=1, help="How many schedules to generate and judge."),
    seed: int = typer.Option(0, "--seed", help="Campaign seed; schedule i is a pure function of (seed, i)."),
    classes: Optional[list[str]] = typer.Option(
        None, "--classes", help="Classes to generate (repeat or comma-separate); default all. "
        "real, random-safe, random-mutated, and one per injected defect (see the report)."),
    workers: int = typer.Option(1, "--workers", "-j", min=1, help="Worker processes."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole report as JSON on stdout."),
    out: Path = typer.Option(Path("paper_results/validator_soundness.json"), "--out",
                             help="Where the JSON report goes; the Markdown table goes beside it (.md)."),
    replay: Optional[int] = typer.Option(None, "--replay", help="Print schedule INDEX of this seed as program JSON, "
                                         "with its class and verdicts on stderr, and exit."),
) -> None:
    """Fuzz the static validator against an independent execution oracle.

    Generates real lowerings, single-injection mutants of them and random programs; the
    validator and the oracle judge each one. Exit status: 0 when there are no false accepts,
    no rejected real lowering and no errors; 1 otherwise.
    """
    from amk.eval import fuzz

    chosen = [c.strip() for item in (classes or []) for c in item.split(",") if c.strip()] or list(fuzz.CLASSES)
    try:
        fuzz.plan(chosen)
    except ValueError as exc:
        fail(str(exc))
    if replay is not None:
        _replay(fuzz, seed, replay, chosen)
        return
    command = "amk fuzz " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "fuzz" \
        else f"amk fuzz --schedules {schedules} --seed {seed} --workers {workers}"
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn("fuzz"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=as_json) as bar:
        task = bar.add_task("fuzz", total=schedules, rate="")
        import time

        t0 = time.perf_counter()
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            el = time.perf_counter() - t0
            bar.update(task, advance=n, rate=f"{done[0] / el:.1f}/s" if el > 0 else "")

        records, wall = fuzz.run_campaign(schedules, seed, chosen, workers, progress=advance)
    doc = fuzz.report(records, wall, command=command, seed=seed, classes=chosen, workers=workers)
    md = fuzz.write_report(doc, out)
    dumped = fuzz.dump_false_accepts(doc, out, seed, chosen)
    if as_json:
        emit_json(doc)
    else:
        typer.echo(fuzz.markdown(doc))
        typer.echo(f"wrote {out} and {md}" + (f"; false-accept programs in {dumped[0].parent}" if dumped else ""))
    t = doc["totals"]
    raise typer.Exit(1 if t["false_accepts"] or t["real_rejected"] or t["errors"] else 0)


def _replay(fuzz, seed: int, index: int, classes: list[str]) -> None:
    from amk.eval.fuzz_oracle import judge
    from amk.schedule.validate import validate

    cls, prog, desc = fuzz.make_schedule(seed, index, classes)
    typer.echo(f"schedule {index} of seed {seed}: class {cls}: {desc}", err=True)
    if prog is None:
        fail("no program (no injection site)", 1)
    res = validate(prog)
    v = judge(prog, seed=seed * 1_000_003 + index)
    typer.echo(f"validator: {res.summary()}", err=True)
    typer.echo(f"oracle: {'safe' if v.safe else 'UNSAFE'} {list(v.labels)} ({v.mode}, exact={v.exact}) {v.witness}", err=True)
    sys.stdout.write(prog.to_json(indent=1) + "\n")
