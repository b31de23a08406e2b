"""The model importer: HF id | local dir | .gguf | config.json -> (ModelSpec, weights).

    spec, weights = load_model("HuggingFaceTB/SmolLM2-135M")   # or None for the embedded default
    model = build_hf_model(spec, weights)                       # the eager reference
    spec, weights, native = load_model("m.gguf", native_quant=True)  # + Q8_0/Q4_0/Q4_1 blocks, undequantized

Unsupported models raise `ImportRefused` naming the field or tensor; unreadable sources raise
`ModelLoadError`. Both derive from `amk.errors.AmkError`.
"""

from amk.errors import AmkError
from amk.schedule.importer.checkpoint import check_weights, expected_shapes
from amk.schedule.importer.default_model import DEFAULT_NAME
from amk.schedule.importer.errors import ImportRefused, ModelLoadError
from amk.schedule.importer.gguf_native import NativeWeights, read_native
from amk.schedule.importer.hf_config import refusal_reasons, spec_from_hf_config
from amk.schedule.importer.load import load_model, load_spec, load_tokenizer
from amk.schedule.importer.random_init import random_state_dict, write_random_checkpoint
from amk.schedule.importer.reference import build_hf_model
from amk.schedule.importer.zoo import refusal_zoo, zoo_configs

__all__ = [
    "AmkError", "ImportRefused", "ModelLoadError", "DEFAULT_NAME",
    "load_model", "load_spec", "load_tokenizer", "build_hf_model", "NativeWeights", "read_native",
    "spec_from_hf_config", "refusal_reasons", "check_weights", "expected_shapes",
    "random_state_dict", "write_random_checkpoint", "zoo_configs", "refusal_zoo",
]
