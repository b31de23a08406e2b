"""The AMK schedule IR: the one data model every stage speaks.

A `Program` is one decode step as a DAG of coarse `Task`s over flat `Buffer`s. Tasks
synchronise only through monotonic `Counter`s: a task waits until each of its counters
reaches a static threshold, runs, then adds exactly 1 to its single `out_counter`.
Per-SM `queues` give the order in which each persistent block walks its tasks.

Every enum code and capacity constant lives here once; `vm/abi.h` mirrors them and
`tests/test_abi_sync.py` fails on any drift. Op semantics (what each operand means) are
documented on each params model and implemented once in `amk.instructions`.

Regions. An `Operand` names the elements a task touches in one buffer:
  * flat buffers: the union over c in [0, count) of [off + c*stride, off + c*stride + len)
    in the buffer's row-major flattening;
  * KV_CACHE buffers (shape [capacity, width]): the columns [off, off + len) of the
    row at the runtime position (`kv=APPEND`, a write) or of rows 0..position
    (`kv=PREFIX`, a read). Positions are runtime inputs, so one program serves every token.

Numerics (every op, CPU and GPU alike): operands are read and converted to fp32, all
arithmetic is fp32, and each store rounds to the output buffer's dtype. Half-precision
rounding points: where a value would be a half-precision tensor in Hugging Face's
half-precision Llama, it is rounded (RNE) to that dtype before it is used, the dtype being
the output buffer's (GEMV prologue: x's; ATTN_PARTIAL: q's), so a fused op rounds where the
unfused ops' stores would: RMSNorm y = rnd(rnd(x * r) * gamma) (also the GEMV prologue and
the head norm); a GEMV's row a = rnd(acc (+ bias)) before its epilogue; SILU_MUL
rnd(silu(gate)) * up; RoPE with rnd(cos), rnd(sin) and each product rounded; attention
scores t = rnd(scale * rnd(q.k)). (HF eager also rounds the normalised softmax
probabilities before P @ V; a split-KV partial never holds them, so that point is not
matched.) For fp32 buffers every such rounding is the identity. Quantized weights
dequantize as I8: w = code * scale[r, c // group], or, where the buffer names a zero
(asymmetric), w = code * scale[r, c // group] + zero[r, c // group]; U4: w = code *
scale[r, c // group] + zero[r, c // group] (zero holds the group minimum), codes unsigned
0..15 packed two per byte, element e in byte e // 2, low nibble first. The zero is then a
GEMV operand role (w_zero, w2_zero) like U4's. Scale/zero companions have shape
[rows, cols // group], any float dtype, and the weight's buffer records `group`. An
operand with count == 1 has no stride (it is ignored).

Runtime inputs: an IO_INPUT I32 buffer `pos` (len 1) holds this step's position p; the
KV length is p + 1. Ops that need it take `pos` as an operand.
"""

from __future__ import annotations

import enum
import json
import typing
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

IR_VERSION = 1


# ----------------------------------------------------------------------------- enums
class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2
    I32 = 3
    I8 = 4
    U4 = 5  # 4-bit codes packed two per byte (low nibble first); logical shape in elements


DTYPE_BITS = {DType.F32: 32, DType.F16: 16, DType.BF16: 16, DType.I32: 32, DType.I8: 8, DType.U4: 4}


class BufferKind(enum.IntEnum):
    WEIGHT = 0  # immutable model parameters
    CONST = 1  # immutable derived tables (RoPE inverse frequencies, ...)
    KV_CACHE = 2  # [capacity, width]; rows < position are read-only history
    IO_INPUT = 3  # written by the host before launch, read-only inside the step
    IO_OUTPUT = 4  # must be fully produced by the step
    ACTIVATION = 5
    SCRATCH = 6


IMMUTABLE_KINDS = frozenset({BufferKind.WEIGHT, BufferKind.CONST})


class Op(enum.IntEnum):
    EMBED = 0
    RMSNORM = 1
    GEMV = 2
    REDUCE = 3  # split-K reduction of GEMV partial sums, then the GEMV's epilogue
    ROPE = 4
    KV_APPEND = 5
    ATTN_PARTIAL = 6
    ATTN_COMBINE = 7
    SILU_MUL = 8
    ADD = 9
    ARGMAX = 10
    HEAD_NORM = 11  # per-head RMSNorm (Qwen3 q/k norm)


class Epilogue(enum.IntEnum):
    """What a GEMV (or its split-K REDUCE) does with each finished output row."""

    STORE = 0  # y = acc (+ bias)
    ADD = 1  # y = residual + acc (+ bias); residual is usually y itself (in place)
    SILU_MUL = 2  # y = silu(acc_gate) * acc_up; needs a second weight matrix
    ROPE = 3  # y = rope(headnorm?(acc)) per head; for q
    ROPE_APPEND = 4  # KV cache row[pos] = rope(headnorm?(acc)); for k
    APPEND = 5  # KV cache row[pos] = acc; for v


class KvMode(enum.IntEnum):
    NONE = 0
    APPEND = 1
    PREFIX = 2


class ArgmaxMode(enum.IntEnum):
    """What an ARGMAX task reads and writes (ArgmaxParams)."""

    WHOLE = 0  # logits -> token
    PARTIAL = 1  # a slice of the logits -> its (max, index) pair
    MERGE = 2  # the slices' pairs -> token


class Scope(enum.IntEnum):
    """Memory scope of a counter's release (signal) and acquire (wait).

    DEVICE orders memory for every block of the GPU. XCD orders it only among blocks of
    one XCD chiplet (AMD gfx942/gfx950: each XCD has a private L2, so an XCD-scoped edge
    skips the L2 write-back and invalidate). The validator (`scope` check) only lets a
    counter be XCD-scoped when all its producers and waiters run on one XCD."""

    DEVICE = 0
    XCD = 1


# ------------------------------------------------------------------ capacity caps
MAX_INPUTS = 10
MAX_OUTPUTS = 2
MAX_WAITS = 4
MAX_TASKS = 1 << 20
MAX_BUFFERS = 1 << 16
MAX_COUNTERS = 1 << 20
MAX_QUEUES = 1024
MAX_RANK = 4
MAX_HEAD_DIM = 256
MAX_KV_SPLITS = 64
MAX_THREADS = 1024
MAX_BUFFER_ELEMS = 1 << 36
PAIR_INDEX_LIMIT = 1 << 24  # an argmax pair holds its index as fp32: exact below 2^24 (not an ABI cap: no MAX_)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class _Frozen(_Model):
    """A program and everything in it are frozen, their sequences tuples, so what is derived
    from one once (its compact form, which the validator reads) stays true. To change one,
    make a changed copy: `replace(...)`."""

    model_config = ConfigDict(frozen=True)

    def replace(self, **fields: Any):
        """A copy with `fields` replaced, lists given as tuples: how a frozen IR object is
        changed. Not validated, as `model_copy(update=...)`; the copy derives what it keeps
        (a program's compact form) from its own fields."""
        copy = self.model_copy(update={k: _tupled(v) for k, v in fields.items()})
        copy.model_post_init(None)
        return copy


def _tupled(value: Any) -> Any:
    return tuple(map(_tupled, value)) if isinstance(value, (list, tuple)) else value


class _Kept:
    """A value derived from a frozen IR object, kept beside it with the fields it was derived
    from. Not part of the object's value: any two compare equal, so model equality (which
    compares private state too) ignores it."""

    __slots__ = ("source", "value")

    def __init__(self, source: tuple, value: Any):
        self.source, self.value = source, value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Kept)

    __hash__ = None


def keep(obj: BaseModel, name: str, source: tuple, value: Any) -> None:
    """Keep `value`, derived from `source` (`obj`'s fields that it depends on), with `obj`."""
    private = obj.__pydantic_private__
    if private is None:
        object.__setattr__(obj, "__pydantic_private__", {name: _Kept(source, value)})
    else:
        private[name] = _Kept(source, value)


def kept(obj: BaseModel, name: str, source: tuple) -> Any:
    """What `keep` kept with `obj` under `name`, if derived from `source` (its fields now:
    a copy with replaced fields carries its original's, and must not use them); else None."""
    private = getattr(obj, "__pydantic_private__", None)
    k = private.get(name) if private else None
    return k.value if k is not None and k.source == source else None


# ------------------------------------------------------------------ data objects
class Buffer(_Frozen):
    id: int
    name: str
    kind: BufferKind
    dtype: DType
    shape: tuple[int, ...]
    # quantized weights: companions [rows, cols/group] of per-group scale and zero (U4's minimum;
    # an asymmetric I8's value of code 0; a symmetric I8 has none)
    scale: Optional[int] = None
    zero: Optional[int] = None
    group: Optional[int] = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class Counter(_Frozen):
    id: int
    name: str = ""
    scope: Scope = Scope.DEVICE


class Wait(_Frozen):
    counter: int
    threshold: int


class Operand(_Frozen):
    buf: int
    off: int
    len: int
    count: int = 1
    stride: int = 0
    kv: KvMode = KvMode.NONE


# ------------------------------------------------------------------ per-op params
class EmbedParams(_Frozen):
    """inputs: [token (I32, len 1), table column tile (off=c0, len=n, count=vocab,
    stride=hidden)]; outputs: [x tile (len n)]. x = table[token, c0:c0+n]."""

    op: Literal[Op.EMBED] = Op.EMBED
    vocab: int
    hidden: int


class RmsNormParams(_Frozen):
    """inputs: [x (the whole vector, len hidden), gamma tile (len n)];
    outputs: [y tile (len n)]. y = x[col:col+n] * rsqrt(mean(x^2) + eps) * gamma."""

    op: Literal[Op.RMSNORM] = Op.RMSNORM
    hidden: int
    col: int
    eps: float


class GemvParams(_Frozen):
    """A slab of rows of y = W x, with fused prologue and epilogue.

    inputs, in this order (bracketed ones only when their flag says so; opspec.input_roles
    is the authority):
      w        rows x [k_lo, k_hi) of W (count=rows, stride=k, len=k_hi-k_lo)
      x        the input vector; the whole vector [0, k) if norm_eps is set, else [k_lo, k_hi)
               -- or, if combine_splits > 0 (the attention combine prologue), instead of x:
      o, ml    the attention partials of the KV heads of columns [k_lo, k_hi), laid out as
               ATTN_PARTIAL writes them: o [(k_hi - k_lo) / (combine_q_heads *
               combine_head_dim), combine_splits, combine_q_heads, combine_head_dim] and ml
               [.., 2]; x is then ATTN_COMBINE of each of those KV heads' partials,
               concatenated (len k_hi - k_lo) and rounded to y's dtype (where the standalone
               combine would have stored it; fp32, unrounded, for split-K partials), no norm
      [x_part] x_partials fp32 vectors shaped like x (count=x_partials, any stride)
                                                                if x_partials > 0
               (needs the norm prologue and split_k == 1): x is then read as
               rnd(x + rnd(sum_s x_part[s])), summed in order s = 0, 1, ..., rnd rounding to
               x's dtype -- what a split-K REDUCE with the ADD epilogue (residual x) would
               have stored into x, so the REDUCE stage can go (ScheduleConfig.o_proj_kv_slices)
      [gamma]  RMSNorm weight (len k)                        if norm_eps is not None
      [w_scale[, w_zero]]  for quantized w (w_zero where w names a zero: U4, asymmetric I8):
               tiles count=rows, stride=k/group, len (k_hi-k_lo)/group
      [w2[, w2_scale[, w2_zero]]]  the up-projection slab, shaped like w  if epilogue == SILU_MUL
      [bias]   len rows                                       if has_bias
      [residual] len rows                                     if epilogue == ADD
      [res_part] residual_partials fp32 vectors of len rows (count=residual_partials)
                                                              if residual_partials > 0
               (needs the ADD epilogue and split_k == 1): the residual is then read as
               rnd(residual + rnd(sum_s res_part[s])), as x_part does x (rnd: residual's dtype)
      [head_gamma] len head_dim                               if head_norm_eps is not None
      [inv_freq] len rows/2 and [pos] len 1                   if epilogue is ROPE/ROPE_APPEND
      [pos]    len 1                                          if epilogue == APPEND
    The epilogue extras ([bias] onwards) belong to the REDUCE task instead when split_k > 1.
    outputs: [y]: rows values (KV_CACHE with kv=APPEND for ROPE_APPEND/APPEND), or, when
    split_k > 1, the partial sums of this K slice into scratch (len rows*m, m=2 for
    SILU_MUL), which a REDUCE task finishes; the epilogue extras then belong to REDUCE.
      [pair]  F32, len 2                                     if argmax_pair_base is not None
               (needs the STORE epilogue, split_k == 1 and no bias): what an ARGMAX PARTIAL of the
               stored y with base argmax_pair_base writes: (the largest stored value, NaN
               maximal, argmax_pair_base + the first row holding it), exact in fp32 below
               2^24. The LM head's tasks write them, so the MERGE follows the GEMV directly
               (ScheduleConfig.fuse_argmax).

    Order of the epilogue on each finished row value a = acc (+ bias):
      STORE: y = a.  ADD: y = residual + a.  SILU_MUL: y = silu(a_gate) * a_up (each with
      its own accumulator; no bias).  ROPE / ROPE_APPEND: a slab covers whole heads (rows
      and the slab start are multiples of head_dim); per head: optional head RMSNorm
      (head_gamma, head_norm_eps), then rotate-half RoPE of head h at angle
      pos * inv_freq[h * d/2 + i] (each head its own d/2 frequencies, so that a slab can
      span runs of different frequencies, eval/PERF_NOTES.md item 113):
      y[i] = a[i] cos - a[i + d/2] sin, y[i + d/2] = a[i + d/2] cos + a[i] sin.
      APPEND: cache row[pos] = a.
    The norm prologue: xn[c] = x[c] * rsqrt(mean_{c<k} x[c]^2 + norm_eps) * gamma[c].
    Split-K scratch layout: a scratch buffer [split_k, R*m] for a matrix of R rows; the
    task for row slab r0 and split s writes off = s*R*m + r0*m, len rows*m, element
    (r, j) at r*m + j (j=0 gate/plain, j=1 up).
    """

    op: Literal[Op.GEMV] = Op.GEMV
    rows: int
    k: int
    k_lo: int = 0
    k_hi: int
    split_k: int = 1
    norm_eps: Optional[float] = None
    has_bias: bool = False
    epilogue: Epilogue = Epilogue.STORE
    head_dim: int = 0
    head_norm_eps: Optional[float] = None
    unpack: int = 0  # quantized unpack strategy (VM knob; semantics unchanged)
    combine_splits: int = 0  # > 0: x is the attention combine of o/ml partials (see above)
    combine_q_heads: int = 0
    combine_head_dim: int = 0
    x_partials: int = 0  # > 0: x is read as x + these split-K partials (see above)
    residual_partials: int = 0  # > 0: the residual is read as residual + these partials
    argmax_pair_base: Optional[int] = None  # not None: the second output, y's argmax pair (see above)


class ReduceParams(_Frozen):
    """inputs: [partials (count=split_k, stride=total row width of the scratch, len rows*m)]
    then the epilogue extras exactly as GEMV lists them ([bias], [residual],
    [head_gamma], [inv_freq, pos] / [pos]); outputs: [y] as GEMV's."""

    op: Literal[Op.REDUCE] = Op.REDUCE
    rows: int
    split_k: int
    has_bias: bool = False
    epilogue: Epilogue = Epilogue.STORE
    head_dim: int = 0
    head_norm_eps: Optional[float] = None


class RopeParams(_Frozen):
    """inputs: [x (len heads*head_dim), inv_freq (len head_dim/2), pos]; outputs: [y (len
    heads*head_dim)]. Rotate-half RoPE per head at the runtime position."""

    op: Literal[Op.ROPE] = Op.ROPE
    head_dim: int
    heads: int


class HeadNormParams(_Frozen):
    """inputs: [x (len heads*head_dim), gamma (len head_dim)]; outputs: [y same len].
    RMSNorm over each head separately."""

    op: Literal[Op.HEAD_NORM] = Op.HEAD_NORM
    head_dim: int
    heads: int
    eps: float


class KvAppendParams(_Frozen):
    """inputs: [src (len n), pos]; outputs: [cache (kv=APPEND, columns off..off+n)]."""

    op: Literal[Op.KV_APPEND] = Op.KV_APPEND
    n: int


class AttnPartialParams(_Frozen):
    """Attention of `q_heads` query heads sharing one KV head over split `split` of
    `splits` of the positions 0..pos (chunk = ceil(ceil((pos+1)/splits)/block)*block).

    Query heads of one KV head g are g*q_heads .. (g+1)*q_heads - 1 (HF's repeat_kv).
    inputs: [q (off g*q_heads*head_dim, len q_heads*head_dim), k cache (PREFIX, off
    g*head_dim, len head_dim), v cache (likewise), pos]; split s covers positions
    [s*chunk, min((s+1)*chunk, pos+1)), possibly empty. Scores t_j = scale * q.k_j.
    outputs: o scratch [kv_heads, splits, q_heads, head_dim] at off ((g*splits+s)*q_heads)
    *head_dim, len q_heads*head_dim: sum_j exp(t_j - m) v_j (unnormalised); ml scratch
    [kv_heads, splits, q_heads, 2] at off (g*splits+s)*q_heads*2: (m, l) per head with
    m = max_j t_j (-inf if empty) and l = sum_j exp(t_j - m) (0 if empty)."""

    op: Literal[Op.ATTN_PARTIAL] = Op.ATTN_PARTIAL
    head_dim: int
    q_heads: int
    splits: int
    split: int
    block: int
    scale: float


class AttnCombineParams(_Frozen):
    """inputs: [o partials of KV head g (off g*splits*q_heads*head_dim, len
    splits*q_heads*head_dim), ml (off g*splits*q_heads*2, len splits*q_heads*2)];
    outputs: [o (off g*q_heads*head_dim, len q_heads*head_dim)]:
    M = max_s m_s; o = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s (empty splits add 0)."""

    op: Literal[Op.ATTN_COMBINE] = Op.ATTN_COMBINE
    head_dim: int
    q_heads: int
    splits: int


class SiluMulParams(_Frozen):
    """inputs: [gate (len n), up (len n)]; outputs: [y (len n)] = silu(gate) * up."""

    op: Literal[Op.SILU_MUL] = Op.SILU_MUL
    n: int


class AddParams(_Frozen):
    """inputs: [a (len n), b (len n)]; outputs: [y (len n)] = a + b."""

    op: Literal[Op.ADD] = Op.ADD
    n: int


class ArgmaxParams(_Frozen):
    """The first index of the maximum (a NaN is maximal), whole or in slices.

    WHOLE: inputs [logits (len n)]; outputs [token (I32, len 1)].
    PARTIAL: inputs [logits[base : base + n] (len n)]; outputs [pair (F32, len 2)] = (the
    slice's maximum, base + its first index; exact in fp32: base + n <= 2^24).
    MERGE: inputs [n pairs (F32, len 2n)]; outputs [token (I32, len 1)] = the index of the pair
    with the largest value, ties (and NaNs) to the smallest index. The merge of PARTIALs over
    disjoint slices is the WHOLE argmax, so one block's scan becomes several in parallel."""

    op: Literal[Op.ARGMAX] = Op.ARGMAX
    n: int
    mode: ArgmaxMode = ArgmaxMode.WHOLE
    base: int = 0


Params = Annotated[
    Union[
        EmbedParams,
        RmsNormParams,
        GemvParams,
        ReduceParams,
        RopeParams,
        HeadNormParams,
        KvAppendParams,
        AttnPartialParams,
        AttnCombineParams,
        SiluMulParams,
        AddParams,
        ArgmaxParams,
    ],
    Field(discriminator="op"),
]
PARAMS_TYPES = frozenset(typing.get_args(typing.get_args(Params)[0]))  # one params model per op


class Task(_Frozen):
    id: int
    params: Params
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    waits: tuple[Wait, ...] = ()
    out_counter: int
    name: str = ""

    @property
    def op(self) -> Op:
        return self.params.op


# ------------------------------------------------------------------ targets
class GpuTarget(_Model):
    """Data only: a new GPU is a new record in `amk.schedule.targets`, never a code change."""

    name: str
    arch: str  # sm_90, gfx942, ...
    vendor: Literal["nvidia", "amd"]
    products: list[str]
    compute_units: int
    warp_size: int
    max_threads_per_cu: int
    max_blocks_per_cu: int
    smem_per_cu: int  # bytes
    regs_per_cu: int  # 32-bit registers
    l2_bytes: int
    xcds: int = 1
    l2_per_xcd: Optional[int] = None
    hbm_gbps: float  # spec bandwidth, GB/s
    dtypes: list[DType]


# ------------------------------------------------------------------ program
class Program(_Frozen):
    version: int = IR_VERSION
    name: str = ""
    target: GpuTarget
    threads_per_block: int = 256
    blocks_per_cu: int = 1
    kv_capacity: int = 0
    buffers: tuple[Buffer, ...]
    counters: tuple[Counter, ...]
    tasks: tuple[Task, ...]
    queues: tuple[tuple[int, ...], ...]
    # the ScheduleConfig and model facts this program was lowered from (provenance only)
    meta: dict[str, Any] = {}
    def model_post_init(self, context: Any) -> None:
        from amk.schedule.compact import keep_compact  # (that module builds on this one)

        keep_compact(self)  # the form the validator reads, made once

    def with_tasks(self, *tasks: Task) -> "Program":
        """A copy with each of `tasks` in place of the task of its id (`replace`)."""
        new = list(self.tasks)
        for t in tasks:
            new[t.id] = t
        return self.replace(tasks=new)

    def to_json(self, indent: Optional[int] = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Program":
        return cls.model_validate_json(text)

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)


# ------------------------------------------------------------------ validation result
class Violation(_Model):
    check: str
    reason: str
    tasks: list[int] = []
    buffers: list[int] = []
    counters: list[int] = []
    cycle: Optional[list[str]] = None  # deadlock witness, e.g. ["task 3", "counter 2", ...]


class Certificate(_Model):
    program_hash: str
    checks: list[str]
    tasks: int
    buffers: int
    counters: int
    queues: int
    waits: int
    conflicting_pairs_checked: int = 0


class ValidationResult(_Model):
    accepted: bool
    violations: list[Violation] = []
    certificate: Optional[Certificate] = None

    def summary(self) -> str:
        if self.accepted:
            c = self.certificate
            return f"accepted: {c.tasks} tasks, {c.counters} counters, {c.queues} queues" if c else "accepted"
        lines = [f"rejected: {len(self.violations)} violation(s)"]
        lines += [f"  [{v.check}] {v.reason}" for v in self.violations]
        return "\n".join(lines)


def dumps(obj: BaseModel) -> str:
    return obj.model_dump_json()


def enum_table() -> dict[str, dict[str, int]]:
    """Every ABI enum as {name: code}; what vm/abi.h must mirror."""
    enums = (DType, BufferKind, Op, Epilogue, KvMode, Scope, ArgmaxMode)
    return {e.__name__: {m.name: int(m.value) for m in e} for e in enums}


def capacity_table() -> dict[str, int]:
    return {
        name: value
        for name, value in globals().items()
        if name.startswith("MAX_") and isinstance(value, int)
    }


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
