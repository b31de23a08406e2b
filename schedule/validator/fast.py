"""The validator's fast path: decides whether a program passes every check, without
explaining failures.

`validate()` runs `verify` first. If it returns a result, the program passed every check
and the certificate is built from it. If it returns None (some check fails, or the input
is anything it does not handle), `validate()` runs the explaining path (`form`, `order`,
`race`, `scope`: the code that names every violation), which alone decides rejections. So
the fast path can only ever be wrong by accepting what the explaining path rejects, and
`tests/test_validate.py` runs both paths on every fuzz class to show they agree.

The checks are the same, in a cheaper form for a program that passes them:

* one pass reads every field of every task, operand and wait out of the pydantic objects
  (C-level maps over the model dicts), then the local rules of `form` run vectorised over
  whole columns; per-op rules are derived once per distinct (params, weight dtype, group);
* a passing program has only full joins, every task in exactly one queue, and (usually)
  task ids that already are a topological order of the producer/waiter + queue graph, which
  two vectorised comparisons prove (acyclic, no level loop); otherwise Kahn's levels
  (`order._levels`) decide it, as in the explaining path;
* happens-before is reachability over the same graph: Python-int bitsets in topological
  order for programs up to `BITSET_MAX_TASKS` tasks, the vector clocks of `order` above;
* the tile and completeness analysis (`race.check_tiles`) and the scope rule
  (`scope.check_scopes`) are the explaining path's own functions, run on these tables; the
  race analysis is `race.check_races`' segment analysis in fewer array passes (`_race_free`;
  `check_races` itself where a task touches one buffer through overlapping regions). The
  race check is exact under any linear extension of happens-before, and on a race-free
  program even its count of ordering checks does not depend on which extension it gets, so
  the certificate equals the explaining path's.

Nothing is cached between calls: every call reads and checks the whole program.
"""

from __future__ import annotations

import struct
from itertools import chain, groupby
from operator import itemgetter
from typing import Optional

import numpy as np
from pydantic import BaseModel

from amk.schedule import ir
from amk.schedule.ir import DType as D, Op
from amk.schedule.opspec import input_roles, output_roles
from amk.schedule.targets import coresident_blocks
from amk.schedule.validator.form import ELEMENTWISE_ROLES, QUANT, _check_consistency, check_buffers, operand_rules
from amk.schedule.validator.order import _levels, vector_clocks
from amk.schedule.validator.race import Accesses, check_races, check_tiles
from amk.schedule.validator.report import Report
from amk.schedule.validator.scope import check_scopes

# every check name this path decides; validate() uses it only while this equals CHECK_GROUPS
COVERED = frozenset({
    "schema", "ids", "reference", "capacity", "arity", "params", "kind", "dtype", "threshold", "self-wait",
    "dataflow-cycle", "queue-coverage", "queue-order-deadlock", "coresidency", "partial-wait", "scope",
    "read-after-write", "write-after-read", "write-after-write", "kv-read-before-append", "tile-overlap", "tile-gap",
    "uninitialized-read", "self-alias", "out-of-bounds", "kv-range", "quant-shape", "complete",
})

BITSET_MAX_TASKS = 2048  # happens-before as Python-int bitsets up to here (an nt x nt matrix), vector clocks above

_FIELDS = BaseModel.__dict__["__dict__"].__get__  # a model's field dict, without the __getattr__ hook
_TASK = itemgetter("id", "params", "inputs", "outputs", "waits", "out_counter", "name")
_OPERAND = itemgetter("buf", "off", "len", "count", "stride", "kv")
_WAIT = itemgetter("counter", "threshold")
_SLOTS = ir.MAX_INPUTS + ir.MAX_OUTPUTS  # operand slot s of a task: inputs 0.., outputs MAX_INPUTS..


class Table:
    """The integer tables of a passing program, shaped as `form.OperandTable` (what
    `race.Accesses` and `validate.program_hash` read)."""


class _OrderView:
    """What `scope.check_scopes` and `race.check_races` read of an `order.Order`."""

    def __init__(self, nt, nc, queue_of, pos_in_queue, waits):
        self.nt, self.nc = nt, nc
        self.queue_of, self.pos_in_queue, self.waits = queue_of, pos_in_queue, waits
        self.topo = None
        self._hb = None

    def happens_before(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._hb(a, b)


def verify(prog: ir.Program) -> Optional[tuple[int, Table]]:
    """(ordering checks made, tables) if `prog` passes every check, else None."""
    scratch = Report()
    if not _header_ok(prog, scratch):
        return None
    check_buffers(prog, scratch)
    if not scratch.ok:
        return None
    bufs = prog.buffers
    nb, nc, nq = len(bufs), len(prog.counters), len(prog.queues)
    # ---------------------------------------------------------------- one read of every task
    tasks = prog.tasks
    nt = len(tasks)
    if nt == 0:
        return None  # nothing to gain; the explaining path handles the empty program
    ids, params, inputs, outputs, waits, outc, names = zip(*map(_TASK, map(_FIELDS, tasks)))
    if ids != tuple(range(nt)):
        return None  # ids
    nin = _ints(list(map(len, inputs)))
    nout = _ints(list(map(len, outputs)))
    nw = _ints(list(map(len, waits)))
    if nin.max() > ir.MAX_INPUTS or nout.max() > ir.MAX_OUTPUTS or nw.max() > ir.MAX_WAITS:
        return None  # capacity
    out = _ints(list(outc))
    if out.min() < 0 or out.max() >= nc:
        return None  # reference
    ops = chain.from_iterable(chain.from_iterable(zip(inputs, outputs)))
    vals = _ints(list(chain.from_iterable(map(_OPERAND, map(_FIELDS, ops))))).reshape(-1, 6)
    nops = len(vals)
    wv = _ints(list(chain.from_iterable(map(_WAIT, map(_FIELDS, chain.from_iterable(waits)))))).reshape(-1, 2)
    buf = vals[:, 0]
    if nops and (buf.min() < 0 or buf.max() >= nb):
        return None  # reference
    if len(wv) and (wv[:, 0].min() < 0 or wv[:, 0].max() >= nc):
        return None  # reference
    # distinct params in order of first appearance (runs of equal params hashed once)
    pkeys = list(map(tuple, map(dict.values, map(_FIELDS, params))))
    pid: dict = {}
    run_pid, run_len, seen_at = [], [], []
    at = 0
    for key, run in groupby(pkeys):
        i = pid.setdefault(key, len(pid))
        if i == len(seen_at):
            seen_at.append(at)
        n = len(list(run))
        run_pid.append(i)
        run_len.append(n)
        at += n
    pix = np.repeat(np.array(run_pid, dtype=np.int64), run_len)
    # operand rows: task, slot, write
    cnt = nin + nout
    start = np.cumsum(cnt) - cnt
    task = np.repeat(np.arange(nt, dtype=np.int64), cnt)
    k = np.arange(nops, dtype=np.int64) - start[task]
    write = k >= nin[task]
    slot = k - np.where(write, nin[task], 0)
    # ---------------------------------------------------------------- per-op operand rules
    variants: dict = {}
    bvar = np.array([variants.setdefault((b.dtype, b.group), len(variants)) for b in bufs], dtype=np.int64)
    op_of_task = np.array([int(params[t].op) for t in seen_at], dtype=np.int64)[pix]  # equal params, equal op
    gemv = (op_of_task == int(Op.GEMV)) & (nin > 0)
    wbuf = np.zeros(nt, dtype=np.int64)
    wbuf[gemv] = buf[start[gemv]]
    key = pix * (len(variants) + 1) + np.where(gemv, bvar[wbuf] + 1, 0)
    first, entry = _groups(key)
    rule_ids: dict = {}
    ne = len(first)
    slot_rule = np.zeros((ne, _SLOTS), dtype=np.int64)
    elementwise = np.zeros((ne, _SLOTS), dtype=bool)
    want_in = np.zeros(ne, dtype=np.int64)
    want_out = np.zeros(ne, dtype=np.int64)
    hidden = np.zeros(ne, dtype=np.int64)
    col = np.zeros(ne, dtype=np.int64)
    quant_entries = []
    for e, t in enumerate(first.tolist()):
        p = params[t]
        w_buf = bufs[int(wbuf[t])] if gemv[t] else None
        try:
            roles_in = input_roles(p, w_buf.dtype if w_buf is not None else D.F32)
            roles_out = output_roles(p)
            ins, outs, problems = operand_rules(p, w_buf)
        except Exception:
            return None  # params its op cannot interpret
        if problems:
            return None  # params
        want_in[e], want_out[e] = len(roles_in), len(roles_out)
        if len(ins) != len(roles_in) or len(outs) != len(roles_out):
            return None  # (never: rules follow the roles) keep the tables aligned
        for s, r in enumerate(ins):
            slot_rule[e, s] = rule_ids.setdefault(r, len(rule_ids))
            elementwise[e, s] = roles_in[s] in ELEMENTWISE_ROLES
        for s, r in enumerate(outs):
            slot_rule[e, ir.MAX_INPUTS + s] = rule_ids.setdefault(r, len(rule_ids))
        op = p.op
        if op == Op.EMBED:
            hidden[e] = p.hidden
        elif op == Op.RMSNORM:
            hidden[e], col[e] = p.hidden, p.col
        elif op == Op.GEMV and w_buf is not None and w_buf.dtype in QUANT:
            quant_entries.append((e, roles_in))
    if (want_in[entry] != nin).any() or (want_out[entry] != nout).any():
        return None  # arity
    ent_row = entry[task]
    rule = slot_rule[ent_row, slot + np.where(write, ir.MAX_INPUTS, 0)]
    if not _operands_ok(prog, vals, rule, list(rule_ids)):
        return None  # kind, dtype, out-of-bounds, params
    off, ln, count, stride, kv = vals[:, 1], vals[:, 2], vals[:, 3], vals[:, 4], vals[:, 5]
    # form._check_consistency: EMBED's table tile matches its output within hidden; RMSNORM's
    # gamma tile and output both span [col, col + n) within hidden
    ts = np.flatnonzero(op_of_task == int(Op.EMBED))
    if len(ts):
        tab, x = start[ts] + 1, start[ts] + nin[ts]
        if ((ln[tab] != ln[x]) | (off[tab] + ln[tab] > hidden[entry[ts]])).any():
            return None  # params
    ts = np.flatnonzero(op_of_task == int(Op.RMSNORM))
    if len(ts):
        gamma, y = start[ts] + 1, start[ts] + nin[ts]
        if ((ln[gamma] != ln[y]) | (col[entry[ts]] + ln[y] > hidden[entry[ts]])).any():
            return None  # params
    if quant_entries:
        for e, roles_in in quant_entries:
            for t in np.flatnonzero(entry == e).tolist():
                _check_consistency(prog, tasks[t], roles_in, bufs[int(wbuf[t])], scratch)
        if not scratch.ok:
            return None  # dtype, quant-shape
    if not _no_self_alias(task, write, buf, off, ln, count, stride, kv, start, nin, ent_row, slot, elementwise):
        return None  # self-alias
    # ---------------------------------------------------------------- waits and queues
    wt = np.repeat(np.arange(nt, dtype=np.int64), nw)
    wc, thr = wv[:, 0], wv[:, 1]
    nprod = np.bincount(out, minlength=nc)
    if len(wc):
        if not ((thr >= 1) & (thr == nprod[wc])).all():
            return None  # threshold, partial-wait
        if (wc == out[wt]).any():
            return None  # self-wait
        pair = np.sort(wt * nc + wc)
        if (pair[1:] == pair[:-1]).any():
            return None  # params (a counter waited on twice)
    qlen = _ints(list(map(len, prog.queues)))
    qflat = _ints(list(chain.from_iterable(prog.queues)))
    if len(qflat) != nt or qflat.min() < 0 or qflat.max() >= nt or (np.bincount(qflat, minlength=nt) != 1).any():
        return None  # queue-coverage
    qstart = np.cumsum(qlen) - qlen
    queue_of = np.empty(nt, dtype=np.int64)
    pos_in_queue = np.empty(nt, dtype=np.int64)
    queue_of[qflat] = np.repeat(np.arange(nq, dtype=np.int64), qlen)
    pos_in_queue[qflat] = np.arange(nt, dtype=np.int64) - np.repeat(qstart, qlen)
    inner = np.ones(nt, dtype=bool)  # qflat[i] -> qflat[i + 1] is a queue edge unless i ends a queue
    inner[(qstart + qlen - 1)[qlen > 0]] = False
    inner = inner[:-1]
    qa, qb = qflat[:-1][inner], qflat[1:][inner]
    order = _OrderView(nt, nc, queue_of, pos_in_queue, np.stack([wt, wc, thr], axis=1))
    check_scopes(prog, order, scratch)
    if not scratch.ok:
        return None  # scope
    # ---------------------------------------------------------------- tiles and completeness
    table = Table()
    table.task, table.buf, table.off, table.len, table.count, table.stride, table.kv = task, buf, off, ln, count, stride, kv
    table.write, table.sane, table.ok = write.astype(np.int64), np.ones(nt, dtype=bool), np.ones(nops, dtype=bool)
    acc = Accesses(prog, table)
    check_tiles(prog, acc, scratch, out=out)
    if not scratch.ok:
        return None  # tile-overlap, tile-gap, complete
    # ---------------------------------------------------------------- deadlock freedom
    maxprod = np.full(nc, -1, dtype=np.int64)
    np.maximum.at(maxprod, out, np.arange(nt, dtype=np.int64))
    if (qa < qb).all() and (maxprod[wc] < wt).all():
        topo = np.arange(nt, dtype=np.int64)  # task ids are a topological order: acyclic
        level = None
    else:
        src = np.concatenate([np.arange(nt, dtype=np.int64), nt + wc, qa])
        dst = np.concatenate([nt + out, wt, qb])
        level = _levels(nt + nc, src, dst)
        if level is None:
            return None  # dataflow-cycle, queue-order-deadlock
        topo = np.argsort(level[:nt], kind="stable")
    # ---------------------------------------------------------------- race freedom
    order.topo = topo
    if nt <= BITSET_MAX_TASKS:
        order._hb = _bitset_hb(nt, nc, topo, qa, qb, out, wt, wc)
    else:
        if level is None:
            level = _levels(nt + nc, np.concatenate([np.arange(nt, dtype=np.int64), nt + wc, qa]),
                            np.concatenate([nt + out, wt, qb]))
        clock = vector_clocks(nt, nc, max(nq, 1), (qa, qb), order.waits, np.ones(nc, dtype=bool), out, level,
                              queue_of, pos_in_queue)
        flat, nqc = clock.reshape(-1), clock.shape[1]
        order._hb = lambda a, b: flat[b * nqc + queue_of[a]] >= pos_in_queue[a]
    rank = np.empty(nt, dtype=np.int64)
    rank[topo] = np.arange(nt, dtype=np.int64)
    pairs = _race_free(acc, rank, order._hb)
    if pairs is None:
        return None  # read-after-write, write-after-read, write-after-write, kv-read-before-append, uninitialized-read
    if pairs < 0:  # a task touches overlapping but different regions of one buffer: the general form decides
        pairs = check_races(prog, order, acc, scratch)
        if not scratch.ok:
            return None
    # ---------------------------------------------------------------- the digest's tables
    arr = np.empty((nops, 9), dtype=np.int64)
    arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3:] = task, slot, write, vals
    table.array = arr
    table.params = list(pid)
    table.task_rows = np.stack([np.arange(nt, dtype=np.int64), pix, out, nin, nout], axis=1)
    table.wait_rows = order.waits
    table.names = names
    return pairs, table


def _groups(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index of each distinct key, in key order; each element's group number)."""
    srt = np.argsort(key, kind="stable")
    k = key[srt]
    new = np.empty(len(k), dtype=bool)
    new[0] = True
    np.not_equal(k[1:], k[:-1], out=new[1:])
    group = np.empty(len(k), dtype=np.int64)
    group[srt] = np.cumsum(new) - 1
    return srt[new], group


def _ints(values: list) -> np.ndarray:
    """int64 array of a list of Python ints; refuses anything else (floats, > 64 bits) by raising."""
    return np.frombuffer(struct.pack(f"={len(values)}q", *values), dtype=np.int64)


def _header_ok(prog: ir.Program, rep: Report) -> bool:
    """`form.check_program_header` less the task ids, which `verify` reads with the tasks."""
    t = prog.target
    if any(b.id != i for i, b in enumerate(prog.buffers)) or any(c.id != i for i, c in enumerate(prog.counters)):
        return False
    if (len(prog.tasks) > ir.MAX_TASKS or len(prog.buffers) > ir.MAX_BUFFERS or len(prog.counters) > ir.MAX_COUNTERS
            or len(prog.queues) > ir.MAX_QUEUES):
        return False
    tpb = prog.threads_per_block
    if not (t.warp_size <= tpb <= ir.MAX_THREADS and tpb % t.warp_size == 0) or prog.blocks_per_cu < 1:
        return False
    if len(prog.queues) > coresident_blocks(t, max(tpb, 1), max(prog.blocks_per_cu, 1)) or not prog.queues:
        return False
    return rep.ok


def _operands_ok(prog: ir.Program, vals: np.ndarray, rule: np.ndarray, rules: list) -> bool:
    """`form._check_operands`' test, over every operand at once."""
    if len(vals) == 0:
        return True
    bufs = prog.buffers
    b = vals[:, 0]
    off, ln, count, stride, kv = vals[:, 1], vals[:, 2], vals[:, 3], vals[:, 4], vals[:, 5]
    kind = np.array([int(x.kind) for x in bufs], dtype=np.int64)[b]
    dtype = np.array([int(x.dtype) for x in bufs], dtype=np.int64)[b]
    extent = np.array([(x.shape[-1] if x.kind == ir.BufferKind.KV_CACHE and x.shape else x.numel) for x in bufs],
                      dtype=np.float64)[b]
    spec = np.array([[sum(1 << int(k) for k in r.kinds), sum(1 << int(d) for d in r.dtypes), int(r.kv)]
                     + [-1 if v is None else v for v in (r.length, r.count, r.stride, r.off)] for r in rules],
                    dtype=np.int64)[rule]
    kind_mask, dtype_mask, want_kv, w_len, w_count, w_stride, w_off = spec.T
    single = count == 1
    end = off.astype(np.float64) + (count - 1).astype(np.float64) * stride.astype(np.float64) + ln
    ok = (((kind_mask >> kind) & 1) == 1) & (((dtype_mask >> dtype) & 1) == 1) & (kv == want_kv)
    ok &= (off >= 0) & (ln >= 1) & (count >= 1) & (stride >= 0) & (end <= extent)
    ok &= ((w_len < 0) | (w_len == ln)) & ((w_count < 0) | (w_count == count))
    ok &= (w_off < 0) | (w_off == off)
    ok &= single | (((w_stride < 0) | (w_stride == stride)) & (stride >= ln) & (kv == 0))
    return bool(ok.all())


def _no_self_alias(task, write, buf, off, ln, count, stride, kv, start, nin, ent_row, slot, elementwise) -> bool:
    """`form._check_aliasing`: no output of a task overlaps one of its own inputs, except an
    elementwise operand updated exactly in place. Every (output, input) pair of each task."""
    w = np.flatnonzero(write)
    if len(w) == 0:
        return True
    n = nin[task[w]]
    r_of = np.repeat(w, n)
    first = np.cumsum(n) - n
    q = start[task[r_of]] + np.arange(len(r_of), dtype=np.int64) - np.repeat(first, n)
    same_buf = buf[r_of] == buf[q]
    if not same_buf.any():
        return True
    r_of, q = r_of[same_buf], q[same_buf]
    same = ((off[q] == off[r_of]) & (ln[q] == ln[r_of]) & (count[q] == count[r_of]) & (stride[q] == stride[r_of])
            & (kv[q] == kv[r_of]))
    exempt = (same & elementwise[ent_row[q], slot[q]]) | ((kv[q] != kv[r_of]) & ((kv[q] == 0) | (kv[r_of] == 0)))
    hi_a = off[r_of] + (count[r_of] - 1) * stride[r_of] + ln[r_of]
    hi_b = off[q] + (count[q] - 1) * stride[q] + ln[q]
    clash = ~exempt & (off[r_of] < hi_b) & (off[q] < hi_a)
    return not clash.any()


def _race_free(acc: Accesses, rank: np.ndarray, hb) -> Optional[int]:
    """`race.check_races` as a decision: its ordering checks made if there is no race and no
    stale read, None if there is one, -1 if a task's accesses of one buffer overlap without
    being identical (then `check_races` itself decides).

    The same segment analysis: the axis is cut at every interval end; in each segment the
    accesses, in rank order, must each come after the previous writer, and each reader
    before the next writer. Here a task's identical intervals are merged up front (an
    in-place task reads and writes one region) rather than per segment, per-segment counts
    come from the intervals, and the previous/next writer of every incidence from one
    running count of writers."""
    if len(acc.lo) == 0:
        return 0
    task, lo, hi, wr = acc.task, acc.lo, acc.hi, acc.write
    pts = np.sort(np.concatenate([lo, hi]))
    cut = np.empty(len(pts), dtype=bool)
    cut[0] = True
    np.not_equal(pts[1:], pts[:-1], out=cut[1:])
    points = pts[cut]
    nseg = len(points)  # segment s is [points[s], points[s + 1])
    s_lo = np.searchsorted(points, lo)
    s_hi = np.searchsorted(points, hi)
    if len(rank) * (nseg + 1) ** 2 >= 1 << 60:
        return -1
    key = (task * (nseg + 1) + s_lo) * (nseg + 1) + s_hi
    srt = np.argsort(key)
    key = key[srt]
    new = np.empty(len(key), dtype=bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    if new.all():
        task, s_lo, s_hi, writes = task[srt], s_lo[srt], s_hi[srt], wr[srt]
        reads = ~writes
    else:
        first = np.flatnonzero(new)
        writes = np.maximum.reduceat(wr[srt].view(np.int8), first).view(bool)
        reads = np.maximum.reduceat((~wr[srt]).view(np.int8), first).view(bool)
        srt = srt[first]
        task, s_lo, s_hi = task[srt], s_lo[srt], s_hi[srt]
    if ((task[1:] == task[:-1]) & (s_lo[1:] < s_hi[:-1])).any():
        return -1
    # per segment: how many intervals, and writers, cover it (difference arrays over segments)
    per_seg = np.cumsum(np.bincount(s_lo, minlength=nseg) - np.bincount(s_hi, minlength=nseg))
    w_seg = np.cumsum(np.bincount(s_lo[writes], minlength=nseg) - np.bincount(s_hi[writes], minlength=nseg))
    w_end = np.cumsum(w_seg)  # writer incidences up to the end of each segment
    # one incidence per (interval, segment), generated in rank order, then put in (segment,
    # rank) order; each carries its interval's task, write and read flags as one code
    span = s_hi - s_lo
    by_rank = np.argsort(rank[task], kind="stable")
    span_r = span[by_rank]
    seg = np.repeat(s_lo[by_rank] - (np.cumsum(span_r) - span_r), span_r)
    seg += np.arange(len(seg))
    code = np.repeat((task * 4 + writes * 2 + reads)[by_rank], span_r)
    code = code[np.argsort(seg.astype(np.uint8 if nseg <= 256 else np.uint16 if nseg <= 1 << 16 else np.int64),
                           kind="stable")]
    w = (code & 2) != 0
    tsk = code >> 2
    cw = np.cumsum(w)  # writers at or before each incidence
    before = cw - w
    has_prev = before > np.repeat(w_end - w_seg, per_seg)  # a writer earlier in the same segment
    if (((code & 1) != 0) & ~has_prev).any():
        return None  # a read of what nothing this step wrote before it
    wtask = tsk[w]  # the task of each writer incidence, in order
    if not (hb(wtask[before - 1], tsk) | ~has_prev).all():  # (before - 1 = -1 only where there is none)
        return None
    later = ~w & (cw < np.repeat(w_end, per_seg))  # readers with a writer later in the same segment
    if not (hb(tsk, wtask[np.minimum(cw, len(wtask) - 1)]) | ~later).all():
        return None
    return int(np.count_nonzero(has_prev) + np.count_nonzero(later))


def _bitset_hb(nt, nc, topo, qa, qb, out, wt, wc):
    """Happens-before as reachability: each task's ancestors (itself included) as a
    Python-int bitset, built in topological order; returns the vectorised query."""
    qprev = np.full(nt, nt, dtype=np.int64)
    qprev[qb] = qa
    qprev = qprev.tolist()
    nw = np.bincount(wt, minlength=nt)
    w_end = np.cumsum(nw)
    w_start, w_end, wc_l, out_l = (w_end - nw).tolist(), w_end.tolist(), wc.tolist(), out.tolist()
    anc = [0] * (nt + 1)  # anc[nt]: no queue predecessor
    canc = [0] * nc
    for t in topo.tolist():
        a = anc[qprev[t]] | (1 << t)
        for c in wc_l[w_start[t]:w_end[t]]:
            a |= canc[c]
        anc[t] = a
        canc[out_l[t]] |= a
    nbytes = (nt + 7) // 8
    packed = np.frombuffer(b"".join([x.to_bytes(nbytes, "little") for x in anc[:nt]]), dtype=np.uint8)
    reach = np.unpackbits(packed.reshape(nt, nbytes), axis=1, count=nt, bitorder="little").view(bool).reshape(-1)
    return lambda a, b: reach[b * nt + a]  # a in anc[b]
