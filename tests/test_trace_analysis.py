"""eval/trace_step.analyse on a fabricated trace (no GPU): per-kind sums, the in-op phases
from the ops' marks, and the critical path walked back through waits and queue order."""

from __future__ import annotations

import numpy as np
import pytest

from amk.eval.trace_step import analyse, export_defines, raw_trace, task_kind
from amk.vm.loader import experiment_defines
from programs import lm_head_program


def _fake_trace(program):
    """Queues run back to back from t=1000 ns; each task waits 100 ns, runs 1000 ns, and
    marks two phases (300 and 700 ns after its wait was met) when it is a GEMV."""
    index = {t.id: i for i, t in enumerate(program.tasks)}
    tr = np.zeros((len(program.tasks), 6), dtype=np.int64)
    for queue in program.queues:
        now = 1000
        for tid in queue:
            i = index[tid]
            tr[i, 0], tr[i, 1], tr[i, 2] = now, now + 100, now + 1100
            if str(getattr(program.tasks[i].op, "value", program.tasks[i].op)) == "2":  # Op.GEMV
                tr[i, 3], tr[i, 4] = now + 400, now + 800
            now += 1200
    return tr


def test_phases_and_critical_path():
    prog, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5)
    r = analyse(prog, _fake_trace(prog))
    assert r["ntasks"] == len(prog.tasks)
    gemv = [k for k in r["phases"] if k.startswith("2")]
    assert gemv, r["phases"].keys()
    for k in gemv:
        p = r["phases"][k]
        assert abs(p["phase0_us"] - 0.3) < 1e-9 and abs(p["phase1_us"] - 0.4) < 1e-9 and abs(p["phase2_us"] - 0.3) < 1e-9
    assert all(not k.startswith("2") for k in set(r["per_kind"]) - set(r["phases"]))  # unmarked ops: no phases
    assert r["critical_path"]["len"] >= 1
    assert abs(r["step_us"] - (r["critical_path"]["rows"][-1]["done_us"])) < 1e-9


def test_raw_trace_keeps_the_table_rebased():
    """trace_raw.npz's arrays: the table in ns from the first wait (unwritten marks stay 0),
    each task's kind, and its queue and place there as the program's queues say."""
    prog, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5)
    tr = _fake_trace(prog)
    raw = raw_trace(prog, tr)
    assert raw["trace"].shape == tr.shape and raw["trace"][:, 0].min() == 0
    assert (raw["trace"][:, :3] == tr[:, :3] - 1000).all()
    assert ((raw["trace"][:, 3:] == 0) == (tr[:, 3:] == 0)).all()
    assert raw["kind"].tolist() == [task_kind(t) for t in prog.tasks]
    index = {t.id: i for i, t in enumerate(prog.tasks)}
    for q, queue in enumerate(prog.queues):
        for k, tid in enumerate(queue):
            assert (raw["queue"][index[tid]], raw["qpos"][index[tid]]) == (q, k)


def test_compare_two_traces(tmp_path):
    """--compare reads the median step of each file and prints before -> after per kind."""
    import json

    from amk.eval.trace_step import compare, median_step

    prog, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5)
    tr = _fake_trace(prog)
    before = analyse(prog, tr)
    tr2 = tr.copy()
    tr2[:, 2] += 500  # every op 0.5 us longer
    after = analyse(prog, tr2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"steps": [after, before, after]}))
    assert median_step(str(path))["step_us"] == after["step_us"]
    lines = compare(before, after)
    assert lines[0] == f"step us: {before['step_us']:8.2f} -> {after['step_us']:8.2f}"
    gemv = next(line for line in lines if line.strip().startswith("2") and "|" in line)
    assert "0.30 ->     0.80" in gemv  # the last phase (epilogue) grew by the 0.5 us
    assert any(line.strip().startswith("2") and " op " in line for line in lines)


def test_defines_reach_the_loader(monkeypatch):
    """--define goes through $AMK_VM_DEFINES (merged, the flag winning), which is what the
    loader's builds, shared-memory sizes and packed layout fields read."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_XPAD=1,AMK_SPIN_MIN_NS=64")
    export_defines(["AMK_GEMV_XPAD=0", "AMK_DIAG_Q_NO_MATH=1"])
    assert experiment_defines() == {"AMK_GEMV_XPAD": 0, "AMK_SPIN_MIN_NS": 64, "AMK_DIAG_Q_NO_MATH": 1}
    with pytest.raises(ValueError):
        export_defines(["NOT_AMK=1"])


def test_release_column():
    """A seventh column (body done, before the counter release) gives each kind's mean release
    time; six-column traces (older builds) report none."""
    prog, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5)
    tr6 = _fake_trace(prog)
    tr7 = np.concatenate([tr6, (tr6[:, 2] - 250)[:, None]], axis=1)  # released 250 ns after the body
    r6, r7 = analyse(prog, tr6), analyse(prog, tr7)
    for k, v in r7["per_kind"].items():
        assert abs(v["release_sum_us"] / v["n"] - 0.25) < 1e-9, k
    assert all(v["release_sum_us"] == 0.0 for v in r6["per_kind"].values())
    assert r6["phases"] == r7["phases"]  # the body column is not a phase mark
    from amk.eval.trace_step import compare

    assert any("counter release" in line for line in compare(r6, r7))


def test_contention_buckets_by_stage_run():
    """`contention`: per kind, mark 1 -> body done grouped by how many other tasks of the same
    run of consecutive tasks were between their marks 0 and 1 at that moment."""
    from amk.eval.trace_step import contention

    # two runs of kind "g" (3 tasks, then 2) split by a task of kind "a"; columns: ws wm done m0 m1 m2 body
    rows = [  # run 1: task 0 ends its rows at 10 while tasks 1, 2 still stream; 1 at 20 with 2 streaming; 2 last
        (0, 0, 0, 1, 10, 0, 15), (0, 0, 0, 1, 20, 0, 22), (0, 0, 0, 1, 30, 0, 31),
        (0, 0, 0, 0, 0, 0, 5),
        (0, 0, 0, 1, 40, 0, 44), (0, 0, 0, 1, 50, 0, 51),  # run 2: 40 (one streaming), 50 (none)
    ]
    raw = {"trace": np.array(rows, dtype=np.int64) * 1000,
           "kind": np.array(["g", "g", "g", "a", "g", "g"])}
    got = contention(raw)
    assert set(got) == {"g"}  # "a" has no mark 1
    by_bucket = {b: (n, us) for b, n, us in got["g"]}
    assert by_bucket["0"] == (2, pytest.approx(1.0))  # tasks 2 and 5: 1 us each
    n, us = by_bucket["1-10"]  # tasks 0 (2 streaming, 5 us), 1 (1, 2 us), 4 (1, 4 us)
    assert n == 3 and us == pytest.approx(11 / 3)


def test_rows_phase_by_task_rows():
    """`rows_phase`: the marks 0 -> 1 time of each GEMV, grouped by kind and the task's rows;
    a program whose tasks are not the traced ones is refused."""
    from amk.eval.trace_step import rows_phase

    prog, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=7)
    raw = raw_trace(prog, _fake_trace(prog))
    got = rows_phase(raw, prog)
    gemv_rows = [t.params.rows for t in prog.tasks if task_kind(t).startswith("2")]
    assert sum(n for n, _ in got.values()) == len(gemv_rows)
    assert {rows for _, rows in got} == set(gemv_rows) and len(set(gemv_rows)) > 1  # 300 rows in 7 slabs
    assert all(us == pytest.approx(0.4) for _, us in got.values())
    other, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5)
    with pytest.raises(ValueError, match="not the traced ones"):
        rows_phase(raw, other)


def test_hops_by_stage_edge():
    """`hops`: per (counter, consumer kind), wait met minus the counter's last producer body
    done, the share of consumers that began waiting after it, the same for the consumer that
    finished last, and each task's turnover after its queue predecessor's release."""
    from amk.eval.trace_step import hops

    prog, _ = lm_head_program(vocab=300, hidden=96, tiles=2, slabs=3)
    # columns: wait start, wait met, op done, marks 0-2, body done (us); queues [[0,3,6],[1,4,7],[2,5]]
    rows = [  # each task begins waiting after its queue predecessor's op done
        (0.0, 0.1, 1.4, 0, 0, 0, 1.0),  # embed[0]
        (0.0, 0.1, 2.4, 0, 0, 0, 2.0),  # embed[48]: the embed counter's last producer, body done at 2.0
        (0.5, 2.5, 3.4, 0, 0, 0, 3.0),  # norm[0]: waited from 0.5, met 0.5 after it
        (2.1, 2.3, 4.4, 0, 0, 0, 4.0),  # norm[48]: began after it (late), met 0.3 after; finished last
        (2.6, 4.6, 6.4, 0, 0, 0, 6.0),  # head[0]: norm's last body done 4.0 -> met 0.6
        (3.6, 4.8, 7.4, 0, 0, 0, 7.0),  # head[100]: 0.8
        (4.6, 5.0, 8.4, 0, 0, 0, 8.0),  # head[200]: late, 1.0, finished last
        (9.0, 9.5, 9.9, 0, 0, 0, 9.8),  # argmax: head's last body done 8.0, began at 9.0 (late) -> 1.5
    ]
    raw = raw_trace(prog, np.array(rows) * 1000)
    got = hops(raw, prog)
    norm = got["edges"][("embed", "1:norm[#]")]
    assert norm["n"] == 2 and norm["met_us"][0] == pytest.approx(0.4) and norm["late"] == 0.5
    assert norm["last_met_us"] == pytest.approx(0.3) and norm["last_late"] == 1.0
    assert norm["met_early_us"] == pytest.approx(0.5) and norm["met_late_us"] == pytest.approx(0.3)
    head = got["edges"][("norm", "2:head[#]")]
    assert head["met_us"][0] == pytest.approx(0.8) and head["late"] == pytest.approx(1 / 3)
    assert head["last_met_us"] == pytest.approx(1.0) and head["last_late"] == 1.0
    assert head["met_early_us"] == pytest.approx(0.7) and head["met_late_us"] == pytest.approx(1.0)
    argmax = got["edges"][("head", "10:argmax")]
    assert argmax["met_us"][0] == pytest.approx(1.5) and argmax["met_early_us"] is None
    assert argmax["met_late_us"] == pytest.approx(1.5)
    assert set(got["edges"]) == {("embed", "1:norm[#]"), ("norm", "2:head[#]"), ("head", "10:argmax")}
    # turnover, queue by queue: 2.1 - 1.4, 4.6 - 4.4 | 2.6 - 2.4, 9.0 - 6.4 | 3.6 - 3.4
    assert got["turnover_us"][0] == pytest.approx(0.2)
    other, _ = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=3)
    with pytest.raises(ValueError, match="not the traced ones"):
        hops(raw, other)
