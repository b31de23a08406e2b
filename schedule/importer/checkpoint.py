"""The state-dict scan: the checkpoint must hold exactly the tensors the spec consumes.

Any extra tensor (a bias the config does not declare, a quantization scale), any missing
one, a wrong shape or a non-float dtype is a refusal naming the tensor. The only entries
dropped are known non-parameter buffers and an `lm_head.weight` that duplicates the tied
embedding.
"""

from __future__ import annotations

from typing import Optional

import torch

from amk.schedule.importer.errors import ImportRefused
from amk.schedule.modelspec import ModelSpec

BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_LISTED = 4


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor in `spec.expected_tensor_names()`, keyed the same way."""
    h, f, v, d = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    by_suffix = {
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
    }
    out = {}
    for name in spec.expected_tensor_names():
        suffix = next(s for s in by_suffix if name.endswith(s))
        out[name] = by_suffix[suffix]
    return out


def _listed(names: list[str]) -> str:
    more = f" (+{len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def check_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: Optional[str] = None
                  ) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Scan `weights` against `spec`; return the spec (with its final dtype) and clean weights.

    `dtype` None keeps the checkpoint's dtype (the embedding's, when tensors disagree).
    """
    weights = {k: t for k, t in weights.items() if not k.endswith(BUFFER_SUFFIXES)}
    embed = weights.get("model.embed_tokens.weight")
    if spec.tie_word_embeddings and "lm_head.weight" in weights and embed is not None:
        head = weights["lm_head.weight"]
        if head.shape == embed.shape and torch.equal(head, embed):
            del weights["lm_head.weight"]
        else:
            raise ImportRefused("tensor lm_head.weight differs from model.embed_tokens.weight "
                                "but tie_word_embeddings=true", model=spec.name)

    shapes = expected_shapes(spec)
    reasons = []
    extra = [k for k in weights if k not in shapes]
    missing = [k for k in shapes if k not in weights]
    if extra:
        reasons.append(f"unexpected tensor(s) not declared by the config: {_listed(extra)}")
    if missing:
        reasons.append(f"missing tensor(s): {_listed(missing)}")
    for name, shape in shapes.items():
        t = weights.get(name)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            reasons.append(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype not in DTYPE_NAMES:
            reasons.append(f"tensor {name} has dtype {str(t.dtype).removeprefix('torch.')} "
                           f"(only float32/bfloat16/float16 weights are supported)")
    if reasons:
        raise ImportRefused(reasons, model=spec.name)

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    target = DTYPES[dtype] if dtype else weights["model.embed_tokens.weight"].dtype
    clean = {name: weights[name].to(target).contiguous() for name in shapes}
    return spec.model_copy(update={"dtype": DTYPE_NAMES[target]}), clean
