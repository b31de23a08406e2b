"""`amk autotune MODEL`: a propose -> validate -> gate -> measure -> keep/revert campaign."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from amk.commands import model_args as A
from amk.commands.common import emit_json, fail

JOURNAL = typer.Option(Path("amk-autotune"), "--journal", help="Directory of the SQLite journal and the reports.")
EVALUATOR = typer.Option("auto", "--evaluator", help="cuda (the megakernel, timed A/B), cpu (ReferenceVM gate + "
                         "analytic cost model) or auto (cuda when a GPU is present).")
FIX = typer.Option(None, "--fix", help="Pin a ScheduleConfig field, FIELD=VALUE (JSON value), e.g. --fix "
                   "max_queues=64 --fix quant='\"none\"'. Repeatable.")
MAX_DRIFT = typer.Option(None, "--max-quant-drift", min=0.0, help="Gate quantized configs on their relative "
                         "max-abs logits drift from the unquantized model (default: report only).")
CONTEXT = typer.Option(None, "--context", min=1, help="KV positions attended in the timed step (default "
                       "min(kv_capacity, 512)).")
TRIAL_TIMEOUT = typer.Option(300.0, "--trial-timeout", min=1.0, help="Seconds before a trial counts as hung.")
ISOLATION = typer.Option("process", "--isolation", help="process (one reused worker, replaced after a failure), "
                         "fresh (a new worker per trial) or inline (no child; debugging only).")


def resolve_evaluator(name: str) -> str:
    if name == "auto":
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
    if name not in ("cpu", "cuda") and ":" not in name:
        fail(f"--evaluator must be cpu, cuda or auto, got {name!r}")
    return name


def fixed_fields(fix: Optional[list[str]]) -> dict:
    from amk.agent.proposers import parse_fixed

    try:
        return parse_fixed(fix or [])
    except ValueError as exc:
        fail(str(exc).splitlines()[0])


def autotune_command(
    model: Optional[str] = A.MODEL,
    minutes: Optional[float] = typer.Option(None, "--minutes", min=0.0, help="Wall-clock budget of the trials, counted "
                                            "once the model has loaded; a trial still running at its end gets 30 s "
                                            "more, then is aborted (recorded as interrupted)."),
    trials: Optional[int] = typer.Option(None, "--trials", min=1, help="Total trials of the campaign (a resumed "
                                         "campaign counts its earlier ones). Default 50 without --minutes/--overnight."),
    overnight: bool = typer.Option(False, "--overnight", help="Run until stopped (SIGINT/SIGTERM), hopping to fresh "
                                   "regions on a plateau; the global best is always kept."),
    resume: bool = typer.Option(False, "--resume", help="Continue the latest campaign of this model, target and "
                                "evaluator in the journal after any interruption."),
    journal: Path = JOURNAL,
    evaluator: str = EVALUATOR,
    random_init: bool = A.RANDOM_INIT,
    seed: int = A.SEED,
    config: Optional[str] = typer.Option(None, "--config", help="Base config (JSON file or preset), evaluated "
                                         "after the default."),
    target: Optional[str] = A.TARGET,
    dtype: Optional[str] = A.DTYPE,
    kv_capacity: int = A.KV_CAPACITY,
    fix: Optional[list[str]] = FIX,
    proposer: str = typer.Option("auto", "--proposer", help="auto (local search + TPE + random), random, local, tpe."),
    search_seed: int = typer.Option(0, "--search-seed", help="Seed of the proposers."),
    search_dtype: bool = typer.Option(False, "--search-dtype", help="Also search the program dtype (default: "
                                      "the model's)."),
    max_quant_drift: Optional[float] = MAX_DRIFT,
    context: Optional[int] = CONTEXT,
    trial_timeout: float = TRIAL_TIMEOUT,
    isolation: str = ISOLATION,
    as_json: bool = typer.Option(False, "--json", help="Print the campaign summary as JSON."),
) -> None:
    """Search ScheduleConfig for the fastest correct megakernel of MODEL.

    Every trial is validated, gated for correctness and measured in a child process; a crash
    or hang is a failed trial, never the end of the campaign. Writes DIR/journal.sqlite and,
    per campaign, DIR/<campaign>/report.md, best_latency.png and best_config.json. Exit 0
    with a passing best config, 1 when no trial passed or the model cannot be loaded."""
    from amk.agent.loop import CampaignError, CampaignSettings, dumps, run_campaign
    from amk.agent.proposers import PROPOSERS
    from amk.commands.model_args import load_config

    if proposer not in PROPOSERS:
        fail(f"--proposer must be one of {', '.join(PROPOSERS)}")
    if isolation not in ("process", "fresh", "inline"):
        fail("--isolation must be process, fresh or inline")
    settings = CampaignSettings(
        model=model, random_init=random_init, seed=seed, dtype=dtype, target=target, kv_capacity=kv_capacity,
        evaluator=resolve_evaluator(evaluator), journal_dir=journal, trials=trials, minutes=minutes,
        overnight=overnight, resume=resume, proposer=proposer, search_seed=search_seed,
        base_config=load_config(config), fixed=fixed_fields(fix), search_dtype=search_dtype,
        max_quant_drift=max_quant_drift, context=context, trial_timeout_s=trial_timeout, isolation=isolation,
        plateau=30 if overnight else 0,
    )
    try:
        summary = run_campaign(settings, progress=not as_json, handle_signals=True)
    except CampaignError as exc:
        fail(str(exc).splitlines()[0], code=1)
    except ImportError as exc:
        fail(str(exc), code=2)
    if as_json:
        import json

        emit_json(json.loads(dumps(summary)))
    else:
        _print(summary)
    raise typer.Exit(0 if summary.get("best") else 1)


def _print(s: dict) -> None:
    best = s.get("best")
    verdicts = ", ".join(f"{v} {k}" for k, v in sorted((s.get("by_verdict") or {}).items()))
    typer.echo(f"campaign {s.get('campaign')} ({s.get('status')}): {s.get('trials')} trials [{verdicts}]")
    if best:
        sp = f", {best['speedup']:.3f}x the default" if best.get("speedup") else ""
        typer.echo(f"best: trial {best['trial']}, {best['latency_us']:.2f} us (floor {best['floor_us']:.2f} us){sp}")
    else:
        typer.echo("no passing trial")
    for k, p in (s.get("report") or {}).items():
        typer.echo(f"  {k}: {p}")
