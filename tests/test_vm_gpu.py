"""The CUDA megakernel against the ReferenceVM (the torch semantics of amk.instructions) on a
real GPU: every op in small programs, whole models (hand-fused and lowered), the step
protocol (epochs, generate), and the watchdog (a hanging program fails within its bound
and the GPU stays usable). Cases and comparisons: tests/vm_cases.py."""

from __future__ import annotations

import time

import pytest
import torch

from amk.schedule.ir import DType
from amk.vm.reference import ReferenceVM
from programs import attention_program, gemv_program, lm_head_program, tiny_model_program
from vm_cases import (
    ARGMAX_CASES,
    ARGMAX_TOKEN,
    ATTN_SPLITS,
    ATTN_TOKENS,
    GEMV_CASES,
    Q_MMA_CASES,
    Q_MMA_DEFINES,
    HALF_WEIGHT_CASES,
    LOWERED,
    PROMPT,
    XQ_CASES,
    argmax_program,
    case_program,
    cast_weights,
    close,
    elementwise_program,
    hang_program,
    hf_model,
    lowered,
    run_both,
    run_xq_case,
)


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")]


def cuda_vm(prog, tensors, **kw):
    """The generic kernel (one build for every program here); test_specialized_build_is_the_same
    checks the dtype-specialized build that models run by default against it."""
    from amk.vm.loader import CudaVM

    kw.setdefault("specialize", False)
    return CudaVM(prog, tensors, poison_each_step=True, **kw)


# ----------------------------------------------------------------------------- single ops
def test_embed_rmsnorm_gemv_argmax():
    prog, t = lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5)
    run_both(cuda_vm, prog, t, [(0, 0), (7, 0), (299, 0), (123, 0)])


@pytest.mark.parametrize("slices", [1, 4, 300, 0])
@pytest.mark.parametrize("case", list(ARGMAX_CASES))
def test_argmax_ties_and_nan(case, slices):
    """The first of several equal largest logits, or the first NaN, as torch.argmax; the same
    from PARTIAL argmaxes over slices and their MERGE, and (slices 0) from the pairs that the LM
    head's GEMV tasks write."""
    prog, t = argmax_program(case, slices)
    ref, _ = run_both(cuda_vm, prog, t, [(ARGMAX_TOKEN, 0)])
    ties, nans = ARGMAX_CASES[case]
    assert int(ref.run_step(ARGMAX_TOKEN, 0)["next_token"]) == min(nans or ties)


@pytest.mark.parametrize("name", list(GEMV_CASES))
def test_gemv(name):
    prog, t = case_program(name)
    run_both(cuda_vm, prog, t, [(tok, pos) for pos, tok in enumerate([1, 3, 0, 2])])


@pytest.mark.parametrize("name,defines", XQ_CASES)
def test_gemv_xq(monkeypatch, name, defines):
    """AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ: quantized rows dotted in integers against x packed as 24-bit
    fixed point a vector's slice (dp2a / dp4a). Within the fp32 bound of the ReferenceVM widened by
    the packing's own (xq_bound) where the outputs are the dots; a task with a tail or an unaligned
    slab keeps float x and the scalar rows (i8_channel_tail, i8_scalar, u4_scalar_split). Both rows
    loops."""
    monkeypatch.setenv("AMK_VM_DEFINES", defines)
    run_xq_case(cuda_vm, name, [1, 3, 0, 2])


@pytest.mark.parametrize("name", Q_MMA_CASES)
def test_gemv_q_mma(monkeypatch, name):
    """AMK_GEMV_I8_MMA / AMK_GEMV_U4_MMA: int8 and int4 rows on the tensor cores (mma.sync), against
    the ReferenceVM."""
    monkeypatch.setenv("AMK_VM_DEFINES", Q_MMA_DEFINES)
    prog, t = case_program(name)
    run_both(cuda_vm, prog, t, [(tok, pos) for pos, tok in enumerate([1, 3, 0, 2])])


@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16])
@pytest.mark.parametrize("name", HALF_WEIGHT_CASES)
def test_gemv_half_weights(name, dtype):
    prog, t = cast_weights(*gemv_program(GEMV_CASES[name], seed=7), {"w", "w2"}, dtype)
    run_both(cuda_vm, prog, t, [(2, 0), (1, 1)])


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("splits,block", ATTN_SPLITS)
def test_attention_ops(qk_norm, splits, block):
    """EMBED, HEAD_NORM, ROPE, KV_APPEND, ATTN_PARTIAL (empty splits early on), ATTN_COMBINE."""
    prog, t = attention_program(heads=8, kv_heads=2, head_dim=32, splits=splits, block=block, qk_norm=qk_norm,
                                capacity=16, seed=splits)
    run_both(cuda_vm, prog, t, list(zip(ATTN_TOKENS, range(len(ATTN_TOKENS)))))


def test_attention_long_context_recomputes_scores():
    """A chunk longer than the shared-memory score cache: pass 2 recomputes scores."""
    from amk.vm.loader import attn_score_cap

    cap, pos = 4096, 3000
    prog, t = attention_program(heads=16, kv_heads=2, head_dim=128, splits=2, block=64, capacity=cap, seed=3)
    p = next(x.params for x in prog.tasks if x.op.name == "ATTN_PARTIAL")
    assert attn_score_cap(p, cap) < 1536  # a chunk of 1536 positions outgrows the cache
    ref, gpu = ReferenceVM(prog, t), cuda_vm(prog, t)
    gen = torch.Generator().manual_seed(0)
    for name in ("k_cache", "v_cache"):  # a random history in both VMs
        hist = torch.randn(cap, ref.read_buffer(name).numel() // cap, generator=gen)
        hist[pos:] = float("nan")
        ref.mem[ref._by_name[name].id].copy_(hist.reshape(-1))
        gpu.tensors[name].copy_(hist.reshape(-1))
    close(gpu.run_step(5, pos)["out"], ref.run_step(5, pos)["out"], "long-context attention")


def test_silu_mul_and_add():
    run_both(cuda_vm, *elementwise_program(), [(0, 0), (4, 0), (2, 0)])


# ----------------------------------------------------------------------------- whole models
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_model_logits_match_reference(family):
    prog, t = tiny_model_program(hf_model(family), split_k=2 if family == "llama" else 1, splits=3)
    ref, gpu = ReferenceVM(prog, t), cuda_vm(prog, t)
    close(gpu.logits_for(PROMPT), ref.logits_for(PROMPT), f"{family} logits")
    assert gpu.generate(PROMPT[:3], 6) == ref.generate(PROMPT[:3], 6)


@pytest.mark.parametrize("case", list(LOWERED))
def test_lowered_model_matches_reference(case):
    """A whole random-init model through the real lowering: logits within 1e-4 (fp32)."""
    prog, t = lowered(case.split("/")[0], **LOWERED[case])
    ref, gpu = ReferenceVM(prog, t), cuda_vm(prog, t)
    close(gpu.logits_for(PROMPT), ref.logits_for(PROMPT), f"{case} logits")
    assert gpu.generate(PROMPT[:4], 5) == ref.generate(PROMPT[:4], 5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lowered_half_precision_model(dtype):
    """Half-precision weights, activations and KV cache: each store rounds once, so the
    two VMs may differ by a rounding step that then propagates; compare loosely."""
    prog, t = lowered("llama-gqa-tied", dtype=dtype)
    ref, gpu = ReferenceVM(prog, t), cuda_vm(prog, t)
    got, want = gpu.logits_for(PROMPT).cpu(), ref.logits_for(PROMPT)
    assert not got.isnan().any()
    rel = (got - want).norm() / want.norm()
    assert rel < 2e-2, f"{dtype}: relative error {rel:.2e}"


def test_specialized_build_is_the_same():
    """The build with only the program's dtype paths compiled (the default for models) gives
    bit-identical logits and tokens to the generic build: the same code, less of it."""
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16")
    generic, special = cuda_vm(prog, t), cuda_vm(prog, t, specialize=True)
    assert special.packed.defines["AMK_GEMV_WDTYPES"] == 1 << 2  # bf16 weights only
    assert torch.equal(special.logits_for(PROMPT), generic.logits_for(PROMPT))
    assert special.generate(PROMPT[:4], 5) == generic.generate(PROMPT[:4], 5)


def test_trace_rows_are_ordered_and_marked():
    """A traced step (CudaVM(trace=True)): per task wait start <= wait met <= each phase mark
    <= body done <= op done, with the marks that every GEMV and attention op records present
    (they are held in shared memory and written with body done), and the logits unchanged."""
    from amk.schedule.ir import Op

    prog, t = lowered("llama-gqa-tied", dtype="bfloat16")
    traced, plain = cuda_vm(prog, t, specialize=True, trace=True), cuda_vm(prog, t, specialize=True)
    assert torch.equal(traced.logits_for(PROMPT), plain.logits_for(PROMPT))
    tr = traced.trace().numpy()  # rows in program.tasks order
    start, met, done, body = tr[:, 0], tr[:, 1], tr[:, 2], tr[:, 6]
    assert (start > 0).all() and (start <= met).all() and (met <= body).all() and (body <= done).all()
    for task, row in zip(prog.tasks, tr):
        marks = row[3:6]
        marked = marks[marks > 0]
        assert ((row[1] <= marked) & (marked <= row[6])).all(), task.name
        assert (marked[1:] >= marked[:-1]).all(), task.name
        if task.params.op in (Op.GEMV, Op.ATTN_PARTIAL, Op.ATTN_COMBINE):
            assert marks[0] > 0 and marks[1] > 0, f"{task.name}: phase marks missing"


def test_device_memory_accounts_for_every_buffer():
    """weights + kv + other cover every buffer of the program once, and the overhead is the
    non-weight, non-KV share."""
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16")
    vm = cuda_vm(prog, t)
    m = vm.device_memory()
    from amk.schedule.ir import IMMUTABLE_KINDS, BufferKind

    weights = sum(vm.tensors[b.name].untyped_storage().nbytes() for b in prog.buffers if b.kind in IMMUTABLE_KINDS)
    kv = sum(vm.tensors[b.name].untyped_storage().nbytes() for b in prog.buffers if b.kind == BufferKind.KV_CACHE)
    assert m["weights"] <= weights and m["weights"] > 0  # <=: storages shared between buffers count once
    assert m["kv"] == kv > 0
    assert m["other"] > 0
    assert abs(m["overhead_pct"] - 100 * m["other"] / (m["weights"] + m["kv"])) < 1e-9


# VM defines that change how the scheduler loop or an op computes, never what: a build with each
# must give the same bits as the build without it. Each with the weight formats whose default it
# changes (a pair of one build twice could not fail; test_vm_emulated checks the list): AMK_COMBINE_EARLY=0
# against its default on in float builds and in symmetric int8 builds of the plain GEMV loop
# (eval/PERF_NOTES.md items 126, 131 and 224), and =2 (the splits copied into shared memory, item 256)
# against float builds' 1, and =0 against the int4 builds' 2; AMK_ATTN_SCORE_HB=1, one head a score pass, against the
# default 4 of float builds, 2 of symmetric int8 and int4 builds of the loads-ahead loop (items 230 and
# 246) and 3 of int8 builds of the plain loop (item 244)
SAME_BITS_CASES = [(None, "AMK_COMBINE_EARLY=0"), ("int8", "AMK_COMBINE_EARLY=0"),
                   (None, "AMK_COMBINE_EARLY=2"), ("int4_ahead", "AMK_COMBINE_EARLY=0"),
                   (None, "AMK_ATTN_SCORE_HB=1"), ("int8", "AMK_ATTN_SCORE_HB=1"), ("int8_ahead", "AMK_ATTN_SCORE_HB=1"),
                   ("int4_ahead", "AMK_ATTN_SCORE_HB=1")]


@pytest.mark.parametrize("quant,defines", SAME_BITS_CASES)
@pytest.mark.parametrize("model", ["smollm2-like", "llama-gqa-tied"])
def test_same_bits_defines(monkeypatch, model, quant, defines):
    """A bf16 model (its specialized build, as benches run it; float or int8 weights, int8 in the
    plain GEMV loop's build and in the loads-ahead loop's, which packs x for integer dots) over 40
    steps, each a launch, with 4
    attention splits of 8-position blocks (3 of them hold rows by the end, so the combine sums
    real splits): logits bit-identical with and without the define, and within tolerance of the
    ReferenceVM in fp32 (so both builds are right, not only alike)."""
    same_bits(monkeypatch, model, quant, defines)


@pytest.mark.parametrize("model", ["smollm2-like", "llama-gqa-tied"])
def test_same_bits_xq_xsums(monkeypatch, model):
    """AMK_GEMV_XQ_XSUMS (eval/PERF_NOTES.md item 239: x's chunk sums taken by the int4 rows' pack, the
    default) against the prologue's sums (=0) in the int4 loads-ahead build, which packs x: as
    test_same_bits_defines."""
    same_bits(monkeypatch, model, "int4_ahead", "AMK_GEMV_XQ_XSUMS=0")


def same_bits(monkeypatch, model, quant, defines):
    """test_same_bits_defines' check, for one model, weight format and define set."""
    quant_cfg = {None: {}, "int8": {"quant": "int8"}, "int8_ahead": {"quant": "int8", "gemv_loads_ahead": True},
                 "int4_ahead": {"quant": "int4", "gemv_loads_ahead": True}}
    cfg = dict(kv_splits=4, kv_block=8, **quant_cfg[quant])
    prog, t = lowered(model, dtype="bfloat16", **cfg)
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    base = cuda_vm(prog, t, specialize=True)
    monkeypatch.setenv("AMK_VM_DEFINES", defines)
    exp = cuda_vm(prog, t, specialize=True)
    from amk.vm.loader import build_defines, parse_defines

    built = build_defines(prog, exp.packed)
    assert all(built.get(k) == v for k, v in parse_defines(defines).items())  # the experiment is in its build
    for step, tok in enumerate(PROMPT * 5):
        a, b = base.run_step(tok, step)["logits"], exp.run_step(tok, step)["logits"]
        assert torch.equal(a, b), f"{model} {defines}: step {step} differs"
    fp_prog, fp_t = lowered(model, **cfg)
    monkeypatch.setenv("AMK_VM_DEFINES", defines)
    close(cuda_vm(fp_prog, fp_t, specialize=True).logits_for(PROMPT), ReferenceVM(fp_prog, fp_t).logits_for(PROMPT),
          f"{model} fp32 {defines}")


# ----------------------------------------------------------------------------- step protocol
def test_many_steps_epochs_and_reset():
    """Counters are never reset between steps (epoch thresholds): 200 launches stay right."""
    prog, t = lm_head_program()
    ref, gpu = ReferenceVM(prog, t), cuda_vm(prog, t)
    for i in range(200):
        tok = (i * 7) % 40
        if i % 50 == 0:
            close(gpu.run_step(tok, 0)["logits"], ref.run_step(tok, 0)["logits"], f"step {i}")
        else:
            gpu.run_step(tok, 0)
    assert gpu.epoch == 201
    gpu.reset()
    assert gpu.epoch == 1
    assert gpu.run_step(3, 0)["next_token"].item() == ref.run_step(3, 0)["next_token"].item()


def test_refuses_rejected_program():
    from amk.vm.loader import VMRefused

    with pytest.raises(VMRefused, match="refuses"):
        cuda_vm(*hang_program())


# ----------------------------------------------------------------------------- watchdog
@pytest.mark.parametrize("who", ["device spin budget", "host watchdog"])
def test_hang_becomes_an_error_and_the_gpu_stays_usable(who):
    from amk.vm.loader import VMHangError

    prog, t = hang_program()
    timeout = 2.0
    spin = 0.5 if who == "device spin budget" else 1000.0  # else only the host abort can end it
    hang = cuda_vm(prog, t, timeout_s=timeout, spin_timeout_s=spin, _unsafe_skip_validation=True)
    for _ in range(2):  # the same VM fails cleanly again after its reset
        start = time.monotonic()
        with pytest.raises(VMHangError, match="spin timeout" if spin < timeout else "aborted"):
            hang.run_step(0, 0)
        assert time.monotonic() - start < timeout + 3.0
    torch.cuda.synchronize()  # the context is healthy
    run_both(cuda_vm, *lm_head_program(), [(5, 0), (6, 0)])
