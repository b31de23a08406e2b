"""The validator's fast path: decides whether a program passes every check, without
explaining failures.

`validate()` runs `verify` first, on the program's compact form (`schedule/compact.py`). If
it returns a count, the program passed every check and the certificate is built from it.
If it returns None (some check fails, numba is missing, or anything unexpected happens),
`validate()` runs the explaining path (`form`, `order`, `race`, `scope`: the code that names
every violation), which alone decides rejections. So the fast path can only ever be wrong
by accepting what the explaining path rejects, and `tests/test_validate.py` runs both paths
on every fuzz class to show they agree.

The checks are the explaining path's, restated as loops over integer columns and compiled
by numba (`kernels.py`): what depends on a task's params (its operands' rules) is derived in
Python once per distinct (params, weight dtype, group), with `form.operand_rules` itself;
the rest runs compiled. Happens-before is vector clocks over the queues, built in the
topological order that proves the task graph acyclic; the race check is the segment
analysis of `race.check_races`, and on a race-free program its count of ordering checks is
the same for every linear extension of happens-before, so the certificate equals the
explaining path's.

Nothing about a program is cached between calls: every call reads and checks the whole
program. The memos map params' field values (read on every call) and weight dtypes and
groups to their operand rules and rule tables, pure functions of them.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.compact import CompactProgram
from amk.schedule.ir import BufferKind as K, DType as D, Op
from amk.schedule.opspec import input_roles
from amk.schedule.targets import coresident_blocks
from amk.schedule.validator import kernels as kn
from amk.schedule.validator import form
from amk.schedule.validator.form import ELEMENTWISE_ROLES, QUANT, operand_rules
from amk.schedule.validator.race import SKIP_KINDS
from amk.schedule.validator.report import Report

AVAILABLE = kn.AVAILABLE

# every check name this path decides; validate() uses it only while this equals CHECK_GROUPS
COVERED = frozenset({
    "schema", "ids", "reference", "capacity", "arity", "params", "kind", "dtype", "threshold", "self-wait",
    "dataflow-cycle", "queue-coverage", "queue-order-deadlock", "coresidency", "partial-wait", "scope",
    "read-after-write", "write-after-read", "write-after-write", "kv-read-before-append", "tile-overlap", "tile-gap",
    "uninitialized-read", "self-alias", "out-of-bounds", "kv-range", "quant-shape", "complete",
})

_SLOTS = ir.MAX_INPUTS + ir.MAX_OUTPUTS  # operand slot s of a task: inputs 0.., outputs MAX_INPUTS..
_QUANT_SLOTS = ((kn.E_SLOT_W, "w"), (kn.E_SLOT_W2, "w2"), (kn.E_SLOT_W_SCALE, "w_scale"), (kn.E_SLOT_W_ZERO, "w_zero"),
                (kn.E_SLOT_W2_SCALE, "w2_scale"), (kn.E_SLOT_W2_ZERO, "w2_zero"))
assert [c for c, _ in _QUANT_SLOTS] == list(range(kn.E_SLOT_W, kn.ENTRY_COLUMNS))  # entry rows list them in this order


def verify(cp: CompactProgram) -> Optional[int]:
    """The ordering checks made if `cp` passes every check, else None."""
    code = verify_code(cp)
    return code if code is not None and code >= 0 else None


def verify_code(cp: CompactProgram) -> Optional[int]:
    """`verify`, but a failure in the compiled checks returns its negative `kernels.REJECT_*`
    code (tests use it to see which check failed); None for a failure before them."""
    scratch = Report()
    if not _header_ok(cp) or not _columns_ok(cp):
        return None
    nc = len(cp.counters)
    table = _buffer_table(cp, scratch)
    if table is None or not scratch.ok:
        return None  # params, capacity, dtype, kv-range, quant-shape, reference
    bufinfo, buf_variant, n_variants = table
    gemv_params = np.array([p.op == Op.GEMV for p in cp.params], dtype=np.bool_)
    code, op_start, entry, first, wbuf = kn.task_entries(
        cp.n_in, cp.n_out, cp.n_wait, cp.out_counter, cp.operands, cp.waits, cp.task_params, len(cp.params),
        gemv_params, buf_variant, n_variants, nc, ir.MAX_INPUTS, ir.MAX_OUTPUTS, ir.MAX_WAITS)
    if code < 0:
        return code
    tables = _entry_tables(cp, first, wbuf)
    if tables is None:
        return None  # params its op cannot interpret, or params problems
    entinfo, slot_rule, elementwise, rules = tables
    xcd_scoped = np.array([c.scope == ir.Scope.XCD for c in cp.counters], dtype=np.bool_)
    return kn.check_program(op_start, cp.n_in, cp.n_out, cp.n_wait, entry, wbuf, cp.out_counter, cp.operands, cp.waits,
                            cp.queue_len, cp.queue_tasks, bufinfo, entinfo, slot_rule, elementwise, rules, xcd_scoped,
                            max(int(cp.target.xcds), 1), ir.MAX_INPUTS)


def _header_ok(cp: CompactProgram) -> bool:
    """`form.check_program_header`'s rules (task ids are dense by construction)."""
    t = cp.target
    if any(b.id != i for i, b in enumerate(cp.buffers)) or any(c.id != i for i, c in enumerate(cp.counters)):
        return False
    nt, nq = cp.num_tasks, cp.num_queues
    if nt == 0 or nt > ir.MAX_TASKS or len(cp.buffers) > ir.MAX_BUFFERS or len(cp.counters) > ir.MAX_COUNTERS:
        return False  # (the empty program is left to the explaining path)
    tpb = cp.threads_per_block
    if not (t.warp_size <= tpb <= ir.MAX_THREADS and tpb % t.warp_size == 0) or cp.blocks_per_cu < 1:
        return False
    return 0 < nq <= min(ir.MAX_QUEUES, coresident_blocks(t, tpb, cp.blocks_per_cu))


def _columns_ok(cp: CompactProgram) -> bool:
    """The columns have the types and lengths the compiled checks index by (a hand-built
    CompactProgram may not)."""
    nt = cp.num_tasks
    cols = cp.arrays()
    if not all(isinstance(a, np.ndarray) and a.dtype == np.int64 and a.flags.c_contiguous for a in cols):
        return False
    if any(a.ndim != 1 for a in (cp.task_params, cp.out_counter, cp.n_in, cp.n_out, cp.n_wait, cp.queue_len, cp.queue_tasks)):
        return False
    if cp.operands.ndim != 2 or cp.operands.shape[1] != 6 or cp.waits.ndim != 2 or cp.waits.shape[1] != 2:
        return False
    if not all(len(a) == nt for a in (cp.out_counter, cp.n_in, cp.n_out, cp.n_wait)) or len(cp.names) != nt:
        return False
    return int(cp.n_wait.sum()) == len(cp.waits)


_KV, _OUTPUT = int(K.KV_CACHE), int(K.IO_OUTPUT)
_MUTABLE = frozenset(int(k) for k in K if k not in SKIP_KINDS)
_FLOAT_CODES = frozenset(int(d) for d in form.FLOAT)
_QUANT_CODES = frozenset(int(d) for d in QUANT)


def _buffer_table(cp: CompactProgram, scratch: Report):
    """`form.check_buffers`' rules (quantized buffers through its own `_check_quant_buffer`,
    reporting to `scratch`), and per buffer: the `kernels.B_*` columns, its (dtype, group)
    variant, how many variants. None at the first failure. (Reads the field dicts and
    compares int codes: enum hashing and pydantic attribute hooks are slow.)"""
    bufs = cp.buffers
    dtypes = frozenset(int(d) for d in cp.target.dtypes)
    kv_capacity = cp.kv_capacity
    if kv_capacity < 0:
        return None
    variants: dict = {}
    rows, variant = [], []
    base = 0
    for b in bufs:
        f = b.__dict__
        kind, dtype, shape, group, scale, zero = int(f["kind"]), int(f["dtype"]), f["shape"], f["group"], f["scale"], f["zero"]
        if not 1 <= len(shape) <= ir.MAX_RANK or min(shape) < 1 or dtype not in dtypes:
            return None
        numel = math.prod(shape)
        if numel > ir.MAX_BUFFER_ELEMS:
            return None
        if kind == _KV and (len(shape) != 2 or shape[0] != kv_capacity or dtype not in _FLOAT_CODES):
            return None
        if dtype in _QUANT_CODES:
            form._check_quant_buffer(b, cp, len(bufs), scratch)
        elif scale is not None or zero is not None or group is not None:
            return None
        extent = shape[-1] if kind == _KV else numel
        rows.append((kind, dtype, extent, group or 0, -1 if scale is None else scale, -1 if zero is None else zero,
                     kind in _MUTABLE, kind == _OUTPUT, base))
        base += extent
        variant.append(variants.setdefault((dtype, group), len(variants)))
    return np.array(rows, dtype=np.int64).reshape(-1, kn.BUFFER_COLUMNS), np.array(variant, dtype=np.int64), len(variants)


class _Weight(NamedTuple):
    """What `operand_rules` reads of a weight buffer."""

    dtype: D
    group: Optional[int]


_SPECS: dict = {}  # (params field values, weight dtype, group) -> _entry_spec(...): a pure function, memoised
_SPECS_MAX = 4096


_TABLES: dict = {}  # the entry keys of a program, in order -> _build_entry_tables(...) (pure, memoised; never written)


def _entry_tables(cp: CompactProgram, first: np.ndarray, wbuf: np.ndarray):
    """Per entry (distinct params and weight variant), from its first task: the
    `kernels.E_*` columns, each slot's rule id and elementwise flag; and the rule table.
    None if some entry's params are invalid."""
    bufs, params, task_params = cp.buffers, cp.params, cp.task_params
    entries = []
    for t in first.tolist():
        p = params[task_params[t]]
        w = wbuf[t]
        weight = _Weight(bufs[w].dtype, bufs[w].group) if w >= 0 else None
        entries.append((p, (tuple(p.__dict__.values()), weight)))  # every field, read now: the memo never goes stale
    key = tuple(k for _, k in entries)
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _SPECS_MAX:
            _TABLES.clear()
        tables = _TABLES[key] = _build_entry_tables(entries)
    return tables


def _build_entry_tables(entries):
    entinfo, slot_rule, elementwise = [], [], []
    rule_ids: dict = {}
    for p, key in entries:
        spec = _SPECS.get(key)
        if spec is None:
            if len(_SPECS) >= _SPECS_MAX:
                _SPECS.clear()
            spec = _SPECS[key] = _entry_spec(p, key[1])
        if spec is False:
            return None
        row, ins, outs, flags = spec
        entinfo.append(row)
        ids = [rule_ids.setdefault(r, len(rule_ids)) for r in ins]
        ids += [0] * (ir.MAX_INPUTS - len(ids))
        ids += [rule_ids.setdefault(r, len(rule_ids)) for r in outs]
        slot_rule.append(ids + [0] * (_SLOTS - len(ids)))
        elementwise.append(flags)
    rules = [[_mask(r.kinds), _mask(r.dtypes), int(r.kv)] + [-1 if v is None else v for v in (r.length, r.count, r.stride, r.off)]
             for r in rule_ids]
    return (np.array(entinfo, dtype=np.int64), np.array(slot_rule, dtype=np.int64), np.array(elementwise, dtype=np.bool_),
            np.array(rules, dtype=np.int64).reshape(-1, 7))


def _entry_spec(p, weight: Optional[_Weight]):
    """(entry row, input rules, output rules, elementwise flag per slot) of tasks with params
    `p` and this weight, from `form.operand_rules`; False if the params are invalid."""
    try:
        roles_in = input_roles(p, weight.dtype if weight is not None else D.F32)
        ins, outs, problems = operand_rules(p, weight)
    except Exception:
        return False
    if problems or len(ins) != len(roles_in):
        return False
    op, fields = p.op, p.__dict__  # (getattr with a default is slow on a pydantic model)
    quant = op == Op.GEMV and weight is not None and weight.dtype in QUANT
    row = ([len(ins), len(outs), int(op), fields.get("hidden", -1), fields.get("col", -1),
            p.k if quant else -1, p.k_lo if quant else -1, int(quant)]
           + [roles_in.index(r) if quant and r in roles_in else -1 for _, r in _QUANT_SLOTS])
    flags = [r in ELEMENTWISE_ROLES for r in roles_in] + [False] * (_SLOTS - len(roles_in))
    return row, tuple(ins), tuple(outs), flags


@functools.lru_cache(maxsize=256)
def _mask(codes: frozenset) -> int:
    """Bit c set for every code c (the rules' kind and dtype sets are a handful of constants)."""
    m = 0
    for c in codes:
        m |= 1 << int(c)
    return m
