"""The compact form of a `Program`: its buffers, counters and tasks as integer columns.

A `Program` holds one pydantic object per buffer, task, operand and wait, which is the
right form to write and read, but reading a few hundred of them costs a millisecond in
Python. `CompactProgram` is the same program in int64 arrays (plus the names, the distinct
params, the target and meta); the validator's fast path and the program digest read it.
A frozen Program makes it once, when it is built, and keeps it (`keep_compact`).

`compact(program)` and `expand(compact)` are exact inverses for programs whose ids are
dense and in order (as `validate()` requires); `compact` returns None for any other program
(and for a few other malformed ones), which the validator's explaining path rejects by name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from itertools import chain, groupby
from operator import itemgetter
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel

from amk.schedule import ir

OPERAND_COLUMNS = ("buf", "off", "len", "count", "stride", "kv")
BUFFER_COLUMNS = ("kind", "dtype", "rank", "d0", "d1", "d2", "d3", "scale", "zero", "group")  # -1: None / no such dim
HEADER_FIELDS = ("version", "name", "target", "threads_per_block", "blocks_per_cu", "kv_capacity", "meta")
_FIELDS = BaseModel.__dict__["__dict__"].__get__  # a model's field dict, without the __getattr__ hook
_TASK = itemgetter("id", "params", "inputs", "outputs", "waits", "out_counter", "name")
_OPERAND = itemgetter(*OPERAND_COLUMNS)
_WAIT = itemgetter("counter", "threshold")


@dataclass(frozen=True, eq=False)
class CompactProgram:
    """A Program with its buffers, counters and tasks as columns. Buffer b is row b of
    `buffers` (BUFFER_COLUMNS) and named buffer_names[b]; counter c has scope
    counter_scope[c] and name counter_names[c]. Task t's operands are n_in[t] + n_out[t]
    consecutive rows of `operands` (inputs first), after those of tasks 0..t-1; its waits
    likewise n_wait[t] rows of `waits`; queue q is the next queue_len[q] entries of
    `queue_tasks`. A Program keeps its compact form (`keep_compact`): nothing may write
    into one (its sequences are tuples; its arrays stay writable only because the compiled
    checks take every column as one array type)."""

    header: dict[str, Any]  # the Program's other fields (the target and meta as pydantic objects / values)
    buffer_names: tuple[str, ...]
    buffers: np.ndarray  # [nb, 10]: BUFFER_COLUMNS
    counter_names: tuple[str, ...]
    counter_scope: np.ndarray  # [nc]
    params: tuple  # the distinct params models, in order of first use
    names: tuple[str, ...]  # task names
    task_params: np.ndarray  # [nt] index into params
    out_counter: np.ndarray  # [nt]
    n_in: np.ndarray  # [nt]
    n_out: np.ndarray  # [nt]
    n_wait: np.ndarray  # [nt]
    operands: np.ndarray  # [n_operands, 6]: OPERAND_COLUMNS
    waits: np.ndarray  # [n_waits, 2]: counter, threshold
    queue_len: np.ndarray  # [nq]
    queue_tasks: np.ndarray  # [sum(queue_len)]

    def __getattr__(self, name: str):  # header fields read like a Program's: cp.target, cp.kv_capacity, ...
        header = self.__dict__.get("header")
        if header is not None and name in header:
            return header[name]
        raise AttributeError(name)

    @property
    def num_tasks(self) -> int:
        return len(self.task_params)

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def num_counters(self) -> int:
        return len(self.counter_scope)

    @property
    def num_queues(self) -> int:
        return len(self.queue_len)

    @property
    def num_waits(self) -> int:
        return len(self.waits)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Every integer column (COLUMN_NAMES), in the order the program digest hashes them."""
        f = self.__dict__
        return tuple(f[name] for name in COLUMN_NAMES)


COLUMN_NAMES = ("buffers", "counter_scope", "task_params", "out_counter", "n_in", "n_out", "n_wait", "operands", "waits",
                "queue_len", "queue_tasks")  # CompactProgram's integer columns, in digest order


def _ints(values: list) -> np.ndarray:
    """Writable int64 array of a list of Python ints; raises on anything else (floats, > 64 bits).
    (Writable as every other column: the compiled checks take them as one type.)"""
    return np.frombuffer(bytearray(struct.pack(f"={len(values)}q", *values)), dtype=np.int64)


def compact(prog: ir.Program) -> Optional[CompactProgram]:
    """The compact form of `prog`, or None if its ids are not 0..n-1 in order, a buffer's
    rank is outside 1..MAX_RANK or its scale/zero/group negative, or a value does not fit
    in 64 bits (the validator's explaining path rejects all of these by name). A program
    built from frozen parts keeps the form it was built with (`keep_compact`); callers must
    not write into its arrays."""
    kept = _kept_compact(prog)
    if kept is not None:
        return kept
    try:
        return _compact(prog)[0]  # (a program that keeps none: is it frozen is not asked)
    except (OverflowError, struct.error, TypeError):
        return None


def keep_compact(prog: ir.Program) -> None:
    """Make `prog`'s compact form and keep it with `prog` (`Program.model_post_init` calls
    this), where nothing in `prog` can change in place: its sequences are tuples of frozen
    objects. `compact(prog)` returns it while `prog`'s fields are those it was made from."""
    try:
        cp, frozen = _compact(prog, ask_frozen=True)
    except Exception:  # anything compact() cannot read: nothing kept (validate() judges it)
        return
    if frozen and cp is not None:
        ir.keep(prog, "compact", tuple(_FIELDS(prog).values()), cp)


def _kept_compact(prog) -> Optional[CompactProgram]:
    if not isinstance(prog, ir.Program):
        return None
    return ir.kept(prog, "compact", tuple(_FIELDS(prog).values()))


def _buffer_row(b: ir.Buffer) -> Optional[list]:
    f = _FIELDS(b)
    shape, extra = f["shape"], (f["scale"], f["zero"], f["group"])
    if not 1 <= len(shape) <= ir.MAX_RANK or any(v is not None and v < 0 for v in extra):
        return None
    return ([int(f["kind"]), int(f["dtype"]), len(shape), *shape] + [-1] * (ir.MAX_RANK - len(shape))
            + [-1 if v is None else v for v in extra])


def _all_of(cls: type, *seqs) -> bool:
    """Whether every item of every sequence is exactly a `cls` (not a lookalike, not a subclass)."""
    return all({*map(type, seq)} <= {cls} for seq in seqs)


def _frozen(prog: ir.Program, inputs, outputs, waits, operands: list, wait_objs: list, params) -> bool:
    """Whether every sequence in `prog` is a tuple of its own frozen types (lists could change
    in place under a kept compact form): the program's, then its tasks' (`inputs` .. `params`:
    per task, as `_compact` read them; `operands` and `wait_objs` all of them)."""
    f = _FIELDS(prog)
    bufs, counters, tasks, queues = f["buffers"], f["counters"], f["tasks"], f["queues"]
    return (_all_of(tuple, (bufs, counters, tasks, queues), queues, [b.shape for b in bufs], inputs, outputs, waits)
            and _all_of(ir.Buffer, bufs) and _all_of(ir.Counter, counters) and _all_of(ir.Task, tasks)
            and _all_of(ir.Operand, operands) and _all_of(ir.Wait, wait_objs) and {*map(type, params)} <= ir.PARAMS_TYPES)


def _compact(prog: ir.Program, ask_frozen: bool = False) -> tuple[Optional[CompactProgram], bool]:
    """(the compact form or None, whether nothing in `prog` can change in place: False
    unless `ask_frozen`)."""
    fields = _FIELDS(prog)
    header = {k: fields[k] for k in HEADER_FIELDS}
    bufs, counters = prog.buffers, prog.counters
    if any(b.id != i for i, b in enumerate(bufs)) or any(c.id != i for i, c in enumerate(counters)):
        return None, False
    buffer_rows = [_buffer_row(b) for b in bufs]
    if None in buffer_rows:
        return None, False
    tasks = prog.tasks
    if tasks:
        ids, params, inputs, outputs, waits, outc, names = zip(*map(_TASK, map(_FIELDS, tasks)))
    else:
        ids = params = inputs = outputs = waits = outc = names = ()
    if ids != tuple(range(len(tasks))):
        return None, False
    operand_objs = list(chain.from_iterable(chain.from_iterable(zip(inputs, outputs))))
    wait_objs = list(chain.from_iterable(waits))
    operands = _ints(list(chain.from_iterable(map(_OPERAND, map(_FIELDS, operand_objs))))).reshape(-1, len(OPERAND_COLUMNS))
    wv = _ints(list(chain.from_iterable(map(_WAIT, map(_FIELDS, wait_objs))))).reshape(-1, 2)
    keys = list(map(tuple, map(dict.values, map(_FIELDS, params))))
    # distinct params in order of first use; runs of equal params (the usual case) hashed once
    index: dict = {}
    distinct: list = []
    run_ids, run_lens = [], []
    at = 0
    for key, run in groupby(keys):
        i = index.setdefault(key, len(index))
        if i == len(distinct):
            distinct.append(params[at])
        n = len(list(run))
        run_ids.append(i)
        run_lens.append(n)
        at += n
    cp = CompactProgram(
        header=header, buffer_names=_packed([b.name for b in bufs]),
        buffers=_ints(list(chain.from_iterable(buffer_rows))).reshape(-1, len(BUFFER_COLUMNS)),
        counter_names=_packed([c.name for c in counters]), counter_scope=_ints([int(c.scope) for c in counters]),
        params=tuple(distinct), names=_packed(names),
        task_params=np.repeat(np.array(run_ids, dtype=np.int64), run_lens),
        out_counter=_ints(list(outc)), n_in=_ints(list(map(len, inputs))), n_out=_ints(list(map(len, outputs))),
        n_wait=_ints(list(map(len, waits))), operands=operands, waits=wv,
        queue_len=_ints(list(map(len, prog.queues))), queue_tasks=_ints(list(chain.from_iterable(prog.queues))),
    )
    return cp, ask_frozen and _frozen(prog, inputs, outputs, waits, operand_objs, wait_objs, params)


def _packed(names) -> tuple:
    """`names` as a tuple of copies made one after another, so they lie together in memory:
    the program digest reads every name, and scattered strings cost a cache miss apiece
    (several times the reading). The originals where a name holds a NUL (the separator)."""
    try:
        copies = "\x00".join(names).split("\x00")
    except TypeError:  # (a name that is no str: left as it is, for the validator to judge)
        return tuple(names)
    return tuple(copies) if len(copies) == len(names) else tuple(names)


def expand(cp: CompactProgram) -> ir.Program:
    """The Program that `cp` is the compact form of."""
    op_end = np.cumsum(cp.n_in + cp.n_out).tolist()
    w_end = np.cumsum(cp.n_wait).tolist()
    operands = [ir.Operand(buf=b, off=o, len=n, count=c, stride=s, kv=k) for b, o, n, c, s, k in cp.operands.tolist()]
    waits = [ir.Wait(counter=c, threshold=t) for c, t in cp.waits.tolist()]
    tasks = []
    o0 = w0 = 0
    for t, (pi, out, nin, o1, w1) in enumerate(zip(cp.task_params.tolist(), cp.out_counter.tolist(), cp.n_in.tolist(),
                                                    op_end, w_end)):
        tasks.append(ir.Task(id=t, params=cp.params[pi], inputs=tuple(operands[o0:o0 + nin]),
                             outputs=tuple(operands[o0 + nin:o1]), waits=tuple(waits[w0:w1]), out_counter=out, name=cp.names[t]))
        o0, w0 = o1, w1
    q_end = np.cumsum(cp.queue_len).tolist()
    flat = cp.queue_tasks.tolist()
    queues = tuple(tuple(flat[a - n:a]) for a, n in zip(q_end, cp.queue_len.tolist()))
    buffers = []
    for i, (name, row) in enumerate(zip(cp.buffer_names, cp.buffers.tolist())):
        kind, dtype, rank, *rest = row
        scale, zero, group = (None if v == -1 else v for v in rest[ir.MAX_RANK:])
        buffers.append(ir.Buffer(id=i, name=name, kind=kind, dtype=dtype, shape=tuple(rest[:rank]), scale=scale, zero=zero, group=group))
    counters = tuple(ir.Counter(id=i, name=name, scope=scope) for i, (name, scope) in enumerate(zip(cp.counter_names, cp.counter_scope.tolist())))
    return ir.Program.model_construct(**cp.header, buffers=tuple(buffers), counters=counters, tasks=tuple(tasks), queues=queues)

