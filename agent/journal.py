"""The campaign journal: SQLite in WAL mode, one row per trial, written before and after it runs.

    j = Journal(Path("out/autotune"))            # DIR/journal.sqlite
    cid = j.new_campaign(model=..., model_key=..., target="h100", evaluator="cpu", device=..., settings={...})
    j.begin_trial(cid, n, config_json, proposer, parent_hash)   # state 'running', committed
    j.finish_trial(cid, n, verdict=..., latency_us=..., kept=...)  # state 'done', committed

Every write is its own committed transaction (synchronous=FULL), so a crash, a kill or a
power cut loses at most the trial in flight, which a resume finds as 'running' and marks
'interrupted'. Several campaigns (and readers such as `amk mcp`) share one file.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

SCHEMA = """
CREATE TABLE IF NOT EXISTS campaigns(
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    status TEXT NOT NULL,              -- running | finished | stopped | failed
    model TEXT, model_key TEXT, target TEXT, evaluator TEXT, device TEXT,
    pid INTEGER, host TEXT,
    settings TEXT,                     -- JSON: the campaign's settings
    info TEXT                          -- JSON: the worker's model/evaluator info
);
CREATE TABLE IF NOT EXISTS trials(
    campaign TEXT NOT NULL REFERENCES campaigns(id),
    n INTEGER NOT NULL,                -- 0.. within the campaign
    state TEXT NOT NULL,               -- running | done | interrupted
    started REAL NOT NULL, finished REAL,
    proposer TEXT, note TEXT,
    config TEXT NOT NULL,              -- ScheduleConfig JSON
    config_hash TEXT NOT NULL, parent_hash TEXT,
    verdict TEXT,                      -- evaluators.VERDICTS
    violations TEXT,                   -- JSON list of strings
    latency_us REAL, p10_us REAL, p90_us REAL, floor_us REAL,
    speedup REAL,                      -- default-config latency / latency
    kept INTEGER NOT NULL DEFAULT 0,   -- became the campaign's best (global, never reverted)
    accepted INTEGER NOT NULL DEFAULT 0,  -- beat its parent (the local walker moved)
    detail TEXT,                       -- JSON: stats, gate, quality, cost model / A-B, ...
    PRIMARY KEY(campaign, n)
);
CREATE INDEX IF NOT EXISTS trials_hash ON trials(config_hash);
CREATE INDEX IF NOT EXISTS campaigns_key ON campaigns(model_key, target, evaluator, device);
"""

TRIAL_COLUMNS = ("campaign", "n", "state", "started", "finished", "proposer", "note", "config", "config_hash",
                 "parent_hash", "verdict", "violations", "latency_us", "p10_us", "p90_us", "floor_us", "speedup",
                 "kept", "accepted", "detail")

FILENAME = "journal.sqlite"


def _json_or(v, default):
    if v is None:
        return default
    try:
        return json.loads(v)
    except (TypeError, ValueError):
        return default


class Journal:
    def __init__(self, directory: Path | str, *, readonly: bool = False):
        self.dir = Path(directory)
        self.path = self.dir / FILENAME
        if readonly:
            if not self.path.is_file():
                raise FileNotFoundError(f"no journal at {self.path}")
            self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30, isolation_level=None)
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write(self, sql: str, args: Iterable[Any] = ()) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute(sql, tuple(args))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ campaigns
    def new_campaign(self, *, model: str, model_key: str, target: str, evaluator: str, device: str,
                     settings: dict, info: dict) -> str:
        cid = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        now = time.time()
        self._write("INSERT INTO campaigns VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (cid, now, now, "running", model, model_key, target, evaluator, device, os.getpid(),
                     socket.gethostname(), json.dumps(settings, default=str), json.dumps(info, default=str)))
        return cid

    def set_status(self, cid: str, status: str) -> None:
        self._write("UPDATE campaigns SET status=?, updated=?, pid=?, host=? WHERE id=?",
                    (status, time.time(), os.getpid(), socket.gethostname(), cid))

    def campaign(self, cid: str) -> Optional[dict]:
        r = self.db.execute("SELECT * FROM campaigns WHERE id=?", (cid,)).fetchone()
        return self._campaign_row(r) if r else None

    def campaigns(self) -> list[dict]:
        return [self._campaign_row(r) for r in self.db.execute("SELECT * FROM campaigns ORDER BY created")]

    @staticmethod
    def _campaign_row(r) -> dict:
        d = dict(r)
        d["settings"] = _json_or(d.get("settings"), {})
        d["info"] = _json_or(d.get("info"), {})
        return d

    def latest_campaign(self, *, model_key: Optional[str] = None, evaluator: Optional[str] = None,
                        target: Optional[str] = None) -> Optional[dict]:
        q, args = "SELECT * FROM campaigns WHERE 1=1", []
        for col, v in (("model_key", model_key), ("evaluator", evaluator), ("target", target)):
            if v is not None:
                q += f" AND {col}=?"
                args.append(v)
        r = self.db.execute(q + " ORDER BY created DESC LIMIT 1", args).fetchone()
        return self._campaign_row(r) if r else None

    # ------------------------------------------------------------------ trials
    def begin_trial(self, cid: str, n: int, config_json: str, config_hash: str, *, proposer: str = "",
                    note: str = "", parent_hash: Optional[str] = None) -> None:
        """Record a trial about to run (state 'running'), committed before it starts."""
        self._write("INSERT INTO trials(campaign, n, state, started, proposer, note, config, config_hash, parent_hash)"
                    " VALUES (?,?,?,?,?,?,?,?,?)",
                    (cid, n, "running", time.time(), proposer, note, config_json, config_hash, parent_hash))
        self._write("UPDATE campaigns SET updated=? WHERE id=?", (time.time(), cid))

    def finish_trial(self, cid: str, n: int, *, verdict: str, violations: list[str], latency_us=None, p10_us=None,
                     p90_us=None, floor_us=None, speedup=None, kept: bool = False, accepted: bool = False,
                     detail: Optional[dict] = None, state: str = "done") -> None:
        self._write("UPDATE trials SET state=?, finished=?, verdict=?, violations=?, latency_us=?, p10_us=?, p90_us=?,"
                    " floor_us=?, speedup=?, kept=?, accepted=?, detail=? WHERE campaign=? AND n=?",
                    (state, time.time(), verdict, json.dumps(violations), latency_us, p10_us, p90_us, floor_us,
                     speedup, int(kept), int(accepted), json.dumps(detail or {}, default=str), cid, n))

    def mark_interrupted(self, cid: str) -> list[int]:
        """Trials left 'running' by a crash or kill: mark them interrupted; returns their numbers."""
        ns = [r[0] for r in self.db.execute("SELECT n FROM trials WHERE campaign=? AND state='running'", (cid,))]
        if ns:
            self._write("UPDATE trials SET state='interrupted', verdict='interrupted', finished=?, "
                        "violations=? WHERE campaign=? AND state='running'",
                        (time.time(), json.dumps(["the campaign stopped while this trial ran"]), cid))
        return ns

    def trials(self, cid: str) -> list[dict]:
        rows = self.db.execute("SELECT * FROM trials WHERE campaign=? ORDER BY n", (cid,)).fetchall()
        return [self._trial_row(r) for r in rows]

    @staticmethod
    def _trial_row(r) -> dict:
        d = dict(r)
        d["config"] = _json_or(d.get("config"), {})
        d["violations"] = _json_or(d.get("violations"), [])
        d["detail"] = _json_or(d.get("detail"), {})
        d["kept"], d["accepted"] = bool(d.get("kept")), bool(d.get("accepted"))
        return d

    def count(self, cid: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM trials WHERE campaign=?", (cid,)).fetchone()[0]

    def previous_results(self, *, model_key: str, target: str, evaluator: str, device: str,
                         exclude: Optional[str] = None, limit: int = 2000) -> list[dict]:
        """Passing trials of earlier campaigns on the same model and device: warm-start data."""
        rows = self.db.execute(
            "SELECT t.config, t.latency_us, t.campaign FROM trials t JOIN campaigns c ON t.campaign = c.id "
            "WHERE c.model_key=? AND c.target=? AND c.evaluator=? AND c.device=? AND t.verdict='pass' "
            "AND t.latency_us IS NOT NULL AND c.id IS NOT ? ORDER BY t.latency_us LIMIT ?",
            (model_key, target, evaluator, device, exclude, limit)).fetchall()
        return [{"config": _json_or(r[0], {}), "latency_us": r[1], "campaign": r[2]} for r in rows]

    # ------------------------------------------------------------------ status
    def status(self, cid: Optional[str] = None) -> dict:
        """A campaign's summary (the latest one by default), for `amk mcp` and reports."""
        c = self.campaign(cid) if cid else self.latest_campaign()
        if c is None:
            return {"campaign": None, "journal": str(self.path), "campaigns": 0}
        trials = self.trials(c["id"])
        by_verdict: dict[str, int] = {}
        for t in trials:
            by_verdict[t["verdict"] or "running"] = by_verdict.get(t["verdict"] or "running", 0) + 1
        kept = [t for t in trials if t["kept"]]
        best = kept[-1] if kept else None
        running = [t["n"] for t in trials if t["state"] == "running"]
        alive = None
        if c["status"] == "running" and c.get("host") == socket.gethostname() and c.get("pid"):
            try:
                os.kill(int(c["pid"]), 0)
                alive = True
            except (OSError, ValueError):
                alive = False
        return {
            "campaign": c["id"], "journal": str(self.path), "status": c["status"], "process_alive": alive,
            "model": c["model"], "model_key": c["model_key"], "target": c["target"], "evaluator": c["evaluator"],
            "device": c["device"], "created": c["created"], "updated": c["updated"],
            "trials": len(trials), "by_verdict": by_verdict, "running_trials": running,
            "default_latency_us": next((t["latency_us"] for t in trials if t["note"] == "default"), None),
            "best": None if best is None else {
                "trial": best["n"], "latency_us": best["latency_us"], "p10_us": best["p10_us"],
                "p90_us": best["p90_us"], "floor_us": best["floor_us"], "speedup": best["speedup"],
                "config": best["config"]},
            "report_dir": str(self.dir / c["id"]),
        }
