"""Build the megakernel with NVRTC (through CuPy) and cache the cubin on disk.

AMD GPUs take the same path through CuPy's ROCm build, which maps the NVRTC API onto
hiprtc: `vm/build_hip.py` holds what differs (options, gfx arch names, the code object).

    cubin = compile_cubin(90, threads=256)          # works without a GPU (NVRTC only)
    kernel = load_kernel(threads=256)               # arch of the live device, cooperative

Sources are `vm/megakernel.cu` plus every header of `vm/` and `instructions/`, handed to
NVRTC in memory (so the cache key covers exactly what was compiled). The cubin is cached
under the user cache dir (`platformdirs`: .../amk/kernels/<sha256>.cubin) keyed by the
sources, the options, the arch and the NVRTC version.

Options are ours, not CuPy's defaults: CuPy's own compile path adds `-ftz=true`, which
flushes denormals and would break bit-exactness with the torch reference.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Optional

KERNEL_NAME = "amk_megakernel"
MAIN_SOURCE = "megakernel.cu"
BUILD_TAG = "amk-vm-1"  # bump to invalidate every cached cubin


class BuildError(RuntimeError):
    """NVRTC rejected the megakernel sources; the message carries the compiler log."""


def source_dirs() -> tuple[Path, Path]:
    """(vm/, instructions/) as installed: the include path of the megakernel."""
    import amk.instructions

    return Path(__file__).resolve().parent, Path(amk.instructions.__file__).resolve().parent


def kernel_sources() -> tuple[str, dict[str, str]]:
    """(megakernel.cu text, {header name: text}) for every header the kernel may include."""
    vm_dir, ins_dir = source_dirs()
    headers: dict[str, str] = {}
    for folder, pattern in ((vm_dir, "*.h"), (ins_dir, "*.cuh")):
        for f in sorted(folder.glob(pattern)):
            if f.name in headers:
                raise BuildError(f"header name {f.name} exists in both vm/ and instructions/")
            headers[f.name] = f.read_text()
    return (vm_dir / MAIN_SOURCE).read_text(), headers


def build_options(arch: int, threads: int, min_blocks: int = 1,
                  defines: Optional[Mapping[str, object]] = None) -> list[str]:
    """NVRTC options: C++17, SASS for `arch` (e.g. 90), the launch bounds (threads per
    block, blocks per SM) so the register budget fits the persistent grid."""
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads per block must be a multiple of 32 in 32..1024, got {threads}")
    # NVRTC's defaults are what the numerics need: IEEE div/sqrt, no flush-to-zero.
    opts = ["--std=c++17", f"-arch=sm_{arch}", f"-DAMK_BLOCK_THREADS={threads}", f"-DAMK_MIN_BLOCKS={min_blocks}"]
    for k, v in sorted((defines or {}).items()):
        opts.append(f"-D{k}={v}")
    if os.environ.get("AMK_NVRTC_LINEINFO") == "1":  # source lines for a profiler (eval/ncu_step.py); same SASS
        opts.append("-lineinfo")
    return opts


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the install
        raise BuildError("NVRTC is unavailable: install cupy-cuda13x (pip install 'amk[cuda]')") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def cache_dir() -> Path:
    override = os.environ.get("AMK_KERNEL_CACHE")
    if override:
        return Path(override)
    try:
        import platformdirs
    except ImportError:  # a bare GPU image: fall back to the XDG default
        return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "amk" / "kernels"
    return Path(platformdirs.user_cache_dir("amk")) / "kernels"


def cache_key(arch: int | str, options: list[str]) -> str:
    main, headers = kernel_sources()
    h = hashlib.sha256()
    for part in [BUILD_TAG, str(arch), repr(nvrtc_version()), *options, MAIN_SOURCE, main]:
        h.update(part.encode())
        h.update(b"\0")
    for name in sorted(headers):
        h.update(name.encode() + b"\0" + headers[name].encode() + b"\0")
    return h.hexdigest()


def is_hip() -> bool:
    """Whether CuPy is its ROCm build (NVRTC calls then go to hiprtc)."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.runtime.is_hip)


def nvrtc_compile(arch: int | str, options: list[str]) -> tuple[bytes, str]:
    """Compile the megakernel to a cubin (hiprtc: a code object); returns (binary, compiler log)."""
    nvrtc = _nvrtc()
    main, headers = kernel_sources()
    names = sorted(headers)
    prog = nvrtc.createProgram(main, MAIN_SOURCE, [headers[n].encode() for n in names], [n.encode() for n in names])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise BuildError(f"NVRTC failed for {arch} ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        if is_hip():  # CuPy's ROCm build returns hiprtc's code object from getPTX
            from amk.vm.build_hip import code_object

            return code_object(nvrtc.getPTX(prog)), nvrtc.getProgramLog(prog)
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(arch: int, *, threads: int = 256, min_blocks: int = 1,
                  defines: Optional[Mapping[str, object]] = None, use_cache: bool = True) -> Path:
    """The cubin for `arch` (compiled now or found in the cache); returns its path."""
    return compile_cached(arch, build_options(arch, threads, min_blocks, defines), ".cubin", use_cache)


def compile_cached(arch: int | str, options: list[str], suffix: str, use_cache: bool = True) -> Path:
    """The binary for (arch, options), compiled now or found in the cache; returns its path."""
    path = cache_dir() / f"{cache_key(arch, options)}{suffix}"
    if use_cache and path.is_file() and path.stat().st_size > 0:
        return path
    binary, _log = nvrtc_compile(arch, options)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(binary)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return path


def device_arch(device_index: int) -> int:
    """Compute capability of a live CUDA device as an NVRTC arch number (9.0 -> 90)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return major * 10 + minor


@lru_cache(maxsize=None)
def _load(path: str, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(path=path, enable_cooperative_groups=True).get_function(KERNEL_NAME)


def load_kernel(device_index: int, *, threads: int, min_blocks: int = 1,
                defines: Optional[Mapping[str, object]] = None):
    """The megakernel as a cooperative `cupy.RawKernel` on `device_index` (built if needed)."""
    if is_hip():
        from amk.vm.build_hip import compile_code_object, device_gfx_arch

        path = compile_code_object(device_gfx_arch(device_index), threads=threads, min_blocks=min_blocks,
                                   defines=defines)
        return _load(str(path), device_index)
    path = compile_cubin(device_arch(device_index), threads=threads, min_blocks=min_blocks, defines=defines)
    return _load(str(path), device_index)
