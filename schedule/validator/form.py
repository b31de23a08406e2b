"""Well-formedness and memory safety: ids, references, caps, arity, typed params, operand
shapes, kinds, dtypes and bounds. Everything here is local to one buffer or one task.

Per-op operand rules come from `operand_rules`, which states for every role of a task what
its operand must look like (length, count, stride, buffer kinds and dtypes, KV mode).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.ir import ArgmaxMode, BufferKind as K, DType as D, Epilogue, KvMode, Op
from amk.schedule.opspec import (APPEND_EPILOGUES, ROPE_EPILOGUES, gemv_rows_width, input_roles, output_roles,
                                 weight_input_roles)
from amk.schedule.targets import coresident_blocks
from amk.schedule.validator.report import Report

FLOAT = frozenset({D.F32, D.F16, D.BF16})
QUANT = frozenset({D.I8, D.U4})
INT = frozenset({D.I32})
IMMUTABLE = frozenset({K.WEIGHT, K.CONST})
READABLE = frozenset({K.WEIGHT, K.CONST, K.IO_INPUT, K.ACTIVATION, K.SCRATCH, K.IO_OUTPUT})
WRITABLE = frozenset({K.ACTIVATION, K.SCRATCH, K.IO_OUTPUT})
KV = frozenset({K.KV_CACHE})
SCALAR_SRC = frozenset({K.IO_INPUT, K.ACTIVATION})


class Rule(NamedTuple):  # kinds/dtypes hold IntEnum members, which hash and compare as their int codes
    """What one operand of one role must be. None means 'not constrained here'. (A named
    tuple: cheap to build and hash; the explaining path derives them per distinct params.)"""

    kinds: frozenset
    dtypes: frozenset
    length: Optional[int] = None
    count: Optional[int] = None
    stride: Optional[int] = None
    off: Optional[int] = None
    kv: KvMode = KvMode.NONE


def _weight_rule(p, rows: int, span: int, dtypes=FLOAT | QUANT) -> Rule:
    return Rule(IMMUTABLE, dtypes, length=span, count=rows, stride=p.k)


def operand_rules(p, w_buf: Optional[ir.Buffer]):
    """(input rules, output rules, params problems) for a task's params. Depends only on the
    params and on its weight buffer's dtype, group and whether it names a zero, so callers
    cache it."""
    op = p.op
    bad: list[str] = []

    def need(cond: bool, why: str) -> None:
        if not cond:
            bad.append(why)

    if op == Op.EMBED:
        need(p.vocab >= 1 and p.hidden >= 1, "vocab and hidden must be positive")
        ins = [Rule(SCALAR_SRC, INT, length=1), Rule(IMMUTABLE, FLOAT, count=p.vocab, stride=p.hidden)]
        outs = [Rule(WRITABLE, FLOAT)]
    elif op == Op.RMSNORM:
        need(p.hidden >= 1 and 0 <= p.col < p.hidden, "col must lie in [0, hidden)")
        need(_pos_finite(p.eps), "eps must be positive and finite")
        ins = [Rule(READABLE, FLOAT, length=p.hidden), Rule(IMMUTABLE, FLOAT, off=p.col)]
        outs = [Rule(WRITABLE, FLOAT)]
    elif op in (Op.GEMV, Op.REDUCE):
        ins, outs = _gemv_rules(p, w_buf, need)
    elif op == Op.ROPE:
        need(p.head_dim >= 2 and p.head_dim % 2 == 0 and p.head_dim <= ir.MAX_HEAD_DIM and p.heads >= 1,
             "head_dim must be even and at most MAX_HEAD_DIM; heads positive")
        n = p.heads * p.head_dim
        ins = [Rule(READABLE, FLOAT, length=n), Rule(IMMUTABLE, FLOAT, length=p.head_dim // 2), Rule(SCALAR_SRC, INT, length=1)]
        outs = [Rule(WRITABLE, FLOAT, length=n)]
    elif op == Op.HEAD_NORM:
        need(1 <= p.head_dim <= ir.MAX_HEAD_DIM and p.heads >= 1, "head_dim in [1, MAX_HEAD_DIM]; heads positive")
        need(_pos_finite(p.eps), "eps must be positive and finite")
        n = p.heads * p.head_dim
        ins = [Rule(READABLE, FLOAT, length=n), Rule(IMMUTABLE, FLOAT, length=p.head_dim)]
        outs = [Rule(WRITABLE, FLOAT, length=n)]
    elif op == Op.KV_APPEND:
        need(p.n >= 1, "n must be positive")
        ins = [Rule(READABLE, FLOAT, length=p.n), Rule(SCALAR_SRC, INT, length=1)]
        outs = [Rule(KV, FLOAT, length=p.n, kv=KvMode.APPEND)]
    elif op == Op.ATTN_PARTIAL:
        need(1 <= p.head_dim <= ir.MAX_HEAD_DIM and p.q_heads >= 1, "head_dim in [1, MAX_HEAD_DIM]; q_heads positive")
        need(1 <= p.splits <= ir.MAX_KV_SPLITS and 0 <= p.split < p.splits, "need 0 <= split < splits <= MAX_KV_SPLITS")
        need(p.block >= 1 and _pos_finite(p.scale), "block and scale must be positive")
        qn = p.q_heads * p.head_dim
        ins = [Rule(READABLE, FLOAT, length=qn), Rule(KV, FLOAT, length=p.head_dim, kv=KvMode.PREFIX),
               Rule(KV, FLOAT, length=p.head_dim, kv=KvMode.PREFIX), Rule(SCALAR_SRC, INT, length=1)]
        outs = [Rule(WRITABLE, FLOAT, length=qn), Rule(WRITABLE, FLOAT, length=p.q_heads * 2)]
    elif op == Op.ATTN_COMBINE:
        need(1 <= p.head_dim <= ir.MAX_HEAD_DIM and p.q_heads >= 1, "head_dim in [1, MAX_HEAD_DIM]; q_heads positive")
        need(1 <= p.splits <= ir.MAX_KV_SPLITS, "splits in [1, MAX_KV_SPLITS]")
        qn = p.q_heads * p.head_dim
        ins = [Rule(READABLE, FLOAT, length=p.splits * qn), Rule(READABLE, FLOAT, length=p.splits * p.q_heads * 2)]
        outs = [Rule(WRITABLE, FLOAT, length=qn)]
    elif op in (Op.SILU_MUL, Op.ADD):
        need(p.n >= 1, "n must be positive")
        ins = [Rule(READABLE, FLOAT, length=p.n), Rule(READABLE, FLOAT, length=p.n)]
        outs = [Rule(WRITABLE, FLOAT, length=p.n)]
    elif op == Op.ARGMAX:  # the roles keep their names in every mode: "logits" in, "token" out
        need(p.n >= 1, "n must be positive")
        if p.mode == ArgmaxMode.PARTIAL:  # a slice -> its (max, index) pair; indices exact in fp32
            need(0 <= p.base and p.base + p.n <= ir.PAIR_INDEX_LIMIT, "a partial argmax needs 0 <= base and base + n <= 2^24")
            ins, outs = [Rule(READABLE, FLOAT, length=p.n)], [Rule(WRITABLE, frozenset({D.F32}), length=2)]
        else:
            need(p.base == 0, "base is only defined for a partial argmax")
            width = 2 * p.n if p.mode == ArgmaxMode.MERGE else p.n  # MERGE: n (max, index) pairs
            ins = [Rule(READABLE, frozenset({D.F32}) if p.mode == ArgmaxMode.MERGE else FLOAT, length=width)]
            outs = [Rule(WRITABLE, INT, length=1)]
    else:  # pragma: no cover - the discriminated union admits nothing else
        ins, outs = [], []
        bad.append(f"unknown op {op}")
    return ins, outs, bad


def _gemv_rules(p, w_buf: Optional[ir.Buffer], need):
    is_gemv = p.op == Op.GEMV
    m = gemv_rows_width(p)
    need(p.rows >= 1, "rows must be positive")
    need(1 <= p.split_k <= 4096, "split_k must be in [1, 4096]")
    rope = p.epilogue in ROPE_EPILOGUES
    if rope:
        need(p.head_dim >= 2 and p.head_dim % 2 == 0 and p.head_dim <= ir.MAX_HEAD_DIM and p.rows % p.head_dim == 0,
             "a RoPE epilogue needs an even head_dim <= MAX_HEAD_DIM dividing rows")
    if p.head_norm_eps is not None:
        need(rope and _pos_finite(p.head_norm_eps), "a head norm needs a RoPE epilogue and a positive eps")
    if p.epilogue == Epilogue.SILU_MUL:
        need(not p.has_bias, "SILU_MUL takes no bias")
    y_rule = Rule(KV, FLOAT, length=p.rows, kv=KvMode.APPEND) if p.epilogue in APPEND_EPILOGUES else Rule(WRITABLE, FLOAT, length=p.rows)
    if not is_gemv:  # REDUCE: partials, then the epilogue extras
        part = Rule(WRITABLE, frozenset({D.F32}), length=p.rows * m, count=p.split_k)
        return [part if r == "partials" else _epilogue_rule(p, r) for r in input_roles(p)], [y_rule]
    need(p.k >= 1 and 0 <= p.k_lo < p.k_hi <= p.k, "need 0 <= k_lo < k_hi <= k")
    if p.split_k == 1:
        need(p.k_lo == 0 and p.k_hi == p.k, "without split-K a task covers all of K")
    if p.norm_eps is not None:
        need(_pos_finite(p.norm_eps), "norm_eps must be positive and finite")
    need(0 <= p.x_partials <= 4096 and 0 <= p.residual_partials <= 4096, "x_partials and residual_partials must be in [0, 4096]")
    if p.x_partials > 0:
        need(p.norm_eps is not None and p.split_k == 1, "x_partials need the norm prologue and no split-K")
    if p.residual_partials > 0:
        need(p.epilogue == Epilogue.ADD and p.split_k == 1, "residual_partials need the ADD epilogue and no split-K")
    pair = p.argmax_pair_base is not None
    if pair:  # its index is base + row as fp32: exact below 2^24
        need(p.epilogue == Epilogue.STORE and p.split_k == 1 and not p.has_bias,
             "an argmax pair needs the STORE epilogue, no split-K and no bias")
        need(0 <= p.argmax_pair_base and p.argmax_pair_base + p.rows <= ir.PAIR_INDEX_LIMIT,
             "argmax_pair_base must be >= 0 with argmax_pair_base + rows <= 2^24")
    heads = _combine_heads(p, need)
    span = p.k_hi - p.k_lo
    wdtype = w_buf.dtype if w_buf is not None else D.F32
    group = (w_buf.group or 0) if w_buf is not None else 0
    quant = wdtype in QUANT
    if quant:
        need(group >= 1 and p.k_lo % group == 0 and span % group == 0, "a quantized K slice must align to the group size")
    ins = []
    for role in weight_input_roles(p, w_buf):  # each role's rule built only where the task has the role
        if role in ("w", "w2"):
            ins.append(_weight_rule(p, p.rows, span))
        elif role == "x":
            ins.append(Rule(READABLE, FLOAT, length=p.k if p.norm_eps is not None else span))
        elif role == "x_part":  # split-K partials of the whole x (the norm prologue reads all of it)
            ins.append(Rule(WRITABLE, frozenset({D.F32}), length=p.k, count=p.x_partials))
        elif role == "gamma":
            ins.append(Rule(IMMUTABLE, FLOAT, length=p.k))
        elif role == "o":  # the partials of the KV heads of [k_lo, k_hi): heads x splits x head_dim values
            ins.append(Rule(READABLE, FLOAT, length=heads * p.combine_splits * p.combine_head_dim))
        elif role == "ml":
            ins.append(Rule(READABLE, FLOAT, length=heads * p.combine_splits * 2))
        elif role in _QUANT_COMPANIONS:
            ins.append(Rule(IMMUTABLE, FLOAT, length=span // group, count=p.rows, stride=p.k // group)
                       if quant and group else _NOTHING)
        else:
            ins.append(_epilogue_rule(p, role))
    if p.split_k > 1:
        return ins, [Rule(WRITABLE, frozenset({D.F32}), length=p.rows * m)]
    return ins, [y_rule] + ([Rule(WRITABLE, frozenset({D.F32}), length=2, count=1)] if pair else [])


def _combine_heads(p, need) -> int:
    """The q heads whose attention combine a GEMV's prologue computes (0 without one): whole
    KV heads' q heads over the task's K slice [k_lo, k_hi), without a norm."""
    if p.combine_splits == 0 and p.combine_q_heads == 0 and p.combine_head_dim == 0:
        return 0
    qh, d = p.combine_q_heads, p.combine_head_dim
    need(1 <= p.combine_splits <= ir.MAX_KV_SPLITS and qh >= 1 and 1 <= d <= ir.MAX_HEAD_DIM,
         "a combine prologue needs splits in [1, MAX_KV_SPLITS], q_heads >= 1, head_dim in [1, MAX_HEAD_DIM]")
    need(qh >= 1 and d >= 1 and p.k_lo % (qh * d) == 0 and p.k_hi % (qh * d) == 0,
         "a combine prologue needs k_lo and k_hi multiples of q_heads * head_dim")
    need(p.norm_eps is None, "a combine prologue takes no norm")
    return (p.k_hi - p.k_lo) // d if d >= 1 else 0


_QUANT_COMPANIONS = frozenset({"w_scale", "w_zero", "w2_scale", "w2_zero"})
_NOTHING = Rule(frozenset(), frozenset())  # a role no operand can fill


def _epilogue_rule(p, role: str) -> Rule:
    """The rule of a GEMV/REDUCE epilogue operand."""
    if role == "bias":
        return Rule(IMMUTABLE, FLOAT, length=p.rows)
    if role == "residual":
        return Rule(READABLE, FLOAT, length=p.rows)
    if role == "res_part":  # split-K partials added to the residual (GEMV residual_partials)
        return Rule(WRITABLE, frozenset({D.F32}), length=p.rows, count=p.residual_partials)
    if role == "head_gamma":
        return Rule(IMMUTABLE, FLOAT, length=p.head_dim)
    if role == "inv_freq":  # head_dim/2 frequencies for each head of the slab (ir.GemvParams)
        return Rule(IMMUTABLE, FLOAT, length=p.rows // 2)
    if role == "pos":
        return Rule(SCALAR_SRC, INT, length=1)
    return _NOTHING


def _pos_finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


# params fields that `operand_rules` and `opspec.input_roles` read only as `v is None` and
# `_pos_finite(v)`: params alike but for these fields' values within one `float_class` get the
# same rules and problems (fast.py memoises by the class; a new float field left out of this
# set is simply memoised by its value)
CLASSED_FLOATS = frozenset({"eps", "norm_eps", "head_norm_eps", "scale"})


def float_class(v) -> Optional[bool]:
    """All that `operand_rules` reads of a CLASSED_FLOATS field: None, or whether it is positive and finite."""
    return None if v is None else _pos_finite(v)


def check_program_header(prog: ir.Program, rep: Report) -> None:
    t = prog.target
    for i, b in enumerate(prog.buffers):
        if b.id != i:
            rep.add("ids", f"buffer at index {i} has id {b.id}; ids must be dense and in order.", buffers=[i])
    for i, c in enumerate(prog.counters):
        if c.id != i:
            rep.add("ids", f"counter at index {i} has id {c.id}; ids must be dense and in order.", counters=[i])
    for i, task in enumerate(prog.tasks):
        if task.id != i:
            rep.add("ids", f"task at index {i} has id {task.id}; ids must be dense and in order.", tasks=[i])
    caps = [("tasks", len(prog.tasks), ir.MAX_TASKS), ("buffers", len(prog.buffers), ir.MAX_BUFFERS),
            ("counters", len(prog.counters), ir.MAX_COUNTERS), ("queues", len(prog.queues), ir.MAX_QUEUES)]
    for what, n, cap in caps:
        if n > cap:
            rep.add("capacity", f"{n} {what} exceed the cap of {cap}.")
    tpb = prog.threads_per_block
    if not (t.warp_size <= tpb <= ir.MAX_THREADS and tpb % t.warp_size == 0):
        rep.add("params", f"threads_per_block {tpb} must be a multiple of the warp size {t.warp_size} in [{t.warp_size}, {ir.MAX_THREADS}].")
    if prog.blocks_per_cu < 1:
        rep.add("params", "blocks_per_cu must be at least 1.")
    blocks = coresident_blocks(t, max(tpb, 1), max(prog.blocks_per_cu, 1))
    if len(prog.queues) > blocks:
        rep.add("coresidency", f"{len(prog.queues)} queues exceed the {blocks} co-resident blocks of {t.name} "
                f"at {tpb} threads; a cooperative launch would fail or deadlock.")
    if not prog.queues:
        rep.add("queue-coverage", "the program has no queues.")


def check_buffers(prog: ir.Program, rep: Report) -> None:
    t = prog.target
    nb = len(prog.buffers)
    for b in prog.buffers:
        if not (1 <= len(b.shape) <= ir.MAX_RANK) or any(d < 1 for d in b.shape):
            rep.add("params", f"buffer {b.id} ({b.name}) has shape {list(b.shape)}; need rank 1..{ir.MAX_RANK}, positive dims.", buffers=[b.id])
            continue
        if b.numel > ir.MAX_BUFFER_ELEMS:
            rep.add("capacity", f"buffer {b.id} ({b.name}) has {b.numel} elements, over MAX_BUFFER_ELEMS.", buffers=[b.id])
        if b.dtype not in t.dtypes:
            rep.add("dtype", f"buffer {b.id} ({b.name}) has dtype {b.dtype.name}, which {t.name} does not support.", buffers=[b.id])
        if b.kind == K.KV_CACHE:
            if len(b.shape) != 2 or b.shape[0] != prog.kv_capacity:
                rep.add("kv-range", f"KV cache {b.id} ({b.name}) has shape {list(b.shape)}; it must be [kv_capacity={prog.kv_capacity}, width].", buffers=[b.id])
            if b.dtype not in FLOAT:
                rep.add("dtype", f"KV cache {b.id} ({b.name}) must hold floats.", buffers=[b.id])
        if b.dtype in QUANT:
            _check_quant_buffer(b, prog, nb, rep)
        elif b.scale is not None or b.zero is not None or b.group is not None:
            rep.add("quant-shape", f"buffer {b.id} ({b.name}) is not quantized but names scale/zero/group.", buffers=[b.id])
    if prog.kv_capacity < 0:
        rep.add("kv-range", "kv_capacity must not be negative.")


def _check_quant_buffer(b: ir.Buffer, prog: ir.Program, nb: int, rep: Report) -> None:
    if b.kind != K.WEIGHT or len(b.shape) != 2:
        rep.add("quant-shape", f"quantized buffer {b.id} ({b.name}) must be a 2-D WEIGHT.", buffers=[b.id])
        return
    rows, cols = b.shape
    g = b.group
    if not g or g < 1 or cols % g:
        rep.add("quant-shape", f"quantized buffer {b.id} ({b.name}) needs a group dividing its {cols} columns (got {g}).", buffers=[b.id])
        return
    if b.dtype == D.U4 and cols % 2:
        rep.add("quant-shape", f"U4 buffer {b.id} ({b.name}) needs an even column count.", buffers=[b.id])
    want = (rows, cols // g)
    # U4 always has a zero; I8 may (asymmetric: w = code * scale + zero)
    companions = [("scale", b.scale)] + ([("zero", b.zero)] if b.dtype == D.U4 or b.zero is not None else [])
    for what, cid in companions:
        if cid is None:
            rep.add("quant-shape", f"quantized buffer {b.id} ({b.name}) has no {what} buffer.", buffers=[b.id])
            continue
        if not (0 <= cid < nb):
            rep.add("reference", f"quantized buffer {b.id} ({b.name}) names {what} buffer {cid}, which does not exist.", buffers=[b.id])
            continue
        c = prog.buffers[cid]
        if tuple(c.shape) != want or c.kind not in IMMUTABLE or c.dtype not in FLOAT:
            rep.add("quant-shape", f"{what} buffer {cid} ({c.name}) of {b.name} must be an immutable float [{rows}, {cols // g}], "
                    f"is {c.kind.name} {c.dtype.name} {list(c.shape)}.", buffers=[b.id, cid])


class OperandTable:
    """Every operand of every task as flat int64 columns (one row per operand), built in the
    explaining path's one pass over the tasks; the race analysis reuses it. `sane[t]` says
    whether task t's references resolve."""

    COLUMNS = ("task", "slot", "write", "buf", "off", "len", "count", "stride", "kv", "rule")

    def __init__(self, rows: list[tuple], sane: list[bool], rules: list[Rule]):
        self.sane = np.array(sane, dtype=bool)
        self.rules = rules
        self.ok = None  # per row: passed its rule (set by _check_operands)
        try:
            a = np.array(rows, dtype=np.int64).reshape(-1, len(self.COLUMNS))
        except OverflowError:  # absurd integers from hand-written JSON: clamp; the bounds check reports them
            a = np.array([[max(-1, min(int(v), 1 << 40)) for v in r] for r in rows], dtype=np.int64).reshape(-1, len(self.COLUMNS))
        for i, name in enumerate(self.COLUMNS):
            setattr(self, name, a[:, i])
        self.array = a


def check_tasks(prog: ir.Program, rep: Report) -> OperandTable:
    """Checks every task locally: references, caps, arity, typed params, and every operand
    against its role's rule (vectorised; failures are explained one by one)."""
    bufs = prog.buffers
    nb, nc = len(bufs), len(prog.counters)
    cache: dict = {}
    rule_ids: dict[Rule, int] = {}
    rules: list[Rule] = []
    rows: list[tuple] = []
    sane_tasks = []
    for task in prog.tasks:
        tid = task.id
        p = task.params
        ins_ops, outs_ops = task.inputs, task.outputs
        pkey = tuple(p.__dict__.values())
        sane = 0 <= task.out_counter < nc
        if not sane:
            rep.add("reference", f"task {tid} signals counter {task.out_counter}, which does not exist.", tasks=[tid])
        if len(ins_ops) > ir.MAX_INPUTS or len(outs_ops) > ir.MAX_OUTPUTS or len(task.waits) > ir.MAX_WAITS:
            rep.add("capacity", f"task {tid} has {len(ins_ops)} inputs, {len(outs_ops)} outputs, {len(task.waits)} waits; "
                    f"caps are {ir.MAX_INPUTS}/{ir.MAX_OUTPUTS}/{ir.MAX_WAITS}.", tasks=[tid])
        for w in task.waits:
            if not (0 <= w.counter < nc):
                rep.add("reference", f"task {tid} waits on counter {w.counter}, which does not exist.", tasks=[tid])
                sane = False
        for o in ins_ops + outs_ops:
            if not (0 <= o.buf < nb):
                rep.add("reference", f"task {tid} names buffer {o.buf}, which does not exist.", tasks=[tid])
                sane = False
        if not sane:
            sane_tasks.append(False)
            continue
        op = p.op
        w_buf = bufs[ins_ops[0].buf] if op == Op.GEMV and ins_ops else None
        key = (op, pkey, w_buf.dtype if w_buf is not None else None, w_buf.group if w_buf is not None else None,
               w_buf is not None and w_buf.zero is not None)
        entry = cache.get(key)
        if entry is None:
            try:
                roles = (weight_input_roles(p, w_buf), output_roles(p))
                ins, outs, problems = operand_rules(p, w_buf)
                ids = ([rule_ids.setdefault(r, len(rule_ids)) for r in ins], [rule_ids.setdefault(r, len(rule_ids)) for r in outs])
                entry = cache[key] = (roles, ids, problems)
            except Exception:  # params that opspec cannot interpret
                entry = cache[key] = (None, None, None)
        roles, ids, problems = entry
        if roles is None:
            rep.add("params", f"task {tid} has params its op cannot interpret.", tasks=[tid])
            sane_tasks.append(False)
            continue
        want_in, want_out = roles
        if len(ins_ops) != len(want_in) or len(outs_ops) != len(want_out):
            rep.add("arity", f"task {tid} ({op.name}) has {len(ins_ops)} inputs and {len(outs_ops)} outputs; "
                    f"its params require {want_in} and {want_out}.", tasks=[tid])
            sane_tasks.append(False)
            continue
        for why in problems:
            rep.add("params", f"task {tid} ({op.name}): {why}.", tasks=[tid])
        for slot, (o, r) in enumerate(zip(ins_ops, ids[0])):
            rows.append((tid, slot, 0, o.buf, o.off, o.len, o.count, o.stride, o.kv, r))
        for slot, (o, r) in enumerate(zip(outs_ops, ids[1])):
            rows.append((tid, slot, 1, o.buf, o.off, o.len, o.count, o.stride, o.kv, r))
        _check_consistency(prog, task, want_in, w_buf, rep)
        sane_tasks.append(True)
    rules = sorted(rule_ids, key=rule_ids.get)
    _check_aliasing(prog, rows, rep)
    table = OperandTable(rows, sane_tasks, rules)
    _check_operands(prog, table, rep)
    return table


# roles whose elements a kernel reads and writes by the same thread: exact in-place is safe
ELEMENTWISE_ROLES = frozenset({"residual", "a", "b", "gate", "up"})


def _check_aliasing(prog: ir.Program, rows: list[tuple], rep: Report) -> None:
    """A task whose output overlaps one of its own inputs races with itself (threads of one
    block write what others still read), except an elementwise operand updated exactly in
    place (y = residual + acc)."""
    reads: dict[tuple[int, int], list[tuple]] = {}
    for r in rows:
        if not r[2]:
            reads.setdefault((r[0], r[3]), []).append(r)
    for r in rows:
        if not r[2] or (r[0], r[3]) not in reads:
            continue
        task = prog.tasks[r[0]]
        w_buf = prog.buffers[task.inputs[0].buf] if task.op == Op.GEMV else None
        roles = weight_input_roles(task.params, w_buf)
        for q in reads[(r[0], r[3])]:
            same = q[4:9] == r[4:9]
            if same and roles[q[1]] in ELEMENTWISE_ROLES:
                continue
            lo_a, hi_a = r[4], r[4] + (r[6] - 1) * r[7] + r[5]
            lo_b, hi_b = q[4], q[4] + (q[6] - 1) * q[7] + q[5]
            if r[8] != q[8] and KvMode.NONE in (r[8], q[8]):
                continue
            if lo_a < hi_b and lo_b < hi_a:
                rep.add("self-alias", f"task {task.id} ({task.op.name}) writes buffer {r[3]} ({prog.buffers[r[3]].name}) "
                        f"over its own {roles[q[1]]} input; its threads would race with each other.",
                        tasks=[task.id], buffers=[r[3]])


def _check_operands(prog: ir.Program, t: OperandTable, rep: Report) -> None:
    """Every operand against its rule at once; the failing ones are explained in Python."""
    t.ok = np.ones(len(t.task), dtype=bool)
    if len(t.task) == 0:
        return
    bufs = prog.buffers
    kind = np.array([int(b.kind) for b in bufs], dtype=np.int64)[t.buf]
    dtype = np.array([int(b.dtype) for b in bufs], dtype=np.int64)[t.buf]
    extent = np.array([(b.shape[-1] if b.kind == K.KV_CACHE and b.shape else b.numel) for b in bufs], dtype=np.float64)[t.buf]
    R = t.rules

    def col(values):
        return np.array(values, dtype=np.int64)[t.rule]

    kind_mask = col([sum(1 << int(k) for k in r.kinds) for r in R])
    dtype_mask = col([sum(1 << int(d) for d in r.dtypes) for r in R])
    want = {name: col([-1 if getattr(r, name) is None else getattr(r, name) for r in R]) for name in ("length", "count", "stride", "off")}
    single = t.count == 1
    end = t.off.astype(np.float64) + (t.count - 1).astype(np.float64) * t.stride.astype(np.float64) + t.len  # float: no overflow
    ok = (((kind_mask >> kind) & 1) == 1) & (((dtype_mask >> dtype) & 1) == 1) & (t.kv == col([int(r.kv) for r in R]))
    ok &= (t.off >= 0) & (t.len >= 1) & (t.count >= 1) & (t.stride >= 0) & (end <= extent)
    ok &= ((want["length"] < 0) | (want["length"] == t.len)) & ((want["count"] < 0) | (want["count"] == t.count))
    ok &= ((want["off"] < 0) | (want["off"] == t.off))
    ok &= single | (((want["stride"] < 0) | (want["stride"] == t.stride)) & (t.stride >= t.len) & (t.kv == 0))
    t.ok = ok
    for i in np.flatnonzero(~ok):
        task = prog.tasks[int(t.task[i])]
        write = bool(t.write[i])
        o = (task.outputs if write else task.inputs)[int(t.slot[i])]
        w_buf = bufs[task.inputs[0].buf] if task.op == Op.GEMV else None
        roles = output_roles(task.params) if write else weight_input_roles(task.params, w_buf)
        _explain_operand(prog, task, roles[int(t.slot[i])], o, R[int(t.rule[i])], rep, write)


def _explain_operand(prog, task, role, o: ir.Operand, rule: Rule, rep: Report, write: bool) -> None:
    """The slow path: say exactly what is wrong with one operand."""
    tid = task.id
    b = prog.buffers[o.buf]
    where = f"task {tid} ({task.op.name}) {role} operand on buffer {b.id} ({b.name})"
    if b.kind not in rule.kinds:
        if write and b.kind in IMMUTABLE | {K.IO_INPUT}:
            reason = f"{where} writes a {b.kind.name} buffer, which is read-only during a step."
        else:
            reason = f"{where}: a {b.kind.name} buffer cannot serve this role."
        rep.add("kind", reason, tasks=[tid], buffers=[b.id])
        return
    if b.dtype not in rule.dtypes:
        rep.add("dtype", f"{where} has dtype {b.dtype.name}; this op supports {sorted(d.name for d in rule.dtypes)}.", tasks=[tid], buffers=[b.id])
    if o.kv != rule.kv:
        rep.add("params", f"{where} has KV mode {o.kv.name}; the role requires {rule.kv.name}.", tasks=[tid], buffers=[b.id])
        return
    if o.off < 0 or o.len < 1 or o.count < 1 or o.stride < 0:
        rep.add("out-of-bounds", f"{where} has off {o.off}, len {o.len}, count {o.count}, stride {o.stride}; need off>=0, len>=1, count>=1, stride>=0.",
                tasks=[tid], buffers=[b.id])
        return
    for name, want, got in (("len", rule.length, o.len), ("count", rule.count, o.count), ("stride", rule.stride, o.stride), ("off", rule.off, o.off)):
        if name == "stride" and o.count == 1:
            continue  # a single repetition has no stride
        if want is not None and want != got:
            rep.add("params", f"{where} has {name} {got}; its params require {want}.", tasks=[tid], buffers=[b.id])
    if o.count > 1 and o.stride < o.len:
        rep.add("params", f"{where} repeats with stride {o.stride} < len {o.len}; repetitions would overlap.", tasks=[tid], buffers=[b.id])
    if b.kind == K.KV_CACHE:
        width = b.shape[-1] if len(b.shape) == 2 else 0
        if o.count != 1 or o.off + o.len > width:
            rep.add("out-of-bounds", f"{where} spans columns [{o.off}, {o.off + o.len}) x{o.count} of a {width}-wide KV cache.", tasks=[tid], buffers=[b.id])
    else:
        end = o.off + (o.count - 1) * o.stride + o.len
        if end > b.numel:
            rep.add("out-of-bounds", f"{where} reaches element {end}, past the buffer's {b.numel}.", tasks=[tid], buffers=[b.id])


def _check_consistency(prog, task, roles, w_buf, rep: Report) -> None:
    """Rules between operands of one task, which params alone cannot state."""
    op = task.params.op
    if op == Op.EMBED:
        table, x = task.inputs[1], task.outputs[0]
        if table.len != x.len or table.off + table.len > task.params.hidden:
            rep.add("params", f"task {task.id} (EMBED): the table tile [{table.off}, {table.off + table.len}) must match the output "
                    f"length {x.len} and lie within the {task.params.hidden} columns.", tasks=[task.id])
    elif op == Op.RMSNORM:
        p, gamma, y = task.params, task.inputs[1], task.outputs[0]
        if gamma.len != y.len or p.col + y.len > p.hidden:
            rep.add("params", f"task {task.id} (RMSNORM): gamma tile and output must both span [col, col+n) within hidden.", tasks=[task.id])
    elif op == Op.GEMV and w_buf is not None and w_buf.dtype in QUANT:
        _check_quant_operands(prog, task, roles, w_buf, rep)


def _check_quant_operands(prog, task, roles, w_buf, rep: Report) -> None:
    """A quantized GEMV's scale/zero operands name that weight's own companions, at its rows."""
    p = task.params
    for prefix in ("w", "w2"):
        if prefix not in roles:
            continue
        w_op = task.inputs[roles.index(prefix)]
        wb = prog.buffers[w_op.buf]
        if wb.dtype != w_buf.dtype or wb.group != w_buf.group:
            rep.add("dtype", f"task {task.id}: w and w2 must share a dtype and group.", tasks=[task.id])
            continue
        group = wb.group or 1
        gk = p.k // group
        want_off = (w_op.off // p.k) * gk + p.k_lo // group
        for comp in ("scale", "zero"):
            role = f"{prefix}_{comp}"
            if role in roles:
                o = task.inputs[roles.index(role)]
                want = getattr(wb, comp)
                if o.buf != want or o.off != want_off:
                    rep.add("quant-shape", f"task {task.id} reads {role} from buffer {o.buf} at {o.off}, but {wb.name}'s {comp} "
                            f"is buffer {want} at {want_off}.", tasks=[task.id], buffers=[o.buf])
