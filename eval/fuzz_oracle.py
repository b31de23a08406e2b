"""The independent oracle of the soundness campaign: ground truth by *execution*.

It neither imports nor re-implements `validate()`. Where the validator reasons statically
over intervals and a topological order, this module runs the program: every queue is a
persistent block that walks its entries in order; a step picks one block whose head task
is enabled (each wait `counter >= threshold` holds), executes that task and adds 1 to its
counter. Memory is tracked per element (regions as ir.py "Regions" defines them, the KV
cache at a concrete runtime position: runs at pos = kv_capacity - 1, bounds checked at
pos = 0 too; the elements a step can write - row pos of a cache - are the same at every
position, so only the bounds differ) and ordering with vector clocks over the blocks:

  * a block's clock advances with each task it runs (program order within a block);
  * a task's release publishes its clock on its counter; an acquire (a passed wait) joins
    the clocks of the releases that counter has seen *so far in this interleaving* - the
    producers that really incremented it before the wait passed. A wait for k of N
    producers therefore learns nothing about the N - k that have not run yet. A counter
    of XCD scope (chiplet GPUs: queue q runs on XCD q % target.xcds) publishes a release
    only to acquires on the releasing block's XCD; its count still reaches every block;
  * per element group: the last write epoch and the read epochs since that write
    (FastTrack style). A read unordered with the last write, or a write unordered with the
    last write or a read since, is a data race.

Findings (any one makes the program unsafe):
  deadlock            no block's head is enabled but some block is not done
  race                two conflicting accesses of one element unordered by happens-before
  out-of-bounds       an access outside its buffer (a KV row >= the cache's rows, columns
                      past its width, or no valid position at all)
  uninitialized-read  an ACTIVATION/SCRATCH/IO_OUTPUT element (or the KV row at pos) read
                      when no task of this step wrote it before the read in happens-before
  incomplete-output   an IO_OUTPUT element no task wrote by the end of the step
  read-only-write     a write to a WEIGHT/CONST/IO_INPUT buffer
  unscheduled         a task that sits in no queue never runs
  malformed           references that do not resolve, arity or operand contracts that do
                      not match the op (a VM would read garbage), a task scheduled twice,
                      a weight role on a mutable buffer (weights are prefetched before waits)
  capacity            counts over the ABI caps of ir.py (the VM's tables cannot hold them)
  coresidency         more queues than co-resident blocks: the cooperative launch fails

Exploring interleavings. Counters only grow, so a step never disables another block's
head: the system is confluent, and whether it deadlocks is decided by any one maximal run.
If every wait needs *all* increments its counter will ever get (threshold >= number of
scheduled producers), each acquire joins the same releases in every interleaving, so
happens-before - and hence every race and stale read - is the same in all of them: one run
is exact. Otherwise (partial waits, a task scheduled twice) the oracle explores: small
programs exhaustively (depth-first over every enabled choice, with state hashing), larger
ones by systematic sampling (starve each producer of a partially awaited counter, random
runs, PCT priority runs). Sampling can miss a race, never invent one: every finding is a
concrete execution. `Verdict.exact` says which case held.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.ir import BufferKind as K, DType as D, Epilogue, KvMode, Op
from amk.schedule.opspec import output_roles, weight_input_roles

LABELS = ("deadlock", "race", "out-of-bounds", "uninitialized-read", "incomplete-output", "read-only-write",
          "unscheduled", "malformed", "capacity", "coresidency")

READ_ONLY = frozenset({K.WEIGHT, K.CONST, K.IO_INPUT})
IMMUTABLE = frozenset({K.WEIGHT, K.CONST})
ELEMENTWISE_ROLES = frozenset({"residual", "a", "b", "gate", "up"})  # read then written by the same thread
WEIGHT_ROLES = frozenset({"w", "w2", "gamma", "w_scale", "w_zero", "w2_scale", "w2_zero", "bias", "head_gamma",
                          "inv_freq", "table"})
QUANT = frozenset({D.I8, D.U4})
MAX_MATERIALIZE = 1 << 24  # elements of one mutable operand the oracle will enumerate


@dataclass(frozen=True)
class Verdict:
    safe: bool
    labels: tuple[str, ...]
    witness: str  # the first finding, in words
    exact: bool  # True: no interleaving left unexplored that could change the verdict
    mode: str  # static | single | exhaustive | sampled
    runs: int  # executions (or explored states, in exhaustive mode)

    def as_dict(self) -> dict:
        return {"safe": self.safe, "labels": list(self.labels), "witness": self.witness, "exact": self.exact,
                "mode": self.mode, "runs": self.runs}


class _Stop(Exception):
    """The program cannot be executed at all (unresolvable references, unknown arity)."""

    def __init__(self, label: str, why: str):
        super().__init__(why)
        self.label, self.why = label, why


def judge(program: Any, *, seed: int = 0, exhaustive_tasks: int = 24, max_states: int = 6000,
          starve_cap: int = 32, random_runs: int = 4, pct_runs: int = 4) -> Verdict:
    """Execute `program` (Program, dict or JSON) and say whether any interleaving is unsafe."""
    try:
        prog = _as_program(program)
    except Exception as exc:  # noqa: BLE001 - anything unreadable is malformed
        return Verdict(False, ("malformed",), f"not a Program: {type(exc).__name__}: {str(exc)[:160]}", True, "static", 0)
    static: list[tuple[str, str]] = []
    try:
        model = _Static(prog, static)
        ex = _Exec(model, model.positions[0])
        for pos in model.positions[1:]:
            ex.add_bounds(pos)
    except _Stop as stop:
        labels = sorted({stop.label} | {lab for lab, _ in static})
        return Verdict(False, tuple(labels), stop.why, True, "static", 0)
    if model.huge:  # counts over the caps: do not try to simulate a million queues
        return _verdict(static, [], True, "static", 0)

    findings = ex.run(_lowest)  # the canonical run decides deadlock (confluence)
    runs = 1
    if static or findings or model.deterministic:
        return _verdict(static, findings, True, "single", runs)
    if model.n_instances <= exhaustive_tasks:
        found, states, complete = ex.exhaustive(max_states)
        if found or complete:
            return _verdict(static, found, complete, "exhaustive", states)
    rng = random.Random(seed)
    found, n = ex.sample(rng, starve_cap, random_runs, pct_runs)
    return _verdict(static, found, False, "sampled", runs + n)


def _verdict(static, findings, exact, mode, runs) -> Verdict:
    allf = list(static) + list(findings)
    if not allf:
        return Verdict(True, (), "", exact, mode, runs)
    labels = tuple(sorted({lab for lab, _ in allf}))
    return Verdict(False, labels, f"{allf[0][0]}: {allf[0][1]}", True, mode, runs)


def _as_program(program: Any) -> ir.Program:
    if isinstance(program, ir.Program):
        return program
    if isinstance(program, (str, bytes, bytearray)):
        return ir.Program.model_validate_json(program)
    if isinstance(program, dict):
        return ir.Program.model_validate(json.loads(json.dumps(program)))
    raise TypeError(f"cannot read a {type(program).__name__} as a Program")


# ----------------------------------------------------------------------------- the static facts
class _Static:
    """What the hardware and the VM need before anything runs: resolvable references, op
    contracts, launch geometry. Records findings in `static`; raises _Stop when the program
    cannot be executed at all."""

    def __init__(self, prog: ir.Program, static: list):
        self.prog = prog
        self.static = static
        self.huge = False
        nb, nc, nt = len(prog.buffers), len(prog.counters), len(prog.tasks)
        for what, n, cap in (("tasks", nt, ir.MAX_TASKS), ("buffers", nb, ir.MAX_BUFFERS),
                             ("counters", nc, ir.MAX_COUNTERS), ("queues", len(prog.queues), ir.MAX_QUEUES)):
            if n > cap:
                static.append(("capacity", f"{n} {what} do not fit the VM's table of {cap}"))
                self.huge = True
        for seq, what in ((prog.buffers, "buffer"), (prog.counters, "counter"), (prog.tasks, "task")):
            for i, x in enumerate(seq):
                if x.id != i:
                    raise _Stop("malformed", f"{what} at index {i} carries id {x.id}: references to it are ambiguous")
        self._launch()
        for b in prog.buffers:
            self._buffer(b)
        self.roles: list[tuple[list[str], list[str]]] = []
        self._roles: dict = {}  # (params, weight) -> roles, contract, KV modes: shared by equal tasks
        self.kv_used = False
        for t in prog.tasks:
            self.roles.append(self._task(t))
        self._queues()
        cap = prog.kv_capacity
        if self.kv_used and cap < 1:
            raise _Stop("out-of-bounds", f"kv_capacity {cap}: no runtime position is valid for the KV operands")
        self.positions = sorted({max(cap, 1) - 1, 0}, reverse=True) if self.kv_used else [0]
        # how many increments each counter will ever get, and whether any wait can pass early
        incs = [0] * nc
        for q in self.queues:
            for t in q:
                incs[prog.tasks[t].out_counter] += 1
        self.deterministic = all(w.threshold >= incs[w.counter] for q in self.queues for t in q
                                 for w in prog.tasks[t].waits)
        self.partial_counters = sorted({w.counter for q in self.queues for t in q for w in prog.tasks[t].waits
                                        if w.threshold < incs[w.counter]})
        self.n_instances = sum(len(q) for q in self.queues)

    def _launch(self) -> None:
        p, t = self.prog, self.prog.target
        tpb = p.threads_per_block
        if t.warp_size < 1 or tpb < t.warp_size or tpb > ir.MAX_THREADS or tpb % t.warp_size:
            self.static.append(("coresidency", f"a block of {tpb} threads cannot launch on {t.name} (warp {t.warp_size})"))
            return
        per_cu = min(p.blocks_per_cu, t.max_blocks_per_cu, t.max_threads_per_cu // tpb)
        blocks = t.compute_units * per_cu if p.blocks_per_cu >= 1 else 0
        if len(p.queues) > blocks:
            self.static.append(("coresidency", f"{len(p.queues)} persistent blocks but only {max(blocks, 0)} can be "
                                f"co-resident on {t.name} at {tpb} threads: the cooperative launch fails"))

    def _buffer(self, b: ir.Buffer) -> None:
        if not (1 <= len(b.shape) <= ir.MAX_RANK) or any(d < 1 for d in b.shape):
            raise _Stop("malformed", f"buffer {b.id} ({b.name}) has shape {b.shape}: it cannot be allocated")
        if b.numel > ir.MAX_BUFFER_ELEMS:
            self.static.append(("capacity", f"buffer {b.id} ({b.name}) has {b.numel} elements, over the VM's "
                                f"addressable {ir.MAX_BUFFER_ELEMS}"))
        if b.kind == K.KV_CACHE and len(b.shape) != 2:
            raise _Stop("malformed", f"KV cache {b.id} ({b.name}) has shape {b.shape}; it must be [rows, width]")
        if b.dtype in QUANT and b.kind == K.WEIGHT:
            nb = len(self.prog.buffers)
            comps = [("scale", b.scale)] + ([("zero", b.zero)] if b.dtype == D.U4 or b.zero is not None else [])
            for what, cid in comps:
                if cid is None or not (0 <= cid < nb):
                    raise _Stop("malformed", f"quantized weight {b.id} ({b.name}) names {what} buffer {cid}, which "
                                "does not exist: the loader cannot bind it")

    def _task(self, t: ir.Task) -> tuple[list[str], list[str]]:
        prog = self.prog
        nb, nc = len(prog.buffers), len(prog.counters)
        if not (0 <= t.out_counter < nc):
            raise _Stop("malformed", f"task {t.id} signals counter {t.out_counter}, which does not exist")
        for w in t.waits:
            if not (0 <= w.counter < nc):
                raise _Stop("malformed", f"task {t.id} waits on counter {w.counter}, which does not exist")
        for o in list(t.inputs) + list(t.outputs):
            if not (0 <= o.buf < nb):
                raise _Stop("malformed", f"task {t.id} names buffer {o.buf}, which does not exist")
        if len(t.inputs) > ir.MAX_INPUTS or len(t.outputs) > ir.MAX_OUTPUTS or len(t.waits) > ir.MAX_WAITS:
            self.static.append(("capacity", f"task {t.id} has {len(t.inputs)} inputs, {len(t.outputs)} outputs, "
                                f"{len(t.waits)} waits; its VM record holds {ir.MAX_INPUTS}/{ir.MAX_OUTPUTS}/{ir.MAX_WAITS}"))
        p = t.params
        wbuf = prog.buffers[t.inputs[0].buf] if p.op == Op.GEMV and t.inputs else None
        key = (type(p), tuple(p.__dict__.values()), None if wbuf is None else (wbuf.dtype, wbuf.group, wbuf.id, wbuf.zero))
        hit = self._roles.get(key)
        if hit is None:
            try:
                rin = weight_input_roles(p, wbuf)
                rout = output_roles(p)
            except Exception as exc:  # noqa: BLE001
                raise _Stop("malformed", f"task {t.id}: its params name no operand roles ({exc})") from None
            want = _contract(p, rin, rout, wbuf)
            kv = ([_kv_role(p, r, False) for r in rin], [_kv_role(p, r, True) for r in rout])
            hit = self._roles[key] = (rin, rout, want, kv)
        rin, rout, want, kv = hit
        if len(rin) != len(t.inputs) or len(rout) != len(t.outputs):
            raise _Stop("malformed", f"task {t.id} ({p.op.name}) has {len(t.inputs)}/{len(t.outputs)} operands; its "
                        f"op reads {rin} and writes {rout}")
        for ops, roles, kvs, write in ((t.inputs, rin, kv[0], False), (t.outputs, rout, kv[1], True)):
            for o, role, kv_role in zip(ops, roles, kvs):
                self._operand(t, o, role, kv_role, write, want.get(role))
        if p.op == Op.EMBED and t.inputs[1].len != t.outputs[0].len:
            raise _Stop("malformed", f"task {t.id} (EMBED): table tile and output differ in length")
        if p.op == Op.RMSNORM and (t.inputs[1].len != t.outputs[0].len or p.col + t.outputs[0].len > p.hidden):
            raise _Stop("malformed", f"task {t.id} (RMSNORM): gamma tile and output must span [col, col+n) in hidden")
        return rin, rout

    def _operand(self, t: ir.Task, o: ir.Operand, role: str, kv_role: KvMode, write: bool, want) -> None:
        b = self.prog.buffers[o.buf]
        kind = b.kind

        def where() -> str:
            return f"task {t.id} ({t.params.op.name}) {role} on buffer {b.id} ({b.name})"

        if o.len < 1 or o.count < 1 or (o.count > 1 and o.stride < 0):
            raise _Stop("malformed", f"{where()}: len {o.len}, count {o.count}, stride {o.stride} name no elements")
        if kind == K.KV_CACHE or o.kv != KvMode.NONE or kv_role != KvMode.NONE:
            if kind != K.KV_CACHE or o.kv != kv_role or o.count != 1:
                raise _Stop("malformed", f"{where()}: KV mode {o.kv.name} x{o.count} on a {kind.name} buffer, role "
                            f"wants {kv_role.name}")
            self.kv_used = True
        if want is not None:
            ln, cnt, stride = want
            if (ln is not None and o.len != ln) or o.count != cnt or (cnt > 1 and stride is not None and o.stride != stride):
                raise _Stop("malformed", f"{where()}: operand len {o.len} x{o.count} (stride {o.stride}) but the op "
                            f"touches len {ln} x{cnt} (stride {stride})")
        if write:
            if kind in READ_ONLY:
                self.static.append(("read-only-write", f"{where()} writes a {kind.name} buffer"))
        elif kind not in IMMUTABLE and role in WEIGHT_ROLES:
            raise _Stop("malformed", f"{where()}: a weight role is prefetched before the task's waits, so it must be "
                        f"an immutable buffer, not {kind.name}")

    def _queues(self) -> None:
        prog = self.prog
        nt = len(prog.tasks)
        seen = [0] * nt
        for qi, q in enumerate(prog.queues):
            for tid in q:
                if not (0 <= tid < nt):
                    raise _Stop("malformed", f"queue {qi} lists task {tid}, which does not exist")
                seen[tid] += 1
        self.queues = [list(q) for q in prog.queues if q]
        self.queue_xcd = [qi % max(prog.target.xcds, 1) for qi, q in enumerate(prog.queues) if q]
        never = [i for i, n in enumerate(seen) if n == 0]
        twice = [i for i, n in enumerate(seen) if n > 1]
        if never:
            self.static.append(("unscheduled", f"{len(never)} task(s) sit in no queue and never run (first {never[:5]})"))
        if twice:
            self.static.append(("malformed", f"task(s) {twice[:5]} are queued more than once: each run signals its "
                                "counter again"))


def _kv_role(p, role: str, write: bool) -> KvMode:
    if not write:
        return KvMode.PREFIX if p.op == Op.ATTN_PARTIAL and role in ("k", "v") else KvMode.NONE
    if p.op == Op.KV_APPEND:
        return KvMode.APPEND
    if p.op in (Op.GEMV, Op.REDUCE) and role == "y" and p.epilogue in (Epilogue.ROPE_APPEND, Epilogue.APPEND):
        return KvMode.APPEND
    return KvMode.NONE


def _contract(p, rin: list[str], rout: list[str], wbuf: Optional[ir.Buffer]) -> dict[str, tuple]:
    """role -> (len or None, count, stride or None): the elements each op touches (ir.py)."""
    op = p.op
    one = lambda n: (n, 1, None)  # noqa: E731
    if op in (Op.GEMV, Op.REDUCE):
        m = 2 if p.epilogue == Epilogue.SILU_MUL else 1
        want = {"bias": one(p.rows), "residual": one(p.rows), "head_gamma": one(p.head_dim),
                "inv_freq": one(p.rows // 2), "pos": one(1), "y": one(p.rows), "partial": one(p.rows * m),
                "pair": one(2)}
        if op == Op.REDUCE:
            want["partials"] = (p.rows * m, p.split_k, None)
            return want
        span = p.k_hi - p.k_lo
        want.update({"w": (span, p.rows, p.k), "w2": (span, p.rows, p.k), "gamma": one(p.k),
                     "x": one(p.k if p.norm_eps is not None else span),
                     "x_part": (p.k, p.x_partials, None), "res_part": (p.rows, p.residual_partials, None)})
        if p.combine_splits > 0 and p.combine_head_dim > 0:  # x from the attention partials of the slice's KV heads
            heads = span // p.combine_head_dim
            want.update({"o": one(heads * p.combine_splits * p.combine_head_dim), "ml": one(heads * p.combine_splits * 2)})
        if wbuf is not None and wbuf.dtype in QUANT:
            g = wbuf.group or 0
            if g < 1:
                raise _Stop("malformed", f"quantized weight {wbuf.id} ({wbuf.name}) has no group size")
            for r in ("w_scale", "w_zero", "w2_scale", "w2_zero"):
                want[r] = (span // g, p.rows, p.k // g)
        return want
    if op == Op.EMBED:
        return {"token": one(1), "table": (None, p.vocab, p.hidden), "x": one(None)}
    if op == Op.RMSNORM:
        return {"x": one(p.hidden), "gamma": one(None), "y": one(None)}
    if op in (Op.ROPE, Op.HEAD_NORM):
        n = p.heads * p.head_dim
        return {"x": one(n), "inv_freq": one(p.head_dim // 2), "pos": one(1), "gamma": one(p.head_dim), "y": one(n)}
    if op == Op.KV_APPEND:
        return {"src": one(p.n), "pos": one(1), "cache": one(p.n)}
    if op == Op.ATTN_PARTIAL:
        qn = p.q_heads * p.head_dim
        return {"q": one(qn), "k": one(p.head_dim), "v": one(p.head_dim), "pos": one(1), "o": one(qn),
                "ml": one(p.q_heads * 2)}
    if op == Op.ATTN_COMBINE:
        qn = p.q_heads * p.head_dim
        return {"o": one(p.splits * qn), "ml": one(p.splits * p.q_heads * 2), "y": one(qn)}
    if op in (Op.SILU_MUL, Op.ADD):
        return {"gate": one(p.n), "up": one(p.n), "a": one(p.n), "b": one(p.n), "y": one(p.n)}
    if op == Op.ARGMAX:  # PARTIAL: a slice -> its (max, index) pair; MERGE: n pairs -> the token
        return {"logits": one(2 * p.n if p.mode == ir.ArgmaxMode.MERGE else p.n),
                "token": one(2 if p.mode == ir.ArgmaxMode.PARTIAL else 1)}
    return {}


# ----------------------------------------------------------------------------- memory at one position
class _Exec:
    """The program's accesses at one runtime position, as element groups, and the runs.

    Only elements a step can write are tracked: every element of ACTIVATION, SCRATCH and
    IO_OUTPUT buffers and row `pos` of each KV cache (rows below pos are history: valid
    before the step and never written by it, since every KV write is an APPEND at row pos,
    so no access to them can race or read stale data). None of them holds valid data
    before the step. Elements touched by exactly the same operands are merged into one
    group (an element-exact coordinate compression: each element of a group has the same
    access history in every run); the runs then work per group."""

    BUF_SHIFT = 37  # element id = buffer << 37 | index (MAX_BUFFER_ELEMS = 2**36)

    def __init__(self, st: _Static, pos: int):
        prog = st.prog
        self.st, self.pos = st, pos
        self.queues = st.queues
        nt = len(prog.tasks)
        self.waits = [tuple((w.counter, w.threshold) for w in t.waits) for t in prog.tasks]
        self.out = [t.out_counter for t in prog.tasks]
        self.nc = len(prog.counters)
        # release-clock slot of (counter, XCD): the counter itself, or one slot per XCD when XCD-scoped
        n_xcd, nc = max(prog.target.xcds, 1), self.nc
        xcd_scoped = [c.scope == ir.Scope.XCD for c in prog.counters]
        self.slots = nc + nc * n_xcd if any(xcd_scoped) else nc
        self.slot = [[nc + c * n_xcd + x if xcd_scoped[c] else c for x in range(n_xcd)] for c in range(nc)]
        self.oob: list[Optional[str]] = [None] * nt
        arrays: list[np.ndarray] = []
        accesses: list[tuple[int, bool, int]] = []  # (task, write, region)
        read_roles: list[tuple[int, int, str]] = []  # (task, region, role) of every tracked read
        memo: dict[tuple, tuple] = {}  # distinct operand -> (region id or -1, bounds problem)
        for t in prog.tasks:
            try:
                roles = weight_input_roles(t.params, prog.buffers[t.inputs[0].buf] if t.params.op == Op.GEMV else None)
            except Exception:  # noqa: BLE001 - malformed tasks were judged statically
                roles = []
            for ops, write in ((t.inputs, False), (t.outputs, True)):
                for i, o in enumerate(ops):
                    key = (o.buf, o.off, o.len, o.count, o.stride if o.count > 1 else 0, o.kv)
                    hit = memo.get(key)
                    if hit is None:
                        b = prog.buffers[o.buf]
                        idx, bad = _elements(o, b, pos, materialize=b.kind not in READ_ONLY)
                        rid = -1
                        if idx is not None and len(idx):
                            rid = len(arrays)
                            arrays.append(idx + (o.buf << self.BUF_SHIFT))
                        hit = memo[key] = (rid, bad)
                    rid, bad = hit
                    if bad and self.oob[t.id] is None:
                        self.oob[t.id] = f"task {t.id} ({t.name or t.params.op.name}) at pos {pos}: {bad}"
                    if rid >= 0:
                        accesses.append((t.id, write, rid))
                        if not write:
                            read_roles.append((t.id, rid, roles[i] if i < len(roles) else "?"))
        self.reads: list[list[int]] = [[] for _ in range(nt)]
        self.writes: list[list[int]] = [[] for _ in range(nt)]
        self.group_buf: list[int] = []
        self.outputs: dict[int, list[tuple[int, int]]] = {b.id: [] for b in prog.buffers if b.kind == K.IO_OUTPUT}
        self.alias: list[Optional[str]] = [None] * nt
        if arrays:
            self._groups(arrays, accesses)
            self._self_aliasing(accesses, read_roles)
        self.ngroups = len(self.group_buf)

    def _self_aliasing(self, accesses, read_roles) -> None:
        """A task's threads run concurrently: one that writes elements it also reads races
        with itself, unless an elementwise operand is updated exactly in place."""
        written: dict[int, set] = {}
        for tid, write, r in accesses:
            if write:
                written.setdefault(tid, set()).add(r)
        for tid, r, role in read_roles:
            out = written.get(tid)
            if not out or (role in ELEMENTWISE_ROLES and r in out):
                continue
            wg = {g for w in out for g in self.of_region[w]}
            if wg.intersection(self.of_region[r]):
                self.alias[tid] = f"task {tid} writes over its own {role} input"

    def _groups(self, arrays: list[np.ndarray], accesses) -> None:
        """Each touched element's signature is the set of regions touching it, as a bitset
        in 64-bit words; equal signatures form one group."""
        sizes = np.array([len(a) for a in arrays], dtype=np.int64)
        flat = np.concatenate(arrays)
        rid = np.repeat(np.arange(len(arrays), dtype=np.int64), sizes)
        universe, at = np.unique(flat, return_inverse=True)
        at = at.reshape(-1)
        nwords = (len(arrays) + 63) // 64
        words = np.zeros((len(universe), nwords), dtype=np.uint64)
        np.bitwise_or.at(words, (at, rid >> 6), np.left_shift(np.uint64(1), (rid & 63).astype(np.uint64)))
        if nwords == 1:
            _, inverse = np.unique(words[:, 0], return_inverse=True)
        else:
            order = np.lexsort(words.T[::-1])
            srt = words[order]
            new = np.concatenate([[True], (srt[1:] != srt[:-1]).any(axis=1)])
            inverse = np.empty(len(universe), dtype=np.int64)
            inverse[order] = np.cumsum(new) - 1
        inverse = inverse.reshape(-1)
        ngroups = int(inverse.max()) + 1
        first = np.zeros(ngroups, dtype=np.int64)
        first[inverse[::-1]] = np.arange(len(universe) - 1, -1, -1)
        gbuf = (universe[first] >> self.BUF_SHIFT).tolist()
        self.group_buf = gbuf
        pairs = np.unique(rid * ngroups + inverse[at])
        prid, pgroup = pairs // ngroups, pairs % ngroups
        cuts = np.searchsorted(prid, np.arange(len(arrays) + 1))
        pg = pgroup.tolist()
        of_region = [pg[cuts[r]:cuts[r + 1]] for r in range(len(arrays))]
        self.of_region = of_region
        for tid, write, r in accesses:
            (self.writes if write else self.reads)[tid].extend(of_region[r])
        self.reads = [sorted(set(x)) if len(x) > 1 else x for x in self.reads]
        self.writes = [sorted(set(x)) if len(x) > 1 else x for x in self.writes]
        if self.outputs:
            counts = np.bincount(inverse, minlength=ngroups).tolist()
            for g, b in enumerate(gbuf):
                if b in self.outputs:
                    self.outputs[b].append((g, counts[g]))

    def add_bounds(self, pos: int) -> None:
        """Another runtime position: the race-relevant elements are the same (row pos of each
        KV cache, every flat element), so only the bounds of the accesses change."""
        prog = self.st.prog
        for t in prog.tasks:
            if self.oob[t.id] is not None:
                continue
            for o in list(t.inputs) + list(t.outputs):
                if o.kv == KvMode.NONE:
                    continue  # flat regions do not depend on the position
                _, bad = _elements(o, prog.buffers[o.buf], pos, materialize=False)
                if bad:
                    self.oob[t.id] = f"task {t.id} ({t.name or t.params.op.name}) at pos {pos}: {bad}"
                    break

    # ------------------------------------------------------------------ runs
    def run(self, choose: Callable, rng: Optional[random.Random] = None) -> list[tuple[str, str]]:
        m = _Machine(self)
        chooser = choose(self, rng) if choose is not _lowest else None
        while True:
            en = m.enabled()
            if not en:
                break
            q = en[0] if chooser is None else chooser(m, en)
            m.step(q)
        return m.finish()

    def exhaustive(self, max_states: int):
        """Every interleaving, depth first, merging identical states. -> (findings, states, complete)."""
        root = _Machine(self)
        seen = {root.key()}
        stack = [root]
        while stack:
            m = stack.pop()
            en = m.enabled()
            if not en:
                f = m.finish()
                if f:
                    return f, len(seen), True
                continue
            for q in en:
                m2 = m.clone()
                m2.step(q)
                if m2.findings:
                    return m2.finish(), len(seen), True
                k = m2.key()
                if k in seen:
                    continue
                seen.add(k)
                if len(seen) > max_states:
                    return [], len(seen), False
                stack.append(m2)
        return [], len(seen), True

    def sample(self, rng: random.Random, starve_cap: int, random_runs: int, pct_runs: int):
        """Systematic sampling: starve every producer of a partially awaited counter (the
        waiter then passes without it), then random and PCT priority runs."""
        prog = self.st.prog
        part = set(self.st.partial_counters)
        victims = [(qi, p) for qi, q in enumerate(self.queues) for p, t in enumerate(q)
                   if prog.tasks[t].out_counter in part]
        if len(victims) > starve_cap:
            victims = rng.sample(victims, starve_cap)
        n = 0
        for v in victims:
            for order in (_lowest, _random_order):
                f = self.run(_starver(v, order), rng)
                n += 1
                if f:
                    return f, n
        for _ in range(random_runs):
            f = self.run(_uniform, rng)
            n += 1
            if f:
                return f, n
        for _ in range(pct_runs):
            f = self.run(_pct, rng)
            n += 1
            if f:
                return f, n
        return [], n


def _elements(o: ir.Operand, b: ir.Buffer, pos: int, materialize: bool):
    """(element indices in the buffer's flat space or None, an out-of-bounds description or '')."""
    if b.kind == K.KV_CACHE:
        rows, width = b.shape
        bad = ""
        if pos >= rows:
            bad = f"KV row {pos} of a {rows}-row cache"
        elif o.off < 0 or o.off + o.len > width:
            bad = f"KV columns [{o.off}, {o.off + o.len}) of a {width}-wide cache"
        if not materialize:
            return None, bad
        if pos >= rows:
            return np.zeros(0, dtype=np.int64), bad
        # rows below pos are history: valid before the step and never written by it (every KV
        # write is an APPEND at row pos), so no access to them can race or read stale data
        c = np.arange(max(o.off, 0), min(o.off + o.len, width), dtype=np.int64)
        return pos * width + c, bad
    numel = b.numel
    stride = o.stride if o.count > 1 else 0
    lo = o.off + min(0, (o.count - 1) * stride)
    hi = o.off + max(0, (o.count - 1) * stride) + o.len
    bad = f"elements [{lo}, {hi}) of a {numel}-element buffer" if lo < 0 or hi > numel else ""
    if not materialize:
        return None, bad
    if o.len * o.count > MAX_MATERIALIZE:
        raise _Stop("capacity", f"an operand of {o.len * o.count} elements on mutable buffer {b.id}")
    idx = (o.off + stride * np.arange(o.count, dtype=np.int64)[:, None] + np.arange(o.len, dtype=np.int64)[None, :]).reshape(-1)
    if bad:
        idx = idx[(idx >= 0) & (idx < numel)]
    return idx, bad


class _Machine:
    """One execution in progress: block positions, counters with their cumulative release
    clocks, block clocks, and per element group the last write and the reads since."""

    __slots__ = ("ex", "qpos", "cnt", "cvc", "qvc", "lwq", "lwp", "rd", "findings", "done_tasks")

    def __init__(self, ex: _Exec, copy: Optional["_Machine"] = None):
        self.ex = ex
        if copy is not None:
            self.qpos, self.cnt, self.cvc = list(copy.qpos), list(copy.cnt), list(copy.cvc)
            self.qvc, self.lwq, self.lwp = list(copy.qvc), list(copy.lwq), list(copy.lwp)
            self.rd = [None if r is None else dict(r) for r in copy.rd]
            self.findings = list(copy.findings)
            self.done_tasks = copy.done_tasks
            return
        nq, ng = len(ex.queues), ex.ngroups
        self.qpos = [0] * nq
        self.cnt = [0] * ex.nc
        self.cvc: list[Optional[tuple]] = [None] * ex.slots
        self.qvc = [(0,) * nq] * nq
        self.lwq = [-1] * ng
        self.lwp = [0] * ng
        self.rd: list[Optional[dict]] = [None] * ng
        self.findings: list[tuple[str, str]] = []
        self.done_tasks = 0

    def clone(self) -> "_Machine":
        return _Machine(self.ex, self)

    def key(self):
        return (tuple(self.qpos), tuple(self.cvc), tuple(self.qvc), tuple(self.lwq), tuple(self.lwp),
                tuple(None if r is None else tuple(sorted(r.items())) for r in self.rd))

    def enabled(self) -> list[int]:
        ex, cnt, qpos, waits = self.ex, self.cnt, self.qpos, self.ex.waits
        out = []
        for q, queue in enumerate(ex.queues):
            p = qpos[q]
            if p < len(queue):
                for c, th in waits[queue[p]]:
                    if cnt[c] < th:
                        break
                else:
                    out.append(q)
        return out

    def step(self, q: int) -> None:
        ex = self.ex
        t = ex.queues[q][self.qpos[q]]
        vc = list(self.qvc[q])
        x = ex.st.queue_xcd[q]
        for c, _ in ex.waits[t]:  # acquire: the releases this counter has seen so far (in scope)
            rel = self.cvc[ex.slot[c][x]]
            if rel is not None:
                vc = [a if a >= b else b for a, b in zip(vc, rel)]
        e = self.qpos[q] + 1
        vc[q] = e
        if ex.oob[t] is not None:
            self.note("out-of-bounds", ex.oob[t])
        if ex.alias[t] is not None:
            self.note("race", ex.alias[t])
        lwq, lwp, rd = self.lwq, self.lwp, self.rd
        for g in ex.reads[t]:
            wq = lwq[g]
            if wq >= 0:
                if lwp[g] > vc[wq]:
                    self._race(g, "read", t, wq, lwp[g])
            else:
                b = ex.st.prog.buffers[ex.group_buf[g]]
                self.note("uninitialized-read", f"task {t} reads buffer {b.id} ({b.name}) before any write of "
                          "this step happens-before it")
            r = rd[g]
            if r is None:
                rd[g] = {q: e}
            else:
                r[q] = e
        for g in ex.writes[t]:
            wq = lwq[g]
            if wq >= 0 and lwp[g] > vc[wq]:
                self._race(g, "write", t, wq, lwp[g])
            r = rd[g]
            if r:
                for rq, rp in r.items():
                    if rp > vc[rq]:
                        self._race(g, "overwrite", t, rq, rp)
                        break
            lwq[g], lwp[g], rd[g] = q, e, None
        vt = tuple(vc)
        c = ex.out[t]
        self.cnt[c] += 1
        rel = self.cvc[ex.slot[c][x]]
        self.cvc[ex.slot[c][x]] = vt if rel is None else tuple(a if a >= b else b for a, b in zip(vt, rel))
        self.qvc[q] = vt
        self.qpos[q] = e
        self.done_tasks += 1

    def _race(self, g: int, what: str, t: int, oq: int, op: int) -> None:
        ex = self.ex
        other = ex.queues[oq][op - 1]
        b = ex.st.prog.buffers[ex.group_buf[g]]
        kind = {"read": "reads what", "write": "writes what", "overwrite": "overwrites what"}[what]
        last = {"read": "wrote", "write": "wrote", "overwrite": "reads"}[what]
        self.note("race", f"task {t} {kind} task {other} {last} in buffer {b.id} ({b.name}) at pos {ex.pos}, "
                  "unordered by happens-before")

    def note(self, label: str, text: str) -> None:
        if sum(1 for lab, _ in self.findings if lab == label) < 3:  # a few witnesses per kind are enough
            self.findings.append((label, text))

    def finish(self) -> list[tuple[str, str]]:
        ex = self.ex
        f = list(self.findings)
        if self.done_tasks < ex.st.n_instances:
            stuck = [(q, ex.queues[q][p]) for q, p in enumerate(self.qpos) if p < len(ex.queues[q])]
            q, t = stuck[0]
            need = [(c, th, self.cnt[c]) for c, th in ex.waits[t] if self.cnt[c] < th]
            f.append(("deadlock", f"{len(stuck)} block(s) stuck; block {q} at task {t} waits on (counter, threshold, "
                      f"value) {need}"))
        else:
            for bid, groups in ex.outputs.items():
                b = ex.st.prog.buffers[bid]
                written = sum(n for g, n in groups if self.lwq[g] >= 0)
                if written < b.numel:
                    f.append(("incomplete-output", f"{b.numel - written} of {b.numel} elements of output {bid} "
                              f"({b.name}) were never written"))
        return f


# ----------------------------------------------------------------------------- schedulers
def _lowest(ex, rng):  # marker: the canonical run picks the lowest enabled block
    return None


def _random_order(ex, rng):
    return lambda m, en: rng.choice(en)


def _uniform(ex, rng):
    return lambda m, en: rng.choice(en)


def _pct(ex, rng, depth: int = 3):
    """PCT: random block priorities; at `depth` random steps the running block drops to last."""
    nq = len(ex.queues)
    prio = list(range(nq))
    rng.shuffle(prio)
    n = max(ex.st.n_instances, 1)
    changes = set(rng.sample(range(n), min(depth, n)))
    low = [-1]
    step = [0]

    def choose(m, en):
        q = max(en, key=lambda x: prio[x])
        if step[0] in changes:
            prio[q] = low[0]
            low[0] -= 1
        step[0] += 1
        return q

    return choose


def _starver(victim: tuple[int, int], order):
    """Run the task at (block, position) `victim` only when nothing else can run."""
    vq, vp = victim

    def make(ex, rng):
        pick = order(ex, rng)

        def choose(m, en):
            others = [q for q in en if not (q == vq and m.qpos[q] == vp)]
            if not others:
                return en[0]
            return others[0] if pick is None else pick(m, others)

        return choose

    return make
