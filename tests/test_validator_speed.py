"""The validator benchmark's per-call breakdown runs on a small program and renders; the
paired comparison (`eval/validator_ab.py`) runs both trees and records what it timed."""

import json
from pathlib import Path

import pytest

from amk.eval import validator_ab
from amk.eval.provenance import git_commit
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


def test_paired_comparison_runs_both_trees_and_writes_its_rows(tmp_path):
    """validator_ab against this very tree: both sides run in their own processes, every
    round has both timings, and the ratios are theirs."""
    repo = Path(validator_ab.__file__).resolve().parent.parent
    out = tmp_path / "ab.json"
    assert validator_ab.main([str(repo), "--rounds", "1", "--programs", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["base_cold_us"] > 0 and row["head_warm_us"] > 0
    assert row["cold_ratio"] == row["base_cold_us"] / row["head_cold_us"]
    assert doc["base_commit"] == git_commit(repo)


def test_paired_comparison_refuses_a_folder_that_is_no_source_tree(tmp_path):
    with pytest.raises(SystemExit):
        validator_ab.main([str(tmp_path)])
