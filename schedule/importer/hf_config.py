"""HF config dict -> `ModelSpec`, or `ImportRefused` naming every unsupported field.

The checks run on the raw dict (as the user wrote it) and again on the dict transformers
normalises it to (transformers 5 moves `rope_theta`/`rope_scaling`/`partial_rotary_factor`
into `rope_parameters`), so a field is caught whichever spelling the checkpoint uses.
"""

from __future__ import annotations

from typing import Any, Optional

from amk.schedule.importer.errors import ImportRefused, ModelLoadError, one_line
from amk.schedule.importer.quiet import quiet_transformers
from amk.schedule.modelspec import ModelSpec

# model_type -> (spec family, accepted `architectures` entries)
SUPPORTED: dict[str, tuple[str, set[str]]] = {
    "llama": ("llama", {"LlamaForCausalLM"}),
    "mistral": ("mistral", {"MistralForCausalLM"}),
    "qwen2": ("qwen2", {"Qwen2ForCausalLM"}),
    "qwen3": ("qwen3", {"Qwen3ForCausalLM"}),
}
ROPE_TYPES = {"default", "llama3"}
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_shared_experts")
ACT_FIELDS = ("hidden_act", "hidden_activation", "activation_function")
LAYERNORM_FIELDS = ("layer_norm_eps", "layer_norm_epsilon")
# fields that change the math of a Llama block in some HF family; none may be active here
SOFTCAP_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "logits_scaling",
                  "embedding_multiplier", "residual_multiplier", "attention_multiplier", "use_qk_norm")


def _rope_dicts(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for field in ("rope_scaling", "rope_parameters"):
        value = cfg.get(field)
        if isinstance(value, dict):
            out.append((field, value))
    return out


def refusal_reasons(cfg: dict[str, Any]) -> list[str]:
    """Every reason AMK cannot run a model with this config (empty when supported)."""
    reasons: list[str] = []
    model_type = cfg.get("model_type")

    for f in MOE_FIELDS:
        v = cfg.get(f)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            reasons.append(f"mixture-of-experts ({f}={v}) is not supported")
    for f in ACT_FIELDS:
        v = cfg.get(f)
        if v is not None and v not in ("silu", "swish"):
            reasons.append(f"{f}={v!r} is not supported (only silu / SwiGLU)")
    for f in LAYERNORM_FIELDS:
        if cfg.get(f) is not None:
            reasons.append(f"LayerNorm model ({f} is set); only RMSNorm is supported")
    if cfg.get("norm_type") not in (None, "rms_norm", "rmsnorm"):
        reasons.append(f"norm_type={cfg['norm_type']!r} is not supported (only RMSNorm)")
    attn_config = cfg.get("attn_config") if isinstance(cfg.get("attn_config"), dict) else {}
    if cfg.get("alibi") or attn_config.get("alibi") or model_type == "bloom":
        field = ("attn_config.alibi" if attn_config.get("alibi")
                 else "alibi" if cfg.get("alibi") else "model_type='bloom'")
        reasons.append(f"ALiBi position biases ({field}) are not supported (only RoPE)")
    pet = cfg.get("position_embedding_type")
    if pet not in (None, "rope", "rotary"):
        reasons.append(f"position_embedding_type={pet!r} is not supported (only RoPE)")

    rotary = [("partial_rotary_factor", cfg.get("partial_rotary_factor")), ("rotary_pct", cfg.get("rotary_pct"))]
    rotary += [(f"{field}.partial_rotary_factor", d.get("partial_rotary_factor")) for field, d in _rope_dicts(cfg)]
    for f, v in rotary:
        if v is not None and float(v) < 1.0:
            reasons.append(f"partial rotary embedding ({f}={v}) is not supported")
    if cfg.get("rotary_dim") is not None:
        reasons.append(f"partial rotary embedding (rotary_dim={cfg['rotary_dim']}) is not supported")
    for field, d in _rope_dicts(cfg):
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type not in ROPE_TYPES:
            reasons.append(f"{field}.rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")
    if (cfg.get("pretraining_tp") or 1) > 1:
        reasons.append(f"pretraining_tp={cfg['pretraining_tp']} > 1 is not supported")
    if cfg.get("quantization_config"):
        qc = cfg["quantization_config"]
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        reasons.append(f"pre-quantized checkpoint (quantization_config.quant_method={method!r}) is not supported")
    for f in SOFTCAP_FIELDS:
        v = cfg.get(f)
        if v not in (None, False, 1, 1.0):
            reasons.append(f"{f}={v!r} is not supported")

    if model_type not in SUPPORTED:
        reasons.append(f"model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
        return reasons
    family, archs = SUPPORTED[model_type]
    for arch in cfg.get("architectures") or []:
        if arch not in archs:
            reasons.append(f"architectures entry {arch!r} is not supported (expected {sorted(archs)[0]})")
    if family in ("llama", "mistral", "qwen3") and cfg.get("attention_bias"):
        reasons.append(f"attention_bias=true is not supported for {model_type}")
    if cfg.get("mlp_bias"):
        reasons.append("mlp_bias=true is not supported")
    if family == "mistral":
        window, max_pos = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
        if window is not None and (max_pos is None or window < max_pos):
            reasons.append(f"sliding_window={window} < max_position_embeddings={max_pos} "
                           "(sliding-window attention is not supported)")
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        reasons.append("use_sliding_window=true (sliding-window attention is not supported)")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        reasons.append(f"layer_types contains {bad} (only full_attention is supported)")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if heads and kv and heads % kv:
        reasons.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return reasons


def normalize(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers' own config class writes it (JSON-able, with model_type)."""
    from transformers import AutoConfig

    try:
        with quiet_transformers(False):
            config = AutoConfig.for_model(**cfg)
    except Exception as exc:  # a malformed field value
        raise ModelLoadError(f"invalid {cfg.get('model_type')} config: {one_line(exc)}") from None
    return _strip(config.to_dict() | {"model_type": config.model_type})


def _strip(cfg: dict[str, Any]) -> dict[str, Any]:
    """Drop bookkeeping keys that do not describe the model."""
    drop = ("_name_or_path", "_model_name_or_path", "_commit_hash", "transformers_version",
            "_attn_implementation_autoset")
    return {k: v for k, v in cfg.items() if k not in drop}


def _first_int(value: Any) -> Optional[int]:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "llama3":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ImportRefused(f"rope_parameters of type 'llama3' lacks {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: params[k] for k in keys}}


def spec_from_hf_config(raw: dict[str, Any], *, name: str, dtype: str = "float32",
                        normalized: bool = False) -> ModelSpec:
    """Check a raw HF config dict and build its `ModelSpec` (weights are checked separately).

    `normalized` says `raw` already is a transformers `to_dict()` (skips re-normalising it).
    """
    reasons = refusal_reasons(raw)
    if reasons:
        raise ImportRefused(reasons, model=name)
    cfg = _strip(raw) if normalized else normalize(raw)
    reasons = refusal_reasons(cfg)
    if reasons:
        raise ImportRefused(reasons, model=name)
    family = SUPPORTED[cfg["model_type"]][0]
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    theta, rope_scaling = _rope(cfg)
    return ModelSpec(
        name=name,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        dtype=dtype,
        bos_token_id=_first_int(cfg.get("bos_token_id")),
        eos_token_id=_first_int(cfg.get("eos_token_id")),
        hf_config=cfg,
    )
