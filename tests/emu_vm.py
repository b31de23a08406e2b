"""EmuVM: the CUDA megakernel's own code run on the CPU (tests/emu/arch_emu.h: one OS
thread per GPU thread, all blocks at once), with the CudaVM's tables and step protocol.

It checks what no CPU test could otherwise reach: the device op functions, the scheduler
loop (waits, epochs, release/acquire on counters) and the packing, against the
ReferenceVM. Numerics differ from the GPU only in libm's exp/sin/cos.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from amk.schedule.ir import IMMUTABLE_KINDS, BufferKind, DType, Program
from amk.vm.build import kernel_sources, source_dirs
from amk.vm.kv_layout import read_as_rows
from amk.vm.loader import (ERRORS, HANG_ERRORS, POISON, STATUS_WORDS, TORCH_DTYPE, PackedProgram, VMError, VMHangError,
                           experiment_defines)

EMU_DIR = Path(__file__).resolve().parent / "emu"
# the emulator has no register limit: the wide attention score and P.V passes (instructions/attention.cuh),
# which the every-dtype GPU build leaves out, are compiled in so that the tests run them, the score pass
# in the form of the float-weight builds (4 heads a block; tests set AMK_ATTN_SCORE_HB to 3 or 1 for the others)
EMU_FLAGS = ("-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror",
             "-Wno-unknown-pragmas", "-DAMK_ARCH_EMU", "-DAMK_ATTN_WIDE=1", "-DAMK_ATTN_PV_WIDE=1",
             "-DAMK_ATTN_SCORE_HB=4", "-DAMK_QUOT_DIVIDE=0")  # amk_quot's shifts, not its plain divisions
_LIBS: dict[tuple, ctypes.CDLL] = {}  # by the defines of build()


def compiler() -> Optional[str]:
    return shutil.which("g++")


def emu_flags(defines: Optional[dict[str, int]] = None) -> list[str]:
    """EMU_FLAGS with `defines` (a program's knobs, `knob_defines`) and then $AMK_VM_DEFINES
    applied as the loader applies them to GPU builds (e.g. AMK_VM_DEFINES=AMK_ATTN_PV_WIDE=0
    runs the tests on the split-layout P.V pass); a define given there replaces EMU_FLAGS' own."""
    extra = {**(defines or {}), **experiment_defines()}
    flags = [f for f in EMU_FLAGS if not (f.startswith("-D") and f[2:].partition("=")[0] in extra)]
    return flags + [f"-D{k}={v}" for k, v in extra.items()]


def build(out_dir: Path, defines: Optional[dict[str, int]] = None, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile the emulated megakernel (once per source hash, defines and extra compiler flags, e.g.
    tests/emu_coverage.py's) and load it."""
    # keyed by $AMK_VM_DEFINES too: a test that sets it (monkeypatch) must not get an earlier build
    key = (tuple(sorted((defines or {}).items())), tuple(sorted(experiment_defines().items())), extra_flags)
    if key in _LIBS:
        return _LIBS[key]
    main, headers = kernel_sources()
    h = hashlib.sha256(main.encode())
    for name in sorted(headers):
        h.update(name.encode() + headers[name].encode())
    for f in sorted(EMU_DIR.iterdir()):
        h.update(f.read_bytes())
    flags = [*emu_flags(defines), *extra_flags]  # (a later -O replaces EMU_FLAGS' own)
    h.update(" ".join(flags).encode())
    lib = out_dir / f"amk_emu_{h.hexdigest()[:16]}.so"
    if not lib.exists():
        vm_dir, ins_dir = source_dirs()
        cmd = [compiler(), *flags, f"-I{EMU_DIR}", f"-I{vm_dir}", f"-I{ins_dir}", str(EMU_DIR / "emu_launch.cpp"),
               "-o", str(lib)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    dll = ctypes.CDLL(str(lib))
    warp = [f for f in flags if f.startswith("-DAMK_WARP_SIZE=")]
    dll.amk_warp_size = int(warp[-1].partition("=")[2]) if warp else 32  # (arch_emu.h's default)
    dll.amk_emu_launch.restype = ctypes.c_int
    dll.amk_emu_launch.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_uint32, ctypes.c_uint64] + [ctypes.c_int] * 4
    _LIBS[key] = dll
    return dll


class EmuVM:
    def __init__(self, program: Program, tensors: dict[str, torch.Tensor], lib: ctypes.CDLL, *,
                 spin_timeout_s: float = 5.0, prefetch_depth: int = 1):
        if lib.amk_warp_size != program.target.warp_size:  # the loader sizes shared memory by the target's
            raise ValueError(f"an emulator built for {lib.amk_warp_size}-lane warps runs {program.target.name}'s "
                             f"programs ({program.target.warp_size} lanes): build it with AMK_WARP_SIZE")
        self.program, self.lib = program, lib
        self.packed = PackedProgram(program)
        self.spin_timeout_s, self.prefetch_depth = spin_timeout_s, prefetch_depth
        self._by_name = {b.name: b for b in program.buffers}
        self.tensors: dict[str, torch.Tensor] = {}
        for b in program.buffers:
            if b.kind in IMMUTABLE_KINDS:
                t = tensors[b.name].detach().reshape(-1).contiguous().clone()
                assert t.dtype == TORCH_DTYPE[b.dtype], b.name
            else:
                t = torch.empty((b.numel + 1) // 2 if b.dtype == DType.U4 else b.numel, dtype=TORCH_DTYPE[b.dtype])
            self.tensors[b.name] = t
        self._tables = self.packed.tasks.copy()
        self._buffers = self.packed.buffer_table({b.id: self.tensors[b.name].data_ptr() for b in program.buffers})
        self._counters = np.zeros(max(len(program.counters), 1), dtype=np.uint32)
        self._status = np.zeros(STATUS_WORDS, dtype=np.int32)
        self._abort = np.zeros(16, dtype=np.int32)
        self.epoch = 1
        self.reset()

    def reset(self) -> None:
        for b in self.program.buffers:
            if b.kind == BufferKind.KV_CACHE:
                self.tensors[b.name].fill_(POISON[b.dtype])
        self._counters[:] = 0
        self._status[:] = 0
        self.epoch = 1

    def read_buffer(self, name: str) -> torch.Tensor:
        return read_as_rows(self.program, self._by_name[name], self.tensors[name])  # a KV cache as the IR's rows

    def run_step(self, token: int, pos: int) -> dict[str, torch.Tensor]:
        for b in self.program.buffers:
            if b.kind in (BufferKind.ACTIVATION, BufferKind.SCRATCH, BufferKind.IO_OUTPUT, BufferKind.IO_INPUT):
                self.tensors[b.name].fill_(POISON[b.dtype])
        for name, value in (("token", token), ("pos", pos)):
            if name in self._by_name and self._by_name[name].kind == BufferKind.IO_INPUT:
                self.tensors[name][0] = value
        ptr = lambda a: a.ctypes.data  # noqa: E731
        self.lib.amk_emu_launch(ptr(self._tables), ptr(self.packed.queue_start),
                                ptr(self.packed.queue_tasks if self.packed.queue_tasks.size else self._status),
                                ptr(self._buffers), ptr(self._counters), ptr(self._status), ptr(self._abort),
                                self.epoch, int(self.spin_timeout_s * 1e9), self.packed.smem_bytes, self.prefetch_depth,
                                len(self.program.queues), self.program.threads_per_block)
        self.epoch += 1
        code = int(self._status[0])
        if code:
            st = self._status.tolist()
            self.reset()
            msg = f"emulated step failed: {ERRORS.get(code, code)} (task {st[1]}, queue {st[2]}, detail {st[3:6]})"
            raise (VMHangError if code in HANG_ERRORS else VMError)(msg)
        return {b.name: self.tensors[b.name].clone().reshape(b.shape) for b in self.program.buffers
                if b.kind == BufferKind.IO_OUTPUT}
