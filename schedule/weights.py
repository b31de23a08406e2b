"""Weights for a lowered Program: every WEIGHT/CONST buffer's contents by buffer name.

Weights are cast to the buffer dtype or quantized to its I8/U4 layout (`quantize.py`);
the one CONST table, `rope.inv_freq`, is computed by transformers' own RoPE init for the
model's config, so llama3-style scaling matches HF exactly.
"""

from __future__ import annotations

import torch

from amk.schedule.ir import BufferKind, DType, Program
from amk.schedule.modelspec import ModelSpec
from amk.schedule.quantize import quantize_int4, quantize_int8

TORCH_DTYPES = {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16}
INV_FREQ = "rope.inv_freq"
LM_HEAD_Q = "lm_head.q"  # the quantized copy of a tied LM head


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them for this config."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = dict(spec.hf_config)
    model_type = hf.pop("model_type", None) or spec.family
    if not hf:
        hf = dict(hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads, head_dim=spec.head_dim,
                  num_key_value_heads=spec.num_kv_heads, rope_theta=spec.rope_theta,
                  max_position_embeddings=spec.max_position_embeddings, rope_scaling=spec.rope_scaling)
    hf.setdefault("head_dim", spec.head_dim)
    config = transformers.AutoConfig.for_model(model_type, **hf)
    # transformers 5 keeps everything in `rope_parameters`; 4.x in `rope_scaling` + `rope_theta`
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "default":
        base = rp.get("rope_theta", getattr(config, "rope_theta", spec.rope_theta))
        inv = 1.0 / (base ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim))
        scaling = 1.0
    elif rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (position-dependent or unknown)")
    else:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    if scaling != 1.0:
        raise ValueError(f"RoPE type {rope_type!r} has attention_scaling {scaling} != 1.0; not supported")
    inv = inv.float()
    if inv.shape != (spec.head_dim // 2,):
        raise ValueError(f"inverse frequencies of shape {tuple(inv.shape)} (partial rotary?) are not supported")
    return inv


def _source_name(name: str, spec: ModelSpec) -> str:
    if name == LM_HEAD_Q:
        return "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    return name


def bind_weights(program: Program, spec: ModelSpec, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contents of every WEIGHT and CONST buffer, by buffer name, in the buffer's layout:
    the program dtype; I8 codes (int8 [N, K]); U4 codes packed two per byte (uint8
    [N, K/2], low nibble first); `<name>.scale` / `<name>.zero` companions [N, K/group]."""
    out: dict[str, torch.Tensor] = {}
    bufs = program.buffers
    companions = {b.scale for b in bufs if b.scale is not None} | {b.zero for b in bufs if b.zero is not None}
    for b in bufs:
        if b.kind == BufferKind.CONST:
            if b.name != INV_FREQ:
                raise ValueError(f"unknown CONST buffer {b.name}")
            out[b.name] = rope_inv_freq(spec)
            continue
        if b.kind != BufferKind.WEIGHT or b.id in companions:
            continue
        src = _source_name(b.name, spec)
        if src not in weights:
            raise KeyError(f"weight {src!r} (for buffer {b.name!r}) is missing")
        w = weights[src].detach()
        if list(w.shape) != b.shape:
            raise ValueError(f"{src}: shape {list(w.shape)} != buffer shape {b.shape}")
        if b.dtype in TORCH_DTYPES:
            out[b.name] = w.to(TORCH_DTYPES[b.dtype]).contiguous()
            continue
        sdt = TORCH_DTYPES[bufs[b.scale].dtype]
        if b.dtype == DType.I8:
            out[b.name], out[bufs[b.scale].name] = quantize_int8(w, b.group, sdt)
        elif b.dtype == DType.U4:
            out[b.name], out[bufs[b.scale].name], out[bufs[b.zero].name] = quantize_int4(w, b.group, sdt)
        else:
            raise ValueError(f"{b.name}: unsupported weight dtype {b.dtype.name}")
    return out
