"""Subcommands of `amk`, one module each; `register` adds them to the typer app."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from amk.commands import validate_cmd

    app.command("validate")(validate_cmd.validate_command)
