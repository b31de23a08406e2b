"""Reference semantics of every AMK op, defined once, in torch.

This is the living definition of the ops: the CPU `ReferenceVM` runs these functions and
the GPU micro-kernel tests compare against them. Each op is a plain function

    fn(params, <operand roles as keywords>) -> fp32 tensor (or a tuple, one per output)

whose keyword names are exactly the roles of `amk.schedule.opspec.input_roles`, taking
operands already sliced out of their buffers (any shape with the right element count;
the functions reshape) and converted to fp32, except integer operands (`token`, `pos`,
quantized weight codes), which stay integers. Results are fp32 in the output operand's
element order; the caller rounds them to the output buffer's dtype on store (`apply`
does the conversion in, the VM does the rounding out).

Numerics, as `amk.schedule.ir` documents: read -> fp32, fp32 arithmetic, round on store.
The choices the IR leaves open are fixed here (the CUDA kernels must follow them):
  * RMSNorm is (x * rsqrt(mean(x^2) + eps)) * gamma, in that association (HF's order).
  * Quantized weights dequantize with two roundings: fp32(code * scale), then + zero.
    (The GPU GEMV reassociates per 16/32-code vector: scale * sum(code * x) + zero * sum(x);
    the same value up to fp32 rounding, which the kernel tests' tolerance covers.)
    A scale/zero tile's first column is group k_lo // group of the row.
  * RoPE angles are fp32(fp32(pos) * inv_freq[i]); cos/sin of that fp32 angle.
  * Attention scores are fp32(scale) * fp32(q . k), the scale rounded to fp32 first.
  * REDUCE sums the split-K partials in split order s = 0, 1, ..., starting from s = 0.
  * ATTN_COMBINE gives an empty split (m = -inf) weight exactly 0.
  * ARGMAX returns the first index of the maximum; a NaN counts as larger than any
    number (torch's rule), so the first NaN wins.
  * silu(g) = g * sigmoid(g) (torch.nn.functional.silu).

Half-precision rounding points (ir.py Numerics): an op also rounds some intermediate
values to a half-precision dtype where Hugging Face's half-precision Llama makes a
half-precision tensor. Each function takes them as rounders (`rnd`, GEMV's `x_rnd`:
fp32 -> that dtype -> fp32, round-to-nearest-even), which `rounding_points` derives from
the operands' buffer dtypes; the default (and any fp32 buffer) is the identity, so fp32
programs compute exactly as above.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from amk.schedule.ir import (
    AddParams,
    ArgmaxMode,
    ArgmaxParams,
    AttnCombineParams,
    AttnPartialParams,
    EmbedParams,
    Epilogue,
    GemvParams,
    HeadNormParams,
    KvAppendParams,
    Op,
    ReduceParams,
    RmsNormParams,
    RopeParams,
    SiluMulParams,
)
from amk.schedule.opspec import ROPE_EPILOGUES, gemv_rows_width

F32 = torch.float32
HALF = (torch.bfloat16, torch.float16)
Tensor = torch.Tensor
Round = Callable[[Tensor], Tensor]


def keep(t: Tensor) -> Tensor:
    """The identity rounder: fp32 results stay as computed."""
    return t


def rounder(dtype: Optional[torch.dtype]) -> Round:
    """Round fp32 values to a half-precision dtype and back (RNE); any other dtype: `keep`."""
    if dtype in HALF:
        return lambda t: t.to(dtype).to(F32)
    return keep


def rounding_points(params, in_dtypes: dict[str, torch.dtype], out_dtypes: list[torch.dtype]) -> dict[str, Round]:
    """The rounders an op takes from its operands' storage dtypes (ir.py Numerics):
    `rnd` rounds to the first output's dtype (ATTN_PARTIAL, whose outputs are fp32 scratch:
    to q's dtype); GEMV's `x_rnd` rounds its RMSNorm prologue (and x plus its partials) to
    x's dtype, its attention combine prologue to y's; `res_rnd` its residual plus partials to
    the residual's dtype."""
    op = params.op
    if op == Op.ATTN_PARTIAL:
        return {"rnd": rounder(in_dtypes.get("q"))}
    kw: dict[str, Round] = {}
    if op in (Op.RMSNORM, Op.HEAD_NORM, Op.ROPE, Op.SILU_MUL, Op.GEMV, Op.REDUCE) and out_dtypes:
        kw["rnd"] = rounder(out_dtypes[0])
    if op == Op.GEMV and params.norm_eps is not None:
        kw["x_rnd"] = rounder(in_dtypes.get("x"))
    if op == Op.GEMV and params.residual_partials > 0:
        kw["res_rnd"] = rounder(in_dtypes.get("residual"))
    if op == Op.GEMV and params.combine_splits > 0 and out_dtypes:  # where the standalone combine stored x
        kw["x_rnd"] = rounder(out_dtypes[0])
    return kw


# ----------------------------------------------------------------------------- helpers
def _vec(t: Tensor) -> Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _int(t: Tensor | int) -> int:
    """A len-1 integer operand (token, pos) as a Python int."""
    return int(t) if isinstance(t, int) else int(t.reshape(-1)[0])


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def rms_scale(x: Tensor, r: Tensor, gamma: Tensor, rnd: Round = keep) -> Tensor:
    """rnd(rnd(x * r) * gamma): HF's `weight * (x * r).to(half)`, each product rounded."""
    return rnd(rnd(x * r) * gamma)


def rms_normalize(x: Tensor, gamma: Tensor, eps: float, rnd: Round = keep) -> Tensor:
    """RMSNorm over the last dim: (x * rsqrt(mean(x^2) + eps)) * gamma (HF's order)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return rms_scale(x, r, gamma, rnd)


def rope_rotate(x: Tensor, inv_freq: Tensor, pos: int, head_dim: int, rnd: Round = keep,
                per_head: bool = False) -> Tensor:
    """Rotate-half RoPE of every head of x (len heads*head_dim) at position pos; cos, sin
    and each product rounded by `rnd` (HF: half cos/sin, q * cos + rotate_half(q) * sin).
    inv_freq: head_dim/2 frequencies for every head, or (per_head) head_dim/2 for each head."""
    half = head_dim // 2
    xh = x.reshape(-1, head_dim)
    want = half * (xh.shape[0] if per_head else 1)
    _need(head_dim % 2 == 0 and inv_freq.numel() == want, f"rope: inv_freq len {inv_freq.numel()} != {want}")
    freq = _vec(inv_freq).reshape(-1, half)
    ang = torch.tensor(float(pos), dtype=F32) * freq  # fp32(fp32(pos) * inv_freq)
    cos, sin = rnd(ang.cos()), rnd(ang.sin())
    a, b = xh[:, :half], xh[:, half:]
    return torch.cat([rnd(a * cos) - rnd(b * sin), rnd(b * cos) + rnd(a * sin)], dim=-1).reshape(-1)


# ----------------------------------------------------------------------------- quantization
def unpack_u4(packed: Tensor, n: int) -> Tensor:
    """U4 storage -> one code (0..15) per uint8: element e in byte e // 2, low nibble first."""
    packed = _vec(packed).to(torch.uint8)
    _need(packed.numel() == (n + 1) // 2, f"u4: {packed.numel()} bytes cannot hold {n} codes")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1)[:n]


def pack_u4(codes: Tensor) -> Tensor:
    """One code (0..15) per element -> U4 storage, two per byte, low nibble first."""
    c = _vec(codes).to(torch.uint8)
    _need(bool((c <= 15).all()), "u4 codes must be in 0..15")
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    return c[0::2] | (c[1::2] << 4)


def dequantize(codes: Tensor, scale: Tensor, zero: Optional[Tensor] = None, *, group: int, k_lo: int = 0) -> Tensor:
    """Weight tile [rows, klen] of columns [k_lo, k_lo+klen): w = code * scale (+ zero).

    codes: int8 (I8) or one unsigned code per element (U4, already unpacked). scale/zero:
    the row's group tiles [rows, L] whose first column is group k_lo // group.
    """
    rows, klen = codes.shape
    s = scale.to(F32).reshape(rows, -1)
    z = zero.to(F32).reshape(rows, -1) if zero is not None else None
    if k_lo % group == 0 and klen % group == 0:  # whole groups (what the validator allows): broadcast
        n = klen // group
        _need(n <= s.shape[1], f"dequantize: scale tile has {s.shape[1]} groups, needs {n}")
        w = codes.to(F32).reshape(rows, n, group) * s[:, :n, None]
        if z is not None:
            w = w + z[:, :n, None]
        return w.reshape(rows, klen)
    cols = torch.arange(k_lo, k_lo + klen) // group - k_lo // group  # group of each column, tile-relative
    _need(klen == 0 or int(cols[-1]) < s.shape[1], f"dequantize: scale tile has {s.shape[1]} groups, needs {int(cols[-1]) + 1}")
    w = codes.to(F32) * s[:, cols]
    return w if z is None else w + z[:, cols]


# ----------------------------------------------------------------------------- ops
def embed(p: EmbedParams, token: Tensor, table: Tensor) -> Tensor:
    """x = table[token, c0:c0+n]; `table` is the column tile over all vocab rows."""
    t = _int(token)
    _need(0 <= t < p.vocab, f"embed: token {t} outside vocab {p.vocab}")
    return table.reshape(p.vocab, -1)[t]


def rmsnorm(p: RmsNormParams, x: Tensor, gamma: Tensor, rnd: Round = keep) -> Tensor:
    """y = x[col:col+n] * rsqrt(mean(x^2) + eps) * gamma, the mean over the whole x."""
    x, gamma = _vec(x), _vec(gamma)
    _need(x.numel() == p.hidden, f"rmsnorm: x len {x.numel()} != hidden {p.hidden}")
    r = torch.rsqrt(x.pow(2).mean() + p.eps)
    return rms_scale(x[p.col : p.col + gamma.numel()], r, gamma, rnd)


def head_norm(p: HeadNormParams, x: Tensor, gamma: Tensor, rnd: Round = keep) -> Tensor:
    """RMSNorm over each head of x separately (Qwen3 q/k norm)."""
    return rms_normalize(x.reshape(p.heads, p.head_dim), _vec(gamma), p.eps, rnd).reshape(-1)


def rope(p: RopeParams, x: Tensor, inv_freq: Tensor, pos: Tensor, rnd: Round = keep) -> Tensor:
    return rope_rotate(_vec(x), inv_freq, _int(pos), p.head_dim, rnd)


def kv_append(p: KvAppendParams, src: Tensor, pos: Tensor) -> Tensor:
    """The cache row[pos] columns get src; `pos` only addresses the store."""
    return _vec(src)


def silu_mul(p: SiluMulParams, gate: Tensor, up: Tensor, rnd: Round = keep) -> Tensor:
    """y = rnd(silu(gate)) * up (HF: act_fn(gate) is a half tensor before the product)."""
    return rnd(F.silu(_vec(gate))) * _vec(up)


def add(p: AddParams, a: Tensor, b: Tensor) -> Tensor:
    return _vec(a) + _vec(b)


def argmax(p: ArgmaxParams, logits: Tensor) -> Tensor:
    """First index of the max, a NaN maximal (an integer tensor: vocab ids above 2^24 are not
    fp32-exact). PARTIAL: the slice's (max, base + index) as fp32; MERGE: `logits` holds n
    (value, index) pairs, and the token is the smallest index among the largest values (or
    among the NaNs), which is WHOLE's answer when the pairs are PARTIALs of disjoint slices."""
    x = _vec(logits)
    if p.mode == ArgmaxMode.MERGE:
        values, index = x[0::2], x[1::2]
        best = torch.isnan(values) if torch.isnan(values).any() else values == values.max()
        return index[best].min().reshape(1).to(torch.int32)
    i = torch.argmax(x)
    if p.mode == ArgmaxMode.PARTIAL:
        return torch.stack([x[i].to(F32), (i + p.base).to(F32)])
    return i.reshape(1).to(torch.int32)


def epilogue(p: GemvParams | ReduceParams, acc: Tensor, acc_up: Optional[Tensor] = None, *, bias=None,
             residual=None, head_gamma=None, inv_freq=None, pos=None, rnd: Round = keep) -> Tensor:
    """What a GEMV (or its REDUCE) does with its finished rows: a = rnd(acc (+ bias)), then
    STORE/APPEND: a; ADD: residual + a; SILU_MUL: rnd(silu(a_gate)) * rnd(a_up);
    ROPE/ROPE_APPEND: per head, optional head RMSNorm, then RoPE at pos (each with `rnd`).
    `rnd` makes a fused epilogue round where the standalone ops' stores would."""
    ep = p.epilogue
    _need(p.has_bias == (bias is not None), f"{ep.name}: has_bias={p.has_bias} but bias {'missing' if bias is None else 'given'}")
    _need(p.head_norm_eps is None or ep in ROPE_EPILOGUES, f"head_norm_eps is only defined for ROPE epilogues, not {ep.name}")
    a = rnd(acc + _vec(bias) if bias is not None else acc)
    if ep in (Epilogue.STORE, Epilogue.APPEND):
        return a
    if ep == Epilogue.ADD:
        return _vec(residual) + a
    if ep == Epilogue.SILU_MUL:
        _need(bias is None, "SILU_MUL has no bias")
        return rnd(F.silu(a)) * rnd(acc_up)
    # ROPE / ROPE_APPEND: the slab is whole heads, so head-local index = row % head_dim
    _need(p.head_dim > 0 and p.rows % p.head_dim == 0, f"{ep.name}: rows {p.rows} not whole heads of {p.head_dim}")
    if p.head_norm_eps is not None:
        a = rms_normalize(a.reshape(-1, p.head_dim), _vec(head_gamma), p.head_norm_eps, rnd).reshape(-1)
    return rope_rotate(a, inv_freq, _int(pos), p.head_dim, rnd, per_head=True)


def plus_partials(v: Tensor, parts: Tensor, rnd: Round) -> Tensor:
    """rnd(v + rnd(sum_s parts[s])), the sum in order s = 0, 1, ...: what a split-K REDUCE
    with the ADD epilogue (residual v) stores (GemvParams x_partials / residual_partials)."""
    parts = parts.reshape(-1, v.numel())
    acc = parts[0]
    for s in range(1, parts.shape[0]):
        acc = acc + parts[s]
    return rnd(v + rnd(acc))


def gemv(p: GemvParams, w: Tensor, x: Optional[Tensor] = None, gamma=None, w_scale=None, w_zero=None, w2=None,
         w2_scale=None, w2_zero=None, bias=None, residual=None, head_gamma=None, inv_freq=None, pos=None, o=None,
         ml=None, x_part=None, res_part=None, *, group: Optional[int] = None, rnd: Round = keep, x_rnd: Round = keep,
         res_rnd: Round = keep) -> Tensor:
    """Rows of y = W x over columns [k_lo, k_hi), with optional RMSNorm prologue (x whole,
    normalised over all k, then sliced) and the epilogue; with split_k > 1 the raw partial
    sums instead, interleaved (r, j) at r*m + j (j=0 gate/plain, j=1 up). With the attention
    combine prologue (combine_splits > 0) x is ATTN_COMBINE of the partials (o, ml) of each
    KV head of [k_lo, k_hi), rounded by `x_rnd`. x_part / res_part: split-K partials that x /
    the residual is read together with (`plus_partials`). With argmax_pair_base: (y, the argmax
    PARTIAL pair of y with that base).

    w/w2: fp32 [rows, klen], or quantized codes when w_scale is given (then `group`, the
    weight buffer's group size, is required)."""
    klen = p.k_hi - p.k_lo
    if p.combine_splits > 0:
        x = x_rnd(combine_heads(p, o, ml))
    x = _vec(x)
    if p.x_partials > 0:
        x = plus_partials(x, x_part, x_rnd)
    if p.residual_partials > 0:
        residual = plus_partials(_vec(residual), res_part, res_rnd)
    if p.norm_eps is not None:
        _need(x.numel() == p.k, f"gemv: norm prologue needs the whole x (len {p.k}), got {x.numel()}")
        x = rms_scale(x, torch.rsqrt(x.pow(2).mean() + p.norm_eps), _vec(gamma), x_rnd)[p.k_lo : p.k_hi]
    _need(x.numel() == klen, f"gemv: x len {x.numel()} != k_hi - k_lo = {klen}")

    def weight(m, scale, zero):
        m = m if m.dim() == 2 else m.reshape(p.rows, klen)
        return dequantize(m, scale, zero, group=group, k_lo=p.k_lo) if scale is not None else m

    acc = torch.mv(weight(w, w_scale, w_zero), x)
    acc_up = torch.mv(weight(w2, w2_scale, w2_zero), x) if p.epilogue == Epilogue.SILU_MUL else None
    if p.split_k > 1:
        return acc if acc_up is None else torch.stack([acc, acc_up], dim=-1).reshape(-1)
    y = epilogue(p, acc, acc_up, bias=bias, residual=residual, head_gamma=head_gamma, inv_freq=inv_freq, pos=pos,
                 rnd=rnd)
    if p.argmax_pair_base is None:
        return y
    # the pair of the stored values (`rnd` is the rounding to y's dtype: STORE's y = rnd(acc))
    return y, argmax(ArgmaxParams(n=p.rows, mode=ArgmaxMode.PARTIAL, base=p.argmax_pair_base), y)


def reduce(p: ReduceParams, partials: Tensor, bias=None, residual=None, head_gamma=None, inv_freq=None,
           pos=None, rnd: Round = keep) -> Tensor:
    """Sum the split-K partials [split_k, rows*m] in split order, then GEMV's epilogue."""
    m = gemv_rows_width(p)
    parts = partials.reshape(p.split_k, p.rows * m)
    acc = parts[0]
    for s in range(1, p.split_k):  # fixed order s = 0, 1, ... so the sum is reproducible
        acc = acc + parts[s]
    acc_up = None
    if m == 2:
        acc, acc_up = acc[0::2], acc[1::2]
    return epilogue(p, acc, acc_up, bias=bias, residual=residual, head_gamma=head_gamma, inv_freq=inv_freq, pos=pos,
                    rnd=rnd)


def attn_chunk(p: AttnPartialParams, pos: int) -> int:
    """Positions per split: ceil(ceil((pos+1)/splits)/block)*block."""
    return math.ceil(math.ceil((pos + 1) / p.splits) / p.block) * p.block


def attn_partial(p: AttnPartialParams, q: Tensor, k: Tensor, v: Tensor, pos: Tensor,
                 rnd: Round = keep) -> tuple[Tensor, Tensor]:
    """Unnormalised attention of the q_heads sharing one KV head over split `split`:
    o = sum_j exp(t_j - m) v_j, (m, l) = (max_j t_j, sum_j exp(t_j - m)),
    t_j = rnd(scale * rnd(q.k_j)) (HF eager: the score matmul and its scaling in q's dtype).
    k, v: the PREFIX rows 0..pos [pos+1, head_dim]. Empty split: o = 0, m = -inf, l = 0."""
    n = _int(pos) + 1
    chunk = attn_chunk(p, n - 1)
    lo, hi = p.split * chunk, min((p.split + 1) * chunk, n)
    qh = q.reshape(p.q_heads, p.head_dim)
    if lo >= hi:
        ml = torch.tensor([-math.inf, 0.0], dtype=F32).repeat(p.q_heads)
        return qh.new_zeros(p.q_heads * p.head_dim), ml
    ks = k.reshape(n, p.head_dim)[lo:hi]
    vs = v.reshape(n, p.head_dim)[lo:hi]
    t = rnd(torch.tensor(p.scale, dtype=F32) * rnd(qh @ ks.T))  # [q_heads, hi-lo]
    m = t.amax(dim=-1)
    e = torch.exp(t - m[:, None])
    o = e @ vs
    return o.reshape(-1), torch.stack([m, e.sum(dim=-1)], dim=-1).reshape(-1)


def attn_combine(p: AttnCombineParams, o: Tensor, ml: Tensor) -> Tensor:
    """o = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s, M = max_s m_s."""
    o = o.reshape(p.splits, p.q_heads, p.head_dim)
    ml = ml.reshape(p.splits, p.q_heads, 2)
    m, l = ml[..., 0], ml[..., 1]
    big = m.amax(dim=0)  # finite: split 0 always holds position 0
    wgt = torch.where(m == -math.inf, torch.zeros_like(m), torch.exp(m - big))
    num = (wgt[..., None] * o).sum(dim=0)
    den = (wgt * l).sum(dim=0)
    return (num / den[:, None]).reshape(-1)


def combine_heads(p: GemvParams, o: Tensor, ml: Tensor) -> Tensor:
    """A GEMV's combine prologue: ATTN_COMBINE of the partials of each KV head of its K slice,
    concatenated."""
    head = AttnCombineParams(head_dim=p.combine_head_dim, q_heads=p.combine_q_heads, splits=p.combine_splits)
    kv_heads = (p.k_hi - p.k_lo) // (p.combine_q_heads * p.combine_head_dim)
    os, mls = o.reshape(kv_heads, -1), ml.reshape(kv_heads, -1)
    return torch.cat([attn_combine(head, os[g], mls[g]) for g in range(kv_heads)])


# ----------------------------------------------------------------------------- registry
SEMANTICS: dict[Op, Callable] = {
    Op.EMBED: embed,
    Op.RMSNORM: rmsnorm,
    Op.GEMV: gemv,
    Op.REDUCE: reduce,
    Op.ROPE: rope,
    Op.KV_APPEND: kv_append,
    Op.ATTN_PARTIAL: attn_partial,
    Op.ATTN_COMBINE: attn_combine,
    Op.SILU_MUL: silu_mul,
    Op.ADD: add,
    Op.ARGMAX: argmax,
    Op.HEAD_NORM: head_norm,
}


def apply(params, inputs: dict[str, Tensor], **extra) -> tuple[Tensor, ...]:
    """Run one op on operands keyed by role: floating operands are read as fp32, integer
    ones (token, pos, quantized codes) pass as they are; returns one result per output
    role (`opspec.output_roles`). `extra` carries what the params do not (GEMV `group`,
    the rounders of `rounding_points`)."""
    args = {role: (t.to(F32) if t.dtype != F32 and t.is_floating_point() else t) for role, t in inputs.items()}
    out = SEMANTICS[params.op](params, **args, **extra)
    return out if isinstance(out, tuple) else (out,)


def round_to(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Round fp32 results to a buffer's storage dtype (round-to-nearest-even), as a store does."""
    return values.to(dtype)
