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
groups to their operand rules and rule tables, pure functions of them. Their keys hold each
float that `operand_rules` reads only as present and positive-finite (`form.CLASSED_FLOATS`,
e.g. a norm epsilon) as that class, so a program that differs from one seen before only in
such a value reuses its tables.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.compact import BUFFER_COLUMNS, COLUMN_NAMES as _COLUMN_NAMES, HEADER_FIELDS, OPERAND_COLUMNS, CompactProgram
from amk.schedule.ir import DType as D, Op
from amk.schedule.opspec import input_roles
from amk.schedule.targets import coresident_blocks
from amk.schedule.validator import kernels as kn
from amk.schedule.validator.form import CLASSED_FLOATS, ELEMENTWISE_ROLES, QUANT, float_class, operand_rules

AVAILABLE = kn.AVAILABLE

# every check name this path decides; validate() uses it only while this equals CHECK_GROUPS
COVERED = frozenset({
    "schema", "ids", "reference", "capacity", "arity", "params", "kind", "dtype", "threshold", "self-wait",
    "dataflow-cycle", "queue-coverage", "queue-order-deadlock", "coresidency", "partial-wait", "scope",
    "read-after-write", "write-after-read", "write-after-write", "kv-read-before-append", "tile-overlap", "tile-gap",
    "uninitialized-read", "self-alias", "out-of-bounds", "kv-range", "quant-shape", "complete",
})

_HEADER_KEYS = frozenset(HEADER_FIELDS)
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
    if not _columns_ok(cp) or not _header_ok(cp):  # (columns first: the header check reads the header's keys)
        return None
    nc = cp.num_counters
    code, bufinfo, buf_variant, n_variants = kn.buffer_table(cp.buffers, cp.kv_capacity, _mask(frozenset(cp.target.dtypes)))
    if code < 0:
        return code  # params, capacity, dtype, kv-range, quant-shape, reference
    gemv_params = np.array([p.op == Op.GEMV for p in cp.params], dtype=np.bool_)
    code, op_start, w_start, entry, first, wbuf = kn.task_entries(
        cp.n_in, cp.n_out, cp.n_wait, cp.out_counter, cp.operands, cp.waits, cp.task_params, len(cp.params),
        gemv_params, buf_variant, n_variants, nc, ir.MAX_INPUTS, ir.MAX_OUTPUTS, ir.MAX_WAITS)
    if code < 0:
        return code
    tables = _entry_tables(cp, first, wbuf)
    if tables is None:
        return None  # params its op cannot interpret, or params problems
    entinfo, slot_rule, elementwise, rules = tables
    return kn.check_program(op_start, cp.n_in, cp.n_out, w_start, entry, wbuf, cp.out_counter, cp.operands, cp.waits,
                            cp.queue_len, cp.queue_tasks, bufinfo, entinfo, slot_rule, elementwise, rules, cp.counter_scope,
                            max(int(cp.target.xcds), 1), ir.MAX_INPUTS)


def _header_ok(cp: CompactProgram) -> bool:
    """`form.check_program_header`'s rules (ids are dense by construction)."""
    h = cp.header  # (read the dict: the attribute hook costs a microsecond a field)
    t, tpb = h["target"], h["threads_per_block"]
    nt, nq = len(cp.task_params), len(cp.queue_len)
    if nt == 0 or nt > ir.MAX_TASKS or len(cp.buffers) > ir.MAX_BUFFERS or len(cp.counter_scope) > ir.MAX_COUNTERS:
        return False  # (the empty program is left to the explaining path)
    warp = t.warp_size
    if not (warp <= tpb <= ir.MAX_THREADS and tpb % warp == 0) or h["blocks_per_cu"] < 1:
        return False
    return 0 < nq <= min(ir.MAX_QUEUES, coresident_blocks(t, tpb, h["blocks_per_cu"]))


_INT64 = np.dtype(np.int64)
_MATRICES = {"buffers": len(BUFFER_COLUMNS), "operands": len(OPERAND_COLUMNS), "waits": 2}  # the 2-D columns and their widths


def _columns_ok(cp: CompactProgram) -> bool:
    """The columns have the types and lengths the compiled checks index by (a hand-built
    CompactProgram may not)."""
    f = cp.__dict__
    for name in _COLUMN_NAMES:
        a = f[name]
        if type(a) is not np.ndarray or a.dtype is not _INT64 or not a.flags.c_contiguous:
            return False
        width = _MATRICES.get(name)
        if (a.ndim != 1) if width is None else (a.ndim != 2 or a.shape[1] != width):
            return False
    nt = len(f["task_params"])
    if len(f["buffer_names"]) != len(f["buffers"]) or len(f["counter_names"]) != len(f["counter_scope"]):
        return False
    if f["header"].keys() != _HEADER_KEYS or len(f["names"]) != nt:
        return False
    if not len(f["out_counter"]) == len(f["n_in"]) == len(f["n_out"]) == len(f["n_wait"]) == nt:
        return False
    return int(f["n_wait"].sum()) == len(f["waits"])


class _Weight(NamedTuple):
    """What `operand_rules` reads of a weight buffer."""

    dtype: int  # a DType code
    group: Optional[int]


_SPECS: dict = {}  # entry key (params' rule-relevant field values, weight) -> _entry_spec(...): pure, memoised
_RULE_KEYS: dict = {}  # params' field values -> _rules_key(...): pure, memoised
_TABLES: dict = {}  # the entry keys of a program, in order -> _build_entry_tables(...) (pure, memoised; never written)
_MEMO_MAX = 4096  # entries per memo before it starts over


def _memo(cache: dict, key, make):
    """cache[key], made by make() the first time (a memo of a pure function, bounded)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= _MEMO_MAX:
            cache.clear()
        value = cache[key] = make()
    return value


def _entry_tables(cp: CompactProgram, first: np.ndarray, wbuf: np.ndarray):
    """Per entry (distinct params and weight variant), from its first task: the
    `kernels.E_*` columns, each slot's rule id and elementwise flag; and the rule table.
    None if some entry's params are invalid."""
    bufs, params, task_params = cp.buffers, cp.params, cp.task_params
    entries, distinct = [], set()
    for t in first.tolist():
        p = params[task_params[t]]
        values = tuple(p.__dict__.values())  # every field, read now: the memos never go stale
        distinct.add(values)
        entries.append((p, (_rules_key(p, values), _weight(bufs, int(wbuf[t])))))
    if len(distinct) != len(params):
        return None  # equal params listed twice: not the one encoding of this program
    return _memo(_TABLES, tuple(k for _, k in entries), lambda: _build_entry_tables([_spec(p, k) for p, k in entries]))


def _spec(p, key: tuple):
    """The entry's `_entry_spec` (memoised: a program new to `_TABLES` derives only its new entries')."""
    return _memo(_SPECS, key, lambda: _entry_spec(p, key[1]))


def _rules_key(p, values: tuple) -> tuple:
    """The params' field values, each of `form.CLASSED_FLOATS` as its `form.float_class`:
    params that differ only in, say, a norm epsilon share their entry and so their tables."""
    return _memo(_RULE_KEYS, values, lambda: _classed_values(p))


def _classed_values(p) -> tuple:
    fields = dict(p.__dict__)
    for name in CLASSED_FLOATS & fields.keys():  # (by name: the attributes operand_rules reads)
        fields[name] = float_class(fields[name])
    return tuple(fields.values())


def _weight(bufs: np.ndarray, w: int) -> Optional[_Weight]:
    if w < 0:
        return None
    group = int(bufs[w, kn.C_GROUP])
    return _Weight(int(bufs[w, kn.C_DTYPE]), None if group == -1 else group)


def _build_entry_tables(specs: list):
    """The program's tables from its entries' specs (each distinct rule gets one row of the
    rule table); None if some entry is invalid."""
    entinfo, slot_rule, elementwise = [], [], []
    rule_ids: dict = {}
    for spec in specs:
        if spec is False:
            return None
        row, ins, outs, flags = spec
        entinfo.append(row)
        ids = [rule_ids.setdefault(r, len(rule_ids)) for r in ins]
        ids += [0] * (ir.MAX_INPUTS - len(ids))
        ids += [rule_ids.setdefault(r, len(rule_ids)) for r in outs]
        slot_rule.append(ids + [0] * (_SLOTS - len(ids)))
        elementwise.append(flags)
    return (np.array(entinfo, dtype=np.int64), np.array(slot_rule, dtype=np.int64), np.array(elementwise, dtype=np.bool_),
            np.array(list(rule_ids), dtype=np.int64).reshape(-1, 7))


def _rule_row(r) -> tuple:
    """A rule as its row of the compiled checks' rule table: kind mask, dtype mask, kv mode,
    then length, count, stride, off (-1: not constrained)."""
    return (_mask(r.kinds), _mask(r.dtypes), int(r.kv)) + tuple(-1 if v is None else v for v in (r.length, r.count, r.stride, r.off))


def _entry_spec(p, weight: Optional[_Weight]):
    """(entry row, input rule rows, output rule rows, elementwise flag per slot) of tasks with
    params `p` and this weight, from `form.operand_rules`; False if the params are invalid."""
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
    return row, tuple(map(_rule_row, ins)), tuple(map(_rule_row, outs)), flags


@functools.lru_cache(maxsize=256)
def _mask(codes: frozenset) -> int:
    """Bit c set for every code c (the rules' kind and dtype sets are a handful of constants)."""
    m = 0
    for c in codes:
        m |= 1 << int(c)
    return m
