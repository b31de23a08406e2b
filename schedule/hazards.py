"""Hazard tracking for the lowering: derive every task's waits from the regions it touches.

The lowering emits tasks in *groups*; a group shares one counter that each of its tasks
signals once, and a consumer always waits on a group in full (threshold = group size).
For each new task the tracker finds every earlier group whose accesses conflict with it
(read-after-write, write-after-read, write-after-write on overlapping elements of a
mutable buffer), then drops the groups already implied transitively by another one. The
result is exactly the happens-before the validator asks for, with no hand-written waits.

Regions follow `ir.py` ("Regions"); a KV_CACHE operand is tracked by its columns (an
APPEND write and a PREFIX read of the same columns overlap at row `pos`).
Immutable buffers (WEIGHT, CONST) and IO_INPUT are never written, so are not tracked.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from amk.schedule.ir import MAX_WAITS, BufferKind, KvMode, Operand

UNTRACKED = frozenset({BufferKind.WEIGHT, BufferKind.CONST, BufferKind.IO_INPUT})
Intervals = list[tuple[int, int]]
Access = tuple[int, bool, Intervals]  # (buffer id, is a write, intervals), tracked buffers only
_KV_NONE = KvMode.NONE  # hoisted: an enum member lookup is slow in the hot loops


def intervals(o: Operand) -> Intervals:
    """The elements an operand touches as sorted disjoint half-open intervals."""
    off, n, count = o.off, o.len, o.count
    if count <= 1 or o.kv != _KV_NONE:
        return [(off, off + n)]
    stride = o.stride
    if stride <= n:
        return [(off, off + (count - 1) * stride + n)]
    return [(off + c * stride, off + c * stride + n) for c in range(count)]


def merge(ivs: Intervals) -> Intervals:
    out: Intervals = []
    for lo, hi in sorted(ivs):
        if lo >= hi:
            continue
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def overlaps(a: Intervals, b: Intervals) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def covered(inner: Intervals, outer: Intervals) -> bool:
    """Every element of `inner` lies in `outer` (both merged)."""
    if len(outer) == 1:
        lo, hi = outer[0]
        return all(lo <= a and b <= hi for a, b in inner)
    starts = [lo for lo, _ in outer]
    for lo, hi in inner:
        k = bisect.bisect_right(starts, lo) - 1
        if k < 0 or outer[k][1] < hi:
            return False
    return True


@dataclass
class _Record:
    group: int
    write: bool
    ivs: Intervals


@dataclass
class HazardTracker:
    kinds: dict[int, BufferKind] = field(default_factory=dict)  # buffer id -> kind
    log: dict[int, list[_Record]] = field(default_factory=dict)
    ancestors: list[int] = field(default_factory=list)  # group -> bitmask of ancestor groups

    def tracked(self, buf: int) -> bool:
        return self.kinds[buf] not in UNTRACKED

    def accesses(self, inputs: list[Operand], outputs: list[Operand]) -> list[Access]:
        """A task's accesses to tracked buffers (reads, then writes), computed once for
        `deps` and `commit`."""
        kinds = self.kinds
        out = [(o.buf, False, intervals(o)) for o in inputs if kinds[o.buf] not in UNTRACKED]
        out += [(o.buf, True, intervals(o)) for o in outputs if kinds[o.buf] not in UNTRACKED]
        return out

    def deps(self, inputs: list[Operand], outputs: list[Operand],
             accesses: Optional[list[Access]] = None) -> list[int]:
        """Groups this task must wait on (transitively reduced), ascending. `accesses`:
        `self.accesses(inputs, outputs)`, if the caller already has it."""
        if accesses is None:
            accesses = self.accesses(inputs, outputs)
        found: set[int] = set()
        log = self.log
        for buf, write, ivs in accesses:
            recs = log.get(buf)
            if not recs:
                continue
            single = len(ivs) == 1
            lo, hi = ivs[0][0], ivs[-1][1]
            for rec in recs:
                if (write or rec.write) and rec.group not in found:
                    r = rec.ivs
                    if lo < r[-1][1] and r[0][0] < hi and ((single and len(r) == 1) or overlaps(ivs, r)):
                        found.add(rec.group)
        if not found:
            return []
        ancestors = self.ancestors
        implied = 0  # a group is implied if it is an ancestor of another found group
        for e in found:
            implied |= ancestors[e]
        reduced = [g for g in found if not (implied >> g) & 1]
        if len(reduced) > MAX_WAITS:
            raise RuntimeError(f"a task needs {len(reduced)} waits (> MAX_WAITS={MAX_WAITS}): {sorted(reduced)}")
        return sorted(reduced)

    def commit(self, group: int, tasks: list[tuple]) -> None:
        """Record a finished group: its tasks' (inputs, outputs, deps), each optionally with
        a fourth item, its `accesses(inputs, outputs)`."""
        assert group == len(self.ancestors)
        accs = [t[3] if len(t) > 3 else self.accesses(t[0], t[1]) for t in tasks]
        ancestors = self.ancestors
        anc = 0
        seen: set[int] = set()
        for t in tasks:
            for d in t[2]:
                if d not in seen:
                    seen.add(d)
                    anc |= (1 << d) | ancestors[d]
        reads: dict[int, Intervals] = {}
        writes: dict[int, Intervals] = {}
        for acc in accs:
            for buf, write, ivs in acc:
                (writes if write else reads).setdefault(buf, []).extend(ivs)
        ancestors.append(anc)
        _check_disjoint(group, accs)
        log = self.log
        for buf, ivs in writes.items():
            w = merge(ivs)
            # older accesses wholly overwritten here are ordered before this group, and
            # every later conflicting access waits on this group: they can be forgotten
            log[buf] = [r for r in log.get(buf, ()) if not covered(r.ivs, w)]
            log[buf].append(_Record(group, True, w))
        for buf, ivs in reads.items():
            log.setdefault(buf, []).append(_Record(group, False, merge(ivs)))


def _check_disjoint(group: int, accs: list[list[Access]]) -> None:
    """Tasks of one group run concurrently: no two may conflict (a task may read what it
    writes itself, e.g. an in-place residual add). O(n log n) per buffer."""
    reads: dict[int, list[tuple[int, int, int]]] = {}
    writes: dict[int, list[tuple[int, int, int]]] = {}
    for t, acc in enumerate(accs):
        for buf, write, ivs in acc:
            (writes if write else reads).setdefault(buf, []).extend((lo, hi, t) for lo, hi in ivs)
    for buf, ws in writes.items():
        ws.sort()
        for (_, h0, t0), (l1, _, t1) in zip(ws, ws[1:]):
            if l1 < h0 and t0 != t1:
                raise RuntimeError(f"group {group}: tasks {t0} and {t1} both write buffer {buf} at {l1}")
        rs = reads.get(buf)
        if not rs:
            continue
        starts, ends = [w[0] for w in ws], [w[1] for w in ws]
        for lo, hi, t in rs:
            for k in range(bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)):
                if ws[k][2] != t:
                    raise RuntimeError(f"group {group}: task {t} reads buffer {buf} at [{lo}, {hi}) "
                                       f"while task {ws[k][2]} writes it")
