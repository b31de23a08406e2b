"""`ModelSpec`: the architecture facts of an imported model, the importer's output.

Weights travel beside it as a plain `dict[str, torch.Tensor]` keyed by the Hugging Face
state-dict names (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`,
..., `lm_head.weight` only when untied). The lowering consumes exactly the tensors that
`expected_tensor_names()` lists; the importer refuses a checkpoint with any other.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

Family = Literal["llama", "mistral", "qwen2", "qwen3"]
WeightDType = Literal["float32", "bfloat16", "float16"]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # the HF `rope_parameters`/`rope_scaling` dict when it is of type "llama3", else None
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry biases
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    dtype: WeightDType = "float32"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # the HF config as a dict, so the oracle can rebuild the eager reference model
    hf_config: dict[str, Any] = {}

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def expected_tensor_names(self) -> list[str]:
        """Every state-dict entry the lowering consumes, in a stable order."""
        names = ["model.embed_tokens.weight"]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight"]
            names += [p + f"self_attn.{m}_proj.weight" for m in ("q", "k", "v", "o")]
            if self.qkv_bias:
                names += [p + f"self_attn.{m}_proj.bias" for m in ("q", "k", "v")]
            if self.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            names += [p + "post_attention_layernorm.weight"]
            names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        names.append("model.norm.weight")
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def weight_bytes(self, bytes_per_param: float | None = None) -> int:
        """Bytes of every consumed weight at the spec dtype (or the given width)."""
        width = bytes_per_param or {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        h, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * d
        total = v * h + self.num_layers * per_layer + h + (0 if self.tie_word_embeddings else v * h)
        return int(total * width)
