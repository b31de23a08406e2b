"""Half-precision rounding points (ir.py Numerics) and the half-precision logits tolerance.

* the reference semantics with bf16 rounders equal HF's own bf16 modules bit for bit
  (LlamaRMSNorm, RoPE, the MLP's act_fn(gate) * up, the residual add, eager scores);
* fp32 is untouched: fp32 buffers get the identity rounder;
* the CUDA sources run on the CPU (tests/emu) agree with the ReferenceVM on half-precision
  programs to the last bit except where libm's exp/sin/cos differ from torch's, and the
  check is sensitive: without the rounding points the reference differs far more often;
* `eval/tolerance.py`: a variant with an error beyond 2 x HF's own fails, one within passes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from amk.instructions import semantics as S
from amk.schedule.ir import (
    AttnPartialParams,
    BufferKind,
    DType,
    Epilogue,
    GemvParams,
    Op,
    RmsNormParams,
    RopeParams,
    SiluMulParams,
)
from refs import inv_freq

B16 = torch.bfloat16
R = S.rounder(B16)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(99)


def _b(*shape, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(B16)


# ----------------------------------------------------------------------------- semantics vs HF bf16
def test_identity_rounders_for_fp32_and_integers():
    assert S.rounder(torch.float32) is S.keep and S.rounder(None) is S.keep and S.rounder(torch.int32) is S.keep
    kw = S.rounding_points(GemvParams(rows=4, k=8, k_hi=8, norm_eps=1e-5), {"x": torch.float32},
                           [torch.float32])
    assert kw == {"rnd": S.keep, "x_rnd": S.keep}


@pytest.mark.parametrize("col,n", [(0, 64), (16, 32)])
def test_rmsnorm_bf16_equals_hf_llama_rmsnorm(gen, col, n):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, gamma = _b(64, gen=gen, scale=3.0), _b(64, gen=gen)
    norm = LlamaRMSNorm(64, eps=1e-5).to(B16)
    with torch.no_grad():
        norm.weight.copy_(gamma)
        want = norm(x)[col : col + n]
    got = S.rmsnorm(RmsNormParams(hidden=64, col=col, eps=1e-5), x.float(), gamma[col : col + n].float(), rnd=R)
    assert torch.equal(got.to(B16), want)
    # the GEMV prologue rounds the same way (to x's dtype)
    w = _b(8, n, gen=gen)
    p = GemvParams(rows=8, k=64, k_lo=col, k_hi=col + n, norm_eps=1e-5)
    y = S.gemv(p, w.float(), x.float(), gamma.float(), x_rnd=R, rnd=R)
    assert torch.equal(y, R(torch.mv(w.float(), want.float())))


@pytest.mark.parametrize("pos", [0, 7, 1000])
def test_rope_bf16_equals_hf_apply_rotary_pos_emb(gen, pos):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d = 64
    x = _b(3 * d, gen=gen, scale=4.0)
    cfg = LlamaConfig(hidden_size=d, num_attention_heads=1, head_dim=d,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    xh = x.reshape(1, 3, 1, d)
    cos, sin = LlamaRotaryEmbedding(cfg)(xh, torch.tensor([[pos]]))
    want, _ = apply_rotary_pos_emb(xh, xh, cos, sin)
    got = S.rope(RopeParams(head_dim=d, heads=3), x.float(), inv_freq(d), torch.tensor([pos]), rnd=R)
    assert torch.equal(got.to(B16), want.reshape(-1))


def test_silu_mul_and_fused_epilogues_equal_hf_mlp_and_residual(gen):
    n = 512
    g, u = _b(n, gen=gen, scale=3.0), _b(n, gen=gen, scale=3.0)
    want = F.silu(g) * u  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), all bf16
    assert torch.equal(S.silu_mul(SiluMulParams(n=n), g.float(), u.float(), rnd=R).to(B16), want)
    # the fused SILU_MUL epilogue rounds the accumulators first, as the unfused stores do
    acc_g, acc_u = 3 * torch.randn(n, generator=gen), 3 * torch.randn(n, generator=gen)
    p = GemvParams(rows=n, k=4, k_hi=4, epilogue=Epilogue.SILU_MUL)
    got = S.epilogue(p, acc_g, acc_u, rnd=R).to(B16)
    assert torch.equal(got, F.silu(acc_g.to(B16)) * acc_u.to(B16))
    # residual add: x + o_proj(attn), both bf16
    res, acc = _b(n, gen=gen, scale=10.0), 3 * torch.randn(n, generator=gen)
    p = GemvParams(rows=n, k=4, k_hi=4, epilogue=Epilogue.ADD)
    assert torch.equal(S.epilogue(p, acc, residual=res.float(), rnd=R).to(B16), res + acc.to(B16))


@pytest.mark.parametrize("d", [64, 128])
def test_attention_scores_bf16_equal_hf_eager(gen, d):
    """t = rnd(scale * rnd(q.k)): HF eager's matmul(q, k^T) * scaling in bf16 (the max
    score m of a one-split partial is the largest t)."""
    qh, n = 3, 17
    q, k, v = _b(qh * d, gen=gen, scale=2.0), _b(n, d, gen=gen, scale=2.0), _b(n, d, gen=gen)
    scale = d**-0.5
    p = AttnPartialParams(head_dim=d, q_heads=qh, splits=1, split=0, block=1, scale=scale)
    _, ml = S.attn_partial(p, q.float(), k.float(), v.float(), torch.tensor([n - 1]), rnd=R)
    hf = (torch.matmul(q.reshape(qh, d), k.T) * scale).float()
    assert torch.equal(ml.reshape(qh, 2)[:, 0], hf.amax(-1))


# ----------------------------------------------------------------------------- the CUDA sources on the CPU
def _to_half(prog, tensors, dtype=DType.BF16):
    """Every fp32 weight, activation, KV cache and output buffer in `dtype` (CONST tables and
    split-K / attention scratch stay fp32, as the lowering keeps them)."""
    kinds = (BufferKind.WEIGHT, BufferKind.ACTIVATION, BufferKind.KV_CACHE, BufferKind.IO_OUTPUT)
    names = {b.name for b in prog.buffers if b.kind in kinds and b.dtype == DType.F32}
    bufs = [b.model_copy(update={"dtype": dtype}) if b.name in names else b for b in prog.buffers]
    td = {DType.BF16: torch.bfloat16, DType.F16: torch.float16}[dtype]
    return prog.model_copy(update={"buffers": bufs}), {n: (t.to(td) if n in names else t) for n, t in tensors.items()}


def _half_programs():
    from programs import attention_program, gemv_program, lm_head_program
    from vm_cases import GEMV_CASES, elementwise_program

    # GEMV cases without the norm prologue and programs without attention outputs: those
    # two rounding points live in gemv.cuh / attention.cuh (checked on the GPU)
    out = {"rmsnorm_lm_head": (lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5), None),
           "silu_mul_add": (elementwise_program(), None),
           "head_norm_rope_append": (attention_program(heads=8, kv_heads=4, head_dim=32, splits=1, block=1,
                                                       qk_norm=True, capacity=16, seed=4), {"k_cache"})}
    for name in ("add_in_place", "rope_head_norm", "append", "split_k_silu", "split_k_add"):
        c = GEMV_CASES[name]
        if c.norm_eps is None:
            out[f"gemv_{name}"] = (gemv_program(c, seed=11), None)
    return out


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """Elements that differ, and the largest difference in units of b's bf16 ulp."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    diff = (a - b).abs()
    ulp = torch.clamp(b.abs(), min=1e-30) * 2.0**-7
    return int((a != b).sum()), float((diff / ulp).max()) if a.numel() else 0.0


@pytest.mark.parametrize("name", ["rmsnorm_lm_head", "silu_mul_add", "head_norm_rope_append", "gemv_add_in_place",
                                  "gemv_rope_head_norm", "gemv_append", "gemv_split_k_silu"])
def test_emulated_kernels_round_like_the_reference(tmp_path_factory, monkeypatch, name):
    from emu_vm import EmuVM, build, compiler

    from amk.vm import reference
    from amk.vm.reference import ReferenceVM

    if compiler() is None:
        pytest.skip("needs g++ (C++20) to build the emulated megakernel")
    lib = build(tmp_path_factory.mktemp("emu"))
    (prog, t), only = _half_programs()[name]
    prog, t = _to_half(prog, t)
    ref, emu = ReferenceVM(prog, t), EmuVM(prog, t, lib)
    monkeypatch.setattr(reference, "rounding_points", lambda *a: {})  # the reference without them
    plain = ReferenceVM(prog, t)
    names = [b.name for b in prog.buffers if (b.kind == BufferKind.IO_OUTPUT and b.dtype == DType.BF16)
             or b.kind == BufferKind.KV_CACHE]
    names = [n for n in names if only is None or n in only]
    assert names
    n_el = n_emu = n_plain = 0
    for step, (tok, pos) in enumerate([(1, 0), (3, 1), (0, 2)]):
        outs = [vm.run_step(tok, pos) for vm in (ref, emu, plain)]
        for n in names:
            want, got, base = (o[n] if n in o else vm.read_buffer(n) for o, vm in zip(outs, (ref, emu, plain)))
            if n.endswith("cache"):  # rows written so far
                rows = pos + 1
                want, got, base = (x.reshape(-1)[: rows * (x.numel() // prog.kv_capacity)] for x in (want, got, base))
            d_emu, ulps = _compare(got, want)
            d_plain, _ = _compare(base, want)
            n_el, n_emu, n_plain = n_el + want.numel(), n_emu + d_emu, n_plain + d_plain
            assert ulps <= 1.0 + 1e-6, f"{name} {n} step {step}: {ulps} bf16 ulps apart"
    # libm vs torch (exp, sin, cos) and accumulation order flip a few last bits, no more
    assert n_emu <= max(2, 0.02 * n_el), f"{name}: {n_emu} of {n_el} elements differ"
    assert n_plain > 3 * max(n_emu, 1) or name == "gemv_append", f"{name}: check not sensitive ({n_plain} vs {n_emu})"


# ----------------------------------------------------------------------------- the tolerance rule
def test_tolerance_bound_is_tied_to_hf_error():
    from amk.eval.tolerance import FLOOR_REL, half_gate

    gen = torch.Generator().manual_seed(3)
    ref = [10 * torch.randn(1000, generator=gen) for _ in range(3)]
    scale = [float(r.abs().max()) for r in ref]
    noise = [torch.randn(1000, generator=gen) for _ in range(3)]
    hf = [r + 0.01 * s * z / z.abs().max() for r, s, z in zip(ref, scale, noise)]  # HF: 1 % off
    good = [r + 0.015 * s * z.roll(1) / z.abs().max() for r, s, z in zip(ref, scale, noise)]
    bad = [g.clone() for g in good]
    bad[1][5] += 0.05 * scale[1]  # one injected error: 5 % > 2 x 1 %
    res = half_gate({"good": good, "bad": bad, "hf": hf}, hf, ref)
    assert res["bound"] == pytest.approx(0.02) and res["hf_err_vs_fp32"] == pytest.approx(0.01)
    assert res["checks"]["good"]["passed"] and res["checks"]["hf"]["passed"]
    assert not res["checks"]["bad"]["passed"] and res["checks"]["bad"]["err_vs_fp32"] > 0.04
    assert not res["passed"]
    # a tiny HF error cannot shrink the bound below the floor
    assert half_gate({"x": ref}, ref, ref)["bound"] == FLOOR_REL


def test_tolerance_argmax_near_tie_and_nan():
    from amk.eval.tolerance import judge_steps

    ref = torch.tensor([0.0, 10.0, 9.99, -5.0])
    assert judge_steps([torch.tensor([0.0, 9.99, 10.0, -5.0])], [ref], 0.01)["near_ties"] == 1
    swapped = torch.tensor([0.0, 5.0, 10.0, -5.0])  # argmax moved onto a logit 1 % lower, error 50 %
    assert not judge_steps([swapped], [ref], 0.01)["passed"]
    r = judge_steps([torch.tensor([0.0, math.nan, 9.99, -5.0])], [ref], 1.0)
    assert not r["passed"] and not r["finite"]


def test_bench_half_gate_on_the_cpu(tmp_path, monkeypatch):
    """The bench's bf16 gate on the ReferenceVM: every variant against the fp32 reference
    under 2 x hf_eager's own error; an injected 10 % error in the megakernel fails it."""
    import json

    from amk.eval import bench
    from amk.eval.bench import BenchOptions, GateFailed, run_bench
    from amk.schedule.importer import zoo_configs

    p = tmp_path / "llama-gqa-tied.json"
    p.write_text(json.dumps(zoo_configs()["llama-gqa-tied"]))
    opts = dict(model=str(p), random_init=True, dtype="bfloat16", ctx=6, steps=2, warmup=1, check_steps=2,
                baselines=("eager", "hf_eager"), device="cpu", bandwidth_gbps=1e9, command="test")
    row = run_bench(BenchOptions(**opts), log=lambda m: None)
    gate = row["correctness"]
    assert gate["passed"] and gate["reference"] == "fp32_reference" and gate["yardstick"] == "hf_eager"
    assert gate["kv_prefix"] == "model" and "fp32_reference" not in row["variants"]
    assert set(gate["checks"]) == {"megakernel", "eager", "hf_eager"}
    assert all(c["max_rel_err"] <= gate["tolerance_rel_to_max_logit"] for c in gate["checks"].values())
    assert "max_rel_err_vs_hf_eager" in gate["checks"]["megakernel"]

    real = bench.MegakernelRunner.logits

    def skewed(self):
        lg = real(self)
        lg[int(lg.argmin())] += 0.1 * float(lg.abs().max())
        return lg

    monkeypatch.setattr(bench.MegakernelRunner, "logits", skewed)
    with pytest.raises(GateFailed) as e:
        run_bench(BenchOptions(**opts), log=lambda m: None)
    assert not e.value.report["checks"]["megakernel"]["passed"] and e.value.report["checks"]["eager"]["passed"]


def test_op_table_covers_rounding_ops():
    """Every op whose rounding points the IR documents gets a rounder from rounding_points."""
    from amk.schedule.ir import HeadNormParams, ReduceParams

    bf = [torch.bfloat16]
    cases = [RmsNormParams(hidden=4, col=0, eps=1e-5), HeadNormParams(head_dim=4, heads=1, eps=1e-5),
             RopeParams(head_dim=4, heads=1), SiluMulParams(n=4), GemvParams(rows=4, k=4, k_hi=4),
             ReduceParams(rows=4, split_k=2)]
    for p in cases:
        assert S.rounding_points(p, {}, bf)["rnd"] is not S.keep, p.op
    attn = AttnPartialParams(head_dim=4, q_heads=1, splits=1, split=0, block=1, scale=0.5)
    assert S.rounding_points(attn, {"q": torch.bfloat16}, [torch.float32])["rnd"] is not S.keep
    assert set(S.SEMANTICS) == set(Op)
