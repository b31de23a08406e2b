"""GGUF quantized tensors -> the VM's I8 / U4 layouts, without dequantizing.

ggml's blocks of 32 map onto the IR's quantized layouts (group 32) exactly:

    Q8_0  d (f16), 32 x int8 q           w = d * q        -> I8, scale = d
    Q4_0  d (f16), 16 bytes of 4-bit q   w = d * (q - 8)  -> U4, scale = d, zero = -8 d
    Q4_1  d, m (f16), 16 bytes of q      w = d * q + m    -> U4, scale = d, zero = m

In a Q4_0/Q4_1 block, byte j holds element j in its low nibble and element j + 16 in its
high nibble; the IR packs element e into byte e // 2, low nibble first, so the nibbles are
re-packed. Scale and zero stay f16, the file's own values (-8 d is exact in f16 unless
|d| >= 8192, when that tensor's companions become f32). The IR dequantizes as
fp32(code * scale) + zero, which equals gguf's numpy dequantization value for value:
Q8_0 and Q4_1 are the same two roundings; for Q4_0 both products are exact, so
fp32(q d) + (-8 d) is the exact (q - 8) d (only the sign of a zero differs: gguf gives
-0.0 where d < 0 and q = 8, we give +0.0).

llama.cpp stores the q/k projections of "llama"-architecture files with their rows
permuted for its RoPE layout; transformers undoes that on load and so do we (a row
permutation of codes and companions). `read_native` checks every tensor it converts
against the float32 weights transformers' loader produced from the same file and refuses
on any difference. Other GGML types (K-quants, Q5_*, ...) are not converted: those
tensors stay the dequantized float weights, and `NativeWeights.dequantized` names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from amk.schedule.importer.errors import ImportRefused, ModelLoadError, one_line
from amk.schedule.ir import DType
from amk.schedule.modelspec import ModelSpec
from amk.schedule.quantize import QuantizedWeight

BLOCK = 32
NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1")
FLOAT_TYPES = ("F32", "F16", "BF16")
PERMUTED_ARCHS = ("llama",)  # transformers' LlamaTensorProcessor: reverse-permute q/k rows


@dataclass
class NativeWeights:
    """The quantized matrices of a GGUF file, by HF state-dict name, in the IR layouts."""

    tensors: dict[str, QuantizedWeight]
    types: dict[str, str]  # every consumed tensor's GGML type, by HF name
    dequantized: list[str] = field(default_factory=list)  # quantized in the file, unsupported here

    def summary(self) -> dict[str, object]:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return {"native": len(self.tensors), "types": counts, "dequantized": list(self.dequantized)}


# ----------------------------------------------------------------------------- block layouts
def _blocks(data: np.ndarray, rows: int, cols: int, type_size: int) -> np.ndarray:
    if cols % BLOCK:
        raise ValueError(f"{cols} columns are not whole blocks of {BLOCK}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, type_size)
    return raw


def _f16(raw: np.ndarray, at: int) -> torch.Tensor:
    """The f16 field at byte offset `at` of every block: [rows, blocks] float16."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """ggml 4-bit block bytes [rows, blocks, 16] -> IR-packed bytes [rows, blocks * 16]:
    ggml element j is the low nibble of byte j, element j + 16 its high nibble."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, blocks, 32] in element order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(qs.shape[0], -1))


def from_q8_0(data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    raw = _blocks(data, rows, cols, 34)
    codes = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(rows, cols).copy())
    return QuantizedWeight(codes, _f16(raw, 0), None, BLOCK, DType.I8, "Q8_0").check()


def from_q4_0(data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    raw = _blocks(data, rows, cols, 18)
    d = _f16(raw, 0)
    zero = -8.0 * d.float()
    if torch.equal(zero.half().float(), zero):
        scale, zero = d, zero.half()
    else:  # |d| >= 8192: -8 d overflows f16; f32 holds both exactly
        scale = d.float()
    return QuantizedWeight(_nibbles(raw[..., 2:]), scale, zero, BLOCK, DType.U4, "Q4_0").check()


def from_q4_1(data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    raw = _blocks(data, rows, cols, 20)
    return QuantizedWeight(_nibbles(raw[..., 4:]), _f16(raw, 0), _f16(raw, 2), BLOCK, DType.U4, "Q4_1").check()


CONVERTERS = {"Q8_0": from_q8_0, "Q4_0": from_q4_0, "Q4_1": from_q4_1}


def convert(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """One GGUF tensor's raw blocks ([rows, bytes per row] uint8) -> the IR layout."""
    if type_name not in CONVERTERS:
        raise ValueError(f"GGML type {type_name} has no native layout (supported: {', '.join(NATIVE_TYPES)})")
    return CONVERTERS[type_name](data, rows, cols)


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """Row index undoing llama.cpp's q/k permutation (transformers' `_reverse_permute_weights`)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


# ----------------------------------------------------------------------------- files
def _hf_to_gguf_names(arch: str, spec: ModelSpec) -> dict[str, str]:
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        raise ImportRefused(f"GGUF architecture {arch!r} is unknown to the gguf package", model=spec.name)
    name_map = get_tensor_name_map(key, spec.num_layers)
    out = {}
    for name in spec.expected_tensor_names():
        base, suffix = name.rsplit(".", 1)
        g = name_map.get_name(base)
        if g is None:
            raise ImportRefused(f"no GGUF name for tensor {name}", model=spec.name)
        out[name] = f"{g}.{suffix}"
    return out


def read_native(path: Path, spec: ModelSpec, weights: Optional[dict[str, torch.Tensor]] = None) -> NativeWeights:
    """The Q8_0/Q4_0/Q4_1 matrices of the GGUF file `path`, by HF name, in the IR layouts.

    Only 2-D tensors are converted (norm vectors are float in every GGUF). Each conversion
    is checked against `weights[name]` (transformers' float32 dequantization of the same
    file) when given; a difference raises ImportRefused.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch_field = reader.fields["general.architecture"]
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {one_line(exc)}") from None
    by_gguf = {t.name: t for t in reader.tensors}
    types: dict[str, str] = {}
    tensors: dict[str, QuantizedWeight] = {}
    dequantized: list[str] = []
    for name, gname in _hf_to_gguf_names(arch, spec).items():
        t = by_gguf.get(gname)
        if t is None:
            raise ImportRefused(f"GGUF file has no tensor {gname} (for {name})", model=spec.name)
        tname = t.tensor_type.name
        types[name] = tname
        if len(t.shape) != 2 or tname in FLOAT_TYPES:
            continue
        if tname not in CONVERTERS:
            dequantized.append(name)
            continue
        cols, rows = (int(x) for x in t.shape)  # GGUF lists ne0 (the contiguous dim) first
        q = convert(tname, np.asarray(t.data), rows, cols)
        if arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = spec.num_heads if name.endswith("q_proj.weight") else spec.num_kv_heads
            q = q.rows(unpermute_rows(rows, heads))
        if weights is not None and name in weights:
            ref = weights[name]
            if tuple(ref.shape) != (rows, cols) or not torch.equal(q.dequantize(), ref.float()):
                raise ImportRefused(f"tensor {name} ({tname}): the native layout does not dequantize to the "
                                    "weights transformers loaded from the same file", model=spec.name)
        tensors[name] = q
    return NativeWeights(tensors, types, dequantized)
