"""Where a KV cache's elements live (Buffer.kv_head): the host's side of instructions/common.cuh's
amk_kv. The IR, the validator and the ReferenceVM see every cache as [capacity, width] rows; a
head-major cache (kv_head = h > 0) stores each run of h columns as its own [capacity, h] block, so
that one KV head's rows are contiguous. Element (row, col) is then at
(col // h) * capacity * h + row * h + col % h, a bijection, so regions and races are unchanged."""

from __future__ import annotations

import torch

from amk.schedule.ir import Buffer, BufferKind


class KvLayoutError(ValueError):
    pass


def check_kv_layout(buf: Buffer) -> None:
    """Refuse a kv_head the VM cannot store: only on a [capacity, width] KV cache, a power of two
    dividing its width."""
    if buf.kv_head == 0:
        return
    if buf.kind != BufferKind.KV_CACHE or len(buf.shape) != 2:
        raise KvLayoutError(f"{buf.name}: kv_head={buf.kv_head} is a layout of [capacity, width] KV caches only")
    h = buf.kv_head
    if h < 0 or h & (h - 1) or buf.shape[1] % h:  # the kernel maps a column by a shift and a mask
        raise KvLayoutError(f"{buf.name}: kv_head={h} must be a power of two dividing its width {buf.shape[1]}")


def kv_rows_view(buf: Buffer, flat: torch.Tensor) -> torch.Tensor:
    """A view [capacity, heads, h] of a KV cache's storage `flat`, indexed as the IR's rows (row,
    col // h, col % h), in either layout; writable (row-major: h = width, one head)."""
    capacity, width = buf.shape
    h = buf.kv_head or width
    return flat.view(width // h, capacity, h).permute(1, 0, 2)


def kv_logical(buf: Buffer, flat: torch.Tensor) -> torch.Tensor:
    """The cache's contents as the IR's rows, flat ([capacity * width], a copy where head-major)."""
    if buf.kv_head == 0:
        return flat
    return kv_rows_view(buf, flat).reshape(-1)
