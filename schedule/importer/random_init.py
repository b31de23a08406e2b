"""Deterministic random weights for a config, and on-disk random checkpoints for tests.

HF's own `_init_weights` (normal(0, initializer_range), zero biases, unit norms) under
`torch.manual_seed(seed)`, then norm weights and biases are perturbed from the same seed so
that a kernel which ignores a norm weight or a bias cannot pass the oracle by accident.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from amk.schedule.importer.hf_config import normalize
from amk.schedule.importer.quiet import quiet_transformers


def random_state_dict(hf_config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """The float32 state dict of a freshly initialised HF model for `hf_config`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with quiet_transformers(False):
        config = AutoConfig.for_model(**hf_config)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(t.shape, generator=gen)
        weights[name] = t
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def write_random_checkpoint(config_dict: dict[str, Any], directory: str | Path, seed: int = 0,
                            extra_tensors: Optional[dict[str, Optional[torch.Tensor]]] = None) -> Path:
    """Write `config.json` + `model.safetensors` with random weights into `directory`.

    `extra_tensors` edits the state dict before writing: a tensor adds or replaces an
    entry, None deletes it (used by the refusal zoo to build bad checkpoints).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = normalize(config_dict)
    weights = random_state_dict(cfg, seed)
    for name, t in (extra_tensors or {}).items():
        if t is None:
            weights.pop(name, None)
        else:
            weights[name] = t.contiguous()
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
