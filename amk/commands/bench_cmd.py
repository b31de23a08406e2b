"""`amk bench`: decode-step latency of the megakernel against PyTorch baselines.

Exit status: 0 measured; 1 refused (correctness gate failed, a latency below the physical
floor, or the run could not be made); 2 unreadable input; 3 measured, but a baseline
failed to build or prepare (its error is in the result).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from amk.commands import model_args as A
from amk.commands.common import emit_json, fail, write_atomic


def bench_command(
    model: Optional[str] = typer.Argument(
        None, help="A model as for `amk compile`, or a shape name (smollm2-135m, llama-3.2-1b, llama-3.1-8b: "
        "with --random-init, weights drawn on the GPU). Default: the embedded SmolLM2-135M."),
    dtype: Optional[str] = A.DTYPE,
    ctx: int = typer.Option(1024, "--ctx", min=0, help="KV positions filled before the first measured step."),
    config: Optional[str] = A.CONFIG,
    target: Optional[str] = typer.Option(None, "--target", help="GPU target record (default: from the GPU's name)."),
    random_init: bool = A.RANDOM_INIT,
    seed: int = A.SEED,
    steps: int = typer.Option(100, "--steps", min=1, help="Timed interleaved rounds (one step of every variant each)."),
    warmup: int = typer.Option(20, "--warmup", min=1, help="Untimed rounds before timing."),
    check_steps: int = typer.Option(4, "--check-steps", min=1, help="Correctness-gate steps before timing."),
    baselines: str = typer.Option("cuda_graph,torch_compile,hf_eager", "--baselines",
                                  help="Comma-separated: cuda_graph, torch_compile, hf_eager, eager."),
    bandwidth: Optional[float] = typer.Option(None, "--bandwidth", min=1.0,
                                              help="HBM bandwidth in GB/s for the floor (default: measure now)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file to add the result row to (atomically; a row "
                                       "with the same model, dtype, ctx and quant is replaced)."),
) -> None:
    """Time one decode step of MODEL: megakernel vs CUDA-graph / torch.compile / HF baselines.

    A correctness gate runs first (logits vs HF eager at equal precision); no latency is
    printed unless it passes, and none below the roofline floor (bytes / bandwidth)."""
    from amk.errors import AmkError
    from amk.eval.bench import BenchOptions, GateFailed, format_gate, format_table, merge_rows, run_bench
    from amk.eval.roofline import FloorViolation

    opts = BenchOptions(model=model, dtype=dtype, ctx=ctx, config=A.load_config(config), random_init=random_init,
                        seed=seed, steps=steps, warmup=warmup, check_steps=check_steps,
                        baselines=tuple(b.strip() for b in baselines.split(",") if b.strip()), target=target,
                        bandwidth_gbps=bandwidth, command="amk " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    try:
        row = run_bench(opts, log=lambda m: typer.echo(m, err=True))
    except GateFailed as exc:
        if as_json:
            emit_json({"status": "gate_failed", "model": model, "dtype": dtype, "ctx": ctx, "correctness": exc.report})
        else:
            typer.echo(format_gate(exc.report))
        fail(str(exc), code=1)
    except FloorViolation as exc:
        fail(str(exc), code=1)
    except AmkError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, code=1)
    if out is not None:
        try:
            doc = json.loads(out.read_text()) if out.exists() else None
        except (OSError, json.JSONDecodeError) as exc:
            fail(f"cannot read {out} to add the row: {exc}")
        write_atomic(out, json.dumps(merge_rows(doc, row), indent=2, sort_keys=True) + "\n")
    if as_json:
        emit_json({"status": "ok", **row})
    else:
        typer.echo(format_table(row))
        if out is not None:
            typer.echo(f"wrote the row to {out}")
    if row["baseline_errors"]:
        typer.echo("error: baseline(s) failed: " + "; ".join(f"{k}: {v}" for k, v in row["baseline_errors"].items()),
                   err=True)
        raise typer.Exit(3)
