"""Every unsupported variant is refused at import, with a message naming the field or tensor."""

from __future__ import annotations

import json

import pytest
import torch

from amk.errors import AmkError
from amk.schedule.importer import (
    ImportRefused, ModelLoadError, load_model, refusal_zoo, spec_from_hf_config, write_random_checkpoint, zoo_configs,
)

REFUSALS = refusal_zoo()


def test_error_hierarchy():
    assert issubclass(ImportRefused, AmkError) and issubclass(ModelLoadError, AmkError)
    assert not issubclass(ImportRefused, ModelLoadError)


def test_refusal_zoo_covers_the_categories():
    assert len(REFUSALS) >= 6
    subs = {sub for _, _, sub in REFUSALS.values()}
    for needed in ("num_local_experts", "hidden_act", "layer_norm_epsilon", "partial_rotary_factor", "ALiBi",
                   "'yarn'", "model.layers.0.self_attn.q_proj.bias"):
        assert needed in subs


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused(name, tmp_path):
    cfg, edits, expected = REFUSALS[name]
    if edits is None:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ImportRefused) as e:
            load_model(tmp_path / "config.json", random_init=True)
        assert expected in str(e.value)
        with pytest.raises(ImportRefused) as e:  # the config is judged before the (absent) weights
            load_model(tmp_path)
        assert expected in str(e.value)
    else:
        write_random_checkpoint(cfg, tmp_path, seed=0, extra_tensors=edits)
        with pytest.raises(ImportRefused) as e:
            load_model(tmp_path)
        assert expected in str(e.value)
    msg = str(e.value)
    assert "\n" not in msg and e.value.reasons


def test_refusal_lists_every_reason():
    cfg = dict(zoo_configs()["llama-mha"], hidden_act="gelu", mlp_bias=True, pretraining_tp=4)
    with pytest.raises(ImportRefused) as e:
        spec_from_hf_config(cfg, name="x")
    assert len(e.value.reasons) == 3
    assert all(f in str(e.value) for f in ("hidden_act", "mlp_bias", "pretraining_tp"))


def test_supported_variants_are_not_refused():
    for name, cfg in zoo_configs().items():
        spec_from_hf_config(cfg, name=name)


def test_pickle_checkpoints_are_refused_without_unpickling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(zoo_configs()["llama-mha"]))
    # not a valid pickle: reading it would fail loudly, so a refusal proves it was never opened
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ImportRefused, match="pickle"):
        load_model(tmp_path)
    with pytest.raises(ImportRefused, match="pickle"):
        load_model(tmp_path / "pytorch_model.bin")
    (tmp_path / "weights.pt").write_bytes(b"not a pickle")
    with pytest.raises(ImportRefused, match="pickle"):
        load_model(tmp_path / "weights.pt")


def test_tied_duplicate_head_is_accepted(tmp_path):
    """A tied checkpoint that stores lm_head.weight as an exact copy of the embedding is fine."""
    from safetensors.torch import load_file, save_file

    write_random_checkpoint(zoo_configs()["llama-gqa-tied"], tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(tmp_path / "model.safetensors"))
    spec, w = load_model(tmp_path)
    assert spec.tie_word_embeddings and "lm_head.weight" not in w


def test_rotary_buffer_is_dropped(tmp_path):
    """Old checkpoints saved `rotary_emb.inv_freq`; it is a buffer, not a weight."""
    edits = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}
    write_random_checkpoint(zoo_configs()["llama-mha"], tmp_path, extra_tensors=edits)
    _, w = load_model(tmp_path)
    assert not any("inv_freq" in k for k in w)
