"""The hiprtc build path on the CPU: arch names, options and the code-object hand-off (the
compile itself needs CuPy's ROCm build and an AMD GPU, which this project does not have)."""

from __future__ import annotations

import pytest

from amk.vm import build, build_hip


@pytest.mark.parametrize("name,arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx950", "gfx950"),
                                       (" gfx90a:xnack+\n", "gfx90a")])
def test_gfx_arch_from_gcn_arch_name(name, arch):
    assert build_hip.gfx_arch(name) == arch


@pytest.mark.parametrize("bad", ["", "sm_90", "NVIDIA H100", "gfx"])
def test_gfx_arch_refuses_other_names(bad):
    with pytest.raises(ValueError):
        build_hip.gfx_arch(bad)


def test_hip_options():
    opts = build_hip.hip_options("gfx942:sramecc+:xnack-", 256, 2, {"AMK_TRACE": 1})
    assert opts == ["-std=c++17", "-O3", "--offload-arch=gfx942", "-fhip-fp32-correctly-rounded-divide-sqrt",
                    "-DAMK_BLOCK_THREADS=256", "-DAMK_MIN_BLOCKS=2", "-DAMK_TRACE=1"]
    with pytest.raises(ValueError, match="multiple of 64"):
        build_hip.hip_options("gfx942", 96)


def test_code_object_bytes():
    assert build_hip.code_object(b"\x7fELF") == b"\x7fELF"
    assert build_hip.code_object("\x7fELF\xff") == b"\x7fELF\xff"


def test_hip_sources_are_part_of_the_build():
    """hiprtc gets the same in-memory headers, the AMD arch headers among them."""
    _, headers = build.kernel_sources()
    assert {"portability.h", "arch_cuda.h", "arch_hip.h", "arch_hip_gfx94.h"} <= set(headers)
    assert build.is_hip() in (False, True)
