"""The `amk` command line. Each subcommand is a thin wrapper over the Python API."""

from __future__ import annotations

from typing import Optional

import typer

from amk import __version__

app = typer.Typer(
    name="amk",
    help="Compile a Hugging Face Llama-family model into one statically verified persistent GPU megakernel.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"amk {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """AMK: one decode step of a Llama-family model as one validated cooperative GPU launch."""


from amk import commands as _commands  # noqa: E402  (registers the subcommands)

_commands.register(app)

if __name__ == "__main__":
    app()
