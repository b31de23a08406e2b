"""Where an `Operand` lands in its buffer (ir.py "Regions"), as one strided window.

Every operand region is `rows` runs of `len` consecutive elements, run i starting at
`offset + i * stride` in the buffer's row-major flattening (logical elements: a U4
buffer counts codes, not bytes):
  * flat buffers: rows = count, stride = stride (runs may be read overlapping);
  * KV_CACHE [capacity, width], kv=APPEND (a write): row pos, columns [off, off+len)
    -> offset = pos*width + off, rows = 1;
  * KV_CACHE, kv=PREFIX (a read): rows 0..pos, columns [off, off+len)
    -> offset = off, rows = pos + 1, stride = width.
The ReferenceVM, the GPU loader and the fuzz oracle all address operands through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from amk.schedule.ir import Buffer, BufferKind, KvMode, Operand


class RegionError(ValueError):
    """An operand that does not name a valid region of its buffer."""


@dataclass(frozen=True)
class Region:
    offset: int  # flat element index of the first element
    rows: int  # number of runs
    stride: int  # elements between run starts
    len: int  # elements per run

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.len)

    @property
    def numel(self) -> int:
        return self.rows * self.len

    @property
    def end(self) -> int:
        """One past the last element touched (offset when empty)."""
        if self.numel == 0:
            return self.offset
        return self.offset + (self.rows - 1) * self.stride + self.len

    @property
    def overlapping(self) -> bool:
        return self.rows > 1 and self.stride < self.len

    def index(self) -> torch.Tensor:
        """Flat element indices [rows, len] (int64), run by run."""
        starts = self.offset + self.stride * torch.arange(self.rows, dtype=torch.int64)
        return starts[:, None] + torch.arange(self.len, dtype=torch.int64)[None, :]

    def slices(self) -> list[slice]:
        """The runs as Python slices of the flat buffer."""
        return [slice(self.offset + i * self.stride, self.offset + i * self.stride + self.len) for i in range(self.rows)]

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """A [rows, len] view into a contiguous flat tensor (no copy)."""
        if self.end > flat.numel():
            raise RegionError(f"region ends at {self.end} past a buffer of {flat.numel()} elements")
        stride = self.stride if self.rows > 1 else self.len
        return flat.as_strided((self.rows, self.len), (stride, 1), flat.storage_offset() + self.offset)


def is_kv(buf: Buffer) -> bool:
    return buf.kind == BufferKind.KV_CACHE


def region(op: Operand, buf: Buffer, pos: Optional[int] = None) -> Region:
    """The region `op` covers in `buf` at runtime position `pos` (needed for KV operands).
    Raises RegionError if the operand is malformed or out of bounds."""
    if op.buf != buf.id:
        raise RegionError(f"operand names buffer {op.buf}, got buffer {buf.id} ({buf.name})")
    if op.off < 0 or op.len < 0 or op.count < 0 or op.stride < 0:
        raise RegionError(f"negative operand field in {op} on {buf.name}")
    if is_kv(buf):
        if op.kv == KvMode.NONE:
            raise RegionError(f"KV cache {buf.name} accessed without kv=APPEND/PREFIX")
        if op.count != 1:
            raise RegionError(f"KV operand on {buf.name} must have count=1, got {op.count}")
        if len(buf.shape) != 2:
            raise RegionError(f"KV cache {buf.name} must be [capacity, width], got {buf.shape}")
        capacity, width = buf.shape
        if pos is None or not 0 <= pos < capacity:
            raise RegionError(f"position {pos} outside KV cache {buf.name} capacity {capacity}")
        if op.off + op.len > width:
            raise RegionError(f"columns [{op.off}, {op.off + op.len}) past KV width {width} of {buf.name}")
        if op.kv == KvMode.APPEND:
            return Region(pos * width + op.off, 1, width, op.len)
        return Region(op.off, pos + 1, width, op.len)
    if op.kv != KvMode.NONE:
        raise RegionError(f"kv={op.kv.name} on non-KV buffer {buf.name}")
    r = Region(op.off, op.count, op.stride, op.len)
    if r.end > buf.numel:
        raise RegionError(f"operand (off {op.off}, {op.count} x stride {op.stride}, len {op.len}) ends at {r.end}, "
                          f"past {buf.name} ({buf.numel} elements)")
    return r


def region_index(op: Operand, buf: Buffer, pos: Optional[int] = None) -> torch.Tensor:
    """Flat element indices [rows, len] the operand covers (see `region`)."""
    return region(op, buf, pos).index()
