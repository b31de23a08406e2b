"""Random well-formed programs for the soundness campaign.

`random_program(rng)` builds a small decode-step-shaped program from every op kind (EMBED,
RMSNORM, GEMV with norm/ADD epilogues, ADD, SILU_MUL, ROPE, HEAD_NORM, KV_APPEND,
ATTN_PARTIAL, ATTN_COMBINE, ARGMAX) with valid arity and params and operands that follow
ir.py's contracts. Tasks come in groups that share a counter; each task's waits are derived
from the regions it touches (read-after-write, write-after-read, write-after-write against
earlier groups, transitively reduced), queues are filled in creation order: the construction
is safe. With `perturb=True` one to three random edits follow (drop a wait, change a
threshold, wait on a later group, reorder or move queue entries, shift a tile, redirect an
operand), some harmless and some not; the oracle decides which.

Programs are small (mostly <= 24 tasks) so the oracle can explore them exhaustively.
"""

from __future__ import annotations

import random
from typing import Optional

from amk.schedule import ir
from amk.schedule.ir import BufferKind as K
from amk.schedule.ir import DType as D
from amk.schedule.ir import Epilogue, KvMode, Operand
from amk.schedule.lower import tiles as _tiles
from amk.schedule.targets import get_target

TARGETS = ("h100", "a10g", "mi300x")


class _Gen:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.buffers: list[ir.Buffer] = []
        self.counters: list[ir.Counter] = []
        self.tasks: list[ir.Task] = []
        self.group_size: list[int] = []
        self.anc: list[int] = []  # group -> bitset of ancestor groups
        self.last: dict[int, list[int]] = {}  # buffer -> per element last writer group (-1 none)
        self.readers: dict[int, list[set]] = {}  # buffer -> per element reader groups since that write
        self.written: dict[int, list[bool]] = {}

    def buf(self, name, kind, dtype, shape) -> int:
        b = ir.Buffer(id=len(self.buffers), name=name, kind=kind, dtype=dtype, shape=list(shape))
        self.buffers.append(b)
        if kind not in (K.WEIGHT, K.CONST, K.IO_INPUT):
            n = shape[-1] if kind == K.KV_CACHE else b.numel
            self.last[b.id] = [-1] * n
            self.readers[b.id] = [set() for _ in range(n)]
            self.written[b.id] = [False] * n
        return b.id

    @staticmethod
    def _elems(o: Operand) -> list[int]:
        if o.kv != KvMode.NONE or o.count <= 1:
            return list(range(o.off, o.off + o.len))
        return [o.off + c * o.stride + i for c in range(o.count) for i in range(o.len)]

    def group(self, name: str, specs: list[tuple[object, list[Operand], list[Operand]]]) -> int:
        """Emit tasks sharing one counter; waits from the hazards against earlier groups."""
        g = len(self.counters)
        self.counters.append(ir.Counter(id=g, name=name))
        pending = []
        for i, (params, ins, outs) in enumerate(specs):
            deps: set[int] = set()
            for o in ins:
                if o.buf in self.last:
                    for e in self._elems(o):
                        if self.last[o.buf][e] >= 0:
                            deps.add(self.last[o.buf][e])
            for o in outs:
                if o.buf in self.last:
                    for e in self._elems(o):
                        if self.last[o.buf][e] >= 0:
                            deps.add(self.last[o.buf][e])
                        deps |= self.readers[o.buf][e]
            implied = 0
            for d in deps:
                implied |= self.anc[d]
            waits = [ir.Wait(counter=d, threshold=self.group_size[d]) for d in sorted(deps) if not (implied >> d) & 1]
            self.tasks.append(ir.Task(id=len(self.tasks), params=params, inputs=ins, outputs=outs, waits=waits[:ir.MAX_WAITS],
                                      out_counter=g, name=f"{name}.{i}"))
            pending.append((ins, outs, deps))
        anc = 0
        for _, _, deps in pending:
            for d in deps:
                anc |= (1 << d) | self.anc[d]
        self.anc.append(anc)
        self.group_size.append(len(specs))
        for ins, outs, _ in pending:
            for o in outs:
                if o.buf in self.last:
                    for e in self._elems(o):
                        self.last[o.buf][e] = g
                        self.readers[o.buf][e] = set()
                        self.written[o.buf][e] = True
        for ins, _outs, _ in pending:
            for o in ins:
                if o.buf in self.last:
                    for e in self._elems(o):
                        self.readers[o.buf][e].add(g)
        return g

    def full(self, b: int) -> bool:
        return all(self.written[b])


def random_program(rng: random.Random, *, perturb: bool = False, max_stages: int = 5) -> tuple[ir.Program, str]:
    g = _Gen(rng)
    hd = rng.choice([4, 8])
    kvh = rng.choice([1, 2])
    qh = rng.choice([1, 2])
    n = kvh * qh * hd  # one vector: also the query of the attention stage
    vocab = rng.choice([8, 16])
    cap = rng.randint(1, 6)
    token = g.buf("token", K.IO_INPUT, D.I32, [1])
    pos = g.buf("pos", K.IO_INPUT, D.I32, [1])
    table = g.buf("table", K.WEIGHT, D.F32, [vocab, n])
    wmat = g.buf("w", K.WEIGHT, D.F32, [n, n])
    gamma = g.buf("gamma", K.WEIGHT, D.F32, [n])
    hgamma = g.buf("head_gamma", K.WEIGHT, D.F32, [hd])
    inv = g.buf("inv_freq", K.CONST, D.F32, [hd // 2])
    acts = [g.buf(f"a{i}", K.ACTIVATION, D.F32, [n]) for i in range(rng.randint(2, 4))]
    out = g.buf("out", K.IO_OUTPUT, D.F32, [n])
    nxt = g.buf("next", K.IO_OUTPUT, D.I32, [1])
    kc = vc = o_part = ml = None

    def parts() -> list[tuple[int, int]]:
        return _tiles(n, rng.choice([1, 1, 2, 2, 3, 4]))

    def op(b, off, ln, **kw) -> Operand:
        return Operand(buf=b, off=off, len=ln, **kw)

    # embed: writes a0 in tiles
    g.group("embed", [(ir.EmbedParams(vocab=vocab, hidden=n), [op(token, 0, 1), op(table, c0, c1 - c0, count=vocab, stride=n)],
                       [op(acts[0], c0, c1 - c0)]) for c0, c1 in parts()])
    stages = ["add", "silu", "rmsnorm", "gemv", "rope", "head_norm", "attention"]
    for si in range(rng.randint(1, max_stages)):
        kind = rng.choice(stages)
        ready = [a for a in acts if g.full(a)]
        src = rng.choice(ready)
        dst = rng.choice(acts)
        name = f"s{si}.{kind}"
        if kind in ("add", "silu"):
            other = rng.choice(ready)
            mk = ir.AddParams if kind == "add" else ir.SiluMulParams
            g.group(name, [(mk(n=c1 - c0), [op(src, c0, c1 - c0), op(other, c0, c1 - c0)], [op(dst, c0, c1 - c0)])
                           for c0, c1 in parts()])
        elif kind == "rmsnorm":
            dst = rng.choice([a for a in acts if a != src])
            g.group(name, [(ir.RmsNormParams(hidden=n, col=c0, eps=1e-5), [op(src, 0, n), op(gamma, c0, c1 - c0)],
                            [op(dst, c0, c1 - c0)]) for c0, c1 in parts()])
        elif kind == "gemv":
            dst = rng.choice([a for a in acts if a != src])
            norm = rng.random() < 0.5
            add = rng.random() < 0.4 and g.full(dst)
            specs = []
            for r0, r1 in parts():
                rows = r1 - r0
                ins = [op(wmat, r0 * n, n, count=rows, stride=n), op(src, 0, n)] + ([op(gamma, 0, n)] if norm else [])
                if add:
                    ins.append(op(dst, r0, rows))
                specs.append((ir.GemvParams(rows=rows, k=n, k_hi=n, norm_eps=1e-5 if norm else None,
                                            epilogue=Epilogue.ADD if add else Epilogue.STORE), ins, [op(dst, r0, rows)]))
            g.group(name, specs)
        elif kind in ("rope", "head_norm"):
            dst = rng.choice([a for a in acts if a != src])  # in place, a head's threads would race
            heads = n // hd
            specs = []
            for h0, h1 in _tiles(heads, rng.choice([1, 2, 3])):
                off, ln = h0 * hd, (h1 - h0) * hd
                if kind == "rope":
                    specs.append((ir.RopeParams(head_dim=hd, heads=h1 - h0), [op(src, off, ln), op(inv, 0, hd // 2), op(pos, 0, 1)],
                                  [op(dst, off, ln)]))
                else:
                    specs.append((ir.HeadNormParams(head_dim=hd, heads=h1 - h0, eps=1e-5), [op(src, off, ln), op(hgamma, 0, hd)],
                                  [op(dst, off, ln)]))
            g.group(name, specs)
        else:  # attention: append k and v, partials over splits, combine
            if kc is None:
                kc = g.buf("k_cache", K.KV_CACHE, D.F32, [cap, kvh * hd])
                vc = g.buf("v_cache", K.KV_CACHE, D.F32, [cap, kvh * hd])
            splits = rng.randint(1, 3)
            o_part = g.buf(f"{name}.o_partial", K.SCRATCH, D.F32, [kvh * splits * qh * hd])
            ml = g.buf(f"{name}.ml", K.SCRATCH, D.F32, [kvh * splits * qh * 2])
            kv_src = rng.choice(ready)
            g.group(f"{name}.append", [(ir.KvAppendParams(n=hd), [op(kv_src, h * hd, hd), op(pos, 0, 1)],
                                        [op(cache, h * hd, hd, kv=KvMode.APPEND)]) for cache in (kc, vc) for h in range(kvh)])
            g.group(f"{name}.partial", [
                (ir.AttnPartialParams(head_dim=hd, q_heads=qh, splits=splits, split=s, block=8, scale=0.5),
                 [op(src, h * qh * hd, qh * hd), op(kc, h * hd, hd, kv=KvMode.PREFIX), op(vc, h * hd, hd, kv=KvMode.PREFIX),
                  op(pos, 0, 1)],
                 [op(o_part, (h * splits + s) * qh * hd, qh * hd), op(ml, (h * splits + s) * qh * 2, qh * 2)])
                for h in range(kvh) for s in range(splits)])
            g.group(f"{name}.combine", [
                (ir.AttnCombineParams(head_dim=hd, q_heads=qh, splits=splits),
                 [op(o_part, h * splits * qh * hd, splits * qh * hd), op(ml, h * splits * qh * 2, splits * qh * 2)],
                 [op(dst, h * qh * hd, qh * hd)]) for h in range(kvh)])
    # the outputs: a head GEMV into `out`, then argmax
    last = rng.choice([a for a in acts if g.full(a)])
    g.group("head", [(ir.GemvParams(rows=r1 - r0, k=n, k_hi=n), [op(wmat, r0 * n, n, count=r1 - r0, stride=n), op(last, 0, n)],
                      [op(out, r0, r1 - r0)]) for r0, r1 in parts()])
    g.group("argmax", [(ir.ArgmaxParams(n=n), [op(out, 0, n)], [op(nxt, 0, 1)])])

    nq = rng.randint(1, 4)
    if rng.random() < 0.5:
        where = [i % nq for i in range(len(g.tasks))]
    else:
        where = [rng.randrange(nq) for _ in g.tasks]
    queues: list[list[int]] = [[] for _ in range(nq)]
    for t, q in zip(g.tasks, where):
        queues[q].append(t.id)
    prog = ir.Program(name="random", target=get_target(rng.choice(TARGETS)), kv_capacity=cap if kc is not None else 0,
                      buffers=g.buffers, counters=g.counters, tasks=g.tasks, queues=[q for q in queues if q])
    if not perturb:
        return prog, f"random safe construction: {len(g.tasks)} tasks, {len(prog.queues)} queues"
    edits = [_perturb(prog, rng, g.group_size) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    for e in edits:
        if e is not None:
            prog = e[0]
    return prog, "random + " + "; ".join(e[1] for e in edits if e is not None)


def _perturb(prog: ir.Program, rng: random.Random, size: list[int]) -> Optional[tuple[ir.Program, str]]:
    t = rng.choice(prog.tasks)
    kind = rng.choice(["drop", "threshold", "threshold", "later", "self", "shuffle", "move", "shift", "redirect"])
    if kind == "drop" and t.waits:
        i = rng.randrange(len(t.waits))
        return prog.with_tasks(t.replace(waits=[w for j, w in enumerate(t.waits) if j != i])), f"task {t.id} drops wait {i}"
    if kind == "threshold" and t.waits:
        i = rng.randrange(len(t.waits))
        w = t.waits[i]
        th = rng.choice([0, 1, max(1, w.threshold - 1), w.threshold + 1])
        waits = list(t.waits)
        waits[i] = ir.Wait(counter=w.counter, threshold=th)
        return prog.with_tasks(t.replace(waits=waits)), f"task {t.id} waits for {th} on counter {w.counter}"
    if kind in ("later", "self") and len(t.waits) < ir.MAX_WAITS:
        c = t.out_counter if kind == "self" else rng.randrange(t.out_counter, len(prog.counters))
        th = rng.randint(1, size[c])
        return (prog.with_tasks(t.replace(waits=[*t.waits, ir.Wait(counter=c, threshold=th)])),
                f"task {t.id} also waits for {th} on counter {c}")
    if kind == "shuffle":
        qs = [list(q) for q in prog.queues]
        q = rng.choice(qs)
        rng.shuffle(q)
        return prog.replace(queues=qs), "one queue shuffled"
    if kind == "move":
        qs = [list(q) for q in prog.queues]
        src = next(q for q in qs if t.id in q)
        src.remove(t.id)
        dst = rng.choice(qs)
        dst.insert(rng.randint(0, len(dst)), t.id)
        return prog.replace(queues=[q for q in qs if q]), f"task {t.id} moved"
    if kind == "shift":
        i = rng.randrange(len(t.outputs))
        o = t.outputs[i]
        outs = list(t.outputs)
        outs[i] = o.replace(off=max(0, o.off + rng.choice([-2, -1, 1, 2])))
        return prog.with_tasks(t.replace(outputs=outs)), f"task {t.id} output {i} shifted"
    if kind == "redirect":
        acts = [b.id for b in prog.buffers if b.kind == K.ACTIVATION]
        flat = [i for i, o in enumerate(t.inputs) if prog.buffers[o.buf].kind == K.ACTIVATION]
        if flat:
            i = rng.choice(flat)
            ins = list(t.inputs)
            ins[i] = ins[i].replace(buf=rng.choice(acts))
            return prog.with_tasks(t.replace(inputs=ins)), f"task {t.id} input {i} redirected"
    return None
