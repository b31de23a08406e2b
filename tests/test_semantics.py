"""Each op's reference semantics vs an independent torch formulation, on fresh random
inputs (the functions are called directly, no VM)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from amk.instructions import semantics as S
from amk.schedule.ir import (
    ArgmaxMode,
    ArgmaxParams,
    AttnCombineParams,
    AttnPartialParams,
    EmbedParams,
    Epilogue,
    GemvParams,
    HeadNormParams,
    Op,
    ReduceParams,
    RmsNormParams,
    RopeParams,
    SiluMulParams,
)
from refs import attention, dequant, hf_rmsnorm, hf_rope, inv_freq, unpack_u4_slow

close = torch.testing.assert_close


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def test_registry_covers_every_op():
    assert set(S.SEMANTICS) == set(Op)


def test_embed_picks_row_tile(gen):
    table = torch.randn(10, 12, generator=gen)
    tile = table[:, 4:9]  # what the operand (off=4, len=5, count=10, stride=12) reads
    out = S.embed(EmbedParams(vocab=10, hidden=12), torch.tensor([7], dtype=torch.int32), tile)
    assert torch.equal(out, table[7, 4:9])
    with pytest.raises(ValueError):
        S.embed(EmbedParams(vocab=10, hidden=12), torch.tensor([10]), tile)


@pytest.mark.parametrize("col,n", [(0, 32), (8, 16)])
def test_rmsnorm_matches_hf(gen, col, n):
    x, gamma = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    out = S.rmsnorm(RmsNormParams(hidden=32, col=col, eps=1e-5), x, gamma[col : col + n])
    close(out, hf_rmsnorm(x, gamma, 1e-5)[col : col + n])


def test_head_norm_matches_hf_per_head(gen):
    x, gamma = torch.randn(4 * 16, generator=gen), torch.randn(16, generator=gen)
    out = S.head_norm(HeadNormParams(head_dim=16, heads=4, eps=1e-6), x, gamma)
    close(out, hf_rmsnorm(x.reshape(4, 16), gamma, 1e-6).reshape(-1))


@pytest.mark.parametrize("pos", [0, 1, 17, 1000])
def test_rope_matches_hf(gen, pos):
    x = torch.randn(3 * 16, generator=gen)
    out = S.rope(RopeParams(head_dim=16, heads=3), x, inv_freq(16), torch.tensor([pos], dtype=torch.int32))
    close(out, hf_rope(x, pos, 16), rtol=0, atol=1e-6)


def test_u4_packing_layout(gen):
    assert S.pack_u4(torch.tensor([1, 2, 15])).tolist() == [0x21, 0x0F]  # low nibble first
    codes = torch.randint(0, 16, (37,), generator=gen, dtype=torch.uint8)
    packed = S.pack_u4(codes)
    assert torch.equal(S.unpack_u4(packed, 37), codes)
    assert torch.equal(unpack_u4_slow(packed, 37), codes)


@pytest.mark.parametrize("kind", ["i8", "u4"])
def test_dequantize_tile_matches_whole_matrix(gen, kind):
    rows, k, group = 6, 32, 8
    codes = (torch.randint(-127, 128, (rows, k), generator=gen).to(torch.int8) if kind == "i8"
             else torch.randint(0, 16, (rows, k), generator=gen).to(torch.uint8))
    scale = torch.rand(rows, k // group, generator=gen)
    zero = -torch.rand(rows, k // group, generator=gen) if kind == "u4" else None
    whole = dequant(codes, scale, zero, group)
    # a tile starting mid-group: columns [12, 29) use groups 1..3, the tile's first column is group 1
    lo, hi = 12, 29
    tile = S.dequantize(codes[:, lo:hi], scale[:, 1:4], None if zero is None else zero[:, 1:4], group=group, k_lo=lo)
    assert torch.equal(tile, whole[:, lo:hi])


def _gemv(rows, k, **kw):
    return GemvParams(rows=rows, k=k, k_hi=kw.pop("k_hi", k), **kw)


def test_gemv_split_k_plus_reduce_equals_matmul(gen):
    rows, k, split_k = 10, 48, 3
    w, x = torch.randn(rows, k, generator=gen), torch.randn(k, generator=gen)
    partials = [S.gemv(_gemv(rows, k, k_lo=lo, k_hi=lo + 16, split_k=split_k), w[:, lo : lo + 16], x[lo : lo + 16])
                for lo in (0, 16, 32)]
    out = S.reduce(ReduceParams(rows=rows, split_k=split_k), torch.stack(partials))
    close(out, x @ w.T)


@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("half", [torch.bfloat16, None])
def test_partials_read_with_x_are_the_reduce_they_replace(gen, slices, half):
    """GemvParams x_partials / residual_partials: x (and down's residual) read with the o-proj's
    slice partials equals what a split-K REDUCE with the ADD epilogue would have stored into x,
    bit for bit (same order of the sums, same rounding points), in a half-precision program too."""
    rows, k, hid = 8, 32, 16
    rnd = S.rounder(half)
    x, parts = rnd(torch.randn(hid, generator=gen)), torch.randn(slices, hid, generator=gen)
    gamma, w_up, w_down = torch.randn(hid, generator=gen), torch.randn(rows, hid, generator=gen), torch.randn(hid, k, generator=gen)
    stored = rnd(S.reduce(ReduceParams(rows=hid, split_k=slices, epilogue=Epilogue.ADD), parts, residual=x, rnd=rnd))
    up = _gemv(rows, hid, norm_eps=1e-5)
    want = S.gemv(up, w_up, stored, gamma, x_rnd=rnd, rnd=rnd)
    got = S.gemv(up.model_copy(update={"x_partials": slices}), w_up, x, gamma, x_part=parts, x_rnd=rnd, rnd=rnd)
    assert torch.equal(got, want)
    h = torch.randn(k, generator=gen)
    down = _gemv(hid, k, epilogue=Epilogue.ADD)
    want = S.gemv(down, w_down, h, residual=stored, rnd=rnd)
    got = S.gemv(down.model_copy(update={"residual_partials": slices}), w_down, h, residual=x, res_part=parts, rnd=rnd,
                 res_rnd=rnd)
    assert torch.equal(got, want)


def test_gemv_norm_prologue_bias_and_add(gen):
    rows, k = 8, 32
    w, x, gamma = (torch.randn(rows, k, generator=gen), torch.randn(k, generator=gen), torch.randn(k, generator=gen))
    bias, residual = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    p = _gemv(rows, k, norm_eps=1e-5, has_bias=True, epilogue=Epilogue.ADD)
    out = S.gemv(p, w, x, gamma, bias=bias, residual=residual)
    close(out, residual + (hf_rmsnorm(x, gamma, 1e-5) @ w.T + bias))


@pytest.mark.parametrize("kind", ["i8", "u4"])
def test_quantized_gemv_equals_dequantize_then_matmul(gen, kind):
    rows, k, group = 8, 64, 16
    codes = (torch.randint(-127, 128, (rows, k), generator=gen).to(torch.int8) if kind == "i8"
             else torch.randint(0, 16, (rows, k), generator=gen).to(torch.uint8))
    scale = torch.rand(rows, k // group, generator=gen) / 64
    zero = -torch.rand(rows, k // group, generator=gen) / 8 if kind == "u4" else None
    x = torch.randn(k, generator=gen)
    # K slice [16, 48): groups 1..2
    p = _gemv(rows, k, k_lo=16, k_hi=48)
    out = S.gemv(p, codes[:, 16:48], x[16:48], w_scale=scale[:, 1:3], w_zero=None if zero is None else zero[:, 1:3],
                 group=group)
    close(out, dequant(codes, scale, zero, group)[:, 16:48] @ x[16:48])


def test_silu_mul_epilogue_and_op(gen):
    rows, k = 12, 20
    wg, wu, x = torch.randn(rows, k, generator=gen), torch.randn(rows, k, generator=gen), torch.randn(k, generator=gen)
    want = (wg @ x) * torch.sigmoid(wg @ x) * (wu @ x)
    close(S.gemv(_gemv(rows, k, epilogue=Epilogue.SILU_MUL), wg, x, w2=wu), want)
    g, u = wg @ x, wu @ x
    close(S.silu_mul(SiluMulParams(n=rows), g, u), g * torch.sigmoid(g) * u)
    # split-K partials interleave (gate, up) per row; REDUCE finishes the epilogue
    p = _gemv(rows, k, k_lo=0, k_hi=10, split_k=2, epilogue=Epilogue.SILU_MUL)
    part0 = S.gemv(p, wg[:, :10], x[:10], w2=wu[:, :10])
    close(part0.reshape(rows, 2), torch.stack([wg[:, :10] @ x[:10], wu[:, :10] @ x[:10]], dim=-1))
    p1 = _gemv(rows, k, k_lo=10, k_hi=20, split_k=2, epilogue=Epilogue.SILU_MUL)
    part1 = S.gemv(p1, wg[:, 10:], x[10:], w2=wu[:, 10:])
    close(S.reduce(ReduceParams(rows=rows, split_k=2, epilogue=Epilogue.SILU_MUL), torch.stack([part0, part1])), want)


@pytest.mark.parametrize("head_norm", [False, True])
def test_rope_epilogue_with_head_norm(gen, head_norm):
    d, heads, k, pos = 16, 2, 24, 9
    w, x, hg = torch.randn(heads * d, k, generator=gen), torch.randn(k, generator=gen), torch.randn(d, generator=gen)
    p = _gemv(heads * d, k, epilogue=Epilogue.ROPE, head_dim=d, head_norm_eps=1e-6 if head_norm else None)
    out = S.gemv(p, w, x, head_gamma=hg if head_norm else None, inv_freq=inv_freq(d).repeat(heads),
                 pos=torch.tensor([pos]))
    a = w @ x
    if head_norm:  # Qwen3: q_norm over each head, before RoPE
        a = hf_rmsnorm(a.reshape(heads, d), hg, 1e-6).reshape(-1)
    close(out, hf_rope(a, pos, d), rtol=1e-5, atol=1e-5)


def test_rope_epilogue_takes_each_heads_own_frequencies(gen):
    # head h at frequencies (h + 1) * f turns as the HF RoPE at position (h + 1) * pos (the
    # scaling by a small integer is exact in fp32), so a head read at another's slice fails
    d, heads, k, pos = 16, 3, 24, 5
    w, x = torch.randn(heads * d, k, generator=gen), torch.randn(k, generator=gen)
    p = _gemv(heads * d, k, epilogue=Epilogue.ROPE, head_dim=d)
    out = S.gemv(p, w, x, inv_freq=torch.cat([inv_freq(d) * (h + 1) for h in range(heads)]), pos=torch.tensor([pos]))
    a = (w @ x).reshape(heads, d)
    want = torch.cat([hf_rope(a[h], (h + 1) * pos, d) for h in range(heads)])
    close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="inv_freq len"):
        S.gemv(p, w, x, inv_freq=inv_freq(d), pos=torch.tensor([pos]))


def test_head_norm_only_with_rope_epilogues(gen):
    p = _gemv(4, 4, epilogue=Epilogue.STORE, head_dim=4, head_norm_eps=1e-6)
    with pytest.raises(ValueError, match="head_norm"):
        S.gemv(p, torch.randn(4, 4), torch.randn(4), head_gamma=torch.ones(4))


def _attend(q, k, v, pos, *, q_heads, splits, block, d):
    """Partials of every split of one KV head, then the combine (as the VM chains them)."""
    outs = [S.attn_partial(AttnPartialParams(head_dim=d, q_heads=q_heads, splits=splits, split=s, block=block,
                                             scale=d ** -0.5), q, k, v, torch.tensor([pos])) for s in range(splits)]
    o = torch.stack([o for o, _ in outs])
    ml = torch.stack([m for _, m in outs])
    return S.attn_combine(AttnCombineParams(head_dim=d, q_heads=q_heads, splits=splits), o, ml), ml.reshape(splits, q_heads, 2)


@pytest.mark.parametrize("pos,splits,block", [(0, 1, 1), (0, 4, 2), (6, 3, 2), (20, 4, 4), (33, 5, 8)])
def test_attention_partials_and_combine_match_softmax(gen, pos, splits, block):
    heads, kv_heads, d = 4, 2, 8
    qh = heads // kv_heads
    q = torch.randn(heads * d, generator=gen)
    k, v = torch.randn(pos + 1, kv_heads * d, generator=gen), torch.randn(pos + 1, kv_heads * d, generator=gen)
    got = torch.cat([_attend(q[g * qh * d : (g + 1) * qh * d], k[:, g * d : (g + 1) * d], v[:, g * d : (g + 1) * d],
                             pos, q_heads=qh, splits=splits, block=block, d=d)[0] for g in range(kv_heads)])
    close(got, attention(q, k, v, heads, kv_heads))


def test_attention_empty_splits(gen):
    # pos 2 (3 positions), 4 splits of block 1: chunk 1, so splits 0..2 hold one position, split 3 none;
    # with block 4 the chunk is 4 and splits 1..3 are all empty
    d, qh = 8, 2
    q, k, v = torch.randn(qh * d, generator=gen), torch.randn(3, d, generator=gen), torch.randn(3, d, generator=gen)
    for block, empty in ((1, [3]), (4, [1, 2, 3])):
        p = lambda s: AttnPartialParams(head_dim=d, q_heads=qh, splits=4, split=s, block=block, scale=d ** -0.5)
        for s in empty:
            o, ml = S.attn_partial(p(s), q, k, v, torch.tensor([2]))
            assert torch.equal(o, torch.zeros(qh * d))
            assert ml.reshape(qh, 2)[:, 0].eq(-math.inf).all() and ml.reshape(qh, 2)[:, 1].eq(0).all()
        out, _ = _attend(q, k, v, 2, q_heads=qh, splits=4, block=block, d=d)
        close(out, attention(q, k, v, qh, 1))


def test_attention_chunk_formula():
    p = AttnPartialParams(head_dim=8, q_heads=1, splits=3, split=0, block=4, scale=1.0)
    # pos 9 -> 10 positions -> ceil(10/3) = 4 -> 4 (a block multiple); pos 12 -> ceil(13/3) = 5 -> 8
    assert S.attn_chunk(p, 9) == 4 and S.attn_chunk(p, 12) == 8


def test_argmax_first_index_of_max():
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0])
    assert S.argmax(ArgmaxParams(n=5), logits).tolist() == [1]
    assert S.argmax(ArgmaxParams(n=2), torch.tensor([-math.inf, -math.inf])).tolist() == [0]


def test_apply_reads_fp32_and_keeps_integers(gen):
    x = torch.randn(8, generator=gen).to(torch.bfloat16)
    (out,) = S.apply(RopeParams(head_dim=8, heads=1), {"x": x, "inv_freq": inv_freq(8), "pos": torch.tensor([3], dtype=torch.int32)})
    assert out.dtype == torch.float32
    close(out, hf_rope(x.float(), 3, 8), rtol=0, atol=1e-6)
    o, ml = S.apply(AttnPartialParams(head_dim=4, q_heads=1, splits=1, split=0, block=1, scale=0.5),
                    {"q": torch.randn(4), "k": torch.randn(1, 4), "v": torch.randn(1, 4), "pos": torch.tensor([0])})
    assert o.shape == (4,) and ml.shape == (2,)


def test_argmax_partial_and_merge():
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0, 7.0, 7.0])
    p = ArgmaxParams(n=3, mode=ArgmaxMode.PARTIAL, base=2)
    assert S.argmax(p, logits[2:5]).tolist() == [3.0, 3.0]  # (max, base + first index)
    pairs = torch.tensor([7.0, 9.0, 3.0, 1.0, 7.0, 5.0])  # ties to the smallest index, whatever the order
    assert S.argmax(ArgmaxParams(n=3, mode=ArgmaxMode.MERGE), pairs).tolist() == [5]
    nan_pairs = torch.tensor([math.nan, 8.0, 7.0, 1.0, math.nan, 4.0])
    assert S.argmax(ArgmaxParams(n=3, mode=ArgmaxMode.MERGE), nan_pairs).tolist() == [4]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([-math.inf, -1.0, 0.0, 2.5, 2.5, 3.0, math.nan]), min_size=1, max_size=40),
       st.integers(1, 8), st.randoms(use_true_random=False))
def test_argmax_merge_of_partials_is_the_whole_argmax(values, slices, rnd):
    """PARTIALs over any cut into slices, merged in any order, give WHOLE's token (ties and NaNs
    included)."""
    x = torch.tensor(values)
    cuts = sorted({0, len(values), *(rnd.randrange(len(values) + 1) for _ in range(slices - 1))})
    pairs = [S.argmax(ArgmaxParams(n=b - a, mode=ArgmaxMode.PARTIAL, base=a), x[a:b]) for a, b in zip(cuts, cuts[1:])]
    rnd.shuffle(pairs)
    merged = S.argmax(ArgmaxParams(n=len(pairs), mode=ArgmaxMode.MERGE), torch.cat(pairs))
    assert merged.tolist() == S.argmax(ArgmaxParams(n=len(values)), x).tolist()
