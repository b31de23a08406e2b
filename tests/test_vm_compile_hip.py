"""The HIP megakernel without an AMD GPU: the same VM sources compile warning-free for the
AMD targets (clang-19, device only, to AMDGCN assembly) and the counter primitives appear
with both memory scopes. Skips with the reason where clang-19 (`make hip-tools`) is
missing (CI sets AMK_REQUIRE_HIP_TOOLS=1, which turns that skip into a failure), and per
arch where the compiler does not know the target (gfx950 needs LLVM 20)."""

from __future__ import annotations

import os

import pytest

from amk.vm import compile_check
from amk.vm import hip_compile_check as hcc


def _need_clang_for(arch: str) -> None:
    clang = hcc.clang_path()
    if clang is None:
        why = "clang-19 not found (make hip-tools installs clang-19, lld-19, libamdhip64-dev)"
        if os.environ.get("AMK_REQUIRE_HIP_TOOLS"):
            pytest.fail(why)
        pytest.skip(why)
    if not hcc.clang_knows(clang, arch):
        pytest.skip(f"{clang} does not know {arch} (needs a newer LLVM)")


@pytest.mark.parametrize("arch", hcc.ARCHS)
def test_hip_compiles_with_scoped_atomics(arch):
    _need_clang_for(arch)
    ok, report, asm = hcc.hip_compile(arch)
    assert ok, report
    assert ".amdhsa_kernel amk_megakernel" in asm


def test_hip_compiles_a_bf16_build_with_the_split_attention_passes():
    """A bf16 build that keeps the split-layout attention passes (a program whose KV rows do not
    all take the wide ones, so the loader sets no AMK_ATTN_ONLY_WIDE) compiles warning-free for
    gfx942: clang-19 could not unroll the wide P.V pass's write-out loop there (a `break` in it),
    which -Werror made an error; hiprtc, without -Werror, would have indexed the accumulators at
    run time. The sm_90 "bf16" build's defines (amk.vm.compile_check) less AMK_ATTN_ONLY_WIDE."""
    _need_clang_for("gfx942")
    defines = {k: v for k, v in compile_check.SPECIALIZED["bf16"].items() if k != "AMK_ATTN_ONLY_WIDE"}
    ok, report, _ = hcc.hip_compile("gfx942", defines=defines)
    assert ok, report


def test_missing_atomics_names_each_absent_sequence():
    asm = "buffer_wbl2 sc1\n global_atomic_add v[0:1], v2, off\n buffer_inv sc1\n global_load_dword v5, v[0:1], off sc1\n"
    assert hcc.missing_atomics(asm) == ["XCD-scope acquire: L1 invalidate only"]
    assert hcc.missing_atomics(asm + "buffer_inv sc0\n") == []


def test_clang_command_passes_defines_and_the_cli_refuses_bad_input(capsys):
    """`-D` reaches clang as the loader's builds get it (e.g. AMK_GEMV_LOADS_AHEAD, which 'auto'
    turns on for a HIP lowering of the 1B); an arch or define of the wrong form exits 2."""
    from pathlib import Path

    cmd = hcc.clang_command("clang-19", "gfx942", Path("out.s"), defines={"AMK_GEMV_LOADS_AHEAD": 1})
    assert "-DAMK_GEMV_LOADS_AHEAD=1" in cmd and "--offload-arch=gfx942" in cmd
    assert hcc.main(["sm_90"]) == 2 and hcc.main(["gfx942", "-D", "AMK_X=y"]) == 2
    assert "not an AMD architecture" in capsys.readouterr().err
