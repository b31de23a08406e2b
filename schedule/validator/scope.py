"""Memory scope of counter edges on chiplet GPUs.

A counter edge (producer -> waiting task) orders memory only within the scope of the
counter's release and acquire. On AMD gfx942/gfx950 each XCD has a private L2: an
XCD-scoped edge skips the L2 write-back/invalidate, so it only orders tasks that run on
the same XCD. Rule: every task that waits on an XCD-scoped counter runs on the XCD of
every producer of that counter; any edge between XCDs needs Scope.DEVICE. Queue q runs on XCD q % target.xcds (workgroups are dispatched
round-robin over XCDs; a one-XCD target puts everything on XCD 0).

The rule is structural (every edge of an XCD-scoped counter, even one that orders no
conflicting access), so it never depends on which edges the race check needed.
"""

from __future__ import annotations

import numpy as np

from amk.schedule import ir
from amk.schedule.validator.order import Order
from amk.schedule.validator.report import Report


def check_scopes(prog: ir.Program, order: Order, rep: Report) -> None:
    nc = order.nc
    if nc == 0:
        return
    xcd_scoped = np.array([c.scope == ir.Scope.XCD for c in prog.counters], dtype=bool)
    if not xcd_scoped.any():
        return
    n_xcd = max(int(prog.target.xcds), 1)
    queue = order.queue_of
    placed = queue >= 0  # unplaced tasks are `queue-coverage` violations; they never run
    xcd = np.where(placed, queue % n_xcd, -1)
    out = np.array([t.out_counter for t in prog.tasks], dtype=np.int64)
    prod = np.flatnonzero(placed & (out >= 0) & (out < nc) & xcd_scoped[np.clip(out, 0, nc - 1)])
    lo = np.full(nc, n_xcd, dtype=np.int64)
    hi = np.full(nc, -1, dtype=np.int64)
    np.minimum.at(lo, out[prod], xcd[prod])
    np.maximum.at(hi, out[prod], xcd[prod])
    w = order.waits  # [task, counter, threshold] of resolvable counters
    ok = (w[:, 0] >= 0) & (w[:, 0] < len(queue))  # malformed ids are the `ids` check's
    t, c = w[ok, 0], w[ok, 1]
    sel = xcd_scoped[c] & placed[t] & (hi[c] >= 0)  # a counter without placed producers is a `threshold` matter
    t, c = t[sel], c[sel]
    bad = (xcd[t] != lo[c]) | (xcd[t] != hi[c])
    for tid, cid in zip(t[bad].tolist(), c[bad].tolist()):
        rep.add("scope", f"task {tid} on XCD {int(xcd[tid])} waits on XCD-scoped counter {cid} signalled on XCD "
                f"{int(lo[cid])}" + (f"..{int(hi[cid])}" if hi[cid] != lo[cid] else "")
                + ": its release does not reach this XCD's L2; the counter needs device scope.",
                tasks=[tid], counters=[cid])
