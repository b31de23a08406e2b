"""The autotuning loop with the CPU evaluator on a tiny random-init zoo model: a campaign
finds a config at least as good as the default under the cost model, survives a crashing
and a hanging trial, never keeps an incorrect config, resumes after a kill losing only the
trial in flight, rejects latencies below the physical floor, warm-starts from the journal,
and writes its report atomically; plus the CLI commands and the MCP tools."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from amk.agent import report as report_mod
from amk.agent.evaluators import (
    FAULT_ENV,
    CostModel,
    CpuEvaluator,
    floor_guard,
    mann_whitney,
)
from amk.agent.journal import Journal
from amk.agent.loop import CampaignSettings, run_campaign
from amk.agent.proposers import (
    SearchSpace,
    SequenceProposer,
    TpeProposer,
    make_proposer,
)
from amk.schedule.config import ScheduleConfig
from amk.schedule.importer import zoo_configs
from amk.schedule.targets import get_target

FIXED = {"max_queues": 8}
DEFAULT = ScheduleConfig(**FIXED)
BETTER = DEFAULT.with_(threads_per_block=1024)  # more loads in flight per SM: lower under the cost model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(zoo_configs()["llama-mha"]))
    return str(d / "config.json")


def settings(model: str, journal: Path, **kw) -> CampaignSettings:
    base = dict(model=model, random_init=True, kv_capacity=16, evaluator="cpu", proposer="local", fixed=dict(FIXED),
                journal_dir=journal, eval_options={"prompt_len": 4}, trial_timeout_s=8.0, report_every=0)
    return CampaignSettings(**{**base, **kw})


def rows(journal: Path) -> list[dict]:
    with Journal(journal) as j:
        c = j.latest_campaign()
        return j.trials(c["id"])


def wait_until_running(proc: subprocess.Popen, journal: Path, n: int, timeout_s: float = 120.0) -> None:
    """Until the campaign in `proc` has trial n in flight (read from its journal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, f"trial {n} never started"
        try:
            db = sqlite3.connect(f"file:{journal / 'journal.sqlite'}?mode=ro", uri=True)
            running = db.execute("SELECT COUNT(*) FROM trials WHERE n=? AND state='running'", (n,)).fetchone()[0]
            db.close()
        except sqlite3.Error:
            running = 0
        if running:
            return
        time.sleep(0.1)


# ----------------------------------------------------------------------------- the campaign
def test_campaign_beats_default_and_survives_crash_and_hang(model, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "crash@2,hang@4")
    out = run_campaign(settings(model, tmp_path / "j", trials=8))
    t = rows(tmp_path / "j")
    assert [r["n"] for r in t] == list(range(8)) and all(r["state"] == "done" for r in t)
    assert t[0]["note"] == "default" and t[0]["verdict"] == "pass" and t[0]["kept"]
    assert t[2]["verdict"] == "crash" and "SIGSEGV" in t[2]["violations"][0]
    assert t[4]["verdict"] == "timeout" and "hang" in t[4]["violations"][0]
    assert any(r["verdict"] == "pass" for r in t[5:])  # the campaign went on after both
    assert out["worker_restarts"] == 2
    # the best is a passing trial at least as good as the default under the cost model
    kept = [r for r in t if r["kept"]]
    assert all(r["verdict"] == "pass" and r["latency_us"] is not None for r in kept)
    best = out["best"]
    assert best["latency_us"] <= t[0]["latency_us"] and best["latency_us"] == min(
        r["latency_us"] for r in t if r["verdict"] == "pass")
    assert best["latency_us"] >= best["floor_us"]
    # the wake-up report: markdown, PNG, best config ready for `amk compile --config`
    rep = out["report"]
    if report_mod._has_mpl():
        assert Path(rep["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ScheduleConfig.model_validate_json(Path(rep["json"]).read_text()).model_dump() == best["config"]
    md = Path(rep["md"]).read_text()
    assert "## Best config" in md and "| 2 | crash |" in md and "| 4 | timeout |" in md
    assert not [p for p in Path(rep["md"]).parent.iterdir() if p.name.startswith(".")]  # no temp files left


def test_incorrect_config_is_never_kept(model, tmp_path, monkeypatch):
    """Trial 1 proposes a config that is better under the cost model, but its program is
    made incorrect (a corrupted weight in the worker): the gate fails it, it is not kept."""
    monkeypatch.setenv(FAULT_ENV, "corrupt@1")
    other = DEFAULT.with_(threads_per_block=512)
    out = run_campaign(settings(model, tmp_path / "j", trials=3, isolation="inline"),
                       proposer=SequenceProposer([BETTER, other]))
    t = rows(tmp_path / "j")
    assert t[1]["config"] == BETTER.model_dump(mode="json")
    assert t[1]["verdict"] == "incorrect" and not t[1]["kept"] and t[1]["latency_us"] is None
    assert "max-abs error" in " ".join(t[1]["violations"])
    assert t[2]["verdict"] == "pass" and t[2]["kept"]
    assert out["best"]["trial"] == 2
    # and with the correctness check itself failing, nothing is ever kept
    import amk.agent.evaluators as ev

    monkeypatch.delenv(FAULT_ENV)
    monkeypatch.setattr(ev, "gate", lambda ours, ref, dtype: {"ok": False, "reasons": ["forced failure"]})
    out = run_campaign(settings(model, tmp_path / "j2", trials=3, isolation="inline"),
                       proposer=SequenceProposer([BETTER, other]))
    assert out["best"] is None and all(r["verdict"] == "incorrect" and not r["kept"] for r in rows(tmp_path / "j2"))


def test_warm_start_from_earlier_campaign(model, tmp_path):
    run_campaign(settings(model, tmp_path / "j", trials=2, isolation="inline"), proposer=SequenceProposer([BETTER]))
    out = run_campaign(settings(model, tmp_path / "j", trials=2, isolation="inline"), proposer=SequenceProposer([]))
    t = rows(tmp_path / "j")
    assert t[1]["proposer"] == "warm-start" and t[1]["config"] == BETTER.model_dump(mode="json")
    assert out["best"]["config"] == BETTER.model_dump(mode="json")


def test_resume_after_kill_loses_only_the_trial_in_flight(model, tmp_path):
    journal = tmp_path / "j"
    script = tmp_path / "campaign.py"
    script.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from amk.agent.loop import CampaignSettings, run_campaign
        if __name__ == "__main__":
            run_campaign(CampaignSettings(model={model!r}, random_init=True, kv_capacity=16, evaluator="cpu",
                                          proposer="local", fixed={FIXED!r}, journal_dir=Path({str(journal)!r}),
                                          eval_options={{"prompt_len": 4}}, trial_timeout_s=120, trials=7,
                                          report_every=0))
    """))
    env = {**os.environ, FAULT_ENV: "hang@3"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_running(proc, journal, 3)
        before = rows(journal)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert [r["state"] for r in before] == ["done"] * 3 + ["running"]

    out = run_campaign(settings(model, journal, trials=7, resume=True))
    after = rows(journal)
    assert out["interrupted_on_resume"] == [3] and out["campaign"] == before[0]["campaign"]
    assert [r["n"] for r in after] == list(range(7))
    for a, b in zip(after[:3], before[:3]):  # nothing before the kill was lost or changed
        assert {k: a[k] for k in ("config", "verdict", "latency_us", "kept")} == \
               {k: b[k] for k in ("config", "verdict", "latency_us", "kept")}
    assert after[3]["state"] == "interrupted" and after[3]["verdict"] == "interrupted"
    assert all(r["state"] == "done" and r["verdict"] not in ("timeout", "crash") for r in after[4:])
    assert out["new_trials"] == 3


def test_sigterm_finishes_the_trial_in_flight_and_writes_the_report(model, tmp_path):
    class SignalledWhileRunning(SequenceProposer):
        def propose(self, state):
            if state.trials == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the campaign runs
            return super().propose(state)

    before = signal.getsignal(signal.SIGTERM)
    out = run_campaign(settings(model, tmp_path / "j", trials=5, isolation="inline"), handle_signals=True,
                       proposer=SignalledWhileRunning([BETTER, DEFAULT.with_(threads_per_block=512)]))
    assert signal.getsignal(signal.SIGTERM) is before
    t = rows(tmp_path / "j")
    assert out["status"] == "stopped" and len(t) == 2 and t[1]["state"] == "done" and t[1]["verdict"] == "pass"
    assert Path(out["report"]["md"]).is_file() and "status **stopped**" in Path(out["report"]["md"]).read_text()


def test_group_sigterm_stops_the_campaign_and_the_trial_in_flight_finishes(model, tmp_path):
    """`timeout`, Ctrl-C and `kill -- -PGID` signal the worker too: it must leave stopping to the
    campaign, so the trial in flight ends as measured, not as a crash."""
    journal = tmp_path / "j"
    script = tmp_path / "campaign.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from pathlib import Path
        from amk.agent.loop import CampaignSettings, run_campaign
        if __name__ == "__main__":
            out = run_campaign(CampaignSettings(model={model!r}, random_init=True, kv_capacity=16, evaluator="cpu",
                                                proposer="local", fixed={FIXED!r}, journal_dir=Path({str(journal)!r}),
                                                eval_options={{"prompt_len": 4}}, trial_timeout_s=120, trials=4,
                                                report_every=0), handle_signals=True)
            print(json.dumps({{"status": out["status"]}}))
    """))
    env = {**os.environ, FAULT_ENV: "slow@1"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_until_running(proc, journal, 1)  # the slow trial
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as `timeout` does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert json.loads(out.decode().strip().splitlines()[-1])["status"] == "stopped"
    t = rows(journal)
    assert len(t) == 2 and t[1]["state"] == "done" and t[1]["verdict"] == "pass", [(r["state"], r["verdict"]) for r in t]


def test_minutes_abort_the_trial_in_flight_after_the_grace(model, tmp_path, monkeypatch):
    """--minutes bounds the run: a trial still running at the end (here one that hangs) is aborted
    after stop_grace_s and recorded as interrupted, not left to its 20 s trial timeout."""
    monkeypatch.setenv(FAULT_ENV, "hang@0")  # the first trial starts with the minutes
    out = run_campaign(settings(model, tmp_path / "j", minutes=2 / 60, stop_grace_s=1.0, trial_timeout_s=20.0))
    t = rows(tmp_path / "j")
    assert out["status"] == "finished"
    assert [(r["n"], r["verdict"]) for r in t] == [(0, "interrupted")]


# ----------------------------------------------------------------------------- the floor guard
class _TooFast(CpuEvaluator):
    """An evaluator whose timing is broken: 1000x below the cost model (and the floor)."""

    def evaluate(self, cfg, **kw):
        res = super().evaluate(cfg, **kw)
        if res["verdict"] == "pass" and cfg.threads_per_block == 1024:
            for k in ("latency_us", "p10_us", "p90_us"):
                res[k] /= 1000
        return res


def test_floor_guard_rejects_impossible_latency(model, tmp_path):
    assert floor_guard(0.1, 1.0) and floor_guard(2.0, 1.0) is None and floor_guard(1.5, 1.0, p10_us=0.5)
    assert floor_guard(0.0, 0.0) and floor_guard(float("nan"), 1.0)
    out = run_campaign(settings(model, tmp_path / "j", trials=2, isolation="inline"),
                       proposer=SequenceProposer([BETTER]), evaluator_factory=_TooFast)
    t = rows(tmp_path / "j")
    assert t[1]["verdict"] == "artifact" and not t[1]["kept"] and t[1]["latency_us"] is None
    assert "below the physical floor" in t[1]["violations"][0]
    assert out["best"]["trial"] == 0


def test_cost_model_never_beats_floor_and_prefers_overlap():
    from amk.schedule.importer import spec_from_hf_config
    from amk.schedule.lower import lower
    from amk.schedule.stats import program_stats

    spec = spec_from_hf_config(zoo_configs()["llama-gqa-tied"], name="gqa")
    h100 = get_target("h100")
    lat = {}
    base = DEFAULT.with_(prefetch_depth=1)  # ('auto' turns the hints off for this tiny model's tasks)
    for name, cfg in {"default": base, "no_prefetch": base.with_(prefetch_depth=0),
                      "no_gemv_hints": base.with_(prefetch_min_kb=65536),
                      "int4": base.with_(quant="int4", quant_group=64), "all_queues": ScheduleConfig()}.items():
        prog = lower(spec, cfg, h100, kv_capacity=64)
        est = CostModel().estimate(prog, ctx=64)
        floor = program_stats(prog)["streamed_bytes"] / (h100.hbm_gbps * 1e3)
        assert est["latency_us"] >= est["stream_us"] >= floor
        lat[name] = est["latency_us"]
    assert lat["no_prefetch"] > lat["default"] and lat["int4"] < lat["default"]
    assert lat["no_prefetch"] >= lat["no_gemv_hints"] > lat["default"]  # prefetch_min_kb: the GEMVs unhinted


# ----------------------------------------------------------------------------- the journal, the report
def _fake_campaign(journal: Path) -> str:
    with Journal(journal) as j:
        cid = j.new_campaign(model="m", model_key="k", target="h100", evaluator="cpu", device="cost-model:h100",
                             settings={"journal_dir": str(journal)}, info={"kv_capacity": 16, "context": 16})
        for n, (lat, kept) in enumerate([(10.0, True), (12.0, False), (None, False), (8.0, True)]):
            cfg = DEFAULT.with_(prefetch_depth=n % 5)
            j.begin_trial(cid, n, cfg.model_dump_json(), str(n), proposer="local", note="default" if n == 0 else "")
            j.finish_trial(cid, n, verdict="pass" if lat else "rejected", violations=[] if lat else ["[race] x"],
                           latency_us=lat, p10_us=lat, p90_us=lat, floor_us=1.0, kept=kept,
                           speedup=10.0 / lat if lat else None)
        return cid


def test_report_is_written_atomically(tmp_path, monkeypatch):
    cid = _fake_campaign(tmp_path)
    with Journal(tmp_path) as j:
        assert j.status(cid)["best"]["trial"] == 3 and j.status(cid)["by_verdict"] == {"pass": 3, "rejected": 1}
        paths = report_mod.write_report(j, cid, tmp_path / "rep")
        before = {k: Path(p).read_bytes() for k, p in paths.items()}
        assert json.loads(before["json"])["prefetch_depth"] == 3

        def broken_replace(src, dst):  # a crash between writing the temp file and the rename
            raise OSError("disk went away")

        monkeypatch.setattr("amk.commands.common.os.replace", broken_replace)
        j.finish_trial(cid, 1, verdict="pass", violations=[], latency_us=5.0, kept=True, floor_us=1.0)
        with pytest.raises(OSError):
            report_mod.write_report(j, cid, tmp_path / "rep")
    assert {k: Path(p).read_bytes() for k, p in paths.items()} == before  # old files intact
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == sorted(Path(p).name for p in paths.values())


def test_journal_marks_in_flight_trials_interrupted(tmp_path):
    cid = _fake_campaign(tmp_path)
    with Journal(tmp_path) as j:
        j.begin_trial(cid, 4, DEFAULT.model_dump_json(), "x")
        assert j.status(cid)["running_trials"] == [4]
        assert j.mark_interrupted(cid) == [4] and j.mark_interrupted(cid) == []
        assert j.trials(cid)[4]["verdict"] == "interrupted"
        assert j.previous_results(model_key="k", target="h100", evaluator="cpu", device="cost-model:h100",
                                  exclude="other")[0]["latency_us"] == 8.0


# ----------------------------------------------------------------------------- proposers
def test_search_space_and_proposers():
    import random

    space = SearchSpace(get_target("h100"), fixed=dict(FIXED))
    assert "max_queues" not in space.names and {"quant", "quant_group", "quant_lm_head", "rope_rows",
                                                 "split_k", "fuse_norm", "prefetch_depth", "prefetch_kb",
                                                 "quant_unpack"} <= set(space.names)
    rng = random.Random(0)
    cfgs = [space.random(rng) for _ in range(200)]  # every point is repaired into a valid config
    assert {c.quant for c in cfgs} == {"none", "int8", "int4"} and all(c.max_queues == 8 for c in cfgs)
    mut = [space.mutate(DEFAULT, rng) for _ in range(50)]
    assert all(sum(a != b for a, b in zip(m.model_dump().values(), DEFAULT.model_dump().values())) <= 3 for m in mut)
    moved = space._move_tasks(DEFAULT, rng, [i % 8 for i in range(40)])
    assert moved.sm_assignment == "explicit" and len(moved.explicit_queues) == 40
    assert space.mutate(moved, rng).sm_assignment != "explicit"  # a structural change drops the queue list
    assert make_proposer("auto", space).name == "auto"
    assert mann_whitney([1.0] * 30, [2.0] * 30) < 1e-6 and mann_whitney([1.0, 2.0] * 15, [2.0, 1.0] * 15) > 0.5


def test_tpe_proposer_learns_from_every_trial():
    pytest.importorskip("optuna")
    from amk.agent.proposers import Observation, SearchState

    space = SearchSpace(get_target("h100"), fixed=dict(FIXED))
    tpe = TpeProposer(space, seed=1, n_startup=2)
    tpe.warm_start([{"config": DEFAULT.model_dump(), "latency_us": 10.0}])  # an earlier campaign's trial
    tpe.observe(Observation(config=BETTER, parent=None, verdict="pass", latency_us=9.0, proposer="local"))
    for i in range(4):
        p = tpe.propose(SearchState())
        tpe.observe(Observation(config=p.config, parent=None, verdict="pass" if i % 2 else "rejected",
                                latency_us=10.0 + i if i % 2 else None, proposer="tpe", token=p.token))
    states = [t.state.name for t in tpe.study.trials]
    assert len(states) == 6 and states.count("FAIL") == 2


# ----------------------------------------------------------------------------- CLI and MCP
def test_cli_evaluate_autotune_and_mcp_tools(model, tmp_path):
    from amk.agent import mcp_server

    from amk.commands.autotune_cmd import autotune_command
    from amk.commands.evaluate_cmd import evaluate_command

    app = typer.Typer()
    app.command("autotune")(autotune_command)
    app.command("evaluate")(evaluate_command)
    runner = CliRunner()
    cfg = tmp_path / "cfg.json"
    cfg.write_text(BETTER.model_dump_json())
    common = [model, "--random-init", "--kv-capacity", "16", "--evaluator", "cpu", "--isolation", "inline",
              "--fix", "max_queues=8"]
    res = runner.invoke(app, ["evaluate", *common, "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["verdict"] == "pass" and out["violations"] == [] and out["speedup_vs_default"] > 1.0
    assert out["latency_us"] >= out["floor_us"] > 0
    res = runner.invoke(app, ["autotune", *common, "--trials", "2", "--journal", str(tmp_path / "j"), "--json",
                              "--proposer", "random"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["trials"] == 2 and Path(summary["report"]["md"]).is_file()
    st = mcp_server.tool_campaign_status(str(tmp_path / "j"))
    assert st["ok"] and st["campaign"] == summary["campaign"] and st["trials"] == 2
    assert mcp_server.tool_schema()["schema"]["title"] == "ScheduleConfig"
    assert not mcp_server.tool_campaign_status(str(tmp_path / "nothing"))["ok"]
    assert mcp_server.tool_validate(str(tmp_path / "missing.json"))["ok"] is False
    try:
        server = mcp_server.build_server(str(tmp_path / "j"))
    except ImportError:  # the mcp SDK is optional
        return
    import asyncio

    names = {t.name for t in asyncio.run(server.list_tools())}
    assert names == {"schema", "compile", "validate", "evaluate", "campaign_status"}


def test_worker_starts_where_an_unrelated_amk_folder_sits(model, tmp_path):
    """The `amk` console script run from a directory holding some other `amk` folder: the
    trial worker re-runs the script, and with the working directory on its sys.path that
    folder shadowed the package ("cannot import name '__version__' from 'amk'")."""
    import subprocess
    import sys

    if sys.version_info < (3, 11):
        pytest.skip("PYTHONSAFEPATH (the fix) exists from Python 3.11")
    script = Path(sys.executable).parent / "amk"
    if not script.is_file():
        pytest.skip("the amk console script is not installed beside this interpreter")
    (tmp_path / "amk").mkdir()
    (tmp_path / "amk" / "notes.py").write_text("")
    res = subprocess.run([str(script), "autotune", model, "--random-init", "--kv-capacity", "16", "--evaluator", "cpu",
                          "--isolation", "process", "--fix", "max_queues=8", "--trials", "1", "--journal",
                          str(tmp_path / "j"), "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["trials"] == 1
