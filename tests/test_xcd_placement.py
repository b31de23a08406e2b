"""Chiplet-aware placement for AMD gfx942/gfx950 (8 XCDs, a private L2 each), on the CPU:
each GEMV's rows split into one contiguous slab per XCD, tasks bound to their XCD's queues
(queue q on XCD q % 8), counters narrowed to XCD scope only inside one XCD, the program
validated, and the ReferenceVM running it to the same logits as HF eager."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest

from amk.api import compile as amk_compile
from amk.eval.coverage import LOGIT_TOL
from amk.eval.oracle import compare
from amk.schedule.config import ScheduleConfig
from amk.schedule.importer import build_hf_model, load_model, zoo_configs
from amk.schedule.ir import Epilogue, Op, Scope
from amk.schedule.lower import lower
from amk.schedule.targets import get_target
from amk.schedule.validate import validate

ZOO = zoo_configs()


def _load(name: str, tmp_path):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ZOO[name]))
    return load_model(str(path), random_init=True, seed=0)


def _xcd_of_task(prog) -> dict[int, int]:
    n = prog.target.xcds
    return {t: q % n for q, ts in enumerate(prog.queues) for t in ts}


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_gemv_rows_split_into_one_slab_per_xcd(target, tmp_path):
    spec, _ = _load("llama2-like", tmp_path)
    prog = lower(spec, ScheduleConfig(max_queues=16), get_target(target), kv_capacity=64)
    assert validate(prog).accepted
    assert prog.meta["resolved"]["xcds"] == 8
    xcd = _xcd_of_task(prog)
    rows = defaultdict(lambda: defaultdict(list))  # weight buffer -> XCD -> [row offsets]
    gran = {}  # RoPE slabs hold whole heads
    for t in prog.tasks:
        if t.op == Op.GEMV:
            w = t.inputs[0]
            rows[w.buf][xcd[t.id]] += [w.off // w.stride + r for r in range(w.count)]
            gran[w.buf] = t.params.head_dim if t.params.epilogue in (Epilogue.ROPE, Epilogue.ROPE_APPEND) else 1
    for buf, per_xcd in rows.items():
        assert len(per_xcd) == min(8, prog.buffers[buf].shape[0] // gran[buf])  # spread over the XCDs
        spans = sorted((min(r), max(r), len(r)) for r in per_xcd.values())
        for lo, hi, n in spans:
            assert hi - lo + 1 == n  # one contiguous slab per XCD
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # slabs disjoint


@pytest.mark.parametrize("kv_head_counters,partials", [(False, "attn_partial.x0"), (True, "attn_partial.g0")])
def test_xcd_scope_only_inside_one_xcd(tmp_path, kv_head_counters, partials):
    spec, _ = _load("llama2-like", tmp_path)  # 4 KV heads, 4 queues: one head per XCD
    cfg = ScheduleConfig(max_queues=4, kv_head_counters=kv_head_counters)
    prog = lower(spec, cfg, get_target("gfx942"), kv_capacity=64)
    assert validate(prog).accepted
    xcd = _xcd_of_task(prog)
    sides = defaultdict(set)
    for t in prog.tasks:
        sides[t.out_counter].add(xcd[t.id])
        for w in t.waits:
            sides[w.counter].add(xcd[t.id])
    scoped = [c.id for c in prog.counters if c.scope == Scope.XCD]
    assert any(prog.counters[c].name.endswith(partials) for c in scoped)
    assert all(len(sides[c]) == 1 for c in scoped)
    assert all(len(sides[c.id]) > 1 for c in prog.counters if c.scope == Scope.DEVICE)


def test_nvidia_and_opt_out_keep_device_scope(tmp_path):
    spec, _ = _load("llama2-like", tmp_path)
    for target, cfg in (("h100", ScheduleConfig(max_queues=4)), ("gfx942", ScheduleConfig(max_queues=4, xcd_placement=False))):
        prog = lower(spec, cfg, get_target(target), kv_capacity=64)
        assert prog.meta["resolved"]["xcds"] == 1
        assert all(c.scope == Scope.DEVICE for c in prog.counters)
    with pytest.raises(ValueError, match="multi-XCD"):
        lower(spec, ScheduleConfig(xcd_placement=True), get_target("h100"), kv_capacity=64)


@pytest.mark.parametrize("name,target,cfg", [
    ("llama2-like", "gfx942", dict(max_queues=4)),  # XCD-scoped attention edges
    ("qwen3-qknorm", "gfx942", dict(max_queues=16, split_k=2)),
    ("mistral", "gfx950", dict(max_queues=16)),
])
def test_reference_vm_matches_hf_for_amd_targets(name, target, cfg, tmp_path):
    spec, weights = _load(name, tmp_path)
    mk = amk_compile(loaded=(spec, weights), config=ScheduleConfig(**cfg), target=target, kv_capacity=64)
    assert mk.validation.accepted and mk.program.target.arch == target
    assert mk.program.meta["resolved"]["xcds"] > 1
    rng = random.Random(0)
    prompt = [rng.randrange(spec.vocab_size) for _ in range(8)]
    rep = compare(build_hf_model(spec, weights), mk.logits_for, lambda p, n: mk.generate(p, n), prompt,
                  max_new_tokens=8)
    assert rep.logits_max_abs_err <= LOGIT_TOL, rep
    assert rep.greedy_match == 8, rep
