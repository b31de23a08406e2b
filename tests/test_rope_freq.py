"""`rope_inv_freq` computes RoPE inverse frequencies without transformers, bitwise equal to it.

For every zoo config (llama3 scaling included), with the config spelled as transformers
normalises it, as the raw config.json (rope_scaling + top-level rope_theta) and as bare
ModelSpec fields, the result must equal both transformers' init function for the RoPE
type and the `inv_freq` buffer of the family's own rotary embedding module.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from amk.schedule.importer import zoo_configs
from amk.schedule.importer.hf_config import spec_from_hf_config
from amk.schedule.weights import rope_inv_freq

ZOO = zoo_configs()


def _hf(cfg: dict):
    import transformers

    return transformers.AutoConfig.for_model(**cfg)


def _rotary_module(model_type: str, config):
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    (cls,) = [getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.endswith("DynamicRotaryEmbedding")
              and getattr(getattr(mod, n), "__module__", "") == mod.__name__]
    return cls(config)


def _hf_init(config):
    """(inv_freq, attention_scaling) from transformers' init function for the config's type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    assert rope_type == "default"
    rot = _rotary_module(config.model_type, config)
    return rot.compute_default_rope_parameters(config)


def _variants(name: str, cfg: dict):
    spec = spec_from_hf_config(cfg, name=name)  # hf_config normalised by transformers
    yield "normalized", spec
    yield "raw", spec.model_copy(update={"hf_config": dict(cfg)})  # config.json spelling
    yield "fields", spec.model_copy(update={"hf_config": {}})  # ModelSpec fields only


def test_zoo_has_llama3_rope():
    assert any((c.get("rope_scaling") or {}).get("rope_type") == "llama3" for c in ZOO.values())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_inv_freq_bitwise_equal_to_transformers(name):
    cfg = ZOO[name]
    config = _hf(cfg)
    ref, scaling = _hf_init(config)
    assert scaling == 1.0
    module = _rotary_module(config.model_type, _hf(cfg)).inv_freq
    assert torch.equal(ref.float(), module.float())
    for how, spec in _variants(name, cfg):
        got = rope_inv_freq(spec)
        assert got.dtype == torch.float32 and got.shape == (spec.head_dim // 2,), how
        assert torch.equal(got, ref.float()), (name, how, (got - ref).abs().max())
        assert torch.equal(got.view(torch.int32), ref.float().view(torch.int32)), (name, how)  # bitwise (incl. -0.0)


@pytest.mark.parametrize("theta,factor,low,high,orig", [
    (500000.0, 8.0, 1.0, 4.0, 8192), (500000, 8, 1, 4, 8192), (10000.0, 32.0, 2.0, 8.0, 64), (1e6, 16.0, 1.0, 4.0, 512),
])
def test_llama3_variants(theta, factor, low, high, orig):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": orig}
    base = dict(ZOO["llama3-rope"], rope_theta=theta, rope_scaling=scaling, head_dim=128, hidden_size=512)
    ref, scaling_out = _hf_init(_hf(base))
    assert scaling_out == 1.0
    for how, spec in _variants("l3", base):
        assert torch.equal(rope_inv_freq(spec), ref.float()), how


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_other_rope_types_refused(rope):
    cfg = dict(ZOO["llama-mha"], rope_scaling=rope)
    config = _hf(cfg)
    if rope["rope_type"] == "yarn":  # the case the attention_scaling check used to catch
        assert _hf_init(config)[1] != 1.0
    spec = spec_from_hf_config(ZOO["llama-mha"], name="x")
    for hf_config in (config.to_dict(), cfg):
        with pytest.raises(ValueError, match="not supported"):
            rope_inv_freq(spec.model_copy(update={"hf_config": hf_config}))


def test_partial_rotary_refused():
    spec = spec_from_hf_config(ZOO["llama-mha"], name="x")
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inv_freq(spec.model_copy(update={"hf_config": dict(ZOO["llama-mha"], partial_rotary_factor=0.5)}))


def test_no_transformers_import():
    code = ("import sys\n"
            "from amk.schedule.modelspec import ModelSpec\n"
            "from amk.schedule.weights import rope_inv_freq\n"
            "s = ModelSpec(name='m', family='llama', vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,"
            " num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=64,"
            " tie_word_embeddings=True, rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,"
            " 'high_freq_factor': 4.0, 'original_max_position_embeddings': 32})\n"
            "assert rope_inv_freq(s).shape == (32,)\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
