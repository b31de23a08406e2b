"""Per-task device trace of one megakernel decode step (Llama-3.2-1B shape, bf16).

    python3 -m amk.eval.trace_step [--shape llama-3.2-1b] [--ctx 1024] [--out DIR]

Builds the shape with random weights, fills `ctx` positions with ordinary steps, then runs
one step with a CudaVM built with -DAMK_TRACE (globaltimer at wait start, wait met and op
done per task) and prints per op / per task kind: summed and max op time, summed wait
time, the per-queue gaps (record copy + prefetch), and the critical path, walked back from
the last task to finish. Writes trace_step.json to $OUT (or --out), and trace_raw.npz: the
reported step's table itself (`raw_trace`: per task its columns in ns from the step's first
wait, its kind, queue and place in the queue), for questions the summary does not answer
(e.g. how far apart one stage's tasks finish).

    python3 -m amk.eval.trace_step --compare BEFORE/trace_step.json AFTER/trace_step.json

prints two such traces side by side (no GPU needed): per task kind the in-op phases and
the critical path's op and hop time, "before -> after".

    python3 -m amk.eval.trace_step --contention DIR/trace_raw.npz
    python3 -m amk.eval.trace_step --rows-phase DIR/trace_raw.npz --shape S --ctx N [--config F]
    python3 -m amk.eval.trace_step --hops DIR/trace_raw.npz --shape S --ctx N [--config F]

print, per task kind, the time from its rows-done mark to body done by how many other tasks
of its stage were still streaming then (`contention`), and the rows phase by the rows of the
task (`rows_phase`, the program lowered again on the CPU), and per stage edge how long after
its last producer the consumers' waits were met (`hops`); no GPU needed.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from amk.commands.common import write_atomic


# The trace table's columns (instructions/common.cuh): wait start, wait met, op done, three
# phase marks, then body done (AMK_TRACE_BODY_DONE; older traces stop before it).
BODY_DONE_COL = 6


def task_kind(t) -> str:
    op = str(getattr(t.op, "value", t.op))
    name = re.sub(r"\d+", "#", t.name or "")
    return f"{op}:{name}" if name else op


def queue_order(program) -> list[list[int]]:
    """Each queue's tasks as indices into program.tasks, in queue order."""
    index = {t.id: i for i, t in enumerate(program.tasks)}
    return [[index[tid if isinstance(tid, int) else tid.id] for tid in getattr(queue, "tasks", queue)]
            for queue in program.queues]


def analyse(program, tr: np.ndarray) -> dict:
    tasks = program.tasks
    raw = tr.astype(np.int64)
    t0 = int(raw[:, 0].min())
    tr = raw - t0
    ws, wm, dn = tr[:, 0], tr[:, 1], tr[:, 2]
    marks = [np.where(raw[:, c] > 0, tr[:, c], -1) for c in range(3, min(BODY_DONE_COL, raw.shape[1]))]  # -1: none
    # body done (before the counter release), where the trace has the column
    body = np.where(raw[:, BODY_DONE_COL] > 0, tr[:, BODY_DONE_COL], -1) if raw.shape[1] > BODY_DONE_COL else None
    producers = defaultdict(list)
    for i, t in enumerate(tasks):
        producers[t.out_counter].append(i)
    prev = {}
    qpos = {}
    for q, order in enumerate(queue_order(program)):
        last = None
        for k, i in enumerate(order):
            prev[i] = last
            qpos[i] = (q, k)
            last = i
    per = defaultdict(lambda: {"n": 0, "op_sum_us": 0.0, "op_max_us": 0.0, "wait_sum_us": 0.0, "gap_sum_us": 0.0,
                               "release_sum_us": 0.0})
    for i, t in enumerate(tasks):
        d = per[task_kind(t)]
        d["n"] += 1
        if body is not None and body[i] >= wm[i]:
            d["release_sum_us"] += (dn[i] - body[i]) / 1e3
        op_us = (dn[i] - wm[i]) / 1e3
        d["op_sum_us"] += op_us
        d["op_max_us"] = max(d["op_max_us"], op_us)
        d["wait_sum_us"] += (wm[i] - ws[i]) / 1e3
        if prev[i] is not None:
            d["gap_sum_us"] += (ws[i] - dn[prev[i]]) / 1e3
        else:
            d["gap_sum_us"] += ws[i] / 1e3
    # in-op phases (the ops' trace marks): wait met -> mark 0 -> mark 1 -> ... -> op done
    phases = defaultdict(lambda: defaultdict(float))
    for i, t in enumerate(tasks):
        prev_t, segs = wm[i], []
        for m in marks:
            if m[i] < prev_t:
                break
            segs.append(m[i] - prev_t)
            prev_t = m[i]
        if not segs:
            continue
        segs.append(dn[i] - prev_t)
        d = phases[task_kind(t)]
        d["n"] += 1
        for k, v in enumerate(segs):
            d[f"phase{k}_us"] += v / 1e3
    phases = {k: {n: (v / d["n"] if n != "n" else v) for n, v in d.items()} for k, d in phases.items()}
    # critical path: from the last finisher, step to whichever finished last among the
    # queue predecessor and the producers of the awaited counters
    cur = int(np.argmax(dn))
    path = []
    while cur is not None:
        path.append(cur)
        t = tasks[cur]
        cands = []
        if prev[cur] is not None:
            cands.append(prev[cur])
        for w in t.waits:
            for p in producers.get(w.counter, []):
                if dn[p] <= wm[cur] + 2000:  # finished before this one could go (+ timer slack)
                    cands.append(p)
        cands = [c for c in cands if dn[c] <= wm[cur] + 2000]
        cur = max(cands, key=lambda c: dn[c]) if cands else None
    path.reverse()
    cp = defaultdict(lambda: {"n": 0, "op_us": 0.0, "wait_us": 0.0, "hop_us": 0.0})
    cp_rows = []
    for a, i in enumerate(path):
        k = task_kind(tasks[i])
        cp[k]["n"] += 1
        cp[k]["op_us"] += (dn[i] - wm[i]) / 1e3
        before = dn[path[a - 1]] if a else 0
        cp[k]["hop_us"] += (wm[i] - before) / 1e3  # from the enabling finish to this one's go
        cp_rows.append({"task": tasks[i].id, "kind": k, "queue": qpos[i][0], "qpos": qpos[i][1],
                        "ws_us": ws[i] / 1e3, "wm_us": wm[i] / 1e3, "done_us": dn[i] / 1e3})
    return {"step_us": float(dn.max() / 1e3), "ntasks": len(tasks), "nqueues": len(program.queues),
            "per_kind": {k: dict(v) for k, v in per.items()}, "phases": phases,
            "critical_path": {"len": len(path), "by_kind": {k: dict(v) for k, v in cp.items()}, "rows": cp_rows},
            "queue_busy_us": {"op_total": float((dn - wm).sum() / 1e3), "wait_total": float((wm - ws).sum() / 1e3)}}


def raw_trace(program, tr: np.ndarray) -> dict[str, np.ndarray]:
    """The trace table as arrays: `trace` [ntasks, cols] int64 ns from the step's first wait
    start (0 where a mark column was not written), and per task `kind`, `queue`, `qpos`."""
    raw = tr.astype(np.int64)
    t0 = int(raw[:, 0].min())
    rebased = np.where(raw > 0, raw - t0, 0)
    queue = np.full(len(program.tasks), -1, dtype=np.int32)
    qpos = np.full(len(program.tasks), -1, dtype=np.int32)
    for q, order in enumerate(queue_order(program)):
        for k, i in enumerate(order):
            queue[i], qpos[i] = q, k
    return {"trace": rebased, "kind": np.array([task_kind(t) for t in program.tasks]), "queue": queue, "qpos": qpos}


# "how many other tasks of its stage still streamed" buckets of `contention`
CONTENTION_BUCKETS = ((0, 0), (1, 10), (11, 40), (41, 1 << 30))


# trace columns of phase marks 0 and 1 (a GEMV's prologue done, rows done)
MARK0_COL, MARK1_COL = 3, 4


def contention(raw: dict[str, np.ndarray]) -> dict[str, list[tuple[str, int, float]]]:
    """Per task kind with phase mark 1 (a GEMV's rows done): the mean time from that mark to
    body done, in us, by how many other tasks of the same stage instance (a run of consecutive
    tasks of the kind, in task order) were still between their marks 0 and 1 at that moment:
    [(bucket, tasks, mean us)]. Shows whether a phase is slow only while the rest of the chip
    streams (eval/PERF_NOTES.md item 100)."""
    tr, kinds = raw["trace"].astype(np.float64) / 1e3, raw["kind"]
    col, prev = MARK1_COL, MARK0_COL
    out: dict[str, list[tuple[str, int, float]]] = {}
    start = 0
    groups: dict[str, list[np.ndarray]] = defaultdict(list)
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            g = np.arange(start, i)
            g = g[tr[g, col] > 0]  # tasks that recorded the mark
            if len(g):
                groups[str(kinds[start])].append(g)
            start = i
    for kind, runs in groups.items():
        busy, tail = [], []
        for g in runs:
            at = tr[g, col]
            busy += [int(np.sum((tr[g, prev] < t) & (at > t))) for t in at]
            tail += list(tr[g, BODY_DONE_COL] - at)
        busy_a, tail_a = np.array(busy), np.array(tail)
        rows = []
        for lo, hi in CONTENTION_BUCKETS:
            sel = (busy_a >= lo) & (busy_a <= hi)
            if sel.any():
                rows.append((f"{lo}" if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}",
                             int(sel.sum()), float(tail_a[sel].mean())))
        out[kind] = rows
    return out


def rows_phase(raw: dict[str, np.ndarray], program) -> dict[tuple[str, int], tuple[int, float]]:
    """The GEMV rows phase (marks 0 -> 1) per (task kind, rows of the task): (tasks, mean us).
    `program` is the traced one (the same tasks in the same order, e.g. lowered again on the
    CPU: `--rows-phase`); a task whose phase is unmarked is left out."""
    _same_tasks(raw, program)
    kinds = raw["kind"]
    tr = raw["trace"].astype(np.float64) / 1e3
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for i, t in enumerate(program.tasks):
        if getattr(t.params, "rows", None) is not None and tr[i, MARK0_COL] > 0 and tr[i, MARK1_COL] > 0:
            groups[(str(kinds[i]), int(t.params.rows))].append(tr[i, MARK1_COL] - tr[i, MARK0_COL])
    return {k: (len(v), float(np.mean(v))) for k, v in groups.items()}


def _same_tasks(raw: dict[str, np.ndarray], program) -> None:
    kinds = raw["kind"]
    if len(program.tasks) != len(kinds) or any(task_kind(t) != k for t, k in zip(program.tasks, kinds)):
        raise ValueError("the program's tasks are not the traced ones (shape, ctx or config differ)")


def hops(raw: dict[str, np.ndarray], program) -> dict:
    """What a hop between stages is made of (eval/PERF_NOTES.md items 103-104). For each
    consumer, its binding wait is the counter whose last producer finished its body last; per
    edge (that counter's name with numbers as '#', the consumer's kind):
    - `met_us`: median and p90 of wait met minus that last body done, over all consumers;
    - `late`: the share of consumers that began waiting only after it (their own previous task
      was still running or releasing: the poll back-off played no part in their hop);
    - `met_early_us` / `met_late_us`: the median of `met_us` over the consumers that were
      polling already (their hop is the signal's way to a poller, back-off included) and over
      the late ones (their turnover and first poll); None where there are none;
    - `last_met_us` / `last_late`: the same for the consumer that finished last at each counter
      (the one that carries the stage's critical path), mean and share;
    and `turnover_us`: median, p10 and p90 of a task's wait start minus its queue predecessor's
    op done (its release included), over all tasks that have one. `program`: the traced one."""
    _same_tasks(raw, program)
    tr = raw["trace"].astype(np.float64) / 1e3
    has_body = tr.shape[1] > BODY_DONE_COL
    body = tr[:, BODY_DONE_COL] if has_body else tr[:, 2]
    recorded = body > 0
    names = {c.id: re.sub(r"\d+", "#", c.name or str(c.id)) for c in program.counters}
    last_done: dict[int, float] = {}
    for i, t in enumerate(program.tasks):
        if recorded[i]:
            last_done[t.out_counter] = max(last_done.get(t.out_counter, -1.0), body[i])
    met: dict[tuple[str, str], list[float]] = defaultdict(list)
    late: dict[tuple[str, str], list[bool]] = defaultdict(list)
    by_counter: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, t in enumerate(program.tasks):
        waits = [w.counter for w in t.waits if w.counter in last_done]
        if not recorded[i] or not waits:
            continue
        c = max(waits, key=lambda w: last_done[w])
        key = (names[c], task_kind(t))
        met[key].append(tr[i, 1] - last_done[c])
        late[key].append(bool(tr[i, 0] > last_done[c]))
        by_counter[(c, key[1])].append(i)
    last_met: dict[tuple[str, str], list[float]] = defaultdict(list)
    last_late: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for (c, kind), members in by_counter.items():
        j = max(members, key=lambda i: body[i])
        last_met[(names[c], kind)].append(tr[j, 1] - last_done[c])
        last_late[(names[c], kind)].append(bool(tr[j, 0] > last_done[c]))
    def median_where(v: list[float], flags: list[bool], want: bool) -> Optional[float]:
        picked = [x for x, f in zip(v, flags) if f == want]
        return float(np.median(picked)) if picked else None

    edges = {k: {"n": len(v), "met_us": (float(np.median(v)), float(np.percentile(v, 90))),
                 "late": float(np.mean(late[k])), "last_met_us": float(np.mean(last_met[k])),
                 "last_late": float(np.mean(last_late[k])),
                 "met_early_us": median_where(v, late[k], False), "met_late_us": median_where(v, late[k], True)}
             for k, v in met.items()}
    turnover = []
    for order in queue_order(program):
        for prev, i in zip(order, order[1:]):
            if recorded[prev] and recorded[i]:
                turnover.append(tr[i, 0] - tr[prev, 2])
    return {"edges": edges, "turnover_us": tuple(float(x) for x in np.percentile(turnover, [50, 10, 90]))
            if turnover else None}


def load_raw(path: str) -> dict[str, np.ndarray]:
    """A trace_raw.npz (what `raw_trace` returned) as its arrays; no pickles."""
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def median_step(path: str) -> dict:
    """The median-length traced step of a trace_step.json (the one main() reports)."""
    with open(path) as f:
        steps = json.load(f)["steps"]
    return sorted(steps, key=lambda r: r["step_us"])[len(steps) // 2]


def compare(a: dict, b: dict) -> list[str]:
    """Lines of `analyse` results a (before) and b (after) side by side, per task kind."""
    def pair(x, y):
        return f"{x:8.2f} -> {y:8.2f}"

    lines = [f"step us: {pair(a['step_us'], b['step_us'])}", "in-op phases, mean us:"]
    for k in sorted(set(a["phases"]) | set(b["phases"])):
        pa, pb = a["phases"].get(k, {}), b["phases"].get(k, {})
        names = sorted(n for n in set(pa) | set(pb) if n != "n")
        lines.append(f"  {k[:44]:44s} " + " | ".join(pair(pa.get(n, 0.0), pb.get(n, 0.0)) for n in names))
    ra, rb = a["per_kind"], b["per_kind"]
    if any(v.get("release_sum_us") for v in list(ra.values()) + list(rb.values())):
        lines.append("counter release (op done - body done), mean us:")

        def rel(d, k):
            v = d.get(k)
            return v.get("release_sum_us", 0.0) / v["n"] if v else 0.0

        for k in sorted(set(ra) | set(rb)):
            lines.append(f"  {k[:44]:44s} {pair(rel(ra, k), rel(rb, k))}")
    lines.append("critical path, us (n before/after: op, hop):")
    ca, cb = a["critical_path"]["by_kind"], b["critical_path"]["by_kind"]
    for k in sorted(set(ca) | set(cb)):
        x, y = ca.get(k, {"n": 0, "op_us": 0.0, "hop_us": 0.0}), cb.get(k, {"n": 0, "op_us": 0.0, "hop_us": 0.0})
        lines.append(f"  {k[:44]:44s} n {x['n']:3d}/{y['n']:3d}  op {pair(x['op_us'], y['op_us'])}  "
                     f"hop {pair(x['hop_us'], y['hop_us'])}")
    return lines


def export_defines(defines: list[str]) -> None:
    """--define NAME=VALUE ... merged into $AMK_VM_DEFINES (these win), as `amk bench` takes
    experiments: the loader then applies them to the build and to what it derives from them
    (shared-memory sizes, packed layout fields), not to the NVRTC build alone."""
    from amk.vm.loader import experiment_defines, parse_defines

    merged = {**experiment_defines(), **parse_defines(",".join(defines), "--define")}
    os.environ["AMK_VM_DEFINES"] = ",".join(f"{k}={v}" for k, v in merged.items())


# KV positions a traced program holds beyond the filled context (room for the traced steps);
# the --rows-phase / --hops programs, lowered again, use it too so that their tasks match
EXTRA_CAPACITY = 76


def _config(config_path):
    if not config_path:
        return None
    from amk.schedule.config import ScheduleConfig

    return ScheduleConfig.model_validate_json(open(config_path).read())


def _shape_spec(shape: str):
    """The bf16 ModelSpec of a shape name (eval/shapes.py), as the traced models are built."""
    from amk.eval.shapes import shape_config
    from amk.schedule.importer import spec_from_hf_config

    return spec_from_hf_config(shape_config(shape), name=shape, dtype="bfloat16")


def shape_program(shape: str, ctx: int, config_path, extra_capacity: int, target: str = "h100"):
    """The program `shape_vm` traces, lowered on the CPU (no weights) for `target`."""
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.lower import lower
    from amk.schedule.targets import get_target

    cfg = _config(config_path) or ScheduleConfig()
    if cfg.dtype is None:
        cfg = cfg.model_copy(update={"dtype": "bfloat16"})
    return lower(_shape_spec(shape), cfg, get_target(target), kv_capacity=ctx + extra_capacity)


def shape_vm(shape: str, ctx: int, config_path, extra_capacity: int, **vm_kwargs):
    """(compiled model, CudaVM) of a shape-only model in bf16 with random weights on the GPU,
    its KV cache filled by real steps at positions 0 .. ctx-1, so the next step runs at ctx:
    what the diagnostics (this trace, eval/ncu_step.py) look at. Prints how long each took."""
    import amk.api
    from amk.eval.shapes import random_weights_like
    from amk.vm.loader import CudaVM

    spec = _shape_spec(shape)
    weights = random_weights_like(spec, "cuda", "bfloat16", 0)
    mk = amk.api.compile(loaded=(spec, weights), config=_config(config_path), dtype="bfloat16",
                         kv_capacity=ctx + extra_capacity)
    t = time.time()
    vm = CudaVM(mk.program, mk.tensors, device="cuda", validation=mk.validation, **vm_kwargs)
    print(f"built the VM in {time.time() - t:.1f}s; {len(mk.program.tasks)} tasks on {len(mk.program.queues)} queues")
    t = time.time()
    for pos in range(ctx):
        evs = vm._launch(pos % 1000 + 1, pos)
        if pos % 64 == 63:
            vm._finish([evs])
    vm._finish([evs])
    print(f"filled {ctx} positions in {time.time() - t:.1f}s")
    return mk, vm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="print two trace_step.json files side by side and exit (no GPU needed)")
    ap.add_argument("--contention", metavar="RAW", default=None,
                    help="a trace_raw.npz: per task kind, the time from its rows-done mark to body done by how many "
                    "other tasks of its stage were still streaming (no GPU needed)")
    ap.add_argument("--rows-phase", metavar="RAW", default=None,
                    help="a trace_raw.npz of --shape/--ctx/--config: the GEMV rows phase per task kind and rows "
                    "of the task (the program lowered again on the CPU for an H100; no GPU needed)")
    ap.add_argument("--hops", metavar="RAW", default=None,
                    help="a trace_raw.npz of --shape/--ctx/--config: per stage edge, how long after its last "
                    "producer the consumers' waits were met, and how many began waiting only after it (no GPU needed)")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="traced steps (the median-length one is reported)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prefetch-depth", type=int, default=None)
    ap.add_argument("--define", action="append", default=[],
                    help="experiment define AMK_NAME=INT, added to $AMK_VM_DEFINES (repeatable)")
    ap.add_argument("--config", default=None, help="a ScheduleConfig JSON file (e.g. eval/configs/int8_g128.json)")
    a = ap.parse_args()
    if a.compare:
        print("\n".join(compare(*map(median_step, a.compare))))
        return
    if a.rows_phase:
        raw = load_raw(a.rows_phase)
        print("GEMV rows phase (prologue done -> rows done), mean us, by task kind and rows:")
        phases = rows_phase(raw, shape_program(a.shape, a.ctx, a.config, EXTRA_CAPACITY))
        for (kind, rows), (n, us) in sorted(phases.items()):
            print(f"  {kind[:44]:44s} rows {rows:6d}  n={n:6d}  {us:9.2f}")
        return
    if a.hops:
        h = hops(load_raw(a.hops), shape_program(a.shape, a.ctx, a.config, EXTRA_CAPACITY))
        if h["turnover_us"]:
            print("turnover (queue predecessor released -> wait start), us: median %.2f, p10 %.2f, p90 %.2f"
                  % h["turnover_us"])
        print("wait met after the counter's last producer, us (median | p90 | share of late starters); "
              "the median of the consumers polling already | of the late ones; "
              "the consumer that finished last (mean | late share):")
        us = lambda x: "    -" if x is None else f"{x:5.2f}"  # noqa: E731
        for (counter, kind), e in sorted(h["edges"].items()):
            print(f"  {counter[:28]:28s} -> {kind[:40]:40s} n={e['n']:6d}  {e['met_us'][0]:5.2f} | "
                  f"{e['met_us'][1]:5.2f} | {e['late']:4.2f}   early {us(e['met_early_us'])} | late "
                  f"{us(e['met_late_us'])}   last {e['last_met_us']:5.2f} | {e['last_late']:4.2f}")
        return
    if a.contention:
        raw = load_raw(a.contention)
        print("after the rows-done mark until body done, mean us, by other tasks of the stage still streaming:")
        for kind, rows in sorted(contention(raw).items()):
            print(f"  {kind[:44]:44s} " + "  ".join(f"[{b}] n={n} {us:.2f}" for b, n, us in rows))
        return
    if a.define:
        export_defines(a.define)
    name = a.shape
    mk, vm = shape_vm(name, a.ctx, a.config, EXTRA_CAPACITY, trace=True, prefetch_depth=a.prefetch_depth)
    results, tables = [], []
    for s in range(a.steps):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        vm.run_step(7, a.ctx + s)
        en.record()
        torch.cuda.synchronize()
        table = vm.trace().numpy()
        r = analyse(mk.program, table)
        r["event_ms"] = st.elapsed_time(en)
        results.append(r)
        tables.append(table)
        print(f"traced step {s}: event {r['event_ms']:.2f} ms, trace span {r['step_us']:.0f} us")
    median = sorted(range(len(results)), key=lambda i: results[i]["step_us"])[len(results) // 2]
    r = results[median]
    print(f"\nstep {r['step_us']:.0f} us, {r['ntasks']} tasks, {r['nqueues']} queues; "
          f"sum op {r['queue_busy_us']['op_total']:.0f} us, sum wait {r['queue_busy_us']['wait_total']:.0f} us")
    print(f"{'kind':44s} {'n':>5s} {'op_sum':>9s} {'op_avg':>8s} {'op_max':>8s} {'wait_sum':>9s} {'gap_sum':>9s} "
          f"{'release_avg':>11s}")
    for k, v in sorted(r["per_kind"].items(), key=lambda kv: -kv[1]["op_sum_us"]):
        print(f"{k[:44]:44s} {v['n']:5d} {v['op_sum_us']:9.0f} {v['op_sum_us'] / v['n']:8.1f} {v['op_max_us']:8.1f} "
              f"{v['wait_sum_us']:9.0f} {v['gap_sum_us']:9.0f} {v.get('release_sum_us', 0.0) / v['n']:11.2f}")
    print("\nin-op phases, mean us (GEMV: prologue | rows | epilogue+signal; attention partial: q+pos | "
          "scores | P.V | store+signal; combine: (m,l) | weights | outputs+signal; argmax: scan | warps | "
          "final+signal):")
    for k, v in sorted(r["phases"].items(), key=lambda kv: kv[0]):
        segs = " | ".join(f"{v[f'phase{j}_us']:6.2f}" for j in range(4) if f"phase{j}_us" in v)
        print(f"  {k[:44]:44s} n={int(v['n']):5d}  {segs}")
    cp = r["critical_path"]
    print(f"\ncritical path: {cp['len']} tasks")
    print(f"{'kind':44s} {'n':>5s} {'op_us':>9s} {'hop_us':>9s}")
    for k, v in sorted(cp["by_kind"].items(), key=lambda kv: -(kv[1]["op_us"] + kv[1]["hop_us"])):
        print(f"{k[:44]:44s} {v['n']:5d} {v['op_us']:9.0f} {v['hop_us']:9.0f}")
    print("first 40 critical-path rows:")
    for row in cp["rows"][:40]:
        print(f"  q{row['queue']:3d}#{row['qpos']:3d} {row['kind'][:40]:40s} ws {row['ws_us']:8.1f} wm {row['wm_us']:8.1f} done {row['done_us']:8.1f}")
    os.makedirs(a.out, exist_ok=True)
    write_atomic(Path(a.out) / "trace_step.json", json.dumps({"shape": name, "ctx": a.ctx, "steps": results}))
    buf = io.BytesIO()
    np.savez_compressed(buf, **raw_trace(mk.program, tables[median]))
    write_atomic(Path(a.out) / "trace_raw.npz", buf.getvalue())
    print("wrote", os.path.join(a.out, "trace_step.json"))


if __name__ == "__main__":
    main()
