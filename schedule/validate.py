"""`validate(program) -> ValidationResult`: the frozen static gate of AMK.

A program is accepted only if it is well-formed, deadlock-free, race-free, memory-safe
and complete (see `validator/report.CHECK_GROUPS` for every check). All checks run at
every program size. The function never raises: unreadable input, a malformed dict or an
internal error is a rejection with a reason, never an exception (fail closed).

Two paths run the same checks. `validator/fast.verify` decides whether the program passes
every one of them, without explaining failures; when it does not say so (a failure, or
anything it does not handle), `_run_checks` runs every check again and names each
violation, and its verdict is the answer. A new check goes into both (`fast.COVERED` lists
the checks the fast path decides; while it differs from CHECK_GROUPS only `_run_checks` runs).

Frozen: a change here needs a new soundness campaign (`amk fuzz`).
"""

from __future__ import annotations

import gc
import hashlib
import struct
from itertools import chain
from typing import Any, Optional

import pydantic_core
from pydantic import ValidationError

from amk.schedule import ir
from amk.schedule.compact import COLUMN_NAMES, CompactProgram, compact, expand
from amk.schedule.validator import fast, kernels
from amk.schedule.validator.form import check_buffers, check_program_header, check_tasks
from amk.schedule.validator.order import Order
from amk.schedule.validator.race import Accesses, check_races, check_tiles
from amk.schedule.validator.report import CHECK_GROUPS, Report
from amk.schedule.validator.scope import check_scopes

CHECKS = sorted(CHECK_GROUPS)
_FAST = fast.AVAILABLE and fast.COVERED == frozenset(CHECK_GROUPS)  # the fast path decides every check there is


def validate(program: Any) -> ir.ValidationResult:
    """Certify `program` (a Program, its CompactProgram, a dict, or JSON text/bytes) or list why not."""
    rep = Report()
    gc_was_on = gc.isenabled()
    gc.disable()  # the analysis allocates many small objects over a large object graph; GC passes cost seconds
    try:
        prog = _parse(program, rep)
        if prog is None:
            return _rejected(rep)
        cp = prog if isinstance(prog, CompactProgram) else compact(prog)
        pairs = _fast_path(cp)
        if pairs is not None:
            return _accepted(cp, pairs)
        if isinstance(prog, CompactProgram):  # the explaining path reads objects; hash what it judged
            prog = expand(prog)
            cp = compact(prog)
        pairs = _run_checks(prog, rep)
        if not rep.ok:
            return _rejected(rep)
        if cp is None:  # (the explaining path rejects every program without a compact form)
            raise ValueError("an accepted program has no compact form")
        return _accepted(cp, pairs)
    except Exception as exc:  # fail closed: a validator bug must never accept or crash
        rep.add("schema", f"the validator could not analyse this input ({type(exc).__name__}: {str(exc)[:200]}).")
        return _rejected(rep)
    finally:
        if gc_was_on:
            gc.enable()


def fast_path_on() -> bool:
    """Whether validate() decides accepted programs on the compiled fast path (numba is
    installed); without it every program goes through the explaining path: same verdicts,
    slower."""
    return _FAST


def _parse(program: Any, rep: Report):
    if isinstance(program, (ir.Program, CompactProgram)):
        return program
    try:
        if isinstance(program, (str, bytes, bytearray)):
            return ir.Program.model_validate_json(program)
        return ir.Program.model_validate(program)
    except ValidationError as exc:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": str(exc)}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        rep.add("schema", f"not a Program: {len(errs)} schema error(s), first at '{loc}': {first.get('msg')}.")
    except Exception as exc:
        rep.add("schema", f"not a Program: {type(exc).__name__}: {str(exc)[:200]}.")
    return None


def _fast_path(cp: Optional[CompactProgram]) -> Optional[int]:
    """The ordering checks made if the fast path shows `cp` passes every check, else None
    (then `_run_checks` decides)."""
    if not _FAST or cp is None:
        return None
    try:
        return fast.verify(cp)
    except Exception:  # anything unexpected: the explaining path decides (and fails closed)
        return None


def _run_checks(prog: ir.Program, rep: Report) -> int:
    """All checks, each violation named; returns the ordering checks made."""
    check_program_header(prog, rep)
    check_buffers(prog, rep)
    table = check_tasks(prog, rep)
    order = Order(prog, rep)
    check_scopes(prog, order, rep)
    acc = Accesses(prog, table)
    check_tiles(prog, acc, rep)
    if not order.check_acyclic(rep):
        return 0  # happens-before is undefined on a cyclic graph; the cycle is the verdict
    if (order.queue_of < 0).any():
        return 0  # a task that never runs has no place in happens-before
    order.compute_clocks()
    return check_races(prog, order, acc, rep)


def program_hash(program) -> str:
    """SHA-256 of the whole program (a Program or its CompactProgram; both hash alike): its
    other fields and its distinct params as one JSON document, its names (`_names`), then
    every integer column of the compact form, each column narrowed losslessly to the fewest
    bytes per value that hold it (`kernels.narrow_arrays`: SHA-256 costs by the byte). Each
    part delimits itself, so no two programs' parts run together alike. Same program, same
    hash (and cheap: no per-task JSON)."""
    cp = program if isinstance(program, CompactProgram) else compact(program)
    if cp is None:
        raise ValueError("a program whose task ids are not 0..n-1 has no hash")
    h = hashlib.sha256(pydantic_core.to_json((cp.header, cp.params), inf_nan_mode="constants"))
    h.update(_names(cp))
    f = cp.__dict__
    h.update(_narrow(tuple(f[name] for name in _MATRICES), tuple(f[name] for name in _VECTORS)))
    return h.hexdigest()


_narrow = kernels.narrow_arrays if kernels.AVAILABLE else kernels.narrow_arrays_numpy
_MATRICES = ("buffers", "operands", "waits")  # the 2-D integer columns, then the 1-D ones (COLUMN_NAMES, in order)
_VECTORS = tuple(name for name in COLUMN_NAMES if name not in _MATRICES)


def _names(cp: CompactProgram) -> bytes:
    """The buffer, counter and task names, unambiguously: how many of each and the encoding's
    length, then all of them joined by NUL (a plain join: JSON escaping costs three times as
    much); where some name holds a NUL, their JSON instead, tagged apart."""
    lists = (cp.buffer_names, cp.counter_names, cp.names)
    counts = tuple(map(len, lists))
    text = "\x00".join(chain.from_iterable(lists))
    if text.count("\x00") == max(sum(counts) - 1, 0):
        tag, data = b"N", text.encode()
    else:
        tag, data = b"J", pydantic_core.to_json(lists)
    return tag + struct.pack("<4q", *counts, len(data)) + data


def _rejected(rep: Report) -> ir.ValidationResult:
    return ir.ValidationResult(accepted=False, violations=rep.violations)


def _accepted(cp: CompactProgram, pairs: int) -> ir.ValidationResult:
    cert = _construct(ir.Certificate, {
        "program_hash": program_hash(cp), "checks": list(CHECKS), "tasks": cp.num_tasks, "buffers": cp.num_buffers,
        "counters": cp.num_counters, "queues": cp.num_queues, "waits": cp.num_waits, "conflicting_pairs_checked": int(pairs),
    })
    return _construct(ir.ValidationResult, {"accepted": True, "violations": [], "certificate": cert})


def _construct(cls, fields: dict):
    """`cls.model_construct(**fields)` where `fields` holds every field of `cls` (a plain
    model: no extras, private attributes or post-init), each already of its type: what
    model_construct does, less its per-field default handling (a few microseconds a
    validation). `tests/test_validate.py` checks that both build the same object."""
    m = cls.__new__(cls)
    _set(m, "__dict__", fields)
    _set(m, "__pydantic_fields_set__", set(fields))
    _set(m, "__pydantic_extra__", None)
    _set(m, "__pydantic_private__", None)
    return m


_set = object.__setattr__
