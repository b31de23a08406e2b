"""Hand-made Programs for the CPU tests: a tiny builder and a few programs that exercise
every op the way the lowering will (tiles, slabs, split-K, fused epilogues, attention
splits), each returned with the WEIGHT/CONST tensors it needs.

Stages: every program is built in topological order, and each task waits for whole
stages (all-join on a stage counter, threshold = the stage's task count). Queues are
filled round-robin in build order, so each queue is a linear extension of the DAG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from amk.instructions.semantics import pack_u4
from amk.schedule.ir import (
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
    HeadNormParams,
    KvAppendParams,
    KvMode,
    Operand,
    Program,
    ReduceParams,
    RmsNormParams,
    RopeParams,
    Task,
    Wait,
)
from amk.schedule.targets import get_target

K = BufferKind


# ----------------------------------------------------------------------------- builder
@dataclass
class Stage:
    counter: int
    tasks: int = 0


class Builder:
    def __init__(self, name: str, *, queues: int = 3, kv_capacity: int = 0):
        self.name, self.kv_capacity, self.nqueues = name, kv_capacity, queues
        self.buffers: list[Buffer] = []
        self.counters: list[Counter] = []
        self.tasks: list[Task] = []
        self.queues: list[list[int]] = [[] for _ in range(queues)]

    def buf(self, name: str, kind: BufferKind, shape: Sequence[int], dtype: DType = DType.F32, **quant) -> Buffer:
        b = Buffer(id=len(self.buffers), name=name, kind=kind, dtype=dtype, shape=list(shape), **quant)
        self.buffers.append(b)
        return b

    def stage(self, name: str) -> Stage:
        self.counters.append(Counter(id=len(self.counters), name=name))
        return Stage(self.counters[-1].id)

    def task(self, params, inputs: list[Operand], outputs: list[Operand], *, stage: Stage,
             after: Sequence[Stage] = (), queue: Optional[int] = None, name: str = "") -> Task:
        waits = [Wait(counter=s.counter, threshold=s.tasks) for s in after]
        t = Task(id=len(self.tasks), params=params, inputs=inputs, outputs=outputs, waits=waits,
                 out_counter=stage.counter, name=name)
        stage.tasks += 1
        self.tasks.append(t)
        self.queues[t.id % self.nqueues if queue is None else queue].append(t.id)
        return t

    def build(self) -> Program:
        return Program(name=self.name, target=get_target("h100"), kv_capacity=self.kv_capacity,
                       buffers=self.buffers, counters=self.counters, tasks=self.tasks,
                       queues=[q for q in self.queues if q])


def with_threshold(prog: Program, task_id: int, threshold: int, wait: int = 0) -> Program:
    """`prog` with task `task_id`'s wait number `wait` set to `threshold` (a program is frozen:
    a changed one is a copy)."""
    t = prog.tasks[task_id]
    waits = list(t.waits)
    waits[wait] = waits[wait].replace(threshold=threshold)
    return prog.with_tasks(t.replace(waits=waits))


def opd(b: Buffer, off: int = 0, len: Optional[int] = None, count: int = 1, stride: int = 0,
        kv: KvMode = KvMode.NONE) -> Operand:
    """An operand; `len` defaults to the whole buffer."""
    return Operand(buf=b.id, off=off, len=b.numel if len is None else len, count=count, stride=stride, kv=kv)


def parts(n: int, k: int, align: int = 1) -> list[tuple[int, int]]:
    """Split [0, n) into k near-even (start, size) pieces, sizes multiples of `align`."""
    units = n // align
    cuts = [round(i * units / k) * align for i in range(k + 1)]
    return [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


def weight_tile(w: Buffer, r0: int, rows: int, k: int, k_lo: int, k_hi: int) -> Operand:
    """Rows [r0, r0+rows) x columns [k_lo, k_hi) of a [R, k] matrix."""
    return opd(w, off=r0 * k + k_lo, len=k_hi - k_lo, count=rows, stride=k)


def group_tile(s: Buffer, r0: int, rows: int, k_lo: int, k_hi: int, group: int) -> Operand:
    """The scale/zero groups of that tile: first column group k_lo // group."""
    g = s.shape[1]
    g0 = k_lo // group
    return opd(s, off=r0 * g + g0, len=math.ceil(k_hi / group) - g0, count=rows, stride=g)


def rand(*shape, gen, scale=1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


# ----------------------------------------------------------------------------- quantization
def quantize(w: torch.Tensor, kind: str, group: int) -> dict[str, torch.Tensor]:
    """Per-group weight-only quantization (test data, not the project's quantizer):
    i8: symmetric codes -127..127; u4: codes 0..15 over [min, max] of the group."""
    rows, k = w.shape
    g = w.reshape(rows, k // group, group)
    if kind == "i8":
        scale = g.abs().amax(-1).clamp_min(1e-8) / 127
        codes = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return {"codes": codes.reshape(rows, k), "scale": scale}
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return {"codes": codes.reshape(rows, k), "scale": scale, "zero": lo}


def add_matrix(b: Builder, tensors: dict, name: str, w: torch.Tensor, quant: Optional[str], group: int) -> Buffer:
    """A [rows, k] weight buffer (fp32, or quantized with its companions)."""
    rows, k = w.shape
    if quant is None:
        tensors[name] = w
        return b.buf(name, K.WEIGHT, [rows, k])
    q = quantize(w, quant, group)
    s = b.buf(name + ".scale", K.WEIGHT, [rows, k // group])
    tensors[s.name] = q["scale"]
    z = None
    if quant == "u4":
        z = b.buf(name + ".zero", K.WEIGHT, [rows, k // group])
        tensors[z.name] = q["zero"]
    dtype = DType.I8 if quant == "i8" else DType.U4
    tensors[name] = q["codes"] if quant == "i8" else pack_u4(q["codes"])
    return b.buf(name, K.WEIGHT, [rows, k], dtype, scale=s.id, zero=z.id if z else None, group=group)


def quant_operands(b: Builder, w: Buffer, r0: int, rows: int, k_lo: int, k_hi: int) -> list[Operand]:
    if w.scale is None:
        return []
    ops = [group_tile(b.buffers[w.scale], r0, rows, k_lo, k_hi, w.group)]
    if w.zero is not None:
        ops.append(group_tile(b.buffers[w.zero], r0, rows, k_lo, k_hi, w.group))
    return ops


# ----------------------------------------------------------------------------- programs
def lm_head_program(vocab: int = 40, hidden: int = 24, *, tiles: int = 2, slabs: int = 3, queues: int = 3,
                    eps: float = 1e-5, seed: int = 0, argmax_slices: int = 1, head_pairs: bool = False):
    """token -> EMBED (column tiles) -> RMSNORM (tiles) -> GEMV (vocab slabs, tied table)
    -> logits, ARGMAX -> next_token (or PARTIAL argmaxes over `argmax_slices` slices of the
    logits, whose pairs a MERGE reduces; or, `head_pairs`, each GEMV slab writes its rows' pair
    and the MERGE follows the GEMVs)."""
    gen = torch.Generator().manual_seed(seed)
    b = Builder("lm_head", queues=queues)
    tok = b.buf("token", K.IO_INPUT, [1], DType.I32)
    table = b.buf("embed", K.WEIGHT, [vocab, hidden])
    gamma = b.buf("norm", K.WEIGHT, [hidden])
    x = b.buf("x", K.ACTIVATION, [hidden])
    xn = b.buf("xn", K.ACTIVATION, [hidden])
    logits = b.buf("logits", K.IO_OUTPUT, [vocab])
    nxt = b.buf("next_token", K.IO_OUTPUT, [1], DType.I32)
    e, n, g, a = b.stage("embed"), b.stage("norm"), b.stage("head"), b.stage("argmax")
    for c0, w in parts(hidden, tiles):
        b.task(EmbedParams(vocab=vocab, hidden=hidden), [opd(tok), opd(table, c0, w, vocab, hidden)],
               [opd(x, c0, w)], stage=e, name=f"embed[{c0}]")
    for c0, w in parts(hidden, tiles):
        b.task(RmsNormParams(hidden=hidden, col=c0, eps=eps), [opd(x), opd(gamma, c0, w)], [opd(xn, c0, w)],
               stage=n, after=[e], name=f"norm[{c0}]")
    slab_rows = parts(vocab, slabs)
    pairs = b.buf("head_pairs", K.SCRATCH, [len(slab_rows), 2]) if head_pairs else None
    for i, (r0, rows) in enumerate(slab_rows):
        b.task(GemvParams(rows=rows, k=hidden, k_hi=hidden, argmax_pair_base=r0 if head_pairs else None),
               [weight_tile(table, r0, rows, hidden, 0, hidden), opd(xn)],
               [opd(logits, r0, rows)] + ([opd(pairs, 2 * i, 2)] if head_pairs else []), stage=g, after=[n],
               name=f"head[{r0}]")
    if head_pairs:
        b.task(ArgmaxParams(n=len(slab_rows), mode=ArgmaxMode.MERGE), [opd(pairs)], [opd(nxt)], stage=a, after=[g],
               name="argmax_merge")
    elif argmax_slices == 1:
        b.task(ArgmaxParams(n=vocab), [opd(logits)], [opd(nxt)], stage=a, after=[g], name="argmax")
    else:
        slices = parts(vocab, argmax_slices)
        pairs = b.buf("argmax_pairs", K.SCRATCH, [len(slices), 2])
        for i, (r0, n) in enumerate(slices):
            b.task(ArgmaxParams(n=n, mode=ArgmaxMode.PARTIAL, base=r0), [opd(logits, r0, n)], [opd(pairs, 2 * i, 2)],
                   stage=a, after=[g], name=f"argmax[{r0}]")
        m = b.stage("argmax_merge")
        b.task(ArgmaxParams(n=len(slices), mode=ArgmaxMode.MERGE), [opd(pairs)], [opd(nxt)], stage=m, after=[a],
               name="argmax_merge")
    tensors = {"embed": rand(vocab, hidden, gen=gen), "norm": 1 + 0.1 * rand(hidden, gen=gen)}
    return b.build(), tensors


@dataclass
class GemvCase:
    """What `gemv_program` builds; tokens pick rows of x_table (and r_table, the residual)."""

    rows: int
    k: int
    slabs: int = 2
    split_k: int = 1
    epilogue: Epilogue = Epilogue.STORE
    norm_eps: Optional[float] = None
    bias: bool = False
    quant: Optional[str] = None  # None | "i8" | "u4"
    group: int = 8
    head_dim: int = 0
    head_norm_eps: Optional[float] = None
    out_dtype: DType = DType.F32
    vocab: int = 4
    kv_capacity: int = 8
    x_scale: float = 1.0  # x's magnitude (e.g. beyond the halves' range, for AMK_GEMV_I8_MMA)
    split_align: Optional[int] = None  # the split-K slices' alignment (default: quantized, the group; else 1)


def gemv_program(c: GemvCase, seed: int = 0):
    """x = x_table[token] (EMBED), then one GEMV (slabs x split-K, + REDUCE) with c's
    prologue/epilogue into `y` (IO_OUTPUT; in place over y = r_table[token] for ADD) or
    into the KV cache `cache` row pos (APPEND, ROPE_APPEND)."""
    gen = torch.Generator().manual_seed(seed)
    b = Builder("gemv", queues=3, kv_capacity=c.kv_capacity)
    tensors: dict[str, torch.Tensor] = {}
    ep, m = c.epilogue, (2 if c.epilogue == Epilogue.SILU_MUL else 1)
    tok = b.buf("token", K.IO_INPUT, [1], DType.I32)
    pos = b.buf("pos", K.IO_INPUT, [1], DType.I32)
    x_table = b.buf("x_table", K.WEIGHT, [c.vocab, c.k])
    tensors["x_table"] = rand(c.vocab, c.k, gen=gen) * c.x_scale
    w = add_matrix(b, tensors, "w", rand(c.rows, c.k, gen=gen, scale=c.k ** -0.5), c.quant, c.group)
    w2 = add_matrix(b, tensors, "w2", rand(c.rows, c.k, gen=gen, scale=c.k ** -0.5), c.quant, c.group) if m == 2 else None
    extras: dict[str, Buffer] = {}
    if c.norm_eps is not None:
        extras["gamma"] = b.buf("gamma", K.WEIGHT, [c.k])
        tensors["gamma"] = 1 + 0.1 * rand(c.k, gen=gen)
    if c.bias:
        extras["bias"] = b.buf("bias", K.WEIGHT, [c.rows])
        tensors["bias"] = rand(c.rows, gen=gen)
    if c.head_norm_eps is not None:
        extras["head_gamma"] = b.buf("head_gamma", K.WEIGHT, [c.head_dim])
        tensors["head_gamma"] = 1 + 0.1 * rand(c.head_dim, gen=gen)
    if ep in (Epilogue.ROPE, Epilogue.ROPE_APPEND):  # head_dim/2 frequencies a head, each head its own:
        # head h turns at (h + 1) times the usual ones, as the usual RoPE at position (h + 1) * pos
        extras["inv_freq"] = b.buf("inv_freq", K.CONST, [c.rows // 2])
        base = 1.0 / (10000.0 ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        tensors["inv_freq"] = torch.cat([base * (h + 1) for h in range(c.rows // c.head_dim)])
    x = b.buf("x", K.ACTIVATION, [c.k])
    to_cache = ep in (Epilogue.APPEND, Epilogue.ROPE_APPEND)
    y = (b.buf("cache", K.KV_CACHE, [c.kv_capacity, c.rows], c.out_dtype) if to_cache
         else b.buf("y", K.IO_OUTPUT, [c.rows], c.out_dtype))

    first = b.stage("inputs")
    b.task(EmbedParams(vocab=c.vocab, hidden=c.k), [opd(tok), opd(x_table, 0, c.k, c.vocab, c.k)], [opd(x)],
           stage=first, name="embed x")
    if ep == Epilogue.ADD:
        r_table = b.buf("r_table", K.WEIGHT, [c.vocab, c.rows])
        tensors["r_table"] = rand(c.vocab, c.rows, gen=gen)
        b.task(EmbedParams(vocab=c.vocab, hidden=c.rows), [opd(tok), opd(r_table, 0, c.rows, c.vocab, c.rows)],
               [opd(y)], stage=first, name="embed residual")

    def extra_operands(r0: int, rows: int) -> list[Operand]:
        ops = [opd(extras["bias"], r0, rows)] if c.bias else []
        if ep == Epilogue.ADD:
            ops.append(opd(y, r0, rows))  # residual: y itself, in place
        if c.head_norm_eps is not None:
            ops.append(opd(extras["head_gamma"]))
        if ep in (Epilogue.ROPE, Epilogue.ROPE_APPEND):
            ops += [opd(extras["inv_freq"], r0 // 2, rows // 2), opd(pos)]
        elif ep == Epilogue.APPEND:
            ops.append(opd(pos))
        return ops

    def out_operand(r0: int, rows: int) -> Operand:
        return opd(y, r0, rows, kv=KvMode.APPEND) if to_cache else opd(y, r0, rows)

    align = c.head_dim if c.head_dim else 1
    slabs = parts(c.rows, c.slabs, align)
    splits = parts(c.k, c.split_k, c.split_align or (c.group if c.quant else 1))
    gemv = b.stage("gemv")
    part = b.buf("partials", K.SCRATCH, [c.split_k, c.rows * m]) if c.split_k > 1 else None
    for r0, rows in slabs:
        for s, (k_lo, klen) in enumerate(splits):
            k_hi = k_lo + klen
            ins = [weight_tile(w, r0, rows, c.k, k_lo, k_hi), opd(x) if c.norm_eps is not None else opd(x, k_lo, klen)]
            if c.norm_eps is not None:
                ins.append(opd(extras["gamma"]))
            ins += quant_operands(b, w, r0, rows, k_lo, k_hi)
            if w2 is not None:
                ins.append(weight_tile(w2, r0, rows, c.k, k_lo, k_hi))
                ins += quant_operands(b, w2, r0, rows, k_lo, k_hi)
            if part is None:
                ins += extra_operands(r0, rows)
                outs = [out_operand(r0, rows)]
            else:
                outs = [opd(part, s * c.rows * m + r0 * m, rows * m)]
            p = GemvParams(rows=rows, k=c.k, k_lo=k_lo, k_hi=k_hi, split_k=c.split_k, norm_eps=c.norm_eps,
                           has_bias=c.bias, epilogue=ep, head_dim=c.head_dim, head_norm_eps=c.head_norm_eps)
            b.task(p, ins, outs, stage=gemv, after=[first], name=f"gemv[{r0},{k_lo}]")
    if part is not None:
        red = b.stage("reduce")
        for r0, rows in slabs:
            p = ReduceParams(rows=rows, split_k=c.split_k, has_bias=c.bias, epilogue=ep, head_dim=c.head_dim,
                             head_norm_eps=c.head_norm_eps)
            ins = [opd(part, r0 * m, rows * m, c.split_k, c.rows * m)] + extra_operands(r0, rows)
            b.task(p, ins, [out_operand(r0, rows)], stage=red, after=[gemv], name=f"reduce[{r0}]")
    return b.build(), tensors


def attention_program(*, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, splits: int = 3, block: int = 2,
                      capacity: int = 16, vocab: int = 8, qk_norm: bool = False, eps: float = 1e-6,
                      queues: int = 4, seed: int = 0):
    """The unfused attention path: q/k/v = *_table[token] (EMBED), [HEAD_NORM], ROPE,
    KV_APPEND, ATTN_PARTIAL per (KV head, split), ATTN_COMBINE per KV head -> `out`."""
    gen = torch.Generator().manual_seed(seed)
    qh, d = heads // kv_heads, head_dim
    b = Builder("attention", queues=queues, kv_capacity=capacity)
    tok = b.buf("token", K.IO_INPUT, [1], DType.I32)
    pos = b.buf("pos", K.IO_INPUT, [1], DType.I32)
    tables = {n: b.buf(f"{n}_table", K.WEIGHT, [vocab, h * d]) for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    tensors = {f"{n}_table": rand(vocab, t.shape[1], gen=gen) for n, t in tables.items()}
    inv_freq = b.buf("inv_freq", K.CONST, [d // 2])
    tensors["inv_freq"] = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    raw = {n: b.buf(f"{n}_raw", K.ACTIVATION, [t.shape[1]]) for n, t in tables.items()}
    roped = {n: b.buf(f"{n}_rope", K.ACTIVATION, [raw[n].numel]) for n in ("q", "k")}
    cache = {n: b.buf(f"{n}_cache", K.KV_CACHE, [capacity, kv_heads * d]) for n in ("k", "v")}
    o_part = b.buf("o_part", K.SCRATCH, [kv_heads, splits, qh, d])
    ml = b.buf("ml", K.SCRATCH, [kv_heads, splits, qh, 2])
    out = b.buf("out", K.IO_OUTPUT, [heads * d])

    embed = b.stage("embed")
    for n, t in tables.items():
        w = t.shape[1]
        b.task(EmbedParams(vocab=vocab, hidden=w), [opd(tok), opd(t, 0, w, vocab, w)], [opd(raw[n])], stage=embed,
               name=f"embed {n}")
    src, last = dict(raw), embed
    if qk_norm:
        norm = b.stage("head_norm")
        for n, h in (("q", heads), ("k", kv_heads)):
            gamma = b.buf(f"{n}_norm", K.WEIGHT, [d])
            tensors[gamma.name] = 1 + 0.1 * rand(d, gen=gen)
            normed = b.buf(f"{n}_normed", K.ACTIVATION, [h * d])
            b.task(HeadNormParams(head_dim=d, heads=h, eps=eps), [opd(raw[n]), opd(gamma)], [opd(normed)],
                   stage=norm, after=[embed], name=f"head_norm {n}")
            src[n] = normed
        last = norm
    rope = b.stage("rope")
    for n, h in (("q", heads), ("k", kv_heads)):
        b.task(RopeParams(head_dim=d, heads=h), [opd(src[n]), opd(inv_freq), opd(pos)], [opd(roped[n])],
               stage=rope, after=[last], name=f"rope {n}")
    append = b.stage("append")
    for n, s in (("k", roped["k"]), ("v", raw["v"])):
        b.task(KvAppendParams(n=s.numel), [opd(s), opd(pos)], [opd(cache[n], 0, s.numel, kv=KvMode.APPEND)],
               stage=append, after=[rope, embed], name=f"append {n}")
    partial = b.stage("partial")
    for g in range(kv_heads):
        for s in range(splits):
            p = AttnPartialParams(head_dim=d, q_heads=qh, splits=splits, split=s, block=block, scale=d ** -0.5)
            ins = [opd(roped["q"], g * qh * d, qh * d), opd(cache["k"], g * d, d, kv=KvMode.PREFIX),
                   opd(cache["v"], g * d, d, kv=KvMode.PREFIX), opd(pos)]
            outs = [opd(o_part, (g * splits + s) * qh * d, qh * d), opd(ml, (g * splits + s) * qh * 2, qh * 2)]
            b.task(p, ins, outs, stage=partial, after=[append, rope], name=f"attn[{g},{s}]")
    combine = b.stage("combine")
    for g in range(kv_heads):
        b.task(AttnCombineParams(head_dim=d, q_heads=qh, splits=splits),
               [opd(o_part, g * splits * qh * d, splits * qh * d), opd(ml, g * splits * qh * 2, splits * qh * 2)],
               [opd(out, g * qh * d, qh * d)], stage=combine, after=[partial], name=f"combine[{g}]")
    return b.build(), tensors


def tiny_model_program(model, *, capacity: int = 32, slabs: int = 2, split_k: int = 2, splits: int = 2,
                       block: int = 4, queues: int = 5):
    """A whole HF Llama / Qwen2 / Qwen3 causal LM, fused the way DESIGN.md describes:
    QKV (norm prologue; ROPE / ROPE_APPEND / APPEND epilogues, q/k head norm for Qwen3,
    biases for Qwen2) -> attention partials -> combine -> O-proj (+residual) ->
    gate/up (norm prologue, SILU_MUL) -> down (split-K + REDUCE, +residual); then the
    final norm + lm_head slabs and ARGMAX. Weights keep their HF state-dict names."""
    cfg = model.config
    sd = {n: t.detach().float() for n, t in model.state_dict().items()}
    sd.pop("model.rotary_emb.inv_freq", None)
    hid, inter, voc = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or hid // nh
    qh, eps = nh // nkv, cfg.rms_norm_eps
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in sd
    bias = "model.layers.0.self_attn.q_proj.bias" in sd
    head_w = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # the same tensor as the embedding table

    b = Builder(f"tiny-{cfg.model_type}", queues=queues, kv_capacity=capacity)
    W = {n: b.buf(n, K.WEIGHT, list(t.shape)) for n, t in sd.items()}
    tensors = dict(sd)
    inv = b.buf("rope.inv_freq", K.CONST, [nh * d // 2])  # the frequencies once a q head
    tensors[inv.name] = model.model.rotary_emb.inv_freq.detach().float().repeat(nh)
    tok = b.buf("token", K.IO_INPUT, [1], DType.I32)
    pos = b.buf("pos", K.IO_INPUT, [1], DType.I32)
    h = b.buf("h", K.ACTIVATION, [hid])  # the residual stream
    q = b.buf("q", K.ACTIVATION, [nh * d])
    attn = b.buf("attn", K.ACTIVATION, [nh * d])
    act = b.buf("act", K.ACTIVATION, [inter])
    part = b.buf("down.partials", K.SCRATCH, [split_k, hid])
    o_part = b.buf("o_part", K.SCRATCH, [nkv, splits, qh, d])
    ml = b.buf("ml", K.SCRATCH, [nkv, splits, qh, 2])
    logits = b.buf("logits", K.IO_OUTPUT, [voc])
    nxt = b.buf("next_token", K.IO_OUTPUT, [1], DType.I32)

    def gemv(st, after, w, rows_total, k, x, out_fn, *, ep=Epilogue.STORE, norm=None, extra_fn=lambda r0, n: [],
             align=1, w2=None, hn=None, has_bias=False):
        for r0, rows in parts(rows_total, slabs, align):
            ins = [weight_tile(W[w], r0, rows, k, 0, k), opd(x)]
            if norm:
                ins.append(opd(W[norm]))
            if w2:
                ins.append(weight_tile(W[w2], r0, rows, k, 0, k))
            p = GemvParams(rows=rows, k=k, k_hi=k, norm_eps=eps if norm else None, epilogue=ep, head_dim=d,
                           head_norm_eps=eps if hn else None, has_bias=has_bias)
            b.task(p, ins + extra_fn(r0, rows), [out_fn(r0, rows)], stage=st, after=after, name=f"{w}[{r0}]")

    prev = b.stage("embed")
    for c0, n in parts(hid, slabs):
        b.task(EmbedParams(vocab=voc, hidden=hid), [opd(tok), opd(W["model.embed_tokens.weight"], c0, n, voc, hid)],
               [opd(h, c0, n)], stage=prev, name=f"embed[{c0}]")
    for layer in range(cfg.num_hidden_layers):
        L = f"model.layers.{layer}."
        kc = b.buf(f"k_cache.{layer}", K.KV_CACHE, [capacity, nkv * d])
        vc = b.buf(f"v_cache.{layer}", K.KV_CACHE, [capacity, nkv * d])
        qkv = b.stage(f"{L}qkv")
        for m, heads, dest, ep in (("q", nh, q, Epilogue.ROPE), ("k", nkv, kc, Epilogue.ROPE_APPEND),
                                   ("v", nkv, vc, Epilogue.APPEND)):
            def extras(r0, n, m=m, ep=ep):
                ops = [opd(W[f"{L}self_attn.{m}_proj.bias"], r0, n)] if bias else []
                if qk_norm and m != "v":
                    ops.append(opd(W[f"{L}self_attn.{m}_norm.weight"]))
                return ops + ([opd(inv, r0 // 2, n // 2), opd(pos)] if ep != Epilogue.APPEND else [opd(pos)])

            def out(r0, n, dest=dest):
                return opd(dest, r0, n, kv=KvMode.APPEND if dest is not q else KvMode.NONE)

            gemv(qkv, [prev], f"{L}self_attn.{m}_proj.weight", heads * d, hid, h, out, ep=ep,
                 norm=f"{L}input_layernorm.weight", extra_fn=extras, align=d, hn=qk_norm and m != "v", has_bias=bias)
        partial = b.stage(f"{L}attn.partial")
        for g in range(nkv):
            for s in range(splits):
                p = AttnPartialParams(head_dim=d, q_heads=qh, splits=splits, split=s, block=block, scale=d ** -0.5)
                b.task(p, [opd(q, g * qh * d, qh * d), opd(kc, g * d, d, kv=KvMode.PREFIX),
                           opd(vc, g * d, d, kv=KvMode.PREFIX), opd(pos)],
                       [opd(o_part, (g * splits + s) * qh * d, qh * d), opd(ml, (g * splits + s) * qh * 2, qh * 2)],
                       stage=partial, after=[qkv], name=f"{L}attn[{g},{s}]")
        combine = b.stage(f"{L}attn.combine")
        for g in range(nkv):
            b.task(AttnCombineParams(head_dim=d, q_heads=qh, splits=splits),
                   [opd(o_part, g * splits * qh * d, splits * qh * d), opd(ml, g * splits * qh * 2, splits * qh * 2)],
                   [opd(attn, g * qh * d, qh * d)], stage=combine, after=[partial], name=f"{L}combine[{g}]")
        o = b.stage(f"{L}o_proj")
        gemv(o, [combine], f"{L}self_attn.o_proj.weight", hid, nh * d, attn, lambda r0, n: opd(h, r0, n),
             ep=Epilogue.ADD, extra_fn=lambda r0, n: [opd(h, r0, n)])
        gu = b.stage(f"{L}gate_up")
        gemv(gu, [o], f"{L}mlp.gate_proj.weight", inter, hid, h, lambda r0, n: opd(act, r0, n), ep=Epilogue.SILU_MUL,
             norm=f"{L}post_attention_layernorm.weight", w2=f"{L}mlp.up_proj.weight")
        prev = _split_k_down(b, W[f"{L}mlp.down_proj.weight"], act, h, part, gu, hid, inter, slabs, split_k, L)
    head = b.stage("lm_head")
    gemv(head, [prev], head_w, voc, hid, h, lambda r0, n: opd(logits, r0, n), norm="model.norm.weight")
    b.task(ArgmaxParams(n=voc), [opd(logits)], [opd(nxt)], stage=b.stage("argmax"), after=[head], name="argmax")
    return b.build(), tensors


def _split_k_down(b: Builder, w: Buffer, act: Buffer, h: Buffer, part: Buffer, after: Stage, rows_total: int, k: int,
                  slabs: int, split_k: int, prefix: str) -> Stage:
    """down_proj as split-K GEMV partials + REDUCE with the residual ADD into h
    (split_k=1: one GEMV with the ADD epilogue)."""
    if split_k == 1:
        st = b.stage(f"{prefix}down")
        for r0, rows in parts(rows_total, slabs):
            b.task(GemvParams(rows=rows, k=k, k_hi=k, epilogue=Epilogue.ADD),
                   [weight_tile(w, r0, rows, k, 0, k), opd(act), opd(h, r0, rows)], [opd(h, r0, rows)],
                   stage=st, after=[after], name=f"{prefix}down[{r0}]")
        return st
    partial, red = b.stage(f"{prefix}down.partial"), b.stage(f"{prefix}down.reduce")
    for r0, rows in parts(rows_total, slabs):
        for s, (k_lo, klen) in enumerate(parts(k, split_k)):
            p = GemvParams(rows=rows, k=k, k_lo=k_lo, k_hi=k_lo + klen, split_k=split_k)
            b.task(p, [weight_tile(w, r0, rows, k, k_lo, k_lo + klen), opd(act, k_lo, klen)],
                   [opd(part, s * rows_total + r0, rows)], stage=partial, after=[after], name=f"{prefix}down[{r0},{s}]")
    for r0, rows in parts(rows_total, slabs):
        b.task(ReduceParams(rows=rows, split_k=split_k, epilogue=Epilogue.ADD),
               [opd(part, r0, rows, split_k, rows_total), opd(h, r0, rows)], [opd(h, r0, rows)],
               stage=red, after=[partial], name=f"{prefix}down.reduce[{r0}]")
    return red
