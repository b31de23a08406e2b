"""Weights for a lowered Program: every WEIGHT/CONST buffer's contents by buffer name.

Weights are cast to the buffer dtype or quantized to its I8/U4 layout (`quantize.py`), or,
for matrices given pre-quantized (a GGUF file's own blocks, `native`), bound as they are;
the one CONST table, `rope.inv_freq`, is computed with transformers' own RoPE formulas
(operation for operation, without importing it), so llama3-style scaling matches HF exactly.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from amk.schedule import rope_rows
from amk.schedule.ir import BufferKind, DType, Program
from amk.schedule.modelspec import ModelSpec
from amk.schedule.quantize import QuantizedWeight, quantize_int4, quantize_int8, quantize_int8_asym

TORCH_DTYPES = {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16}
COMPANION_DTYPES = {str(t): d for d, t in TORCH_DTYPES.items()}  # "torch.float16" -> DType.F16
INV_FREQ = "rope.inv_freq"
LM_HEAD_Q = "lm_head.q"  # the quantized copy of a tied LM head


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them for this config.

    The "default" and "llama3" formulas are transformers' own (`compute_default_rope_parameters`,
    `_compute_llama3_parameters` in `modeling_rope_utils`), operation for operation, so the
    result is bitwise equal without importing transformers (seconds). Every other RoPE type
    (linear, dynamic, yarn, longrope, ...: position-dependent or attention_scaling != 1) is
    refused; tests/test_rope_freq.py checks both against transformers."""
    hf = spec.hf_config
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or spec.rope_scaling or {}
    if any(isinstance(v, dict) for v in rp.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE type {rope_type!r} is not supported (only 'default' and 'llama3'; "
                         "others are position-dependent or have attention_scaling != 1)")
    partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} (partial rotary) is not supported")
    base = rp.get("rope_theta", hf.get("rope_theta", spec.rope_theta))
    dim = spec.head_dim
    # 1.0 / (base ** (arange(0, dim, 2) / dim)) in float32, as transformers writes it
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope_type == "llama3":
        factor = rp["factor"]
        low_freq_factor = rp["low_freq_factor"]
        high_freq_factor = rp["high_freq_factor"]
        # transformers prefers a top-level original_max_position_embeddings (Phi3-style)
        old_context_len = hf.get("original_max_position_embeddings") or rp.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings", spec.max_position_embeddings))

        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor

        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    inv = inv_freq.float()
    if inv.shape != (spec.head_dim // 2,):
        raise ValueError(f"inverse frequencies of shape {tuple(inv.shape)} (partial rotary?) are not supported")
    return inv


def source_name(name: str, spec: ModelSpec) -> str:
    """The importer's (HF state-dict) name of the tensor a buffer holds."""
    if name == LM_HEAD_Q:
        return "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    return name


def _bind_native(b, bufs, q: QuantizedWeight, src: str) -> dict[str, torch.Tensor]:
    """A pre-quantized matrix, checked against the buffer layout the lowering chose for it."""
    scale = bufs[b.scale]
    zero = bufs[b.zero] if b.zero is not None else None
    want = (b.dtype, b.group, tuple(b.shape), scale.dtype, zero is not None)
    have = (q.dtype, q.group, tuple(q.shape), COMPANION_DTYPES.get(str(q.scale.dtype)), q.zero is not None)
    if want != have:
        raise ValueError(f"{src}: native quantized layout {have} does not match buffer {b.name} {want}")
    out = {b.name: q.codes.contiguous(), scale.name: q.scale.contiguous()}
    if zero is not None:
        out[zero.name] = q.zero.contiguous()
    return out


def bind_weights(program: Program, spec: ModelSpec, weights: dict[str, torch.Tensor],
                 native: Optional[Mapping[str, QuantizedWeight]] = None) -> dict[str, torch.Tensor]:
    """Contents of every WEIGHT and CONST buffer, by buffer name, in the buffer's layout:
    the program dtype; I8 codes (int8 [N, K]); U4 codes packed two per byte (uint8
    [N, K/2], low nibble first); `<name>.scale` / `<name>.zero` companions [N, K/group].
    With quant='gguf' the quantized buffers come from `native` (the file's blocks, by HF
    name) unchanged; float buffers always come from `weights`."""
    gguf = program.meta.get("config", {}).get("quant") == "gguf"
    if gguf and native is None:
        raise ValueError("a quant='gguf' program needs the GGUF file's quantized tensors (native=...)")
    out: dict[str, torch.Tensor] = {}
    bufs = program.buffers
    run, head_dim, permuted = rope_rows.permuted_rows(program)

    def rows_in_order(b, t: torch.Tensor) -> torch.Tensor:  # q/k rows in the program's layout
        return rope_rows.permute_rows(t, head_dim, run) if b.name in permuted else t

    companions = {b.scale for b in bufs if b.scale is not None} | {b.zero for b in bufs if b.zero is not None}
    for b in bufs:
        if b.kind == BufferKind.CONST:
            if b.name != INV_FREQ:
                raise ValueError(f"unknown CONST buffer {b.name}")
            inv = rope_inv_freq(spec)  # repeated once a head: the table of the q/k GEMVs' RoPE epilogues
            out[b.name] = inv.repeat(b.numel // inv.numel())
            continue
        if b.kind != BufferKind.WEIGHT or b.id in companions:
            continue
        src = source_name(b.name, spec)
        if gguf and b.group is not None:
            if src not in native:
                raise KeyError(f"native quantized tensor {src!r} (for buffer {b.name!r}) is missing")
            out.update({k: rows_in_order(b, t) for k, t in _bind_native(b, bufs, native[src], src).items()})
            continue
        if src not in weights:
            raise KeyError(f"weight {src!r} (for buffer {b.name!r}) is missing")
        w = weights[src].detach()
        if tuple(w.shape) != b.shape:
            raise ValueError(f"{src}: shape {list(w.shape)} != buffer shape {list(b.shape)}")
        w = rows_in_order(b, w)  # before quantization: scales and zeros follow their rows
        if b.dtype in TORCH_DTYPES:
            out[b.name] = w.to(TORCH_DTYPES[b.dtype]).contiguous()
            continue
        sdt = TORCH_DTYPES[bufs[b.scale].dtype]
        if b.dtype == DType.I8 and b.zero is not None:
            out[b.name], out[bufs[b.scale].name], out[bufs[b.zero].name] = quantize_int8_asym(w, b.group, sdt)
        elif b.dtype == DType.I8:
            out[b.name], out[bufs[b.scale].name] = quantize_int8(w, b.group, sdt)
        elif b.dtype == DType.U4:
            out[b.name], out[bufs[b.scale].name], out[bufs[b.zero].name] = quantize_int4(w, b.group, sdt)
        else:
            raise ValueError(f"{b.name}: unsupported weight dtype {b.dtype.name}")
    return out
