"""`amk compile`: import, lower, validate; write program.json, config.json and report.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from amk.commands import model_args as A
from amk.commands.common import emit_json, write_atomic


def compile_command(
    model: Optional[str] = A.MODEL,
    config: Optional[str] = A.CONFIG,
    target: Optional[str] = A.TARGET,
    dtype: Optional[str] = A.DTYPE,
    out: Optional[Path] = typer.Option(None, "--out", help="Directory for program.json, config.json and report.md."),
    random_init: bool = A.RANDOM_INIT,
    kv_capacity: int = A.KV_CAPACITY,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Compile MODEL into one validated megakernel program for one decode step.

    A model AMK cannot run exactly is refused with the reason (exit 1); unreadable input is a
    one-line error. Nothing is written to --out unless compilation succeeds. No weights are
    bound (with --random-init none are drawn: any shape compiles in little memory)."""
    from amk.schedule.lower import program_stats
    from amk.schedule.targets import TARGETS

    mk = A.build_program(model, config, target, dtype, random_init, kv_capacity, progress=not as_json)
    stats = program_stats(mk.program)
    summary = {"model": mk.spec.name, "family": mk.spec.family, "target": mk.program.target.name,
               "dtype": mk.program.meta.get("dtype"), "accepted": mk.validation.accepted,
               "certificate": mk.validation.certificate.model_dump(mode="json"), "stats": stats}
    if out is not None:
        write_atomic(out / "program.json", mk.program.to_json())
        write_atomic(out / "config.json", mk.config.model_dump_json(indent=2))
        write_atomic(out / "report.md", _report(mk, stats, TARGETS))
        summary["out"] = str(out)
    if as_json:
        emit_json(summary)
        return
    c = mk.validation.certificate
    xcds = mk.program.meta.get("resolved", {}).get("xcds", 1)
    placed = f" ({xcds} XCDs, chiplet placement)" if xcds > 1 else ""
    typer.echo(f"{mk.spec.name}: {c.tasks} tasks, {c.counters} counters, {c.queues} queues on {mk.program.target.name}"
               f"{placed} - validated (hash {c.program_hash[:12]})")
    if out is not None:
        typer.echo(f"wrote {out}/program.json, config.json, report.md")


def _report(mk, stats: dict, targets) -> str:
    c = mk.validation.certificate
    lines = [f"# AMK program: {mk.spec.name}", "",
             f"- family {mk.spec.family}, {mk.spec.num_layers} layers, hidden {mk.spec.hidden_size}, "
             f"{mk.spec.num_heads} heads / {mk.spec.num_kv_heads} KV heads, head_dim {mk.spec.head_dim}",
             f"- target {mk.program.target.name} ({mk.program.target.arch}), dtype {mk.program.meta.get('dtype')}, "
             f"KV capacity {mk.program.kv_capacity}", "", "## Program", "",
             "```json", json.dumps(stats, indent=2, default=str), "```", "",
             "## Validation certificate", "", f"- accepted, program SHA-256 `{c.program_hash}`",
             f"- {c.tasks} tasks, {c.buffers} buffers, {c.counters} counters, {c.queues} queues, {c.waits} waits, "
             f"{c.conflicting_pairs_checked} ordering checks", f"- checks: {', '.join(c.checks)}", "",
             "## Config", "", "```json", mk.config.model_dump_json(indent=2), "```", ""]
    return "\n".join(lines)
