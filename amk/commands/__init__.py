"""Subcommands of `amk`, one module each; `register` adds them to the typer app."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from amk.commands import (autotune_cmd, bench_cmd, compile_cmd, evaluate_cmd, fuzz_cmd, generate_cmd, mcp_cmd,
                              schema_cmd, validate_cmd)

    app.command("compile")(compile_cmd.compile_command)
    app.command("generate")(generate_cmd.generate_command)
    app.command("validate")(validate_cmd.validate_command)
    app.command("schema")(schema_cmd.schema_command)
    app.command("fuzz")(fuzz_cmd.fuzz_command)
    app.command("bench")(bench_cmd.bench_command)
    app.command("autotune")(autotune_cmd.autotune_command)
    app.command("evaluate")(evaluate_cmd.evaluate_command)
    app.command("mcp")(mcp_cmd.mcp_command)
