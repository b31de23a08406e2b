"""`amk schema`: the JSON Schema of ScheduleConfig, the agents' edit surface."""

from __future__ import annotations

from amk.commands.common import emit_json


def schema_command() -> None:
    """Print the JSON Schema of ScheduleConfig (every knob, its range and what it changes)."""
    from amk.schedule.config import ScheduleConfig

    emit_json(ScheduleConfig.model_json_schema())
