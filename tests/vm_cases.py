"""Programs and comparisons shared by the megakernel tests: on the GPU (test_vm_gpu.py)
and under host emulation (test_vm_emulated.py), each VM is run against the ReferenceVM.

`run_both(make_vm, prog, tensors, steps)` runs (token, pos) steps on both VMs with
activations, scratch and outputs poisoned (NaN / a sentinel) before every step, and
compares every IO output and every KV cache: fp32 within 1e-4 (summation order is the only
freedom), half precision within one rounding step.
"""

from __future__ import annotations

import zlib

import torch

from amk.instructions.semantics import unpack_u4
from amk.schedule.ir import AddParams, BufferKind, DType, Epilogue
from amk.vm.reference import ReferenceVM
from programs import Builder, GemvCase, gemv_program, lm_head_program, opd, with_threshold

K = BufferKind
TORCH = {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16}


def close(got: torch.Tensor, want: torch.Tensor, what: str, dtype: DType = DType.F32) -> None:
    got = got.detach().cpu()
    if not want.is_floating_point():
        assert torch.equal(got, want), f"{what}: {got.tolist()} != {want.tolist()}"
        return
    tol = 1e-4 if dtype == DType.F32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def close_within(got: torch.Tensor, want: torch.Tensor, extra: torch.Tensor, what: str) -> None:
    """fp32 outputs within close()'s bound widened by `extra` per element (a documented freedom
    beyond the summation order, e.g. xq_bound)."""
    got, want = got.detach().cpu().double(), want.double()
    excess = (got - want).abs() - (1e-4 + 1e-4 * want.abs() + extra.double())
    assert not torch.isnan(got).any() and (excess <= 0).all(), (
        f"{what}: {int((excess > 0).sum())} elements beyond the bound, the worst by {float(excess.max()):.3g}")


def run_both(make_vm, prog, tensors, steps, *, kv_check: bool = True, y_extra=None):
    """Run (token, pos) steps on the ReferenceVM and on make_vm(prog, tensors); compare.
    y_extra(token): a widening of output y's bound (close_within), or None for close()'s."""
    ref = ReferenceVM(prog, tensors)
    vm = make_vm(prog, tensors)
    dtypes = {b.name: b.dtype for b in prog.buffers}
    for token, pos in steps:
        want = ref.run_step(token, pos)
        got = vm.run_step(token, pos)
        assert set(got) == set(want)
        for name in want:
            what = f"{prog.name} step ({token}, {pos}) output {name}"
            extra = y_extra(token) if y_extra is not None and name == "y" else None
            if extra is not None:
                close_within(got[name], want[name], extra, what)
            else:
                close(got[name], want[name], what, dtypes[name])
        if kv_check:
            for b in prog.buffers:
                if b.kind == K.KV_CACHE:
                    close(vm.read_buffer(b.name), ref.read_buffer(b.name), f"{prog.name} pos {pos} {b.name}", b.dtype)
    return ref, vm


def cast_weights(prog, tensors, names, dtype: DType):
    """The same program with the named WEIGHT buffers stored in `dtype` (e.g. bf16 GEMVs)."""
    bufs = [b.model_copy(update={"dtype": dtype}) if b.name in names else b for b in prog.buffers]
    new = {n: (t.to(TORCH[dtype]) if n in names else t) for n, t in tensors.items()}
    return prog.model_copy(update={"buffers": bufs}), new


GEMV_CASES = {
    "store": GemvCase(rows=40, k=64, slabs=3),
    "store_odd_scalar": GemvCase(rows=13, k=37, slabs=2),  # rows not 16-byte aligned: scalar path
    "norm_bias": GemvCase(rows=48, k=128, norm_eps=1e-5, bias=True),
    "add_in_place": GemvCase(rows=64, k=96, epilogue=Epilogue.ADD, bias=True),
    "silu_mul": GemvCase(rows=32, k=64, epilogue=Epilogue.SILU_MUL, norm_eps=1e-6),
    "rope_head_norm": GemvCase(rows=64, k=64, epilogue=Epilogue.ROPE, head_dim=16, head_norm_eps=1e-6, bias=True),
    "rope_append": GemvCase(rows=32, k=64, epilogue=Epilogue.ROPE_APPEND, head_dim=16, norm_eps=1e-5),
    "append": GemvCase(rows=24, k=64, epilogue=Epilogue.APPEND, bias=True),
    "split_k_add": GemvCase(rows=40, k=96, split_k=3, epilogue=Epilogue.ADD, norm_eps=1e-5),
    "split_k_silu": GemvCase(rows=32, k=64, split_k=2, epilogue=Epilogue.SILU_MUL),
    "split_k_rope": GemvCase(rows=32, k=64, split_k=2, epilogue=Epilogue.ROPE_APPEND, head_dim=16,
                             head_norm_eps=1e-6, bias=True),
    # first slice [0, 22): 5 float vectors and a tail of 2 columns (the vector rows' tail path);
    # second [22, 44): unaligned, the scalar rows
    "split_k_tail": GemvCase(rows=16, k=44, split_k=2),
    "i8_scalar": GemvCase(rows=24, k=64, quant="i8", group=8),
    "i8_vec": GemvCase(rows=24, k=128, quant="i8", group=32, norm_eps=1e-5),
    "u4_vec": GemvCase(rows=24, k=128, quant="u4", group=32, epilogue=Epilogue.SILU_MUL),
    "u4_scalar_split": GemvCase(rows=24, k=64, quant="u4", group=8, split_k=2, epilogue=Epilogue.ADD),
    "u4_vec_split": GemvCase(rows=24, k=256, quant="u4", group=64, split_k=2),
    "bf16_out": GemvCase(rows=40, k=64, out_dtype=DType.BF16, epilogue=Epilogue.ADD),
    "f16_out_rope": GemvCase(rows=32, k=64, epilogue=Epilogue.ROPE_APPEND, head_dim=16, out_dtype=DType.F16),
    "long_k": GemvCase(rows=64, k=2048, slabs=2, norm_eps=1e-5),
    # rows long enough for 8-16 lanes a row: every rotation of a lane's x chunks (vec.cuh AmkXRot)
    "i8_long_k": GemvCase(rows=16, k=2048, quant="i8", group=128, epilogue=Epilogue.SILU_MUL, norm_eps=1e-5),
    "u4_long_k": GemvCase(rows=16, k=2048, quant="u4", group=64),
    # a row longer than one round of a lane group's loads (32 lanes x 8 vectors: 512 int8 > 256)
    "i8_two_rounds": GemvCase(rows=8, k=8192, quant="i8", group=128),
    # a warp's rounds across several rows, one round a row and several (the pipelined loop's
    # row ends: gemv.cuh amk_gemv_rows_pipe)
    "many_rows": GemvCase(rows=300, k=256),
    # long rows left over after whole rounds of the 8 warps (13 = 8 + 5, 11 = 8 + 3; eval/PERF_NOTES.md
    # items 101-102: the rows phase is the busiest warp's)
    "tail_rows_pair": GemvCase(rows=13, k=4096, epilogue=Epilogue.SILU_MUL, norm_eps=1e-5),
    "tail_rows_add": GemvCase(rows=11, k=4096, epilogue=Epilogue.ADD, bias=True),
    "i8_pair_rows_rounds": GemvCase(rows=40, k=8192, quant="i8", group=128, epilogue=Epilogue.SILU_MUL),
    "u4_many_rows": GemvCase(rows=200, k=1024, quant="u4", group=64, epilogue=Epilogue.ADD),
    # groups of 64 (one a tensor-core pass, AMK_GEMV_I8_MMA) over split-K slices, rows not a multiple of 16
    "i8_g64_split": GemvCase(rows=40, k=512, quant="i8", group=64, split_k=2, epilogue=Epilogue.ADD, norm_eps=1e-5),
    # x far beyond a half's 65504 (activations of a few 1e5 in some layers)
    "i8_large_x": GemvCase(rows=32, k=256, quant="i8", group=128, x_scale=3e5),
    # int4 in groups of 128 (one a tensor-core pass, AMK_GEMV_U4_MMA): the gate/up pair, split-K slices
    "u4_g128_pair": GemvCase(rows=40, k=512, quant="u4", group=128, epilogue=Epilogue.SILU_MUL, norm_eps=1e-5),
    "u4_g128_split": GemvCase(rows=24, k=1024, quant="u4", group=128, split_k=2, epilogue=Epilogue.ADD),
    # rows many and K short: the MMA rows' slices would need more scratch than x's words (gemv.cuh
    # amk_mma_deal), so a tile takes its whole K
    "i8_g64_short_k": GemvCase(rows=64, k=128, quant="i8", group=64, epilogue=Epilogue.SILU_MUL),
    # the vector rows' group mapping (gemv.cuh amk_group_of): a slice inside one group of a
    # power-of-two number of vectors (shifts), inside one group of 3 vectors (a division: per-channel
    # scales of any width), and two groups of 3 vectors (not vectorizable: the scalar path)
    "i8_one_group": GemvCase(rows=24, k=64, quant="i8", group=64),
    "i8_one_group_of_3": GemvCase(rows=24, k=48, quant="i8", group=48, epilogue=Epilogue.ADD),
    "u4_groups_of_3": GemvCase(rows=16, k=192, quant="u4", group=96, epilogue=Epilogue.SILU_MUL),
    # per-channel int8 scales over 4 whole vectors and a tail of 8 columns: vector rows with a tail
    # (AMK_GEMV_I8_XQ sends it to the scalar rows and leaves x as floats)
    "i8_channel_tail": GemvCase(rows=16, k=72, quant="i8", group=72, norm_eps=1e-5),
}
# the cases whose quantized rows AMK_GEMV_I8_MMA / AMK_GEMV_U4_MMA take (a pass of 4 vectors inside
# one group: int8 groups of 64 or more, int4 of 128 or more; K a multiple of the pass)
Q_MMA_CASES = ["i8_long_k", "i8_two_rounds", "i8_pair_rows_rounds", "i8_g64_split", "i8_large_x", "u4_g128_pair",
               "u4_g128_split", "i8_g64_short_k"]
Q_MMA_DEFINES = "AMK_GEMV_I8_MMA=1,AMK_GEMV_U4_MMA=1"


def xq_bound(case: GemvCase, tensors: dict, token: int):
    """How far AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ's packed x may move each output of a quantized GEMV case
    whose outputs are its dots (STORE or ADD, unquantized bias): sum_j |s_g(j) c_rj| m(j) 2^-22, c the
    codes, s their group's scale and m(j) the largest |x| of column j's slice (16 columns for int8, 32
    for int4; instructions/vec.cuh amk_xq_pack moves x by m / 2^24; 4x that for the roundings of its
    step). An int4 zero's term is summed from float x, untouched. None for the other epilogues, for
    K not in whole slices and for half-precision outputs, which keep close()'s bound."""
    cols = {"i8": 16, "u4": 32}[case.quant]
    if case.epilogue not in (Epilogue.STORE, Epilogue.ADD) or case.k % cols or case.out_dtype != DType.F32:
        return None
    x = tensors["x_table"][token].double()
    if case.norm_eps is not None:
        x = x * torch.rsqrt((x * x).mean() + case.norm_eps) * tensors["gamma"].double()
    m = x.abs().view(-1, cols).amax(1).repeat_interleave(cols)
    codes = tensors["w"] if case.quant == "i8" else unpack_u4(tensors["w"], case.rows * case.k).view(case.rows, case.k)
    w = codes.double() * tensors["w.scale"].double().repeat_interleave(case.group, 1)
    return (w.abs() * m).sum(1) * 2.0 ** -22


def case_program(name: str):
    """GEMV_CASES[name]'s program and tensors, seeded by the name (the same every run)."""
    return gemv_program(GEMV_CASES[name], seed=zlib.crc32(name.encode()) % 1000)


def run_xq_case(make_vm, name: str, tokens: list[int]) -> None:
    """GEMV case `name` on make_vm and the ReferenceVM, output y within close()'s bound widened by
    xq_bound where it applies (the emulated and the GPU AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ tests)."""
    case = GEMV_CASES[name]
    prog, t = case_program(name)
    run_both(make_vm, prog, t, [(tok, pos) for pos, tok in enumerate(tokens)],
             y_extra=lambda token: xq_bound(case, t, token))


# every quantized case, for AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ (x packed as fixed point where the
# quantized rows are whole vectors), each in both rows loops: the plain one and the loads-ahead one
XQ_CASES = [(name, f"AMK_GEMV_{case.quant.upper()}_XQ=1{ahead}") for name, case in GEMV_CASES.items()
            if case.quant for ahead in ("", ",AMK_GEMV_LOADS_AHEAD=1")]

HALF_WEIGHT_CASES = ["store", "silu_mul", "split_k_tail", "long_k", "rope_head_norm"]

# ARGMAX's ties and NaNs (torch.argmax: the first maximal index; NaN is maximal): rows of the
# tied table that make equal largest logits (or NaN ones) far apart, so that different
# threads see them, and pairs that one thread sees in one round of loads (with 256 threads
# and 4-float vectors, 37 and 2085 are thread 9's vectors 0 and 2; 901 and 1925 are thread
# 225's 0 and 1). Token 5's row is the direction.
ARGMAX_TOKEN = 5
ARGMAX_CASES = {"ties": ([2999, 1234, 2085, 37, 600, 2597], None), "nan": ([2999, 37], [1925, 901])}


def argmax_program(case: str, slices: int = 1):
    """The case's table; `slices` > 1: PARTIAL argmaxes over that many slices (4: the tied and
    NaN rows fall in different slices, and 37 and 600 in one; 300: slices of 10, so the MERGE's
    thread 3 holds pairs 3 and 259, both tied: 37 and 2597) and their MERGE; 0: the LM head's 7
    GEMV slabs write the pairs (fuse_argmax; ties in slabs 0, 1, 2, 4 and two in 6: 2597 and 2999;
    the NaNs 901 and 1925 in slabs 2 and 4)."""
    prog, t = lm_head_program(vocab=3000, hidden=32, tiles=2, slabs=7, argmax_slices=max(slices, 1),
                              head_pairs=slices == 0)
    table = t["embed"].clone()
    ties, nans = ARGMAX_CASES[case]
    table[ties] = 10 * table[ARGMAX_TOKEN]
    if nans:
        table[nans] = float("nan")
    return prog, {**t, "embed": table}
ATTN_SPLITS = [(1, 1), (3, 2), (5, 1)]
ATTN_TOKENS = [3, 1, 4, 1, 5, 7, 2, 6, 0]


def elementwise_program():
    """EMBED g/u/r, SILU_MUL tiles, ADD tiles into a bf16 output."""
    from amk.schedule.ir import EmbedParams, SiluMulParams

    n, vocab = 300, 5
    b = Builder("elementwise", queues=3)
    tok = b.buf("token", K.IO_INPUT, [1], DType.I32)
    tables = {m: b.buf(f"{m}_table", K.WEIGHT, [vocab, n]) for m in ("g", "u", "r")}
    vals = {m: b.buf(m, K.ACTIVATION, [n]) for m in ("g", "u", "r")}
    act = b.buf("act", K.ACTIVATION, [n])
    y = b.buf("y", K.IO_OUTPUT, [n], DType.BF16)
    e, s, a = b.stage("embed"), b.stage("silu"), b.stage("add")
    for m in ("g", "u", "r"):
        b.task(EmbedParams(vocab=vocab, hidden=n), [opd(tok), opd(tables[m], 0, n, vocab, n)], [opd(vals[m])], stage=e)
    tiles = ((0, 128), (128, 300))
    for lo, hi in tiles:  # a stage's tasks are all built before anyone waits on it
        b.task(SiluMulParams(n=hi - lo), [opd(vals["g"], lo, hi - lo), opd(vals["u"], lo, hi - lo)],
               [opd(act, lo, hi - lo)], stage=s, after=[e])
    for lo, hi in tiles:
        b.task(AddParams(n=hi - lo), [opd(act, lo, hi - lo), opd(vals["r"], lo, hi - lo)], [opd(y, lo, hi - lo)],
               stage=a, after=[s, e])
    gen = torch.Generator().manual_seed(1)
    return b.build(), {f"{m}_table": 3 * torch.randn(vocab, n, generator=gen) for m in ("g", "u", "r")}


def runs_apart_program():
    """elementwise_program with its first ADD tile reading r in two runs apart, r[0:64] and r[150:214]
    (an operand the kernel reads through amk_flat: what loader.flat_runs_needed looks for)."""
    from amk.schedule.ir import Op

    prog, tensors = elementwise_program()
    tasks = list(prog.tasks)
    i = next(i for i, t in enumerate(tasks) if t.params.op == Op.ADD and t.inputs[1].off == 0)
    r = tasks[i].inputs[1].model_copy(update=dict(len=64, count=2, stride=150))
    tasks[i] = tasks[i].model_copy(update=dict(inputs=[tasks[i].inputs[0], r]))
    return prog.model_copy(update=dict(tasks=tasks)), tensors


def hang_program():
    """x = a + b, then y = x + b where `second` waits for 2 signals of a counter that only
    one task signals: it can never run (the validator rejects this program)."""
    b = Builder("hang", queues=2)
    a_, b_ = b.buf("a", K.CONST, [4]), b.buf("b", K.CONST, [4])
    x, y = b.buf("x", K.ACTIVATION, [4]), b.buf("y", K.IO_OUTPUT, [4])
    s1, s2 = b.stage("first"), b.stage("second")
    b.task(AddParams(n=4), [opd(a_), opd(b_)], [opd(x)], stage=s1, queue=0, name="first")
    t2 = b.task(AddParams(n=4), [opd(x), opd(b_)], [opd(y)], stage=s2, after=[s1], queue=1, name="second")
    return with_threshold(b.build(), t2.id, 2), {"a": torch.arange(4.0), "b": torch.ones(4)}


def hf_model(family: str):
    """A tiny random HF model (biases and norm weights perturbed so they matter)."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    cfg = {"llama": lambda: tf.LlamaConfig(**common),
           "qwen2": lambda: tf.Qwen2Config(**common),
           "qwen3": lambda: tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)}[family]()
    torch.manual_seed(0)
    model = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[family](cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def lowered(model: str, dtype: str = "float32", kv_capacity: int = 64, target: str = "h100", **cfg):
    """A zoo model with random weights through the real lowering (for `target`), and its bound tensors."""
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.importer import random_state_dict, spec_from_hf_config, zoo_configs
    from amk.schedule.importer.hf_config import normalize
    from amk.schedule.lower import bind_weights, lower
    from amk.schedule.targets import get_target

    hf = normalize(zoo_configs()[model])
    spec = spec_from_hf_config(hf, name=model, dtype=dtype)
    prog = lower(spec, ScheduleConfig(**cfg), get_target(target), kv_capacity=kv_capacity)
    return prog, bind_weights(prog, spec, random_state_dict(hf, seed=0))


UNFUSED = dict(fuse_norm=False, fuse_rope_append=False, fuse_residual=False, fuse_silu_mul=False)
LOWERED = {
    "llama-gqa-tied": {},
    "llama-gqa-tied/split_k": dict(split_k=2),
    "llama-gqa-tied/unfused": UNFUSED,
    "llama-gqa-tied/int8": dict(quant="int8", quant_lm_head=True),
    "llama-gqa-tied/int4": dict(quant="int4", quant_group=32),
    "llama-gqa-tied/int8_asym": dict(quant="int8", quant_group=32, quant_asym=True, quant_lm_head=True),
    "llama-gqa-tied/int8_asym_split_k": dict(quant="int8", quant_group=64, quant_asym=True, split_k=2),
    "smollm2-like": dict(kv_splits=4),
    "qwen2-bias": dict(split_k=2),
    "qwen3-qknorm": {},
    "llama-hd128": dict(threads_per_block=512, prefetch_depth=2),
    "llama-mqa/rr": dict(sm_assignment="round_robin", gemv_tasks_per_matrix=7),
    # q/k tasks of several RoPE runs across heads, each run its own frequencies (PERF_NOTES item 113)
    "llama-gqa-tied/rope_multi_run": dict(rope_multi_run=True, gemv_tasks_per_matrix=3),
    # a counter per KV head for q/k/v and the attention partials (PERF_NOTES item 116)
    "llama-gqa-tied/kv_head_counters": dict(kv_head_counters=True, gemv_tasks_per_matrix=3),
    # the attention combine in every o-proj task's prologue (PERF_NOTES item 122)
    "llama-gqa-tied/fuse_attn_combine": dict(fuse_attn_combine=True, gemv_tasks_per_matrix=3),
    "smollm2-like/fuse_attn_combine": dict(kv_splits=4, fuse_attn_combine=True),
    # the o-proj in K slices of KV heads, their sums read by the MLP (PERF_NOTES item 135)
    "llama-gqa-tied/o_proj_kv_slices": dict(o_proj_kv_slices=2, gemv_tasks_per_matrix=3),
    "smollm2-like/o_proj_kv_slices": dict(kv_splits=4, o_proj_kv_slices=3),
    "llama-gqa-tied/o_proj_kv_slices_int4": dict(o_proj_kv_slices=2, quant="int4", quant_group=32),
    # the LM head's tasks write the argmax pairs, merged without a PARTIAL stage (PERF_NOTES item 195)
    "llama-gqa-tied/fuse_argmax": dict(fuse_argmax=True, gemv_tasks_per_matrix=3),
    "smollm2-like/fuse_argmax_int8": dict(kv_splits=4, fuse_argmax=True, quant="int8", quant_lm_head=True),
    # each KV head's rows stored as one block (PERF_NOTES item 221)
    "llama-gqa-tied/kv_head_major": dict(kv_head_major=True, kv_splits=2),
    "smollm2-like/kv_head_major_unfused": dict(kv_splits=4, kv_head_major=True, **UNFUSED),
}
PROMPT = [1, 17, 42, 5, 9, 88, 3, 60]
