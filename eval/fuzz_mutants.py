"""Single-injection mutators for the soundness campaign: one function per unsafe class.

Each `mut_<class>(prog, facts, rng)` returns `(mutant, description)` or None when the base
program offers no site for that injection. A mutant differs from its base by one injected
defect (copy-on-write: untouched tasks and buffers are shared with the base). Whether the
injection really made the program unsafe is *not* assumed: dropping a wait that is implied
transitively is harmless, and the campaign takes ground truth from the oracle
(`fuzz_oracle.judge`), never from the mutator's intent.

`Facts` is a plain analysis of a (valid) base program used only to find injection sites:
producers per counter, happens-before ancestors as bitsets, and which tasks read or
overwrite the value each task writes.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.ir import BufferKind as K, DType as D, KvMode

UNTRACKED = frozenset({K.WEIGHT, K.CONST, K.IO_INPUT})
Mutant = Optional[tuple[ir.Program, str]]


# ----------------------------------------------------------------------------- analysis of a base
class Facts:
    def __init__(self, prog: ir.Program):
        self.prog = prog
        nt, nc = len(prog.tasks), len(prog.counters)
        self.nt, self.nc = nt, nc
        self.producers: list[list[int]] = [[] for _ in range(nc)]
        for t in prog.tasks:
            self.producers[t.out_counter].append(t.id)
        self.nprod = [len(p) for p in self.producers]
        self.queue_of = [-1] * nt
        self.pos_of = [-1] * nt
        for qi, q in enumerate(prog.queues):
            for p, t in enumerate(q):
                self.queue_of[t], self.pos_of[t] = qi, p
        self.danc = self._ancestors(queues=False)  # through waits only (queue moves cannot break these)
        self.hanc = self._ancestors(queues=True)  # happens-before: waits and queue order
        self._dataflow()

    def _ancestors(self, queues: bool) -> list[int]:
        prog, nt = self.prog, self.nt
        preds: list[list[int]] = [[] for _ in range(nt)]
        for t in prog.tasks:
            for w in t.waits:
                preds[t.id] += self.producers[w.counter]
        if queues:
            for q in prog.queues:
                for a, b in zip(q, q[1:]):
                    preds[b].append(a)
        indeg = [len(p) for p in preds]
        succ: list[list[int]] = [[] for _ in range(nt)]
        for b, ps in enumerate(preds):
            for a in ps:
                succ[a].append(b)
        ready = [t for t in range(nt) if indeg[t] == 0]
        anc = [0] * nt
        while ready:
            a = ready.pop()
            for b in succ[a]:
                anc[b] |= anc[a] | (1 << a)
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
        return anc

    def _dataflow(self) -> None:
        """Scan tasks in program order (a topological order for lowered programs) over every
        mutable element: who last wrote it, who read that value, who overwrote it."""
        prog = self.prog
        nt = self.nt
        last = {b.id: np.full(_extent(b), -1, dtype=np.int64) for b in prog.buffers if b.kind not in UNTRACKED}
        self.readers_of: list[set[int]] = [set() for _ in range(nt)]  # tasks reading the value t wrote
        self.overwriters_of: list[set[int]] = [set() for _ in range(nt)]  # tasks overwriting it
        self.overwrites: list[set[int]] = [set() for _ in range(nt)]  # writers whose value t overwrites
        self.read_kinds: dict[tuple[int, int], set[str]] = {}  # (writer, reader) -> {"raw", "kv"}
        self.writes_flat: list[list[ir.Operand]] = [[] for _ in range(nt)]
        for t in prog.tasks:
            for o in t.inputs:
                if o.buf in last:
                    lw = np.unique(last[o.buf][_cols(o)])
                    kind = "kv" if o.kv == KvMode.PREFIX else "raw"
                    for w in lw[lw >= 0].tolist():
                        if w != t.id:
                            self.readers_of[w].add(t.id)
                            self.read_kinds.setdefault((w, t.id), set()).add(kind)
            for o in t.outputs:
                if o.buf in last:
                    at = _cols(o)
                    lw = np.unique(last[o.buf][at])
                    for w in lw[lw >= 0].tolist():
                        if w != t.id:
                            self.overwriters_of[w].add(t.id)
                            self.overwrites[t.id].add(w)
                    last[o.buf][at] = t.id
                    self.writes_flat[t.id].append(o)

    def descendants(self, t: int, data_only: bool = True) -> list[int]:
        anc = self.danc if data_only else self.hanc
        return [u for u in range(self.nt) if (anc[u] >> t) & 1]

    def justifies(self, t: int, counter: int) -> set[str]:
        """Why task t waits on `counter`: the conflicts (raw, kv, war, waw) with its producers."""
        why: set[str] = set()
        for p in self.producers[counter]:
            why |= self.read_kinds.get((p, t), set())
            if t in self.overwriters_of[p]:
                why.add("waw")
            if any(p in self.readers_of[s] for s in self.overwrites[t]):
                why.add("war")
        return why


def _extent(b: ir.Buffer) -> int:
    return b.shape[-1] if b.kind == K.KV_CACHE else b.numel


def _cols(o: ir.Operand) -> np.ndarray:
    """Elements of a mutable operand; a KV operand by its columns (only row pos is written)."""
    if o.kv != KvMode.NONE or o.count <= 1:
        return np.arange(o.off, o.off + o.len)
    return (o.off + o.stride * np.arange(o.count)[:, None] + np.arange(o.len)[None, :]).reshape(-1)


def _reads_kv(t: ir.Task) -> bool:
    return any(o.kv == KvMode.PREFIX for o in t.inputs)


# ----------------------------------------------------------------------------- copy-on-write edits
def _set_task(prog: ir.Program, tid: int, **update) -> ir.Program:
    return prog.with_tasks(prog.tasks[tid].replace(**update))


def _set_tasks(prog: ir.Program, updates: dict[int, dict]) -> ir.Program:
    return prog.with_tasks(*(prog.tasks[tid].replace(**up) for tid, up in updates.items()))


def _with_waits(waits: list[tuple[int, int]]) -> list[ir.Wait]:
    return [ir.Wait(counter=c, threshold=th) for c, th in waits]


def _waits(task: ir.Task) -> list[tuple[int, int]]:
    return [(w.counter, w.threshold) for w in task.waits]


def _pick(rng: random.Random, seq):
    seq = list(seq)
    return rng.choice(seq) if seq else None


def _set_operand(prog: ir.Program, tid: int, outputs: bool, i: int, **update) -> ir.Program:
    t = prog.tasks[tid]
    ops = list(t.outputs if outputs else t.inputs)
    ops[i] = ops[i].replace(**update)
    return _set_task(prog, tid, **{"outputs" if outputs else "inputs": ops})


def _add_buffer(prog: ir.Program, **kw) -> tuple[ir.Program, int]:
    bid = len(prog.buffers)
    return prog.replace(buffers=list(prog.buffers) + [ir.Buffer(id=bid, **kw)]), bid


def _clone_into_own_queue(prog: ir.Program, src: ir.Task, waits: list[tuple[int, int]], tag: str) -> tuple[ir.Program, int, int]:
    """A copy of `src` with a fresh counter, alone on a new queue (so it cannot block anyone)."""
    cid, tid = len(prog.counters), len(prog.tasks)
    clone = src.replace(id=tid, out_counter=cid, waits=_with_waits(waits), name=f"{src.name}.{tag}")
    prog = prog.replace(counters=[*prog.counters, ir.Counter(id=cid, name=tag)], tasks=[*prog.tasks, clone],
                        queues=[*prog.queues, [tid]])
    return prog, tid, cid


# ----------------------------------------------------------------------------- deadlock classes
def mut_cycle(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A task waits on the counter of one of its own dataflow descendants."""
    has_desc = 0
    for a in f.danc:
        has_desc |= a
    cands = [t for t in prog.tasks if len(t.waits) < ir.MAX_WAITS and (has_desc >> t.id) & 1]
    if not cands:
        return None
    a = rng.choice(cands)
    b = prog.tasks[rng.choice(f.descendants(a.id))]
    c = b.out_counter
    return _set_task(prog, a.id, waits=list(a.waits) + [ir.Wait(counter=c, threshold=f.nprod[c])]), \
        f"task {a.id} ({a.name}) waits on counter {c} of its descendant {b.id} ({b.name})"


def mut_self_wait(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A task waits for every producer of its own counter, itself included."""
    cands = [t for t in prog.tasks if len(t.waits) < ir.MAX_WAITS]
    if not cands:
        return None
    a = rng.choice(cands)
    c = a.out_counter
    return _set_task(prog, a.id, waits=list(a.waits) + [ir.Wait(counter=c, threshold=f.nprod[c])]), \
        f"task {a.id} ({a.name}) waits on its own counter {c} (threshold {f.nprod[c]})"


def mut_threshold(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A threshold above the number of producers of its counter."""
    sites = [(t.id, i) for t in prog.tasks for i in range(len(t.waits))]
    if not sites:
        return None
    tid, i = rng.choice(sites)
    t = prog.tasks[tid]
    c = t.waits[i].counter
    th = f.nprod[c] + rng.randint(1, 3)
    waits = list(t.waits)
    waits[i] = ir.Wait(counter=c, threshold=th)
    return _set_task(prog, tid, waits=waits), f"task {tid} ({t.name}) waits for {th} of the {f.nprod[c]} producers of counter {c}"


def mut_queue_order_deadlock(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """Cross-SM: block Q1 runs b then (later) e; block Q2 runs a, where b waits on a. Move a
    task d of Q2 that depends on e in front of a: b waits on a, a is behind d, d waits on e,
    e is behind b."""
    queues = prog.queues
    sites = []
    for b in prog.tasks:
        for w in b.waits:
            for a in f.producers[w.counter]:
                if f.queue_of[a] != f.queue_of[b.id]:
                    sites.append((b.id, a))
    rng.shuffle(sites)
    for b, a in sites[:40]:
        q1, q2 = f.queue_of[b], f.queue_of[a]
        after_b = 0
        for e in queues[q1][f.pos_of[b] + 1:]:
            after_b |= 1 << e
        ds = [d for d in queues[q2][f.pos_of[a] + 1:] if f.danc[d] & after_b]
        if not ds:
            continue
        d = rng.choice(ds)
        q = [t for t in queues[q2] if t != d]
        q.insert(q.index(a), d)
        new = list(queues)
        new[q2] = q
        return prog.replace(queues=new), \
            f"queue {q2}: task {d} moved before task {a}, which task {b} on queue {q1} waits for; {d} depends on a later task of queue {q1}"
    # no cross-queue site: a consumer moved in front of its producer on the producer's queue
    for b, a in sites[:1]:
        q2 = f.queue_of[a]
        new = [list(q) for q in queues]
        new[f.queue_of[b]].remove(b)
        new[q2].insert(new[q2].index(a), b)
        return prog.replace(queues=new), f"task {b} moved in front of its producer {a} on queue {q2}"
    return None


# ----------------------------------------------------------------------------- race classes
def mut_dropped_wait(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """Drop a wait that orders a read after the write it reads (read-after-write)."""
    sites = [(t.id, i) for t in prog.tasks for i, w in enumerate(t.waits) if "raw" in f.justifies(t.id, w.counter)]
    if not sites:
        sites = [(t.id, i) for t in prog.tasks for i in range(len(t.waits))]
    if not sites:
        return None
    tid, i = rng.choice(sites)
    t = prog.tasks[tid]
    waits = [w for j, w in enumerate(t.waits) if j != i]
    return _set_task(prog, tid, waits=waits), f"task {tid} ({t.name}) no longer waits on counter {t.waits[i].counter}"


def mut_partial_wait(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """An all-join on a shared counter becomes first-k-of-N."""
    sites = [(t.id, i) for t in prog.tasks for i, w in enumerate(t.waits) if f.nprod[w.counter] >= 2]
    if not sites:
        return None
    tid, i = rng.choice(sites)
    t = prog.tasks[tid]
    c = t.waits[i].counter
    k = rng.randint(1, f.nprod[c] - 1)
    waits = list(t.waits)
    waits[i] = ir.Wait(counter=c, threshold=k)
    return _set_task(prog, tid, waits=waits), f"task {tid} ({t.name}) waits for {k} of the {f.nprod[c]} producers of counter {c}"


def mut_write_after_read(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A copy of writer W runs again after W (it waits on W) but not after W's readers: it
    rewrites the value while they may still read it. Later overwriters wait on the copy, so
    the only new conflicts are between the copy and W's readers."""
    sites = [t.id for t in prog.tasks if f.readers_of[t.id] and f.writes_flat[t.id] and len(t.waits) < ir.MAX_WAITS
             and all(len(prog.tasks[o].waits) < ir.MAX_WAITS for o in f.overwriters_of[t.id])]
    w = _pick(rng, sites)
    if w is None:
        return None
    src = prog.tasks[w]
    c = src.out_counter
    prog, tid, cid = _clone_into_own_queue(prog, src, _waits(src) + [(c, f.nprod[c])], "rewrite")
    ups = {o: {"waits": list(prog.tasks[o].waits) + [ir.Wait(counter=cid, threshold=1)]} for o in f.overwriters_of[w]}
    return _set_tasks(prog, ups), f"task {tid} rewrites what task {w} ({src.name}) wrote, unordered with its readers {sorted(f.readers_of[w])[:6]}"


def mut_write_after_write(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A second writer: a copy of W with W's own waits (so unordered with W). Every reader of
    W's value waits on the copy too, so the only new conflict is writer against writer."""
    sites = [t.id for t in prog.tasks if f.writes_flat[t.id]
             and all(len(prog.tasks[r].waits) < ir.MAX_WAITS for r in f.readers_of[t.id] | f.overwriters_of[t.id])]
    w = _pick(rng, sites)
    if w is None:
        return None
    src = prog.tasks[w]
    prog, tid, cid = _clone_into_own_queue(prog, src, _waits(src), "twin")
    ups = {r: {"waits": list(prog.tasks[r].waits) + [ir.Wait(counter=cid, threshold=1)]}
           for r in f.readers_of[w] | f.overwriters_of[w]}
    return _set_tasks(prog, ups), f"task {tid} writes what task {w} ({src.name}) writes, unordered with it"


def mut_kv_before_append(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """Attention reads a KV row before this step's append: drop the wait on the appender, or
    read another layer's cache whose append comes later."""
    readers = [t for t in prog.tasks if _reads_kv(t)]
    if not readers:
        return None
    variants = ["drop", "retarget"]
    rng.shuffle(variants)
    for v in variants:
        if v == "drop":
            sites = [(t.id, i) for t in readers for i, w in enumerate(t.waits) if "kv" in f.justifies(t.id, w.counter)]
            if sites:
                tid, i = rng.choice(sites)
                t = prog.tasks[tid]
                waits = [w for j, w in enumerate(t.waits) if j != i]
                return _set_task(prog, tid, waits=waits), f"attention task {tid} ({t.name}) no longer waits for the KV append (counter {t.waits[i].counter})"
        else:
            sites = []
            for t in readers:
                for i, o in enumerate(t.inputs):
                    if o.kv != KvMode.PREFIX:
                        continue
                    shape = prog.buffers[o.buf].shape
                    for b in prog.buffers:
                        if b.kind == K.KV_CACHE and b.id != o.buf and b.shape == shape:
                            appenders = [w for w in range(f.nt) if any(x.buf == b.id for x in f.writes_flat[w])]
                            if appenders and not all((f.hanc[t.id] >> w) & 1 for w in appenders):
                                sites.append((t.id, i, b.id))
            if sites:
                tid, i, bid = rng.choice(sites)
                return _set_operand(prog, tid, False, i, buf=bid), f"attention task {tid} reads KV cache {bid}, appended later in the step"
    return None


# ----------------------------------------------------------------------------- memory classes
def mut_tile(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """Shift one tile: an output off by a few elements (a gap and an overlap, or past the end)
    or an input past the end of its buffer."""
    v = rng.random()
    if v < 0.7:
        sites = [(t.id, i) for t in prog.tasks for i, o in enumerate(t.outputs)]
        tid, i = rng.choice(sites)
        o = prog.tasks[tid].outputs[i]
        delta = rng.choice([-1, 1]) * rng.randint(1, max(1, o.len))
        if o.off + delta < 0:
            delta = -delta
        return _set_operand(prog, tid, True, i, off=o.off + delta), f"task {tid} output {i} shifted by {delta}"
    sites = [(t.id, out, i) for t in prog.tasks for out, ops in ((False, t.inputs), (True, t.outputs)) for i in range(len(ops))]
    tid, out, i = rng.choice(sites)
    t = prog.tasks[tid]
    o = (t.outputs if out else t.inputs)[i]
    b = prog.buffers[o.buf]
    ext = b.shape[-1] if b.kind == K.KV_CACHE else b.numel
    span = (o.count - 1) * o.stride + o.len if o.count > 1 and o.kv == KvMode.NONE else o.len
    off = ext - span + rng.randint(1, max(1, o.len))
    return _set_operand(prog, tid, out, i, off=off), f"task {tid} {'output' if out else 'input'} {i} moved to end at {off + span} > {ext}"


def mut_dangling(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A reference to a buffer, counter, task or quantization companion that does not exist."""
    nb, nc, nt = len(prog.buffers), len(prog.counters), len(prog.tasks)
    far = rng.choice([0, 0, 1, 7, 1000])
    v = rng.randrange(5)
    t = rng.choice(prog.tasks)
    if v == 0:
        out = rng.random() < 0.5
        ops = t.outputs if out else t.inputs
        i = rng.randrange(len(ops))
        bad = nb + far if rng.random() < 0.85 else -1
        return _set_operand(prog, t.id, out, i, buf=bad), f"task {t.id} operand names buffer {bad}"
    if v == 1 and t.waits:
        waits = list(t.waits)
        i = rng.randrange(len(waits))
        waits[i] = ir.Wait(counter=nc + far, threshold=waits[i].threshold)
        return _set_task(prog, t.id, waits=waits), f"task {t.id} waits on counter {nc + far}"
    if v == 2:
        return _set_task(prog, t.id, out_counter=nc + far), f"task {t.id} signals counter {nc + far}"
    if v == 3:
        qs = [list(q) for q in prog.queues]
        qi = rng.randrange(len(qs))
        qs[qi].insert(rng.randint(0, len(qs[qi])), nt + far)
        return prog.replace(queues=qs), f"queue {qi} lists task {nt + far}"
    quant = [b for b in prog.buffers if b.scale is not None]
    if quant:
        b = rng.choice(quant)
        bufs = list(prog.buffers)
        bufs[b.id] = b.replace(scale=nb + far)
        return prog.replace(buffers=bufs), f"quantized weight {b.id} names scale buffer {nb + far}"
    return _set_task(prog, t.id, out_counter=nc + far), f"task {t.id} signals counter {nc + far}"


def mut_capacity(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """Over an ABI cap: more waits than a task record holds (each extra wait redundant), or a
    buffer over the addressable element count."""
    if rng.random() < 0.7:
        for t in rng.sample(prog.tasks, min(len(prog.tasks), 30)):
            have = {w.counter for w in t.waits}
            # counters all of whose producers already happen before t: waiting on them is harmless
            extra = [c for c in range(f.nc) if c not in have and f.producers[c] and c != t.out_counter
                     and all((f.hanc[t.id] >> p) & 1 for p in f.producers[c])]
            need = ir.MAX_WAITS + rng.randint(1, 2) - len(t.waits)
            if len(extra) >= need:
                add = rng.sample(extra, need)
                waits = list(t.waits) + [ir.Wait(counter=c, threshold=f.nprod[c]) for c in add]
                return _set_task(prog, t.id, waits=waits), f"task {t.id} has {len(waits)} waits (> MAX_WAITS={ir.MAX_WAITS})"
    rows = 1 << rng.randint(17, 22)
    cols = (ir.MAX_BUFFER_ELEMS // rows) + rng.randint(1, 1 << 10)
    prog, bid = _add_buffer(prog, name="huge", kind=K.SCRATCH, dtype=D.F32, shape=[rows, cols])
    return prog, f"buffer {bid} has {rows * cols} elements (> MAX_BUFFER_ELEMS)"


def mut_kv_range(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A KV position past the cache: kv_capacity above the caches' rows, or one cache short."""
    kv = [b for b in prog.buffers if b.kind == K.KV_CACHE]
    if not kv:
        return None
    r = rng.choice([1, 1, 2, 16])
    if rng.random() < 0.5 or all(b.shape[0] <= 1 for b in kv):
        return prog.replace(kv_capacity=prog.kv_capacity + r), f"kv_capacity {prog.kv_capacity} -> {prog.kv_capacity + r} (caches keep {kv[0].shape[0]} rows)"
    b = rng.choice([b for b in kv if b.shape[0] > 1])
    rows = max(1, b.shape[0] - r)
    bufs = list(prog.buffers)
    bufs[b.id] = b.replace(shape=[rows, b.shape[1]])
    return prog.replace(buffers=bufs), f"KV cache {b.id} ({b.name}) has {rows} rows for kv_capacity {prog.kv_capacity}"


def mut_coresidency(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """More queues than co-resident blocks: extra (empty) blocks, or a smaller GPU record."""
    t = prog.target
    per_cu = min(prog.blocks_per_cu, t.max_blocks_per_cu, t.max_threads_per_cu // prog.threads_per_block)
    nq = len(prog.queues)
    if rng.random() < 0.5 and nq >= 2:
        cus = rng.randint(1, max(1, (nq - 1) // per_cu))
        if cus * per_cu < nq:
            target = t.model_copy(update={"compute_units": cus, "name": f"{t.name}-{cus}cu"})
            return prog.replace(target=target), f"{nq} queues on a {cus}-CU {t.name} ({cus * per_cu} co-resident blocks)"
    limit = t.compute_units * per_cu
    extra = limit - nq + rng.randint(1, 8)
    return prog.replace(queues=list(prog.queues) + [[] for _ in range(extra)]), \
        f"{nq + extra} queues for {limit} co-resident blocks"


def mut_unscheduled(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A task in no queue (never runs) or in two (runs twice)."""
    t = rng.choice(prog.tasks)
    qs = [list(q) for q in prog.queues]
    if rng.random() < 0.5 or len(qs) < 2:
        qs[f.queue_of[t.id]].remove(t.id)
        return prog.replace(queues=qs), f"task {t.id} ({t.name}) removed from every queue"
    other = rng.choice([i for i in range(len(qs)) if i != f.queue_of[t.id]])
    qs[other].append(t.id)
    return prog.replace(queues=qs), f"task {t.id} ({t.name}) also queued at the end of queue {other}"


def mut_uninit_read(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """A read of an activation nothing writes: an input redirected to a fresh buffer."""
    sites = [(t.id, i) for t in prog.tasks for i, o in enumerate(t.inputs)
             if prog.buffers[o.buf].kind in (K.ACTIVATION, K.SCRATCH) and o.kv == KvMode.NONE]
    if not sites:
        return None
    tid, i = rng.choice(sites)
    o = prog.tasks[tid].inputs[i]
    src = prog.buffers[o.buf]
    prog, bid = _add_buffer(prog, name=f"{src.name}.unwritten", kind=src.kind, dtype=src.dtype, shape=list(src.shape))
    return _set_operand(prog, tid, False, i, buf=bid), f"task {tid} reads fresh buffer {bid} instead of {src.name}"


def mut_read_only_write(prog: ir.Program, f: Facts, rng: random.Random) -> Mutant:
    """An output redirected into a weight buffer."""
    weights = [b for b in prog.buffers if b.kind in (K.WEIGHT, K.CONST) and b.dtype in (D.F32, D.F16, D.BF16)]
    sites = [(t.id, i) for t in prog.tasks for i, o in enumerate(t.outputs) if o.kv == KvMode.NONE
             and any(b.numel >= o.off + o.len for b in weights)]
    if not sites:
        return None
    tid, i = rng.choice(sites)
    o = prog.tasks[tid].outputs[i]
    b = rng.choice([b for b in weights if b.numel >= o.off + o.len])
    return _set_operand(prog, tid, True, i, buf=b.id), f"task {tid} writes into {b.kind.name} buffer {b.id} ({b.name})"


MUTATORS: dict[str, Callable[[ir.Program, Facts, random.Random], Mutant]] = {
    "cycle": mut_cycle,
    "self-wait": mut_self_wait,
    "dropped-wait": mut_dropped_wait,
    "partial-wait": mut_partial_wait,
    "threshold": mut_threshold,
    "write-after-read": mut_write_after_read,
    "write-after-write": mut_write_after_write,
    "kv-before-append": mut_kv_before_append,
    "queue-order-deadlock": mut_queue_order_deadlock,
    "tile": mut_tile,
    "dangling": mut_dangling,
    "capacity": mut_capacity,
    "kv-range": mut_kv_range,
    "coresidency": mut_coresidency,
    "unscheduled": mut_unscheduled,
    "uninit-read": mut_uninit_read,
    "read-only-write": mut_read_only_write,
}
