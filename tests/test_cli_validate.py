"""`amk validate`: exit codes 0/1/2, JSON output, one-line errors without tracebacks."""

import json

from typer.testing import CliRunner

from amk.cli import app
from amk.eval.synthetic import layered_program

runner = CliRunner()


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("amk ")


def test_accepted(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(layered_program().to_json())
    res = runner.invoke(app, ["validate", str(f)])
    assert res.exit_code == 0 and "accepted" in res.output


def test_rejected_json(tmp_path):
    d = layered_program().model_dump(mode="json")
    d["tasks"][5]["waits"] = []
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    res = runner.invoke(app, ["validate", str(f), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["accepted"] is False and any(v["check"] == "read-after-write" for v in out["violations"])


def test_unreadable(tmp_path):
    for content in (None, "{not json", "{}"):
        f = tmp_path / "x.json"
        if content is not None:
            f.write_text(content)
        res = runner.invoke(app, ["validate", str(f)])
        assert res.exit_code == 2
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
