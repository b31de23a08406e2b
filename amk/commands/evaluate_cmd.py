"""`amk evaluate MODEL --config F`: one gated trial, the agents' measurement call."""

from __future__ import annotations

from typing import Optional

import typer

from amk.commands import model_args as A
from amk.commands.autotune_cmd import (
    CONTEXT,
    EVALUATOR,
    FIX,
    ISOLATION,
    MAX_DRIFT,
    TRIAL_TIMEOUT,
    fixed_fields,
    resolve_evaluator,
)
from amk.commands.common import emit_json, fail


def evaluate_command(
    model: Optional[str] = A.MODEL,
    config: str = typer.Option(..., "--config", help="ScheduleConfig JSON file (see `amk schema`) or a preset name."),
    evaluator: str = EVALUATOR,
    target: Optional[str] = A.TARGET,
    dtype: Optional[str] = A.DTYPE,
    random_init: bool = A.RANDOM_INIT,
    seed: int = A.SEED,
    kv_capacity: int = A.KV_CAPACITY,
    fix: Optional[list[str]] = FIX,
    max_quant_drift: Optional[float] = MAX_DRIFT,
    context: Optional[int] = CONTEXT,
    trial_timeout: float = TRIAL_TIMEOUT,
    isolation: str = ISOLATION,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Validate, correctness-gate and measure one config against the default config.

    Prints the verdict, violations, latency (p10/p90), the floor and the speedup over the
    default (an interleaved A/B on cuda). Exit 0 pass, 1 any other verdict, 2 bad input."""
    from amk.agent.loop import CampaignError, CampaignSettings, dumps, evaluate_config
    from amk.commands.model_args import load_config

    cfg = load_config(config)
    fixed = fixed_fields(fix)
    if fixed:
        cfg = cfg.with_(**fixed)
    settings = CampaignSettings(model=model, random_init=random_init, seed=seed, dtype=dtype, target=target,
                                kv_capacity=kv_capacity, evaluator=resolve_evaluator(evaluator), fixed=fixed,
                                max_quant_drift=max_quant_drift, context=context, trial_timeout_s=trial_timeout,
                                isolation=isolation)
    try:
        out = evaluate_config(settings, cfg)
    except CampaignError as exc:
        fail(str(exc).splitlines()[0], code=1)
    if as_json:
        import json

        emit_json(json.loads(dumps(out)))
    else:
        typer.echo(f"verdict: {out['verdict']}")
        for v in out["violations"][:10]:
            typer.echo(f"  - {v}")
        if out["verdict"] == "pass":
            sp = out.get("speedup_vs_default")
            typer.echo(f"latency {out['latency_us']:.3f} us (p10 {out['p10_us']:.3f}, p90 {out['p90_us']:.3f}), "
                       f"floor {out['floor_us']:.3f} us" + (f", {sp:.3f}x the default" if sp else ""))
    raise typer.Exit(0 if out["verdict"] == "pass" else 1)
