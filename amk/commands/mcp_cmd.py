"""`amk mcp`: serve compile / validate / evaluate / campaign status to agents over MCP."""

from __future__ import annotations

from pathlib import Path

import typer

from amk.commands.common import fail


def mcp_command(
    journal: Path = typer.Option(Path("amk-autotune"), "--journal", help="Default journal directory of the "
                                 "campaign_status tool."),
    transport: str = typer.Option("stdio", "--transport", help="stdio, sse or streamable-http."),
) -> None:
    """Run an MCP server (the official `mcp` SDK) exposing the tools schema, compile, validate,
    evaluate and campaign_status. See AGENTS.md."""
    if transport not in ("stdio", "sse", "streamable-http"):
        fail("--transport must be stdio, sse or streamable-http")
    from amk.agent.mcp_server import serve

    try:
        serve(str(journal), transport)
    except ImportError as exc:
        fail(str(exc))
