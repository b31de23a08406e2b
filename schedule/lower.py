"""Lowering: ModelSpec + ScheduleConfig + GpuTarget -> Program (one decode step).

Per layer, with every fusion on (DESIGN "Performance design"):

    QKV GEMV slabs (+norm prologue, +bias, +head norm/RoPE/KV append epilogues)
      -> ATTN_PARTIAL per (kv head, split) -> ATTN_COMBINE per kv head
      -> O-proj GEMV (+residual add into x, in place)
      -> gate/up GEMV (+norm prologue, +SiLU*up epilogue) -> down GEMV (+residual add)

then the final norm + LM head GEMV -> logits -> ARGMAX -> next_token. A fusion switched
off emits the standalone op instead (RMSNORM, HEAD_NORM, ROPE, KV_APPEND, ADD,
SILU_MUL); split_k > 1 turns every GEMV into K-slice partial tasks plus REDUCE tasks.

On a multi-XCD target (`xcd_placement`) every GEMV matrix is first cut into one contiguous
row part per XCD, whose slabs get that XCD as their home (its L2 holds that part of the
weights), and each XCD's attention partials stay with their combine on one XCD; counters
that end up inside one XCD get the cheaper XCD scope (`placement.narrow_scopes`).

Waits are not written by hand: `HazardTracker` derives each task's waits from the
regions it reads and writes (RAW, WAR, WAW), so activation buffers are shared by all
layers and every reuse is ordered. Queues come from `placement.assign`.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from amk.schedule import placement, rope_rows
from amk.schedule.config import (SHORT_POLL_CAP_NS, SHORT_POLL_TASK_KB, SMALL_TASK_KB, VM_POLL_CAP_NS,
                                 ScheduleConfig)
from amk.schedule.hazards import HazardTracker
from amk.schedule.ir import (
    MAX_HEAD_DIM,
    MAX_KV_SPLITS,
    MAX_QUEUES,
    PAIR_INDEX_LIMIT,
    AddParams,
    ArgmaxMode,
    ArgmaxParams,
    AttnCombineParams,
    AttnPartialParams,
    Buffer,
    BufferKind,
    Counter,
    DType,
    EmbedParams,
    Epilogue,
    GemvParams,
    GpuTarget,
    HeadNormParams,
    KvAppendParams,
    KvMode,
    Op,
    Operand,
    Program,
    ReduceParams,
    RmsNormParams,
    RopeParams,
    SiluMulParams,
    Task,
    Wait,
)
from amk.schedule.modelspec import ModelSpec
from amk.schedule.quantize import QuantizedWeight, group_for
from amk.schedule.stats import program_stats
from amk.schedule.targets import coresident_blocks
from amk.schedule.weights import (  # noqa: F401 (re-exported)
    COMPANION_DTYPES,
    INV_FREQ,
    LM_HEAD_Q,
    bind_weights,
    rope_inv_freq,
    source_name,
)

PROGRAM_DTYPES = {"float32": DType.F32, "bfloat16": DType.BF16, "float16": DType.F16}
ROPE_EPILOGUES = (Epilogue.ROPE, Epilogue.ROPE_APPEND)
LM_HEAD_STAGE = "lm_head"  # the name (and task-name prefix) of the LM head's GEMV stage


MIN_SPLIT_POSITIONS = 64  # the KV positions below which 'auto' kv_splits adds no more splits
# 'auto' kv_splits' cap: a combine output's split loads in flight (AMK_SPLIT_SUM_UNROLL, vec.cuh),
# so that it sums its splits in one round trip (a 17th split costs a second)
AUTO_MAX_KV_SPLITS = 16
assert AUTO_MAX_KV_SPLITS <= MAX_KV_SPLITS


def tiles(n: int, parts: int, gran: int = 1) -> list[tuple[int, int]]:
    """Split [0, n) into at most `parts` near-equal contiguous tiles, bounds multiples of gran."""
    if n % gran:
        raise ValueError(f"{n} is not a multiple of {gran}")
    units = n // gran
    parts = max(1, min(parts, units))
    base, extra = divmod(units, parts)
    out, lo = [], 0
    for i in range(parts):
        u = base + (i < extra)
        out.append((lo * gran, (lo + u) * gran))
        lo += u
    return out


def _allocate(total: int, mats: list["_Mat"]) -> list[int]:
    """Share `total` row slabs among a stage's matrices in proportion to their bytes (each
    >= 1 and <= its whole-unit cap; a one-unit-per-slab matrix gets its cap first), then give
    back slabs that cannot shorten the stage: it lasts as long as its largest task, so no
    matrix needs tasks smaller than that."""
    weights = [m.rows * m.k * m.width for m in mats]
    caps = [m.rows // m.gran for m in mats]
    fixed = [m.one_unit_per_slab for m in mats]  # exactly one unit (gran rows) per slab
    alloc = [caps[i] if fixed[i] else 1 for i in range(len(mats))]
    wsum = sum(weights)
    for _ in range(max(0, total - sum(alloc))):
        open_ = [i for i in range(len(mats)) if alloc[i] < caps[i]]
        if not open_:
            break
        i = max(open_, key=lambda i: (weights[i] * total / wsum - alloc[i], -i))
        alloc[i] += 1

    def task_bytes(i: int, a: int) -> int:  # the largest slab of matrix i cut into a slabs
        m = mats[i]
        return -(-caps[i] // a) * m.gran * m.k * m.width

    if any(fixed):  # more one-unit slabs than the budget: the others still no larger than them
        unit = max(task_bytes(i, caps[i]) for i in range(len(mats)) if fixed[i])
        for i in range(len(mats)):
            while alloc[i] < caps[i] and task_bytes(i, alloc[i]) > unit:
                alloc[i] += 1
    worst = max(task_bytes(i, a) for i, a in enumerate(alloc))
    for i in range(len(mats)):
        while not fixed[i] and alloc[i] > 1 and task_bytes(i, alloc[i] - 1) <= worst:
            alloc[i] -= 1
    return alloc


@dataclass
class _Mat:
    """One weight matrix of a GEMV stage and what its epilogue does with each row."""

    role: str  # names the tasks and the split-K scratch
    w: Buffer
    y: Callable[[int, int], Operand]  # output operand for rows [r0, r0 + rows)
    epilogue: Epilogue = Epilogue.STORE
    w2: Optional[Buffer] = None  # the up projection of a fused SILU_MUL
    bias: Optional[Buffer] = None
    residual: Optional[Buffer] = None
    res_part: Optional[Buffer] = None  # split-K partials [n, rows] the residual is read with (o_proj_kv_slices)
    head_gamma: Optional[Buffer] = None
    head_dim: int = 0
    gran: int = 1  # rows per slab must be a multiple (whole heads, or rope_rows runs, for RoPE)
    argmax_pairs: bool = False  # each slab also writes its stored rows' argmax pair (split_k 1, no bias)
    one_unit_per_slab: bool = False  # each slab exactly `gran` rows (RoPE runs shorter than a head)

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1]

    @property
    def width(self) -> int:
        return 2 if self.epilogue == Epilogue.SILU_MUL else 1


@dataclass(frozen=True)
class _Combine:
    """The attention partials a GEMV's combine prologue reads (ir.GemvParams combine_*)."""

    o: Buffer
    ml: Buffer
    splits: int
    q_heads: int
    head_dim: int

    def params(self) -> dict:
        return {"combine_splits": self.splits, "combine_q_heads": self.q_heads, "combine_head_dim": self.head_dim}


@dataclass
class _Spec:
    name: str
    params: object
    inputs: list[Operand]
    outputs: list[Operand]
    xcd: int = -1  # home XCD (-1: any queue)


def _op(buf: Buffer, off: int, n: int, count: int = 1, stride: int = 0, kv: KvMode = KvMode.NONE) -> Operand:
    return Operand(buf=buf.id, off=off, len=n, count=count, stride=stride if count > 1 else 0, kv=kv)


def _whole(buf: Buffer) -> Operand:
    return _op(buf, 0, buf.numel)


def _parts(partials: Optional[Buffer]) -> int:
    """The slices of a split-K partials buffer [slices, n] (0: none)."""
    return partials.shape[0] if partials is not None else 0


# logits an ARGMAX slice scans ('auto' argmax_splits): one 16-byte load for each thread of a
# 256-thread block at 16-bit logits. 8192 (four loads a thread, item 45) -> 2048: 63 slices on the
# 1B -0.14 %, 24 on the SmolLM2 shape -0.14 % (eval/PERF_NOTES.md item 196)
ARGMAX_SLICE = 2048
ZERO_CHUNK = 32  # columns of an x sum in the GEMV's zero term (vm/loader.py XSUM_CHUNK, gemv.cuh AMK_XSUM_CHUNK)


class _Lowering:
    def __init__(self, spec: ModelSpec, cfg: ScheduleConfig, target: GpuTarget, kv_capacity: int,
                 native: Optional[Mapping[str, QuantizedWeight]] = None):
        self.spec, self.cfg, self.target, self.kv_capacity = spec, cfg, target, kv_capacity
        if cfg.quant == "gguf" and native is None:
            raise ValueError("quant='gguf' is only valid for a GGUF source: lower() needs the file's quantized "
                             "tensors (load_model(source, native_quant=True)[2].tensors)")
        self.native = dict(native or {}) if cfg.quant == "gguf" else {}
        self.dtype = PROGRAM_DTYPES[cfg.dtype or spec.dtype]
        if self.dtype not in target.dtypes:
            raise ValueError(f"target {target.name} does not support {self.dtype.name}")
        self.scale_dtype = DType.F32 if self.dtype == DType.F32 else DType.F16
        self.quant_dtype = {"none": None, "int8": DType.I8, "int4": DType.U4, "gguf": None}[cfg.quant]

        per_cu = cfg.blocks_per_sm
        if coresident_blocks(target, cfg.threads_per_block, per_cu) < target.compute_units * per_cu:
            raise ValueError(
                f"{per_cu} block(s) of {cfg.threads_per_block} threads per SM do not fit {target.name}"
            )
        if cfg.threads_per_block % target.warp_size:
            raise ValueError(f"threads_per_block must be a multiple of the {target.name} warp size {target.warp_size}")
        self.n_queues = min(target.compute_units * per_cu, cfg.max_queues or MAX_QUEUES, MAX_QUEUES)
        if cfg.xcd_placement is True and target.xcds < 2:
            raise ValueError(f"xcd_placement needs a multi-XCD target; {target.name} has one")
        on = cfg.xcd_placement is True or (cfg.xcd_placement == "auto" and target.xcds > 1)
        self.xcds = min(target.xcds, self.n_queues) if on else 1  # XCDs that get a home (queue q is on XCD q % xcds)
        s = cfg.gemv_tasks_per_matrix
        self.slabs = -(-self.n_queues // cfg.split_k) if s == "auto" else s
        kvh = spec.num_kv_heads
        if cfg.kv_splits == "auto":
            fill = -(-kv_capacity // cfg.kv_block)
            # floor, not ceil: one more split than queues/kv_heads puts two partials on some
            # queue, back to back on the critical path (measured: attention 2x slower); at least
            # MIN_SPLIT_POSITIONS positions a split and at most AUTO_MAX_KV_SPLITS splits, since
            # every split adds to each combine's sums (SmolLM2's 3 KV heads at ctx 1024: 44
            # splits -> 16, -5.4 %; 18 only -4.1 %; eval/PERF_NOTES.md item 123)
            short = max(1, kv_capacity // MIN_SPLIT_POSITIONS)
            self.kv_splits = max(1, min(AUTO_MAX_KV_SPLITS, self.n_queues // kvh, fill, short))
        else:
            self.kv_splits = cfg.kv_splits
        a = cfg.argmax_splits
        self.argmax_splits = min(-(-spec.vocab_size // ARGMAX_SLICE), self.n_queues, 64) if a == "auto" else a
        if spec.vocab_size > PAIR_INDEX_LIMIT:  # a slice's pair holds its index as fp32
            self.argmax_splits = 1

        # q/k GEMV tasks with RoPE: whole heads, or runs of rope_rows rows (schedule/rope_rows.py),
        # sized so that the q/k tasks take at most their share (by rows) of the stage's slabs
        d, qk_rows = spec.head_dim, (spec.num_heads + kvh) * spec.head_dim
        share = self.slabs * qk_rows // (qk_rows + kvh * d)
        self.rope_rows = rope_rows.choose(cfg.rope_rows, d, spec.num_heads + kvh, share,
                                          whole_heads_only=spec.qk_norm or not cfg.fuse_rope_append,
                                          multi_run=cfg.rope_multi_run)
        self.permuted: list[str] = []  # buffers whose rows bind_weights permutes

        self.buffers: list[Buffer] = []
        self.by_name: dict[str, Buffer] = {}
        self.counters: list[Counter] = []
        self.tasks: list[Task] = []
        self.home: list[int] = []  # per task: its XCD, or -1
        self.hz = HazardTracker()
        self._size: list[int] = []  # tasks per counter (group)

    # ------------------------------------------------------------------ buffers
    def buf(self, name: str, kind: BufferKind, dtype: DType, shape: list[int], **kw) -> Buffer:
        if name in self.by_name:
            b = self.by_name[name]
            assert (b.kind, b.dtype, b.shape) == (kind, dtype, tuple(shape)), name
            return b
        b = Buffer(id=len(self.buffers), name=name, kind=kind, dtype=dtype, shape=shape, **kw)
        self.buffers.append(b)
        self.by_name[name] = b
        self.hz.kinds[b.id] = kind
        return b

    def act(self, name: str, n: int) -> Buffer:
        return self.buf(name, BufferKind.ACTIVATION, self.dtype, [n])

    def weight(self, name: str, shape: list[int]) -> Buffer:
        return self.buf(name, BufferKind.WEIGHT, self.dtype, shape)

    def quantizes(self, name: str) -> bool:
        """Whether the config quantizes matrix `name` (with 'gguf': whether the file holds it
        in a native quantized type)."""
        if self.cfg.quant == "gguf":
            return source_name(name, self.spec) in self.native
        return self.quant_dtype is not None

    def linear(self, name: str, rows: int, k: int, quantize: bool = True) -> Buffer:
        """A [rows, k] weight, quantized per the config (with its companions)."""
        if not quantize or not self.quantizes(name):
            return self.weight(name, [rows, k])
        if name in self.by_name:
            return self.by_name[name]
        if self.cfg.quant == "gguf":
            return self.native_linear(name, rows, k)
        g = group_for(k, self.cfg.quant_group)
        asym = self.cfg.quant_asym and self.quant_dtype == DType.I8
        if asym and g % ZERO_CHUNK:  # the device's zero term sums x over whole 32-column chunks
            raise ValueError(f"{name}: quant_asym needs groups of whole {ZERO_CHUNK}-column chunks; K={k} gives "
                             f"group {g}")
        scale = self.buf(name + ".scale", BufferKind.WEIGHT, self.scale_dtype, [rows, k // g])
        zero = None
        if self.quant_dtype == DType.U4 or asym:
            zero = self.buf(name + ".zero", BufferKind.WEIGHT, self.scale_dtype, [rows, k // g]).id
        return self.buf(name, BufferKind.WEIGHT, self.quant_dtype, [rows, k], scale=scale.id, zero=zero, group=g)

    def native_linear(self, name: str, rows: int, k: int) -> Buffer:
        """A matrix in the layout the GGUF file holds it in (I8/U4, its group, its scale dtype)."""
        q = self.native[source_name(name, self.spec)]
        if tuple(q.shape) != (rows, k):
            raise ValueError(f"{name}: native quantized tensor of shape {tuple(q.shape)}, expected {(rows, k)}")
        sdt = COMPANION_DTYPES[str(q.scale.dtype)]
        scale = self.buf(name + ".scale", BufferKind.WEIGHT, sdt, [rows, k // q.group])
        zero = None
        if q.zero is not None:
            zero = self.buf(name + ".zero", BufferKind.WEIGHT, sdt, [rows, k // q.group]).id
        return self.buf(name, BufferKind.WEIGHT, q.dtype, [rows, k], scale=scale.id, zero=zero, group=q.group)

    # ------------------------------------------------------------------ tasks
    def group(self, name: str, specs: list[_Spec]) -> int:
        """Emit tasks that share one counter; their waits come from the hazard tracker."""
        cid = len(self.counters)
        self.counters.append(Counter(id=cid, name=name))
        done = []
        for s in specs:
            acc = self.hz.accesses(s.inputs, s.outputs)
            deps = self.hz.deps(s.inputs, s.outputs, acc)
            waits = [Wait(counter=d, threshold=self._size[d]) for d in deps]
            self.tasks.append(Task(id=len(self.tasks), params=s.params, inputs=s.inputs, outputs=s.outputs,
                                   waits=waits, out_counter=cid, name=s.name))
            self.home.append(s.xcd)
            done.append((s.inputs, s.outputs, deps, acc))
        self._size.append(len(specs))
        self.hz.commit(cid, done)
        return cid

    # ------------------------------------------------------------------ GEMV stages
    def gemv_stage(self, name: str, mats: list[_Mat], x: Optional[Buffer], norm: Optional[Buffer],
                   counter_of: Optional[Callable[[str, int], int]] = None,
                   combine: Optional["_Combine"] = None, x_part: Optional[Buffer] = None) -> Optional[Buffer]:
        """Row slabs of every matrix in `mats` (one counter), split-K partials + REDUCE
        when split_k > 1. `norm` is the RMSNorm gamma fused into the prologue, if any;
        `combine` (split_k 1 only) the attention partials that each task combines into x;
        `x_part` (with `norm`, split_k 1) split-K partials [n, k] that x is read with.
        `counter_of(role, r0)`, if given, splits the stage's output tasks over several
        counters (slabs with one key share one), so that a consumer of part of the output
        waits only for the slabs that write it. Returns the argmax pairs [slabs, 2] that the
        slabs of a matrix with `argmax_pairs` write (split_k 1 only; None otherwise)."""
        cfg = self.cfg
        counts = _allocate(self.slabs, mats)
        sk = cfg.split_k
        eps = self.spec.rms_norm_eps if norm is not None else None
        partial_groups: list[tuple[_Mat, list[tuple[int, int]], Optional[Buffer]]] = []
        direct: list[_Spec] = []  # one counter for the stage's GEMV (or partial) tasks
        keys: list[int] = []  # counter_of of each of them
        pairs: Optional[Buffer] = None
        first_xcd = 0
        for m, n_slabs in zip(mats, counts, strict=True):
            slabs = self.row_slabs(m, n_slabs, first_xcd)
            first_xcd += len({x for _, _, x in slabs})  # the next matrix starts on the next XCD
            if sk == 1:
                ksl = [(0, m.k)]
            else:
                kg = m.w.group if m.w.group else (8 if m.k % 8 == 0 else 1)
                ksl = tiles(m.k, sk, kg)
                if len(ksl) != sk:
                    raise ValueError(f"{m.w.name}: K={m.k} cannot be split into {sk} slices of multiples of {kg}")
            scratch = None
            if sk > 1:
                scratch = self.buf(f"splitk.{m.role}", BufferKind.SCRATCH, DType.F32, [sk, m.rows * m.width])
            with_pairs = m.argmax_pairs and sk == 1 and m.bias is None
            if with_pairs:
                pairs = self.buf(f"{m.role}.argmax_pairs", BufferKind.SCRATCH, DType.F32, [len(slabs), 2])
            for slab, (r0, r1, xcd) in enumerate(slabs):
                rows = r1 - r0
                for s, (k_lo, k_hi) in enumerate(ksl):
                    params = GemvParams(
                        rows=rows, k=m.k, k_lo=k_lo, k_hi=k_hi, split_k=sk, norm_eps=eps,
                        has_bias=m.bias is not None, epilogue=m.epilogue, head_dim=m.head_dim,
                        head_norm_eps=self.spec.rms_norm_eps if m.head_gamma is not None else None,
                        unpack=cfg.quant_unpack if m.w.group else 0,
                        **(combine.params() if combine else {}),
                        x_partials=_parts(x_part), residual_partials=_parts(m.res_part),
                        argmax_pair_base=r0 if with_pairs else None,
                    )
                    ins = [self.w_op(m.w, r0, rows, k_lo, k_hi)]
                    if combine:
                        ins += [_whole(combine.o), _whole(combine.ml)]
                    else:
                        ins.append(_op(x, 0, m.k) if norm is not None else _op(x, k_lo, k_hi - k_lo))
                    if x_part is not None:
                        ins.append(_op(x_part, 0, m.k, count=_parts(x_part), stride=m.k))
                    if norm is not None:
                        ins.append(_whole(norm))
                    ins += self.q_ops(m.w, r0, rows, k_lo, k_hi)
                    if m.w2 is not None:
                        ins.append(self.w_op(m.w2, r0, rows, k_lo, k_hi))
                        ins += self.q_ops(m.w2, r0, rows, k_lo, k_hi)
                    if sk == 1:
                        ins += self.extras(m, r0, rows)
                        outs = [m.y(r0, rows)] + ([_op(pairs, 2 * slab, 2)] if with_pairs else [])
                    else:
                        R, w = m.rows * m.width, m.width
                        outs = [_op(scratch, s * R + r0 * w, rows * w)]
                    tag = f"{name}.{m.role}[{r0}:{r1}]" + (f".k{s}" if sk > 1 else "")
                    direct.append(_Spec(tag, params, ins, outs, xcd))
                    keys.append(counter_of(m.role, r0) if counter_of else 0)
            partial_groups.append((m, slabs, scratch))
        # split-K partials share one counter per stage too: a producer set must write each
        # scratch buffer without gaps (validator `tile-gap`), and a per-slab set would not
        if sk == 1:
            self.groups_by_key(name, direct, keys)
            return pairs
        self.group(f"{name}.partial", direct)
        reduce_specs, keys = [], []
        for m, slabs, scratch in partial_groups:
            R, w = m.rows * m.width, m.width
            for r0, r1, xcd in slabs:
                rows = r1 - r0
                params = ReduceParams(
                    rows=rows, split_k=sk, has_bias=m.bias is not None, epilogue=m.epilogue, head_dim=m.head_dim,
                    head_norm_eps=self.spec.rms_norm_eps if m.head_gamma is not None else None,
                )
                ins = [_op(scratch, r0 * w, rows * w, count=sk, stride=R)] + self.extras(m, r0, rows)
                reduce_specs.append(_Spec(f"{name}.{m.role}[{r0}:{r1}].reduce", params, ins, [m.y(r0, rows)], xcd))
                keys.append(counter_of(m.role, r0) if counter_of else 0)
        self.groups_by_key(f"{name}.reduce", reduce_specs, keys)
        return None

    def groups_by_key(self, name: str, specs: list[_Spec], keys: list[int]) -> None:
        """One counter per distinct key (in order of first appearance), tasks in lowering
        order within each; a single key keeps the stage's name."""
        order = list(dict.fromkeys(keys))
        for k in order:
            self.group(name if len(order) == 1 else f"{name}.c{k}", [s for s, kk in zip(specs, keys) if kk == k])

    def row_slabs(self, m: _Mat, n: int, first_xcd: int) -> list[tuple[int, int, int]]:
        """About n slabs [r0, r1) of m's rows, each with its home XCD (-1: any). With XCD
        placement the rows are first cut into one contiguous part per XCD (matrices of a stage
        start on successive XCDs), so the tasks of one XCD stream one slab of weights."""
        if self.xcds == 1:
            return [(r0, r1, -1) for r0, r1 in tiles(m.rows, n, m.gran)]
        parts = tiles(m.rows, self.xcds, m.gran)
        per = -(-n // len(parts))
        return [(a + r0, a + r1, (first_xcd + x) % self.xcds)
                for x, (a, b) in enumerate(parts) for r0, r1 in tiles(b - a, per, m.gran)]

    def w_op(self, w: Buffer, r0: int, rows: int, k_lo: int, k_hi: int) -> Operand:
        k = w.shape[1]
        return _op(w, r0 * k + k_lo, k_hi - k_lo, count=rows, stride=k)

    def q_ops(self, w: Buffer, r0: int, rows: int, k_lo: int, k_hi: int) -> list[Operand]:
        if w.scale is None:
            return []
        g = w.group
        per_row = w.shape[1] // g
        comps = [w.scale] + ([w.zero] if w.zero is not None else [])
        return [_op(self.buffers[c], r0 * per_row + k_lo // g, (k_hi - k_lo) // g, count=rows, stride=per_row)
                for c in comps]

    def extras(self, m: _Mat, r0: int, rows: int) -> list[Operand]:
        """Epilogue operands in opspec order: [bias] [residual] [head_gamma] [inv_freq pos | pos]."""
        ops = []
        if m.bias is not None:
            ops.append(_op(m.bias, r0, rows))
        if m.epilogue == Epilogue.ADD:
            ops.append(_op(m.residual, r0, rows))
            if m.res_part is not None:
                ops.append(_op(m.res_part, r0, rows, count=_parts(m.res_part), stride=m.rows))
        if m.head_gamma is not None:
            ops.append(_whole(m.head_gamma))
        if m.epilogue in ROPE_EPILOGUES:  # the frequencies of the slab's runs: the table holds
            # each head's once, so run-aligned row r0 starts at entry r0 / 2 (rope_rows.py)
            ops += [_op(self.inv_freq, r0 // 2, rows // 2), _whole(self.pos)]
        elif m.epilogue == Epilogue.APPEND:
            ops.append(_whole(self.pos))
        return ops

    def sliced_o_proj(self, name: str, wo: Buffer, o_part: Buffer, ml: Buffer, slices: int) -> Buffer:
        """ScheduleConfig.o_proj_kv_slices: the o-proj cut along K into `slices` slices of whole
        KV heads; each task combines its slice's attention partials in its prologue and writes
        the slice's partial sum of its rows into a scratch [slices, H], which the next GEMVs read
        with x (gemv_stage x_part, _Mat res_part) in place of a REDUCE. Returns the scratch."""
        spec, cfg = self.spec, self.cfg
        nkv, qh, d, S = spec.num_kv_heads, spec.q_per_kv, spec.head_dim, self.kv_splits
        if nkv % slices:  # (split_k 1 and the fused norm and residual: ScheduleConfig checks them)
            raise ValueError(f"o_proj_kv_slices={slices} must divide the {nkv} KV heads")
        H, heads = wo.shape[0], nkv // slices
        span = heads * qh * d
        if wo.group and span % wo.group:
            raise ValueError(f"o_proj_kv_slices={slices}: a slice of {span} columns does not align to "
                             f"{wo.name}'s quantization group of {wo.group}")
        scratch = self.buf("o_proj.partial", BufferKind.SCRATCH, DType.F32, [slices, H])
        mat = _Mat("o", wo, lambda r0, n: _op(scratch, r0, n))  # (its rows and granule cut the slabs)
        specs = []
        for r0, r1, xcd in self.row_slabs(mat, -(-self.slabs // slices), 0):
            rows = r1 - r0
            for j in range(slices):
                k_lo, k_hi, g0 = j * span, (j + 1) * span, j * heads
                params = GemvParams(rows=rows, k=wo.shape[1], k_lo=k_lo, k_hi=k_hi, split_k=slices,
                                    unpack=cfg.quant_unpack if wo.group else 0,
                                    **_Combine(o_part, ml, S, qh, d).params())
                ins = [self.w_op(wo, r0, rows, k_lo, k_hi), _op(o_part, g0 * S * qh * d, heads * S * qh * d),
                       _op(ml, g0 * S * qh * 2, heads * S * qh * 2)] + self.q_ops(wo, r0, rows, k_lo, k_hi)
                specs.append(_Spec(f"{name}[{r0}:{r1}].k{j}", params, ins, [_op(scratch, j * H + r0, rows)], xcd))
        self.group(name, specs)
        return scratch

    # ------------------------------------------------------------------ standalone ops
    def rmsnorm(self, name: str, x: Buffer, gamma: Buffer, y: Buffer) -> None:
        h = x.numel
        self.group(name, [
            _Spec(f"{name}[{c0}:{c1}]", RmsNormParams(hidden=h, col=c0, eps=self.spec.rms_norm_eps),
                  [_whole(x), _op(gamma, c0, c1 - c0)], [_op(y, c0, c1 - c0)])
            for c0, c1 in tiles(h, self.slabs)
        ])

    def binary(self, name: str, op: Op, a: Buffer, b: Buffer, y: Buffer) -> None:
        n = a.numel
        mk = AddParams if op == Op.ADD else SiluMulParams
        self.group(name, [
            _Spec(f"{name}[{c0}:{c1}]", mk(n=c1 - c0), [_op(a, c0, c1 - c0), _op(b, c0, c1 - c0)],
                  [_op(y, c0, c1 - c0)])
            for c0, c1 in tiles(n, self.slabs)
        ])

    def per_head(self, parts: list[tuple[str, Buffer, Buffer, int]], kind: Op, name: str,
                 gammas: dict[str, Buffer] | None = None) -> None:
        """HEAD_NORM / ROPE / KV_APPEND over whole-head tiles of several vectors, one counter."""
        d = self.spec.head_dim
        specs = []
        for role, src, dst, heads in parts:
            for h0, h1 in tiles(heads, self.slabs):
                off, n = h0 * d, (h1 - h0) * d
                if kind == Op.HEAD_NORM:
                    p = HeadNormParams(head_dim=d, heads=h1 - h0, eps=self.spec.rms_norm_eps)
                    ins, out = [_op(src, off, n), _whole(gammas[role])], _op(dst, off, n)
                elif kind == Op.ROPE:
                    p = RopeParams(head_dim=d, heads=h1 - h0)
                    ins, out = [_op(src, off, n), _op(self.inv_freq, 0, d // 2), _whole(self.pos)], _op(dst, off, n)
                else:
                    p = KvAppendParams(n=n)
                    ins, out = [_op(src, off, n), _whole(self.pos)], _op(dst, off, n, kv=KvMode.APPEND)
                specs.append(_Spec(f"{name}.{role}[{h0}:{h1}]", p, ins, [out]))
        self.group(name, specs)

    # ------------------------------------------------------------------ the model
    def run(self) -> Program:
        spec, cfg = self.spec, self.cfg
        H, V, F, L, d = spec.hidden_size, spec.vocab_size, spec.intermediate_size, spec.num_layers, spec.head_dim
        nq, nkv, qh = spec.num_heads, spec.num_kv_heads, spec.q_per_kv
        QD, KD = nq * d, nkv * d
        if nq % nkv or d % 2 or d > MAX_HEAD_DIM:
            raise ValueError(f"unsupported head layout: {nq} heads, {nkv} kv heads, head_dim {d}")

        self.token = self.buf("token", BufferKind.IO_INPUT, DType.I32, [1])
        self.pos = self.buf("pos", BufferKind.IO_INPUT, DType.I32, [1])
        logits = self.buf("logits", BufferKind.IO_OUTPUT, self.dtype, [V])  # HF: the lm_head returns its dtype
        next_token = self.buf("next_token", BufferKind.IO_OUTPUT, DType.I32, [1])
        self.inv_freq = self.buf(INV_FREQ, BufferKind.CONST, DType.F32, [nq * d // 2])  # d/2 a q head
        embed = self.weight("model.embed_tokens.weight", [V, H])
        x = self.act("x", H)

        self.group("embed", [_Spec("embed", EmbedParams(vocab=V, hidden=H),
                                   [_whole(self.token), _op(embed, 0, H, count=V, stride=H)], [_whole(x)])])

        def kv_group(role: str, r0: int) -> int:  # the KV head whose attention reads rows r0.. of q/k/v
            return r0 // d // qh if role == "q" else r0 // d

        def normed(name: str, gamma: Buffer) -> tuple[Buffer, Optional[Buffer]]:
            if cfg.fuse_norm:
                return x, gamma
            xn = self.act("xn", H)
            self.rmsnorm(name, x, gamma, xn)
            return xn, None

        def into(buf: Buffer, kv: KvMode = KvMode.NONE):
            return lambda r0, rows: _op(buf, r0, rows, kv=kv)

        for i in range(L):
            p, t = f"model.layers.{i}.", f"layers.{i}"
            kc = self.buf(f"{t}.k_cache", BufferKind.KV_CACHE, self.dtype, [self.kv_capacity, KD])
            vc = self.buf(f"{t}.v_cache", BufferKind.KV_CACHE, self.dtype, [self.kv_capacity, KD])
            a = p + "self_attn."
            wq, wk, wv = self.linear(a + "q_proj.weight", QD, H), self.linear(a + "k_proj.weight", KD, H), \
                self.linear(a + "v_proj.weight", KD, H)
            bq = bk = bv = qn = kn = None
            if spec.qkv_bias:
                bq, bk, bv = (self.weight(a + f"{m}_proj.bias", [n]) for m, n in (("q", QD), ("k", KD), ("v", KD)))
            if spec.qk_norm:
                qn, kn = self.weight(a + "q_norm.weight", [d]), self.weight(a + "k_norm.weight", [d])

            # ---- q/k/v
            xin, gamma = normed(f"{t}.attn_norm", self.weight(p + "input_layernorm.weight", [H]))
            q = self.act("q", QD)
            if cfg.fuse_rope_append:
                r = self.rope_rows
                if r < d:  # q/k rows permuted per head (schedule/rope_rows.py)
                    self.permuted += [b.name for b in (wq, wk, bq, bk) if b is not None]
                one_run = r < d and not cfg.rope_multi_run  # else whole runs, cut by bytes
                mats = [
                    _Mat("q", wq, into(q), Epilogue.ROPE, bias=bq, head_gamma=qn, head_dim=r, gran=r,
                         one_unit_per_slab=one_run),
                    _Mat("k", wk, into(kc, KvMode.APPEND), Epilogue.ROPE_APPEND, bias=bk, head_gamma=kn,
                         head_dim=r, gran=r, one_unit_per_slab=one_run),
                    _Mat("v", wv, into(vc, KvMode.APPEND), Epilogue.APPEND, bias=bv),
                ]
                self.gemv_stage(f"{t}.qkv", mats, xin, gamma, kv_group if cfg.kv_head_counters else None)
            else:
                q_raw, k_raw, v_raw = self.act("q_raw", QD), self.act("k_raw", KD), self.act("v_raw", KD)
                mats = [_Mat("q", wq, into(q_raw), bias=bq), _Mat("k", wk, into(k_raw), bias=bk),
                        _Mat("v", wv, into(v_raw), bias=bv)]
                self.gemv_stage(f"{t}.qkv", mats, xin, gamma)
                qs, ks = q_raw, k_raw
                if spec.qk_norm:
                    qs, ks = self.act("q_hn", QD), self.act("k_hn", KD)
                    self.per_head([("q", q_raw, qs, nq), ("k", k_raw, ks, nkv)], Op.HEAD_NORM, f"{t}.head_norm",
                                  {"q": qn, "k": kn})
                k_rot = self.act("k_rot", KD)
                self.per_head([("q", qs, q, nq), ("k", ks, k_rot, nkv)], Op.ROPE, f"{t}.rope")
                self.per_head([("k", k_rot, kc, nkv), ("v", v_raw, vc, nkv)], Op.KV_APPEND, f"{t}.kv_append")

            # ---- attention
            S = self.kv_splits
            o_part = self.buf("attn.o_partial", BufferKind.SCRATCH, DType.F32, [nkv, S, qh, d])
            ml = self.buf("attn.ml", BufferKind.SCRATCH, DType.F32, [nkv, S, qh, 2])
            scale = 1.0 / math.sqrt(d)
            # with XCD placement and whole heads per XCD, each XCD's partials get their own
            # counter, which only that XCD's combines wait on (an XCD-scoped edge)
            local = self.xcds > 1 and nkv % self.xcds == 0
            head_xcd = [g * self.xcds // nkv if local else -1 for g in range(nkv)]
            # kv_head_counters: a counter per KV head, so that its combine waits for its own partials
            # (neither split when every o-proj task combines all heads: it would wait for every
            # counter, more than MAX_WAITS on 8 KV heads or 8 XCDs)
            fused = cfg.fuse_attn_combine and cfg.split_k == 1
            # o_proj_kv_slices: a counter per slice of KV heads, which only that slice's o tasks wait on
            slices = cfg.o_proj_kv_slices
            per_head = cfg.kv_head_counters and not fused and not slices
            per_xcd = local and not fused and not slices
            if slices:
                cuts = tiles(nkv, slices)
            else:
                cuts = [(g, g + 1) for g in range(nkv)] if per_head else tiles(nkv, self.xcds if per_xcd else 1)
            for xi, (g0, g1) in enumerate(cuts):
                tag = f".g{g0}" if per_head else (f".x{xi}" if per_xcd else (f".s{xi}" if len(cuts) > 1 else ""))
                self.group(f"{t}.attn_partial" + tag, [
                    _Spec(f"{t}.attn_partial[g{g}.s{s}]",
                          AttnPartialParams(head_dim=d, q_heads=qh, splits=S, split=s, block=cfg.kv_block, scale=scale),
                          [_op(q, g * qh * d, qh * d), _op(kc, g * d, d, kv=KvMode.PREFIX),
                           _op(vc, g * d, d, kv=KvMode.PREFIX), _whole(self.pos)],
                          [_op(o_part, (g * S + s) * qh * d, qh * d), _op(ml, (g * S + s) * qh * 2, qh * 2)],
                          head_xcd[g])
                    for g in range(g0, g1) for s in range(S)
                ])
            combine, attn, o_sum = None, None, None
            wo = self.linear(a + "o_proj.weight", H, QD)
            if slices:  # the o-proj's slices combine their own heads; the MLP's GEMVs add their sums
                o_sum = self.sliced_o_proj(f"{t}.o_proj", wo, o_part, ml, slices)
            elif fused:  # every o-proj task combines all heads itself
                combine = _Combine(o_part, ml, S, qh, d)
            else:
                attn = self.act("attn_out", QD)
                self.group(f"{t}.attn_combine", [
                    _Spec(f"{t}.attn_combine[g{g}]", AttnCombineParams(head_dim=d, q_heads=qh, splits=S),
                          [_op(o_part, g * S * qh * d, S * qh * d), _op(ml, g * S * qh * 2, S * qh * 2)],
                          [_op(attn, g * qh * d, qh * d)], head_xcd[g])
                    for g in range(nkv)
                ])

            # ---- o-proj (+ residual)
            if not slices:
                self.residual_gemv(f"{t}.o_proj", "o", wo, attn, x, "attn_proj", combine)

            # ---- mlp
            m = p + "mlp."
            wg, wu = self.linear(m + "gate_proj.weight", F, H), self.linear(m + "up_proj.weight", F, H)
            xin, gamma = normed(f"{t}.mlp_norm", self.weight(p + "post_attention_layernorm.weight", [H]))
            h = self.act("mlp_h", F)
            if cfg.fuse_silu_mul and (wg.dtype, wg.group) == (wu.dtype, wu.group):  # one layout for w, w2
                self.gemv_stage(f"{t}.gate_up", [_Mat("gate_up", wg, into(h), Epilogue.SILU_MUL, w2=wu)], xin, gamma,
                                x_part=o_sum)
            else:
                g_act, u_act = self.act("mlp_gate", F), self.act("mlp_up", F)
                self.gemv_stage(f"{t}.gate_up", [_Mat("gate", wg, into(g_act)), _Mat("up", wu, into(u_act))],
                                xin, gamma, x_part=o_sum)
                self.binary(f"{t}.silu_mul", Op.SILU_MUL, g_act, u_act, h)
            wd = self.linear(m + "down_proj.weight", H, F)
            self.residual_gemv(f"{t}.down", "down", wd, h, x, "mlp_out", res_part=o_sum)

        # ---- final norm, LM head, argmax
        xin, gamma = normed("final_norm", self.weight("model.norm.weight", [H]))
        if spec.tie_word_embeddings:
            head = self.linear(LM_HEAD_Q, V, H) if cfg.quant_lm_head and self.quantizes(LM_HEAD_Q) else embed
        else:
            head = self.linear("lm_head.weight", V, H, quantize=cfg.quant_lm_head)
        fuse = cfg.fuse_argmax and spec.vocab_size <= PAIR_INDEX_LIMIT
        pairs = self.gemv_stage(LM_HEAD_STAGE, [_Mat("lm_head", head, into(logits), argmax_pairs=fuse)], xin, gamma)
        self.argmax_fused = pairs is not None
        self.argmax(logits, next_token, pairs)
        return self.program()

    def argmax(self, logits: Buffer, token: Buffer, pairs: Optional[Buffer] = None) -> None:
        """token = argmax(logits): one task, or PARTIAL tasks over slices (16-byte aligned for
        the vector loads) and a MERGE of their (max, index) pairs; with `pairs` (the LM head's
        tasks wrote one each: fuse_argmax) the MERGE of those alone."""
        if pairs is not None:
            self.group("argmax", [_Spec("argmax.merge", ArgmaxParams(n=pairs.shape[0], mode=ArgmaxMode.MERGE),
                                        [_whole(pairs)], [_whole(token)])])
            return
        V, s = logits.numel, self.argmax_splits
        if s == 1:
            self.group("argmax", [_Spec("argmax", ArgmaxParams(n=V), [_whole(logits)], [_whole(token)])])
            return
        chunk = (-(-V // s) + 7) // 8 * 8  # ceil(V / s), rounded up to whole 16-byte vectors
        slices = [(b, min(chunk, V - b)) for b in range(0, V, chunk)]
        pairs = self.buf("argmax.pairs", BufferKind.SCRATCH, DType.F32, [len(slices), 2])
        self.group("argmax.partial", [
            _Spec(f"argmax.partial{i}", ArgmaxParams(n=n, mode=ArgmaxMode.PARTIAL, base=b),
                  [_op(logits, b, n)], [_op(pairs, 2 * i, 2)]) for i, (b, n) in enumerate(slices)])
        self.group("argmax", [_Spec("argmax.merge", ArgmaxParams(n=len(slices), mode=ArgmaxMode.MERGE),
                                    [_whole(pairs)], [_whole(token)])])

    def residual_gemv(self, name: str, role: str, w: Buffer, src: Optional[Buffer], x: Buffer, tmp: str,
                      combine: Optional["_Combine"] = None, res_part: Optional[Buffer] = None) -> None:
        """x += W src: the residual add fused into the epilogue (in place), or a STORE plus ADD.
        With `combine`, src is computed by each task's combine prologue instead of read; with
        `res_part` (fused only), x is read with those split-K partials (x + their sum)."""
        if self.cfg.fuse_residual:
            mat = _Mat(role, w, lambda r0, n: _op(x, r0, n), Epilogue.ADD, residual=x, res_part=res_part)
            self.gemv_stage(name, [mat], src, None, combine=combine)
        else:
            out = self.act(tmp, x.numel)
            self.gemv_stage(name, [_Mat(role, w, lambda r0, n: _op(out, r0, n))], src, None, combine=combine)
            self.binary(f"{name}.add", Op.ADD, x, out, x)

    def largest_layer_task_bytes(self) -> Optional[int]:
        """The weight bytes of the largest layer GEMV task (the LM head does not count); None
        without one. What the 'auto' VM knobs below are chosen by."""
        layer_bytes = [placement.weight_bytes(t, self.buffers) for t in self.tasks if _is_layer_gemv(t)]
        return max(layer_bytes) if layer_bytes else None

    def prefetch_depth(self) -> int:
        """ScheduleConfig.prefetch_depth resolved ('auto': 0 for programs of small GEMV tasks)."""
        if self.cfg.prefetch_depth != "auto":
            return self.cfg.prefetch_depth
        largest = self.largest_layer_task_bytes()
        return 0 if largest is not None and largest <= SMALL_TASK_KB * 1024 else 1

    def poll_cap_ns(self) -> int:
        """ScheduleConfig.poll_cap_ns resolved ('auto': the short cap for programs of GEMV tasks
        up to SHORT_POLL_TASK_KB; their stages are short enough that a long sleep shows)."""
        if self.cfg.poll_cap_ns != "auto":
            return self.cfg.poll_cap_ns
        largest = self.largest_layer_task_bytes()
        return SHORT_POLL_CAP_NS if largest is not None and largest <= SHORT_POLL_TASK_KB * 1024 else VM_POLL_CAP_NS

    def gemv_loads_ahead(self) -> bool:
        """ScheduleConfig.gemv_loads_ahead resolved ('auto': on for programs whose largest layer
        GEMV task streams more than SMALL_TASK_KB, except asymmetric int8, whose GEMV does not
        take that loop)."""
        if self.cfg.gemv_loads_ahead != "auto":
            return self.cfg.gemv_loads_ahead
        if any(b.kind == BufferKind.WEIGHT and b.dtype == DType.I8 and b.zero is not None for b in self.buffers):
            return False
        largest = self.largest_layer_task_bytes()
        return largest is not None and largest > SMALL_TASK_KB * 1024

    def program(self) -> Program:
        cfg = self.cfg
        cost = placement.task_costs(self.tasks, self.buffers, self.kv_capacity)
        n_xcd = self.target.xcds
        queues = placement.assign(self.tasks, self.n_queues, cfg.sm_assignment, cost, cfg.explicit_queues,
                                  home=self.home, n_xcd=n_xcd)
        counters = self.counters
        if self.xcds > 1:
            counters = placement.narrow_scopes(counters, self.tasks, queues, n_xcd)
        meta = {
            "model": self.spec.name,
            "family": self.spec.family,
            "dtype": self.dtype.name,
            "config": cfg.model_dump(mode="json"),
            "resolved": {"queues": self.n_queues, "gemv_tasks_per_matrix": self.slabs, "kv_splits": self.kv_splits,
                         "argmax_splits": self.argmax_splits, "fuse_argmax": self.argmax_fused,
                         "xcds": self.xcds},
            "vm": {"prefetch_depth": self.prefetch_depth(), "prefetch_kb": cfg.prefetch_kb,
                   "prefetch_min_kb": cfg.prefetch_min_kb, "gemv_unroll": cfg.gemv_unroll,
                   "gemv_unroll_quant": cfg.gemv_unroll_quant, "poll_cap_ns": self.poll_cap_ns(),
                   "gemv_loads_ahead": self.gemv_loads_ahead(),
                   # head-major KV caches (vm/kv_layout.py): absent, row-major, as before the knob
                   **({"kv_head": self.spec.head_dim} if cfg.kv_head_major else {})},
        }
        if self.permuted:
            meta[rope_rows.META_KEY] = {"rows": self.rope_rows, "head_dim": self.spec.head_dim, "permuted": self.permuted}
        if cfg.quant == "gguf":  # which matrices run in the file's own blocks
            meta["gguf_native"] = {b.name: self.native[source_name(b.name, self.spec)].source
                                   for b in self.buffers if b.group is not None}
        prog = Program(
            name=self.spec.name, target=self.target, threads_per_block=cfg.threads_per_block,
            blocks_per_cu=cfg.blocks_per_sm, kv_capacity=self.kv_capacity, buffers=self.buffers,
            counters=counters, tasks=self.tasks, queues=queues, meta=meta,
        )
        prog.meta["stats"] = program_stats(prog)  # (the dict stays writable; provenance only)
        return prog


def _is_layer_gemv(t: Task) -> bool:
    return t.params.op == Op.GEMV and not t.name.startswith(LM_HEAD_STAGE)


def lower(spec: ModelSpec, config: ScheduleConfig | None, target: GpuTarget, *, kv_capacity: int = 2048,
          native: Optional[Mapping[str, QuantizedWeight]] = None) -> Program:
    """Lower one decode step of `spec` under `config` (default config if None) for `target`.

    `native`: with quant='gguf', the GGUF file's quantized matrices by HF name (only their
    layouts are read here; `bind_weights` binds their contents)."""
    if kv_capacity < 1:
        raise ValueError("kv_capacity must be >= 1")
    gc_was_on = gc.isenabled()
    gc.disable()  # ~10^5 small acyclic objects: GC passes would rescan the whole heap (seconds)
    try:
        return _Lowering(spec, config or ScheduleConfig(), target, kv_capacity, native).run()
    finally:
        if gc_was_on:
            gc.enable()
