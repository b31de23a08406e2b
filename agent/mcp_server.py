"""`amk mcp`: the agent surface as an MCP server (the official `mcp` package, imported lazily).

Tools (each a plain function here, so they are testable without MCP):

    schema()                         the JSON Schema of ScheduleConfig: the edit surface
    compile(model, config, ...)      import + lower + validate: certificate and program stats
    validate(program)                the frozen validator on a program JSON (path or text)
    evaluate(model, config, ...)     one gated trial in a child process: verdict, violations,
                                     latency, floor, speedup over the default
    campaign_status(journal, id)     a campaign's progress and best config, from its journal

A tool never raises for an expected failure: it returns {"ok": false, "error": ...}.
Works with mcp 1.x (`mcp.server.fastmcp.FastMCP`) and 2.x (`mcp.server.mcpserver.MCPServer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

INSTRUCTIONS = (
    "AMK compiles a Llama-family model into one statically verified persistent GPU megakernel. "
    "Change only ScheduleConfig (see the schema tool) and measure with evaluate; every latency is "
    "gated on correctness. Read AGENTS.md for what may and may not be edited."
)

ConfigArg = Union[dict, str, None]


def _config(config: ConfigArg):
    from amk.schedule.config import PRESETS, ScheduleConfig

    if config is None:
        return None
    if isinstance(config, dict):
        return ScheduleConfig.model_validate(config)
    if config in PRESETS:
        return PRESETS[config]
    text = config
    if not config.lstrip().startswith("{"):
        text = Path(config).read_text()
    return ScheduleConfig.model_validate_json(text)


def _error(exc: BaseException) -> dict:
    msg = str(exc).strip().splitlines()
    return {"ok": False, "error": f"{type(exc).__name__}: {msg[0] if msg else ''}"}


def _safe(obj) -> Any:
    from amk.agent.loop import json_safe

    return json.loads(json.dumps(json_safe(obj), default=str))


def tool_schema() -> dict:
    from amk.schedule.config import PRESETS, ScheduleConfig

    return {"ok": True, "schema": ScheduleConfig.model_json_schema(), "presets": sorted(PRESETS)}


def tool_compile(model: Optional[str] = None, config: ConfigArg = None, target: Optional[str] = None,
                 dtype: Optional[str] = None, random_init: bool = False, kv_capacity: int = 2048,
                 out: Optional[str] = None) -> dict:
    from pydantic import ValidationError

    from amk.errors import AmkError

    try:
        from amk.schedule.stats import program_stats

        from amk.api import compile_program

        # lowering and validation need no weights: none are drawn for random_init
        mk = compile_program(model, _config(config), target, dtype=dtype, random_init=random_init,
                             kv_capacity=kv_capacity)
        res = {"ok": True, "model": mk.spec.name, "target": mk.program.target.name,
               "certificate": mk.validation.certificate.model_dump(mode="json"), "stats": program_stats(mk.program),
               "config": mk.config.model_dump(mode="json")}
        if out:
            from amk.commands.common import write_atomic

            write_atomic(Path(out) / "program.json", mk.program.to_json())
            write_atomic(Path(out) / "config.json", mk.config.model_dump_json(indent=2))
            res["program_path"] = str(Path(out) / "program.json")
        return _safe(res)
    except (AmkError, ValidationError, ValueError, OSError) as exc:
        return _error(exc)


def tool_validate(program: str) -> dict:
    """`program`: a path to a program JSON or the JSON text itself."""
    from amk.schedule.validate import validate

    try:
        text = program if program.lstrip().startswith("{") else Path(program).read_text()
    except OSError as exc:
        return _error(exc)
    r = validate(text)
    return _safe({"ok": True, "accepted": r.accepted, "summary": r.summary(), **r.model_dump(mode="json")})


def tool_evaluate(model: Optional[str] = None, config: ConfigArg = None, evaluator: str = "auto",
                  target: Optional[str] = None, dtype: Optional[str] = None, random_init: bool = False,
                  seed: int = 0, kv_capacity: int = 2048, max_quant_drift: Optional[float] = None,
                  context: Optional[int] = None, timeout_s: float = 300.0) -> dict:
    from amk.agent.loop import CampaignError, CampaignSettings, evaluate_config
    from amk.schedule.config import ScheduleConfig
    from pydantic import ValidationError

    try:
        cfg = _config(config) or ScheduleConfig()
        if evaluator == "auto":
            import torch

            evaluator = "cuda" if torch.cuda.is_available() else "cpu"
        s = CampaignSettings(model=model, random_init=random_init, seed=seed, dtype=dtype, target=target,
                             kv_capacity=kv_capacity, evaluator=evaluator, max_quant_drift=max_quant_drift,
                             context=context, trial_timeout_s=timeout_s)
        return _safe({"ok": True, **evaluate_config(s, cfg)})
    except (CampaignError, ValidationError, ValueError, OSError) as exc:
        return _error(exc)


def tool_campaign_status(journal: str = "amk-autotune", campaign: Optional[str] = None) -> dict:
    from amk.agent.journal import Journal

    try:
        with Journal(Path(journal), readonly=True) as j:
            st = j.status(campaign)
            st["campaigns"] = [{"id": c["id"], "model": c["model"], "status": c["status"], "evaluator": c["evaluator"],
                                "device": c["device"]} for c in j.campaigns()]
            return _safe({"ok": True, **st})
    except (FileNotFoundError, OSError) as exc:
        return _error(exc)
    except Exception as exc:  # sqlite errors on a journal being created
        return _error(exc)


TOOLS = {"schema": tool_schema, "compile": tool_compile, "validate": tool_validate, "evaluate": tool_evaluate,
         "campaign_status": tool_campaign_status}


def _server_class():
    try:
        from mcp.server.mcpserver import MCPServer  # mcp >= 2

        return MCPServer
    except ImportError:
        pass
    try:
        from mcp.server.fastmcp import FastMCP  # mcp 1.x

        return FastMCP
    except ImportError:
        raise ImportError("`amk mcp` needs the official MCP SDK: pip install mcp") from None


def build_server(journal: Optional[str] = None):
    """The MCP server with every tool registered (campaign_status defaults to `journal`)."""
    server = _server_class()("amk", instructions=INSTRUCTIONS)
    for name, fn in TOOLS.items():
        if name == "campaign_status" and journal:
            default_journal = str(journal)

            def campaign_status(journal: str = default_journal, campaign: Optional[str] = None) -> dict:
                return tool_campaign_status(journal, campaign)

            fn = campaign_status
        server.tool(name=name, description=TOOL_DOCS[name])(fn)
    return server


TOOL_DOCS = {
    "schema": "The JSON Schema of ScheduleConfig (every knob an agent may change) and the preset names.",
    "compile": "Import, lower and validate a model under a ScheduleConfig; returns the certificate and program stats.",
    "validate": "Run the frozen static validator on a program JSON (a path or the JSON text).",
    "evaluate": "One gated trial of a config in a child process: verdict, violations, latency, floor, speedup "
                "over the default config.",
    "campaign_status": "A campaign's progress and best config, read from its journal directory.",
}


def serve(journal: Optional[str] = None, transport: str = "stdio") -> None:
    build_server(journal).run(transport=transport)
