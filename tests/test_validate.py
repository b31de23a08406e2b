"""The validator: safe programs accepted; for every check a minimal unsafe program rejected
under that check's name; never raises."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import ValidationError

from amk.eval.synthetic import layered_program
from amk.schedule import ir, validate as V
from amk.schedule.ir import BufferKind as K, DType as D
from amk.schedule.validate import program_hash, validate
from amk.schedule.compact import compact
from amk.schedule.validator import fast
from amk.schedule.validator.report import CHECK_GROUPS, Report
from programs import lm_head_program


@pytest.fixture(scope="module")
def base() -> dict:
    return layered_program(layers=2, width=4, hidden=64, vocab=128).model_dump(mode="json")


def _checks(prog) -> set[str]:
    res = validate(prog)
    assert not res.accepted
    assert all(v.reason for v in res.violations)
    return {v.check for v in res.violations}


def _task(d, name):
    return next(t for t in d["tasks"] if t["name"] == name)


def _buf(d, name):
    return next(b for b in d["buffers"] if b["name"] == name)


def _add_buffer(d, name, kind, dtype, shape, **kw):
    d["buffers"].append(dict(id=len(d["buffers"]), name=name, kind=int(kind), dtype=int(dtype), shape=shape, **kw))
    return len(d["buffers"]) - 1


def _add_counter(d):
    d["counters"].append({"id": len(d["counters"]), "name": ""})
    return len(d["counters"]) - 1


def _add_task(d, params, inputs, outputs, waits=()):
    """A task on a queue of its own, so only its waits order it."""
    c = _add_counter(d)
    tid = len(d["tasks"])
    d["tasks"].append(dict(id=tid, name=f"extra{tid}", params=params, inputs=inputs, outputs=outputs,
                           waits=[{"counter": a, "threshold": b} for a, b in waits], out_counter=c))
    d["queues"].append([tid])
    return tid


def op(buf, off, n, **kw):
    return dict(buf=buf, off=off, len=n, **kw)


# ----------------------------------------------------------------------------- accepted
@pytest.mark.parametrize("layers,width,hidden", [(1, 1, 32), (2, 4, 64), (3, 8, 256), (4, 36, 1152)])
def test_layered_programs_accepted(layers, width, hidden):
    prog = layered_program(layers=layers, width=width, hidden=hidden)
    res = validate(prog)
    assert res.accepted, res.summary()
    cert = res.certificate
    assert cert.tasks == len(prog.tasks) and cert.queues == len(prog.queues)
    assert set(cert.checks) == set(CHECK_GROUPS)
    assert len(cert.program_hash) == 64 and cert.conflicting_pairs_checked > 0


def test_accepts_dict_and_json_forms(base):
    assert validate(base).accepted
    assert validate(json.dumps(base)).accepted
    assert validate(json.dumps(base).encode()).accepted


def test_program_json_round_trip_is_exact():
    prog = layered_program(layers=2, width=4, hidden=64)
    text = prog.to_json()
    again = ir.Program.from_json(text)
    assert again == prog and again.to_json() == text


def test_kv_program_accepted():
    assert validate(_kv_program()).accepted


def test_program_without_waits_accepted():
    """One task, nothing to wait for: the empty columns (waits) still hash (certificate)."""
    from amk.schedule.targets import get_target

    bufs = [ir.Buffer(id=0, name="token", kind=K.IO_INPUT, dtype=D.I32, shape=[1]),
            ir.Buffer(id=1, name="embed", kind=K.WEIGHT, dtype=D.F32, shape=[16, 8]),
            ir.Buffer(id=2, name="out", kind=K.IO_OUTPUT, dtype=D.F32, shape=[8])]
    task = ir.Task(id=0, name="e", params=ir.EmbedParams(vocab=16, hidden=8),
                   inputs=[ir.Operand(buf=0, off=0, len=1), ir.Operand(buf=1, off=0, len=8, count=16, stride=8)],
                   outputs=[ir.Operand(buf=2, off=0, len=8)], waits=[], out_counter=0)
    prog = ir.Program(name="no-waits", target=get_target("h100"), threads_per_block=128, blocks_per_cu=1, kv_capacity=8,
                      buffers=bufs, counters=[ir.Counter(id=0, name="c")], tasks=[task], queues=[[0]])
    res = validate(prog)
    assert res.accepted, res.violations
    assert res.certificate.program_hash == V.program_hash(compact(prog))


# ----------------------------------------------------------------------------- one per check
def _mut_ids(d):
    d["tasks"][3]["id"] = 99


def _mut_reference(d):
    d["tasks"][5]["waits"][0]["counter"] = 999


def _mut_capacity(d):
    _buf(d, "a")["shape"] = [1 << 20, 1 << 17]


def _mut_arity(d):
    _task(d, "l0.a.1")["inputs"].pop()


def _mut_params(d):
    _task(d, "l0.a.1")["params"]["norm_eps"] = -1.0


def _mut_kind(d):
    _task(d, "l0.b.0")["outputs"][0]["buf"] = _buf(d, "token")["id"]


def _mut_dtype(d):
    _buf(d, "a")["dtype"] = int(D.I32)


def _mut_threshold(d):
    _task(d, "l0.b.2")["waits"][0]["threshold"] = 5


def _mut_self_wait(d):
    t = _task(d, "l0.b.2")
    t["waits"].append({"counter": t["out_counter"], "threshold": 4})


def _mut_dataflow_cycle(d):
    _task(d, "embed.0")["waits"].append({"counter": _task(d, "head")["out_counter"], "threshold": 1})


def _mut_queue_coverage(d):
    tid = _task(d, "l1.a.2")["id"]
    for q in d["queues"]:
        if tid in q:
            q.remove(tid)


def _mut_queue_order_deadlock(d):
    am = _task(d, "argmax")["id"]
    for q in d["queues"]:
        if am in q:
            q.remove(am)
    d["queues"][0].insert(0, am)


def _mut_coresidency(d):
    d["target"]["compute_units"] = 2


def _mut_partial_wait(d):
    _task(d, "l0.b.2")["waits"][0]["threshold"] = 1


def _mut_read_after_write(d):
    _task(d, "l0.b.2")["waits"] = []


def _mut_write_after_read(d):
    # l0.a.3 still reads x but now signals a counter nobody waits on: l0.b may overwrite x under it
    t = _task(d, "l0.a.3")
    t["out_counter"] = _add_counter(d)
    t["outputs"][0] = op(_add_buffer(d, "detached", K.SCRATCH, D.F32, [64]), 48, 16)
    for i in range(4):
        _task(d, f"l0.b.{i}")["waits"][0]["threshold"] = 3


def _mut_write_after_write(d):
    x, table = _buf(d, "x")["id"], _buf(d, "embed")["id"]
    _add_task(d, {"op": int(ir.Op.SILU_MUL), "n": 16}, [op(table, 0, 16), op(table, 16, 16)], [op(x, 0, 16)],
              waits=[(_task(d, "embed.0")["out_counter"], 4)])


def _mut_tile_overlap(d):
    t = _task(d, "embed.1")
    t["outputs"][0]["off"] = 8
    t["inputs"][1]["off"] = 8


def _mut_tile_gap(d):
    t = _task(d, "embed.1")
    t["outputs"][0].update(off=17, len=15)
    t["inputs"][1].update(off=17, len=15)


def _mut_uninitialized_read(d):
    _task(d, "embed.0")["outputs"][0]["buf"] = _add_buffer(d, "elsewhere", K.SCRATCH, D.F32, [64])


def _mut_out_of_bounds(d):
    _task(d, "l0.b.3")["outputs"][0]["off"] = 60


def _mut_kv_range(d):
    d.update(_kv_program(capacity_mismatch=True).model_dump(mode="json"))


def _mut_quant_shape(d):
    w = _buf(d, "l0.w1")
    w["dtype"] = int(D.I8)
    w["group"] = 32  # but no scale buffer


def _mut_self_alias(d):
    t = _task(d, "l0.a.1")  # reads all of x (norm prologue) and now writes a slab of x too
    t["outputs"][0]["buf"] = _buf(d, "x")["id"]


def _mut_complete(d):
    _add_buffer(d, "never_written", K.IO_OUTPUT, D.F32, [8])


def _mut_scope(d):
    # on a chiplet target the l0.a producers sit on queues of different XCDs (queue q on XCD q % 8),
    # so their counter may not take the cheaper XCD scope
    d["target"]["xcds"] = 8
    d["counters"][_task(d, "l0.a.0")["out_counter"]]["scope"] = int(ir.Scope.XCD)


def test_xcd_scope_inside_one_xcd_accepted(base):
    d = copy.deepcopy(base)
    _mut_scope(d)
    d["target"]["xcds"] = 1  # one XCD: every edge stays inside it
    assert validate(d).accepted


def _mut_kv_read_before_append(d):
    d.update(_kv_program(drop_append_wait=True).model_dump(mode="json"))


MUTANTS = {name[len("_mut_"):].replace("_", "-"): fn for name, fn in globals().items() if name.startswith("_mut_")}


def test_every_check_has_a_mutant():
    assert set(MUTANTS) | {"schema"} == set(CHECK_GROUPS)


@pytest.mark.parametrize("check", sorted(MUTANTS))
def test_mutant_rejected_under_its_check(base, check):
    d = copy.deepcopy(base)
    MUTANTS[check](d)
    assert check in _checks(d)


def test_cycle_witness_is_given(base):
    d = copy.deepcopy(base)
    _mut_dataflow_cycle(d)
    (v,) = [v for v in validate(d).violations if v.check == "dataflow-cycle"]
    assert v.cycle and any(s.startswith("counter") for s in v.cycle) and any(s.startswith("task") for s in v.cycle)


@pytest.mark.parametrize("bad", ["", "{", "[]", "42", "null", b"\xff\xfe", {}, {"tasks": 3}, 42, None, [1, 2]])
def test_schema_rejections(bad):
    res = validate(bad)
    assert not res.accepted and res.violations[0].check == "schema"


# ----------------------------------------------------------------------------- never raises
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=20)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_arbitrary_json_never_raises(value):
    res = validate(value)
    assert isinstance(res, ir.ValidationResult) and not res.accepted


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_arbitrary_mutations_never_raise(base, data):
    d = copy.deepcopy(base)
    paths = list(_paths(d))
    for _ in range(data.draw(st.integers(1, 4))):
        path = data.draw(st.sampled_from(paths))
        parent = d
        try:
            for k in path[:-1]:
                parent = parent[k]
            value = data.draw(st.integers(-3, 200) | JSON)
            parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    res = validate(d)
    assert isinstance(res, ir.ValidationResult)


# ----------------------------------------------------------------------------- a KV program
def _kv_program(capacity_mismatch: bool = False, drop_append_wait: bool = False) -> ir.Program:
    """q, k, v from an embedding; append k and v; attention over 2 splits; combine."""
    from amk.schedule.targets import get_target

    hd, cap = 8, 16
    B = []

    def buf(name, kind, dtype, shape):
        B.append(ir.Buffer(id=len(B), name=name, kind=kind, dtype=dtype, shape=shape))
        return len(B) - 1

    token, pos = buf("token", K.IO_INPUT, D.I32, [1]), buf("pos", K.IO_INPUT, D.I32, [1])
    table = buf("table", K.WEIGHT, D.F32, [32, 3 * hd])
    qkv = buf("qkv", K.ACTIVATION, D.F32, [3 * hd])
    kc = buf("k_cache", K.KV_CACHE, D.F32, [cap + (1 if capacity_mismatch else 0), hd])
    vc = buf("v_cache", K.KV_CACHE, D.F32, [cap, hd])
    o_part = buf("o_part", K.SCRATCH, D.F32, [2, hd])
    ml = buf("ml", K.SCRATCH, D.F32, [2, 2])
    out = buf("attn", K.IO_OUTPUT, D.F32, [hd])
    O = ir.Operand
    tasks = [
        ir.Task(id=0, params=ir.EmbedParams(vocab=32, hidden=3 * hd), inputs=[O(buf=token, off=0, len=1),
                O(buf=table, off=0, len=3 * hd, count=32, stride=3 * hd)], outputs=[O(buf=qkv, off=0, len=3 * hd)], out_counter=0),
        ir.Task(id=1, params=ir.KvAppendParams(n=hd), inputs=[O(buf=qkv, off=hd, len=hd), O(buf=pos, off=0, len=1)],
                outputs=[O(buf=kc, off=0, len=hd, kv=ir.KvMode.APPEND)], waits=[ir.Wait(counter=0, threshold=1)], out_counter=1),
        ir.Task(id=2, params=ir.KvAppendParams(n=hd), inputs=[O(buf=qkv, off=2 * hd, len=hd), O(buf=pos, off=0, len=1)],
                outputs=[O(buf=vc, off=0, len=hd, kv=ir.KvMode.APPEND)], waits=[ir.Wait(counter=0, threshold=1)], out_counter=1),
    ]
    append_wait = [] if drop_append_wait else [ir.Wait(counter=1, threshold=2)]
    for s in range(2):
        tasks.append(ir.Task(id=3 + s, params=ir.AttnPartialParams(head_dim=hd, q_heads=1, splits=2, split=s, block=4, scale=0.35),
                             inputs=[O(buf=qkv, off=0, len=hd), O(buf=kc, off=0, len=hd, kv=ir.KvMode.PREFIX),
                                     O(buf=vc, off=0, len=hd, kv=ir.KvMode.PREFIX), O(buf=pos, off=0, len=1)],
                             outputs=[O(buf=o_part, off=s * hd, len=hd), O(buf=ml, off=2 * s, len=2)],
                             waits=[ir.Wait(counter=0, threshold=1)] + append_wait, out_counter=2))
    tasks.append(ir.Task(id=5, params=ir.AttnCombineParams(head_dim=hd, q_heads=1, splits=2),
                         inputs=[O(buf=o_part, off=0, len=2 * hd), O(buf=ml, off=0, len=4)], outputs=[O(buf=out, off=0, len=hd)],
                         waits=[ir.Wait(counter=2, threshold=2)], out_counter=3))
    counters = [ir.Counter(id=i) for i in range(4)]
    return ir.Program(target=get_target("h100"), kv_capacity=cap, buffers=B, counters=counters, tasks=tasks,
                      queues=[[0, 1, 3], [2, 4, 5]])


# ----------------------------------------------------------------------------- the two paths
# validate() asks `validator.fast.verify` first and runs the explaining checks (`_run_checks`)
# whenever it does not certify the program; the fast path must never certify what the
# explaining path rejects, and must certify (with the same certificate) what it accepts.


def _explained(prog: ir.Program):
    """The explaining path alone (None where it raises: validate() then rejects, fail closed)."""
    rep = Report()
    try:
        pairs = V._run_checks(prog, rep)
        return V._accepted(compact(prog), pairs) if rep.ok else V._rejected(rep)
    except Exception:
        return None


def _fast_only(prog: ir.Program):
    cp = compact(prog)
    got = None if cp is None else fast.verify(cp)
    return None if got is None else V._accepted(cp, got)


def _agree(prog: ir.Program) -> bool:
    """Both paths on `prog`: the fast path certifies exactly what the explaining path
    accepts, with the same certificate; validate() answers as the explaining path does,
    given the Program or its compact form. Returns the verdict."""
    slow = _explained(prog)
    quick = _fast_only(prog)
    if slow is None:
        assert quick is None and not validate(prog).accepted
        return False
    if slow.accepted:
        assert quick is not None and quick.model_dump() == slow.model_dump()
    else:
        assert quick is None, [v.check for v in slow.violations]
    assert validate(prog).model_dump() == slow.model_dump()
    cp = compact(prog)
    if cp is not None:
        assert validate(cp).model_dump() == slow.model_dump()
    return slow.accepted


def test_fast_path_covers_every_check():
    assert fast.COVERED == frozenset(CHECK_GROUPS) and V._FAST


@pytest.mark.parametrize("check", sorted(MUTANTS))
def test_paths_agree_on_every_mutant(base, check):
    d = copy.deepcopy(base)
    MUTANTS[check](d)
    assert not _agree(ir.Program.model_validate(d))


def _renumbered(prog: ir.Program, seed: int) -> ir.Program:
    """The same program with its tasks listed (and numbered) in a random order, so that task
    ids are no longer a topological order."""
    import random

    order = list(range(len(prog.tasks)))
    random.Random(seed).shuffle(order)
    new_id = {old: new for new, old in enumerate(order)}
    tasks = [prog.tasks[old].replace(id=new) for new, old in enumerate(order)]
    queues = [[new_id[t] for t in q] for q in prog.queues]
    return prog.replace(tasks=tasks, queues=queues)


@pytest.mark.parametrize("layers,width,hidden", [(1, 1, 32), (2, 4, 64), (4, 36, 1152)])
def test_paths_agree_on_accepted_programs(layers, width, hidden):
    prog = layered_program(layers=layers, width=width, hidden=hidden)
    assert _agree(prog) and _agree(_kv_program())
    assert _agree(_renumbered(prog, seed=layers))  # topological order by Kahn's levels, not task ids


def test_paths_agree_on_fuzz_schedules():
    """Every class of the soundness campaign (real lowerings, random programs, one mutant
    per injected defect), a few schedules each."""
    from amk.eval import fuzz

    per_class: dict[str, int] = {}
    verdicts = set()
    for i in range(3 * len(fuzz.plan(fuzz.CLASSES))):
        cls, prog, _ = fuzz.make_schedule(7, i)
        if prog is None or per_class.get(cls, 0) >= 2:
            continue
        per_class[cls] = per_class.get(cls, 0) + 1
        verdicts.add(_agree(prog))
        if cls == fuzz.REAL:
            assert _agree(_renumbered(prog, seed=i))
    assert verdicts == {True, False}


def test_paths_agree_on_xcd_scoped_counters(base):
    d = copy.deepcopy(base)
    _mut_scope(d)
    d["target"]["xcds"] = 1  # XCD scope inside one XCD: accepted, through the scope rule of both paths
    assert _agree(ir.Program.model_validate(d))


def test_a_program_cannot_change_in_place():
    """A program and everything in it are frozen and its sequences tuples, so the compact
    form it keeps from when it was built (what the validator reads) cannot go stale."""
    prog = layered_program(layers=2, width=4, hidden=64)
    task = prog.tasks[5]
    for obj, field, value in ((prog, "queues", ()), (task, "waits", ()), (task.waits[0], "threshold", 1),
                              (task.inputs[0], "off", 1), (task.params, "k", 1), (prog.buffers[0], "shape", (2,)),
                              (prog.counters[0], "scope", ir.Scope.XCD)):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(obj, field, value)
    for seq in (prog.tasks, prog.buffers, prog.queues[0], task.inputs, task.waits, prog.buffers[0].shape):
        assert type(seq) is tuple
    assert compact(prog) is compact(prog)  # kept, not made again


def test_a_changed_copy_is_judged_anew():
    """A copy with a field replaced is judged on its own fields, not on the compact form its
    original kept (model_copy copies that along; `replace` derives its own)."""
    prog = layered_program(layers=2, width=4, hidden=64)
    assert validate(prog).accepted
    tasks = list(prog.tasks)
    tasks[5] = tasks[5].model_copy(update={"waits": ()})
    for dropped in (prog.replace(tasks=tasks), prog.model_copy(update={"tasks": tuple(tasks)})):
        res = validate(dropped)
        assert not res.accepted and "read-after-write" in {v.check for v in res.violations}
    moved = prog.model_copy(update={"queues": prog.queues[::-1]})
    assert validate(moved).certificate.program_hash == program_hash(moved) != program_hash(prog)
    for same in (copy.copy(prog), copy.deepcopy(prog), ir.Program.model_validate_json(prog.to_json())):
        assert validate(same).certificate.program_hash == program_hash(prog)


def test_a_program_of_lists_is_read_on_every_call():
    """A program built around validation (model_construct) with lists in it keeps no compact
    form: changed in place after an accepted validation, it is judged anew."""
    base = layered_program(layers=2, width=4, hidden=64)
    prog = ir.Program.model_construct(**{**base.__dict__, "tasks": list(base.tasks)})
    assert validate(prog).accepted
    prog.tasks[5] = prog.tasks[5].model_copy(update={"waits": ()})
    res = validate(prog)
    assert not res.accepted and "read-after-write" in {v.check for v in res.violations}


def test_fast_path_rereads_changed_params():
    """The entry-table memos are keyed by the params' field values: a program whose params
    differ from an accepted one's is judged anew (the memoised table of the old values is
    not reused), and the shared tables cannot be written."""
    prog = layered_program(layers=2, width=4, hidden=64)
    cp = compact(prog)
    assert fast.verify(cp) is not None and validate(prog).accepted
    entry = next(t for t in prog.tasks if t.params.op == ir.Op.EMBED)
    changed = prog.with_tasks(entry.replace(params=entry.params.replace(vocab=entry.params.vocab + 1)))
    assert fast.verify(compact(changed)) is None  # the table operand's count no longer matches
    res = validate(changed)
    assert not res.accepted and "params" in {v.check for v in res.violations}
    assert validate(prog).accepted
    tables = [v for v in fast._TABLES.values() if v is not None]
    assert tables and not any(t.flags.writeable for t in tables)


def test_accepted_result_is_built_as_model_construct_builds_it():
    """validate() builds its certificate and result without model_construct's per-field
    work: the same objects (and the models are still plain: no root, post-init, private
    attributes or extras that the shortcut would skip)."""
    for cls in (ir.Certificate, ir.ValidationResult):
        assert not cls.__pydantic_root_model__ and not cls.__pydantic_post_init__ and not cls.__private_attributes__
        assert cls.model_config.get("extra") != "allow"
    cp = compact(layered_program(layers=1, width=2, hidden=64))
    got = V._accepted(cp, 7)
    cert = ir.Certificate.model_construct(**dict(got.certificate.__dict__))
    want = ir.ValidationResult.model_construct(accepted=True, violations=[], certificate=cert)
    for a, b in ((got, want), (got.certificate, cert)):
        assert a == b and a.__dict__ == b.__dict__ and a.model_fields_set == b.model_fields_set
        assert (a.__pydantic_extra__, a.__pydantic_private__) == (b.__pydantic_extra__, b.__pydantic_private__)
    assert got.model_dump() == want.model_dump() and got.certificate.tasks == cp.num_tasks
    assert ir.ValidationResult.model_validate(got.model_dump()) == got


def test_program_hash_names_are_delimited():
    """The digest's names are counted and length-prefixed (JSON where one holds a NUL):
    names that would run together alike (a NUL inside one) hash apart."""
    cp = compact(layered_program(layers=1, width=2, hidden=64))
    names = list(cp.names)
    a = dataclasses.replace(cp, names=[names[0] + "\x00" + names[1]] + [""] + names[2:])
    b = dataclasses.replace(cp, names=[names[0]] + [names[1] + "\x00"] + names[2:])
    c = dataclasses.replace(cp, names=[names[0], "\x00" + names[1]] + names[2:])
    assert len({V.program_hash(x) for x in (cp, a, b, c)}) == 4


def test_classed_floats_are_read_only_by_their_class():
    """fast.py memoises operand rules by `float_class` of each CLASSED_FLOATS field: within a
    class, operand_rules and input_roles must not see the value (every params of the fuzz
    classes, each classed field set to values of each class)."""
    from amk.eval import fuzz
    from amk.schedule.opspec import input_roles
    from amk.schedule.validator.form import CLASSED_FLOATS, float_class, operand_rules

    params = {}
    for i in range(len(fuzz.plan(fuzz.CLASSES))):
        _, prog, _ = fuzz.make_schedule(11, i)
        for task in prog.tasks if prog is not None else ():
            params[json.dumps(task.params.model_dump(mode="json"), sort_keys=True)] = task.params
    values = [None, 1e-5, 0.5, 3, True, 1e300, 0.0, -0.0, -1e-5, float("inf"), float("nan"), False]
    seen = set()
    for p in params.values():
        for name in CLASSED_FLOATS & p.__dict__.keys():
            seen.add(name)
            by_class: dict = {}
            for v in values:
                q = p.model_copy(update={name: v})
                ins, outs, problems = operand_rules(q, None)
                got = (ins, outs, bool(problems), input_roles(q))
                assert by_class.setdefault(float_class(v), got) == got, (p, name, v)
    assert seen == CLASSED_FLOATS


def test_fast_path_tables_shared_by_float_class():
    """Programs differing only in a norm epsilon share tables, but an invalid epsilon is not
    of the valid one's class: both paths reject it after the valid one was accepted."""
    assert validate(compact(layered_program(layers=2, width=4, hidden=64, norm_eps=1e-5))).accepted
    assert validate(compact(layered_program(layers=2, width=4, hidden=64, norm_eps=3e-5))).accepted
    for bad in (0.0, -1e-5, float("inf"), float("nan")):
        prog = layered_program(layers=2, width=4, hidden=64, norm_eps=bad)
        assert fast.verify(compact(prog)) is None and not validate(prog).accepted


def test_argmax_slices_rules():
    """PARTIAL argmaxes (a slice -> its (max, index) pair in fp32) and their MERGE: accepted as
    lowered; rejected by name when an index would not be fp32-exact, a pair count does not
    match the pairs operand, a non-partial has a base, or a partial's pair goes to an integer
    token (a WHOLE argmax's output)."""
    prog, _ = lm_head_program(vocab=3000, hidden=32, tiles=2, slabs=7, argmax_slices=4)
    assert validate(prog).accepted
    d = prog.model_dump(mode="json")
    for name, change, want in [("argmax[750]", {"base": (1 << 24) - 10}, {"params"}),
                               ("argmax_merge", {"n": 3}, {"params"}),
                               ("argmax_merge", {"base": 4}, {"params"}),
                               ("argmax[750]", {"mode": int(ir.ArgmaxMode.WHOLE)}, {"params", "dtype"})]:
        bad = json.loads(json.dumps(d))
        _task(bad, name)["params"].update(change)
        assert want <= _checks(bad), (name, change)


def test_gemv_argmax_pair_rules():
    """The LM head's GEMV tasks writing their rows' argmax pair (GemvParams argmax_pair_base, a
    second output of two F32s) and the MERGE of those pairs: accepted by both paths as built;
    rejected by name when an index would not be fp32-exact, the epilogue is not STORE or split-K
    holds it, the pair is missing, too long, not one run or goes to an integer buffer, or the MERGE
    reads before the pairs' writers have all signalled."""
    prog, _ = lm_head_program(vocab=3000, hidden=32, tiles=2, slabs=7, head_pairs=True)
    assert validate(prog).accepted and _agree(prog)
    d = prog.model_dump(mode="json")
    token = _buf(d, "next_token")["id"]
    for name, change, want in [
            ("head[2571]", lambda t: t["params"].update(argmax_pair_base=(1 << 24) - 10), {"params"}),
            ("head[2571]", lambda t: t["params"].update(argmax_pair_base=-1), {"params"}),
            ("head[0]", lambda t: t["params"].update(epilogue=int(ir.Epilogue.ADD)), {"arity"}),  # (no residual)
            ("head[0]", lambda t: (t["params"].update(split_k=2, k_hi=16), t["outputs"].pop()), {"params"}),
            ("head[0]", lambda t: t["outputs"].pop(), {"arity"}),
            ("head[0]", lambda t: t["outputs"][1].update(len=3), {"params"}),
            ("head[0]", lambda t: t["outputs"][1].update(len=1, count=2, stride=2), {"params"}),  # (one run: the device's store)
            ("head[0]", lambda t: t["outputs"][1].update(buf=token, off=0, len=1), {"dtype", "params"}),
            ("argmax_merge", lambda t: t["waits"][0].update(threshold=6), {"partial-wait"})]:
        bad = json.loads(json.dumps(d))
        change(_task(bad, name))
        got = _checks(bad)
        assert want <= got, (name, got)
        assert not _agree(ir.Program.model_validate(bad))


def test_paths_agree_on_asymmetric_int8():
    """I8 weights with a zero companion (ScheduleConfig.quant_asym): the zero is an operand role
    of their GEMVs (`opspec.quant_roles`), both paths accept the lowering, and both reject a zero
    of the wrong shape, a GEMV that leaves the zero out, and a zero that names no buffer; a
    symmetric I8 program in the same validator process keeps its own entry rows."""
    from vm_cases import lowered

    prog, _ = lowered("llama-gqa-tied", quant="int8", quant_group=32, quant_asym=True, split_k=2)
    sym, _ = lowered("llama-gqa-tied", quant="int8", quant_group=32, split_k=2)
    zeros = [b for b in prog.buffers if b.dtype == D.I8 and b.zero is not None]
    assert zeros and not any(b.zero is not None for b in sym.buffers if b.dtype == D.I8)
    assert _agree(prog) and _agree(sym) and _agree(prog)
    w = zeros[0]
    bad_shape = prog.replace(buffers=[b.replace(shape=(b.shape[0], b.shape[1] + 1)) if b.id == w.zero else b
                                      for b in prog.buffers])
    no_buffer = prog.replace(buffers=[b.replace(zero=len(prog.buffers) + 5) if b.id == w.id else b
                                      for b in prog.buffers])
    gemv = next(t for t in prog.tasks if t.inputs and t.inputs[0].buf == w.id)
    dropped = prog.replace(tasks=[t.replace(inputs=tuple(o for o in t.inputs if o.buf != w.zero)) if t.id == gemv.id
                                  else t for t in prog.tasks])
    for broken in (bad_shape, no_buffer, dropped):
        assert not _agree(broken)
