"""Race freedom, tile coverage and completeness over buffer regions.

Every access of a mutable buffer becomes intervals on one global axis (each buffer gets
its own range; a KV cache is addressed by column, since within a step only row `pos`
is written and rows 0..pos are read). The axis is cut into elementary segments at every
interval end, and each segment's accesses are sorted by a linear extension of
happens-before. A segment is race-free iff

  * each writer happens after the previous writer (the writers form a chain), and
  * each reader happens after the last writer before it and before the next one,

because the chain then orders the reader against every writer by transitivity. Each
failing check is a real unordered conflicting pair, so the check is exact (no false
alarms, nothing skipped), and costs O(incidences log incidences) in numpy rather than
O(pairs). A reader with no writer before it in the step reads stale data: for
activations that is an uninitialized read, for the KV cache a read before this step's
append.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.ir import BufferKind as K, KvMode
from amk.schedule.validator.order import Order
from amk.schedule.validator.report import Report

SKIP_KINDS = frozenset({K.WEIGHT, K.CONST, K.IO_INPUT})  # read-only within a step: no conflicts


class Accesses:
    """Flat arrays of every mutable-buffer access interval: task, buffer, [lo, hi), write."""

    def __init__(self, prog: ir.Program, table):
        bufs = prog.buffers
        size = np.array([_extent(b) for b in bufs], dtype=np.int64)
        self.base = np.concatenate([[0], np.cumsum(size)[:-1]]) if len(bufs) else np.zeros(0, np.int64)
        self.size = size
        skip = np.array([b.kind in SKIP_KINDS for b in bufs], dtype=bool)
        t = table
        sel = np.flatnonzero(~skip[t.buf] & t.sane[t.task] & t.ok) if len(t.task) else np.zeros(0, np.int64)
        task, buf, off, ln, write = t.task[sel], t.buf[sel], t.off[sel], t.len[sel], t.write[sel]
        count = np.where(t.kv[sel] == int(KvMode.NONE), np.clip(t.count[sel], 1, None), 1)
        stride = t.stride[sel]
        rep = np.repeat(np.arange(len(sel)), count)  # one interval per repetition
        first = np.repeat(np.cumsum(count) - count, count)
        c = np.arange(len(rep)) - first
        lo = off[rep] + c * stride[rep]
        hi = lo + ln[rep]
        b = buf[rep]
        lo = np.clip(lo, 0, size[b])  # out-of-bounds is reported elsewhere; never bleed into a neighbour
        hi = np.clip(hi, 0, size[b])
        keep = hi > lo
        self.task, self.buf, self.write = task[rep][keep], b[keep], write[rep][keep].astype(bool)
        self.lo, self.hi = (lo + self.base[b])[keep], (hi + self.base[b])[keep]


def _extent(b: ir.Buffer) -> int:
    if b.kind == K.KV_CACHE:
        return b.shape[-1] if b.shape else 0
    return b.numel


def check_races(prog: ir.Program, order: Order, acc: Accesses, rep: Report) -> int:
    """Race and stale-read checks. Returns how many ordering checks it made."""
    n = len(acc.lo)
    if n == 0:
        return 0
    rank = np.empty(order.nt, dtype=np.int64)
    rank[np.asarray(order.topo, dtype=np.int64)] = np.arange(len(order.topo))
    points = np.unique(np.concatenate([acc.lo, acc.hi]))
    s_lo = np.searchsorted(points, acc.lo).astype(np.int32)
    span = np.searchsorted(points, acc.hi).astype(np.int32) - s_lo
    # expand each interval (taken in happens-before rank order) into one incidence per
    # segment; a stable sort by segment then yields (segment, rank) order
    by_rank = np.argsort(rank[acc.task], kind="stable").astype(np.int32)
    span_r = span[by_rank]
    src = np.repeat(by_rank, span_r)
    seg = np.repeat(s_lo[by_rank] - (np.cumsum(span_r) - span_r).astype(np.int32), span_r) + np.arange(len(src), dtype=np.int32)
    srt = np.argsort(seg, kind="stable")
    src, seg = src[srt], seg[srt]
    tsk = acc.task[src]
    # merge a task's accesses of one segment (an in-place task both reads and writes)
    start = np.flatnonzero(np.concatenate([[True], (seg[1:] != seg[:-1]) | (tsk[1:] != tsk[:-1])]))
    write = np.maximum.reduceat(acc.write[src].astype(np.int8), start).astype(bool)
    reads = np.maximum.reduceat((~acc.write[src]).astype(np.int8), start).astype(bool)  # in-place tasks do both
    src, seg, task = src[start], seg[start], tsk[start]
    m = len(src)
    idx = np.arange(m, dtype=np.int32)
    # previous writer in the same segment, strictly before
    last_w = np.maximum.accumulate(np.where(write, idx, -1))
    prev = np.concatenate([[-1], last_w[:-1]])
    has_prev = prev >= 0
    has_prev[has_prev] = seg[prev[has_prev]] == seg[has_prev]
    # next writer in the same segment, strictly after
    next_w = np.minimum.accumulate(np.where(write, idx, m)[::-1])[::-1]
    nxt = np.concatenate([next_w[1:], [m]])
    has_next = nxt < m
    has_next[has_next] = seg[nxt[has_next]] == seg[has_next]

    kind = np.array([b.kind for b in prog.buffers], dtype=np.int64)
    buf = acc.buf[src]
    is_kv = kind[buf] == int(K.KV_CACHE)

    # an unordered reader/writer pair is named by the program's intent: task ids follow
    # program order, so a writer created before its reader makes it a read-after-write
    i = np.flatnonzero(has_prev)
    a, b = task[prev[i]], task[i]
    bad = ~order.happens_before(a, b)
    ww = bad & write[i]
    _report_pairs(rep, prog, "write-after-write", a[ww], b[ww], buf[i][ww])
    rw = bad & ~write[i]
    _report_rw(rep, prog, a[rw], b[rw], buf[i][rw], is_kv[i][rw])

    r = np.flatnonzero(has_next & ~write)
    a, b = task[r], task[nxt[r]]
    bad = ~order.happens_before(a, b)
    _report_rw(rep, prog, b[bad], a[bad], buf[r][bad], is_kv[r][bad])

    stale = np.flatnonzero(reads & ~has_prev)
    for check, mask in (("uninitialized-read", ~is_kv[stale]), ("kv-read-before-append", is_kv[stale])):
        sel = stale[mask]
        for t, b in _unique_pairs(task[sel], buf[sel]):
            rep.add(check, f"task {t} reads buffer {b} ({prog.buffers[b].name}) where nothing this step wrote before it"
                    + ("; the KV row at pos is appended later or never." if check != "uninitialized-read" else "."),
                    tasks=[t], buffers=[b])
    return int(len(i) + len(r))


def _unique_pairs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int]]:
    if len(a) == 0:
        return []
    u = np.unique(np.stack([a, b], axis=1), axis=0)
    return [(int(x), int(y)) for x, y in u]


def _report_rw(rep: Report, prog: ir.Program, writer, reader, buf, kv) -> None:
    """Unordered writer/reader pairs, named by which one the program created first."""
    raw = writer < reader
    _report_pairs(rep, prog, "read-after-write", writer[raw & ~kv], reader[raw & ~kv], buf[raw & ~kv])
    _report_pairs(rep, prog, "kv-read-before-append", writer[raw & kv], reader[raw & kv], buf[raw & kv])
    _report_pairs(rep, prog, "write-after-read", reader[~raw], writer[~raw], buf[~raw])


def _report_pairs(rep: Report, prog: ir.Program, check: str, first, second, buf) -> None:
    if len(first) == 0:
        return
    trip = np.unique(np.stack([first, second, buf], axis=1), axis=0)
    what = {"write-after-write": "both write", "read-after-write": "the second reads what the first writes",
            "kv-read-before-append": "the second reads the KV rows the first appends",
            "write-after-read": "the second overwrites what the first reads"}[check]
    for a, b, bf in trip:
        rep.add(check, f"tasks {a} and {b} are unordered on buffer {bf} ({prog.buffers[bf].name}): {what}.",
                tasks=[int(a), int(b)], buffers=[int(bf)])


def check_tiles(prog: ir.Program, acc: Accesses, rep: Report, out: Optional[np.ndarray] = None) -> None:
    """Tasks that share a counter form a producer set: on each buffer their written tiles
    must be disjoint and leave no gap; every IO_OUTPUT must be written whole. `out`: every
    task's out_counter, if the caller has it."""
    w = acc.write
    if out is None:
        out = np.array([t.out_counter for t in prog.tasks], dtype=np.int64)
    counter = out[acc.task[w]]
    buf, lo, hi, task = acc.buf[w], acc.lo[w], acc.hi[w], acc.task[w]
    srt = np.lexsort((lo, buf, counter))
    counter, buf, lo, hi, task = counter[srt], buf[srt], lo[srt], hi[srt], task[srt]
    same = (counter[1:] == counter[:-1]) & (buf[1:] == buf[:-1]) & (task[1:] != task[:-1])
    overlap = np.flatnonzero(same & (lo[1:] < hi[:-1]))
    gap = np.flatnonzero(same & (lo[1:] > hi[:-1]))
    for k in overlap:
        b = int(buf[k])
        rep.add("tile-overlap", f"tasks {task[k]} and {task[k + 1]} of the producer set of counter {counter[k]} both write "
                f"elements {lo[k + 1] - acc.base[b]}..{min(hi[k], hi[k + 1]) - acc.base[b]} of buffer {b} ({prog.buffers[b].name}).",
                tasks=[int(task[k]), int(task[k + 1])], buffers=[b], counters=[int(counter[k])])
    for k in gap:
        b = int(buf[k])
        rep.add("tile-gap", f"the producer set of counter {counter[k]} leaves elements {hi[k] - acc.base[b]}..{lo[k + 1] - acc.base[b]} "
                f"of buffer {b} ({prog.buffers[b].name}) unwritten between tasks {task[k]} and {task[k + 1]}.",
                tasks=[int(task[k]), int(task[k + 1])], buffers=[b], counters=[int(counter[k])])
    outputs = [b for b in prog.buffers if b.kind == K.IO_OUTPUT]
    for b in outputs:
        sel = buf == b.id
        covered = _covered(lo[sel] - acc.base[b.id], hi[sel] - acc.base[b.id])
        if covered < b.numel:
            rep.add("complete", f"output buffer {b.id} ({b.name}) has {b.numel - covered} of {b.numel} elements no task writes.",
                    buffers=[b.id])


def _covered(lo: np.ndarray, hi: np.ndarray) -> int:
    if len(lo) == 0:
        return 0
    srt = np.argsort(lo)
    lo, hi = lo[srt], np.maximum.accumulate(hi[srt])
    prev_hi = np.concatenate([[lo[0]], hi[:-1]])
    return int((hi - np.maximum(lo, prev_hi)).clip(min=0).sum())
