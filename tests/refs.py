"""Independent torch formulations the reference semantics are checked against: HF's own
modules where they exist (LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb,
repeat_kv), plain textbook formulas otherwise. Nothing here imports amk.instructions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)


def hf_rmsnorm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm in fp32 over the last dim."""
    norm = LlamaRMSNorm(gamma.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(gamma)
        return norm(x.float())


def hf_rope(x: torch.Tensor, pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate x (len heads*head_dim) at pos with HF's rotary embedding + apply_rotary_pos_emb."""
    cfg = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    xh = x.reshape(1, -1, 1, head_dim)  # [batch, heads, seq, head_dim]
    cos, sin = LlamaRotaryEmbedding(cfg)(xh, torch.tensor([[pos]]))
    out, _ = apply_rotary_pos_emb(xh, xh, cos, sin)
    return out.reshape(-1)


def inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def unpack_u4_slow(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Element e lives in byte e // 2, low nibble first (element by element, on purpose)."""
    b = packed.reshape(-1).tolist()
    return torch.tensor([(b[e // 2] >> (4 * (e % 2))) & 0xF for e in range(n)], dtype=torch.uint8)


def dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """Whole-matrix dequantization: w[r, c] = code * scale[r, c // group] (+ zero[r, c // group])."""
    w = codes.float() * scale.repeat_interleave(group, dim=1)
    return w if zero is None else w + zero.repeat_interleave(group, dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Decode attention of one query over all cached positions, HF eager style:
    softmax(q k^T * d^-0.5) v with repeat_kv. q [heads*d], k/v [n, kv_heads*d] -> [heads*d]."""
    d = q.numel() // heads
    n = k.shape[0]
    qh = q.reshape(1, heads, 1, d)
    kh = repeat_kv(k.reshape(1, n, kv_heads, d).transpose(1, 2), heads // kv_heads)
    vh = repeat_kv(v.reshape(1, n, kv_heads, d).transpose(1, 2), heads // kv_heads)
    w = F.softmax((qh @ kh.transpose(-1, -2)) * d ** -0.5, dim=-1, dtype=torch.float32)
    return (w @ vh).reshape(-1)
