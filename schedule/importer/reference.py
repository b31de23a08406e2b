"""The eager HF model for a (spec, weights) pair: the correctness oracle's reference."""

from __future__ import annotations

from typing import Optional

import torch

from amk.schedule.importer.checkpoint import DTYPES
from amk.schedule.modelspec import ModelSpec


def build_hf_model(spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: Optional[str] = "float32",
                   device: str | torch.device = "cpu", attn: str = "eager"):
    """An eval-mode HF `PreTrainedModel` holding exactly `weights`, with eager attention
    unless `attn` names another HF implementation ("sdpa").

    `dtype` defaults to float32 whatever the weights' dtype; None keeps `spec.dtype`.
    `device`: where the model is built (its throwaway random init runs there too).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = DTYPES[dtype or spec.dtype]
    config = AutoConfig.for_model(**spec.hf_config)
    config._attn_implementation = attn
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch_dtype)
    state = {k: t.to(device=device, dtype=torch_dtype) for k, t in weights.items()}
    if spec.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    if spec.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
