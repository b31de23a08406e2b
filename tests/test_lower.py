"""The lowering: zoo-like model shapes under many configs give well-formed, race-free
programs (checked here independently of the lowering's own hazard tracker, and by the
validator), every config field changes the program, weights bind in the right layouts,
and the lowered step matches eager Hugging Face on the ReferenceVM."""

from __future__ import annotations

import random
import re

import pytest
import torch

from amk.eval.shapes import shape_config
from amk.schedule.config import ScheduleConfig
from amk.schedule.ir import (
    ArgmaxMode,
    DTYPE_BITS,
    IMMUTABLE_KINDS,
    MAX_INPUTS,
    MAX_OUTPUTS,
    MAX_WAITS,
    BufferKind,
    DType,
    Epilogue,
    KvMode,
    Op,
    Program,
)
from amk.schedule.lower import bind_weights, lower, program_stats, rope_inv_freq, tiles
from amk.schedule.importer import spec_from_hf_config
from amk.schedule.modelspec import ModelSpec
from amk.schedule.opspec import input_roles, output_roles
from amk.schedule.quantize import dequantize, group_for, quantize_int4, quantize_int8, quantize_int8_asym
from amk.schedule.targets import coresident_blocks, get_target
from amk.schedule.rope_rows import head_order, in_hf_order

H100 = get_target("h100")
K = BufferKind


# ----------------------------------------------------------------------------- models
def spec_of(name, family="llama", H=128, heads=2, kv=2, d=64, F=256, L=2, V=256, tied=False, dtype="float32",
            hf_config=None, **kw) -> ModelSpec:
    return ModelSpec(name=name, family=family, vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=L,
                     num_heads=heads, num_kv_heads=kv, head_dim=d, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=tied, dtype=dtype,
                     qkv_bias=family == "qwen2", qk_norm=family == "qwen3", hf_config=hf_config or {}, **kw)


ZOO = {
    "mha": spec_of("mha"),
    "gqa": spec_of("gqa", H=256, heads=4, kv=2, F=512, tied=True),
    "mqa": spec_of("mqa", family="mistral", H=256, heads=4, kv=1, F=384),
    "d128": spec_of("d128", H=256, heads=2, kv=1, d=128, F=512, L=1),
    "odd": spec_of("odd", H=576, heads=9, kv=3, d=64, F=1536, L=1, V=320, tied=True),
    "qwen2": spec_of("qwen2", family="qwen2", H=256, heads=4, kv=2, F=512, tied=True),
    "qwen3": spec_of("qwen3", family="qwen3", H=128, heads=4, kv=2, d=64, F=256),
}

UNFUSED = dict(fuse_norm=False, fuse_rope_append=False, fuse_residual=False, fuse_silu_mul=False)
CONFIGS = {
    "default": {},
    "unfused": UNFUSED,
    "no_norm": dict(fuse_norm=False),
    "no_rope": dict(fuse_rope_append=False),
    "no_residual": dict(fuse_residual=False),
    "no_silu": dict(fuse_silu_mul=False),
    "split_k2": dict(split_k=2),
    "split_k4_unfused": dict(split_k=4, **UNFUSED),
    "kv1": dict(kv_splits=1),
    "kv4": dict(kv_splits=4, kv_block=8),
    "round_robin": dict(sm_assignment="round_robin", gemv_tasks_per_matrix=5),
    "int8_g32": dict(quant="int8", quant_group=32),
    "int8_channel": dict(quant="int8", quant_group="channel", quant_lm_head=True),
    "int4_g64_sk2": dict(quant="int4", quant_group=64, split_k=2, quant_lm_head=True),
    "int4_unfused": dict(quant="int4", quant_group=128, **UNFUSED),
    "bf16": dict(dtype="bfloat16", split_k=2, fuse_residual=False),
}


def cfg_of(**kw) -> ScheduleConfig:
    return ScheduleConfig(**{"max_queues": 8, **kw})


# ----------------------------------------------------------------------------- structure
def _elems(buf, o) -> set[int]:
    """Elements an operand touches (KV caches: the columns), straight from the IR docstring."""
    if o.kv != KvMode.NONE:
        return set(range(o.off, o.off + o.len))
    return {o.off + c * o.stride + e for c in range(o.count) for e in range(o.len)}


def check_structure(p: Program) -> None:
    bufs, tasks = p.buffers, p.tasks
    assert [b.id for b in bufs] == list(range(len(bufs)))
    assert [t.id for t in tasks] == list(range(len(tasks)))
    assert len({b.name for b in bufs}) == len(bufs)
    # queues: every task exactly once, each queue in a topological (lowering) order
    flat = sorted(i for q in p.queues for i in q)
    assert flat == list(range(len(tasks)))
    assert all(list(q) == sorted(q) for q in p.queues)
    assert len(p.queues) <= coresident_blocks(p.target, p.threads_per_block, p.blocks_per_cu)
    producers: dict[int, list[int]] = {}
    for t in tasks:
        producers.setdefault(t.out_counter, []).append(t.id)
    assert sorted(producers) == [c.id for c in p.counters]

    hb_counter: dict[int, int] = {}  # counter -> bitmask of tasks done once it is full
    hb = [0] * len(tasks)
    for t in tasks:
        wdt = bufs[t.inputs[0].buf].dtype if t.op == Op.GEMV else DType.F32
        assert len(t.inputs) == len(input_roles(t.params, wdt)) <= MAX_INPUTS, t.name
        assert len(t.outputs) == len(output_roles(t.params)) <= MAX_OUTPUTS, t.name
        assert len(t.waits) <= MAX_WAITS
        for w in t.waits:
            assert w.threshold == len(producers[w.counter]), "a counter is only waited on in full"
            assert max(producers[w.counter]) < t.id
            hb[t.id] |= hb_counter[w.counter]
        hb_counter[t.out_counter] = hb_counter.get(t.out_counter, 0) | hb[t.id] | (1 << t.id)
        for o in t.inputs + t.outputs:
            b = bufs[o.buf]
            assert o.len >= 1 and o.count >= 1
            if o.kv != KvMode.NONE:
                assert b.kind == K.KV_CACHE and o.off + o.len <= b.shape[1]
            else:
                assert b.kind != K.KV_CACHE and o.off + (o.count - 1) * o.stride + o.len <= b.numel, t.name
        for o in t.outputs:
            assert bufs[o.buf].kind not in IMMUTABLE_KINDS | {K.IO_INPUT}
        _check_params(p, t)

    # race freedom and completeness, element by element
    acc: dict[int, list[tuple[int, bool, set[int]]]] = {}
    for t in tasks:
        for ops, write in ((t.inputs, False), (t.outputs, True)):
            for o in ops:
                b = bufs[o.buf]
                if b.kind in IMMUTABLE_KINDS or b.kind == K.IO_INPUT:
                    continue
                acc.setdefault(o.buf, []).append((t.id, write, _elems(b, o)))
    for buf, lst in acc.items():
        b = bufs[buf]
        written = set()
        for i, (ta, wa, ea) in enumerate(lst):
            for tb, wb, eb in lst[i + 1:]:
                if ta != tb and (wa or wb) and ea & eb:
                    lo, hi = min(ta, tb), max(ta, tb)
                    assert (hb[hi] >> lo) & 1, f"unordered conflict on {b.name}: {tasks[lo].name} / {tasks[hi].name}"
            if wa:
                written |= ea
            else:
                before = set().union(*(e for tc, wc, e in lst if wc and (hb[ta] >> tc) & 1))
                assert ea <= before, f"{tasks[ta].name} reads {b.name} elements no earlier task wrote"
        full = b.shape[1] if b.kind == K.KV_CACHE else b.numel
        assert written == set(range(full)), f"{b.name} not completely written"


def _check_params(p: Program, t) -> None:
    bufs, pr = p.buffers, t.params
    if t.op == Op.GEMV:
        w = t.inputs[0]
        assert w.count == pr.rows and w.len == pr.k_hi - pr.k_lo and bufs[w.buf].shape[1] == pr.k
        m = 2 if pr.epilogue == Epilogue.SILU_MUL else 1
        assert t.outputs[0].len == pr.rows * (m if pr.split_k > 1 else 1)
        if pr.epilogue in (Epilogue.ROPE, Epilogue.ROPE_APPEND):
            assert pr.rows % pr.head_dim == 0 and t.outputs[0].off % pr.head_dim == 0
        if pr.epilogue == Epilogue.ADD and pr.split_k == 1:
            res = t.inputs[input_roles(pr, bufs[w.buf].dtype).index("residual")]
            assert (res.buf, res.off, res.len) == (t.outputs[0].buf, t.outputs[0].off, t.outputs[0].len)
        if bufs[w.buf].group:
            assert pr.k_lo % bufs[w.buf].group == 0
    elif t.op == Op.REDUCE:
        assert t.inputs[0].count == pr.split_k
    elif t.op == Op.ATTN_PARTIAL:
        assert t.inputs[0].len == pr.q_heads * pr.head_dim and t.inputs[1].kv == KvMode.PREFIX


# ----------------------------------------------------------------------------- the matrix
try:
    from amk.schedule.validate import validate
except ImportError:  # pragma: no cover - the validator lands separately
    validate = None


@pytest.mark.parametrize("cname", list(CONFIGS))
@pytest.mark.parametrize("mname", list(ZOO))
def test_zoo_lowers_well_formed(mname, cname):
    spec = ZOO[mname]
    p = lower(spec, cfg_of(**CONFIGS[cname]), H100, kv_capacity=64)
    check_structure(p)
    assert Program.from_json(p.to_json()) == p
    assert p.kv_capacity == 64 and p.meta["model"] == spec.name
    if validate is not None:
        res = validate(p)
        assert res.accepted, res.summary()


@pytest.mark.parametrize("mname", ["gqa", "odd"])
def test_full_size_queues_validate(mname):
    """Default config: one queue per SM of the target (no max_queues)."""
    for target in ("h100", "mi300x"):
        p = lower(ZOO[mname], None, get_target(target), kv_capacity=128)
        assert len(p.queues) == get_target(target).compute_units
        res = validate(p)
        assert res.accepted, res.summary()


def test_buffer_contract():
    spec = ZOO["qwen3"]
    p = lower(spec, cfg_of(), H100, kv_capacity=32)
    b = {x.name: x for x in p.buffers}
    assert (b["token"].kind, b["token"].dtype, b["token"].shape) == (K.IO_INPUT, DType.I32, (1,))
    assert (b["pos"].kind, b["pos"].dtype, b["pos"].shape) == (K.IO_INPUT, DType.I32, (1,))
    assert (b["logits"].kind, b["logits"].dtype, b["logits"].shape) == (K.IO_OUTPUT, DType.F32, (spec.vocab_size,))
    assert (b["next_token"].kind, b["next_token"].dtype) == (K.IO_OUTPUT, DType.I32)
    for i in range(spec.num_layers):
        for kv in ("k", "v"):
            c = b[f"layers.{i}.{kv}_cache"]
            assert (c.kind, c.dtype, c.shape) == (K.KV_CACHE, DType.F32, (32, spec.num_kv_heads * spec.head_dim))
    weights = {x.name for x in p.buffers if x.kind == K.WEIGHT}
    assert weights == set(spec.expected_tensor_names())
    assert [x.name for x in p.buffers if x.kind == K.CONST] == ["rope.inv_freq"]
    assert [t.op for t in p.tasks][-1] == Op.ARGMAX


def test_every_op_is_used():
    used = set()
    for cname in ("default", "unfused", "split_k2"):
        p = lower(ZOO["qwen3"], cfg_of(**CONFIGS[cname]), H100, kv_capacity=16)
        used |= {t.op for t in p.tasks}
    assert used == set(Op)


def test_tied_head_reads_embedding_unless_quantized():
    spec = ZOO["gqa"]
    p = lower(spec, cfg_of(), H100, kv_capacity=16)
    head = [t for t in p.tasks if t.name.startswith("lm_head")]
    assert {p.buffers[t.inputs[0].buf].name for t in head} == {"model.embed_tokens.weight"}
    p = lower(spec, cfg_of(quant="int4", quant_lm_head=True), H100, kv_capacity=16)
    head = [t for t in p.tasks if t.name.startswith("lm_head")]
    q = p.buffer("lm_head.q")
    assert {t.inputs[0].buf for t in head} == {q.id} and q.dtype == DType.U4
    assert p.buffer("model.embed_tokens.weight").dtype == DType.F32
    p = lower(ZOO["mha"], cfg_of(quant="int8", quant_lm_head=True), H100, kv_capacity=16)
    assert p.buffer("lm_head.weight").dtype == DType.I8 and "lm_head.q" not in {b.name for b in p.buffers}


def test_fused_layer_is_six_hops():
    p = lower(ZOO["gqa"], cfg_of(), H100, kv_capacity=16)
    st = p.meta["stats"]
    # QKV -> attn partial -> combine -> o-proj -> gate/up -> down
    assert st["hops_per_layer"] == [6, 6]
    assert st == program_stats(Program.model_validate({**p.model_dump(), "meta": {}}))
    unfused = lower(ZOO["gqa"], cfg_of(**UNFUSED), H100, kv_capacity=16).meta["stats"]
    assert unfused["max_hops_per_layer"] > st["max_hops_per_layer"]
    assert st["streamed_bytes"] < st["weight_bytes"] + 1  # tied: the table is streamed once by the head
    assert st["floor_us"] == pytest.approx(st["streamed_bytes"] / (H100.hbm_gbps * 1e3))


def test_argmax_slices():
    """'auto': one PARTIAL argmax per 2048 logits (63 for Llama-3's vocabulary), 16-byte aligned
    slices that cover it, and their MERGE; 1: one WHOLE argmax."""
    spec = spec_from_hf_config(shape_config("llama-3.2-1b"), name="1b")
    p = lower(spec, ScheduleConfig(), H100, kv_capacity=64)
    parts = [t.params for t in p.tasks if t.params.op == Op.ARGMAX and t.params.mode == ArgmaxMode.PARTIAL]
    assert p.meta["resolved"]["argmax_splits"] == len(parts) == 63
    assert [q.base for q in parts] == [sum(r.n for r in parts[:i]) for i in range(63)]
    assert sum(q.n for q in parts) == spec.vocab_size and all(q.base % 8 == 0 for q in parts)
    (merge,) = [t for t in p.tasks if t.params.op == Op.ARGMAX and t.params.mode == ArgmaxMode.MERGE]
    assert merge.params.n == 63 and merge is p.tasks[-1]
    small = lower(spec_from_hf_config(shape_config("smollm2-135m"), name="s"), ScheduleConfig(), H100, kv_capacity=64)
    assert small.meta["resolved"]["argmax_splits"] == 24
    one = lower(spec, ScheduleConfig(argmax_splits=1), H100, kv_capacity=64)
    assert [t.params.mode for t in one.tasks if t.params.op == Op.ARGMAX] == [ArgmaxMode.WHOLE]


def test_meta():
    p = lower(ZOO["mqa"], cfg_of(prefetch_depth=3, dtype="bfloat16"), H100, kv_capacity=16)
    assert p.meta["vm"] == {"prefetch_depth": 3, "prefetch_kb": 64, "prefetch_min_kb": 0, "gemv_unroll": "auto",
                            "gemv_unroll_quant": "auto", "poll_cap_ns": 128, "gemv_loads_ahead": False}
    assert p.meta["family"] == "mistral" and p.meta["dtype"] == "BF16"
    assert ScheduleConfig.model_validate(p.meta["config"]) == cfg_of(prefetch_depth=3, dtype="bfloat16")
    assert {t.dtype for t in p.buffers if t.kind in (K.ACTIVATION, K.KV_CACHE)} == {DType.BF16}


def test_prefetch_depth_auto_is_off_for_small_gemv_tasks():
    """'auto' prefetch_depth resolves to 0 when no layer GEMV task streams more than
    SMALL_TASK_KB of weights (the LM head does not count), else 1; a number is kept."""
    from amk.eval.shapes import shape_config
    from amk.schedule.config import SMALL_TASK_KB
    from amk.schedule.importer import spec_from_hf_config
    from amk.schedule.importer.hf_config import normalize
    from amk.schedule.lower import LM_HEAD_STAGE
    from amk.schedule.placement import weight_bytes

    def resolved(shape, **cfg):
        spec = spec_from_hf_config(normalize(shape_config(shape)), name=shape, dtype="bfloat16")
        p = lower(spec, ScheduleConfig(**cfg), H100, kv_capacity=64)
        largest = max(weight_bytes(t, p.buffers) for t in p.tasks
                      if t.params.op == Op.GEMV and not t.name.startswith(LM_HEAD_STAGE))
        return p.meta["vm"]["prefetch_depth"], largest

    depth, largest = resolved("smollm2-135m")  # its LM head tasks (~430 KB) are larger, and do not count
    assert depth == 0 and largest <= SMALL_TASK_KB * 1024
    depth, largest = resolved("llama-3.2-1b")
    assert depth == 1 and largest > SMALL_TASK_KB * 1024
    assert resolved("smollm2-135m", prefetch_depth=2)[0] == 2 and resolved("llama-3.2-1b", prefetch_depth=0)[0] == 0


def test_poll_cap_auto_is_short_for_programs_of_short_gemv_tasks():
    """'auto' poll_cap_ns resolves to the short cap when no layer GEMV task streams more than
    SHORT_POLL_TASK_KB of weights (SmolLM2, the 1B), else to the VM's (the 8B); a number is kept.
    The loader turns only a cap other than the VM's into a define."""
    from amk.eval.shapes import shape_config
    from amk.schedule.config import SHORT_POLL_CAP_NS, VM_POLL_CAP_NS
    from amk.schedule.importer import spec_from_hf_config
    from amk.schedule.importer.hf_config import normalize
    from amk.vm.loader import knob_defines

    def lowered(shape, **cfg):
        spec = spec_from_hf_config(normalize(shape_config(shape)), name=shape, dtype="bfloat16")
        return lower(spec, ScheduleConfig(**cfg), H100, kv_capacity=64)

    small, big = lowered("llama-3.2-1b"), lowered("llama-3.1-8b")
    assert small.meta["vm"]["poll_cap_ns"] == SHORT_POLL_CAP_NS and big.meta["vm"]["poll_cap_ns"] == VM_POLL_CAP_NS
    assert knob_defines(small)["AMK_SPIN_MAX_NS"] == SHORT_POLL_CAP_NS and "AMK_SPIN_MAX_NS" not in knob_defines(big)
    assert lowered("smollm2-135m", poll_cap_ns=512).meta["vm"]["poll_cap_ns"] == 512


def test_gemv_loads_ahead_auto_is_on_for_large_tasks_but_asymmetric_int8():
    """'auto' gemv_loads_ahead resolves to on for float-weight, symmetric int8 and int4 programs
    with a layer GEMV task of more than SMALL_TASK_KB (the 1B, the 8B, the int8 and int4 1B), off
    for SmolLM2's small tasks and asymmetric int8 programs (whose GEMV keeps the plain loop); a
    bool is kept. The loader turns on into AMK_GEMV_LOADS_AHEAD."""
    from amk.eval.shapes import shape_config
    from amk.schedule.importer import spec_from_hf_config
    from amk.schedule.importer.hf_config import normalize
    from amk.vm.loader import knob_defines

    def lowered(shape, **cfg):
        spec = spec_from_hf_config(normalize(shape_config(shape)), name=shape, dtype="bfloat16")
        return lower(spec, ScheduleConfig(**cfg), H100, kv_capacity=64)

    on = [lowered("llama-3.2-1b"), lowered("llama-3.1-8b"), lowered("llama-3.2-1b", quant="int8"),
          lowered("llama-3.2-1b", quant="int4")]
    off = [lowered("smollm2-135m"), lowered("smollm2-135m", quant="int4"),
           lowered("llama-3.2-1b", quant="int8", quant_asym=True)]
    assert [p.meta["vm"]["gemv_loads_ahead"] for p in on + off] == [True] * 4 + [False] * 3
    assert all(knob_defines(p)["AMK_GEMV_LOADS_AHEAD"] == 1 for p in on)
    assert not any("AMK_GEMV_LOADS_AHEAD" in knob_defines(p) for p in off)
    assert lowered("smollm2-135m", gemv_loads_ahead=True).meta["vm"]["gemv_loads_ahead"] is True
    assert lowered("llama-3.2-1b", gemv_loads_ahead=False).meta["vm"]["gemv_loads_ahead"] is False
    assert lowered("llama-3.2-1b", quant="int4", gemv_loads_ahead=False).meta["vm"]["gemv_loads_ahead"] is False


def test_slabs_and_splits_follow_config():
    spec = ZOO["gqa"]
    p = lower(spec, cfg_of(gemv_tasks_per_matrix=4, split_k=2, kv_splits=3), H100, kv_capacity=64)
    o = [t for t in p.tasks if t.name.startswith("layers.0.o_proj") and t.op == Op.GEMV]
    assert len(o) == 4 * 2 and {t.params.split_k for t in o} == {2}
    attn = [t for t in p.tasks if t.name.startswith("layers.0.attn_partial")]
    assert len(attn) == spec.num_kv_heads * 3
    # q/k/v slabs cover whole heads when RoPE is fused
    qkv = [t for t in p.tasks if t.name.startswith("layers.0.qkv") and t.op == Op.GEMV]
    assert all(t.params.rows % spec.head_dim == 0 for t in qkv if t.params.epilogue != Epilogue.APPEND)


def test_explicit_queues():
    spec = ZOO["mha"]
    n = len(lower(spec, cfg_of(), H100, kv_capacity=16).tasks)
    rng = random.Random(0)
    where = [rng.randrange(8) for _ in range(n)]
    p = lower(spec, cfg_of(sm_assignment="explicit", explicit_queues=where), H100, kv_capacity=16)
    for q, ids in enumerate(p.queues):
        assert all(where[i] == q for i in ids)
    check_structure(p)
    with pytest.raises(ValueError, match="explicit_queues"):
        lower(spec, cfg_of(sm_assignment="explicit", explicit_queues=where[:-1]), H100, kv_capacity=16)
    with pytest.raises(ValueError, match="explicit_queues"):
        lower(spec, cfg_of(sm_assignment="explicit", explicit_queues=[8] * n), H100, kv_capacity=16)


def test_refusals():
    with pytest.raises(ValueError, match="do not fit"):
        lower(ZOO["mha"], ScheduleConfig(threads_per_block=1024, blocks_per_sm=4), H100)
    with pytest.raises(ValueError, match="kv_capacity"):
        lower(ZOO["mha"], None, H100, kv_capacity=0)
    with pytest.raises(ValueError, match="cannot be split"):
        lower(spec_of("tiny", H=64, heads=1, kv=1, F=128), cfg_of(split_k=16), H100)


# every field, a (base, changed) pair of config overrides; the lowered JSON must differ
FIELD_CHANGES = {
    "gemv_tasks_per_matrix": ({}, dict(gemv_tasks_per_matrix=3)),
    "split_k": ({}, dict(split_k=2)),
    "kv_splits": ({}, dict(kv_splits=3)),
    "kv_block": ({}, dict(kv_block=64)),
    "argmax_splits": ({}, dict(argmax_splits=3)),
    "sm_assignment": ({}, dict(sm_assignment="round_robin")),
    "explicit_queues": ("explicit0", "explicit1"),
    "blocks_per_sm": (dict(max_queues=None), dict(max_queues=None, blocks_per_sm=2)),
    "max_queues": ({}, dict(max_queues=4)),
    "threads_per_block": ({}, dict(threads_per_block=512)),
    "prefetch_depth": ({}, dict(prefetch_depth=2)),
    "prefetch_kb": ({}, dict(prefetch_kb=128)),
    "prefetch_min_kb": ({}, dict(prefetch_min_kb=128)),
    "gemv_unroll": ({}, dict(gemv_unroll=4)),
    "gemv_unroll_quant": ({}, dict(gemv_unroll_quant=4)),
    "poll_cap_ns": ({}, dict(poll_cap_ns=256)),
    "gemv_loads_ahead": ({}, dict(gemv_loads_ahead=False)),  # (gqa's one-task matrices: auto is on)
    "fuse_norm": ({}, dict(fuse_norm=False)),
    "fuse_rope_append": ({}, dict(fuse_rope_append=False)),
    "fuse_residual": ({}, dict(fuse_residual=False)),
    "rope_rows": ({}, dict(rope_rows=16)),
    "rope_multi_run": ({}, dict(rope_multi_run=False)),
    "kv_head_counters": ({}, dict(kv_head_counters=False)),
    "kv_head_major": ({}, dict(kv_head_major=True)),
    "fuse_attn_combine": ({}, dict(fuse_attn_combine=True)),
    "o_proj_kv_slices": ({}, dict(o_proj_kv_slices=2)),
    "fuse_argmax": ({}, dict(fuse_argmax=True)),
    "fuse_silu_mul": ({}, dict(fuse_silu_mul=False)),
    "quant": ({}, dict(quant="int8")),
    "quant_group": (dict(quant="int8"), dict(quant="int8", quant_group=32)),
    "quant_asym": (dict(quant="int8", quant_group=32), dict(quant="int8", quant_group=32, quant_asym=True)),
    "quant_lm_head": (dict(quant="int8"), dict(quant="int8", quant_lm_head=True)),
    "quant_unpack": (dict(quant="int4"), dict(quant="int4", quant_unpack=1)),
    "dtype": ({}, dict(dtype="bfloat16")),
    "xcd_placement": ({}, dict(xcd_placement=False)),
}
FIELD_TARGET = {"xcd_placement": get_target("mi300x")}  # a chiplet field: lowered for a multi-XCD target


def test_every_field_is_covered():
    assert set(FIELD_CHANGES) == set(ScheduleConfig.model_fields)


@pytest.mark.parametrize("field", list(FIELD_CHANGES))
def test_every_field_changes_the_program(field):
    spec = ZOO["gqa"]
    base, alt = FIELD_CHANGES[field]
    if base == "explicit0":
        n = len(lower(spec, cfg_of(), H100, kv_capacity=64).tasks)
        base = dict(sm_assignment="explicit", explicit_queues=[0] * n)
        alt = dict(sm_assignment="explicit", explicit_queues=[i % 8 for i in range(n)])
    target = FIELD_TARGET.get(field, H100)
    a = lower(spec, cfg_of(**base), target, kv_capacity=64)
    b = lower(spec, cfg_of(**alt), target, kv_capacity=64)
    strip = lambda p: Program.model_validate({**p.model_dump(), "meta": {**p.meta, "config": None}}).to_json()
    assert strip(a) != strip(b), f"{field} does not change the lowered program"


# ----------------------------------------------------------------------------- weights
def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {}
    H, F, V, d = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim
    QD, KD = spec.num_heads * d, spec.num_kv_heads * d
    for name in spec.expected_tensor_names():
        if name.endswith("norm.weight") or "layernorm" in name:
            shapes[name] = [d] if ("q_norm" in name or "k_norm" in name) else [H]
        elif name.endswith(".bias"):
            shapes[name] = [QD if "q_proj" in name else KD]
        else:
            base = name.split(".")[-2]
            shapes[name] = {"embed_tokens": [V, H], "lm_head": [V, H], "q_proj": [QD, H], "k_proj": [KD, H],
                            "v_proj": [KD, H], "o_proj": [H, QD], "gate_proj": [F, H], "up_proj": [F, H],
                            "down_proj": [H, F]}[base]
    out = {}
    for n, s in shapes.items():
        if len(s) == 1 and not n.endswith(".bias"):
            out[n] = 1.0 + 0.2 * torch.randn(s, generator=g)
        else:
            out[n] = 0.05 * torch.randn(s, generator=g)
    return out


def test_bind_weights_layouts():
    spec = ZOO["odd"]  # K=576: int4 group 128 falls back to 64
    w = random_weights(spec)
    for kw in (dict(quant="int8", quant_group="channel", quant_lm_head=True),
               dict(quant="int8", quant_group=32, quant_asym=True, quant_lm_head=True),
               dict(quant="int4", quant_group=128, quant_lm_head=True), dict(dtype="bfloat16")):
        p = lower(spec, cfg_of(**kw), H100, kv_capacity=16)
        t = bind_weights(p, spec, w)
        assert set(t) == {b.name for b in p.buffers if b.kind in IMMUTABLE_KINDS}
        for b in p.buffers:
            if b.kind not in IMMUTABLE_KINDS:
                continue
            x = t[b.name]
            want = {DType.I8: torch.int8, DType.U4: torch.uint8, DType.F32: torch.float32,
                    DType.BF16: torch.bfloat16, DType.F16: torch.float16}[b.dtype]
            assert x.dtype == want, b.name
            assert x.numel() * x.element_size() * 8 == b.numel * DTYPE_BITS[b.dtype], b.name
            if b.scale is not None:
                scale = t[p.buffers[b.scale].name]
                zero = t[p.buffers[b.zero].name] if b.zero is not None else None
                assert list(scale.shape) == [b.shape[0], b.shape[1] // b.group]
                src = w["model.embed_tokens.weight" if b.name == "lm_head.q" else b.name]
                deq = in_hf_order(p, b.name, dequantize(x, scale, zero))  # rope_rows < head_dim permutes q/k
                err = (deq - src).abs().max()
                step = 2 * src.abs().max() / (15 if b.dtype == DType.U4 else 254)
                assert err <= step, (b.name, err, step)
        if kw.get("quant_asym"):  # every quantized matrix, the LM head's copy too, has its zero
            assert all(b.zero is not None for b in p.buffers if b.dtype == DType.I8)
        if kw.get("quant") == "int4":
            assert p.buffer("model.layers.0.self_attn.q_proj.weight").group == 64
            assert p.buffer("model.layers.0.mlp.down_proj.weight").group == 128
    with pytest.raises(KeyError):
        bind_weights(p, spec, {k: v for k, v in w.items() if "down_proj" not in k})


def test_quantizers_roundtrip():
    w = torch.randn(6, 64)
    codes, scale = quantize_int8(w, 32, torch.float32)
    assert codes.dtype == torch.int8 and scale.shape == (6, 2)
    assert (dequantize(codes, scale) - w).abs().max() <= scale.max() / 2 + 1e-6
    packed, scale, zero = quantize_int4(w, 16, torch.float16)
    assert packed.shape == (6, 32) and zero.shape == (6, 4)
    low = packed[0, 0] & 0xF
    c0 = torch.round((w[0, 0] - zero[0, 0].float()) / scale[0, 0].float()).clamp(0, 15)
    assert int(low) == int(c0)  # element 0 in the low nibble of byte 0
    assert (dequantize(packed, scale, zero) - w).abs().max() <= scale.float().max() / 2 + 1e-3
    codes, scale, zero = quantize_int8_asym(w, 32, torch.float32)
    assert codes.dtype == torch.int8 and scale.shape == zero.shape == (6, 2)
    assert codes.min() == -128 and codes.max() == 127  # each group spans the whole code range
    assert (dequantize(codes, scale, zero) - w).abs().max() <= scale.max() / 2 + 1e-6
    grid = -0.3 + 0.01 * torch.randint(0, 16, (6, 64)).float()  # a Q4_1-like grid: 16 levels from a minimum
    grid[:, ::32], grid[:, 1::32] = -0.3, -0.15  # every group spans all 16
    codes, scale, zero = quantize_int8_asym(grid, 32, torch.float32)
    assert (dequantize(codes, scale, zero) - grid).abs().max() < 1e-6  # codes 17 apart: exact
    assert group_for(576, 128) == 64 and group_for(4096, "channel") == 4096
    assert tiles(10, 3) == [(0, 4), (4, 7), (7, 10)] and tiles(256, 3, 64) == [(0, 128), (128, 192), (192, 256)]


def _hf_cfg(family, spec_kw, **extra):
    import transformers

    kw = dict(vocab_size=spec_kw["V"], hidden_size=spec_kw["H"], intermediate_size=spec_kw["F"],
              num_hidden_layers=spec_kw["L"], num_attention_heads=spec_kw["heads"],
              num_key_value_heads=spec_kw["kv"], head_dim=spec_kw["d"], rms_norm_eps=1e-5,
              max_position_embeddings=512, tie_word_embeddings=spec_kw.get("tied", False), **extra)
    return transformers.AutoConfig.for_model(family, **kw)


def test_rope_matches_hf_llama3_and_refuses_scaled_attention():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    sk = dict(V=64, H=128, F=256, L=1, heads=2, kv=1, d=64)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = _hf_cfg("llama", sk, rope_scaling=scaling, rope_theta=500000.0)
    spec = spec_of("l3", H=128, heads=2, kv=1, d=64, F=256, L=1, V=64, hf_config=hf.to_dict(), rope_scaling=scaling)
    assert torch.equal(rope_inv_freq(spec), LlamaRotaryEmbedding(hf).inv_freq)
    plain = spec_of("plain", H=128, heads=2, kv=1, d=64)
    ref = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    assert torch.equal(rope_inv_freq(plain), ref)
    yarn = _hf_cfg("llama", sk, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="attention_scaling|not supported"):
        rope_inv_freq(spec_of("yarn", H=128, heads=2, kv=1, d=64, F=256, L=1, V=64, hf_config=yarn.to_dict()))


# ----------------------------------------------------------------------------- vs eager HF
E2E = [
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), {}),
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), UNFUSED),
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), dict(argmax_splits=3)),  # PARTIALs + MERGE
    ("qwen2", dict(H=128, heads=4, kv=1, d=64, F=192, L=2, V=200, tied=True), dict(split_k=2, kv_splits=3, kv_block=8)),
    ("qwen3", dict(H=64, heads=4, kv=2, d=32, F=128, L=2, V=160), dict(split_k=4, **UNFUSED, sm_assignment="round_robin")),
    ("qwen3", dict(H=64, heads=4, kv=2, d=32, F=128, L=2, V=160), dict(fuse_norm=False, fuse_silu_mul=False)),
    ("mistral", dict(H=96, heads=3, kv=3, d=32, F=160, L=2, V=128), dict(quant="int8", quant_group=32, quant_lm_head=True)),
    ("llama", dict(H=128, heads=2, kv=1, d=64, F=256, L=1, V=128, tied=True),
     dict(quant="int4", quant_group=32, quant_lm_head=True, split_k=2, gemv_tasks_per_matrix=3)),
    # q/k heads permuted into RoPE runs shorter than a head: float, quantized, split-K, bias
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), dict(rope_rows=8)),
    ("llama", dict(H=128, heads=2, kv=1, d=64, F=256, L=1, V=128, tied=True),
     dict(quant="int4", quant_group=32, rope_rows=16, split_k=2)),
    ("qwen2", dict(H=128, heads=4, kv=1, d=64, F=192, L=2, V=200, tied=True), dict(rope_rows=4, kv_splits=3)),
    # q/k tasks of several runs, across heads (each run its own frequencies): auto, and cut unevenly
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), dict(rope_multi_run=True)),
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200),
     dict(rope_multi_run=True, rope_rows=8, gemv_tasks_per_matrix=3, quant="int8", quant_group=32)),
    # a counter per KV head for q/k/v and the partials: alone, with split-K (REDUCE tasks), unfused
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), dict(kv_head_counters=True)),
    ("qwen2", dict(H=128, heads=4, kv=2, d=32, F=192, L=2, V=200), dict(kv_head_counters=True, split_k=2)),
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200),
     dict(kv_head_counters=True, fuse_rope_append=False, kv_splits=3)),
    # the attention combine in the o-proj's prologue: float, quantized o-proj, unfused residual and
    # norm, split-K (which keeps the standalone combine)
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), dict(fuse_attn_combine=True, kv_splits=3)),
    ("mistral", dict(H=96, heads=3, kv=3, d=32, F=160, L=2, V=128),
     dict(fuse_attn_combine=True, quant="int8", quant_group=32, gemv_tasks_per_matrix=3)),
    ("qwen3", dict(H=64, heads=4, kv=2, d=32, F=128, L=2, V=160), dict(fuse_attn_combine=True, **UNFUSED)),
    ("qwen2", dict(H=128, heads=4, kv=2, d=32, F=192, L=2, V=200), dict(fuse_attn_combine=True, split_k=2)),
    # the o-proj in K slices of KV heads, their sums read by the MLP (o_proj_kv_slices): a slice a KV
    # head, one slice for both heads, quantized with bias and unfused gate/up, three heads of a Qwen2
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200), dict(o_proj_kv_slices=2, kv_splits=3)),
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200, tied=True), dict(o_proj_kv_slices=1)),
    ("qwen2", dict(H=96, heads=6, kv=3, d=32, F=192, L=2, V=200),
     dict(o_proj_kv_slices=3, quant="int8", quant_group=32, fuse_silu_mul=False, gemv_tasks_per_matrix=3)),
    # the LM head's tasks write the argmax pairs (a quantized tied head; split-K keeps the PARTIALs)
    ("llama", dict(H=128, heads=4, kv=2, d=32, F=256, L=2, V=200, tied=True),
     dict(fuse_argmax=True, quant="int8", quant_group=32, quant_lm_head=True)),
    ("qwen2", dict(H=128, heads=4, kv=2, d=32, F=192, L=2, V=200), dict(fuse_argmax=True, split_k=2)),
]


@pytest.mark.parametrize("family,sk,cfg", E2E)
def test_matches_eager_hf(family, sk, cfg):
    import amk.vm.reference as rvm
    import transformers

    hf_cfg = _hf_cfg(family, sk)
    spec = spec_of(f"e2e-{family}", family=family, H=sk["H"], heads=sk["heads"], kv=sk["kv"], d=sk["d"], F=sk["F"],
                   L=sk["L"], V=sk["V"], tied=sk.get("tied", False), hf_config=hf_cfg.to_dict())
    weights = random_weights(spec, seed=1)
    p = lower(spec, cfg_of(max_queues=6, **cfg), H100, kv_capacity=16)
    tensors = bind_weights(p, spec, weights)
    # the eager reference runs the weights the program holds (dequantized where quantized)
    ref_w = dict(weights)
    for b in p.buffers:
        if b.scale is not None:
            zero = tensors[p.buffers[b.zero].name] if b.zero is not None else None
            deq = dequantize(tensors[b.name], tensors[p.buffers[b.scale].name], zero)
            deq = in_hf_order(p, b.name, deq)  # rope_rows < head_dim: back to the HF row order
            ref_w["lm_head.weight" if b.name == "lm_head.q" else b.name] = deq
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    state = dict(ref_w)
    if spec.tie_word_embeddings:
        if "lm_head.weight" in state:  # a quantized tied head: untie the eager model to hold both
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(state["lm_head.weight"].clone())
            state.pop("lm_head.weight")
        model.load_state_dict(state, strict=False)
    else:
        model.load_state_dict(state, strict=True)
    ids = [5, 17, 42, 7, 99]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    vm = rvm.ReferenceVM(p, tensors)
    got = vm.logits_for(ids)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    assert vm.generate(ids[:2], 3) == _greedy(model, ids[:2], 3)


def _greedy(model, ids, n):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


# ----------------------------------------------------------------------------- helpers
def test_hazard_tracker_waits():
    from amk.schedule.hazards import HazardTracker
    from amk.schedule.ir import Operand

    hz = HazardTracker(kinds={0: K.ACTIVATION, 1: K.WEIGHT, 2: K.KV_CACHE})
    op = lambda buf, off, n, **kw: Operand(buf=buf, off=off, len=n, **kw)  # noqa: E731
    assert hz.deps([op(1, 0, 4)], [op(0, 0, 10)]) == []  # weights are not tracked
    hz.commit(0, [([op(1, 0, 4)], [op(0, 0, 10)], [])])  # group 0 writes x
    assert hz.deps([op(0, 2, 2)], []) == [0]  # RAW
    hz.commit(1, [([op(0, 0, 10)], [op(2, 0, 4, kv=KvMode.APPEND)], [0])])  # group 1 reads x, appends
    # WAR on group 1 and WAW on group 0: group 0 is implied through group 1
    assert hz.deps([], [op(0, 0, 5)]) == [1]
    assert hz.deps([op(2, 2, 2, kv=KvMode.PREFIX)], []) == [1]  # prefix read after the append
    assert hz.deps([op(2, 4, 2, kv=KvMode.PREFIX)], []) == []  # other columns
    with pytest.raises(RuntimeError, match="both write"):
        hz.commit(2, [([], [op(0, 0, 6)], [1]), ([], [op(0, 5, 5)], [1])])


def test_hazard_tracker_flags_intra_group_read_write():
    from amk.schedule.hazards import HazardTracker
    from amk.schedule.ir import Operand

    hz = HazardTracker(kinds={0: K.ACTIVATION})
    with pytest.raises(RuntimeError, match="reads buffer"):
        hz.commit(0, [([Operand(buf=0, off=0, len=8)], [Operand(buf=0, off=0, len=4)], []),
                      ([Operand(buf=0, off=0, len=8)], [Operand(buf=0, off=4, len=4)], [])])


def test_lpt_balances_bytes_within_a_level():
    from amk.schedule import placement

    p = lower(ZOO["odd"], cfg_of(max_queues=8, gemv_tasks_per_matrix=20), H100, kv_capacity=16)
    buffers = p.buffers
    cost = [placement.task_bytes(t, buffers, 16) for t in p.tasks]
    levels = placement.dag_levels(p.tasks)

    def worst(queues):  # sum over levels of the most loaded queue in that level
        where = {i: q for q, ids in enumerate(queues) for i in ids}
        total = 0.0
        for lv in set(levels):
            load = [0.0] * len(queues)
            for i, l in enumerate(levels):
                if l == lv:
                    load[where[i]] += cost[i]
            total += max(load)
        return total

    rr = placement.assign(p.tasks, 8, "round_robin", cost)
    lpt = placement.assign(p.tasks, 8, "lpt", cost)
    assert worst(lpt) <= worst(rr)
    assert lpt == [list(q) for q in p.queues]


def test_amd_warp_multiple():
    with pytest.raises(ValueError, match="warp size"):
        lower(ZOO["mha"], cfg_of(threads_per_block=96), get_target("mi300x"), kv_capacity=16)
    assert lower(ZOO["mha"], cfg_of(threads_per_block=128), get_target("mi300x"), kv_capacity=16).threads_per_block == 128


# ----------------------------------------------------------------------------- rope_rows
def test_rope_rows_runs_hold_whole_rotate_half_pairs():
    for d, r in ((64, 64), (64, 16), (128, 32), (32, 8), (8, 2)):
        order = head_order(d, r)
        assert sorted(order) == list(range(d))
        for p, dim in enumerate(order):  # the partner of a run's first half sits r/2 later in the same run
            if p % r < r // 2:
                assert order[p + r // 2] == dim + d // 2
    assert head_order(64, 64) == list(range(64))  # whole heads: the HF layout
    for bad in (0, 3, 12, 128):
        with pytest.raises(ValueError):
            head_order(64, bad)


def test_rope_rows_lowering_and_refusals():
    spec = ZOO["gqa"]  # head_dim 64, 4 + 2 heads; one RoPE run a task (test_rope_multi_run_* below: several)
    one_run = dict(rope_multi_run=False)
    p = lower(spec, cfg_of(rope_rows=16, **one_run), H100, kv_capacity=16)
    q = [t for t in p.tasks if t.name.startswith("layers.0.qkv.q[")]
    assert len(q) == 4 * 64 // 16 and all(t.params.head_dim == 16 and t.params.rows == 16 for t in q)
    assert p.meta["rope_rows"]["rows"] == 16 and len(p.meta["rope_rows"]["permuted"]) == 2 * spec.num_layers
    for r, queues in ((16, None), (8, 6)):  # v slabs no larger than the q/k runs, even past the budget
        pr = lower(spec, cfg_of(rope_rows=r, **one_run, **({"max_queues": queues} if queues else {})), H100,
                   kv_capacity=16)
        v = [t.params.rows for t in pr.tasks if t.name.startswith("layers.0.qkv.v[")]
        assert sum(v) == spec.num_kv_heads * spec.head_dim and max(v) <= r
    whole = lower(spec, cfg_of(rope_rows=64), H100, kv_capacity=16)
    assert "rope_rows" not in whole.meta
    with pytest.raises(ValueError, match="whole heads"):  # RoPE in standalone per-head ops
        lower(spec, cfg_of(rope_rows=16, fuse_rope_append=False), H100, kv_capacity=16)
    with pytest.raises(ValueError, match="even divisor"):
        lower(spec, cfg_of(rope_rows=24), H100, kv_capacity=16)


def test_rope_multi_run_tasks_span_runs_and_heads():
    spec = ZOO["gqa"]  # head_dim 64, 4 + 2 heads
    p = lower(spec, cfg_of(rope_multi_run=True, gemv_tasks_per_matrix=3), H100, kv_capacity=16)
    assert p.meta["rope_rows"]["rows"] == 8  # 'auto' with several runs a task: the finest cut
    q = [t for t in p.tasks if t.name.startswith("layers.0.qkv.q[")]
    r0s = [int(t.name.split("[")[1].split(":")[0]) for t in q]
    assert sum(t.params.rows for t in q) == 4 * 64 and all(t.params.rows % 8 == 0 for t in q)
    assert any(r0 // 64 != (r0 + t.params.rows - 1) // 64 for r0, t in zip(r0s, q))  # a task spans two heads
    inv = next(b for b in p.buffers if b.name == "rope.inv_freq")
    assert inv.numel == spec.num_heads * 64 // 2
    for r0, t in zip(r0s, q):  # the frequencies of its runs: entries r0/2 .. (r0 + rows)/2 of the table
        f = t.inputs[input_roles(t.params).index("inv_freq")]  # (float weights: no scale roles)
        assert (f.buf, f.off, f.len) == (inv.id, r0 // 2, t.params.rows // 2)
    res = validate(p)
    assert res.accepted, res.summary()


@pytest.mark.parametrize("shape,one_run,multi_run", [("llama-3.2-1b", 32, 24), ("llama-3.1-8b", 64, 48)])
def test_rope_multi_run_fills_the_h100(shape, one_run, multi_run):
    """q/k/v of the 1B and 8B shapes: one run a task leaves 36 of the H100's 132 SMs idle;
    tasks of several runs fill it (eval/PERF_NOTES.md items 97, 113)."""
    spec = spec_from_hf_config(shape_config(shape), name=shape, dtype="bfloat16")
    for multi, rows, tasks in ((False, one_run, 96), (True, multi_run, 130)):
        p = lower(spec, ScheduleConfig(dtype="bfloat16", rope_multi_run=multi), H100, kv_capacity=1156)  # every queue
        qkv = [t for t in p.tasks if t.name.startswith("layers.0.qkv.")]
        assert (len(qkv), max(t.params.rows for t in qkv)) == (tasks, rows)
        res = validate(p)
        assert res.accepted, res.summary()


def test_kv_head_counters_narrow_the_attention_waits():
    """kv_head_counters: a combine waits for its own KV head's partials only, and a partial for
    the q/k/v slabs of its head (plus a slab that crosses into it), not for whole stages."""
    spec = ZOO["gqa"]  # head_dim 64, 4 q heads on 2 KV heads
    p = lower(spec, cfg_of(kv_head_counters=True, gemv_tasks_per_matrix=8, kv_splits=2), H100, kv_capacity=16)
    writers: dict[int, list] = {}
    for t in p.tasks:
        writers.setdefault(t.out_counter, []).append(t)
    for g in range(spec.num_kv_heads):
        comb = next(t for t in p.tasks if t.name == f"layers.0.attn_combine[g{g}]")
        (w,) = comb.waits
        assert sorted(t.name for t in writers[w.counter]) == [f"layers.0.attn_partial[g{g}.s{s}]" for s in range(2)]
        part = next(t for t in p.tasks if t.name == f"layers.0.attn_partial[g{g}.s0]")
        qkv = [t for w in part.waits for t in writers[w.counter]]
        assert all(t.name.startswith("layers.0.qkv.") for t in qkv)
        assert {t.name.split("[")[0] for t in qkv} == {"layers.0.qkv.q", "layers.0.qkv.k", "layers.0.qkv.v"}
        assert len(qkv) < sum(t.name.startswith("layers.0.qkv.") for t in p.tasks)  # not the whole stage
    res = validate(p)
    assert res.accepted, res.summary()


@pytest.mark.parametrize("kv_head_counters", [False, True])
def test_fuse_attn_combine_drops_the_combine_stage(kv_head_counters):
    """fuse_attn_combine: no ATTN_COMBINE tasks; every o-proj task reads all KV heads' partials
    (o and ml whole), waits for the layer's partials (one counter: a counter per KV head would
    give the 8 KV heads of a Llama-3 more waits than a task holds), and the program validates."""
    spec = ZOO["gqa"]
    cfg = dict(kv_head_counters=kv_head_counters, gemv_tasks_per_matrix=4, kv_splits=3)
    base = lower(spec, cfg_of(**cfg), H100, kv_capacity=16)
    p = lower(spec, cfg_of(fuse_attn_combine=True, **cfg), H100, kv_capacity=16)
    assert not any(t.op == Op.ATTN_COMBINE for t in p.tasks)
    assert any("attn_combine" in c.name for c in base.counters)
    assert not any("attn_combine" in c.name for c in p.counters)  # one stage a layer fewer
    writers: dict[int, set] = {}
    for t in p.tasks:
        writers.setdefault(t.out_counter, set()).add(t.name.split("[")[0])
    partials = {c for c, names in writers.items() if any(".attn_partial" in n for n in names)}
    o_tasks = [t for t in p.tasks if t.name.startswith("layers.0.o_proj")]
    assert len(o_tasks) > 1
    for t in o_tasks:
        assert (t.params.combine_splits, t.params.combine_q_heads, t.params.combine_head_dim) == (3, 2, 64)
        o, ml = (p.buffers[t.inputs[i].buf] for i in (1, 2))
        assert (o.name, ml.name) == ("attn.o_partial", "attn.ml")
        assert (t.inputs[1].len, t.inputs[2].len) == (o.numel, ml.numel)
        waited = {w.counter for w in t.waits}
        layer0 = {c for c in partials if any(n.startswith("layers.0.") for n in writers[c])}
        assert len(layer0) == 1 and layer0 <= waited
    res = validate(p)
    assert res.accepted, res.summary()


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_fuse_argmax_drops_the_partial_stage(quant):
    """fuse_argmax: no PARTIAL argmax tasks; LM head task i writes its rows' pair into pairs[i]
    with its first row as the index base, and one MERGE reads every pair after the whole LM head
    stage (quantized head too). With split_k > 1 the PARTIALs stay (a REDUCE finishes the logits)."""
    spec = ZOO["gqa"]
    cfg = dict(gemv_tasks_per_matrix=5, argmax_splits=3, quant=quant, quant_lm_head=quant != "none")
    p = lower(spec, cfg_of(fuse_argmax=True, **cfg), H100, kv_capacity=16)
    assert p.meta["resolved"]["fuse_argmax"]
    argmax = [t for t in p.tasks if t.op == Op.ARGMAX]
    assert [t.params.mode for t in argmax] == [ArgmaxMode.MERGE]
    head = sorted((t for t in p.tasks if t.name.startswith("lm_head.")), key=lambda t: t.outputs[0].off)
    assert len(head) == 5 and argmax[0].params.n == 5
    pairs = p.buffers[argmax[0].inputs[0].buf]
    for i, t in enumerate(head):
        assert t.params.argmax_pair_base == t.outputs[0].off
        assert (t.outputs[1].buf, t.outputs[1].off, t.outputs[1].len) == (pairs.id, 2 * i, 2)
    assert {w.counter for w in argmax[0].waits} == {head[0].out_counter}
    assert validate(p).accepted
    # the build that writes the pairs is the program's own; one without it is refused, not run
    from amk.vm.loader import VMRefused, build_defines, knob_defines
    assert knob_defines(p)["AMK_GEMV_ARGMAX"] == 1 and "AMK_GEMV_ARGMAX" not in knob_defines(lower(spec, cfg_of(**cfg), H100, kv_capacity=16))
    with pytest.raises(VMRefused, match="AMK_GEMV_ARGMAX=0"):
        build_defines(p, experiments={"AMK_GEMV_ARGMAX": 0})
    split = lower(spec, cfg_of(fuse_argmax=True, split_k=2, **cfg), H100, kv_capacity=16)
    assert not split.meta["resolved"]["fuse_argmax"]
    assert sum(t.op == Op.ARGMAX for t in split.tasks) == 3 + 1
    assert all(t.params.argmax_pair_base is None for t in split.tasks if t.op == Op.GEMV)


@pytest.mark.parametrize("slices", [1, 2])
def test_o_proj_kv_slices_drops_the_combine_stage(slices):
    """o_proj_kv_slices: no ATTN_COMBINE or REDUCE tasks; o task (slab, slice j) reads the attention
    partials of slice j's KV heads only, waits for their counter alone, and writes row partials
    into slice j of a scratch that every gate/up task reads whole with x and each down task reads
    for its rows with its residual; a layer has one stage fewer and the program validates."""
    spec = ZOO["gqa"]
    cfg = dict(gemv_tasks_per_matrix=4, kv_splits=3)
    base = lower(spec, cfg_of(**cfg), H100, kv_capacity=16)
    p = lower(spec, cfg_of(o_proj_kv_slices=slices, **cfg), H100, kv_capacity=16)
    assert not any(t.op in (Op.ATTN_COMBINE, Op.REDUCE) for t in p.tasks)
    def layer_stages(prog):  # (a stage may have a counter a KV head, slice or group of q/k/v slabs)
        return {re.sub(r"\.[gsc]\d+$", "", c.name) for c in prog.counters if c.name.startswith("layers.0.")}

    assert layer_stages(base) - layer_stages(p) == {"layers.0.attn_combine"}
    assert layer_stages(p) < layer_stages(base)
    scratch = next(b for b in p.buffers if b.name == "o_proj.partial")
    assert scratch.shape == (slices, spec.hidden_size)
    heads = spec.num_kv_heads // slices
    by_counter = {c.id: c.name for c in p.counters}
    o_tasks = [t for t in p.tasks if t.name.startswith("layers.0.o_proj")]
    assert len(o_tasks) == -(-4 // slices) * slices and {t.name[-1] for t in o_tasks} == {str(j) for j in range(slices)}
    for t in o_tasks:
        j = int(t.name[-1])
        span = heads * spec.q_per_kv * spec.head_dim
        assert (t.params.k_lo, t.params.k_hi, t.params.split_k) == (j * span, (j + 1) * span, slices)
        o = t.inputs[1]
        assert o.off == j * heads * 3 * spec.q_per_kv * spec.head_dim and o.len == heads * 3 * spec.q_per_kv * spec.head_dim
        assert t.outputs[0].buf == scratch.id and t.outputs[0].off // spec.hidden_size == j
        waited = [by_counter[w.counter] for w in t.waits]
        assert waited == [f"layers.0.attn_partial.s{j}" if slices > 1 else "layers.0.attn_partial"]
    gate_up = [t for t in p.tasks if t.name.startswith("layers.0.gate_up")]
    down = [t for t in p.tasks if t.name.startswith("layers.0.down")]
    for t in gate_up:
        assert t.params.x_partials == slices and t.inputs[2].buf == scratch.id
        assert (t.inputs[2].len, t.inputs[2].count) == (spec.hidden_size, slices)
    for t in down:
        rp = t.inputs[-1]
        assert t.params.residual_partials == slices and rp.buf == scratch.id and rp.count == slices
        assert rp.off == t.outputs[0].off and rp.len == t.outputs[0].len
    res = validate(p)
    assert res.accepted, res.summary()


def test_o_proj_kv_slices_refusals():
    """Slices must be whole KV heads (and, quantized, whole groups); the option needs the fused
    norm and residual and no split-K."""
    spec = ZOO["gqa"]  # 2 KV heads
    with pytest.raises(ValueError, match="must divide the 2 KV heads"):
        lower(spec, cfg_of(o_proj_kv_slices=3), H100, kv_capacity=16)
    with pytest.raises(ValueError, match="o_proj_kv_slices needs"):
        cfg_of(o_proj_kv_slices=2, split_k=2)
    with pytest.raises(ValueError, match="o_proj_kv_slices needs"):
        cfg_of(o_proj_kv_slices=2, fuse_residual=False)


@pytest.mark.parametrize("shape,capacity,want", [("smollm2-135m", 1162, 16), ("llama-3.2-1b", 1162, 16),
                                                 ("llama-3.2-1b", 8330, 16), ("smollm2-135m", 300, 4)])
def test_auto_kv_splits(shape, capacity, want):
    """'auto' kv_splits: queues / KV heads, at most 16 (a combine output's split loads in one
    round trip) and one split per 64 KV positions (SmolLM2's 3 KV heads once got 44)."""
    spec = spec_from_hf_config(shape_config(shape), name=shape, dtype="bfloat16")
    p = lower(spec, ScheduleConfig(), H100, kv_capacity=capacity)  # all 132 queues
    part = next(t for t in p.tasks if t.params.op == Op.ATTN_PARTIAL)
    assert part.params.splits == want


def test_fuse_attn_combine_on_a_multi_xcd_target():
    """With whole KV heads per XCD the partials get a counter per XCD; a fused o-proj task
    waits for all heads, so they then keep one counter (8 XCDs would be 8 waits)."""
    spec = spec_from_hf_config(shape_config("llama-3.2-1b"), name="1b", dtype="bfloat16")
    p = lower(spec, ScheduleConfig(fuse_attn_combine=True), get_target("mi300x"), kv_capacity=256)
    assert [c.name for c in p.counters if c.name.startswith("layers.0.attn_partial")] == ["layers.0.attn_partial"]
    res = validate(p)
    assert res.accepted, res.summary()


def test_quant_asym_is_int8_with_whole_32_column_groups():
    """quant_asym: int8 only (int4 has its zero anyway), and groups of whole 32-column chunks
    (the device's zero term sums x by chunks): K = 40 gives group 8 and is refused."""
    with pytest.raises(ValueError, match="quant_asym is for int8"):
        cfg_of(quant="int4", quant_asym=True)
    spec = ZOO["odd"]
    assert lower(spec, cfg_of(quant="int8", quant_group=128, quant_asym=True), H100, kv_capacity=16)  # K=576: 64
    narrow = spec.model_copy(update={"hidden_size": 40, "num_heads": 5, "num_kv_heads": 5, "head_dim": 8})
    with pytest.raises(ValueError, match="whole 32-column chunks"):
        lower(narrow, cfg_of(quant="int8", quant_group=32, quant_asym=True), H100, kv_capacity=16)
