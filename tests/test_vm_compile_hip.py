"""The HIP megakernel without an AMD GPU: the same VM sources compile warning-free for the
AMD targets (clang-19, device only, to AMDGCN assembly) and the counter primitives appear
with both memory scopes. Skips with the reason where clang-19 (`make hip-tools`) is
missing (CI sets AMK_REQUIRE_HIP_TOOLS=1, which turns that skip into a failure), and per
arch where the compiler does not know the target (gfx950 needs LLVM 20)."""

from __future__ import annotations

import os

import pytest

from amk.vm import hip_compile_check as hcc


@pytest.mark.parametrize("arch", hcc.ARCHS)
def test_hip_compiles_with_scoped_atomics(arch):
    clang = hcc.clang_path()
    if clang is None:
        why = "clang-19 not found (make hip-tools installs clang-19, lld-19, libamdhip64-dev)"
        if os.environ.get("AMK_REQUIRE_HIP_TOOLS"):
            pytest.fail(why)
        pytest.skip(why)
    if not hcc.clang_knows(clang, arch):
        pytest.skip(f"{clang} does not know {arch} (needs a newer LLVM)")
    ok, report, asm = hcc.hip_compile(arch)
    assert ok, report
    assert ".amdhsa_kernel amk_megakernel" in asm


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
