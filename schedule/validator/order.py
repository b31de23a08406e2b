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
        self.full_join = np.ones(nc, dtype=bool)  # False: some wait takes only part of its producers
        self.level: Optional[np.ndarray] = None
        self.waits = self._check_waits(rep)  # [n, 3]: task, counter, threshold (resolvable counters)
        self.queue_pairs = self._check_queues(rep)  # (a, b): b directly follows a in a queue

    # ------------------------------------------------------------------ local rules
    def _check_waits(self, rep: Report) -> np.ndarray:
        rows = []
        for t in self.prog.tasks:
            seen = set()
            for w in t.waits:
                c = w.counter
                if not (0 <= c < self.nc):
                    continue
                rows.append((t.id, c, w.threshold))
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
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def _check_queues(self, rep: Report) -> tuple[np.ndarray, np.ndarray]:
        nt = self.nt
        pairs = []
        for qi, queue in enumerate(self.prog.queues):
            pairs += [(a, b) for a, b in zip(queue, queue[1:]) if 0 <= a < nt and 0 <= b < nt]
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
        arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]

    # ------------------------------------------------------------------ graphs
    def _edges(self, with_queues: bool) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) of every edge: tasks are nodes 0..nt-1, counters nt..nt+nc-1."""
        nt, nc = self.nt, self.nc
        out = np.array([t.out_counter for t in self.prog.tasks], dtype=np.int64)
        ok = (out >= 0) & (out < nc)
        src, dst = [np.flatnonzero(ok)], [nt + out[ok]]
        w = self.waits
        src.append(nt + w[:, 1])
        dst.append(w[:, 0])
        if with_queues:
            a, b = self.queue_pairs
            src.append(a)
            dst.append(b)
        return np.concatenate(src), np.concatenate(dst)

    def check_acyclic(self, rep: Report) -> bool:
        """Data + queue order must be acyclic; on failure the witness is classified by whether
        the data graph alone already has the cycle."""
        n = self.nt + self.nc
        level = _levels(n, *self._edges(with_queues=True))
        if level is not None:
            self.level = level
            return True
        data = self._edges(with_queues=False)
        if _levels(n, *data) is None:
            check, why, edges = "dataflow-cycle", "producers and consumers form a cycle: each task on it waits for the next.", data
        else:
            check, why, edges = ("queue-order-deadlock", "a wait can only be satisfied by a task queued behind a blocked task "
                                 "on another SM.", self._edges(with_queues=True))
        succ: list[list[int]] = [[] for _ in range(n)]
        for a, b in zip(*(e.tolist() for e in edges)):
            succ[a].append(b)
        cycle = _find_cycle(succ)
        rep.add(check, why, tasks=[x for x in cycle if x < self.nt], counters=[x - self.nt for x in cycle if x >= self.nt],
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

    def compute_clocks(self) -> None:
        """Vector clocks, one level of the (acyclic) union graph at a time. Needs every task
        placed in a queue and `check_acyclic` passed."""
        out = np.array([t.out_counter for t in self.prog.tasks], dtype=np.int64)
        self.clock = vector_clocks(self.nt, self.nc, max(len(self.prog.queues), 1), self.queue_pairs, self.waits,
                                   self.full_join, out, self.level, self.queue_of, self.pos_in_queue)
        self.topo = np.argsort(self.level[:self.nt], kind="stable").tolist()
        self._flat_clock = self.clock.reshape(-1)

    def happens_before(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Elementwise: did task a[i] finish before task b[i] started?"""
        nq = self.clock.shape[1]
        return self._flat_clock[b * nq + self.queue_of[a]] >= self.pos_in_queue[a]


def vector_clocks(nt: int, nc: int, nq: int, queue_pairs, waits: np.ndarray, full_join: np.ndarray, out: np.ndarray,
                  level: np.ndarray, queue_of: np.ndarray, pos_in_queue: np.ndarray) -> np.ndarray:
    """clock[t][q]: the highest position of queue q known to finish before task t starts
    (its own position in its own queue), one level of the acyclic union graph at a time.
    `waits` rows are (task, counter, threshold); only waits on `full_join` counters order."""
    clock = np.full((nt + 1, nq), -1, dtype=np.int32)  # row nt: 'no predecessor'
    cclock = np.full((nc + 1, nq), -1, dtype=np.int32)  # row nc: 'no counter'
    qprev = np.full(nt, nt, dtype=np.int64)
    a, b = queue_pairs
    qprev[b] = a
    w = waits
    nwait = np.bincount(w[:, 0], minlength=nt) if len(w) else np.zeros(nt, np.int64)
    width = int(nwait.max()) if nt else 0
    wait_mat = np.full((nt, max(width, 1)), nc, dtype=np.int64)
    if len(w):
        srt = np.argsort(w[:, 0], kind="stable")
        wt, wc = w[srt, 0], w[srt, 1]
        col = np.arange(len(wt)) - np.repeat(np.cumsum(nwait) - nwait, nwait)
        wait_mat[wt, col] = np.where(full_join[wc], wc, nc)  # a partial wait orders nothing
    prod = np.argsort(out, kind="stable")
    prod_ptr = np.searchsorted(out[prod], np.arange(nc + 1))
    t_level, c_level = level[:nt], level[nt:]
    t_order = np.argsort(t_level, kind="stable")
    c_order = np.argsort(c_level, kind="stable")
    t_ptr = np.searchsorted(t_level[t_order], np.arange(level.max() + 2))
    c_ptr = np.searchsorted(c_level[c_order], np.arange(level.max() + 2))
    for lv in range(int(level.max()) + 1):
        cs = c_order[c_ptr[lv]:c_ptr[lv + 1]]
        if len(cs):
            cnt = prod_ptr[cs + 1] - prod_ptr[cs]
            cs, cnt = cs[cnt > 0], cnt[cnt > 0]
            if len(cs):
                idx = np.repeat(prod_ptr[cs] - np.cumsum(cnt) + cnt, cnt) + np.arange(cnt.sum())
                cclock[cs] = np.maximum.reduceat(clock[prod[idx]], np.cumsum(cnt) - cnt, axis=0)
        ts = t_order[t_ptr[lv]:t_ptr[lv + 1]]
        if len(ts):
            acc = clock[qprev[ts]]
            for j in range(wait_mat.shape[1]):
                np.maximum(acc, cclock[wait_mat[ts, j]], out=acc)
            acc[np.arange(len(ts)), queue_of[ts]] = pos_in_queue[ts]
            clock[ts] = acc
    return clock[:nt]


def _levels(n: int, src: np.ndarray, dst: np.ndarray) -> Optional[np.ndarray]:
    """Longest-path level of every node (Kahn's algorithm, one frontier at a time), or None
    if the graph has a cycle."""
    order = np.argsort(src, kind="stable")
    s_dst = dst[order]
    ptr = np.searchsorted(src[order], np.arange(n + 1))
    indeg = np.bincount(dst, minlength=n)
    level = np.full(n, -1, dtype=np.int64)
    frontier = np.flatnonzero(indeg == 0)
    lv, done = 0, 0
    while len(frontier):
        level[frontier] = lv
        done += len(frontier)
        cnt = ptr[frontier + 1] - ptr[frontier]
        targets = s_dst[np.repeat(ptr[frontier] - np.cumsum(cnt) + cnt, cnt) + np.arange(cnt.sum())]
        indeg -= np.bincount(targets, minlength=n)
        cand = np.unique(targets)
        frontier = cand[indeg[cand] == 0]
        lv += 1
    return level if done == n else None


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
