"""The megakernel's own device code on the CPU: vm/megakernel.cu and instructions/*.cuh
compiled by g++ against tests/emu/arch_emu.h (one OS thread per GPU thread, every block
at once), run against the ReferenceVM on the programs the GPU tests use. This checks the
op functions, the scheduler loop (waits, epoch thresholds, release/acquire) and the table
packing without a GPU; the GPU tests (test_vm_gpu.py) check the real thing."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
import torch

from amk.schedule.ir import BufferKind, DType, Epilogue, Op, Scope
from amk.schedule.targets import get_target
from amk.vm.loader import (PackedProgram, VMError, VMHangError, epilogue_staged_words, gemv_vec_rows, gemv_whole_vecs,
                           knob_defines)
from amk.vm.kv_layout import program_kv_head
from amk.vm.reference import ReferenceVM
from emu_vm import EmuVM, build, compiler
from programs import GemvCase, attention_program, gemv_program, lm_head_program, tiny_model_program
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
    UNFUSED,
    XQ_CASES,
    TORCH,
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
    runs_apart_program,
)

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs g++ (C++20) to build the emulated megakernel")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu")

    def make(prog, tensors, **kw):  # built with the program's knobs, as the CudaVM's kernel is, and
        warp = prog.target.warp_size  # for its target's warp size (the loader sizes shared memory by it)
        defines = {**knob_defines(prog), **({"AMK_WARP_SIZE": warp} if warp != 32 else {})}
        return EmuVM(prog, tensors, build(out, defines), **kw)

    return make


def test_embed_rmsnorm_gemv_argmax(emu):
    run_both(emu, *lm_head_program(vocab=300, hidden=96, tiles=3, slabs=5), [(0, 0), (7, 0), (299, 0)])


@pytest.mark.parametrize("slices", [1, 4, 300, 0])
@pytest.mark.parametrize("case", list(ARGMAX_CASES))
def test_argmax_ties_and_nan(emu, case, slices):
    """The first of several equal largest logits, or the first NaN, as torch.argmax; the same
    from PARTIAL argmaxes over slices and their MERGE, and (slices 0) from the pairs that the LM
    head's GEMV tasks write."""
    prog, t = argmax_program(case, slices)
    ref, _ = run_both(emu, prog, t, [(ARGMAX_TOKEN, 0)])
    ties, nans = ARGMAX_CASES[case]
    assert int(ref.run_step(ARGMAX_TOKEN, 0)["next_token"]) == min(nans or ties)


@pytest.mark.parametrize("name", list(GEMV_CASES))
def test_gemv(emu, name):
    prog, t = case_program(name)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate([1, 3, 0])])


@pytest.mark.parametrize("name,defines", XQ_CASES)
def test_gemv_xq(emu, monkeypatch, name, defines):
    """AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ: quantized rows dotted in integers against x packed as 24-bit
    fixed point a vector's slice (dp2a / dp4a). Within the fp32 bound of the ReferenceVM widened by
    the packing's own (xq_bound) where the outputs are the dots; a task with a tail or an unaligned
    slab keeps float x and the scalar rows (i8_channel_tail, i8_scalar, u4_scalar_split). Both rows
    loops."""
    monkeypatch.setenv("AMK_VM_DEFINES", defines)
    run_xq_case(emu, name, [1, 3, 0])


@pytest.mark.parametrize("name", Q_MMA_CASES)
def test_gemv_q_mma(emu, monkeypatch, name):
    """AMK_GEMV_I8_MMA / AMK_GEMV_U4_MMA: symmetric int8 and int4 rows as tensor-core MMAs (the
    emulator's mma.sync has the PTX fragment layout), x split into hi + lo halves: within the fp32
    bound of the ReferenceVM."""
    monkeypatch.setenv("AMK_VM_DEFINES", Q_MMA_DEFINES)
    prog, t = case_program(name)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate([1, 3, 0])])


@pytest.mark.parametrize("name", ["long_k", "many_rows", "tail_rows_pair", "split_k_tail", "i8_two_rounds",
                                  "i8_pair_rows_rounds", "i8_g64_split", "u4_many_rows", "u4_vec_split"])
def test_gemv_loads_ahead(emu, monkeypatch, name):
    """AMK_GEMV_LOADS_AHEAD (gemv.cuh): the next round's loads (with their scales and zeros)
    issued before the row's reduction. Rounds across rows (many_rows, u4_many_rows), several a
    row (long_k in fp32, the pair's 4096 columns, int8's 8192), a K slice's tail (split_k_tail)
    and quantized K slices: the plain loop's results, float weights in bf16 too."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_LOADS_AHEAD=1")
    prog, t = case_program(name)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate([1, 3, 0])])
    if GEMV_CASES[name].quant is None:
        run_both(emu, *cast_weights(prog, t, {"w", "w2"}, DType.BF16), [(2, 0)])


@pytest.mark.parametrize("name", ["store", "many_rows", "tail_rows_pair", "u4_many_rows", "i8_pair_rows_rounds"])
def test_gemv_loads_ahead_for_multi_row_tasks(emu, monkeypatch, name):
    """AMK_GEMV_AHEAD_MULTI (experiment, eval/PERF_NOTES.md item 208): a plain-loop build takes the
    loads-ahead loop for tasks whose lane groups take several rows (many_rows, u4_many_rows,
    i8_pair_rows_rounds: a result changed there fails them), the plain loop for the others (store,
    tail_rows_pair): the ReferenceVM's results either way."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_AHEAD_MULTI=1,AMK_GEMV_LOADS_AHEAD=0")
    prog, t = case_program(name)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate([1, 3, 0])])


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("name", ["silu_mul", "split_k_tail", "i8_pair_rows_rounds", "u4_vec_split"])
def test_gemv_rows_twice(emu, monkeypatch, name, ahead):
    """AMK_DIAG_ROWS_TWICE (a trace diagnostic, eval/PERF_NOTES.md item 232): the rows run twice,
    the second pass rewriting the same sums, so results stay the ReferenceVM's in both loops, split-K
    partials and quantized rows included (a second pass that wrote other rows fails them)."""
    monkeypatch.setenv("AMK_VM_DEFINES", f"AMK_DIAG_ROWS_TWICE=1,AMK_GEMV_LOADS_AHEAD={ahead}")
    prog, t = case_program(name)
    run_both(emu, prog, t, [(1, 0), (3, 1)])


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("name,xq", [("i8_pair_rows_rounds", "AMK_GEMV_I8_XQ=1"), ("u4_vec_split", "AMK_GEMV_U4_XQ=1")])
def test_gemv_rows_twice_xq(emu, monkeypatch, name, xq, ahead):
    """AMK_DIAG_ROWS_TWICE where the rows pack x for integer dots (inside the rows, under the first
    loads in the loads-ahead loop): the second pass reads the x the first packed and packs it no more
    (packing it twice fails these)."""
    monkeypatch.setenv("AMK_VM_DEFINES", f"AMK_DIAG_ROWS_TWICE=1,AMK_GEMV_LOADS_AHEAD={ahead},{xq}")
    run_xq_case(emu, name, [1, 3])


@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16])
@pytest.mark.parametrize("name", HALF_WEIGHT_CASES)
def test_gemv_half_weights(emu, name, dtype):
    run_both(emu, *cast_weights(*gemv_program(GEMV_CASES[name], seed=7), {"w", "w2"}, dtype), [(2, 0), (1, 1)])


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("splits,block", ATTN_SPLITS)
def test_attention_ops(emu, qk_norm, splits, block):
    prog, t = attention_program(heads=8, kv_heads=2, head_dim=32, splits=splits, block=block, qk_norm=qk_norm,
                                capacity=16, seed=splits)
    run_both(emu, prog, t, list(zip(ATTN_TOKENS, range(len(ATTN_TOKENS)))))


@pytest.mark.parametrize("score_hb", [4, 3, 1])
@pytest.mark.parametrize("head_dim,splits", [(32, 1), (64, 1), (64, 3), (128, 1)])
def test_attention_half_precision_kv(emu, monkeypatch, head_dim, splits, score_hb):
    """bf16 K/V caches, as lowered models have them: the score pass reads rows with 16-byte
    vectors, 4 of them a lane (instructions/attention.cuh, amk_attn_scores_wide), over splits
    of several passes (a random history of 200 rows in both VMs), scoring 4 heads a block (the
    float-weight builds), 3 (SmolLM2's 3 q heads a KV head: here a full block and a part-empty one)
    or one (the quantized builds: AMK_ATTN_SCORE_HB)."""
    defines = os.environ.get("AMK_VM_DEFINES", "")
    monkeypatch.setenv("AMK_VM_DEFINES", ",".join(filter(None, [defines, f"AMK_ATTN_SCORE_HB={score_hb}"])))
    cap, pos = 256, 200
    prog, t = attention_program(heads=8, kv_heads=2, head_dim=head_dim, splits=splits, block=16, capacity=cap,
                                seed=head_dim + splits)
    bf16 = [b.model_copy(update={"dtype": DType.BF16}) if b.kind == BufferKind.KV_CACHE else b for b in prog.buffers]
    prog = prog.model_copy(update={"buffers": bf16})
    ref, vm = ReferenceVM(prog, t), emu(prog, t)
    gen = torch.Generator().manual_seed(head_dim)
    for name in ("k_cache", "v_cache"):
        hist = torch.randn(cap, ref.read_buffer(name).numel() // cap, generator=gen).to(torch.bfloat16)
        ref.mem[ref._by_name[name].id].copy_(hist.reshape(-1).to(ref.mem[ref._by_name[name].id].dtype))
        vm.tensors[name].copy_(hist.reshape(-1))
    close(vm.run_step(5, pos)["out"], ref.run_step(5, pos)["out"], f"bf16 KV attention, head_dim {head_dim}")


# (head_dim, q heads a KV head, KV dtype, splits, position): the wide P.V pass (attention.cuh,
# amk_attn_pv_wide) at 8 warps takes 2048 / head_dim rows a round (512 | 256 | 128), so each
# case runs more than two rounds and a ragged last one; q heads 6 and 5 leave a head block
# part empty, 8 makes two full ones; head_dim 32 with 8 q heads caps the cached scores at 1024
# (vm/loader.py SCORE_CACHE_WORDS), so its split of 1201 rows takes two tiles
PV_CASES = [(32, 8, DType.BF16, 1, 1200), (64, 6, DType.BF16, 1, 600), (64, 8, DType.F16, 2, 1100),
            (128, 5, DType.BF16, 1, 300), (128, 4, DType.F16, 3, 700)]


@pytest.mark.parametrize("head_dim,q_heads,dtype,splits,pos", PV_CASES)
def test_attention_half_kv_pv_rounds(emu, head_dim, q_heads, dtype, splits, pos):
    """The P.V pass over half-precision V rows, checked on the unnormalised partial sums
    o_s = sum_j exp(t_j - m) v_j themselves: the K history is small, so every row's weight is
    near 1 and a row, a head block or a lane's dims left out (or summed with the wrong
    partner) is far outside the tolerance. Two runs of the step agree bit for bit (the
    reduction has a fixed order)."""
    cap, kv_heads = pos + 1, 2
    prog, t = attention_program(heads=q_heads * kv_heads, kv_heads=kv_heads, head_dim=head_dim, splits=splits,
                                block=16, capacity=cap, seed=head_dim + q_heads)
    prog = prog.model_copy(update={"buffers": [b.model_copy(update={"dtype": dtype}) if b.kind == BufferKind.KV_CACHE
                                               else b for b in prog.buffers]})
    # long splits take the emulator's threads seconds on a busy machine: a generous spin timeout
    ref, vm = ReferenceVM(prog, t), emu(prog, t, spin_timeout_s=60.0)
    gen = torch.Generator().manual_seed(head_dim * 7 + q_heads)
    for name, scale in (("k_cache", 0.05), ("v_cache", 1.0)):
        hist = (scale * torch.randn(cap, ref.read_buffer(name).numel() // cap, generator=gen)).to(TORCH[dtype])
        ref.mem[ref._by_name[name].id].copy_(hist.reshape(-1).to(ref.mem[ref._by_name[name].id].dtype))
        vm.tensors[name].copy_(hist.reshape(-1))
    what = f"{dtype.name} KV P.V, head_dim {head_dim}, {q_heads} q heads, {splits} splits"
    want = ref.run_step(5, pos)["out"]
    got = vm.run_step(5, pos)["out"]
    close(vm.read_buffer("o_part"), ref.read_buffer("o_part"), what + ": partial sums")
    close(vm.read_buffer("ml"), ref.read_buffer("ml"), what + ": (m, l)")
    close(got, want, what)
    again = vm.run_step(5, pos)["out"]
    assert torch.equal(got, again), what + ": a second run differs"


def test_silu_mul_and_add(emu):
    run_both(emu, *elementwise_program(), [(0, 0), (4, 0)])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model(emu, family):
    prog, t = tiny_model_program(hf_model(family), split_k=2 if family == "llama" else 1, splits=3, queues=3)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:4])])


@pytest.mark.parametrize("cfg", [{}, dict(quant="int4", quant_group=32, split_k=2),
                                 dict(fuse_norm=False, fuse_rope_append=False, fuse_residual=False,
                                      fuse_silu_mul=False, quant="int8"),
                                 dict(rope_multi_run=True, gemv_tasks_per_matrix=3),
                                 dict(kv_head_counters=True, gemv_tasks_per_matrix=3),
                                 dict(kv_head_counters=True, split_k=2),
                                 dict(fuse_attn_combine=True, gemv_tasks_per_matrix=3),
                                 dict(fuse_attn_combine=True, quant="int4", quant_group=32, fuse_residual=False),
                                 # the o-proj in K slices of KV heads, their sums read with x by the MLP
                                 dict(o_proj_kv_slices=2, gemv_tasks_per_matrix=3),
                                 dict(o_proj_kv_slices=1, quant="int8", quant_group=32, fuse_silu_mul=False),
                                 # the LM head's tasks write the argmax pairs: float, and a quantized head
                                 dict(fuse_argmax=True, gemv_tasks_per_matrix=3),
                                 dict(fuse_argmax=True, quant="int8", quant_group=32, quant_lm_head=True),
                                 # asymmetric int8 (a zero a group): the gate/up pair, then split-K partials
                                 # and standalone GEMVs with the quantized LM head
                                 dict(quant="int8", quant_group=32, quant_asym=True),
                                 dict(quant="int8", quant_group=64, quant_asym=True, split_k=2, fuse_silu_mul=False,
                                      quant_lm_head=True)])
def test_lowered_model(emu, cfg):
    prog, t = lowered("llama-gqa-tied", max_queues=4, threads_per_block=64, **cfg)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


LOADER_BUILD_CASES = {**{f"llama-gqa-tied/{name}": cfg for name, cfg in (
    ("int8_ahead", dict(quant="int8", gemv_loads_ahead=True)), ("int4_ahead", dict(quant="int4", gemv_loads_ahead=True)),
    ("bf16_ahead", dict(gemv_loads_ahead=True)),
    # an AMD target's build (64-lane wavefronts: the emulator built with AMK_WARP_SIZE=64)
    ("gfx942", dict(target="gfx942", threads_per_block=128)),
    ("gfx942_int4", dict(target="gfx942", threads_per_block=128, quant="int4", quant_group=32)))}, **LOWERED}


# each weight format in each rows loop, asymmetric int8, split-K, the o-proj's K slices and an AMD
# target at every commit; the other lowering cases (~50 s more on 2 cores) with `make test-all`, to
# keep CI in its time
LOADER_BUILD_EVERY_COMMIT = {"llama-gqa-tied", "llama-gqa-tied/int8", "llama-gqa-tied/int4", "llama-gqa-tied/int8_asym",
                             "llama-gqa-tied/split_k", "llama-gqa-tied/o_proj_kv_slices_int4",
                             "llama-gqa-tied/bf16_ahead", "llama-gqa-tied/int8_ahead", "llama-gqa-tied/int4_ahead",
                             "llama-gqa-tied/gfx942", "llama-gqa-tied/gfx942_int4"}


@pytest.mark.parametrize("case", [c if c in LOADER_BUILD_EVERY_COMMIT else pytest.param(c, marks=pytest.mark.slow)
                                  for c in LOADER_BUILD_CASES])
def test_loader_build_of_a_lowered_model(tmp_path, monkeypatch, case):
    """The build the loader compiles for a lowered bf16 model (loader.build_defines: the dtype masks and
    every specialization it adopted, e.g. amk_flat as one run, the wide passes only, the vector rows
    only, the score block, x packed for integer dots), not only the program's knobs as the `emu`
    fixture builds: the same results and caches as the ReferenceVM, for every lowering case (vm_cases
    LOWERED), the loads-ahead loop in each weight format and an AMD target's builds (no AMD GPU runs
    them anywhere else). The GPU suite runs the NVIDIA builds too, once or twice a session; this runs
    them at every commit."""
    from amk.vm.loader import build_defines

    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = lowered(case.split("/")[0], dtype="bfloat16",
                      **{"max_queues": 4, "threads_per_block": 64, **LOADER_BUILD_CASES[case]})
    warp = prog.target.warp_size
    defines = {**build_defines(prog, experiments={}), **({"AMK_WARP_SIZE": warp} if warp != 32 else {})}
    assert defines["AMK_FLAT_RUNS"] == 0
    run_both(lambda p, ts: EmuVM(p, ts, build(tmp_path, defines)), prog, t,
             [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


@pytest.mark.parametrize("defines,cfg", [
    ("AMK_GEMV_I8_XQ=1", dict(quant="int8", quant_group=32, fuse_argmax=True, quant_lm_head=True)),
    ("AMK_GEMV_I8_XQ=1", dict(quant="int8", quant_group=64, quant_asym=True, split_k=2, quant_lm_head=True)),
    ("AMK_GEMV_U4_XQ=1", dict(quant="int4", quant_group=32, quant_lm_head=True)),
    ("AMK_GEMV_U4_XQ=1,AMK_GEMV_LOADS_AHEAD=1", dict(quant="int4", quant_group=64, split_k=2)),
    ("AMK_GEMV_I8_XQ=1,AMK_GEMV_LOADS_AHEAD=1", dict(quant="int8", quant_group=32)),
    ("AMK_GEMV_U4_XQ=1,AMK_GEMV_LOADS_AHEAD=1", dict(quant="int4", quant_group=64, split_k=2, quant_lm_head=True))])
def test_lowered_model_xq(emu, monkeypatch, defines, cfg):
    """AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ in a lowered bf16 model: symmetric int8 with the quantized head
    writing the argmax pairs and in the loads-ahead loop, asymmetric int8 (its zero terms from x's
    float chunk sums, taken before x is packed) with split-K partials, and int4 (zeros always) in both
    rows loops, with and without its quantized head."""
    monkeypatch.setenv("AMK_VM_DEFINES", defines)
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", max_queues=4, threads_per_block=64, **cfg)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


@pytest.mark.parametrize("dtype,cfg", [("bfloat16", dict(kv_splits=2)), ("float32", dict(kv_splits=3)),
                                       ("bfloat16", dict(UNFUSED))])
def test_lowered_model_with_head_major_kv_caches(emu, dtype, cfg):
    """ScheduleConfig.kv_head_major (eval/PERF_NOTES.md item 221): each KV head's rows stored as one
    block. The same results and caches (read back as the IR's rows) as the ReferenceVM, through the
    wide passes (bf16), the split-layout ones (fp32) and the unfused ROPE / KV_APPEND writers; and the
    storage is head-major: a head's rows back to back."""
    prog, t = lowered("llama-gqa-tied", dtype=dtype, max_queues=4, threads_per_block=64, kv_head_major=True, **cfg)
    caches = [b for b in prog.buffers if b.kind == BufferKind.KV_CACHE]
    assert caches and program_kv_head(prog) == 64 and all(b.shape[1] == 128 for b in caches)
    steps = [(tok, pos) for pos, tok in enumerate(PROMPT[:3])]
    ref, vm = run_both(emu, prog, t, steps)
    for b in caches:
        stored = vm.tensors[b.name].view(2, b.shape[0], 64)[:, :3]  # [head, row, dim] of the rows written
        rows = ref.read_buffer(b.name).view(b.shape[0], 2, 64)[:3].transpose(0, 1)
        close(stored.contiguous(), rows.contiguous(), f"{b.name} stored head-major", b.dtype)


@pytest.mark.parametrize("case", ["gemv", "bf16", "int4"])
def test_amd_programs_on_64_lane_wavefronts(emu, case):
    """A program for an AMD target (gfx942: 64-lane wavefronts) on the emulator built with
    AMK_WARP_SIZE=64 (the `emu` fixture's build for its target) computes what the ReferenceVM does.
    In the GEMV-only program the GEMV has the largest shared-memory need, a word a lane of it: the
    loader once sized it for 32-lane warps, and the device refused the step (not enough shared
    memory)."""
    if case == "gemv":
        prog, t = gemv_program(GemvCase(rows=16, k=64))
        prog, steps = prog.model_copy(update={"target": get_target("gfx942")}), [(2, 0), (1, 1)]
    else:
        quant = dict(quant="int4", quant_group=32) if case == "int4" else {}
        prog, t = lowered("llama-gqa-tied", dtype="bfloat16", target="gfx942", max_queues=4, threads_per_block=128,
                          **quant)
        steps = [(tok, pos) for pos, tok in enumerate(PROMPT[:2])]
    assert prog.target.warp_size == 64
    run_both(emu, prog, t, steps)


@pytest.mark.parametrize("dtype,vec", [("bfloat16", 1), ("bfloat16", 0), ("float32", 0)])
def test_lowered_model_o_proj_kv_slices(emu, monkeypatch, dtype, vec):
    """o_proj_kv_slices: the gate/up prologue reads x with the o-proj's partial sums by 16-byte
    vectors (bf16 here; fp32 in test_lowered_model) or, with AMK_X_PARTS_VEC=0, by elements."""
    monkeypatch.setenv("AMK_VM_DEFINES", f"AMK_X_PARTS_VEC={vec}")
    prog, t = lowered("llama-gqa-tied", dtype=dtype, max_queues=4, threads_per_block=64, o_proj_kv_slices=2)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


@pytest.mark.parametrize("cfg", [dict(quant="int4"), dict(quant="int8"), dict(quant="int8", quant_asym=True)])
def test_lowered_half_precision_quantized_model(emu, cfg):
    """A bf16 program's quantized GEMVs read F16 scales and zeros, which knob_defines names
    (AMK_QCOMP_DTYPE = F16) so that the rows convert them without a run-time dtype test."""
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", max_queues=4, threads_per_block=64, quant_group=32, **cfg)
    assert knob_defines(prog)["AMK_QCOMP_DTYPE"] == int(DType.F16)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


@pytest.mark.parametrize("cfg", [dict(quant="int4"), dict(quant="int8", quant_asym=True)])
def test_companion_dtype_define_that_does_not_match_takes_the_scalar_path(emu, monkeypatch, cfg):
    """AMK_QCOMP_DTYPE names the one dtype of every scale and zero (knob_defines); a weight whose
    companions are of another dtype (here F32 scales under a BF16 define) takes the scalar path:
    the same results, only slower, never companions misread. (The build must compile BF16 then:
    the loader refuses a companion dtype it neither compiles nor finds, test_vm_loader.)"""
    monkeypatch.setenv("AMK_VM_DEFINES", f"AMK_QCOMP_DTYPE={int(DType.BF16)},AMK_DTYPES=63")
    prog, t = lowered("llama-gqa-tied", max_queues=4, threads_per_block=64, quant_group=32, **cfg)
    assert knob_defines(prog)["AMK_QCOMP_DTYPE"] == int(DType.F32)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_lowered_model_unpack_strategies(emu, quant):
    """Both ways of turning codes into floats (ScheduleConfig.quant_unpack: a build define)
    against the ReferenceVM; int8's sums are the same bit for bit either way, int4's are not (the
    byte-permute form takes 128 * sum(x) off at the end), which shows the define reached the build."""
    outs = {}
    for unpack in (1, 2):
        prog, t = lowered("llama-gqa-tied", max_queues=4, threads_per_block=64, quant=quant, quant_group=32,
                          quant_unpack=unpack)
        assert knob_defines(prog)["AMK_Q_UNPACK"] == unpack
        _, vm = run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])
        outs[unpack] = {name: vm.read_buffer(name) for name in ("logits", "x")}
    assert (quant == "int8") == all(torch.equal(outs[1][n], outs[2][n]) for n in outs[1])


@pytest.mark.parametrize("model,cfg", [("llama-gqa-tied", {}), ("qwen2-bias", dict(split_k=2)),
                                       ("qwen3-qknorm", dict(fuse_norm=False, fuse_silu_mul=False)),
                                       ("llama-gqa-tied", dict(dtype="bfloat16"))])
def test_lowered_model_specialized_build(tmp_path, model, cfg):
    """The build with only the program's dtypes, ops and epilogue features compiled in (what the
    CudaVM compiles: PackedProgram.defines), against the ReferenceVM: bias, head norm, split-K
    REDUCE and the unfused ops each reach a build that compiles them, and a bf16 program the
    build without the split-layout attention passes (AMK_ATTN_ONLY_WIDE); every one the build
    without the GEMV's scalar rows (AMK_GEMV_ONLY_VEC), and a loads-ahead one (as 'auto' makes
    these) the build without the rows' tail (AMK_GEMV_WHOLE_VECS)."""
    prog, t = lowered(model, max_queues=4, threads_per_block=64, **cfg)
    defines = PackedProgram(prog).defines
    assert defines["AMK_OPS"] != 0xFFF and defines["AMK_GEMV_ONLY_VEC"] == 1
    ahead = knob_defines(prog).get("AMK_GEMV_LOADS_AHEAD")
    assert defines.get("AMK_GEMV_WHOLE_VECS") == (1 if ahead else None)
    lib = build(tmp_path, {**defines, **knob_defines(prog)})
    run_both(lambda p, tt: EmuVM(p, tt, lib), prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


@pytest.mark.parametrize("left_out", ["AMK_OPS", "AMK_EPILOGUES"])
def test_build_without_a_feature_of_the_program_reports_it(tmp_path, left_out):
    """A task whose op or GEMV epilogue the build left out reports AMK_ERR_BAD_OP rather than
    doing nothing."""
    prog, t = lowered("llama-gqa-tied", max_queues=4, threads_per_block=64)
    defines = dict(PackedProgram(prog).defines)
    defines[left_out] &= ~{"AMK_OPS": 1 << int(Op.ATTN_COMBINE), "AMK_EPILOGUES": 1 << int(Epilogue.SILU_MUL)}[left_out]
    vm = EmuVM(prog, t, build(tmp_path, {**defines, **knob_defines(prog)}))
    with pytest.raises(VMError, match="bad op or epilogue code"):
        vm.run_step(PROMPT[0], 0)


def test_lowered_model_epilogue_operands_beyond_one_per_thread(emu):
    """One task per matrix on 64 threads: the q/k GEMVs' staged epilogue operands (bias,
    RoPE frequencies, position) and o/down's residuals outnumber the threads, so the prologue
    stages the rest after x (instructions/gemv.cuh)."""
    prog, t = lowered("qwen2-bias", max_queues=2, threads_per_block=64, gemv_tasks_per_matrix=1)
    assert max(epilogue_staged_words(x.params) for x in prog.tasks if x.op == Op.GEMV) > 64
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


def test_lowered_model_xcd_placement(emu):
    """A gfx942 program: XCD-scoped counters packed into the tables (the emulator, like a
    one-L2 GPU, runs XCD scope as device scope), on 64-lane wavefronts."""
    prog, t = lowered("llama-gqa-tied", max_queues=2, threads_per_block=64, target="gfx942")
    assert any(c.scope == Scope.XCD for c in prog.counters)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])


def test_epochs_across_steps(emu):
    prog, t = lm_head_program()
    vm = emu(prog, t)
    for i in range(20):
        vm.run_step(i % 40, 0)
    assert vm.epoch == 21
    run_both(lambda p, tt: vm, prog, t, [(9, 0)])


def test_hang_is_reported(emu):
    vm = emu(*hang_program(), spin_timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(VMHangError, match="spin timeout"):
        vm.run_step(0, 0)
    assert time.monotonic() - start < 5
    assert vm.epoch == 1  # reset after the failure


@pytest.mark.parametrize("early", [1, 2])
@pytest.mark.parametrize("threads", [64, 128])
def test_combine_early_gives_the_same_bits(tmp_path, monkeypatch, threads, early):
    """AMK_COMBINE_EARLY (eval/PERF_NOTES.md items 126, 131 and 256) changes when the combine loads its
    splits, not what it sums: a build with it gives the same bits as one without, step after
    step (1: a four-warp block's 128 threads hold the combine's 2 heads x 64 outputs, one a thread:
    the early loads; a two-warp block cannot, so it checks the fallback. 2: the splits copied into
    shared memory, two outputs a thread in the two-warp block; the emulator does the copies only at
    the wait, so a sum that read them before it would differ)."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", kv_capacity=16, max_queues=4, threads_per_block=threads,
                      kv_splits=2, kv_block=8)  # 16 steps: the second split has rows from position 8 on
    comb = [x.params for x in prog.tasks if x.op == Op.ATTN_COMBINE]
    assert comb and comb[0].splits == 2 and (comb[0].q_heads * comb[0].head_dim <= threads) == (threads == 128)
    assert_same_bits(prog, t, tmp_path, {**knob_defines(prog), "AMK_COMBINE_EARLY": 0}, {"AMK_COMBINE_EARLY": early},
                     PROMPT * 2, ["logits", "next_token"])


def assert_same_bits(prog, tensors, out, defines: dict, experiment: dict, tokens: list[int], outputs: list[str]):
    """The emulated builds with `defines` and with `experiment` on top, over the steps of `tokens`:
    each of `outputs` bit for bit the same, step after step."""
    base = EmuVM(prog, tensors, build(out, defines))
    exp = EmuVM(prog, tensors, build(out, {**defines, **experiment}))
    for pos, tok in enumerate(tokens):
        a, b = base.run_step(tok, pos), exp.run_step(tok, pos)
        for name in outputs:
            assert torch.equal(a[name], b[name]), f"step {pos} {name}"


@pytest.mark.parametrize("ahead", [0, 1])
def test_xq_xsums_give_the_same_bits(tmp_path, monkeypatch, ahead):
    """AMK_GEMV_XQ_XSUMS (eval/PERF_NOTES.md item 239, the default): where int4 rows pack x, the pack
    takes x's chunk sums too, in the prologue's order: the same bits as the prologue's sums
    (AMK_GEMV_XQ_XSUMS=0), step after step, in both rows loops (the model's int4 GEMVs take the
    vector rows)."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", max_queues=4, threads_per_block=64, quant="int4",
                      quant_group=32)
    defines = {**knob_defines(prog), "AMK_GEMV_U4_XQ": 1, "AMK_GEMV_LOADS_AHEAD": ahead, "AMK_GEMV_XQ_XSUMS": 0}
    assert_same_bits(prog, t, tmp_path, defines, {"AMK_GEMV_XQ_XSUMS": 1}, PROMPT, ["logits"])


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_companions_apart_give_the_same_bits(tmp_path, monkeypatch, quant):
    """The companions' dtype left out of AMK_DTYPES (eval/PERF_NOTES.md item 243, the loader's builds:
    the F16 scales of a bf16 model then compile no F16 copy of the ops' float loops; gemv.cuh
    amk_qcomp_apart): logits bit for bit those of the build that compiles F16 everywhere, as the
    loader's did until then, step after step."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", max_queues=4, threads_per_block=64, quant=quant,
                      quant_group=32)
    defines = {**knob_defines(prog), **PackedProgram(prog).defines}
    f16 = 1 << int(DType.F16)
    assert defines["AMK_QCOMP_DTYPE"] == int(DType.F16) and not defines["AMK_DTYPES"] & f16
    assert_same_bits(prog, t, tmp_path, {**defines, "AMK_DTYPES": defines["AMK_DTYPES"] | f16},
                     {"AMK_DTYPES": defines["AMK_DTYPES"]}, PROMPT, ["logits", "next_token"])


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("name", [name for name, case in GEMV_CASES.items() if case.quant == "u4"])
def test_gemv_xq_xsums(emu, tmp_path, monkeypatch, name, ahead):
    """AMK_GEMV_XQ_XSUMS over every int4 GEMV case, both loops: the fp32 outputs bit for bit those of
    the build whose prologue sums x (AMK_GEMV_XQ_XSUMS=0; the vector rows read the pack's sums, the
    scalar rows of u4_scalar_split read none), and within the bound test_gemv_xq holds."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = case_program(name)
    defines = {**knob_defines(prog), "AMK_GEMV_U4_XQ": 1, "AMK_GEMV_LOADS_AHEAD": ahead, "AMK_GEMV_XQ_XSUMS": 0}
    assert_same_bits(prog, t, tmp_path, defines, {"AMK_GEMV_XQ_XSUMS": 1}, [1, 3, 0], ["y"])
    monkeypatch.setenv("AMK_VM_DEFINES", f"AMK_GEMV_U4_XQ=1,AMK_GEMV_LOADS_AHEAD={ahead},AMK_GEMV_XQ_XSUMS=1")
    run_xq_case(emu, name, [1, 3, 0])


@pytest.mark.parametrize("ahead", [0, 1])
def test_typed_tail_gives_the_same_bits(tmp_path, monkeypatch, ahead):
    """AMK_GEMV_TAIL_TYPED (eval/PERF_NOTES.md item 245): a float tail read as the rows' dtype, not
    through amk_w_at: y bit for bit the same, in both rows loops (split_k_tail's first slice is 5
    vectors and a tail of 2 columns)."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = case_program("split_k_tail")
    defines = {**knob_defines(prog), "AMK_GEMV_LOADS_AHEAD": ahead, "AMK_GEMV_TAIL_TYPED": 0}
    assert_same_bits(prog, t, tmp_path, defines, {"AMK_GEMV_TAIL_TYPED": 1}, [1, 3, 0], ["y"])


def quantized_tail_program(quant: str, align: int):
    """A split-K GEMV whose K slices are 1.5 groups: the first a whole vector or two and half of one
    more, so its quantized rows have a tail (the validator refuses it: slices align to the group)."""
    group = 2 * align
    return gemv_program(GemvCase(rows=24, k=5 * group, quant=quant, group=group, split_k=2, split_align=align), seed=5)


@pytest.mark.parametrize("quant,align", [("i8", 8), ("u4", 16)])
def test_typed_tail_refuses_a_quantized_tail(emu, monkeypatch, quant, align):
    """With AMK_GEMV_Q_NO_TAIL the quantized rows have no tail: the validator aligns a quantized K
    slice to its group, which the vector rows require whole vectors of, so no program that runs has
    one; a program built past the validator with one gets "unsupported dtype", not a wrong sum."""
    from amk.schedule.validate import validate

    prog, t = quantized_tail_program(quant, align)
    assert "align to the group" in validate(prog).summary()
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_TAIL_TYPED=1,AMK_GEMV_Q_NO_TAIL=1")
    with pytest.raises(VMError, match="unsupported dtype"):
        emu(prog, t).run_step(2, 0)


@pytest.mark.parametrize("quant,align", [("i8", 8), ("u4", 16)])
def test_typed_float_tail_keeps_the_quantized_tail(tmp_path, monkeypatch, quant, align):
    """AMK_GEMV_Q_NO_TAIL=0 beside AMK_GEMV_TAIL_TYPED=1 (eval/PERF_NOTES.md items 254-255, the plain int4 build's):
    the float tail typed, the quantized rows' tail kept. A quantized tail (the program past the
    validator above) sums bit for bit as in the build before item 245 (AMK_GEMV_TAIL_TYPED=0)."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = quantized_tail_program(quant, align)
    defines = {**knob_defines(prog), "AMK_GEMV_TAIL_TYPED": 0}
    assert_same_bits(prog, t, tmp_path, defines, {"AMK_GEMV_TAIL_TYPED": 1, "AMK_GEMV_Q_NO_TAIL": 0}, [1, 3, 0], ["y"])


@pytest.mark.parametrize("case", ["llama-gqa-tied/split_k", "llama-gqa-tied/o_proj_kv_slices_int4"])
def test_flat_runs_off_gives_the_same_bits(tmp_path, monkeypatch, case):
    """AMK_FLAT_RUNS=0 (eval/PERF_NOTES.md items 249-250, the loader's build where a program allows it):
    the logits bit for bit those of the build with amk_flat's runs, over a prompt. These programs have
    operands of runs apart in roles of loader.RUN_ADDRESSED_ROLES (K slices of the GEMV weights, w and
    w2; int4 scales and zeros; split-K partials; o_proj_kv_slices' residual partials), which the kernel
    addresses run by run (runs that abut, as whole rows or the x partials here, read the same either
    way)."""
    from amk.vm.loader import flat_runs_needed

    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = lowered(case.split("/")[0], dtype="bfloat16", max_queues=4, threads_per_block=64, **LOWERED[case])
    assert not flat_runs_needed(prog) and any(o.count > 1 and o.stride != o.len for x in prog.tasks for o in x.inputs)
    assert_same_bits(prog, t, tmp_path, knob_defines(prog), {"AMK_FLAT_RUNS": 0}, PROMPT, ["logits"])


def test_flat_runs_off_misreads_runs_apart_read_flat(tmp_path, monkeypatch):
    """The refusal's reason (loader.flat_runs_needed): an ADD's input in two runs apart, read as one run
    by a build with AMK_FLAT_RUNS=0, gives another y."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    prog, t = runs_apart_program()
    with pytest.raises(AssertionError, match="y"):
        assert_same_bits(prog, t, tmp_path, knob_defines(prog), {"AMK_FLAT_RUNS": 0}, [0, 3], ["y"])


def build_macros(defines: dict, unforced: str = "") -> dict[str, str]:
    """The macros the kernel sources define for a build's -D set, from the preprocessor (the
    emulator's compiler): name -> its text. `unforced`: a macro the emulator's own flags set (e.g.
    AMK_ATTN_SCORE_HB, to run the multi-head paths) left to the sources unless `defines` sets it."""
    from emu_vm import EMU_DIR, emu_flags
    from amk.vm.build import source_dirs

    vm_dir, ins_dir = source_dirs()
    forced = f"-D{unforced}=" if unforced and unforced not in defines else None
    flags = [f for f in emu_flags(defines) if not f.startswith("-O") and not (forced and f.startswith(forced))]
    out = subprocess.run([compiler(), *flags, "-E", "-dM", f"-I{EMU_DIR}", f"-I{vm_dir}", f"-I{ins_dir}",
                          str(EMU_DIR / "emu_launch.cpp")], check=True, capture_output=True, text=True).stdout
    return dict(re.findall(r"^#define (AMK_\w+) (.*)$", out, re.M))


def build_defaults(name: str) -> dict:
    """Per loader build (and the every-dtype one), the integer value of macro `name` as its
    sources define it (one level of indirection resolved)."""
    from amk.vm.compile_check import SPECIALIZED

    def value(defines):
        macros = build_macros(defines, unforced=name)
        text = macros.get(name, "")
        text = macros.get(text, text)
        assert re.fullmatch(r"\d+", text), f"{name} is not an integer literal: {text!r}"
        return int(text)

    return {build: value(SPECIALIZED.get(build, {})) for build in ("generic", *SPECIALIZED)}


def test_combine_early_default_per_build(monkeypatch):
    """How the loader builds load the combine's splits by default (instructions/combine.cuh;
    eval/PERF_NOTES.md items 126, 131, 224 and 256): held in registers early (1) in float-weight builds
    and symmetric int8 builds of the plain GEMV loop; copied into shared memory early (2) in the int4
    builds and the symmetric int8 builds of the loads-ahead loop; after the weights (0) in the
    asymmetric int8 builds and the every-dtype build. Read from the preprocessor (the emulator's compiler, the
    compile checks' build defines), so the GPU's same-bits tests compare builds that have them."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    assert build_defaults("AMK_COMBINE_EARLY") == {
        "generic": 0, "bf16": 1, "int8": 1, "int4": 2, "int8_asym": 0, "bf16_ahead": 1, "int8_ahead": 2,
        "int4_ahead": 2, "bf16_oslices": 1, "bf16_fargmax": 1}


def test_score_head_block_default_per_build(monkeypatch):
    """Heads the wide score pass scores together by default (instructions/attention.cuh;
    eval/PERF_NOTES.md items 85, 224, 230, 244 and 246): 4 in float-weight builds, 2 in symmetric int8
    and int4 builds of the loads-ahead loop, 3 in those of the plain loop, 1 in asymmetric int8 builds
    and the every-dtype build."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    assert build_defaults("AMK_ATTN_SCORE_HB") == {
        "generic": 1, "bf16": 4, "int8": 3, "int4": 3, "int8_asym": 1, "bf16_ahead": 4, "int8_ahead": 2,
        "int4_ahead": 2, "bf16_oslices": 4, "bf16_fargmax": 4}


def test_typed_tail_default_per_build(monkeypatch):
    """Every build reads a float rows tail as its dtype (instructions/gemv.cuh AMK_GEMV_TAIL_TYPED;
    eval/PERF_NOTES.md items 245, 255), and all but the int4 builds of the plain loop compile quantized
    rows without a tail (AMK_GEMV_Q_NO_TAIL; the every-dtype build has int4 and the plain loop)."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    builds = ["generic", "bf16", "int8", "int4", "int8_asym", "bf16_ahead", "int8_ahead", "int4_ahead",
              "bf16_oslices", "bf16_fargmax"]
    assert build_defaults("AMK_GEMV_TAIL_TYPED") == dict.fromkeys(builds, 1)
    assert build_defaults("AMK_GEMV_Q_NO_TAIL") == {b: 0 if b in ("generic", "int4") else 1 for b in builds}


def test_gpu_same_bits_cases_change_their_builds(monkeypatch):
    """Every define of the GPU's test_same_bits_defines changes the default of the weight format it is
    paired with (the loader's build of it, compile_check.SPECIALIZED): a pair of one build twice could
    not fail (session 67 found int4 and int8_ahead pairs of that kind and dropped them)."""
    from test_vm_gpu import SAME_BITS_CASES

    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    build_of = {None: "bf16", "int8": "int8", "int8_ahead": "int8_ahead", "int4_ahead": "int4_ahead"}
    for quant, define in SAME_BITS_CASES:
        name, value = define.split("=")
        assert build_defaults(name)[build_of[quant]] != int(value), (quant, define)


def test_attention_row_hints_off_by_default(monkeypatch):
    """The attention partials' wait-time K/V row hints are off unless a build asks for them
    (vm/megakernel.cu AMK_PREFETCH_ATTN_ROWS; eval/PERF_NOTES.md item 234: on, they cost the 1B 1.0 %)."""
    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    assert build_macros({})["AMK_PREFETCH_ATTN_ROWS"] == "0"
    assert build_macros({"AMK_PREFETCH_ATTN_ROWS": 1})["AMK_PREFETCH_ATTN_ROWS"] == "1"


def run_where_the_mirror_says(emu, name: str, needs) -> tuple:
    """GEMV case `name` in the build $AMK_VM_DEFINES names, which leaves a path out: the device
    reports "unsupported dtype" where `needs(task, by_id, qcomp)` (a loader mirror) says a GEMV
    task needs that path, and computes the ReferenceVM's results where none does. Returns the
    program and the per-task flags."""
    prog, t = gemv_program(GEMV_CASES[name], seed=3)
    qcomp = knob_defines(prog).get("AMK_QCOMP_DTYPE", -1)
    by_id = {b.id: b for b in prog.buffers}
    flags = [needs(task, by_id, qcomp) for task in prog.tasks if task.params.op == Op.GEMV]
    if any(flags):
        with pytest.raises(VMError, match="unsupported dtype"):
            emu(prog, t).run_step(2, 0)
    else:
        run_both(emu, prog, t, [(2, 0), (1, 1)])
    return prog, flags


@pytest.mark.parametrize("name", ["store", "store_odd_scalar", "split_k_tail", "i8_scalar", "i8_vec",
                                  "u4_scalar_split", "u4_vec_split", "i8_g64_split"])
def test_gemv_vec_rows_is_the_devices_test(emu, monkeypatch, name):
    """loader.gemv_vec_rows says which GEMV tasks take the scalar rows as the device decides it:
    a build without them (AMK_GEMV_ONLY_VEC) computes the case where every task streams vectors
    and reports the error where one does not."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_ONLY_VEC=1")
    prog, scalar = run_where_the_mirror_says(emu, name, lambda task, by_id, qcomp: not gemv_vec_rows(task, by_id, qcomp))
    # the loader's build leaves the scalar rows out exactly then: with the device's test pinned
    # to the mirror above, no program the loader builds reaches the error
    assert PackedProgram(prog).defines.get("AMK_GEMV_ONLY_VEC") == (None if any(scalar) else 1)
    # (the cases named so, and split_k_tail's unaligned second slice, take them)
    assert ("scalar" in name or name == "split_k_tail") == any(scalar)


@pytest.mark.parametrize("name", ["store", "split_k_tail", "store_odd_scalar", "u4_vec_split"])
def test_gemv_whole_vecs_is_the_devices_test(emu, monkeypatch, name):
    """AMK_GEMV_WHOLE_VECS (eval/PERF_NOTES.md items 207, 211; the loader sets it for float and
    symmetric int8 loads-ahead builds) leaves out the vector rows' tail past their whole vectors: a program
    computes where loader.gemv_whole_vecs holds for every vector-row task (scalar-row tasks need no
    tail: store_odd_scalar), and reports the error where one has a tail (split_k_tail's first
    slice: 5 float vectors and 2 columns)."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_WHOLE_VECS=1")
    _, tail = run_where_the_mirror_says(
        emu, name, lambda task, by_id, qcomp: gemv_vec_rows(task, by_id, qcomp) and not gemv_whole_vecs(task, by_id))
    assert any(tail) == (name == "split_k_tail")


def test_build_without_the_scalar_rows(emu, monkeypatch):
    """AMK_GEMV_ONLY_VEC (experiment, eval/PERF_NOTES.md item 203) leaves the GEMV's scalar rows
    out: the same results where every GEMV streams vectors (a bf16 model), and an error, not a
    wrong answer, where one would need them (int8 scales of another dtype than the build reads)."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_GEMV_ONLY_VEC=1")
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", max_queues=4, threads_per_block=64)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:2])])
    monkeypatch.setenv("AMK_VM_DEFINES", f"AMK_GEMV_ONLY_VEC=1,AMK_QCOMP_DTYPE={int(DType.BF16)}")
    prog, t = lowered("llama-gqa-tied", max_queues=4, threads_per_block=64, quant="int8", quant_group=32)
    with pytest.raises(VMError, match="unsupported dtype"):
        emu(prog, t).run_step(PROMPT[0], 0)


def test_build_with_one_score_tile(emu, monkeypatch):
    """AMK_ATTN_ONE_TILE (experiment, eval/PERF_NOTES.md item 205) leaves out the later tiles'
    second score pass: the same results where every split fits its cached scores (a lowered bf16
    model), and an error, not a wrong answer, for a split of 1201 rows over 1024 cached scores
    (PV_CASES' two-tile case, which computes without the define there)."""
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_ATTN_ONE_TILE=1")
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", max_queues=4, threads_per_block=64)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:3])])
    prog, t = attention_program(heads=16, kv_heads=2, head_dim=32, splits=1, block=16, capacity=1201, seed=1)
    prog = prog.model_copy(update={"buffers": [b.model_copy(update={"dtype": DType.BF16})
                                               if b.kind == BufferKind.KV_CACHE else b for b in prog.buffers]})
    with pytest.raises(VMError, match="params inconsistent with operands"):
        emu(prog, t, spin_timeout_s=60.0).run_step(5, 1200)


def test_builds_without_the_never_run_paths(emu, monkeypatch):
    """AMK_ATTN_ONLY_WIDE and AMK_COMBINE_ONLY_HELD (experiments, eval/PERF_NOTES.md items 198-199)
    leave out the attention passes and the combine path that a bf16 Llama never runs: the same
    results where every partial's rows are wide and every combine holds its splits (a four-warp
    block, 2 heads x 64 outputs), and an error, not a wrong answer, where a partial's rows are
    fp32."""
    # (the emulator compiles every weight dtype, which leaves AMK_COMBINE_EARLY off unless asked)
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_ATTN_ONLY_WIDE=1,AMK_COMBINE_ONLY_HELD=1,AMK_COMBINE_EARLY=1")
    shape = dict(kv_capacity=16, max_queues=4, threads_per_block=128, kv_splits=2, kv_block=8)
    prog, t = lowered("llama-gqa-tied", dtype="bfloat16", **shape)
    run_both(emu, prog, t, [(tok, pos) for pos, tok in enumerate(PROMPT[:3])])
    prog, t = lowered("llama-gqa-tied", **shape)
    with pytest.raises(VMError, match="unsupported dtype"):
        emu(prog, t).run_step(PROMPT[0], 0)
