"""The coverage zoo: tiny random-init configs AMK must run, and variants it must refuse.

Sizes are small enough for the CPU oracle (2 layers) but keep the shapes that stress the
lowering: GQA ratios 1/2/3/4/8, MQA, head_dim 64 and 128 (also bigger than hidden/heads),
SmolLM2's odd 576/9/3, a vocab that is not a multiple of 64, biases, q/k norms.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from amk.schedule.importer.random_init import write_random_checkpoint

__all__ = ["zoo_configs", "refusal_zoo", "write_random_checkpoint"]


def _llama(**over: Any) -> dict[str, Any]:
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=512,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2)
    cfg.update(over)
    return cfg


def zoo_configs() -> dict[str, dict[str, Any]]:
    """Name -> HF config dict of every supported shape class (all 2 layers, fp32 random init)."""
    llama3_rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 1024}
    return {
        "llama-mha": _llama(),
        "llama-gqa-tied": _llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True),
        "llama-mqa": _llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, vocab_size=1000),
        "llama-hd128": _llama(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
        "llama-hd128-wide": _llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                   tie_word_embeddings=True),
        "llama3-rope": _llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                              rope_scaling=llama3_rope, max_position_embeddings=4096, tie_word_embeddings=True,
                              vocab_size=1024, eos_token_id=[2, 3]),
        "smollm2-like": _llama(hidden_size=576, intermediate_size=512, num_attention_heads=9, num_key_value_heads=3,
                               vocab_size=1024, rope_theta=100000.0, tie_word_embeddings=True,
                               max_position_embeddings=8192),
        "tinyllama-like": _llama(hidden_size=512, intermediate_size=384, num_attention_heads=8, num_key_value_heads=1,
                                 vocab_size=768),
        "llama2-like": _llama(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4,
                              vocab_size=1000, rms_norm_eps=1e-6, max_position_embeddings=4096),
        "mistral": dict(_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                               sliding_window=None), model_type="mistral", architectures=["MistralForCausalLM"]),
        "mistral-window-full": dict(_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                           sliding_window=2048, max_position_embeddings=2048),
                                    model_type="mistral", architectures=["MistralForCausalLM"]),
        "qwen2-bias": _qwen("qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, vocab_size=600),
        "qwen3-qknorm": _qwen("qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              attention_bias=False),
    }


def _qwen(model_type: str, **over: Any) -> dict[str, Any]:
    cfg = _llama(**over)
    for k in ("attention_bias", "mlp_bias") if model_type == "qwen2" else ("mlp_bias",):
        cfg.pop(k)
    if model_type == "qwen2":
        cfg.pop("head_dim")
    cfg.update(model_type=model_type, architectures=[f"{model_type.capitalize()}ForCausalLM"], rope_theta=1e6,
               tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
    return cfg


RefusalCase = tuple[dict[str, Any], Optional[dict[str, Optional[torch.Tensor]]], str]


def refusal_zoo() -> dict[str, RefusalCase]:
    """Name -> (config dict, tensor edits for the checkpoint or None, substring the refusal must contain).

    With tensor edits the case is a real checkpoint (`write_random_checkpoint(cfg, dir, 0, edits)`);
    without, the config alone must be refused.
    """
    q = 128  # q_proj rows of the default _llama()
    return {
        "mixtral-moe": (dict(_llama(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                             model_type="mixtral", architectures=["MixtralForCausalLM"]), None, "num_local_experts"),
        "qwen2-moe": (dict(_llama(num_experts=4, num_experts_per_tok=2), model_type="qwen2_moe",
                           architectures=["Qwen2MoeForCausalLM"]), None, "num_experts"),
        "gelu-act": (_llama(hidden_act="gelu"), None, "hidden_act"),
        "gpt2-layernorm": (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2, n_head=2,
                                vocab_size=256, n_positions=128, activation_function="gelu_new",
                                layer_norm_epsilon=1e-5), None, "layer_norm_epsilon"),
        "phi-partial-rotary": (dict(model_type="phi", architectures=["PhiForCausalLM"], hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=256,
                                    partial_rotary_factor=0.5, hidden_act="gelu_new", layer_norm_eps=1e-5),
                               None, "partial_rotary_factor"),
        "llama-partial-rotary": (_llama(partial_rotary_factor=0.5), None, "partial_rotary_factor"),
        "bloom-alibi": (dict(model_type="bloom", architectures=["BloomForCausalLM"], hidden_size=64, n_layer=2,
                             n_head=2, vocab_size=256, layer_norm_epsilon=1e-5), None, "ALiBi"),
        "mpt-alibi": (dict(model_type="mpt", architectures=["MptForCausalLM"], d_model=64, n_heads=2, n_layers=2,
                           vocab_size=256, attn_config={"alibi": True}), None, "attn_config.alibi"),
        "rope-linear": (_llama(rope_scaling={"type": "linear", "factor": 2.0}), None, "'linear'"),
        "rope-yarn": (_llama(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 1024}), None, "'yarn'"),
        "rope-dynamic": (_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), None, "'dynamic'"),
        "llama-attention-bias": (_llama(attention_bias=True), None, "attention_bias"),
        "llama-mlp-bias": (_llama(mlp_bias=True), None, "mlp_bias"),
        "pretraining-tp": (_llama(pretraining_tp=2), None, "pretraining_tp"),
        "mistral-sliding-window": (dict(_llama(sliding_window=256, max_position_embeddings=2048),
                                        model_type="mistral", architectures=["MistralForCausalLM"]),
                                   None, "sliding_window"),
        "qwen2-sliding-window": (_qwen("qwen2") | {"use_sliding_window": True, "sliding_window": 256},
                                 None, "use_sliding_window"),
        "qwen3-attention-bias": (_qwen("qwen3", attention_bias=True), None, "attention_bias"),
        "gemma": (dict(model_type="gemma", architectures=["GemmaForCausalLM"], hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=256,
                       hidden_activation="gelu_pytorch_tanh"), None, "model_type='gemma'"),
        "gptq-quantized": (_llama(quantization_config={"quant_method": "gptq", "bits": 4}), None,
                           "quantization_config"),
        "undeclared-bias-tensor": (_llama(), {"model.layers.0.self_attn.q_proj.bias": torch.zeros(q)},
                                   "model.layers.0.self_attn.q_proj.bias"),
        "missing-tensor": (_llama(), {"model.layers.1.mlp.down_proj.weight": None},
                           "model.layers.1.mlp.down_proj.weight"),
        "wrong-shape": (_llama(), {"model.norm.weight": torch.ones(7)}, "model.norm.weight"),
        "int8-tensor": (_llama(), {"model.norm.weight": torch.ones(128, dtype=torch.int8)}, "dtype int8"),
        "untied-head-on-tied-config": (_llama(tie_word_embeddings=True), {"lm_head.weight": torch.zeros(512, 128)},
                                       "lm_head.weight"),
    }
