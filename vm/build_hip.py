"""The AMD side of `vm/build.py`: hiprtc options, gfx arch names and the code object.

    path = compile_code_object("gfx942", threads=256)   # needs CuPy's ROCm build (hiprtc)

CuPy's ROCm build maps the NVRTC API that `build.nvrtc_compile` uses onto hiprtc, so the
sources, the in-memory headers and the on-disk cache are shared with the CUDA path; only
the options, the arch name and the output (an HSA code object, `.hsaco`) differ. hiprtc
defines __HIPCC_RTC__, so vm/portability.h selects vm/arch_hip.h. Never run on AMD
hardware so far (see the README's AMD section); tests/test_build_hip.py checks what a CPU can.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

WAVE = 64  # CDNA wavefront width (AMK_WARP_SIZE in vm/arch_hip.h)


def gfx_arch(gcn_arch_name: str) -> str:
    """The processor of a HIP device's gcnArchName ('gfx942:sramecc+:xnack-' -> 'gfx942'):
    a code object built for the bare processor runs in every sramecc/xnack mode."""
    name = gcn_arch_name.strip().split(":", 1)[0]
    if not name.startswith("gfx") or len(name) < 6:
        raise ValueError(f"not an AMD GPU architecture name: {gcn_arch_name!r}")
    return name


def hip_options(arch: str, threads: int, min_blocks: int = 1,
                defines: Optional[Mapping[str, object]] = None) -> list[str]:
    """hiprtc options: C++17, code for `arch`, the launch bounds; IEEE-exact fp32 division
    and square root (the numerics must match the torch reference bit for bit)."""
    if threads % WAVE or not WAVE <= threads <= 1024:
        raise ValueError(f"threads per block must be a multiple of {WAVE} in {WAVE}..1024, got {threads}")
    opts = ["-std=c++17", "-O3", f"--offload-arch={gfx_arch(arch)}", "-fhip-fp32-correctly-rounded-divide-sqrt",
            f"-DAMK_BLOCK_THREADS={threads}", f"-DAMK_MIN_BLOCKS={min_blocks}"]
    for k, v in sorted((defines or {}).items()):
        opts.append(f"-D{k}={v}")
    return opts


def code_object(output) -> bytes:
    """hiprtc's compiled code (CuPy hands it out through getPTX) as bytes."""
    return output if isinstance(output, (bytes, bytearray)) else str(output).encode("latin-1")


def device_gfx_arch(device_index: int) -> str:
    import torch

    return gfx_arch(torch.cuda.get_device_properties(device_index).gcnArchName)


def compile_code_object(arch: str, *, threads: int = 256, min_blocks: int = 1,
                        defines: Optional[Mapping[str, object]] = None, use_cache: bool = True) -> Path:
    """The code object for `arch` (compiled now or found in the cache); returns its path."""
    from amk.vm.build import compile_cached

    return compile_cached(gfx_arch(arch), hip_options(arch, threads, min_blocks, defines), ".hsaco", use_cache)
