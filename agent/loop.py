"""The autotuning loop: propose -> validate -> correctness-gate -> measure -> keep or revert.

    summary = run_campaign(CampaignSettings(model="cfg.json", random_init=True, trials=40,
                                            evaluator="cpu", journal_dir=Path("out/tune")))

Each trial runs in a worker child process (`TrialRunner`): the worker loads the model
once and evaluates trials over a pipe; a trial that crashes the worker (segfault, GPU
fault), hangs past `trial_timeout_s`, or leaves the device suspect is recorded as a failed
trial, the worker is replaced, and the campaign goes on. `isolation="fresh"` uses a new
worker per trial; `"inline"` runs in this process (tests, debugging; no crash isolation).
Workers come from a forkserver that preloads torch and the compiler, so a replacement
costs a fork, not an import (as with any multiprocessing start method but fork, a script
that calls `run_campaign` needs an `if __name__ == "__main__":` guard).

Per trial: the journal row is committed ('running') before the worker sees it and
updated after, the physical floor guard turns a latency below bytes / bandwidth into an
'artifact', and only a passing trial can be kept. "Kept" means it became the campaign's
best: strictly better under the cost model (cpu), or faster than the incumbent best in an
interleaved A/B test (cuda). Non-kept trials are simply not adopted (revert). The best is
global: restarts and plateau hops move the proposers, never the best.

`resume=True` reopens the latest campaign of the same model/target/evaluator in the
journal: the trial that was in flight is marked 'interrupted' (the only one lost), the
proposers replay every finished trial, and the campaign continues up to `trials` rows.
Warm start: passing trials of earlier campaigns on the same model and device seed the
proposers, and their best three configs are evaluated right after the default.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from amk.agent.evaluators import PASS, config_hash, floor_guard
from amk.agent.journal import Journal
from amk.agent.proposers import (
    Observation,
    Proposal,
    Proposer,
    SearchSpace,
    SearchState,
    SequenceProposer,
    make_proposer,
)
from amk.schedule.config import ScheduleConfig

# (forkserver_signals first: the server must outlive a process group's SIGTERM from its start)
PRELOAD = ["amk.agent.forkserver_signals", "torch", "transformers", "transformers.models.llama.modeling_llama",
           "amk.schedule.lower", "amk.schedule.validate", "amk.schedule.importer", "amk.vm.reference", "amk.eval.oracle",
           "amk.agent.evaluators"]
DEFAULT_TRIALS = 50


class CampaignError(RuntimeError):
    """The campaign cannot run at all (the worker cannot load the model, bad settings)."""


@dataclass
class CampaignSettings:
    model: Optional[str] = None
    random_init: bool = False
    seed: int = 0
    dtype: Optional[str] = None
    target: Optional[str] = None
    kv_capacity: int = 512
    evaluator: str = "cpu"  # cpu | cuda | module:Class
    journal_dir: Path = Path("amk-autotune")
    trials: Optional[int] = None  # total trials of the campaign (resumed ones included)
    minutes: Optional[float] = None  # wall-clock budget of the trials (after the model loads); a trial
    # still running at its end gets stop_grace_s more, then is aborted (verdict 'interrupted')
    overnight: bool = False  # run until stopped (or trials/minutes), hop on plateaus
    resume: bool = False
    proposer: str = "auto"
    search_seed: int = 0
    base_config: Optional[ScheduleConfig] = None
    fixed: dict = field(default_factory=dict)  # pinned ScheduleConfig fields
    search_dtype: bool = False
    max_quant_drift: Optional[float] = None
    context: Optional[int] = None
    trial_timeout_s: float = 300.0
    init_timeout_s: float = 1800.0
    isolation: str = "process"  # process | fresh | inline
    report_every: int = 10
    plateau: int = 30  # trials without a new best before a hop to a fresh region (0: never)
    stop_grace_s: float = 30.0  # after a first SIGINT/SIGTERM, abort the trial in flight after this
    eval_options: dict = field(default_factory=dict)  # EvalOptions fields (timing rounds, device, ...)

    def init_message(self) -> dict:
        return {"model": None if self.model is None else str(self.model), "random_init": self.random_init,
                "seed": self.seed, "dtype": self.dtype, "target": self.target, "kv_capacity": self.kv_capacity,
                "evaluator": self.evaluator,
                "options": {**self.eval_options, "context": self.context, "max_quant_drift": self.max_quant_drift}}

    def as_json(self) -> dict:
        d = asdict(self)
        d["journal_dir"] = str(self.journal_dir)
        d["base_config"] = self.base_config.model_dump(mode="json") if self.base_config else None
        return d


# ============================================================================ the worker
@contextlib.contextmanager
def _safe_path():
    """Start interpreters (the forkserver, a spawned worker) without the working directory
    on sys.path (PYTHONSAFEPATH, Python >= 3.11): they re-run this process's main script,
    and an unrelated `amk` folder where the user stands would shadow the package."""
    old = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = old


def _context():
    methods = mp.get_all_start_methods()
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


class TrialRunner:
    """Runs trials in a worker child (or inline), with timeouts; never raises for a bad trial."""

    def __init__(self, init: dict, *, isolation: str = "process", trial_timeout_s: float = 300.0,
                 init_timeout_s: float = 1800.0, evaluator_factory: Optional[Callable] = None):
        if isolation not in ("process", "fresh", "inline"):
            raise ValueError(f"isolation must be process, fresh or inline, got {isolation!r}")
        self.init, self.isolation = init, isolation
        self.trial_timeout_s, self.init_timeout_s = trial_timeout_s, init_timeout_s
        self.factory = evaluator_factory
        self.proc = None
        self.conn = None
        self.info: dict = {}
        self._inline = None
        self.restarts = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self, abort: Callable[[], bool] = lambda: False) -> dict:
        if self.isolation == "inline":
            from amk.agent.evaluators import ModelContext, make_evaluator

            ctx = ModelContext(self.init)
            self._inline = self.factory(ctx) if self.factory else make_evaluator(self.init.get("evaluator", "cpu"), ctx)
            ctx.warm()
            self.info = {**ctx.info(), **self._inline.info()}
            return self.info
        self._spawn(abort)
        return self.info

    def _spawn(self, abort: Callable[[], bool]) -> None:
        from amk.agent.evaluators import serve

        ctx = _context()
        parent, child = ctx.Pipe()
        # the worker takes this process's environment as of now (a forkserver's children
        # would otherwise inherit the server's, frozen when it started)
        init = {**self.init, "campaign_pid": os.getpid(), "env": dict(os.environ)}
        proc = ctx.Process(target=serve, args=(child, init), daemon=True, name="amk-trial-worker")
        with _safe_path():
            proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        deadline = time.monotonic() + self.init_timeout_s
        while not parent.poll(0.2):
            if not proc.is_alive() and not parent.poll(0):
                self._kill()
                raise CampaignError(f"the trial worker died while loading the model (exit code {proc.exitcode})")
            if time.monotonic() > deadline or abort():
                self._kill()
                raise CampaignError("the trial worker did not load the model in time" if not abort()
                                    else "stopped while the worker loaded the model")
        try:
            msg = parent.recv()
        except (EOFError, OSError):
            self._kill()
            raise CampaignError(f"the trial worker died while loading the model (exit code {proc.exitcode})")
        if not msg.get("ok"):
            self._kill()
            raise CampaignError(f"the trial worker cannot load the model: {msg.get('error')}")
        self.info = msg["info"]

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send({"cmd": "stop"})
                self.proc.join(timeout=5)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    # ---------------------------------------------------------------- trials
    def run(self, msg: dict, abort: Callable[[], bool] = lambda: False) -> dict:
        """The worker's result dict, or a failure verdict (crash, timeout, interrupted)."""
        if self.isolation == "inline":
            from amk.agent.evaluators import run_trial

            return run_trial(self._inline, msg)
        if self.proc is None or not self.proc.is_alive():
            self._kill()
            try:
                self._spawn(abort)
            except CampaignError as exc:
                if not abort():
                    raise
                return {"verdict": "interrupted", "violations": [str(exc)]}
            self.restarts += 1
        t0 = time.monotonic()
        try:
            self.conn.send(msg)
        except (OSError, BrokenPipeError):
            self._kill()
            return {"verdict": "crash", "violations": ["the trial worker was gone before the trial started"]}
        res = None
        while res is None:
            if self.conn.poll(0.1):
                try:
                    res = self.conn.recv()
                except (EOFError, OSError):
                    break
            elif not self.proc.is_alive():
                break
            elif abort():
                self._kill()
                return {"verdict": "interrupted", "violations": ["aborted by a stop signal while running"]}
            elif time.monotonic() - t0 > self.trial_timeout_s:
                self._kill()
                return {"verdict": "timeout",
                        "violations": [f"the trial did not finish within {self.trial_timeout_s:g} s (hang); worker killed"]}
        if res is None:
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            self._kill()
            sig = ""
            if code is not None and code < 0:
                try:
                    sig = f" ({signal.Signals(-code).name})"
                except ValueError:
                    pass
            return {"verdict": "crash", "violations": [f"the trial worker died (exit code {code}{sig})"]}
        if res.get("restart") or self.isolation == "fresh":
            self._kill()  # a GPU fault may leave the context unusable: start clean
        return res


# ============================================================================ signals
class StopFlag:
    """First SIGINT/SIGTERM: finish the trial in flight (abort it after `grace_s`), then stop.
    Second: abort it now."""

    def __init__(self, grace_s: float = 30.0):
        self.count = 0
        self.first_at: Optional[float] = None
        self.grace_s = grace_s

    def request(self, *_):
        self.count += 1
        if self.first_at is None:
            self.first_at = time.monotonic()

    @property
    def soft(self) -> bool:
        return self.count > 0

    def hard(self) -> bool:
        return self.count > 1 or (self.first_at is not None and time.monotonic() - self.first_at > self.grace_s)


# ============================================================================ the campaign
RESULT_DETAIL = ("stats", "gate", "quality", "cost", "ab", "resolved", "program_hash", "seconds", "samples",
                 "traceback", "restart")


def _observation(row: dict) -> Observation:
    return Observation(config=ScheduleConfig.model_validate(row["config"]),
                       parent=None, verdict=row["verdict"], latency_us=row["latency_us"], accepted=row["accepted"],
                       kept=row["kept"], proposer=row["proposer"] or "", detail=row["detail"] or {})


def _progress(enabled: bool, total: Optional[int]):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    prog = Progress(TextColumn("[bold]autotune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[status]}"), console=Console(stderr=True), transient=False)
    prog.start()
    prog.add_task("trials", total=total, status="")
    return prog


def run_campaign(s: CampaignSettings, *, proposer: Optional[Proposer] = None,
                 evaluator_factory: Optional[Callable] = None, progress: bool = False,
                 handle_signals: bool = False, stop: Optional[StopFlag] = None) -> dict:
    """Run (or resume) one campaign; returns its summary. Raises CampaignError only when
    nothing can run (the model does not load)."""
    from amk.agent.report import write_report
    from amk.schedule.targets import get_target

    stop = stop or StopFlag(s.stop_grace_s)
    old_handlers = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, stop.request)
    trials_budget = s.trials if (s.trials is not None or s.minutes is not None or s.overnight) else DEFAULT_TRIALS
    journal = Journal(s.journal_dir)
    runner = TrialRunner(s.init_message(), isolation=s.isolation, trial_timeout_s=s.trial_timeout_s,
                         init_timeout_s=s.init_timeout_s, evaluator_factory=evaluator_factory)
    cid = None
    bar = None
    status = "failed"
    summary: dict[str, Any] = {}
    try:
        info = runner.start(abort=stop.hard)
        target = get_target(info.get("target") or s.target)
        key, device = info["model_key"], info["device"]
        lost: list[int] = []
        if s.resume:
            prev = journal.latest_campaign(model_key=key, evaluator=s.evaluator, target=target.name)
            if prev is not None:
                cid = prev["id"]
                lost = journal.mark_interrupted(cid)
                journal.set_status(cid, "running")
        if cid is None:
            cid = journal.new_campaign(model=info.get("model", str(s.model)), model_key=key, target=target.name,
                                       evaluator=s.evaluator, device=device, settings=s.as_json(), info=info)
        space = SearchSpace(target, fixed=s.fixed, search_dtype=s.search_dtype, base=s.base_config)
        proposer = proposer or make_proposer(s.proposer, space, s.search_seed)
        default_cfg = ScheduleConfig.model_validate(space.repair(ScheduleConfig().model_dump()))

        # ---- replay the journal (resume) ----------------------------------------------
        seen: dict[str, Observation] = {}
        best: Optional[Observation] = None
        default_latency: Optional[float] = None
        for row in journal.trials(cid):
            if row["state"] != "done":
                continue
            obs = _observation(row)
            seen[config_hash(obs.config)] = obs
            proposer.observe(obs)
            if obs.kept:
                best = obs
            if row["note"] == "default" and obs.ok:
                default_latency = obs.latency_us
        warm = journal.previous_results(model_key=key, target=target.name, evaluator=s.evaluator, device=device,
                                        exclude=cid)
        proposer.warm_start(warm)
        first: list[Proposal] = [Proposal(default_cfg, proposer="baseline", note="default")]
        if space.base != default_cfg:
            first.append(Proposal(space.base, proposer="baseline", note="base"))
        for r in warm[:3]:
            try:
                first.append(Proposal(ScheduleConfig.model_validate(space.repair(r["config"])), proposer="warm-start",
                                      note=f"best of campaign {r['campaign']}"))
            except Exception:
                continue
        unique: dict[str, Proposal] = {}
        for p in first:
            unique.setdefault(config_hash(p.config), p)
        first = [p for h, p in unique.items() if h not in seen]
        queue = SequenceProposer([p.config for p in first])
        notes = {config_hash(p.config): p for p in first}

        n = journal.count(cid)
        n_start = n
        t0 = time.monotonic()
        since_best = 0
        hops = 0
        bar = _progress(progress, trials_budget)
        if bar is not None:
            bar.update(bar.task_ids[0], completed=n)

        def out_of_minutes(grace_s: float = 0.0) -> bool:
            return s.minutes is not None and time.monotonic() - t0 >= s.minutes * 60 + grace_s

        def budget_left() -> bool:
            if stop.soft:
                return False
            if trials_budget is not None and n >= trials_budget:
                return False
            return not out_of_minutes()

        def abort_trial() -> bool:  # a stop signal's grace, or the minutes' (so that --minutes bounds the run)
            return stop.hard() or out_of_minutes(s.stop_grace_s)

        exhausted = False
        while budget_left():
            state = SearchState(best=best, default=default_cfg, trials=n)
            prop = _next_proposal(queue, notes, proposer, space, state, seen)
            if prop is None:
                exhausted = True
                break
            cfg = prop.config
            h = config_hash(cfg)
            parent = prop.parent if prop.parent is not None else (best.config if best else None)
            if prop.proposer in ("baseline", "warm-start"):
                parent = best.config if best else None
            journal.begin_trial(cid, n, cfg.model_dump_json(), h, proposer=prop.proposer, note=prop.note,
                                parent_hash=config_hash(parent))
            res = runner.run({"cmd": "evaluate", "trial": n, "config": cfg.model_dump(mode="json"),
                              "parent": parent.model_dump(mode="json") if parent else None,
                              "best": best.config.model_dump(mode="json") if best else None}, abort=abort_trial)
            verdict, violations = verdict_of(res)
            latency = res.get("latency_us") if verdict == PASS else None
            kept, accepted = _decide(res, verdict, latency, best, parent, seen)
            if prop.note == "default" and verdict == PASS:
                default_latency = latency
            speedup = (default_latency / latency) if (latency and default_latency) else None
            detail = {k: res[k] for k in RESULT_DETAIL if k in res}
            if kept or accepted:
                detail["queue_of"] = res.get("queue_of")
            journal.finish_trial(cid, n, verdict=verdict, violations=violations, latency_us=latency,
                                 p10_us=res.get("p10_us") if latency else None,
                                 p90_us=res.get("p90_us") if latency else None, floor_us=res.get("floor_us"),
                                 speedup=speedup, kept=kept, accepted=accepted, detail=detail,
                                 state="interrupted" if verdict == "interrupted" else "done")
            obs = Observation(config=cfg, parent=parent, verdict=verdict, latency_us=latency, accepted=accepted,
                              kept=kept, proposer=prop.proposer, token=prop.token,
                              detail={**detail, "queue_of": res.get("queue_of")})
            seen[h] = obs
            proposer.observe(obs)
            n += 1
            if kept:
                best, since_best = obs, 0
            else:
                since_best += 1
            if s.plateau and since_best >= s.plateau:
                proposer.hop()
                since_best, hops = 0, hops + 1
            if bar is not None:
                txt = f"best {best.latency_us:.2f} us" if best else "no passing trial yet"
                if best and default_latency:
                    txt += f" ({default_latency / best.latency_us:.2f}x default)"
                bar.update(bar.task_ids[0], completed=n, status=f"{txt}  last: {verdict}")
            if s.report_every and (n - n_start) % s.report_every == 0:
                write_report(journal, cid, s.journal_dir / cid)
        status = "stopped" if stop.soft else "finished"
        summary = {"campaign": cid, "journal": str(journal.path), "status": status, "model_key": key,
                   "device": device, "new_trials": n - n_start, "interrupted_on_resume": lost,
                   "hops": hops, "worker_restarts": runner.restarts, "space_exhausted": exhausted}
    except KeyboardInterrupt:  # without handle_signals, Ctrl-C ends the campaign here
        status = "stopped"
        raise
    finally:
        if bar is not None:
            bar.stop()
        runner.close()
        if cid is not None:
            journal.set_status(cid, status)
            try:
                summary["report"] = write_report(journal, cid, s.journal_dir / cid)
            except Exception as exc:  # a report failure must not lose the campaign's result
                summary["report_error"] = f"{type(exc).__name__}: {exc}"
            summary.update({k: v for k, v in journal.status(cid).items() if k in
                            ("trials", "by_verdict", "best", "default_latency_us")})
        journal.close()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    return summary


def _next_proposal(queue: SequenceProposer, notes: dict, proposer: Proposer, space: SearchSpace,
                   state: SearchState, seen: dict) -> Optional[Proposal]:
    """The next unseen proposal: first the fixed queue (default, base, warm-start bests),
    then the proposer; a repeat is answered from the journal (not re-run) and asked again."""
    import random

    prop = queue.propose(state)
    if prop is not None:
        return notes.get(config_hash(prop.config), prop)
    rng = random.Random(len(seen) * 7919 + 1)
    for attempt in range(60):
        prop = proposer.propose(state) if attempt < 40 else Proposal(space.random(rng), proposer="random",
                                                                     parent=state.best.config if state.best else None)
        if prop is None:
            return None
        h = config_hash(prop.config)
        if h not in seen:
            return prop
        old = seen[h]
        proposer.observe(Observation(config=prop.config, parent=prop.parent, verdict=old.verdict,
                                     latency_us=old.latency_us, accepted=False, kept=False,
                                     proposer=prop.proposer, token=prop.token, detail=old.detail))
    return None  # the space looks exhausted around here


def verdict_of(res: dict) -> tuple[str, list]:
    """A trial's verdict and violations, with a PASS below the physical floor turned into an artifact."""
    verdict = res.get("verdict", "error")
    violations = list(res.get("violations") or [])
    if verdict == PASS:
        why = floor_guard(res.get("latency_us"), res.get("floor_us"), res.get("p10_us"))
        if why:
            verdict, violations = "artifact", [why]
    return verdict, violations


def _decide(res: dict, verdict: str, latency: Optional[float], best: Optional[Observation],
            parent: Optional[ScheduleConfig], seen: dict) -> tuple[bool, bool]:
    """(kept, accepted). Only a PASS can be kept. With an A/B result (cuda) the test's
    decision rules; without one (the deterministic cost model) a strictly lower latency."""
    if verdict != PASS or latency is None:
        return False, False
    ab = res.get("ab") or {}
    if best is None:
        kept = True
    elif "best" in ab:
        kept = ab["best"].get("decision") == "faster"
    else:
        kept = best.latency_us is not None and latency < best.latency_us * (1 - 1e-9)
    accepted = False
    if parent is not None:
        ph = config_hash(parent)
        if best is not None and ph == config_hash(best.config):
            accepted = kept
        elif "parent" in ab:
            accepted = ab["parent"].get("decision") == "faster"
        elif ph in seen and seen[ph].latency_us is not None:
            accepted = latency < seen[ph].latency_us * (1 - 1e-9)
    return kept, accepted


# ============================================================================ one trial (amk evaluate, MCP)
def evaluate_config(s: CampaignSettings, config: ScheduleConfig, *,
                    evaluator_factory: Optional[Callable] = None) -> dict:
    """One gated trial of `config` and of the default config in one worker (A/B on cuda):
    {verdict, violations, latency_us, p10_us, p90_us, floor_us, speedup_vs_default, ...}."""
    runner = TrialRunner(s.init_message(), isolation=s.isolation, trial_timeout_s=s.trial_timeout_s,
                         init_timeout_s=s.init_timeout_s, evaluator_factory=evaluator_factory)
    try:
        info = runner.start()
        from amk.schedule.targets import get_target

        space = SearchSpace(get_target(info.get("target") or s.target), fixed={k: v for k, v in s.fixed.items()})
        default_cfg = ScheduleConfig.model_validate(space.repair(ScheduleConfig().model_dump()))
        d = default_cfg.model_dump(mode="json")
        base = runner.run({"cmd": "evaluate", "trial": None, "config": d, "parent": None, "best": None})
        same = config_hash(config) == config_hash(default_cfg)
        res = base if same else runner.run({"cmd": "evaluate", "trial": None, "config": config.model_dump(mode="json"),
                                           "parent": d, "best": d})
    finally:
        runner.close()
    verdict, violations = verdict_of(res)
    out = {"verdict": verdict, "violations": violations, "config": config.model_dump(mode="json"),
           "model": info.get("model"), "target": info.get("target"), "evaluator": info.get("evaluator"),
           "device": info.get("device")}
    for k in ("latency_us", "p10_us", "p90_us", "floor_us", "stats", "gate", "quality", "cost", "resolved",
              "program_hash"):
        if k in res and (verdict == PASS or k not in ("latency_us", "p10_us", "p90_us")):
            out[k] = res[k]
    out["default_latency_us"] = base.get("latency_us") if base.get("verdict") == PASS else None
    out["default_verdict"] = base.get("verdict")
    ab = (res.get("ab") or {}).get("best")
    if verdict == PASS and ab:
        out["speedup_vs_default"] = 1.0 / ab["ratio"] if ab.get("ratio") else None
        out["ab_vs_default"] = ab
    elif verdict == PASS and out["default_latency_us"]:
        out["speedup_vs_default"] = out["default_latency_us"] / out["latency_us"]
    else:
        out["speedup_vs_default"] = None
    if out.get("floor_us") and out.get("latency_us"):
        out["pct_of_floor"] = 100.0 * out["floor_us"] / out["latency_us"]
    return out


def json_safe(obj):
    """NaN/inf -> None, recursively (strict JSON for --json and MCP)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj) -> str:
    return json.dumps(json_safe(obj), indent=2, sort_keys=True, default=str)

