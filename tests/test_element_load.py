"""instructions/common.cuh amk_load (a buffer element as fp32, by its run-time dtype) compiled for the CPU
(tests/emu/arch_emu.h) with the loader's dtype masks: every dtype each build compiles gives the value
numpy's conversion gives, bit for bit, edge values included."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from amk.schedule.ir import DType
from amk.vm.build import source_dirs
from emu_vm import EMU_DIR, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="g++ not found")

SOURCE = """
#include "common.cuh"
extern "C" float amk_test_load(int dtype, const void* ptr, long long i) {
  AmkBuffer b{};
  b.ptr = (amk_u64)ptr;
  b.dtype = dtype;
  return amk_load(b, i);
}
"""
# the loader's masks (AMK_DTYPES) of a float program, an int8 and an int4 one (their F16 scales left
# out, loader.compiled_dtypes), and the every-dtype build
MASKS = {"float": 0x0D, "int8": 0x1D, "int4": 0x2D, "every": 0x3F}
N = 257


def load_fn(tmp: Path, mask: int):
    src = tmp / "load.cpp"
    src.write_text(SOURCE)
    lib = tmp / f"load_{mask:x}.so"
    vm_dir, ins_dir = source_dirs()
    subprocess.run([compiler(), "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror",
                    "-Wno-unknown-pragmas", "-DAMK_ARCH_EMU", f"-DAMK_DTYPES={mask}",
                    f"-I{EMU_DIR}", f"-I{vm_dir}", f"-I{ins_dir}", str(src), "-o", str(lib)],
                   check=True, capture_output=True, text=True)
    fn = ctypes.CDLL(str(lib)).amk_test_load
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong]
    return fn


def data(dt: DType, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(the buffer's bytes, its N elements as fp32) for dtype dt, random, with the edge values."""
    if dt in (DType.F32, DType.F16, DType.BF16):
        x = rng.standard_normal(N).astype(np.float32) * 8
        x[:4] = [0.0, -0.0, np.inf, -np.inf]
        t = torch.from_numpy(x).to({DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16}[dt])
        raw = t.view(torch.int32 if dt == DType.F32 else torch.int16).numpy().copy()
        return raw, t.float().numpy()
    if dt == DType.I32:
        x = rng.integers(-(2**31), 2**31, N, dtype=np.int64).astype(np.int32)
        return x, x.astype(np.float32)
    if dt == DType.I8:
        x = rng.integers(-128, 128, N).astype(np.int8)
        return x, x.astype(np.float32)
    codes = rng.integers(0, 16, N + 1).astype(np.uint8)  # U4: two a byte, low nibble first
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8), codes[:N].astype(np.float32)


@pytest.mark.parametrize("build", list(MASKS))
def test_element_load_every_compiled_dtype(tmp_path, build):
    mask = MASKS[build]
    load = load_fn(tmp_path, mask)
    rng = np.random.default_rng(mask)
    for dt in [dt for dt in DType if mask >> dt & 1]:
        raw, want = data(dt, rng)
        got = np.array([load(int(dt), raw.ctypes.data, i) for i in range(N)], dtype=np.float32)
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), dt.name
