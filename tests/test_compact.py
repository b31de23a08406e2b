"""The compact form of a Program (`schedule/compact.py`) and the validator on it: exact round
trips, the same verdict and certificate as for the Program, and no crash (numba does not
bounds-check) whatever the columns hold."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from amk.eval.synthetic import layered_program
from amk.schedule import ir, validate as V
from amk.schedule.compact import COLUMN_NAMES, HEADER_FIELDS, OPERAND_COLUMNS, CompactProgram, compact, expand
from amk.schedule.validate import validate
from amk.schedule.validator import fast
from amk.schedule.validator.report import Report


def _real_programs():
    from amk.eval import fuzz

    out = []
    for i in range(4 * len(fuzz.plan(fuzz.CLASSES))):
        cls, prog, _ = fuzz.make_schedule(3, i, classes=(fuzz.REAL,))
        if prog is not None:
            out.append(prog)
        if len(out) == 2:
            break
    return out


@pytest.fixture(scope="module")
def programs():
    return [layered_program(layers=2, width=4, hidden=64), layered_program(layers=3, width=9, hidden=288)] + _real_programs()


def test_round_trip_is_exact(programs):
    for prog in programs:
        cp = compact(prog)
        assert cp is not None and cp.num_tasks == len(prog.tasks)
        assert expand(cp) == prog
        assert expand(cp).model_dump_json() == prog.model_dump_json()


def test_names_round_trip_with_separators_and_odd_names(programs):
    """The compact form copies the names into one run of memory (`compact._packed`, joined
    and split at NUL); names that hold a NUL, or are empty, come back exactly as they were."""
    prog = programs[0]
    tasks = list(prog.tasks)
    for odd in ("a\x00b", "", "\x00", "caf\u00e9 \U0001f600"):
        tasks[1] = tasks[1].model_copy(update={"name": odd})
        renamed = prog.model_copy(update={"tasks": tuple(tasks)})
        cp = compact(renamed)
        assert cp.names == tuple(t.name for t in renamed.tasks)
        assert expand(cp) == renamed
        assert V.program_hash(cp) != V.program_hash(prog)


def test_every_model_field_has_a_column():
    """A field added to the IR must get a place in the compact form (the fast path judges and
    the digest covers only what compact() keeps)."""
    assert set(ir.Operand.model_fields) == set(OPERAND_COLUMNS)
    assert set(ir.Wait.model_fields) == {"counter", "threshold"}
    assert set(ir.Task.model_fields) == {"id", "params", "inputs", "outputs", "waits", "out_counter", "name"}
    assert set(ir.Buffer.model_fields) == {"id", "name", "kind", "dtype", "shape", "scale", "zero", "group"}
    assert set(ir.Counter.model_fields) == {"id", "name", "scope"}
    assert set(ir.Program.model_fields) == set(HEADER_FIELDS) | {"buffers", "counters", "tasks", "queues"}


def test_equal_params_are_stored_once(programs):
    prog = programs[1]
    cp = compact(prog)
    assert len(cp.params) == len({tuple(t.params.__dict__.values()) for t in prog.tasks}) < len(prog.tasks)
    assert all(cp.params[i] == t.params for i, t in zip(cp.task_params.tolist(), prog.tasks))


def test_no_compact_form_without_dense_task_ids(programs):
    prog = programs[0]
    shuffled = prog.model_copy(update={"tasks": (prog.tasks[1], prog.tasks[0], *prog.tasks[2:])})
    assert compact(shuffled) is None
    res = validate(shuffled)
    assert not res.accepted and "ids" in {v.check for v in res.violations}


def test_validate_gives_the_same_certificate_for_both_forms(programs):
    for prog in programs:
        a, b = validate(prog), validate(compact(prog))
        assert a.accepted and a.model_dump() == b.model_dump()
        assert V.program_hash(prog) == V.program_hash(compact(prog)) == a.certificate.program_hash


def test_hash_sees_every_column(programs):
    prog = programs[0]
    h = V.program_hash(prog)
    cp = compact(prog)
    for name in ("buffers", "counter_scope", "out_counter", "n_wait", "operands", "waits", "queue_tasks"):
        col = getattr(cp, name).copy()
        col.reshape(-1)[-1] += 1
        assert V.program_hash(dataclasses.replace(cp, **{name: col})) != h, name
    for name in ("names", "buffer_names", "counter_names"):
        renamed = dataclasses.replace(cp, **{name: ("x", *getattr(cp, name)[1:])})
        assert V.program_hash(renamed) != h, name


def _decode_narrowed(e: bytes) -> list:
    """The arrays that `kernels.narrow_arrays` bytes encode (each column at its own width)."""
    arrays, at = [], 0
    while at < len(e):
        rows, cols = np.frombuffer(e[at:at + 16], dtype="<i8").tolist()
        at += 16
        columns = []
        for _ in range(cols):
            w = e[at]
            assert w in (1, 2, 4, 8)
            columns.append(np.frombuffer(e[at + 1:at + 1 + w * rows], dtype=f"<i{w}").astype(np.int64))
            at += 1 + w * rows
        arrays.append(np.stack(columns, axis=1) if cols else np.zeros((rows, 0), np.int64))
    return arrays


def test_hash_narrowing_is_exact():
    """The digest narrows each column to the fewest bytes that hold it: values on either side
    of every width's edge, and the same values in another shape, encode differently; the
    encoding decodes to the arrays; the compiled, plain-Python and numpy encodings agree."""
    from amk.schedule.validator import kernels
    edges = [v for w in (8, 16, 32) for v in (2 ** (w - 1) - 1, 2 ** (w - 1), -(2 ** (w - 1)), -(2 ** (w - 1)) - 1)]
    cases = [np.array([[v]], np.int64) for v in edges + [0, -1, 2 ** 63 - 1, -(2 ** 63)]]
    cases += [np.array([[1, 2]], np.int64), np.array([[1], [2]], np.int64), np.zeros((0, 2), np.int64)]
    cases += [np.array([[1, 300], [2, -70000]], np.int64), np.array([[300, 1], [-70000, 2]], np.int64)]
    vector = np.array([5, -300], np.int64)  # (taken as one column, after the matrices)

    def encode(fn, a):
        return bytes(fn((a,), (vector,)))

    encoded = [encode(kernels.narrow_arrays, a) for a in cases]
    assert len(set(encoded)) == len(cases)
    for a, e in zip(cases, encoded):
        assert encode(getattr(kernels.narrow_arrays, "py_func", kernels.narrow_arrays), a) == e
        assert encode(kernels.narrow_arrays_numpy, a) == e
        assert [x.tolist() for x in _decode_narrowed(e)] == [a.tolist(), vector.reshape(-1, 1).tolist()]
    assert e[16] == 4 and e[16 + 1 + 2 * 4] == 1  # (the last case: a column of 4-byte values, then one of 1-byte)
    rng = np.random.default_rng(0)
    arrays = tuple(rng.integers(-(1 << (8 * w - 2)), 1 << (8 * w - 2), size=(n, c)).astype(np.int64)
                   for w, n, c in ((1, 5, 3), (2, 0, 4), (4, 9, 1), (8, 3, 6)))
    vectors = (np.arange(-3, 900, dtype=np.int64), np.zeros(0, np.int64))
    e = bytes(kernels.narrow_arrays(arrays, vectors))
    assert bytes(kernels.narrow_arrays_numpy(arrays, vectors)) == e
    assert [x.tolist() for x in _decode_narrowed(e)] == [a.tolist() for a in arrays] + [v.reshape(-1, 1).tolist() for v in vectors]


def test_hash_without_numba_is_the_same(programs, monkeypatch):
    """Without numba the digest narrows with numpy: the same hash."""
    from amk.schedule.validator import kernels
    h = V.program_hash(programs[0])
    monkeypatch.setattr(V, "_narrow", kernels.narrow_arrays_numpy)
    assert V.program_hash(programs[0]) == h


def _rejected_without_crash(cp: CompactProgram) -> None:
    res = validate(cp)
    assert not res.accepted and res.violations


def test_malformed_columns_are_rejected(programs):
    cp = compact(programs[0])
    bad = [
        dataclasses.replace(cp, operands=cp.operands[:-1]),  # fewer operand rows than the tasks name
        dataclasses.replace(cp, waits=cp.waits[:, :1].copy()),
        dataclasses.replace(cp, queue_tasks=cp.queue_tasks[:-1]),
        dataclasses.replace(cp, task_params=cp.task_params + len(cp.params)),  # params index out of range
        dataclasses.replace(cp, names=cp.names[:-1]),
        dataclasses.replace(cp, buffer_names=cp.buffer_names[:-1]),
        dataclasses.replace(cp, buffers=cp.buffers[:, :-1].copy()),
        dataclasses.replace(cp, counter_scope=cp.counter_scope + 7),  # not a Scope code
    ]
    for b in bad:
        assert fast.verify(b) is None
        _rejected_without_crash(b)
    # other integer types: the fast path declines, the explaining path judges the same program
    narrow = dataclasses.replace(cp, operands=cp.operands.astype(np.int32))
    assert fast.verify(narrow) is None and validate(narrow).model_dump() == validate(cp).model_dump()


# the values a mutation may write into a column (COLUMN_NAMES): in range, just out of range, far out of range
_VALUES = st.one_of(st.integers(-3, 70), st.sampled_from([-(1 << 62), (1 << 40), (1 << 62)]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(COLUMN_NAMES), st.integers(0, 10**6), _VALUES), min_size=1, max_size=3))
def test_mutated_columns_never_crash_and_never_fool_the_fast_path(edits):
    """Arbitrary edits of the integer columns: validate() never raises (nor crashes the
    process), and whatever the fast path certifies the explaining path accepts, with the
    same certificate."""
    cp = compact(layered_program(layers=2, width=3, hidden=48))
    cols = {name: getattr(cp, name).copy() for name in COLUMN_NAMES}
    for name, at, value in edits:
        flat = cols[name].reshape(-1)
        if len(flat):
            flat[at % len(flat)] = value
    mutated = dataclasses.replace(cp, **cols)
    res = validate(mutated)
    quick = fast.verify(mutated)
    if quick is None:
        return
    assert res.accepted
    rep = Report()
    prog = expand(mutated)
    assert V._run_checks(prog, rep) == quick and rep.ok
    assert res.model_dump() == validate(prog).model_dump()


@pytest.mark.skipif(not fast.AVAILABLE, reason="numba is not installed")
@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=60), far=st.booleans())
def test_segment_ranks_by_table_and_by_sorting_agree(data, far):
    """`kernels.segments` ranks interval ends with a table on small axes and by sorting on
    large ones: both give each end's rank among the distinct ends."""
    from amk.schedule.validator import kernels as kn

    lo = np.array([a for a, _ in data], dtype=np.int64) + ((1 << 40) if far else 0)  # far: the sorting branch
    hi = lo + np.array([n for _, n in data], dtype=np.int64)
    s_lo, s_hi, nseg = kn.segments(lo, hi)
    points = np.unique(np.concatenate((lo, hi)))
    assert nseg == len(points)
    assert (s_lo == np.searchsorted(points, lo)).all() and (s_hi == np.searchsorted(points, hi)).all()
