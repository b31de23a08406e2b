"""The validator soundness campaign (`amk fuzz`).

A population of schedules, each judged twice - by the frozen validator (`validate`) and by
the independent execution oracle (`fuzz_oracle.judge`) - and counted per class:

  real              real lowerings: a zoo model x a random ScheduleConfig point (fusions,
                    split_k, kv_splits, kv_block, argmax_splits, SM assignment incl. explicit, quant
                    none/int8/int4, dtype, 2..16 queues, targets); the validator must accept
                    every one
  random-safe       random well-formed programs built safe (fuzz_random)
  random-mutated    the same with random wait/queue/tile edits, some harmless, some not
  <mutant classes>  one injected defect in a real lowering (fuzz_mutants.MUTATORS)

Ground truth is the oracle's: a false accept is oracle-unsafe but accepted (must be 0), a
false reject is oracle-safe but rejected (listed with the validator's checks and reason).

Every schedule is a pure function of (seed, index): the class comes from the index, and
everything random from `random.Random(f"amk-fuzz/{seed}/{index}")`, so a run is the same
for any number of workers and any one schedule can be rebuilt (`make_schedule`). Workers
are spawned processes; each caches the handful of base lowerings it mutates.
"""

from __future__ import annotations

from amk.eval.provenance import cpu_name, git_commit

import json
import os
import platform
import random
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable, Optional

from amk.eval.fuzz_mutants import MUTATORS, Facts
from amk.eval.fuzz_random import random_program

REAL, RANDOM_SAFE, RANDOM_MUTATED = "real", "random-safe", "random-mutated"
MUTANT_CLASSES = tuple(MUTATORS)
CLASSES = (REAL, RANDOM_SAFE, RANDOM_MUTATED) + MUTANT_CLASSES
WEIGHTS = {REAL: 1, RANDOM_SAFE: 1, RANDOM_MUTATED: 2}  # per round of the plan; every mutant class 1
KV_CAPACITY = 32
TARGETS = ("h100", "a100", "mi300x", "l4")

# the base lowerings mutants are made from: every zoo model at each of these points
BASE_CONFIGS: tuple[dict, ...] = (
    dict(max_queues=2),
    dict(max_queues=3, split_k=2),
    dict(max_queues=4, fuse_norm=False, fuse_rope_append=False, fuse_residual=False, fuse_silu_mul=False),
    dict(max_queues=6, quant="int8", quant_group="channel", sm_assignment="round_robin"),
    dict(max_queues=4, quant="int4", quant_group=64, kv_splits=2, kv_block=16),
    dict(max_queues=8, kv_splits=3, kv_block=8, fuse_silu_mul=False, gemv_tasks_per_matrix=2, argmax_splits=3),
    dict(max_queues=5, quant="int8", quant_group=32, split_k=2, fuse_norm=False, quant_lm_head=True),
    dict(max_queues=3, fuse_rope_append=False, fuse_residual=False, sm_assignment="round_robin", blocks_per_sm=2),
    dict(max_queues=4, quant="int8", quant_group=32, quant_asym=True, split_k=2, fuse_silu_mul=False),
    # the LM head's tasks write the argmax pairs (a GEMV's second output) that one MERGE reads
    dict(max_queues=4, fuse_argmax=True, gemv_tasks_per_matrix=3),
)


@dataclass
class Record:
    index: int
    cls: str
    desc: str = ""
    skipped: bool = False  # no site for this injection in any tried base
    accepted: Optional[bool] = None
    checks: tuple[str, ...] = ()
    reason: str = ""  # the validator's first violation
    safe: Optional[bool] = None
    labels: tuple[str, ...] = ()
    witness: str = ""
    exact: Optional[bool] = None
    mode: str = ""
    tasks: int = 0
    seconds: float = 0.0  # generation + validation + oracle, wall clock
    cpu: float = 0.0  # the same in CPU seconds of the worker (load on the machine does not count)
    error: str = ""  # an exception in generation or the oracle


# ----------------------------------------------------------------------------- the population
def plan(classes: Iterable[str]) -> list[str]:
    """One round of classes; schedule i has class plan[i % len(plan)]."""
    classes = list(classes)
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        raise ValueError(f"unknown class(es) {unknown}; known: {', '.join(CLASSES)}")
    return [c for c in CLASSES if c in classes for _ in range(WEIGHTS.get(c, 1))]


def schedule_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"amk-fuzz/{seed}/{index}")


@lru_cache(maxsize=None)
def _specs():
    from amk.schedule.importer import spec_from_hf_config, zoo_configs

    return {name: spec_from_hf_config(cfg, name=name) for name, cfg in zoo_configs().items()}


@lru_cache(maxsize=None)
def _target(name: str):
    from amk.schedule.targets import get_target

    return get_target(name)


def _lower(model: str, cfg: dict, target: str = "h100"):
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.lower import lower

    return lower(_specs()[model], ScheduleConfig(**cfg), _target(target), kv_capacity=KV_CAPACITY)


@lru_cache(maxsize=None)
def base(model: str, cfg_index: int):
    """A cached base lowering and its facts, or None if that point does not lower."""
    try:
        prog = _lower(model, BASE_CONFIGS[cfg_index])
    except ValueError:
        return None
    return prog, Facts(prog)


def random_config(rng: random.Random) -> dict:
    quant = rng.choice(["none", "none", "int8", "int4"])
    cfg = dict(
        max_queues=rng.randint(2, 16),
        gemv_tasks_per_matrix=rng.choice(["auto", "auto", 1, 2, 3, 5]),
        split_k=rng.choice([1, 1, 1, 2, 3, 4]),
        kv_splits=rng.choice(["auto", 1, 2, 3, 4]),
        kv_block=rng.choice([8, 16, 64]),
        argmax_splits=rng.choice(["auto", "auto", 2, 3]),
        sm_assignment=rng.choice(["lpt", "round_robin", "explicit"]),
        blocks_per_sm=rng.choice([1, 1, 2]),
        threads_per_block=rng.choice([128, 256, 512]),
        prefetch_depth=rng.randint(0, 4),
        fuse_norm=rng.random() < 0.5, fuse_rope_append=rng.random() < 0.5,
        fuse_residual=rng.random() < 0.5, fuse_silu_mul=rng.random() < 0.5,
        quant=quant,
        dtype=rng.choice([None, None, "bfloat16", "float16"]),
    )
    if quant != "none":
        groups = [32, 64, 128] + (["channel"] if quant == "int8" and cfg["split_k"] == 1 else [])
        # quant_unpack drawn from 0..3 as when 3 was allowed (now 0..2), so that every later draw
        # of a campaign, and its published figures, stay the same (the validator ignores it)
        cfg.update(quant_group=rng.choice(groups), quant_lm_head=rng.random() < 0.3, quant_unpack=rng.randint(0, 3) % 3)
    cfg["rope_multi_run"] = rng.random() < 0.5  # drawn last, so the draws before it are as they were
    cfg["kv_head_counters"] = rng.random() < 0.5  # likewise
    cfg["fuse_attn_combine"] = rng.random() < 0.5  # likewise
    if quant == "int8":
        cfg["quant_asym"] = rng.random() < 0.5  # likewise (I8 weights with a zero companion)
    # likewise: the o-proj in K slices of KV heads, read with x by the MLP (where the config allows it;
    # a count that does not divide the model's KV heads is a lowering refusal, drawn again)
    slices, on = rng.choice([1, 2, 3, 4]), rng.random() < 0.5
    if on and cfg["split_k"] == 1 and cfg["fuse_norm"] and cfg["fuse_residual"] and not cfg["fuse_attn_combine"]:
        cfg["o_proj_kv_slices"] = slices
    cfg["fuse_argmax"] = rng.random() < 0.5  # likewise (the LM head's tasks write the argmax pairs)
    return cfg


def _real(rng: random.Random):
    models = sorted(_specs())
    last = None
    for _ in range(30):
        model, target, cfg = rng.choice(models), rng.choice(TARGETS), random_config(rng)
        explicit = cfg["sm_assignment"] == "explicit"
        try:
            if explicit:  # the queue of every task: lower once to learn the task and queue counts
                probe = _lower(model, {**cfg, "sm_assignment": "round_robin"}, target)
                nq = probe.meta["resolved"]["queues"]
                cfg = {**cfg, "explicit_queues": [rng.randrange(nq) for _ in probe.tasks]}
            prog = _lower(model, cfg, target)
        except ValueError as exc:  # a point the lowering refuses (e.g. K not divisible by split_k)
            last = exc
            continue
        shown = {k: v for k, v in cfg.items() if k != "explicit_queues"}
        return prog, f"{model} on {target}: {shown}" + (" (explicit queues)" if explicit else "")
    raise RuntimeError(f"no lowerable config in 30 tries: {last}")


def _mutant(cls: str, rng: random.Random):
    fn = MUTATORS[cls]
    models = sorted(_specs())
    for _ in range(12):
        model, ci = rng.choice(models), rng.randrange(len(BASE_CONFIGS))
        b = base(model, ci)
        if b is None:
            continue
        got = fn(b[0], b[1], rng)
        if got is not None:
            return got[0], f"{model} cfg#{ci}: {got[1]}"
    return None


def make_schedule(seed: int, index: int, classes: Iterable[str] = CLASSES):
    """(class, program or None, description): schedule `index` of the campaign `seed`."""
    p = plan(classes)
    cls = p[index % len(p)]
    rng = schedule_rng(seed, index)
    if cls == REAL:
        prog, desc = _real(rng)
    elif cls in (RANDOM_SAFE, RANDOM_MUTATED):
        prog, desc = random_program(rng, perturb=cls == RANDOM_MUTATED)
    else:
        got = _mutant(cls, rng)
        if got is None:
            return cls, None, "no injection site"
        prog, desc = got
    return cls, prog, desc


def run_one(seed: int, index: int, classes: tuple[str, ...]) -> Record:
    from amk.eval.fuzz_oracle import judge
    from amk.schedule.validate import validate

    t0, c0 = time.perf_counter(), time.process_time()
    p = plan(classes)
    rec = Record(index=index, cls=p[index % len(p)])
    try:
        cls, prog, desc = make_schedule(seed, index, classes)
    except Exception as exc:  # noqa: BLE001 - a generator bug is reported, not fatal
        rec.error = f"generation: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        rec.seconds, rec.cpu = time.perf_counter() - t0, time.process_time() - c0
        return rec
    rec.desc = desc
    if prog is None:
        rec.skipped = True
        rec.seconds, rec.cpu = time.perf_counter() - t0, time.process_time() - c0
        return rec
    rec.tasks = len(prog.tasks)
    res = validate(prog)
    rec.accepted = res.accepted
    rec.checks = tuple(sorted({v.check for v in res.violations}))
    rec.reason = res.violations[0].reason if res.violations else ""
    try:
        v = judge(prog, seed=seed * 1_000_003 + index)
    except Exception as exc:  # noqa: BLE001
        rec.error = f"oracle: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    else:
        rec.safe, rec.labels, rec.witness, rec.exact, rec.mode = v.safe, v.labels, v.witness, v.exact, v.mode
    rec.seconds, rec.cpu = time.perf_counter() - t0, time.process_time() - c0
    return rec


def _run_chunk(seed: int, indices: list[int], classes: tuple[str, ...]) -> list[Record]:
    return [run_one(seed, i, classes) for i in indices]


def _warm() -> None:
    import amk.eval.fuzz_oracle  # noqa: F401
    import amk.schedule.lower  # noqa: F401
    import amk.schedule.validate  # noqa: F401

    _specs()


def run_campaign(schedules: int, seed: int = 0, classes: Iterable[str] = CLASSES, workers: int = 1,
                 progress: Optional[Callable[[int], None]] = None) -> tuple[list[Record], float]:
    """Every record (in index order) and the wall-clock seconds the campaign took."""
    classes = tuple(c for c in CLASSES if c in set(classes))
    plan(classes)  # fail early on unknown classes
    t0 = time.perf_counter()
    records: list[Record] = []
    if workers <= 1:
        _warm()
        for i in range(schedules):
            records.append(run_one(seed, i, classes))
            if progress:
                progress(1)
    else:
        chunk = max(4, min(64, schedules // (workers * 16) or 1))
        chunks = [list(range(s, min(s + chunk, schedules))) for s in range(0, schedules, chunk)]
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_warm) as pool:
            futs = {pool.submit(_run_chunk, seed, c, classes): len(c) for c in chunks}
            for f in as_completed(futs):
                records += f.result()
                if progress:
                    progress(futs[f])
        records.sort(key=lambda r: r.index)
    return records, time.perf_counter() - t0


# ----------------------------------------------------------------------------- the report
def summarize(records: list[Record], classes: Iterable[str]) -> dict:
    rows = {}
    for cls in [c for c in CLASSES if c in set(classes)]:
        rs = [r for r in records if r.cls == cls]
        judged = [r for r in rs if not r.skipped and not r.error]
        secs = sum(r.cpu for r in rs)
        fa = [r for r in judged if r.safe is False and r.accepted]
        fr = [r for r in judged if r.safe is True and not r.accepted]
        by_checks: dict[str, int] = {}
        for r in fr:
            key = ",".join(r.checks)
            by_checks[key] = by_checks.get(key, 0) + 1
        labels: dict[str, int] = {}
        for r in judged:
            for lab in r.labels:
                labels[lab] = labels.get(lab, 0) + 1
        rows[cls] = {
            "generated": len(judged),
            "skipped": sum(r.skipped for r in rs),
            "errors": sum(bool(r.error) for r in rs),
            "oracle_unsafe": sum(r.safe is False for r in judged),
            "rejected": sum(r.accepted is False for r in judged),
            "false_accepts": len(fa),
            "false_rejects": len(fr),
            "false_rejects_by_checks": dict(sorted(by_checks.items(), key=lambda kv: -kv[1])),
            "oracle_exact": sum(bool(r.exact) for r in judged),
            "oracle_modes": _count(r.mode for r in judged),
            "oracle_labels": dict(sorted(labels.items())),
            "mean_tasks": round(sum(r.tasks for r in judged) / max(len(judged), 1), 1),
            "schedules_per_second_per_core": round(len(rs) / secs, 2) if secs else None,
        }
    return rows


def _count(xs: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def _machine(workers: int) -> dict:
    cpu = cpu_name()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores_allowed": allowed, "workers": workers, "python": platform.python_version(),
            "platform": platform.platform()}


def report(records: list[Record], wall: float, *, command: str, seed: int, classes: Iterable[str], workers: int) -> dict:
    classes = [c for c in CLASSES if c in set(classes)]
    rows = summarize(records, classes)
    judged = [r for r in records if not r.skipped and not r.error]
    fa = [r for r in judged if r.safe is False and r.accepted]
    fr = [r for r in judged if r.safe is True and not r.accepted]
    real_rejected = [r for r in judged if r.cls == REAL and not r.accepted]
    unsafe_classes = [c for c in MUTANT_CLASSES if c in rows]
    cpu = sum(r.cpu for r in records)
    return {
        "command": command,
        "commit": git_commit(),
        "machine": _machine(workers),
        "seed": seed,
        "schedules": len(records),
        "wall_seconds": round(wall, 2),
        "schedules_per_second": round(len(records) / wall, 2) if wall else None,
        "cpu_seconds": round(cpu, 2),
        "schedules_per_cpu_second": round(len(records) / cpu, 2) if cpu else None,
        "totals": {
            "judged": len(judged),
            "oracle_unsafe": sum(r.safe is False for r in judged),
            "rejected": sum(r.accepted is False for r in judged),
            "false_accepts": len(fa),
            "false_rejects": len(fr),
            "real_rejected": len(real_rejected),
            "errors": sum(bool(r.error) for r in records),
            "skipped": sum(r.skipped for r in records),
            "unsafe_classes": len(unsafe_classes),
            "unsafe_classes_with_1000": sum(rows[c]["generated"] >= 1000 for c in unsafe_classes),
        },
        "classes": rows,
        "false_accepts": [_entry(r, seed) for r in fa],
        "real_rejected": [_entry(r, seed) for r in real_rejected],
        "false_rejects": [_entry(r, seed) for r in fr],
        "errors": [{"index": r.index, "class": r.cls, "error": r.error} for r in records if r.error][:50],
    }


def _entry(r: Record, seed: int) -> dict:
    return {"index": r.index, "class": r.cls, "checks": list(r.checks), "reason": r.reason, "labels": list(r.labels),
            "witness": r.witness, "oracle_mode": r.mode, "oracle_exact": r.exact, "desc": r.desc,
            "replay": f"amk fuzz --seed {seed} --replay {r.index}"}


# Why a rule may reject a program the oracle finds safe (the 'every false reject explained' list)
CONSERVATIVE_RULES = {
    "partial-wait": "a counter with several producers must be waited on in full (DESIGN invariant 2). A partial wait "
                    "is safe only when queue order happens to order the missing producers; the validator does not "
                    "credit that, and it stops propagating that counter's happens-before, which is why race checks "
                    "fire beside it.",
    "self-wait": "a task may not wait on its own out_counter, even when its siblings alone could satisfy the threshold.",
    "dataflow-cycle": "the producer->consumer graph must be acyclic counting every producer of a counter, even where a "
                      "partial threshold could be met without the task on the cycle.",
    "queue-order-deadlock": "data + queue-order edges must be acyclic counting every producer, as above.",
    "threshold": "thresholds start at 1: a wait for 0 is always met, so it orders nothing and is a lowering bug.",
    "tile-overlap": "tiles of one producer set must be disjoint, even where queue order serialises the overlapping "
                    "tasks (the later write wins deterministically, but the result depends on placement).",
    "tile-gap": "tiles of one producer set must leave no gap, even where the gap is never read.",
    "read-after-write": "reported beside a partial wait, whose happens-before the validator does not credit.",
    "write-after-read": "reported beside a partial wait, as above.",
    "write-after-write": "reported beside a partial wait, as above.",
    "kv-read-before-append": "reported beside a partial wait, as above.",
}


def markdown(doc: dict) -> str:
    t = doc["totals"]
    m = doc["machine"]
    lines = [
        "# Validator soundness campaign",
        "",
        f"Command: `{doc['command']}` (commit {doc['commit'][:12]}, {m['cpu']}, {m['workers']} worker(s) on "
        f"{m['cores_allowed']} allowed core(s), Python {m['python']})",
        "",
        f"{doc['schedules']} schedules in {doc['wall_seconds']:.1f} s ({doc['schedules_per_second']:.1f} schedules/s; "
        f"{doc['schedules_per_cpu_second']:.1f} per CPU second of a worker); "
        f"**{t['false_accepts']} false accepts**, {t['false_rejects']} false rejects, {t['real_rejected']} real "
        f"lowerings rejected, {t['errors']} errors; {t['unsafe_classes_with_1000']} of {t['unsafe_classes']} injected "
        "classes with >= 1000 mutants.",
        "",
        "Ground truth is the execution oracle (`amk.eval.fuzz_oracle`): false accept = oracle-unsafe but accepted, "
        "false reject = oracle-safe but rejected. *exact* = the oracle's verdict covers every interleaving "
        "(deterministic happens-before or exhaustive search); otherwise it sampled schedules.",
        "",
        "| class | generated | oracle-unsafe | rejected | false accepts | false rejects | oracle exact | sched/CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cls, r in doc["classes"].items():
        rate = r["schedules_per_second_per_core"]
        lines.append(f"| {cls} | {r['generated']} | {r['oracle_unsafe']} | {r['rejected']} | {r['false_accepts']} | "
                     f"{r['false_rejects']} | {r['oracle_exact']} | {rate if rate is not None else '-'} |")
    fr = [(cls, k, n) for cls, r in doc["classes"].items() for k, n in r["false_rejects_by_checks"].items()]
    if fr:
        lines += ["", "## False rejects by the validator checks that fired", "",
                  "| class | checks | count | example |", "|---|---|---:|---|"]
        for cls, k, n in fr:
            ex = next(e for e in doc["false_rejects"] if e["class"] == cls and ",".join(e["checks"]) == k)
            lines.append(f"| {cls} | {k} | {n} | #{ex['index']}: {ex['desc'][:90]} — {ex['reason'][:120]} |")
        fired = sorted({c for _, k, _ in fr for c in k.split(",")})
        lines += ["", "## Why these are rejected on purpose", "",
                  "Every false reject comes from a rule that is deliberately stricter than execution requires, so that "
                  "a program's safety never depends on an accident of placement:", ""]
        lines += [f"- `{c}`: {CONSERVATIVE_RULES.get(c, 'see the violation reasons above')}" for c in fired]
    for title, key in (("False accepts", "false_accepts"), ("Real lowerings rejected", "real_rejected")):
        if doc[key]:
            lines += ["", f"## {title}", ""]
            lines += [f"- #{e['index']} ({e['class']}): {e['desc']} — oracle: {e['witness']} — `{e['replay']}`" for e in doc[key]]
    return "\n".join(lines) + "\n"


def write_report(doc: dict, out: Path) -> Path:
    from amk.commands.common import write_atomic

    write_atomic(out, json.dumps(doc, indent=1) + "\n")
    md = out.with_suffix(".md")
    write_atomic(md, markdown(doc))
    return md


def dump_false_accepts(doc: dict, out: Path, seed: int, classes: Iterable[str]) -> list[Path]:
    """The program of every false accept beside the report, to reproduce it."""
    paths = []
    for e in doc["false_accepts"]:
        _, prog, _ = make_schedule(seed, e["index"], classes)
        p = out.parent / f"{out.stem}_false_accepts" / f"{e['index']}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(prog.to_json(indent=1))
        paths.append(p)
    return paths


if __name__ == "__main__":  # python -m amk.eval.fuzz [args]: the same as `amk fuzz`
    import typer

    from amk.commands.fuzz_cmd import fuzz_command

    typer.run(fuzz_command)
    sys.exit(0)
