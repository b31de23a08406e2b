"""CudaVM: an accepted Program packed into device tables and run as one cooperative launch
per decode step.

    vm = CudaVM(program, tensors)              # tensors: WEIGHT/CONST contents by buffer name
    out = vm.run_step(token, pos)              # {IO_OUTPUT name: tensor}, like ReferenceVM
    ids = vm.generate(prompt_ids, 16)          # greedy, one launch per token, argmax on device

It speaks the ReferenceVM's interface (run_step / step, generate, logits_for, reset,
read_buffer), so callers can swap one for the other.

Packing happens once: the task records, queues and buffer table (vm/tables.h layouts) are
uploaded at construction; weights, KV caches and activations stay resident as torch
tensors whose addresses the buffer table holds. A step only writes `token`/`pos` with
torch ops on the device and launches.

Counters are never reset between steps: the kernel's waits compare against
(epoch - 1) * producers + threshold, and `epoch` advances by one per launch. After a
failed step (or `reset`) the counters are zeroed and the epoch restarts at 1.

Watchdog: every launch is bounded twice. The spinning thread of each block gives up
after `spin_timeout_s` (device clock) and reports; the host polls the launch's completion
event and, after `timeout_s`, raises an abort flag in mapped host memory that every
spinning block polls. Either way the kernel exits, the VM resets its counters and raises
`VMHangError`, and the process and the GPU stay usable.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import os
import time
from typing import Optional

import numpy as np
import torch
from amk.schedule.ir import (
    IMMUTABLE_KINDS,
    MAX_INPUTS,
    MAX_OUTPUTS,
    MAX_WAITS,
    Buffer,
    BufferKind,
    DTYPE_BITS,
    DType,
    Epilogue,
    Op,
    Program,
    ValidationResult,
)
from amk.schedule.config import VM_POLL_CAP_NS
from amk.schedule.opspec import gemv_rows_width, output_roles, weight_input_roles
from amk.schedule.placement import weight_bytes
from amk.vm.bindings import TORCH_DTYPE, bound_tensor_mismatch
from amk.vm.kv_layout import KvLayoutError, check_kv_layout, program_kv_head, read_as_rows, stored_kv_head
from amk.vm.progress import StepProgress

from amk.errors import AmkError


XSUM_CHUNK = 32  # columns per U4 x-sum in the GEMV's shared memory (instructions/gemv.cuh AMK_XSUM_CHUNK)


def experiment_defines() -> dict[str, int]:
    """Integer build defines from $AMK_VM_DEFINES ("AMK_SPIN_MAX_NS=1024,AMK_ATTN_UNROLL=1"), for
    performance experiments on tunables that are not ScheduleConfig knobs (yet). Names must
    start with AMK_; anything else is refused."""
    return parse_defines(os.environ.get("AMK_VM_DEFINES", ""), "AMK_VM_DEFINES")


def parse_defines(text: str, what: str = "defines") -> dict[str, int]:
    """{"AMK_A": 1, "AMK_B": -2} from "AMK_A=1,AMK_B=-2"; ValueError for anything else."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        if not name.startswith("AMK_") or not name.replace("_", "").isalnum() or not value.lstrip("-").isdigit():
            raise ValueError(f"{what}: {item!r} is not AMK_NAME=integer")
        out[name] = int(value)
    return out


class VMError(AmkError, RuntimeError):
    """The device reported an error during a step (bad position, token, shape...)."""


class VMHangError(VMError):
    """A step did not finish: a wait timed out or the watchdog aborted the launch."""


class VMRefused(AmkError, ValueError):
    """The program or tensors cannot run on this VM (rejected by the validator, ...)."""


# ---------------------------------------------------------------------- ABI mirror of vm/tables.h
WARP = 32  # AMK_WARP_SIZE on NVIDIA
ATTN_HEAD_BLOCK = 4  # AMK_ATTN_HB (instructions/attention.cuh): q heads per P.V register block
SCORE_CACHE_WORDS = 8192  # shared-memory words for cached attention scores per task
ROLE_SLOTS = 32
NIPARAM, NFPARAM = 16, 4
STATUS_WORDS = 8

# AmkRole, in order: the role strings of amk.schedule.opspec
ROLES = ("w", "x", "gamma", "w_scale", "w_zero", "w2", "w2_scale", "w2_zero", "bias", "residual",
         "head_gamma", "inv_freq", "pos", "token", "table", "src", "q", "k", "v", "o", "ml", "gate",
         "up", "a", "b", "logits", "partials", "x_part", "res_part")
ROLE_CODE = {r: i for i, r in enumerate(ROLES)}

# AmkParamIndex
PARAM_INDEX = {
    "P_ROWS": 0, "P_EPILOGUE": 1, "P_HAS_BIAS": 2, "P_HEAD_DIM": 3, "P_HAS_HEAD_NORM": 4, "P_SPLIT_K": 5,
    "P_K": 6, "P_K_LO": 7, "P_K_HI": 8, "P_HAS_NORM": 9, "P_UNPACK": 10, "P_X_PAD": 11,
    "P_COMBINE_SPLITS": 12, "P_COMBINE_Q_HEADS": 13, "P_COMBINE_HEAD_DIM": 14, "P_ARGMAX_PAIR_BASE": 15,
    "F_HEAD_NORM_EPS": 0, "F_NORM_EPS": 1,
    "P_EMBED_VOCAB": 0, "P_EMBED_HIDDEN": 1,
    "P_NORM_HIDDEN": 0, "P_NORM_COL": 1, "F_NORM_EPS_RMS": 0,
    "P_HEADS_HEAD_DIM": 0, "P_HEADS_HEADS": 1, "F_HEADS_EPS": 0,
    "P_N": 0, "P_ARGMAX_MODE": 1, "P_ARGMAX_BASE": 2,
    "P_ATTN_HEAD_DIM": 0, "P_ATTN_Q_HEADS": 1, "P_ATTN_SPLITS": 2, "P_ATTN_SPLIT": 3, "P_ATTN_BLOCK": 4,
    "P_ATTN_SCORE_CAP": 5, "F_ATTN_SCALE": 0,
}

# AmkError
ERRORS = {1: "spin timeout", 2: "aborted by the host watchdog", 3: "bad op or epilogue code",
          4: "not enough shared memory", 5: "position outside the KV cache", 6: "token outside the vocabulary",
          7: "unsupported dtype", 8: "params inconsistent with operands"}
HANG_ERRORS = (1, 2)

OPERAND_DTYPE = np.dtype([("off", "<i8"), ("stride", "<i8"), ("buf", "<i4"), ("len", "<i4"),
                          ("count", "<i4"), ("kv", "<i4")])
WAIT_DTYPE = np.dtype([("counter", "<i4"), ("threshold", "<u4"), ("producers", "<u4"), ("scope", "<i4")])
TASK_DTYPE = np.dtype([
    ("op", "<i4"), ("out_counter", "<i4"), ("n_in", "<i4"), ("n_out", "<i4"), ("n_wait", "<i4"), ("id", "<i4"),
    ("prefetch_in", "<i4"), ("out_scope", "<i4"),
    ("waits", WAIT_DTYPE, (MAX_WAITS,)),
    ("role", "i1", (ROLE_SLOTS,)),
    ("ip", "<i4", (NIPARAM,)),
    ("fp", "<f4", (NFPARAM,)),
    ("in", OPERAND_DTYPE, (MAX_INPUTS,)),
    ("out", OPERAND_DTYPE, (MAX_OUTPUTS,)),
])
BUFFER_DTYPE = np.dtype([("ptr", "<u8"), ("numel", "<i8"), ("width", "<i8"), ("rows", "<i8"), ("dtype", "<i4"),
                         ("kind", "<i4"), ("group", "<i4"), ("kv_head", "<i4")])

POISON = {DType.F32: float("nan"), DType.F16: float("nan"), DType.BF16: float("nan"), DType.I32: -(2**31)}
GEMV_PREFETCH_ROLES = ("w", "w_scale", "w_zero", "w2", "w2_scale", "w2_zero")


# ---------------------------------------------------------------------- packing (host only, no GPU)
def _P(name: str) -> int:
    return PARAM_INDEX[name]


def attn_score_cap(p, kv_capacity: int) -> int:
    """Scores per q head an ATTN_PARTIAL keeps in shared memory: its largest chunk, bounded."""
    return max(0, min(attn_max_chunk(p, kv_capacity), SCORE_CACHE_WORDS // max(p.q_heads, 1)))


def _pack_params(p, ip: np.ndarray, fp: np.ndarray, kv_capacity: int, x_pad_shift: int) -> None:
    op = p.op
    if op in (Op.GEMV, Op.REDUCE):
        ip[_P("P_ROWS")], ip[_P("P_EPILOGUE")], ip[_P("P_HAS_BIAS")] = p.rows, int(p.epilogue), int(p.has_bias)
        ip[_P("P_HEAD_DIM")], ip[_P("P_HAS_HEAD_NORM")] = p.head_dim, int(p.head_norm_eps is not None)
        ip[_P("P_SPLIT_K")] = p.split_k
        fp[_P("F_HEAD_NORM_EPS")] = p.head_norm_eps or 0.0
        if op == Op.GEMV:
            ip[_P("P_K")], ip[_P("P_K_LO")], ip[_P("P_K_HI")] = p.k, p.k_lo, p.k_hi
            ip[_P("P_HAS_NORM")], ip[_P("P_UNPACK")] = int(p.norm_eps is not None), p.unpack
            ip[_P("P_X_PAD")] = x_pad_shift
            ip[_P("P_COMBINE_SPLITS")], ip[_P("P_COMBINE_Q_HEADS")] = p.combine_splits, p.combine_q_heads
            ip[_P("P_COMBINE_HEAD_DIM")] = p.combine_head_dim
            ip[_P("P_ARGMAX_PAIR_BASE")] = -1 if p.argmax_pair_base is None else p.argmax_pair_base
            fp[_P("F_NORM_EPS")] = p.norm_eps or 0.0
    elif op == Op.EMBED:
        ip[_P("P_EMBED_VOCAB")], ip[_P("P_EMBED_HIDDEN")] = p.vocab, p.hidden
    elif op == Op.RMSNORM:
        ip[_P("P_NORM_HIDDEN")], ip[_P("P_NORM_COL")], fp[_P("F_NORM_EPS_RMS")] = p.hidden, p.col, p.eps
    elif op in (Op.ROPE, Op.HEAD_NORM):
        ip[_P("P_HEADS_HEAD_DIM")], ip[_P("P_HEADS_HEADS")] = p.head_dim, p.heads
        if op == Op.HEAD_NORM:
            fp[_P("F_HEADS_EPS")] = p.eps
    elif op in (Op.KV_APPEND, Op.SILU_MUL, Op.ADD, Op.ARGMAX):
        ip[_P("P_N")] = p.n
        if op == Op.ARGMAX:
            ip[_P("P_ARGMAX_MODE")], ip[_P("P_ARGMAX_BASE")] = int(p.mode), p.base
    elif op in (Op.ATTN_PARTIAL, Op.ATTN_COMBINE):
        ip[_P("P_ATTN_HEAD_DIM")], ip[_P("P_ATTN_Q_HEADS")], ip[_P("P_ATTN_SPLITS")] = p.head_dim, p.q_heads, p.splits
        if op == Op.ATTN_PARTIAL:
            ip[_P("P_ATTN_SPLIT")], ip[_P("P_ATTN_BLOCK")] = p.split, p.block
            ip[_P("P_ATTN_SCORE_CAP")] = attn_score_cap(p, kv_capacity)
            fp[_P("F_ATTN_SCALE")] = p.scale
    else:  # pragma: no cover - ir.Op is closed
        raise VMRefused(f"op {op!r} has no device packing")


def epilogue_staged_words(p) -> int:
    """Words of a GEMV's epilogue operands staged by its prologue (instructions/epilogue.cuh
    AmkEpiStage): residual, bias, RoPE frequencies, position; none when a REDUCE finishes it."""
    if p.split_k > 1:
        return 0
    rope = p.epilogue in (Epilogue.ROPE, Epilogue.ROPE_APPEND)
    return ((p.rows if p.epilogue == Epilogue.ADD else 0) + (p.rows if p.has_bias else 0)
            + (p.rows // 2 if rope else 0) + (1 if rope or p.epilogue == Epilogue.APPEND else 0))


def gemv_x_pad_shift(wdtype: DType) -> int:
    """log2 of the columns between the 4 unused floats of a GEMV's staged x (the task record's
    P_X_PAD, instructions/gemv.cuh AmkXPad): one weight vector, 16 (I8) or 32 (U4) columns,
    for quantized weights; 0 (x dense) otherwise or when $AMK_VM_DEFINES sets AMK_GEMV_XPAD=0.
    The device's rows loop steps by the format's vector (AmkWFmt<DT>::VEC) plus the pad, so
    the spacing here must be that vector."""
    shift = {DType.I8: 4, DType.U4: 5}.get(wdtype, 0)
    return shift if experiment_defines().get("AMK_GEMV_XPAD", 1) else 0


def gemv_x_words(k: int, wdtype: DType) -> int:
    """Words of a GEMV's staged x (instructions/gemv.cuh amk_xs_words)."""
    return _x_words(k, gemv_x_pad_shift(wdtype))


def _x_words(k: int, shift: int) -> int:
    return k + ((k >> shift) * 4 if shift else 0)


def smem_words(p, threads: int, kv_capacity: int, wdtype: DType, warp: int) -> int:
    """Dynamic shared memory (4-byte words) a task needs; mirrors the amk_smem_* functions
    (wdtype: a GEMV's weight dtype, which sizes its staged x; warp: the target's AMK_WARP_SIZE,
    64 on the AMD parts. Neither has a default, as for _pack_params: a caller that forgot one
    would size a quantized GEMV's padded x, or an AMD task's scratch, too small)."""
    return _smem_words(p, threads, kv_capacity, gemv_x_pad_shift(wdtype), warp)


def _smem_words(p, threads: int, kv_capacity: int, x_pad_shift: int, warp: int) -> int:
    op, nwarps = p.op, threads // warp
    r4 = lambda n: (n + 3) & ~3  # noqa: E731
    if op == Op.GEMV:
        k = p.k_hi - p.k_lo
        # x | accumulators | reduction scratch | x sums (U4 zero term) | the norm weights, staged with x
        # | the epilogue's operands, staged with x (amk_gemv_epi_stage: none under split-K)
        # | the combine prologue's weights and denominators (combine.cuh amk_combine_smem_words)
        norm = r4(k) if p.norm_eps is not None else 0
        combine = 0
        if p.combine_splits > 0:
            heads = k // p.combine_head_dim
            combine = r4(2 * heads * p.combine_splits + heads)
        pair = 2 * warp if p.argmax_pair_base is not None else 0  # | the argmax pair's reduction
        return (r4(_x_words(k, x_pad_shift)) + r4(p.rows * gemv_rows_width(p)) + warp + r4(k // XSUM_CHUNK) + norm
                + r4(epilogue_staged_words(p)) + combine + pair)
    if op == Op.REDUCE:
        return p.rows * gemv_rows_width(p)
    if op in (Op.ROPE, Op.HEAD_NORM):
        return p.heads * p.head_dim
    if op == Op.RMSNORM:
        return warp
    if op == Op.ARGMAX:
        return 2 * warp
    if op == Op.ATTN_PARTIAL:
        qh, hd = p.q_heads, p.head_dim
        return 2 * qh * hd + 3 * qh + nwarps * ATTN_HEAD_BLOCK * hd + qh * attn_score_cap(p, kv_capacity)
    if op == Op.ATTN_COMBINE:  # | AMK_COMBINE_EARLY=2's copied splits (counted in every build)
        return r4(2 * p.splits * p.q_heads + p.q_heads) + p.splits * p.q_heads * p.head_dim
    return 0


class PackedProgram:
    """The device tables of a Program as numpy arrays (no GPU needed).

    tasks: TASK_DTYPE [n_tasks]; queue_start: int32 [n_queues + 1]; queue_tasks: int32
    (task indices, queue after queue); producers: tasks signalling each counter per step;
    buffer_index: Buffer.id -> row of the buffer table; smem_bytes: the launch's dynamic
    shared memory (the largest task's need); flat_runs_needed: does a task read operands of runs
    apart through amk_flat (the module's flat_runs_needed, asked while packing)."""

    def __init__(self, program: Program):
        self.program = program
        threads, warp = program.threads_per_block, program.target.warp_size
        self.buffer_index = {b.id: i for i, b in enumerate(program.buffers)}
        self.counter_index = {c.id: i for i, c in enumerate(program.counters)}
        task_index = {t.id: i for i, t in enumerate(program.tasks)}
        _check_kv_layouts(program)
        producers = np.zeros(len(program.counters), dtype=np.int64)
        for t in program.tasks:
            producers[self.counter_index[t.out_counter]] += 1
        self.producers = producers

        recs = np.zeros(len(program.tasks), dtype=TASK_DTYPE)
        words = 0
        gemv_wdtypes: set[DType] = set()
        hint_min_bytes = int(_vm_meta(program).get("prefetch_min_kb", 0)) * 1024  # smaller GEMVs: no hints
        by_id = {b.id: b for b in program.buffers}
        x_pad_shift: dict[DType, int] = {}  # per weight dtype (reads $AMK_VM_DEFINES once, not per task)
        self.flat_runs_needed = False  # flat_runs_needed(program), found while packing
        for i, t in enumerate(program.tasks):
            rec = recs[i]
            p = t.params
            wb = program.buffers[self.buffer_index[t.inputs[0].buf]] if p.op == Op.GEMV and t.inputs else None
            wdtype = wb.dtype if wb is not None else DType.F32
            if p.op == Op.GEMV:
                gemv_wdtypes.add(wdtype)
            iroles, oroles = weight_input_roles(p, wb), output_roles(p)
            if len(iroles) != len(t.inputs) or len(oroles) != len(t.outputs) or len(t.waits) > MAX_WAITS:
                raise VMRefused(f"task {t.id} {t.name!r}: operands do not match the roles {iroles} / {oroles}")
            self.flat_runs_needed = self.flat_runs_needed or _reads_runs_flat(t, iroles)
            rec["op"], rec["id"] = int(p.op), t.id
            rec["out_counter"] = self.counter_index[t.out_counter]
            rec["out_scope"] = int(program.counters[rec["out_counter"]].scope)
            rec["n_in"], rec["n_out"], rec["n_wait"] = len(t.inputs), len(t.outputs), len(t.waits)
            rec["role"][:] = -1
            mask = 0
            for s, (role, o) in enumerate(zip(iroles, t.inputs)):
                rec["role"][ROLE_CODE[role]] = s
                self._operand(rec["in"][s], o)
                if p.op == Op.GEMV and role in GEMV_PREFETCH_ROLES:
                    if program.buffers[self.buffer_index[o.buf]].kind not in IMMUTABLE_KINDS:
                        raise VMRefused(f"task {t.id} {t.name!r}: GEMV {role} must be a WEIGHT or CONST buffer "
                                        "(the kernel streams it through the read-only path)")
                    mask |= 1 << s
            if mask and hint_min_bytes and weight_bytes(t, by_id) < hint_min_bytes:
                mask = 0
            rec["prefetch_in"] = mask
            for s, o in enumerate(t.outputs):
                self._operand(rec["out"][s], o)
            for s, w in enumerate(t.waits):
                c = self.counter_index[w.counter]
                rec["waits"][s] = (c, w.threshold, producers[c], int(program.counters[c].scope))
            if wdtype not in x_pad_shift:
                x_pad_shift[wdtype] = gemv_x_pad_shift(wdtype)
            _pack_params(p, rec["ip"], rec["fp"], program.kv_capacity, x_pad_shift[wdtype])
            words = max(words, _smem_words(p, threads, program.kv_capacity, x_pad_shift[wdtype], warp))
        self.tasks = recs
        self.smem_bytes = 4 * words
        # Build-time specialization (instructions/common.cuh): compile only the dtype paths
        # this program uses; the kernel is one function and its size costs instruction fetches.
        self.defines = {"AMK_DTYPES": _dtype_mask(compiled_dtypes(program)),
                        "AMK_GEMV_WDTYPES": _dtype_mask(gemv_wdtypes), **_op_defines(program),
                        **_score_block_define(program, gemv_wdtypes),
                        **_only_wide_define(program, by_id, gemv_wdtypes), **_only_vec_define(program, by_id),
                        **_whole_vecs_define(program, by_id, gemv_wdtypes),
                        **_k_ahead_define(program, by_id, gemv_wdtypes), **_xq_define(program, gemv_wdtypes),
                        # amk_flat as one run where no task needs its runs (common.cuh AMK_FLAT_RUNS)
                        **({} if self.flat_runs_needed else {"AMK_FLAT_RUNS": 0})}
        self.queue_start = np.zeros(len(program.queues) + 1, dtype=np.int32)
        self.queue_start[1:] = np.cumsum([len(q) for q in program.queues])
        self.queue_tasks = np.array([task_index[tid] for q in program.queues for tid in q], dtype=np.int32)

    def _operand(self, dst: np.ndarray, o) -> None:
        dst["off"], dst["stride"], dst["len"], dst["count"] = o.off, o.stride, o.len, o.count
        dst["buf"], dst["kv"] = self.buffer_index[o.buf], int(o.kv)

    def buffer_table(self, pointers: dict[int, int]) -> np.ndarray:
        """The buffer table for the given device addresses (Buffer.id -> pointer)."""
        table = np.zeros(len(self.program.buffers), dtype=BUFFER_DTYPE)
        for i, b in enumerate(self.program.buffers):
            width = b.shape[-1] if b.shape else 1
            table[i] = (pointers[b.id], b.numel, width, b.numel // max(width, 1), int(b.dtype), int(b.kind),
                        b.group or 0, stored_kv_head(self.program, b))
        return table


def _check_kv_layouts(program: Program) -> None:
    """Refuse head-major KV caches (meta['vm']['kv_head'], vm/kv_layout.py) the kernel cannot read: a
    kv_head that is not a power of two dividing a cache's width, or an attention partial's head that is
    not one whole block (the partial streams a head's rows as one run of kv_head elements a row;
    appends map each element)."""
    h = program_kv_head(program)
    if h == 0:
        return
    by_id = {b.id: b for b in program.buffers}
    for b in program.buffers:
        if b.kind == BufferKind.KV_CACHE:
            try:
                check_kv_layout(b, h)
            except KvLayoutError as e:
                raise VMRefused(str(e)) from None
    for t in program.tasks:
        if t.params.op != Op.ATTN_PARTIAL:
            continue
        for o in t.inputs[1:3]:  # k, v (opspec: q, k, v, pos)
            if o.off % h or o.len != h:
                raise VMRefused(f"task {t.id} {t.name!r}: reads columns [{o.off}, {o.off + o.len}) of head-major "
                                f"{by_id[o.buf].name} (kv_head {h}): a partial's head must be one whole block")


# ---------------------------------------------------------------------- the VM
def _op_defines(program: Program) -> dict[str, int]:
    """The ops and GEMV / REDUCE epilogue features the program uses (AMK_OPS, AMK_EPILOGUES,
    AMK_EPI_BIAS, AMK_EPI_HEAD_NORM of instructions/common.cuh): the rest is not compiled."""
    ops = epilogues = 0
    bias = head_norm = False
    for t in program.tasks:
        p = t.params
        ops |= 1 << int(p.op)
        if p.op in (Op.GEMV, Op.REDUCE):
            epilogues |= 1 << int(p.epilogue)
            bias |= p.has_bias
            head_norm |= p.head_norm_eps is not None
    return {"AMK_OPS": ops, "AMK_EPILOGUES": epilogues, "AMK_EPI_BIAS": int(bias), "AMK_EPI_HEAD_NORM": int(head_norm)}


def score_head_block(q_heads: int, cap: int = ATTN_HEAD_BLOCK) -> int:
    """Heads the wide score pass scores together (AMK_ATTN_SCORE_HB) for q_heads q heads a KV
    head: blocks of at most `cap`, as few as possible, as even as possible, so that few re-score
    a head past the last (SmolLM2's 3 in a block of 4 scored one twice)."""
    blocks = -(-q_heads // cap)
    return -(-q_heads // blocks)


# The most heads a score block holds in builds of one symmetric quantized weight format, whose rows
# take the registers a fourth head's chains would hold (instructions/attention.cuh; eval/PERF_NOTES.md
# items 230, 244 and 246: 3 for SmolLM2's 3 q heads a KV head, 2 for the 1B's 4, int8 and int4).
QUANT_SCORE_BLOCK = 3


def _score_block_define(program: Program, gemv_wdtypes: set[DType]) -> dict[str, int]:
    """AMK_ATTN_SCORE_HB for the program's attention (one q heads count a KV head): in float-weight
    builds blocks of at most ATTN_HEAD_BLOCK, the define only where that differs from the kernel's
    default (ATTN_HEAD_BLOCK); in builds of one symmetric quantized format (int8 or int4) blocks of at
    most QUANT_SCORE_BLOCK, always given (the kernel's default there depends on the rows loop); the
    others (asymmetric int8, both formats) keep the kernel's default, one head a pass."""
    q_heads = {t.params.q_heads for t in program.tasks if t.params.op == Op.ATTN_PARTIAL}
    if len(q_heads) != 1:
        return {}
    quantized = gemv_wdtypes & {DType.I8, DType.U4}
    if not quantized:
        hb = score_head_block(q_heads.pop())
        return {} if hb == ATTN_HEAD_BLOCK else {"AMK_ATTN_SCORE_HB": hb}
    if len(quantized) > 1 or _has_i8_zeros(program):
        return {}
    return {"AMK_ATTN_SCORE_HB": score_head_block(q_heads.pop(), QUANT_SCORE_BLOCK)}


def attn_wide_rows(buffer: Buffer, off: int, head_dim: int) -> bool:
    """Do a KV cache's rows at column `off` take the wide attention passes? The device's
    amk_attn_wide_rows (instructions/attention.cuh): half precision, 16-byte vectors (every row
    16-byte aligned; buffers are allocated 256-byte aligned), head_dim / 32 a power of two <= 32."""
    if buffer.dtype not in (DType.BF16, DType.F16):
        return False
    width = buffer.shape[-1] if buffer.shape else 1
    if head_dim % 8 or (off * 2) % 16 or (width * 2) % 16:
        return False
    groups = head_dim // 32  # lanes a row: 4 vectors of 8 halves each
    return head_dim % 32 == 0 and 1 <= groups <= WARP and groups & (groups - 1) == 0


def _only_wide_define(program: Program, by_id: dict[int, Buffer], gemv_wdtypes: set[DType]) -> dict[str, int]:
    """AMK_ATTN_ONLY_WIDE where every ATTN_PARTIAL's K and V rows take the wide passes: the
    split-layout passes are left out of the build (eval/PERF_NOTES.md item 198: SmolLM2 shape
    -2.1 %, 1B -0.6 %; int8 -2.4 % and -1.35 %, on the H200). Not with U4 GEMV weights, whose
    builds keep the split P.V pass anyway (AMK_ATTN_PV_WIDE is off there) and spill 80 B with the
    define (sm_90 int4_ahead), nor where a GEMV combines the attention's splits (o_proj_kv_slices:
    that build spills 8 B with it on sm_80 and sm_90)."""
    partials = [t for t in program.tasks if t.params.op == Op.ATTN_PARTIAL]
    combine_in_gemv = any(t.params.op == Op.GEMV and t.params.combine_splits > 0 for t in program.tasks)
    if not partials or DType.U4 in gemv_wdtypes or combine_in_gemv:
        return {}
    for t in partials:
        for cache in t.inputs[1:3]:  # k, v (opspec: q, k, v, pos)
            if not attn_wide_rows(by_id[cache.buf], cache.off, t.params.head_dim):
                return {}
    return {"AMK_ATTN_ONLY_WIDE": 1}


def attn_max_chunk(p, kv_capacity: int) -> int:
    """An ATTN_PARTIAL's largest split at the program's KV capacity (AttnPartialParams: chunk =
    ceil(ceil((pos + 1) / splits) / block) * block, largest at the last position)."""
    return math.ceil(math.ceil(kv_capacity / p.splits) / p.block) * p.block if kv_capacity > 0 else 0


def wide_score_rows_a_round(head_dim: int, threads: int) -> int:
    """Rows the wide score pass loads a round, a block's warps together (amk_attn_scores_wide:
    head_dim / 32 lanes a row, one row a lane group, whatever the warp size)."""
    return threads // (head_dim // 32)


def _k_ahead_define(program: Program, by_id: dict[int, Buffer], gemv_wdtypes: set[DType]) -> dict[str, int]:
    """AMK_ATTN_K_AHEAD where some ATTN_PARTIAL's largest split has two full rounds of the wide
    score pass or more: each lane hints its rows of the later rounds into the L1 at the pass's
    start (eval/PERF_NOTES.md items 213, 214 and 219, H200: the 1B at ctx 8192, 528-row splits,
    -0.23 % and -0.35 %). Where it issues no hint the code alone cost the SmolLM2 shape +0.42 % (1B
    +0.05 %, ctx 1024), and the 8B's 80-row splits (a round of 64 at head_dim 128, then 16 rows)
    measured -0.13 % without it, so those builds leave it out. Not with quantized GEMV weights: the
    int8 1B at ctx 8192 measured -0.49 % without it (its builds score one head a pass, and the hint,
    issued once, serves the first), and U4 builds spill with any code added."""
    if gemv_wdtypes & {DType.I8, DType.U4}:
        return {}
    for t in program.tasks:
        p = t.params
        if p.op != Op.ATTN_PARTIAL or not attn_wide_rows(by_id[t.inputs[1].buf], t.inputs[1].off, p.head_dim):
            continue
        if attn_max_chunk(p, program.kv_capacity) >= 2 * wide_score_rows_a_round(p.head_dim, program.threads_per_block):
            return {"AMK_ATTN_K_AHEAD": 1}
    return {}


_FLOAT_DTYPES = (DType.F32, DType.BF16, DType.F16)


def vector_elems(dtype: DType) -> int:
    """Elements of `dtype` in a 16-byte vector, the unit the GEMV rows stream (AmkWFmt::VEC)."""
    return 128 // DTYPE_BITS[dtype]


def gemv_vec_rows(task, by_id: dict[int, Buffer], qcomp_dtype: int = -1) -> bool:
    """Do a GEMV task's weight slabs stream as aligned 16-byte vectors, or take the scalar rows?
    The device's amk_gemv_vec_ok (instructions/gemv.cuh), for w and, in a pair, w2: offset and
    row stride whole vectors (buffers are allocated 256-byte aligned); quantized: group and k_lo
    whole vectors, the slice in one group or a power of two of vectors a group, companions of a
    float dtype (the build's AMK_QCOMP_DTYPE where it names one), an I8 zero's slice whole
    32-column chunks. The scalar rows are correct but slow (AMK_GEMV_ONLY_VEC leaves them out).
    by_id: the program's buffers by id (built once for all its tasks)."""
    p = task.params
    ops = dict(zip(weight_input_roles(p, by_id[task.inputs[0].buf]), task.inputs))
    k_lo, k = p.k_lo, p.k_hi - p.k_lo
    for prefix in ("w", "w2") if "w2" in ops else ("w",):
        w = by_id[ops[prefix].buf]
        vec = vector_elems(w.dtype)
        if ops[prefix].off % vec or ops[prefix].stride % vec:
            return False
        companions = [ops[r] for r in (f"{prefix}_scale", f"{prefix}_zero") if r in ops]
        if not companions:
            continue
        if any(by_id[o.buf].dtype not in _FLOAT_DTYPES or qcomp_dtype not in (-1, int(by_id[o.buf].dtype))
               for o in companions):
            return False
        if w.dtype == DType.I8 and f"{prefix}_zero" in ops and (k_lo % XSUM_CHUNK or k % XSUM_CHUNK):
            return False
        group = w.group if w.group and w.group > 0 else 1
        per_group = group // vec
        one_group = k_lo + k <= (k_lo // group + 1) * group
        if group % vec or k_lo % vec or not (one_group or per_group & (per_group - 1) == 0):
            return False
    return True


def _only_vec_define(program: Program, by_id: dict[int, Buffer]) -> dict[str, int]:
    """AMK_GEMV_ONLY_VEC where every GEMV task streams aligned vectors (gemv_vec_rows, with the
    companions' dtype the build will name): the scalar rows are left out of the build
    (eval/PERF_NOTES.md items 203 and 206: SmolLM2 shape -0.8 %, 1B -0.4 % on the H200)."""
    gemvs = [t for t in program.tasks if t.params.op == Op.GEMV]
    qcomp = companion_dtype(program)
    if gemvs and all(gemv_vec_rows(t, by_id, -1 if qcomp is None else int(qcomp)) for t in gemvs):
        return {"AMK_GEMV_ONLY_VEC": 1}
    return {}


def _whole_vecs_define(program: Program, by_id: dict[int, Buffer], gemv_wdtypes: set[DType]) -> dict[str, int]:
    """AMK_GEMV_WHOLE_VECS where the GEMVs take the loads-ahead loop (the program's
    gemv_loads_ahead) and every GEMV task spans whole vectors (gemv_whole_vecs): the rows'
    tail is left out of the build (eval/PERF_NOTES.md items 207 and 211: on the H200 the bf16 1B
    -0.73 %, the int8 1B -1.14 %; in the plain loop, SmolLM2's, +0.24 %, so not there). Not with
    U4 weights, whose builds spill with it, nor asymmetric int8 (I8 with zeros), not measured."""
    gemvs = [t for t in program.tasks if t.params.op == Op.GEMV]
    if (not gemvs or DType.U4 in gemv_wdtypes or _has_i8_zeros(program)
            or _vm_meta(program).get("gemv_loads_ahead") is not True):
        return {}
    return {"AMK_GEMV_WHOLE_VECS": 1} if all(gemv_whole_vecs(t, by_id) for t in gemvs) else {}


def _xq_define(program: Program, gemv_wdtypes: set[DType]) -> dict[str, int]:
    """AMK_GEMV_I8_XQ / AMK_GEMV_U4_XQ where the GEMVs have one quantized weight format (symmetric int8,
    or int4) on an NVIDIA target: x packed once a task as 24-bit fixed point, the rows dotted by dp2a /
    dp4a (instructions/vec.cuh; eval/PERF_NOTES.md items 235, 236 and 240, on the H200: the int8 1B
    -3.0 %, the int4 1B -4.69 %, the int8 8B -6.9 %, the int4 8B -12.9 %, the int4 SmolLM2 shape -3.75 %).
    int4 in either rows loop; int8 only in the loads-ahead loop, where the pack runs under the first
    loads: the plain loop packs ahead of its rows, and there the int8 SmolLM2 shape lost (+0.67 %,
    item 240; +1.47 % in the smaller build of item 247), int4 gaining for its costlier float dot. Not
    asymmetric int8 nor int8 beside int4, not measured; not AMD targets (no dp2a); not where x is left
    unpadded (AMK_GEMV_XPAD=0) or the program names a code unpack strategy."""
    quantized = gemv_wdtypes & {DType.I8, DType.U4}
    ahead = _vm_meta(program).get("gemv_loads_ahead") is True
    if (len(quantized) != 1 or _has_i8_zeros(program)
            or program.target.vendor != "nvidia" or (DType.I8 in quantized and not ahead)
            or not experiment_defines().get("AMK_GEMV_XPAD", 1)
            or any(t.params.op == Op.GEMV and t.params.unpack != 0 for t in program.tasks)):
        return {}
    return {"AMK_GEMV_I8_XQ" if DType.I8 in quantized else "AMK_GEMV_U4_XQ": 1}


def _has_i8_zeros(program: Program) -> bool:
    """Asymmetric int8 (ScheduleConfig.quant_asym): an I8 buffer with zeros."""
    return any(b.dtype == DType.I8 and b.zero is not None for b in program.buffers)


def companion_dtype(program: Program) -> Optional[DType]:
    """The one dtype of every quantized weight's scales and zeros, or None (none, or several):
    the build's AMK_QCOMP_DTYPE (knob_defines), whose loads then skip the dtype test."""
    by_id = {b.id: b for b in program.buffers}
    companions = {by_id[i].dtype for b in program.buffers for i in (b.scale, b.zero) if i is not None}
    return companions.pop() if len(companions) == 1 else None


def compiled_dtypes(program: Program) -> set[DType]:
    """The dtypes whose code paths the build compiles for any buffer (AMK_DTYPES): every buffer's, but
    the quantized weights' companions' one dtype (AMK_QCOMP_DTYPE) only where another buffer has it
    too. Their loads convert it themselves (gemv.cuh amk_qcomp_apart), and the F16 scales of a bf16
    model would otherwise compile an F16 copy of every float loop: the int8 build's sm_90 code 358 ->
    291 KB, and the int8 1B -6.2 %, the SmolLM2 shape -6.8 % (eval/PERF_NOTES.md item 243)."""
    qcomp = companion_dtype(program)
    companions = {i for b in program.buffers for i in (b.scale, b.zero) if i is not None} if qcomp is not None else set()
    return {b.dtype for b in program.buffers if b.id not in companions}


def gemv_whole_vecs(task, by_id: dict[int, Buffer]) -> bool:
    """Does a GEMV task's K slice span whole 16-byte vectors of its weight's dtype? A vector-row
    task (gemv_vec_rows) that does not has a tail of scalar columns, which a build with
    AMK_GEMV_WHOLE_VECS leaves out (the device then reports the task, instructions/gemv.cuh)."""
    w = by_id[task.inputs[0].buf]
    return (task.params.k_hi - task.params.k_lo) % vector_elems(w.dtype) == 0


def _dtype_mask(dtypes) -> int:
    """Bit d set for every AmkDType code d among `dtypes` (at least one bit: 0 is F32)."""
    mask = 0
    for d in dtypes:
        mask |= 1 << int(d)
    return mask or 1


UNPACK_STRATEGIES = {1: "byte permute", 2: "integer conversion"}  # AMK_Q_UNPACK (instructions/vec.cuh)


def _vm_meta(program: Program) -> dict:
    """program.meta['vm']: the VM knobs the lowering recorded (empty for hand-built programs)."""
    return (program.meta.get("vm") or {}) if isinstance(program.meta, dict) else {}


def knob_defines(program: Program) -> dict[str, int]:
    """The build defines a program's VM knobs select: program.meta['vm'] (gemv_unroll,
    gemv_unroll_quant, prefetch_kb; 'auto' leaves the architecture's default; poll_cap_ns as
    AMK_SPIN_MAX_NS where it is not the VM's own; gemv_loads_ahead as AMK_GEMV_LOADS_AHEAD 1) and the unpack
    strategy of its quantized GEMVs (params.unpack; 0 leaves the default). One build serves
    every task, so the quantized GEMVs must agree on it. AMK_GEMV_COMBINE 1 where a GEMV has
    the attention combine prologue, AMK_GEMV_PARTIALS 1 where one reads x or its residual with
    split-K partials, AMK_GEMV_ARGMAX 1 where one writes an argmax pair (the LM head's,
    ScheduleConfig.fuse_argmax), AMK_GEMV_I8_ZERO 1 where an I8 weight has a zero (its term
    in the rows), AMK_KV_HEAD_MAJOR 1 where the KV caches are stored head-major (meta's kv_head), which
    no build compiles unless asked (common.cuh, gemv.cuh), and AMK_QCOMP_DTYPE where every scale
    and zero has one dtype (gemv.cuh AmkQRow)."""
    vm_meta = _vm_meta(program)
    out = {define: vm_meta[knob] for knob, define in (("gemv_unroll", "AMK_GEMV_UNROLL"),
                                                      ("gemv_unroll_quant", "AMK_GEMV_UNROLL_Q"),
                                                      ("prefetch_kb", "AMK_PREFETCH_KB"))
           if isinstance(vm_meta.get(knob), int)}
    if isinstance(vm_meta.get("poll_cap_ns"), int) and vm_meta["poll_cap_ns"] != VM_POLL_CAP_NS:
        out["AMK_SPIN_MAX_NS"] = vm_meta["poll_cap_ns"]  # (the VM's cap needs no define: builds stay shared)
    if vm_meta.get("gemv_loads_ahead") is True:
        out["AMK_GEMV_LOADS_AHEAD"] = 1
    unpack = {t.params.unpack for t in program.tasks if t.params.op == Op.GEMV and t.params.unpack != 0}
    if len(unpack) > 1 or not unpack <= UNPACK_STRATEGIES.keys():
        raise VMRefused(f"quantized GEMVs ask for unpack strategies {sorted(unpack)}: one build runs one of "
                        f"{UNPACK_STRATEGIES} (0 = the default)")
    if unpack:
        out["AMK_Q_UNPACK"] = unpack.pop()
    if any(t.params.op == Op.GEMV and t.params.combine_splits > 0 for t in program.tasks):
        out["AMK_GEMV_COMBINE"] = 1
    if any(t.params.op == Op.GEMV and (t.params.x_partials or t.params.residual_partials) for t in program.tasks):
        out["AMK_GEMV_PARTIALS"] = 1
    if any(t.params.op == Op.GEMV and t.params.argmax_pair_base is not None for t in program.tasks):
        out["AMK_GEMV_ARGMAX"] = 1
    if _has_i8_zeros(program):
        out["AMK_GEMV_I8_ZERO"] = 1
    if program_kv_head(program):
        out["AMK_KV_HEAD_MAJOR"] = 1
    qcomp = companion_dtype(program)
    if qcomp is not None:
        out["AMK_QCOMP_DTYPE"] = int(qcomp)
    return out


def build_defines(program: Program, packed: Optional["PackedProgram"] = None, *, specialize: bool = True,
                  trace: bool = False, experiments: Optional[dict[str, int]] = None) -> dict[str, int]:
    """Every build define the CudaVM compiles `program` with: the dtype specialization
    (PackedProgram.defines, unless `specialize` is off), AMK_TRACE, the program's knobs
    (knob_defines) and the experiments (default: $AMK_VM_DEFINES), later ones winning."""
    if specialize:
        packed = packed or PackedProgram(program)
    defines = dict(packed.defines) if specialize else {}
    if trace:
        defines["AMK_TRACE"] = 1
    knobs = knob_defines(program)
    defines.update(knobs)
    defines.update(experiment_defines() if experiments is None else experiments)
    # a build without the pair epilogue would leave the pairs unwritten (the device does not check)
    if knobs.get("AMK_GEMV_ARGMAX") and not defines.get("AMK_GEMV_ARGMAX"):
        raise VMRefused("the program's LM head writes argmax pairs (fuse_argmax), which a build with "
                        "AMK_GEMV_ARGMAX=0 does not compile")
    if knobs.get("AMK_KV_HEAD_MAJOR") and not defines.get("AMK_KV_HEAD_MAJOR"):  # it would read rows as row-major
        raise VMRefused("the program's KV caches are head-major (kv_head_major), which a build with "
                        "AMK_KV_HEAD_MAJOR=0 does not read")
    _refuse_missing_dtypes(program, defines)
    _refuse_flat_runs_off(program, defines, packed)
    return defines


# Roles whose operands the device addresses run by run (off + k * stride), never through amk_flat: the
# GEMV weights with their scales and zeros (a row a run, gemv.cuh AmkGemvW), the GEMV's x and residual
# partials and the split-K REDUCE's (a partial a run), and the embedding table (a row per token).
RUN_ADDRESSED_ROLES = {Op.GEMV: frozenset({*GEMV_PREFETCH_ROLES, "x_part", "res_part"}),
                       Op.REDUCE: frozenset({"partials"}), Op.EMBED: frozenset({"table"})}


def _reads_runs_flat(task, iroles) -> bool:
    """Does `task` read or write, through amk_flat, an operand of several runs apart (count > 1, stride
    != len; runs that abut are one)? iroles: its inputs' roles (weight_input_roles). Operands of
    RUN_ADDRESSED_ROLES do not count: the device addresses them run by run."""
    by_run = RUN_ADDRESSED_ROLES.get(task.params.op, frozenset())

    def apart(o) -> bool:
        return o.count > 1 and o.stride != o.len

    return (any(apart(o) and role not in by_run for role, o in zip(iroles, task.inputs))
            or any(apart(o) for o in task.outputs))


def flat_runs_needed(program: Program) -> bool:
    """Does a task read or write an operand of several runs apart through amk_flat
    (_reads_runs_flat)? Then the build needs amk_flat's runs (AMK_FLAT_RUNS, instructions/common.cuh),
    else PackedProgram.defines compiles amk_flat as one run. No program the lowering makes has one
    (tests/test_vm_compile.py), a hand-built one may."""
    by_id = {b.id: b for b in program.buffers}
    return any(_reads_runs_flat(t, weight_input_roles(t.params, by_id[t.inputs[0].buf]
                                                      if t.params.op == Op.GEMV and t.inputs else None))
               for t in program.tasks)


def _refuse_flat_runs_off(program: Program, defines: dict[str, int], packed: Optional["PackedProgram"]) -> None:
    """A build with AMK_FLAT_RUNS=0 reads every amk_flat operand as one run: refused for a program
    with an operand of several runs apart there (it would read and write the wrong elements). Asked of
    `packed` where the program was packed (its task loop found it), else of the program's tasks."""
    if defines.get("AMK_FLAT_RUNS", 1):
        return
    if packed.flat_runs_needed if packed is not None else flat_runs_needed(program):
        raise VMRefused("the program has operands of several runs apart, which a build with AMK_FLAT_RUNS=0 "
                        "reads as one run")


def _refuse_missing_dtypes(program: Program, defines: dict[str, int]) -> None:
    """A build must compile every buffer's dtype (AMK_DTYPES), but for the companions' where it names
    their one dtype in AMK_QCOMP_DTYPE (their loads convert it themselves, compiled_dtypes). So an
    experiment's AMK_DTYPES that leaves a dtype in use out, or an AMK_QCOMP_DTYPE the build does not
    compile that is not the companions' (a build would read them as its own), is refused: either
    would read some buffer with the wrong conversion."""
    dtypes, qcomp = defines.get("AMK_DTYPES", 0x3F), defines.get("AMK_QCOMP_DTYPE", -1)  # (the kernel's defaults)
    compiled = {d for d in DType if (dtypes >> int(d)) & 1}
    companions = companion_dtype(program)
    apart = companions is not None and int(companions) == qcomp  # (the companions' loads convert it)
    if qcomp >= 0 and not (dtypes >> qcomp) & 1 and not apart:
        raise VMRefused(f"the build's AMK_QCOMP_DTYPE={qcomp} is neither in its AMK_DTYPES={dtypes} nor the "
                        f"dtype of every quantized weight's scales and zeros ({companions.name if companions else 'none'})")
    need = compiled_dtypes(program) if apart else {b.dtype for b in program.buffers}
    if missing := sorted(d.name for d in need - compiled):
        raise VMRefused(f"the build's AMK_DTYPES={dtypes} leaves out dtypes the program's buffers have: "
                        f"{', '.join(missing)}")


def _refuse_if_rejected(program: Program, validation: Optional[ValidationResult]) -> None:
    if validation is None:
        validation = importlib.import_module("amk.schedule.validate").validate(program)
    if not validation.accepted:
        raise VMRefused(f"CudaVM refuses program {program.name!r}: {validation.summary()}")


def _bytes_to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8).copy()).to(device)


TRACE_COLS = 7  # instructions/common.cuh AMK_TRACE_COLS


class CudaVM:
    def __init__(self, program: Program, tensors: dict[str, torch.Tensor], device: str | torch.device = "cuda", *,
                 validation: Optional[ValidationResult] = None, timeout_s: float = 10.0,
                 spin_timeout_s: Optional[float] = None, prefetch_depth: Optional[int] = None,
                 poison_each_step: bool = False, trace: bool = False, specialize: bool = True,
                 _unsafe_skip_validation: bool = False):
        """`tensors`: buffer name -> contents of every WEIGHT and CONST buffer (I8 as int8,
        U4 as uint8 packed two per byte), on any device. `validation`: a result to honour
        instead of running the validator. `timeout_s`: host watchdog per launch;
        `spin_timeout_s`: device bound on one wait (default timeout_s / 2).
        `prefetch_depth`: tasks ahead whose weights a block prefetches (default: the
        program's meta['vm']['prefetch_depth'], else 1). `poison_each_step`: fill
        activations/scratch/outputs with NaN before every step, as the ReferenceVM does.
        `trace`: build with -DAMK_TRACE and record per task the globaltimer (ns) at wait
        start, wait met and op done, then up to 3 phase marks inside the op (GEMV: prologue
        done, rows done; attention partial: q staged, scores done, P.V done; combine: (m, l)
        staged, weights done; argmax: thread 0's scan done, warps' bests in; 0 = none), then
        body done (before the counter release); `trace()` returns the last step's [ntasks, 7]
        table.
        `specialize`: compile only the dtype code paths the program uses (a smaller kernel,
        so fewer instruction-cache misses; one build per dtype combination) instead of the
        generic kernel that runs any program."""
        if not _unsafe_skip_validation:
            _refuse_if_rejected(program, validation)
        if not torch.cuda.is_available():
            raise VMRefused("CudaVM needs a CUDA device (torch.cuda.is_available() is False)")
        import cupy
        from amk.vm import build

        self._cupy = cupy
        self.program = program
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        self.spin_timeout_s = float(spin_timeout_s if spin_timeout_s is not None else timeout_s / 2)
        meta_depth = _vm_meta(program).get("prefetch_depth", 1)
        self.prefetch_depth = int(prefetch_depth if prefetch_depth is not None else meta_depth)
        self.poison_each_step = poison_each_step
        self.trace_enabled = bool(trace)
        self._broken: Optional[str] = None

        self.packed = PackedProgram(program)
        self._by_name = {b.name: b for b in program.buffers}
        self.tensors: dict[str, torch.Tensor] = {}
        self._alloc(tensors)
        dev = self.device
        self._tasks = _bytes_to_device(self.packed.tasks, dev)
        self._queue_start = torch.from_numpy(self.packed.queue_start).to(dev)
        self._queue_tasks = torch.from_numpy(self.packed.queue_tasks if self.packed.queue_tasks.size else
                                             np.zeros(1, np.int32)).to(dev)
        ptrs = {b.id: self.tensors[b.name].data_ptr() for b in program.buffers}
        self._buffer_table = _bytes_to_device(self.packed.buffer_table(ptrs), dev)
        self._counters = torch.zeros(max(len(program.counters), 1), dtype=torch.int32, device=dev)
        self._status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=dev)
        self._status_host = torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=True)
        self.epoch = 1
        self._trace = (torch.zeros((max(len(program.tasks), 1), TRACE_COLS), dtype=torch.int64, device=dev)
                       if self.trace_enabled else None)

        with cupy.cuda.Device(dev.index):
            rt = cupy.cuda.runtime
            # the abort flag: mapped pinned host memory the kernel reads through UVA
            self._abort_ptr = rt.hostAlloc(64, rt.hostAllocMapped | rt.hostAllocPortable)
            self._abort = ctypes.c_int32.from_address(self._abort_ptr)
            self._abort.value = 0
            defines = build_defines(program, self.packed, specialize=specialize, trace=self.trace_enabled)
            self._kernel = build.load_kernel(dev.index, threads=program.threads_per_block,
                                             min_blocks=program.blocks_per_cu, defines=defines or None)
            self._check_launchable(rt)
        self._token = self._io_input("token")
        self._pos = self._io_input("pos")
        self.reset()

    # ------------------------------------------------------------------ setup
    def _alloc(self, given: dict[str, torch.Tensor]) -> None:
        problem = bound_tensor_mismatch(self.program, given.keys())
        if problem:
            raise VMRefused(problem)
        for b in self.program.buffers:
            want = TORCH_DTYPE[b.dtype]
            numel = (b.numel + 1) // 2 if b.dtype == DType.U4 else b.numel
            if b.kind in IMMUTABLE_KINDS:
                t = given[b.name]
                if t.dtype != want:
                    raise VMRefused(f"buffer {b.name} is {b.dtype.name}: expected a {want} tensor, got {t.dtype}")
                t = t.detach().reshape(-1).to(self.device).contiguous()
                if t.numel() != numel:
                    raise VMRefused(f"buffer {b.name} needs {numel} elements of storage, tensor has {t.numel()}")
            else:
                if b.dtype not in POISON:
                    raise VMRefused(f"buffer {b.name}: {b.dtype.name} is only supported for weights")
                t = torch.empty(numel, dtype=want, device=self.device)
            self.tensors[b.name] = t

    def _io_input(self, name: str) -> Optional[torch.Tensor]:
        b = self._by_name.get(name)
        return self.tensors[name] if b is not None and b.kind == BufferKind.IO_INPUT else None

    def _check_launchable(self, rt) -> None:
        from cupy_backends.cuda.api import driver

        idx = self.device.index
        threads, nq = self.program.threads_per_block, len(self.program.queues)
        if not rt.deviceGetAttribute(rt.cudaDevAttrCooperativeLaunch, idx):
            raise VMRefused("this device does not support cooperative launches")
        static = self._kernel.attributes["shared_size_bytes"]
        optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, idx)
        smem = self.packed.smem_bytes
        if smem + static > optin:
            raise VMRefused(f"the largest task needs {smem} B of shared memory (+{static} static); "
                            f"the device allows {optin} per block")
        if smem > 48 * 1024:
            self._kernel.max_dynamic_shared_size_bytes = smem
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(self._kernel.kernel.ptr, threads, smem)
        sms = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, idx)
        if nq > per_sm * sms:
            raise VMRefused(f"{nq} queues need co-resident blocks but only {per_sm} x {sms} SMs = {per_sm * sms} "
                            f"blocks of {threads} threads with {smem} B shared memory fit")
        self.max_coresident = per_sm * sms

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget the KV caches (poisoned) and restart the counters."""
        for b in self.program.buffers:
            if b.kind == BufferKind.KV_CACHE:
                self.tensors[b.name].fill_(POISON[b.dtype])
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._counters.zero_()
        self._status.zero_()
        self.epoch = 1

    def poison(self, inputs: bool = True) -> None:
        """Fill activations, scratch and outputs (and IO inputs) with NaN / a sentinel, as the
        ReferenceVM does before each step, so a read of anything the step never wrote shows."""
        kinds = {BufferKind.ACTIVATION, BufferKind.SCRATCH, BufferKind.IO_OUTPUT}
        if inputs:
            kinds.add(BufferKind.IO_INPUT)
        for b in self.program.buffers:
            if b.kind in kinds:
                self.tensors[b.name].fill_(POISON[b.dtype])

    def read_buffer(self, name: str) -> torch.Tensor:
        """A buffer's current contents (flat, its dtype; U4 packed; a KV cache as the IR's rows,
        whatever its layout), for inspection."""
        return read_as_rows(self.program, self._by_name[name], self.tensors[name])

    def close(self) -> None:
        ptr, self._abort_ptr = getattr(self, "_abort_ptr", 0), 0
        if ptr:
            torch.cuda.synchronize(self.device)
            self._cupy.cuda.runtime.freeHost(ptr)

    def __del__(self):  # best effort; never raise from a finaliser
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ launching
    def _launch(self, token: Optional[int], pos: int) -> torch.cuda.Event:
        """Enqueue one step (token None: the token buffer already holds it); returns its event."""
        if self._broken:
            raise VMHangError(self._broken)
        if self.poison_each_step:
            self.poison(inputs=token is not None)  # a fed-back token must survive
        if token is not None and self._token is not None:
            self._token.fill_(int(token))
        if self._pos is not None:
            self._pos.fill_(int(pos))
        cp = self._cupy
        stream = torch.cuda.current_stream(self.device)
        args = (
            np.uint64(self._tasks.data_ptr()), np.uint64(self._queue_start.data_ptr()),
            np.uint64(self._queue_tasks.data_ptr()), np.uint64(self._buffer_table.data_ptr()),
            np.uint64(self._counters.data_ptr()), np.uint64(self._status.data_ptr()), np.uint64(self._abort_ptr),
            np.uint32(self.epoch & 0xFFFFFFFF), np.uint64(int(self.spin_timeout_s * 1e9)),
            np.int32(self.packed.smem_bytes), np.int32(self.prefetch_depth),
        )
        if self._trace is not None:
            args = args + (np.uint64(self._trace.data_ptr()),)
        with cp.cuda.Device(self.device.index):
            self._kernel((len(self.program.queues),), (self.program.threads_per_block,), args,
                         shared_mem=self.packed.smem_bytes, stream=self._cupy_stream(stream))
        self.epoch += 1
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def device_memory(self) -> dict:
        """Bytes of device memory this VM holds, by what they are: 'weights' (WEIGHT and CONST
        buffers, including storage shared with the caller's tensors), 'kv' (KV caches),
        'other' (activations, scratch, IO buffers, the packed tables, counters, status,
        trace), and other / (weights + kv) as 'overhead_pct'. The CUDA context and the loaded
        module are not counted."""
        seen: set[int] = set()
        total = {"weights": 0, "kv": 0, "other": 0}

        def add(kind: str, t: Optional[torch.Tensor]) -> None:
            if t is None:
                return
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                return
            seen.add(ptr)
            total[kind] += t.untyped_storage().nbytes()

        for b in self.program.buffers:
            kind = "weights" if b.kind in IMMUTABLE_KINDS else "kv" if b.kind == BufferKind.KV_CACHE else "other"
            add(kind, self.tensors[b.name])
        for t in (self._tasks, self._queue_start, self._queue_tasks, self._buffer_table, self._counters, self._status,
                  self._trace):
            add("other", t)
        base = total["weights"] + total["kv"]
        return dict(total, overhead_pct=100.0 * total["other"] / base if base else 0.0)

    def trace(self) -> torch.Tensor:
        """[ntasks, 7] int64 globaltimer ns of the last traced step (task id order): wait
        start, wait met, op done (released), three phase marks (0 = none), body done (before
        the release). Needs CudaVM(..., trace=True)."""
        if self._trace is None:
            raise VMRefused("tracing is off: construct CudaVM(..., trace=True)")
        torch.cuda.synchronize(self.device)
        return self._trace.cpu()

    def _cupy_stream(self, stream: torch.cuda.Stream):
        """CuPy's view of a torch stream (cached: one wrapper per stream)."""
        cache = self.__dict__.setdefault("_streams", {})
        key = stream.cuda_stream
        if key not in cache:
            try:  # the CUDA stream protocol (CuPy >= 14, torch streams with __cuda_stream__)
                cache[key] = self._cupy.cuda.Stream.from_external(stream)
            except (AttributeError, TypeError):
                cache[key] = self._cupy.cuda.ExternalStream(key, self.device.index)
        return cache[key]

    def _wait(self, ev: torch.cuda.Event, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        delay = 2e-5
        while not ev.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def _finish(self, events: list[torch.cuda.Event]) -> None:
        """Watch the launched steps in order; raise on a hang or a device error."""
        stream = torch.cuda.current_stream(self.device)
        self._status_host.copy_(self._status, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        aborted = False
        for ev in events + [done]:
            if not self._wait(ev, self.timeout_s):
                aborted = True
                self._abort.value = 1  # every spinning block polls this and leaves
                break
        if aborted and not self._wait(done, max(self.timeout_s, 5.0)):
            self._broken = ("the megakernel did not exit after the watchdog abort; the GPU is wedged "
                            "(restart the process)")
            raise VMHangError(self._broken)
        self._abort.value = 0
        code = int(self._status_host[0])
        if code == 0 and not aborted:
            return
        st = self._status_host.tolist()
        self._reset_counters()
        what = ERRORS.get(code, f"error {code}") if code else "watchdog timeout"
        msg = (f"megakernel step failed: {what} (task {st[1]}, queue {st[2]}, detail {st[3]}, "
               f"{st[4]}, {st[5]}; timeout {self.timeout_s:g}s)")
        if aborted or code in HANG_ERRORS:
            raise VMHangError(msg)
        raise VMError(msg)

    def _check_pos(self, pos: int) -> None:
        cap = self.program.kv_capacity
        if pos < 0 or (cap and pos >= cap):
            raise ValueError(f"position {pos} outside [0, kv_capacity={cap})")

    # ------------------------------------------------------------------ the ReferenceVM interface
    def run_step(self, token: int, pos: int) -> dict[str, torch.Tensor]:
        """One decode step: write `token`/`pos`, launch, return the IO_OUTPUT buffers by name
        (copies on the device, shaped as declared)."""
        self._check_pos(pos)
        self._finish([self._launch(token, pos)])
        return self.outputs()

    step = run_step

    def outputs(self) -> dict[str, torch.Tensor]:
        return {b.name: self.tensors[b.name].clone().reshape(b.shape) for b in self.program.buffers
                if b.kind == BufferKind.IO_OUTPUT}

    def _next_token(self) -> torch.Tensor:
        """The step's next token as an int32 device tensor of one element (no host sync)."""
        if "next_token" in self.tensors and self._by_name["next_token"].kind == BufferKind.IO_OUTPUT:
            return self.tensors["next_token"][:1]
        if "logits" in self.tensors:
            return torch.argmax(self.tensors["logits"].float()).reshape(1).to(torch.int32)
        raise KeyError("program has neither a `next_token` nor a `logits` output")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, progress: bool = False) -> list[int]:
        """Greedy decoding from an empty cache: the prompt one token per launch (pos 0..),
        then the program's own next token, fed back on the device (no host sync between
        launches; the watchdog then follows the launches in order). Returns the new ids."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_new_tokens <= 0:
            return []
        steps = len(prompt_ids) + max_new_tokens - 1
        self._check_pos(steps - 1)
        self.reset()
        new = torch.empty(max_new_tokens, dtype=torch.int32, device=self.device)
        events = []
        n = len(prompt_ids)
        bar = StepProgress("launched", steps, progress)
        for pos in range(steps):
            events.append(self._launch(prompt_ids[pos] if pos < n else None, pos))
            if pos >= n - 1:
                nxt = self._next_token()
                new[pos - (n - 1)].copy_(nxt[0])
                if self._token is not None and pos + 1 < steps:
                    self._token.copy_(nxt)
            bar.tick()
        self._finish(events)
        bar.close()
        return [int(t) for t in new.tolist()]

    def logits_for(self, prompt_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(prompt_ids), vocab] (fp32), one launch per position."""
        self._check_pos(len(prompt_ids) - 1)
        self.reset()
        vocab = self._by_name["logits"].numel
        out = torch.empty(len(prompt_ids), vocab, dtype=torch.float32, device=self.device)
        events = []
        for pos, tok in enumerate(prompt_ids):
            events.append(self._launch(tok, pos))
            out[pos].copy_(self.tensors["logits"])
        self._finish(events)
        return out
