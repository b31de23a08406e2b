"""Weight-only quantization: GGUF-native blocks and round-to-nearest int8/int4 (CPU).

* GGUF Q8_0 / Q4_0 / Q4_1 blocks re-packed into the IR's I8 / U4 layouts dequantize
  (`amk.instructions.semantics.dequantize`) to exactly what `gguf.quants.dequantize`
  gives for the same bytes;
* a small GGUF written here (mixed Q8_0/Q4_0/Q4_1/Q5_0/F16/F32 tensors, tied head) runs
  as a quant='gguf' program on the ReferenceVM to HF's logits on the file (1e-4);
* int8 round-to-nearest keeps greedy decoding of a small model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from amk.errors import AmkError  # noqa: E402
from amk.instructions.semantics import dequantize, unpack_u4  # noqa: E402
from amk.schedule.config import ScheduleConfig  # noqa: E402
from amk.schedule.importer.gguf_native import convert, unpermute_rows  # noqa: E402
from amk.schedule.ir import DType  # noqa: E402

QT = gguf.GGMLQuantizationType
SIZES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _ours(type_name: str, blocks: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """Dequantize our re-packed layout with the VM's reference semantics."""
    q = convert(type_name, blocks, rows, cols)
    assert q.group == 32 and q.source == type_name
    codes = q.codes if q.dtype == DType.I8 else unpack_u4(q.codes, rows * cols).reshape(rows, cols)
    return dequantize(codes, q.scale, q.zero, group=q.group)


def _same(ours: torch.Tensor, ref: np.ndarray, type_name: str) -> None:
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert torch.equal(ours, ref_t)  # values, bit for bit except the sign of a zero
    bits_o, bits_r = ours.view(torch.int32), ref_t.view(torch.int32)
    differ = bits_o != bits_r
    if type_name != "Q4_0":
        assert not differ.any()
    else:  # gguf: d * (q - 8) = -0.0 for d < 0, q = 8; ours: 8d + (-8d) = +0.0
        assert bool((ref_t[differ] == 0).all())


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_blocks_match_gguf(type_name):
    gen = np.random.default_rng(0)
    rows, cols = 6, 128
    w = gen.standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (d = 0)
    w[1, 32:64] = -np.abs(w[1, 32:64])  # one-signed blocks
    w[2, 64:96] = np.abs(w[2, 64:96]) + 3.0
    blocks = gguf.quants.quantize(w, QT[type_name])
    assert blocks.shape == (rows, cols // 32 * SIZES[type_name])
    _same(_ours(type_name, blocks, rows, cols), gguf.quants.dequantize(blocks, QT[type_name]), type_name)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_random_block_bytes_match_gguf(type_name):
    """Arbitrary codes and finite f16 scales (not only what a quantizer would emit)."""
    gen = np.random.default_rng(1)
    rows, cols = 5, 96
    raw = gen.integers(0, 256, size=(rows, cols // 32, SIZES[type_name]), dtype=np.uint8)
    n_f16 = 2 if type_name == "Q4_1" else 1
    f16 = (gen.standard_normal((rows, cols // 32, n_f16)) * 0.05).astype(np.float16)
    f16[0, 0, 0] = np.float16(-1e-7)  # a subnormal scale
    raw[..., : 2 * n_f16] = f16.view(np.uint8)
    blocks = raw.reshape(rows, -1)
    _same(_ours(type_name, blocks, rows, cols), gguf.quants.dequantize(blocks, QT[type_name]), type_name)


def test_nibble_order():
    """ggml: byte j holds element j (low nibble) and j + 16 (high); we re-pack to e // 2, low first."""
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1, m = 0
    block[4:] = [j | ((15 - j) << 4) for j in range(16)]
    want = list(range(16)) + list(range(15, -1, -1))
    assert gguf.quants.dequantize(block[None], QT.Q4_1)[0].tolist() == want
    q = convert("Q4_1", block[None], 1, 32)
    assert unpack_u4(q.codes, 32).tolist() == want
    assert q.codes[0, 0] == 0x10 and q.codes[0, 8] == 0xEF  # elements (0, 1) = (0, 1), (16, 17) = (15, 14)


def test_q4_0_companions_and_overflow():
    block = np.zeros((2, 18), dtype=np.uint8)
    block[0, :2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[1, :2] = np.array([10000.0], dtype=np.float16).view(np.uint8)  # -8 d overflows f16
    small = convert("Q4_0", block[:1], 1, 32)
    assert small.scale.dtype == torch.float16 and float(small.zero[0, 0]) == -4.0
    big = convert("Q4_0", block[1:], 1, 32)
    assert big.scale.dtype == torch.float32 and float(big.zero[0, 0]) == -80000.0


def test_unpermute_rows_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    for heads in (1, 2, 3):
        ref = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
        assert np.array_equal(w[unpermute_rows(24, heads).numpy()], ref)


# ----------------------------------------------------------------------------- a small GGUF model
CFG = dict(hidden=64, ffn=96, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=160)
# GGML type of every matrix; the rest F32. blk.1.ffn_up is Q5_0 (no native layout: stays
# dequantized float, so layer 1's gate/up cannot fuse); blk.1.attn_v is F16.
TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0"}
OVERRIDE = {"blk.1.ffn_up": "Q5_0", "blk.1.attn_v": "F16"}


def write_small_gguf(path) -> None:
    c = CFG
    gen = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("amk-test")
    w.add_context_length(256)
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c["vocab"])
    h, f, qd, kd = c["hidden"], c["ffn"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]

    def mat(name, rows, cols, kind):
        kind = OVERRIDE.get(name, kind)
        x = (gen.standard_normal((rows, cols)) * cols ** -0.5).astype(np.float32)
        if kind == "F16":
            w.add_tensor(name + ".weight", x.astype(np.float16))
        else:
            w.add_tensor(name + ".weight", gguf.quants.quantize(x, QT[kind]), raw_dtype=QT[kind])

    def vec(name, n):
        w.add_tensor(name + ".weight", (1.0 + 0.1 * gen.standard_normal(n)).astype(np.float32))

    mat("token_embd", c["vocab"], h, TYPES["token_embd"])
    for i in range(c["layers"]):
        b = f"blk.{i}."
        vec(b + "attn_norm", h)
        mat(b + "attn_q", qd, h, TYPES["attn_q"])
        mat(b + "attn_k", kd, h, TYPES["attn_k"])
        mat(b + "attn_v", kd, h, TYPES["attn_v"])
        mat(b + "attn_output", h, qd, TYPES["attn_output"])
        vec(b + "ffn_norm", h)
        mat(b + "ffn_gate", f, h, TYPES["ffn_gate"])
        mat(b + "ffn_up", f, h, TYPES["ffn_up"])
        mat(b + "ffn_down", h, f, TYPES["ffn_down"])
    vec("output_norm", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    import os

    from amk.schedule.importer import load_model

    d = tmp_path_factory.mktemp("gguf")
    path = d / "tiny.gguf"
    write_small_gguf(path)
    old = os.environ.get("AMK_CACHE_DIR")
    os.environ["AMK_CACHE_DIR"] = str(d / "cache")
    try:
        yield path, load_model(str(path), native_quant=True)
    finally:
        if old is None:
            os.environ.pop("AMK_CACHE_DIR", None)
        else:
            os.environ["AMK_CACHE_DIR"] = old


def test_native_import(small_gguf):
    _, (spec, weights, native) = small_gguf
    assert spec.tie_word_embeddings and spec.num_layers == 2
    assert native.dequantized == ["model.layers.1.mlp.up_proj.weight"]
    assert native.types["model.layers.1.self_attn.v_proj.weight"] == "F16"
    assert native.types["model.layers.0.self_attn.q_proj.weight"] == "Q4_0"
    assert set(native.tensors) == {n for n, t in native.types.items() if t in ("Q8_0", "Q4_0", "Q4_1")}
    for name, q in native.tensors.items():  # read_native checked this already; the guarantee, spelled out
        assert torch.equal(q.dequantize(), weights[name]), name


def test_native_program_matches_hf(small_gguf):
    from amk.api import compile as amk_compile
    from amk.eval.oracle import hf_logits
    from amk.schedule.importer import build_hf_model

    path, loaded = small_gguf
    spec, weights, native = loaded
    cfg = ScheduleConfig(quant="gguf", quant_lm_head=True, max_queues=4)
    mk = amk_compile(str(path), cfg, loaded=loaded, kv_capacity=16)
    p = mk.program
    dt = {b.name: b.dtype for b in p.buffers}
    assert dt["lm_head.q"] == DType.I8 and p.buffer("lm_head.q").group == 32  # the Q8_0 embedding blocks
    assert dt["model.embed_tokens.weight"] == DType.F32  # EMBED reads float rows
    assert dt["model.layers.0.self_attn.q_proj.weight"] == DType.U4
    assert dt["model.layers.0.self_attn.v_proj.weight"] == DType.I8
    assert dt["model.layers.1.self_attn.v_proj.weight"] == DType.F32  # F16 in the file
    assert dt["model.layers.1.mlp.up_proj.weight"] == DType.F32  # Q5_0: dequantized fallback
    assert dt["model.layers.0.self_attn.q_proj.weight.scale"] == DType.F16
    assert p.meta["gguf_native"]["lm_head.q"] == "Q8_0"
    assert mk.tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.uint8

    ids = [3, 17, 99, 5, 150, 42]
    ref = hf_logits(build_hf_model(spec, weights), ids)
    ours = mk.logits_for(ids)
    assert (ours - ref).abs().max() < 1e-4


def test_gguf_mode_refusals(tmp_path):
    from amk.schedule.importer import ImportRefused, load_model, write_random_checkpoint, zoo_configs
    from amk.schedule.lower import lower
    from amk.schedule.targets import get_target

    with pytest.raises(ValueError, match="quant_group must be 32"):
        ScheduleConfig(quant="gguf", quant_group=64)
    assert ScheduleConfig(quant="gguf").quant_group == 32
    write_random_checkpoint(zoo_configs()["llama-mha"], tmp_path)
    with pytest.raises(ImportRefused, match="native_quant"):
        load_model(str(tmp_path), native_quant=True)
    spec, _ = load_model(str(tmp_path))
    with pytest.raises(ValueError, match="only valid for a GGUF source"):
        lower(spec, ScheduleConfig(quant="gguf"), get_target("h100"), kv_capacity=8)
    with pytest.raises(AmkError):
        from amk.api import compile as amk_compile

        amk_compile(str(tmp_path), ScheduleConfig(quant="gguf"))


# ----------------------------------------------------------------------------- round-to-nearest
def test_int8_keeps_greedy_tokens():
    """int8 RTN (per channel, LM head too) of a small model decodes the same tokens as its
    fp32 program. The LM head is scaled up so that greedy decoding has margins to keep
    (a freshly initialised model's logits are nearly flat)."""
    from amk.api import compile as amk_compile
    from amk.schedule.importer import zoo_configs
    from amk.schedule.importer.hf_config import spec_from_hf_config
    from amk.schedule.importer.random_init import random_state_dict

    cfg = zoo_configs()["llama-gqa-tied"] | {"tie_word_embeddings": False}
    spec = spec_from_hf_config(cfg, name="int8-greedy")
    weights = random_state_dict(spec.hf_config, seed=3)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 30.0
    prompt = [3, 17, 99, 5]
    runs, logits = {}, {}
    for name, kw in {"fp32": {}, "int8": dict(quant="int8", quant_group="channel", quant_lm_head=True)}.items():
        mk = amk_compile(None, ScheduleConfig(max_queues=4, **kw), loaded=(spec, weights), kv_capacity=32,
                         random_init=True)
        runs[name] = mk.generate(prompt, 16)
        logits[name] = mk.logits_for(prompt)
    assert runs["int8"] == runs["fp32"]
    assert len(set(runs["fp32"])) > 1  # not a degenerate one-token loop
    drift = (logits["int8"] - logits["fp32"]).abs().max() / logits["fp32"].abs().max()
    assert 0 < drift < 0.02
