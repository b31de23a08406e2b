"""eval/prewarm: the builds it compiles are the CudaVM's (vm.loader.build_defines), one per
distinct variant, without a GPU (the compile itself is replaced)."""

import pytest

from amk.eval import prewarm
from amk.vm import build
from amk.vm.loader import PackedProgram, build_defines, knob_defines


@pytest.fixture(scope="module")
def program():
    return prewarm.program_for("smollm2-135m", None, "bfloat16")


def test_builds_are_the_cudavms(program, monkeypatch):
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    todo = prewarm.builds(program, ["-", "AMK_SPIN_MAX_NS=512", "AMK_SPIN_MAX_NS=512,AMK_ATTN_UNROLL=2"])
    assert [v for v, _ in todo] == ["-", "AMK_SPIN_MAX_NS=512", "AMK_SPIN_MAX_NS=512,AMK_ATTN_UNROLL=2"]
    base = build_defines(program)
    assert todo[0][1] == base and base == {**PackedProgram(program).defines, **knob_defines(program)}
    assert todo[1][1] == {**base, "AMK_SPIN_MAX_NS": 512}
    assert todo[2][1] == {**base, "AMK_SPIN_MAX_NS": 512, "AMK_ATTN_UNROLL": 2}
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_SPIN_MAX_NS=512")  # what the CudaVM would build for variant 1
    assert build_defines(program) == todo[1][1]


def test_duplicates_dropped_and_trace(program):
    todo = prewarm.builds(program, ["-", "", "-"], trace=True)
    assert len(todo) == 1 and todo[0][1]["AMK_TRACE"] == 1


def test_main_compiles_each_build_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(build, "compile_cubin", lambda arch, **kw: calls.append((arch, kw)))
    assert prewarm.main(["smollm2-135m", "--arch", "90", "-j", "1", "--variant", "-",
                         "--variant", "AMK_GEMV_UNROLL=4"]) == 0
    assert len(calls) == 2 and {c[0] for c in calls} == {90}
    assert calls[1][1]["defines"]["AMK_GEMV_UNROLL"] == 4 and "AMK_GEMV_UNROLL" not in calls[0][1]["defines"]
    assert "2 build(s)" in capsys.readouterr().out


def test_bad_variant_is_a_one_line_error(capsys):
    assert prewarm.main(["smollm2-135m", "--arch", "90", "--variant", "GEMV_UNROLL=4"]) == 2
    assert "is not AMK_NAME=integer" in capsys.readouterr().err
