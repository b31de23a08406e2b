"""The validator benchmark's per-call breakdown runs on a small program and renders."""

from amk.eval.synthetic import layered_program
from amk.eval.validator_speed import breakdown, render_md
from amk.schedule.compact import compact


def test_breakdown_times_each_part_and_renders():
    cp = compact(layered_program(layers=2, width=4, hidden=4 * 32))
    b = breakdown(cp, repeats=1, calls=2)
    assert b["tasks"] == cp.num_tasks
    assert b["validate_us"] > 0 and b["checks_us"] > 0 and b["digest_us"] > 0
    doc = {"command": "x", "commit": "0" * 12, "machine": {"cpu": "cpu", "cores_allowed": 1, "fast_path": True},
           "results": {"small_program_breakdown": b}}
    assert f"One validation of the {cp.num_tasks}-task compact program" in render_md(doc)
