"""Shape-only models for the decode benchmark: real models' HF configs with random weights.

    amk bench llama-3.1-8b --random-init --dtype bfloat16 --ctx 1024

A shape-only model measures the *shape* (the bytes a decode step streams), not a
checkpoint: its weights are drawn by `random_weights_like` directly on the GPU in the
program dtype (seconds for 8B, where HF's CPU init takes minutes). Results carry
`shape_only: true`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _llama(**over: Any) -> dict[str, Any]:
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", attention_bias=False,
               mlp_bias=False, rms_norm_eps=1e-5, initializer_range=0.02)
    cfg.update(over)
    return cfg


SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct)
    "smollm2-135m": _llama(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                           rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                           rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=32.0),
                           tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": _llama(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                           rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
                           tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
}


def shape_config(name: Optional[str]) -> Optional[dict[str, Any]]:
    """A copy of the HF config dict of a named shape (case-insensitive), or None."""
    cfg = SHAPES.get((name or "").strip().lower())
    return None if cfg is None else {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}


@torch.no_grad()
def random_weights_like(spec, device: str | torch.device = "cuda", dtype: str = "bfloat16",
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of exactly the shapes `spec` consumes (`expected_shapes`), drawn on
    `device` in `dtype`: matrices N(0, initializer_range), norm weights 1 + N(0, 0.1),
    biases N(0, 0.02) (never all-ones / zeros, so a kernel that skips one cannot pass)."""
    from amk.schedule.importer import expected_shapes
    from amk.schedule.importer.checkpoint import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    std = float((spec.hf_config or {}).get("initializer_range", 0.02))
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(spec).items():
        t = torch.randn(shape, generator=gen, device=dev, dtype=DTYPES[dtype])
        if name.endswith("norm.weight"):
            t.mul_(0.1).add_(1.0)
        else:
            t.mul_(0.02 if name.endswith(".bias") else std)
        out[name] = t
    return out
