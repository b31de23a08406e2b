"""Weight-only quantization to the IR's I8 / U4 layouts (see `ir.py`, "Numerics").

I8: w = code * scale[r, c // group], codes int8 in -127..127 (symmetric, absmax); or, with a
    zero companion (asymmetric, `quantize_int8_asym`), w = code * scale + zero[r, c // group],
    codes -128..127 spanning the group's [min, max] (zero = the value of code 0).
U4: w = code * scale[r, c // group] + zero[r, c // group], zero = the group minimum,
codes 0..15 packed two per byte, element e in byte e // 2, low nibble first.

Scale and zero are stored in `scale_dtype`; codes are computed against the *stored*
(rounded) scale and zero, so dequantization reproduces exactly what was quantized.

`QuantizedWeight` is a matrix already in one of these layouts (codes + companions), as the
importer reads it from a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks without dequantizing
(`amk.schedule.importer.gguf_native`); `bind_weights` binds it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from amk.schedule.ir import DType


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight in the IR's I8 / U4 layout.

    codes: int8 [rows, cols] (I8) or uint8 [rows, cols/2] packed two per byte, low nibble
    first (U4); scale / zero: [rows, cols/group] float (zero: always for U4, optional for I8).
    `source` names where the layout came from (a GGML type such as "Q4_1", or "rtn")."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    group: int
    dtype: DType
    source: str = "rtn"

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.codes.shape[0]
        return rows, self.scale.shape[1] * self.group

    def check(self) -> "QuantizedWeight":
        """Raise ValueError unless the parts agree with each other (shapes, dtypes)."""
        rows, cols = self.shape
        if self.dtype == DType.I8:
            ok = (self.codes.dtype == torch.int8 and tuple(self.codes.shape) == (rows, cols)
                  and (self.zero is None or (self.zero.shape == self.scale.shape and self.zero.dtype == self.scale.dtype)))
        elif self.dtype == DType.U4:
            ok = (self.codes.dtype == torch.uint8 and tuple(self.codes.shape) == (rows, cols // 2)
                  and self.zero is not None and self.zero.shape == self.scale.shape
                  and self.zero.dtype == self.scale.dtype and cols % 2 == 0)
        else:
            ok = False
        if not ok or not self.scale.is_floating_point() or self.group < 1:
            raise ValueError(f"inconsistent {self.dtype.name} quantized weight: codes {tuple(self.codes.shape)} "
                             f"{self.codes.dtype}, scale {tuple(self.scale.shape)} {self.scale.dtype}, "
                             f"group {self.group}, zero {'set' if self.zero is not None else 'none'}")
        return self

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols] with the IR's numerics: fp32(code * scale) (+ zero)."""
        return dequantize(self.codes, self.scale, self.zero)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The same weight with its rows reordered (`index` as for `tensor[index]`)."""
        z = None if self.zero is None else self.zero[index].contiguous()
        return QuantizedWeight(self.codes[index].contiguous(), self.scale[index].contiguous(), z, self.group,
                               self.dtype, self.source)


def group_for(k: int, group: int | str) -> int:
    """The group actually used for a matrix with K columns: 'channel' -> K; otherwise the
    requested group, halved until it divides K (at least 8)."""
    if group == "channel":
        return k
    g = int(group)
    while g >= 8 and k % g:
        g //= 2
    if g < 8:
        raise ValueError(f"no quantization group >= 8 divides K={k}")
    return g


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(f"group {group} does not divide K={k}")
    return w.float().reshape(n, k // group, group)


def quantize_int8(w: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """-> (codes int8 [N, K], scale [N, K/group] in scale_dtype)."""
    wg = _grouped(w, group)
    scale = (wg.abs().amax(-1) / 127.0).to(scale_dtype)
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    scale = s.to(scale_dtype)
    codes = torch.clamp(torch.round(wg / s[..., None]), -127, 127).to(torch.int8)
    return codes.reshape(w.shape), scale


def quantize_int8_asym(w: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """-> (codes int8 [N, K], scale, zero [N, K/group] in scale_dtype): each group's 256 codes
    span its [min, max] (scale = (max - min) / 255, zero = min + 128 * scale, the value of
    code 0). A group on a grid of 15 steps from its minimum (a Q4_1 block, as in the embedded
    SmolLM2 checkpoint) lands on codes 17 apart: exactly, up to the rounding of the stored
    scale and zero (eval/PERF_NOTES.md item 129)."""
    wg = _grouped(w, group)
    lo = wg.amin(-1)
    s = ((wg.amax(-1) - lo) / 255.0).to(scale_dtype).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    zero = (lo + 128.0 * s).to(scale_dtype)
    codes = torch.clamp(torch.round((wg - zero.float()[..., None]) / s[..., None]), -128, 127).to(torch.int8)
    return codes.reshape(w.shape), s.to(scale_dtype), zero


def quantize_int4(w: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """-> (packed uint8 [N, K/2], scale [N, K/group], zero [N, K/group]) in scale_dtype."""
    n, k = w.shape
    if k % 2:
        raise ValueError("int4 needs an even K")
    wg = _grouped(w, group)
    zero = wg.amin(-1).to(scale_dtype)
    z = zero.float()
    s = ((wg.amax(-1) - z) / 15.0).to(scale_dtype).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.clamp(torch.round((wg - z[..., None]) / s[..., None]), 0, 15).to(torch.uint8)
    codes = codes.reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), s.to(scale_dtype), zero


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] codes 0..15."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 weights from I8 codes [N, K] (int8) or packed U4 [N, K/2] (uint8), + zero where given."""
    c = unpack_int4(codes) if codes.dtype == torch.uint8 else codes
    n, k = c.shape
    group = k // scale.shape[1]
    w = c.float().reshape(n, k // group, group) * scale.float()[..., None]
    if zero is not None:
        w = w + zero.float()[..., None]
    return w.reshape(n, k)
