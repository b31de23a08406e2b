"""amk.eval.ab: arm parsing, the bench command of an arm, rotated rounds, and the paired summary
(the benches themselves need a GPU: a fake runner stands in for them here)."""

from __future__ import annotations

import json

import pytest

from amk.eval import ab


def test_parse_arm(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"kv_head_counters": false}')
    assert ab.parse_arm("base=") == ab.Arm("base", None, "")
    assert ab.parse_arm(f"x={cfg}@AMK_A=1,AMK_B=-2") == ab.Arm("x", str(cfg), "AMK_A=1,AMK_B=-2")
    assert ab.parse_arm("y=@AMK_A=3") == ab.Arm("y", None, "AMK_A=3")
    for bad, msg in (("noequals", "LABEL="), ("=x", "LABEL="), ("z=missing.json", "no config file"),
                     ("w=@AMK_A", "AMK_NAME=integer"), ("v=@FOO=1", "AMK_NAME=integer")):
        with pytest.raises(ValueError, match=msg):
            ab.parse_arm(bad)


def test_bench_command_of_an_arm():
    b = ab.BenchArgs(model="llama-3.2-1b", ctx=2048, bandwidth=3000.0)
    argv, env = ab.bench_command(b, ab.Arm("x", "eval/configs/kv_head_counters.json", "AMK_A=1"))
    assert argv[1:5] == ["-m", "amk.cli", "bench", "llama-3.2-1b"]
    for flag, value in (("--ctx", "2048"), ("--config", "eval/configs/kv_head_counters.json"),
                        ("--bandwidth", "3000.0"), ("--baselines", "cuda_graph"), ("--dtype", "bfloat16")):
        assert argv[argv.index(flag) + 1] == value
    assert "--json" in argv and "--random-init" in argv
    assert env["AMK_VM_DEFINES"] == "AMK_A=1"
    argv, env = ab.bench_command(ab.BenchArgs(model="ckpt", random_init=False), ab.Arm("base", None, ""))
    assert "--config" not in argv and "--random-init" not in argv and "--bandwidth" not in argv
    assert env["AMK_VM_DEFINES"] == ""  # an arm's defines replace the caller's, never add to them


def _row(median_us: float, status: str = "ok") -> dict:
    """What `amk bench --json` prints, cut to the fields the A/B reads."""
    if status != "ok":
        return {"status": status, "correctness": {"passed": False}}
    return {"status": "ok", "git_commit": "abc", "gpu": "H100", "correctness": {"passed": True},
            "variants": {"megakernel": {"median_us": median_us, "p10_us": median_us - 5, "p90_us": median_us + 5},
                         "cuda_graph": {"median_us": 2 * median_us}},
            "speedup": {"cuda_graph": {"median": 2.0}}}


def test_rounds_rotate_and_pair_with_the_reference():
    arms = [ab.Arm("a", None, ""), ab.Arm("b", None, "AMK_X=1"), ab.Arm("c", None, "AMK_X=2")]
    medians = {("a", 0): 100.0, ("b", 0): 99.0, ("c", 0): 120.0, ("a", 1): 102.0, ("b", 1): 99.96, ("c", 1): 0}
    calls = []

    def fake(b, arm):
        r = sum(1 for _, x in calls if x == arm.label)
        calls.append((r, arm.label))
        m = medians[(arm.label, r)]
        return ab.summarize_row(_row(m) if m else _row(0, "gate_failed"))

    doc = ab.run_ab(ab.BenchArgs(model="m"), arms, rounds=2, run=fake, log=lambda m: None)
    assert [x for _, x in calls] == ["a", "b", "c", "b", "c", "a"]  # round 2 starts one arm later
    s = doc["summary"]
    assert s["a"]["medians_us"] == [100.0, 102.0] and s["a"]["mean_us"] == pytest.approx(101.0)
    assert s["b"]["ratios_to_ref"] == pytest.approx([0.99, 0.98])
    assert s["b"]["mean_ratio_to_ref"] == pytest.approx(0.985)
    assert s["c"]["medians_us"] == [120.0, None] and s["c"]["failed_rounds"] == 1  # no latency without a PASS
    assert s["c"]["ratios_to_ref"] == pytest.approx([1.2])
    assert doc["rounds"][1]["c"]["status"] == "gate_failed" and "median_us" not in doc["rounds"][1]["c"]
    table = ab.format_summary(doc)
    assert "-1.50 %" in table and "FAIL" in table
    assert json.loads(json.dumps(doc)) == doc  # what --out writes


def test_the_reference_failing_leaves_no_ratio():
    arms = [ab.Arm("a", None, ""), ab.Arm("b", None, "AMK_X=1")]
    doc = ab.run_ab(ab.BenchArgs(model="m"), arms, rounds=1, log=lambda m: None,
                    run=lambda b, arm: ab.summarize_row(_row(0, "gate_failed") if arm.label == "a" else _row(90.0)))
    assert doc["summary"]["b"]["ratios_to_ref"] == [] and doc["summary"]["b"]["mean_ratio_to_ref"] is None


def test_bench_output_is_found_after_other_lines():
    doc = {"status": "ok", "x": 1}
    assert ab._last_json(json.dumps(doc, indent=2)) == doc
    assert ab._last_json("a warning\n" + json.dumps(doc, indent=2) + "\n") == doc
    assert ab._last_json("Traceback ...\nerror") is None


def test_a_bench_that_cannot_run_is_an_error_not_a_latency(monkeypatch):
    """The real process path: `amk bench` refuses without a GPU (or fails its import), and the
    A/B records an error for that arm, with no latency."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    res = ab.run_bench_process(ab.BenchArgs(model="no-such-model", timeout_s=120), ab.Arm("a", None, ""))
    assert res["status"] == "error" and "median_us" not in res


def test_cli_refuses_bad_arms(capsys):
    with pytest.raises(SystemExit):
        ab.main(["m", "--arm", "a=", "--arm", "a=@AMK_X=1", "--no-prewarm"])
    assert "labels must differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["m", "--arm", "bad"])
    assert "LABEL=" in capsys.readouterr().err


def test_a_real_bench_row_is_read():
    """The fields the A/B reads exist in a row `amk bench` wrote (paper_results/perf_h100.json)."""
    from pathlib import Path

    doc = json.loads((Path(__file__).parent.parent / "paper_results" / "perf_h100.json").read_text())
    row = next(r for r in doc["rows"] if r["model"] == "llama-3.2-1b" and r["quant"] == "none")
    got = ab.summarize_row({"status": "ok", **row})
    assert got["status"] == "ok" and got["gate"] == "PASS"
    assert got["median_us"] == row["variants"]["megakernel"]["median_us"]
    assert got["p10_us"] < got["median_us"] < got["p90_us"]
    assert got["baselines_us"]["cuda_graph"] > got["median_us"] and got["speedup_vs_baselines"]["cuda_graph"] > 1


def test_prewarm_builds_each_config_once_with_all_its_variants(monkeypatch):
    started = []

    class FakePopen:
        def __init__(self, argv, **kw):
            started.append(argv)
            self.returncode = 0

        def communicate(self):
            return "1 build(s) in 1 s\n", None

    monkeypatch.setattr(ab.subprocess, "Popen", FakePopen)
    arms = [ab.Arm("a", None, ""), ab.Arm("b", None, "AMK_X=1"), ab.Arm("c", "k.json", ""), ab.Arm("d", None, "")]
    logs = []
    ab.prewarm(ab.BenchArgs(model="llama-3.2-1b"), arms, logs.append)
    assert len(started) == 2 and len(logs) == 2
    default, other = started
    assert "--config" not in default and default[default.index("-j") + 1] == "2"
    assert [default[i + 1] for i, x in enumerate(default) if x == "--variant"] == ["-", "AMK_X=1"]
    assert other[other.index("--config") + 1] == "k.json"
    assert [other[i + 1] for i, x in enumerate(other) if x == "--variant"] == ["-"]


def test_every_bench_is_saved_as_it_finishes():
    """A run cut short (a device call's time limit) keeps the benches it finished: the document
    after each bench pairs only complete pairs, and says that it is not complete."""
    arms = [ab.Arm("a", None, ""), ab.Arm("b", None, "AMK_X=1")]
    medians = iter([100.0, 98.0, 97.0, 101.0])  # round 1: a, b; round 2: b, a
    saved = []
    doc = ab.run_ab(ab.BenchArgs(model="m"), arms, rounds=2, log=lambda m: None,
                    run=lambda b, arm: ab.summarize_row(_row(next(medians))),
                    on_bench=lambda d: saved.append(json.loads(json.dumps(d))))
    assert len(saved) == 4 and not any(d["complete"] for d in saved) and doc["complete"]
    third = saved[2]  # round 2 has b only: its ratio waits for a
    assert third["summary"]["b"]["medians_us"] == [98.0, 97.0]
    assert third["summary"]["b"]["ratios_to_ref"] == pytest.approx([0.98])
    assert third["summary"]["a"]["medians_us"] == [100.0, None] and third["summary"]["a"]["failed_rounds"] == 0
    assert "not run" in ab.format_summary(third) and "FAIL" not in ab.format_summary(third)
    assert doc["summary"]["b"]["ratios_to_ref"] == pytest.approx([0.98, 97.0 / 101.0])


def _python3_shim(tmp_path, before: str = ""):
    """A folder holding `python3` for the eval/ shell scripts: this interpreter (a wrapper, not a
    link: a venv is found from the path run), after the shell lines `before`."""
    import sys

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\n{before}exec "{sys.executable}" "$@"\n')
    (shim / "python3").chmod(0o755)
    return shim


def test_ab_call_script_runs_groups_under_one_budget(tmp_path):
    """eval/ab_call.sh on a machine without a GPU: the first group's benches fail (no latency),
    its JSON is written with a repository-relative config made absolute, its table is printed
    from the JSON, the exit status says a group failed, a group that the budget no longer
    covers is skipped, not run, and $OUT holds the JSON and one log, nothing else."""
    import os
    import subprocess
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the benches would run for real")
    repo = Path(__file__).resolve().parents[1]
    # the script's python3 spends 8 s before each A/B group, so that group 1, started with nearly
    # all of the 1000 s budget, leaves group 2 less than the 994 s it needs, whatever the machine
    shim = _python3_shim(tmp_path, 'case "$*" in "-m amk.eval.ab "*) sleep 8;; esac\n')
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}",
           "AMK_AB_BUDGET_S": "1000", "AMK_AB_MIN_LEFT_S": "994", "AMK_GIT_COMMIT": "test"}
    run = subprocess.run(["bash", str(repo / "eval/ab_call.sh"),
                          "smollm2-135m --arm base= --arm k12=eval/configs/kv_splits_12.json --rounds 1 --no-prewarm",
                          "llama-3.2-1b --arm base="],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    doc = json.loads((tmp_path / "out" / "ab_1_smollm2-135m.json").read_text())
    assert [a["config"] for a in doc["arms"]] == [None, str(repo / "eval/configs/kv_splits_12.json")]
    assert doc["bench"]["bandwidth"] == 3000.0 and doc["complete"]
    assert all(r["status"] != "ok" for rr in doc["rounds"] for r in rr.values())  # no GPU: no latency
    assert "skipped group 2 (llama-3.2-1b)" in run.stdout
    assert not (tmp_path / "out" / "ab_2_llama-3.2-1b.json").exists()
    # a device call brings back at most 8 files: a group's JSON each, and one log for them all
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ab_1_smollm2-135m.json", "ab_call.log"]
    assert "== group 1 (ab_1_smollm2-135m)" in (tmp_path / "out" / "ab_call.log").read_text()
    table = run.stdout[run.stdout.index("== ab_1_smollm2-135m"):]
    assert "FAIL" in table and "kv_splits_12.json" in table


def test_tree_ab_script_without_gpu(tmp_path):
    """eval/tree_ab.sh on a machine without a GPU: every bench of both trees and rounds runs in
    turn and gives no latency, which the summary says and the exit status reports; $OUT holds
    the benches' tarball and the progress log, nothing else (a device call returns 8 files)."""
    import os
    import subprocess
    import tarfile
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the benches would run for real")
    repo = Path(__file__).resolve().parents[1]
    shim = _python3_shim(tmp_path)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(repo / "eval/tree_ab.sh"), str(repo), "old", "new", "smollm2-135m"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["bench.err", "benches.tgz"]
    with tarfile.open(out / "benches.tgz") as t:
        names = sorted(m.name for m in t.getmembers())
    assert names == [f"b_{tree}_smollm2-135m_{r}.json" for tree in ("new", "old") for r in (1, 2)]
    assert run.stdout.count("no result") == 4
    log = (out / "bench.err").read_text()
    assert "new smollm2-135m round 1: rc 1" in log and "old smollm2-135m round 2: rc 1" in log
