"""SM assignment: deal a lowered task list onto per-block queues.

Tasks arrive in lowering order, which is a topological order of the wait DAG (a task
only waits on counters of earlier tasks). Every queue keeps its tasks in that order, so
each queue is a linear extension of the DAG and, with all blocks co-resident, the
earliest unfinished task can always run: no assignment here can deadlock.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

from amk.schedule.ir import DTYPE_BITS, Buffer, KvMode, Task


def task_bytes(task: Task, buffers: Sequence[Buffer], kv_rows: int) -> float:
    """Estimated bytes a task moves: every operand's elements at its buffer's width;
    a KV-prefix read counts `kv_rows` rows."""
    total = 0.0
    for o in list(task.inputs) + list(task.outputs):
        n = o.len * o.count * (kv_rows if o.kv == KvMode.PREFIX else 1)
        total += n * DTYPE_BITS[buffers[o.buf].dtype] / 8
    return total


def task_costs(tasks: Sequence[Task], buffers: Sequence[Buffer], kv_rows: int) -> list[float]:
    """`task_bytes` of every task (the same values, computed in one pass)."""
    bits = [DTYPE_BITS[b.dtype] for b in buffers]
    prefix = KvMode.PREFIX
    out = []
    for task in tasks:
        total = 0.0
        for ops in (task.inputs, task.outputs):
            for o in ops:
                n = o.len * o.count * (kv_rows if o.kv == prefix else 1)
                total += n * bits[o.buf] / 8
        out.append(total)
    return out


def dag_levels(tasks: Sequence[Task]) -> list[int]:
    """Level of each task: 0 without waits, else 1 + the deepest producer it waits on."""
    counter_level: dict[int, int] = {}
    levels = []
    for t in tasks:
        lv = 0
        for w in t.waits:
            c = counter_level[w.counter] + 1
            if c > lv:
                lv = c
        levels.append(lv)
        if lv > counter_level.get(t.out_counter, 0):
            counter_level[t.out_counter] = lv
        else:
            counter_level.setdefault(t.out_counter, 0)
    return levels


def assign(
    tasks: Sequence[Task],
    n_queues: int,
    mode: str,
    cost: Sequence[float],
    explicit: Optional[Sequence[int]] = None,
) -> list[list[int]]:
    if mode == "round_robin":
        where = [i % n_queues for i in range(len(tasks))]
    elif mode == "explicit":
        if explicit is None or len(explicit) != len(tasks):
            got = None if explicit is None else len(explicit)
            raise ValueError(f"explicit_queues has {got} entries; the program has {len(tasks)} tasks")
        if any(not 0 <= q < n_queues for q in explicit):
            raise ValueError(f"explicit_queues entries must be in 0..{n_queues - 1}")
        where = list(explicit)
    elif mode == "lpt":
        where = _lpt(tasks, n_queues, cost)
    else:
        raise ValueError(f"unknown sm_assignment {mode!r}")
    queues: list[list[int]] = [[] for _ in range(n_queues)]
    for t, q in zip(tasks, where, strict=True):
        queues[q].append(t.id)
    return queues


def _lpt(tasks: Sequence[Task], n_queues: int, cost: Sequence[float]) -> list[int]:
    """Per DAG level, largest task first onto the queue least loaded in this level
    (ties: least loaded overall, then lowest index)."""
    levels = dag_levels(tasks)
    by_level: dict[int, list[int]] = {}
    for i, lv in enumerate(levels):
        by_level.setdefault(lv, []).append(i)
    total = [0.0] * n_queues
    where = [0] * len(tasks)
    for lv in sorted(by_level):
        heap = [(0.0, total[q], q) for q in range(n_queues)]
        heapq.heapify(heap)
        for i in sorted(by_level[lv], key=lambda i: (-cost[i], i)):
            load, _, q = heapq.heappop(heap)
            where[i] = q
            total[q] += cost[i]
            heapq.heappush(heap, (load + cost[i], total[q], q))
    return where
