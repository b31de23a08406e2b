"""SM assignment: deal a lowered task list onto per-block queues.

Tasks arrive in lowering order, which is a topological order of the wait DAG (a task
only waits on counters of earlier tasks). Every queue keeps its tasks in that order, so
each queue is a linear extension of the DAG and, with all blocks co-resident, the
earliest unfinished task can always run: no assignment here can deadlock.

Chiplets (AMD gfx942/gfx950): queue q runs on XCD q % xcds, because the hardware deals the
workgroups of a launch round-robin over the XCDs (one partition per device, SPX mode). A
task with a home XCD is only placed on that XCD's queues; `narrow_scopes` then gives the
cheaper XCD memory scope to every counter whose producers and waiters share one XCD.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Optional, Sequence, Union

from amk.schedule.ir import DTYPE_BITS, IMMUTABLE_KINDS, Buffer, Counter, KvMode, Scope, Task


def task_bytes(task: Task, buffers: Sequence[Buffer], kv_rows: int) -> float:
    """Estimated bytes a task moves: every operand's elements at its buffer's width;
    a KV-prefix read counts `kv_rows` rows."""
    total = 0.0
    for o in list(task.inputs) + list(task.outputs):
        n = o.len * o.count * (kv_rows if o.kv == KvMode.PREFIX else 1)
        total += n * DTYPE_BITS[buffers[o.buf].dtype] / 8
    return total


def weight_bytes(task: Task, buffers: Union[Sequence[Buffer], Mapping[int, Buffer]]) -> int:
    """Bytes of a task's immutable inputs (weights, their scales and zeros, norm weights,
    tables): what the scheduler may hint into L2 while the task waits. `buffers[o.buf]` is
    an operand's buffer (a program's list, or a mapping by id)."""
    total = 0
    for o in task.inputs:
        b = buffers[o.buf]
        if b.kind in IMMUTABLE_KINDS:
            total += o.len * max(o.count, 1) * DTYPE_BITS[b.dtype] // 8
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


def xcd_of_queue(q: int, n_xcd: int) -> int:
    return q % n_xcd


def assign(
    tasks: Sequence[Task],
    n_queues: int,
    mode: str,
    cost: Sequence[float],
    explicit: Optional[Sequence[int]] = None,
    home: Optional[Sequence[int]] = None,
    n_xcd: int = 1,
) -> list[list[int]]:
    """Queues of task ids. `home[i]` >= 0 binds task i to the queues of that XCD (not for
    'explicit', which places every task itself)."""
    home = home if home is not None and n_xcd > 1 else [-1] * len(tasks)
    if mode == "round_robin":
        where = _round_robin(home, n_queues, n_xcd)
    elif mode == "explicit":
        if explicit is None or len(explicit) != len(tasks):
            got = None if explicit is None else len(explicit)
            raise ValueError(f"explicit_queues has {got} entries; the program has {len(tasks)} tasks")
        if any(not 0 <= q < n_queues for q in explicit):
            raise ValueError(f"explicit_queues entries must be in 0..{n_queues - 1}")
        where = list(explicit)
    elif mode == "lpt":
        where = _lpt(tasks, n_queues, cost, home, n_xcd)
    else:
        raise ValueError(f"unknown sm_assignment {mode!r}")
    queues: list[list[int]] = [[] for _ in range(n_queues)]
    for t, q in zip(tasks, where, strict=True):
        queues[q].append(t.id)
    return queues


def _round_robin(home: Sequence[int], n_queues: int, n_xcd: int) -> list[int]:
    """Lowering order over all queues; a homed task over its XCD's queues in turn."""
    per_xcd = [[q for q in range(n_queues) if xcd_of_queue(q, n_xcd) == x] for x in range(n_xcd)]
    turn = [0] * n_xcd
    where = []
    for i, x in enumerate(home):
        if x < 0:
            where.append(i % n_queues)
        else:
            where.append(per_xcd[x][turn[x] % len(per_xcd[x])])
            turn[x] += 1
    return where


def _lpt(tasks: Sequence[Task], n_queues: int, cost: Sequence[float], home: Sequence[int], n_xcd: int) -> list[int]:
    """Per DAG level, largest task first onto the queue least loaded in this level
    (ties: least loaded overall, then lowest index); a homed task only onto its XCD's
    queues (one heap per XCD; a free task takes the best top of all of them)."""
    levels = dag_levels(tasks)
    by_level: dict[int, list[int]] = {}
    for i, lv in enumerate(levels):
        by_level.setdefault(lv, []).append(i)
    n_heaps = min(n_xcd, n_queues)
    total = [0.0] * n_queues
    where = [0] * len(tasks)
    for lv in sorted(by_level):
        heaps = [[(0.0, total[q], q) for q in range(n_queues) if xcd_of_queue(q, n_xcd) == x] for x in range(n_heaps)]
        for h in heaps:
            heapq.heapify(h)
        for i in sorted(by_level[lv], key=lambda i: (-cost[i], i)):
            x = home[i] if home[i] >= 0 else min(range(n_heaps), key=lambda x: heaps[x][0])
            load, _, q = heapq.heappop(heaps[x])
            where[i] = q
            total[q] += cost[i]
            heapq.heappush(heaps[x], (load + cost[i], total[q], q))
    return where


def narrow_scopes(counters: Sequence[Counter], tasks: Sequence[Task], queues: Sequence[Sequence[int]],
                  n_xcd: int) -> list[Counter]:
    """Counters whose producers and waiters all run on one XCD get Scope.XCD; the rest keep
    theirs (device scope). The validator's `scope` check states the same rule."""
    queue_of = {t: q for q, ts in enumerate(queues) for t in ts}
    xcds: list[set[int]] = [set() for _ in counters]
    for t in tasks:
        x = xcd_of_queue(queue_of[t.id], n_xcd)
        xcds[t.out_counter].add(x)
        for w in t.waits:
            xcds[w.counter].add(x)
    return [c.model_copy(update={"scope": Scope.XCD}) if len(xcds[c.id]) == 1 else c for c in counters]
