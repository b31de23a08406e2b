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
Python once per distinct (params, weight dtype, group, zero), with `form.operand_rules` itself;
the rest runs compiled. Happens-before is vector clocks over the queues, built in the
topological order that proves the task graph acyclic; the race check is the segment
analysis of `race.check_races`, and on a race-free program its count of ordering checks is
the same for every linear extension of happens-before, so the certificate equals the
explaining path's.

Nothing about a program is cached between calls: every call reads and checks the whole
program. The memos map params' field values (read on every call) and a weight dtype,
group and zero flag to that entry's row of the entry table (its operand rules), a pure function of them;
a program's table is its entries' rows stacked, so a program with one new params derives
only that row. A second memo keys each float that `operand_rules` reads only as present and
positive-finite (`form.CLASSED_FLOATS`, e.g. a norm epsilon) as that class, so params that
differ from ones seen before only in such a value reuse their row.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple, Optional

import numpy as np

from amk.schedule import ir
from amk.schedule.compact import BUFFER_COLUMNS, COLUMN_NAMES as _COLUMN_NAMES, HEADER_FIELDS, OPERAND_COLUMNS, CompactProgram
from amk.schedule.ir import Op
from amk.schedule.targets import coresident_blocks
from amk.schedule.validator import kernels as kn
from amk.schedule.opspec import weight_input_roles
from amk.schedule.validator.form import CLASSED_FLOATS, ELEMENTWISE_ROLES, QUANT, Rule, float_class, operand_rules

AVAILABLE = kn.AVAILABLE

# every check name this path decides; validate() uses it only while this equals CHECK_GROUPS
COVERED = frozenset({
    "schema", "ids", "reference", "capacity", "arity", "params", "kind", "dtype", "threshold", "self-wait",
    "dataflow-cycle", "queue-coverage", "queue-order-deadlock", "coresidency", "partial-wait", "scope",
    "read-after-write", "write-after-read", "write-after-write", "kv-read-before-append", "tile-overlap", "tile-gap",
    "uninitialized-read", "self-alias", "out-of-bounds", "kv-range", "quant-shape", "complete",
})

_HEADER_KEYS = frozenset(HEADER_FIELDS)
_GEMV = Op.GEMV  # (a module global: an enum class attribute costs more to look up)
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
    nc, h = cp.num_counters, cp.header  # (the header's dict: cp.target and the like go through __getattr__)
    target = h["target"]
    code, bufinfo, buf_variant, n_variants = kn.buffer_table(cp.buffers, h["kv_capacity"], _mask(frozenset(target.dtypes)))
    if code < 0:
        return code  # params, capacity, dtype, kv-range, quant-shape, reference
    gemv_params = np.array([p.op == _GEMV for p in cp.params], dtype=np.bool_)
    code, op_start, w_start, entry, first, wbuf = kn.task_entries(
        cp.n_in, cp.n_out, cp.n_wait, cp.out_counter, cp.operands, cp.waits, cp.task_params, len(cp.params),
        gemv_params, buf_variant, n_variants, nc, ir.MAX_INPUTS, ir.MAX_OUTPUTS, ir.MAX_WAITS, cp.buffers)
    if code < 0:
        return code
    entinfo = _entry_tables(cp, first)
    if entinfo is None:
        return None  # params its op cannot interpret, or params problems
    return kn.check_program(op_start, cp.n_in, cp.n_out, w_start, entry, wbuf, cp.out_counter, cp.operands, cp.waits,
                            cp.queue_len, cp.queue_tasks, bufinfo, entinfo, cp.counter_scope, max(int(target.xcds), 1),
                            ir.MAX_INPUTS)


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
# per column: its name, the strides of a C-ordered int64 array of its rank and width (which
# imply the rank and, with the width, C order: one tuple compare), its width (0: 1-D)
_LAYOUT = tuple((name, (8 * _MATRICES[name], 8) if name in _MATRICES else (8,), _MATRICES.get(name, 0))
                for name in _COLUMN_NAMES)


def _columns_ok(cp: CompactProgram) -> bool:
    """The columns have the types and lengths the compiled checks index by (a hand-built
    CompactProgram may not)."""
    f = cp.__dict__
    for name, strides, width in _LAYOUT:
        a = f[name]
        if type(a) is not np.ndarray or a.dtype is not _INT64 or a.strides != strides or (width and a.shape[1] != width):
            return False
    nt = len(f["task_params"])
    if len(f["buffer_names"]) != len(f["buffers"]) or len(f["counter_names"]) != len(f["counter_scope"]):
        return False
    if f["header"].keys() != _HEADER_KEYS or len(f["names"]) != nt:
        return False
    return len(f["out_counter"]) == len(f["n_in"]) == len(f["n_out"]) == len(f["n_wait"]) == nt  # (the waits: task_entries)


class _Weight(NamedTuple):
    """What `operand_rules` reads of a weight buffer."""

    dtype: int  # a DType code
    group: Optional[int]
    zero: Optional[int]  # not None where the weight names a zero companion (its id is not read)


_ROWS: dict = {}  # (params' field values, weight dtype, group, zero) -> the entry's table row, or False: pure, memoised
_CLASSED_ROWS: dict = {}  # the same, keyed by the values with each CLASSED_FLOATS field as its class
_TABLES: dict = {}  # a program's entry rows, in order -> its entry table (read-only: shared)
_MEMO_MAX = 4096  # entries per memo before it starts over


def _memo(cache: dict, key, make):
    """cache[key], made by make() the first time (a memo of a pure function, bounded)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= _MEMO_MAX:
            cache.clear()
        value = cache[key] = make()
    return value


def _entry_tables(cp: CompactProgram, first: np.ndarray) -> Optional[np.ndarray]:
    """The entry table (`kernels.ENTRY_WIDTH` columns) of the entries `first` lists (each
    one's first task, weight dtype, group and zero flag): per entry its `kernels.E_*` values,
    elementwise flags and slot rules. None if some entry's params are invalid."""
    params, task_params = cp.params, cp.task_params
    rows, distinct = [], set()
    for t, dtype, group, zero in first.tolist():
        p = params[task_params[t]]
        values = tuple(p.__dict__.values())  # every field, read now: the memos never go stale
        distinct.add(values)
        row = _ROWS.get((values, dtype, group, zero))
        if row is None:
            row = _memo(_ROWS, (values, dtype, group, zero), lambda: _classed_row(p, dtype, group, zero))
        if row is False:
            return None
        rows.append(row)
    if len(distinct) != len(params):
        return None  # equal params listed twice: not the one encoding of this program
    rows = tuple(rows)  # (bytes: hashed once each, so a warm lookup costs little)
    return _memo(_TABLES, rows, lambda: np.frombuffer(b"".join(rows), np.int64).reshape(len(rows), kn.ENTRY_WIDTH))


def _classed_row(p, dtype: int, group: int, zero: int):
    """`_entry_row` of `p` and its weight (dtype -1: none; zero 1: it names a zero), shared by
    params that differ only in CLASSED_FLOATS values of one class (`form.float_class`): say,
    a norm epsilon."""
    weight = None if dtype == -1 else _Weight(dtype, None if group == -1 else group, 1 if zero else None)
    classed = CLASSED_FLOATS & p.__dict__.keys()  # (by name: the attributes operand_rules reads)
    if not classed:
        return _entry_row(p, weight)  # (no such field: the caller's memo, by the values, is the one)
    fields = dict(p.__dict__)
    for name in classed:
        fields[name] = float_class(fields[name])
    return _memo(_CLASSED_ROWS, (tuple(fields.values()), dtype, group, zero), lambda: _entry_row(p, weight))


def _entry_row(p, weight: Optional[_Weight]):
    """The entry table row of tasks with params `p` and this weight, from
    `form.operand_rules`, as ENTRY_WIDTH int64 values packed in bytes (immutable: shared by
    every program with these params): the `kernels.E_*` values, an elementwise flag per slot,
    each slot's rule (`kernels.R_*`: kind mask, dtype mask, kv mode, then length, count,
    stride, off, -1 where not constrained; unused slots 0: arity is checked before any rule
    is read). False if the params are invalid."""
    try:
        roles_in = weight_input_roles(p, weight)
        ins, outs, problems = operand_rules(p, weight)
        if problems or len(ins) != len(roles_in) or len(ins) > ir.MAX_INPUTS or len(outs) > ir.MAX_OUTPUTS:
            return False
        op, fields = p.op, p.__dict__  # (getattr with a default is slow on a pydantic model)
        quant = op == Op.GEMV and weight is not None and weight.dtype in QUANT
        if quant:
            head = [len(ins), len(outs), op, fields.get("hidden", -1), fields.get("col", -1), p.k, p.k_lo, 1]
            head += [roles_in.index(r) if r in roles_in else -1 for _, r in _QUANT_SLOTS]
        else:
            head = [len(ins), len(outs), op, fields.get("hidden", -1), fields.get("col", -1), -1, -1, 0, *_NO_QUANT_SLOTS]
        head += [r in ELEMENTWISE_ROLES for r in roles_in]
        head += _NO_FLAGS[len(roles_in):]
        # (each pack raises on a value that is no integer or overflows int64)
        return b"".join((_HEAD.pack(*head), *map(_rule_bytes, ins), _NO_RULES[ir.MAX_INPUTS - len(ins)],
                         *map(_rule_bytes, outs), _NO_RULES[ir.MAX_OUTPUTS - len(outs)]))
    except Exception:
        return False


def _rule_bytes(rule: Rule) -> bytes:
    """A rule's RULE_COLUMNS values (`kernels.R_*`), packed."""
    kinds, dtypes, length, count, stride, off, kv = rule  # (by position: the order is asserted below)
    return _RULE.pack(_mask(kinds), _mask(dtypes), kv, -1 if length is None else length, -1 if count is None else count,
                      -1 if stride is None else stride, -1 if off is None else off)


assert Rule._fields == ("kinds", "dtypes", "length", "count", "stride", "off", "kv")
assert (kn.R_KINDS, kn.R_DTYPES, kn.R_KV, kn.R_LEN, kn.R_COUNT, kn.R_STRIDE, kn.R_OFF) == tuple(range(kn.RULE_COLUMNS))
_HEAD = struct.Struct(f"={kn.E_RULES}q")  # the E_* values and the flags
_RULE = struct.Struct(f"={kn.RULE_COLUMNS}q")
assert _HEAD.size + _RULE.size * kn.SLOTS == 8 * kn.ENTRY_WIDTH
_NO_FLAGS = [False] * kn.SLOTS
_NO_QUANT_SLOTS = [-1] * len(_QUANT_SLOTS)
_NO_RULES = [bytes(_RULE.size * n) for n in range(kn.SLOTS + 1)]  # n unused slots' rules (zeros)


@functools.lru_cache(maxsize=256)
def _mask(codes: frozenset) -> int:
    """Bit c set for every code c (the rules' kind and dtype sets are a handful of constants)."""
    m = 0
    for c in codes:
        m |= 1 << int(c)
    return m
