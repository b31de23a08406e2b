"""`program_stats`: what a lowered Program costs, for meta, reports and the autotuner."""

from __future__ import annotations

import re
from typing import Optional

from amk.schedule.ir import DTYPE_BITS, Buffer, BufferKind, Op, Program
from amk.schedule.targets import TARGETS

_LAYER = re.compile(r"^layers\.(\d+)\.")


def buffer_bytes(b: Buffer) -> int:
    return b.numel * DTYPE_BITS[b.dtype] // 8


def program_stats(program: Program) -> dict:
    """Task counts per op, counters, cross-SM hops per layer, weight bytes, bandwidth floor."""
    tasks = program.tasks
    ops = [t.params.op for t in tasks]
    by_op: dict[Op, int] = {}
    for op in ops:
        by_op[op] = by_op.get(op, 0) + 1
    per_op = {op.name: n for op, n in by_op.items()}
    # hops: the longest chain of counter waits among one layer's tasks, counting the wait
    # that enters the layer (a task with no in-layer producer is 1 hop deep)
    layer = [(int(m.group(1)) if (m := _LAYER.match(t.name)) else None) for t in tasks]
    counter_depth: dict[int, dict[Optional[int], int]] = {}  # counter -> layer -> deepest producer
    depth = [0] * len(tasks)
    for t in tasks:
        lt = layer[t.id]
        best = 0
        if lt is not None:
            for w in t.waits:
                d = counter_depth.get(w.counter)
                if d is not None and d.get(lt, 0) > best:
                    best = d[lt]
        depth[t.id] = best + 1
        per_layer = counter_depth.setdefault(t.out_counter, {})
        per_layer[lt] = max(per_layer.get(lt, 0), depth[t.id])
    n_layers = max((l for l in layer if l is not None), default=-1) + 1
    hops = [0] * n_layers
    for t in tasks:
        if layer[t.id] is not None:
            hops[layer[t.id]] = max(hops[layer[t.id]], depth[t.id])

    immutable = {b.id for b in program.buffers if b.kind in (BufferKind.WEIGHT, BufferKind.CONST)}
    weight_bytes = sum(buffer_bytes(program.buffers[i]) for i in immutable)
    # bytes streamed per step: each immutable buffer some non-EMBED task reads, plus one embedding row
    streamed, embed_only = set(), set()
    embed = Op.EMBED
    for t, op in zip(tasks, ops):
        into = embed_only if op == embed else streamed
        for o in t.inputs:
            if o.buf in immutable:
                into.add(o.buf)
    streamed_bytes = sum(buffer_bytes(program.buffers[i]) for i in streamed)
    for i in embed_only - streamed:
        b = program.buffers[i]
        streamed_bytes += b.shape[-1] * DTYPE_BITS[b.dtype] // 8
    floor = {name: streamed_bytes / (tg.hbm_gbps * 1e9) * 1e6 for name, tg in TARGETS.items()}
    floor[program.target.name] = streamed_bytes / (program.target.hbm_gbps * 1e9) * 1e6
    return {
        "tasks": len(tasks),
        "tasks_per_op": per_op,
        "counters": len(program.counters),
        "waits": sum(len(t.waits) for t in tasks),
        "queues": len(program.queues),
        "max_queue_len": max((len(q) for q in program.queues), default=0),
        "hops_per_layer": hops,
        "max_hops_per_layer": max(hops, default=0),
        "weight_bytes": weight_bytes,
        "streamed_bytes": streamed_bytes,
        "floor_us": floor[program.target.name],
        "floor_us_by_target": floor,
    }
