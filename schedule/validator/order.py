"""Deadlock freedom and happens-before.

The graph has a node per task and per counter: producer -> counter -> waiting task
(data edges) and queue[i] -> queue[i+1] (queue-order edges: a block runs its queue in
order, so an entry stuck on a wait blocks every later entry of that queue). With all
queues co-resident, the program terminates iff the union graph is acyclic.

Happens-before is tracked with vector clocks over the queues: clock[t][q] is the highest
position in queue q known to have finished before task t starts. A wait propagates the
clocks of its counter's producers only when it waits for all of them: a partial wait
(first k of N) guarantees no particular producer has finished.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.validator.report import Report


class Order:
    """Queue placement, producers per counter, a topological order and vector clocks."""

    def __init__(self, prog: ir.Program, rep: Report):
        self.prog = prog
        nt, nc = len(prog.tasks), len(prog.counters)
        self.nt, self.nc = nt, nc
        self.producers: list[list[int]] = [[] for _ in range(nc)]
        for t in prog.tasks:
            if 0 <= t.out_counter < nc:
                self.producers[t.out_counter].append(t.id)
        self.queue_of = np.full(nt, -1, dtype=np.int64)
        self.pos_in_queue = np.full(nt, -1, dtype=np.int64)
        self.topo: Optional[list[int]] = None  # a linear extension of happens-before (tasks only)
        self.clock: Optional[np.ndarray] = None
        self.full_join: list[bool] = [True] * nc
        self._check_waits(rep)
        self._check_queues(rep)

    # ------------------------------------------------------------------ local rules
    def _check_waits(self, rep: Report) -> None:
        for t in self.prog.tasks:
            seen = set()
            for w in t.waits:
                c = w.counter
                if not (0 <= c < self.nc):
                    continue
                n = len(self.producers[c])
                if c in seen:
                    rep.add("params", f"task {t.id} waits on counter {c} twice.", tasks=[t.id], counters=[c])
                seen.add(c)
                if c == t.out_counter:
                    rep.add("self-wait", f"task {t.id} waits on counter {c}, which only it (or its own group) signals.",
                            tasks=[t.id], counters=[c])
                if not (1 <= w.threshold <= n):
                    rep.add("threshold", f"task {t.id} waits for counter {c} to reach {w.threshold}, but it has {n} producer(s); "
                            f"the wait can never be satisfied." if w.threshold > n else
                            f"task {t.id} waits for counter {c} to reach {w.threshold}; thresholds start at 1.",
                            tasks=[t.id], counters=[c])
                elif n > 1 and w.threshold < n:
                    self.full_join[c] = False
                    rep.add("partial-wait", f"task {t.id} waits for {w.threshold} of the {n} producers of counter {c}; "
                            f"which ones finished is unknown, so their writes are unordered with its reads.",
                            tasks=[t.id], counters=[c])

    def _check_queues(self, rep: Report) -> None:
        nt = self.nt
        for qi, queue in enumerate(self.prog.queues):
            for pos, tid in enumerate(queue):
                if not (0 <= tid < nt):
                    rep.add("queue-coverage", f"queue {qi} lists task {tid}, which does not exist.")
                elif self.queue_of[tid] >= 0:
                    rep.add("queue-coverage", f"task {tid} sits in queue {self.queue_of[tid]} and again in queue {qi}.", tasks=[tid])
                else:
                    self.queue_of[tid] = qi
                    self.pos_in_queue[tid] = pos
        missing = np.flatnonzero(self.queue_of < 0)
        if len(missing):
            rep.add("queue-coverage", f"{len(missing)} task(s) sit in no queue and would never run (first: {missing[:5].tolist()}).",
                    tasks=missing[:25].tolist())

    # ------------------------------------------------------------------ graphs
    def _adjacency(self, with_queues: bool) -> list[list[int]]:
        """Successors of every node: tasks are 0..nt-1, counters nt..nt+nc-1."""
        nt = self.nt
        succ: list[list[int]] = [[] for _ in range(nt + self.nc)]
        for c, prods in enumerate(self.producers):
            for p in prods:
                succ[p].append(nt + c)
        for t in self.prog.tasks:
            for w in t.waits:
                if 0 <= w.counter < self.nc:
                    succ[nt + w.counter].append(t.id)
        if with_queues:
            for queue in self.prog.queues:
                for a, b in zip(queue, queue[1:]):
                    if 0 <= a < nt and 0 <= b < nt:
                        succ[a].append(b)
        return succ

    def check_acyclic(self, rep: Report) -> bool:
        """Data + queue order must be acyclic; on failure the witness is classified by whether
        the data graph alone already has the cycle."""
        union = self._adjacency(with_queues=True)
        order = _kahn(union)
        if order is not None:
            self._compute_clocks(order)
            return True
        data = self._adjacency(with_queues=False)
        if _kahn(data) is None:
            check, why, graph = "dataflow-cycle", "producers and consumers form a cycle: each task on it waits for the next.", data
        else:
            check, why, graph = ("queue-order-deadlock", "a wait can only be satisfied by a task queued behind a blocked task "
                                 "on another SM.", union)
        cycle = _find_cycle(graph)
        rep.add(check, why, tasks=[n for n in cycle if n < self.nt], counters=[n - self.nt for n in cycle if n >= self.nt],
                cycle=self._describe(cycle))
        return False

    def _describe(self, cycle: list[int]) -> list[str]:
        nt = self.nt
        out = []
        for n in cycle:
            if n < nt:
                name = self.prog.tasks[n].name
                out.append(f"task {n}" + (f" ({name})" if name else ""))
            else:
                out.append(f"counter {n - nt}")
        return out

    def _compute_clocks(self, order: list[int]) -> None:
        nt, nq = self.nt, max(len(self.prog.queues), 1)
        clock = np.full((nt, nq), -1, dtype=np.int32)
        cclock = np.full((self.nc, nq), -1, dtype=np.int32)
        qprev = np.full(nt, -1, dtype=np.int64)
        for queue in self.prog.queues:
            for a, b in zip(queue, queue[1:]):
                qprev[b] = a
        tasks = self.prog.tasks
        topo = []
        for n in order:
            if n >= nt:
                c = n - nt
                prods = self.producers[c]
                if prods and self.full_join[c]:
                    cclock[c] = clock[prods].max(axis=0)
                continue
            topo.append(n)
            row = clock[n]
            p = qprev[n]
            if p >= 0:
                np.maximum(row, clock[p], out=row)
            for w in tasks[n].waits:
                if 0 <= w.counter < self.nc:
                    np.maximum(row, cclock[w.counter], out=row)
            row[self.queue_of[n]] = self.pos_in_queue[n]
        self.topo = topo
        self.clock = clock
        self._flat_clock = clock.reshape(-1)

    def happens_before(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Elementwise: did task a[i] finish before task b[i] started?"""
        nq = self.clock.shape[1]
        return self._flat_clock[b * nq + self.queue_of[a]] >= self.pos_in_queue[a]


def _kahn(succ: list[list[int]]) -> Optional[list[int]]:
    indeg = [0] * len(succ)
    for outs in succ:
        for m in outs:
            indeg[m] += 1
    ready = [n for n, d in enumerate(indeg) if d == 0]
    order = []
    while ready:
        n = ready.pop()
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    return order if len(order) == len(succ) else None


def _find_cycle(succ: list[list[int]]) -> list[int]:
    """One cycle of a graph known to have one (iterative DFS, colours)."""
    colour = [0] * len(succ)  # 0 new, 1 on stack, 2 done
    for root in range(len(succ)):
        if colour[root]:
            continue
        stack = [(root, iter(succ[root]))]
        path = [root]
        colour[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                colour[node] = 2
            elif colour[nxt] == 1:
                return path[path.index(nxt):]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(succ[nxt])))
    return []
