"""`amk compile`, `amk generate`, `amk schema` through the CLI: outputs, refusals and bad input."""

import json
import os

import pytest
from typer.testing import CliRunner

from amk.cli import app
from amk.schedule.importer import refusal_zoo, write_random_checkpoint, zoo_configs

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(zoo_configs()["llama-gqa-tied"]))
    return d / "config.json"


def _one_line_error(res):
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output


def test_compile_writes_validated_program(tiny_config, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["compile", str(tiny_config), "--random-init", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["accepted"] and summary["certificate"]["tasks"] > 0
    assert {p.name for p in out.iterdir()} == {"program.json", "config.json", "report.md"}
    assert "hops" in (out / "report.md").read_text()
    res = runner.invoke(app, ["validate", str(out / "program.json")])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_compile_for_amd_targets_places_on_xcds(tiny_config, tmp_path, target):
    out = tmp_path / target
    res = runner.invoke(app, ["compile", str(tiny_config), "--random-init", "--target", target, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "8 XCDs, chiplet placement" in res.output and "validated" in res.output
    prog = json.loads((out / "program.json").read_text())
    assert prog["target"]["arch"] == target and prog["meta"]["resolved"]["xcds"] == 8
    res = runner.invoke(app, ["validate", str(out / "program.json")])
    assert res.exit_code == 0, res.output


def test_generate_verify_random_init(tiny_config):
    res = runner.invoke(app, ["generate", str(tiny_config), "--random-init", "--prompt-ids", "1,2,3",
                              "--max-new-tokens", "6", "--device", "cpu", "--verify", "--json",
                              "--config", "unfused"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["verify"]["pass"] and len(out["new_ids"]) == 6


def test_generate_text_prompt_without_tokenizer(tiny_config):
    res = runner.invoke(app, ["generate", str(tiny_config), "--random-init", "--prompt", "hi", "--max-new-tokens", "2",
                              "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["prompt_ids"] == [ord("h"), ord("i")]


def test_schema_is_json_schema():
    res = runner.invoke(app, ["schema"])
    assert res.exit_code == 0
    schema = json.loads(res.stdout)
    assert schema["title"] == "ScheduleConfig" and "split_k" in schema["properties"]


def test_refused_model_exits_with_reason(tmp_path):
    name, (cfg, edits, expected) = next(iter(refusal_zoo().items()))
    write_random_checkpoint(cfg, tmp_path / "m", seed=0, extra_tensors=edits) if edits else (tmp_path / "m").mkdir()
    if not edits:
        (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    res = runner.invoke(app, ["compile", str(tmp_path / "m"), "--random-init", "--out", str(out)])
    _one_line_error(res)
    assert expected in res.output and not out.exists()


@pytest.mark.parametrize("kind", ["missing", "truncated-safetensors", "truncated-gguf", "unknown-hub-id"])
def test_bad_input_is_one_line_error(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if kind == "missing":
        src = str(tmp_path / "does-not-exist")
    elif kind == "truncated-safetensors":
        d = tmp_path / "ckpt"
        write_random_checkpoint(zoo_configs()["llama-mha"], d, seed=0)
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: os.path.getsize(f) // 2])
        src = str(d)
    elif kind == "truncated-gguf":
        f = tmp_path / "m.gguf"
        f.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)
        src = str(f)
    else:
        src = "no-such-org/no-such-model-xyz"
    out = tmp_path / "out"
    res = runner.invoke(app, ["compile", src, "--out", str(out)])
    _one_line_error(res)
    assert not out.exists()


def test_compile_program_binds_no_weights_and_equals_compile(tiny_config, tmp_path, monkeypatch):
    """`amk compile` lowers and validates without weights: with --random-init none are drawn
    (an 8B shape's float32 weights would take 32 GB), and the program is the one
    `amk.compile` builds with its weights bound; bfloat16 keeps the same dtype rules."""
    from amk.api import compile as amk_compile, compile_program
    from amk.schedule.importer import load_model, load_spec

    for dtype in (None, "bfloat16"):
        with_weights = amk_compile(str(tiny_config), random_init=True, dtype=dtype, kv_capacity=32)
        bare = compile_program(str(tiny_config), random_init=True, dtype=dtype, kv_capacity=32)
        assert bare.program.to_json() == with_weights.program.to_json()
        assert bare.spec == with_weights.spec == load_model(str(tiny_config), random_init=True, dtype=dtype)[0]
        assert bare.validation.certificate == with_weights.validation.certificate
    assert load_spec("smollm2-135m", dtype="float16") == load_model("smollm2-135m", random_init=True, dtype="float16")[0]

    def no_weights(*a, **k):
        raise AssertionError("weights drawn")

    import amk.eval.shapes
    import amk.schedule.importer.load as load

    monkeypatch.setattr(amk.eval.shapes, "random_weights_like", no_weights)
    monkeypatch.setattr(load, "random_state_dict", no_weights)
    for model in ("smollm2-135m", str(tiny_config)):
        res = runner.invoke(app, ["compile", model, "--random-init", "--out", str(tmp_path / "o"), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["accepted"]


def test_written_files_are_whole_and_get_the_usual_mode(tmp_path):
    """write_atomic: the content in full, no temporary left behind, and the mode a plain
    open() gives (the umask's, not mkstemp's private 0600)."""
    from amk.commands.common import write_atomic

    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "sub" / "a.json", "x" * 1000)
        write_atomic(tmp_path / "sub" / "a.json", b"{}")
    finally:
        os.umask(old)
    f = tmp_path / "sub" / "a.json"
    assert f.read_bytes() == b"{}"
    assert os.stat(f).st_mode & 0o777 == 0o640
    assert [p.name for p in f.parent.iterdir()] == ["a.json"]
