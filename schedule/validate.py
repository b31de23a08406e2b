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

import enum
import gc
import hashlib
from typing import Any

import numpy as np

from pydantic import ValidationError

from amk.schedule import ir
from amk.schedule.validator import fast
from amk.schedule.validator.form import check_buffers, check_program_header, check_tasks
from amk.schedule.validator.order import Order
from amk.schedule.validator.race import Accesses, check_races, check_tiles
from amk.schedule.validator.report import CHECK_GROUPS, Report
from amk.schedule.validator.scope import check_scopes

CHECKS = sorted(CHECK_GROUPS)
_FAST = fast.COVERED == frozenset(CHECK_GROUPS)  # the fast path decides every check there is


def validate(program: Any) -> ir.ValidationResult:
    """Certify `program` (a Program, a dict, or JSON text/bytes) or list why not."""
    rep = Report()
    gc_was_on = gc.isenabled()
    gc.disable()  # the analysis allocates many small objects over a large object graph; GC passes cost seconds
    try:
        prog = _parse(program, rep)
        if prog is None:
            return _result(rep, None, 0)
        passed = _fast_path(prog)
        if passed is not None:
            return _result(rep, prog, *passed)
        pairs, table = _run_checks(prog, rep)
        return _result(rep, prog, pairs, table)
    except Exception as exc:  # fail closed: a validator bug must never accept or crash
        rep.add("schema", f"the validator could not analyse this input ({type(exc).__name__}: {str(exc)[:200]}).")
        return _result(rep, None, 0)
    finally:
        if gc_was_on:
            gc.enable()


def _parse(program: Any, rep: Report):
    if isinstance(program, ir.Program):
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


def _fast_path(prog: ir.Program):
    """(ordering checks made, tables) if the fast path shows `prog` passes every check, else
    None (then `_run_checks` decides)."""
    if not _FAST:
        return None
    try:
        return fast.verify(prog)
    except Exception:  # anything unexpected: the explaining path decides (and fails closed)
        return None


def _run_checks(prog: ir.Program, rep: Report):
    """All checks, each violation named; returns (ordering checks made, the operand table)."""
    check_program_header(prog, rep)
    check_buffers(prog, rep)
    table = check_tasks(prog, rep)
    order = Order(prog, rep)
    check_scopes(prog, order, rep)
    acc = Accesses(prog, table)
    check_tiles(prog, acc, rep)
    if not order.check_acyclic(rep):
        return 0, table  # happens-before is undefined on a cyclic graph; the cycle is the verdict
    if (order.queue_of < 0).any():
        return 0, table  # a task that never runs has no place in happens-before
    order.compute_clocks()
    return check_races(prog, order, acc, rep), table


def program_hash(prog: ir.Program, table=None) -> str:
    """SHA-256 of the whole program: everything but the tasks as JSON, the distinct params,
    the task names, then every task's params index, counter and waits and every operand as
    integer tables. Same program, same hash (and cheap: no per-task JSON)."""
    if table is None:
        table = check_tasks(prog, Report())
    h = hashlib.sha256()
    h.update(prog.model_dump_json(exclude={"tasks"}).encode())
    h.update(repr([tuple(int(v) if isinstance(v, enum.IntEnum) else v for v in p) for p in table.params]).encode())
    names = getattr(table, "names", None)
    h.update("\x00".join(names if names is not None else [t.name for t in prog.tasks]).encode())
    for part in (table.task_rows, table.wait_rows, table.array[:, :9]):  # the rule id column is derived
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def _result(rep: Report, prog, pairs: int, table=None) -> ir.ValidationResult:
    if not rep.ok or prog is None:
        return ir.ValidationResult(accepted=False, violations=rep.violations)
    cert = ir.Certificate(
        program_hash=program_hash(prog, table), checks=CHECKS, tasks=len(prog.tasks), buffers=len(prog.buffers),
        counters=len(prog.counters), queues=len(prog.queues),
        waits=len(table.wait_rows) if table is not None else sum(len(t.waits) for t in prog.tasks),
        conflicting_pairs_checked=pairs,
    )
    return ir.ValidationResult(accepted=True, certificate=cert)
