"""`amk validate PROGRAM.json`: exit 0 accepted, 1 rejected, 2 unreadable input."""

from __future__ import annotations

from pathlib import Path

import typer

from amk.commands.common import emit_json, fail


def validate_command(
    program: Path = typer.Argument(..., help="A program JSON file, as `amk compile` writes it."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole ValidationResult as JSON."),
) -> None:
    """Statically certify a program deadlock-free, race-free, memory-safe and complete.

    Exit status: 0 accepted, 1 rejected (each violation printed with its check), 2 unreadable input.
    """
    from amk.schedule.validate import validate

    try:
        text = program.read_bytes()
    except OSError as exc:
        fail(f"cannot read {program}: {exc.strerror or exc}")
    result = validate(text)
    if not result.accepted and result.violations and result.violations[0].check == "schema":
        if as_json:
            emit_json(result.model_dump(mode="json"))
        else:
            typer.echo(f"error: {program} is not a readable program: {result.violations[0].reason}", err=True)
        raise typer.Exit(2)
    if as_json:
        emit_json(result.model_dump(mode="json"))
    else:
        typer.echo(result.summary())
        if result.accepted:
            c = result.certificate
            typer.echo(f"  hash {c.program_hash[:16]}…  {c.waits} waits, {c.conflicting_pairs_checked} ordering checks, "
                       f"{len(c.checks)} checks")
    raise typer.Exit(0 if result.accepted else 1)
