"""Where a KV cache's elements live: the host's side of instructions/common.cuh's amk_kv_at.

The IR, the validator and the ReferenceVM see every KV cache as [capacity, width] rows. A program's
`meta['vm']['kv_head']` (ScheduleConfig.kv_head_major) = h > 0 tells the VM to store each cache
head-major instead: each run of h columns (a KV head) as its own [capacity, h] block, so that one
head's rows are contiguous. Element (row, col) is then at (col // h) * capacity * h + row * h + col % h,
a bijection, so regions and races are those the validator proved. A VM storage knob, not an IR field:
it lives in meta, which the program's hash covers."""

from __future__ import annotations

import torch

from amk.schedule.ir import Buffer, BufferKind, Program


class KvLayoutError(ValueError):
    pass


def program_kv_head(program: Program) -> int:
    """The head width h of the program's head-major KV caches, 0 where they are row-major."""
    vm = program.meta.get("vm") if isinstance(program.meta, dict) else None
    return int((vm or {}).get("kv_head") or 0)


def stored_kv_head(program: Program, buf: Buffer) -> int:
    """The layout `buf` is stored in: the program's kv_head for a KV cache, 0 for anything else."""
    return program_kv_head(program) if buf.kind == BufferKind.KV_CACHE else 0


def check_kv_layout(buf: Buffer, h: int) -> None:
    """Refuse a layout the VM cannot store: h a power of two dividing a [capacity, width] cache's width."""
    if h == 0:
        return
    if buf.kind != BufferKind.KV_CACHE or len(buf.shape) != 2:
        raise KvLayoutError(f"{buf.name}: kv_head={h} is a layout of [capacity, width] KV caches only")
    if h < 0 or h & (h - 1) or buf.shape[1] % h:  # the kernel maps a column by a shift and a mask
        raise KvLayoutError(f"{buf.name}: kv_head={h} must be a power of two dividing its width {buf.shape[1]}")


def kv_rows_view(buf: Buffer, flat: torch.Tensor, h: int) -> torch.Tensor:
    """A view [capacity, heads, h] of a KV cache's storage `flat` in layout h (0: row-major), indexed
    as the IR's rows (row, col // h, col % h); writable."""
    capacity, width = buf.shape
    h = h or width
    return flat.view(width // h, capacity, h).permute(1, 0, 2)


def kv_logical(buf: Buffer, flat: torch.Tensor, h: int) -> torch.Tensor:
    """A buffer's storage in layout h as the IR's rows, flat (a copy where head-major)."""
    if h == 0:
        return flat
    return kv_rows_view(buf, flat, h).reshape(-1)


def read_as_rows(program: Program, buf: Buffer, flat: torch.Tensor) -> torch.Tensor:
    """A VM's copy of `buf`'s storage as the IR sees it (read_buffer of the CUDA and emulated VMs)."""
    return kv_logical(buf, flat, stored_kv_head(program, buf)).clone()
