"""ScheduleConfig: ranges and cross-field rules are enforced, the schema is complete."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from amk.schedule.config import PRESETS, ScheduleConfig, preset


def test_defaults_and_schema():
    cfg = ScheduleConfig()
    assert cfg.gemv_tasks_per_matrix == "auto" and cfg.split_k == 1 and cfg.quant == "none"
    schema = ScheduleConfig.model_json_schema()
    assert schema.get("additionalProperties") is False
    assert set(schema["properties"]) == set(ScheduleConfig.model_fields)
    for name, prop in schema["properties"].items():
        assert prop.get("description"), f"field {name} has no description"
    json.dumps(schema)  # printable


@pytest.mark.parametrize("field,value", [
    ("gemv_tasks_per_matrix", 0), ("gemv_tasks_per_matrix", 5000), ("gemv_tasks_per_matrix", "many"),
    ("split_k", 0), ("split_k", 17),
    ("kv_splits", 0), ("kv_splits", 65), ("kv_splits", "lots"),
    ("kv_block", 4), ("kv_block", 48), ("kv_block", 2048),
    ("sm_assignment", "random"),
    ("blocks_per_sm", 0), ("blocks_per_sm", 9),
    ("max_queues", 0), ("max_queues", 1025),
    ("threads_per_block", 32), ("threads_per_block", 100), ("threads_per_block", 2048),
    ("prefetch_depth", -1), ("prefetch_depth", 5), ("prefetch_kb", 0), ("prefetch_kb", 8193),
    ("poll_cap_ns", 63), ("poll_cap_ns", 4097),
    ("fuse_norm", "sometimes"),
    ("quant", "fp8"), ("quant_group", 16), ("quant_group", 256),
    ("quant_unpack", -1), ("quant_unpack", 3),
    ("dtype", "float64"),
    ("no_such_field", 1),
])
def test_bad_values_rejected(field, value):
    with pytest.raises(ValidationError):
        ScheduleConfig(**{field: value})


@pytest.mark.parametrize("kwargs", [
    dict(sm_assignment="explicit"),  # explicit needs the list
    dict(explicit_queues=[0, 1]),  # the list needs explicit
    dict(sm_assignment="explicit", explicit_queues=[0, -1]),
    dict(quant="int4", quant_group="channel"),
    dict(quant="none", quant_group="channel"),
    dict(quant="int8", quant_group="channel", split_k=2),
    dict(quant_lm_head=True),
    dict(quant_unpack=1),
])
def test_inconsistent_combinations_rejected(kwargs):
    with pytest.raises(ValidationError):
        ScheduleConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(sm_assignment="explicit", explicit_queues=[0, 1, 2]),
    dict(quant="int8", quant_group="channel", quant_lm_head=True),
    dict(quant="int4", quant_group=32, quant_unpack=2),
    dict(kv_splits=64, kv_block=8, split_k=16, threads_per_block=1024, dtype="float16"),
])
def test_good_combinations(kwargs):
    cfg = ScheduleConfig(**kwargs)
    assert ScheduleConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_frozen_and_with():
    cfg = ScheduleConfig()
    with pytest.raises(ValidationError):
        cfg.split_k = 2
    assert cfg.with_(split_k=2).split_k == 2
    with pytest.raises(ValidationError):
        cfg.with_(split_k=0)


def test_presets():
    assert "default" in PRESETS
    for name, cfg in PRESETS.items():
        assert preset(name) is cfg
        ScheduleConfig.model_validate(cfg.model_dump())
    with pytest.raises(ValueError):
        preset("nope")
