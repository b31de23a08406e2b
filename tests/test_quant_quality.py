"""The quality table's near-tie diagnostic: margins per greedy step, and where each program
first leaves the fp32 run."""

import torch

from amk.eval.quant_quality import greedy_margins, markdown


def test_greedy_margins_are_top1_minus_top2_per_step():
    logits = torch.tensor([[3.0, 1.0, 2.5], [0.0, -1.0, 5.0], [2.0, 2.0, 0.0]])
    assert greedy_margins(logits) == [0.5, 5.0, 0.0]


def test_markdown_shows_the_margin_at_each_first_difference_and_the_nearest_ties():
    row = {"weight_bytes": 1e6, "greedy_prefix_vs_fp32": 2, "greedy_equal_positions_vs_fp32": 3, "ppl": 10.0,
           "ppl_rel_diff_vs_fp32": 0.01, "top1_agreement_vs_fp32": 0.9, "logits_max_abs_diff_vs_fp32": 0.5,
           "greedy_prefix_vs_hf": 2, "fp32_margin_at_first_difference": 0.044}
    same = dict(row, greedy_prefix_vs_fp32=4, fp32_margin_at_first_difference=None)
    doc = {"command": "x", "commit": "0" * 12, "machine": {"cpu": "cpu"}, "prompt": "p", "prompt_tokens": 1,
           "text_tokens": 8, "new_tokens": 4, "hf": {"ppl": 10.0}, "fp32_greedy_margins": [0.8, 1.3, 0.044, 2.5],
           "results": {"fp32": same, "int8 channel": row, "gguf native": dict(same, hf_tokens_identical=True)}}
    md = markdown(doc)
    assert "| int8 channel | 1.0 | 2 / 3 |" in md and md.count("| 0.044 |") == 1
    assert "steps 0 (0.800), 1 (1.300), 2 (0.044), 3 (2.500)" in md


def test_int8_asym_probe_formats():
    """The probe's asymmetric int8 reproduces a Q4_1-style block (16 levels from its minimum)
    up to rounding, where symmetric int8 cannot; both stay within half a step of any weight."""
    from amk.eval.int8_asym_probe import asym_int8, sym_int8

    g = torch.Generator().manual_seed(0)
    rows, k, group = 8, 128, 32
    d = torch.rand(rows, k // group, 1, generator=g) * 0.02 + 0.001  # Q4_1: w = min + d * q, q in 0..15
    lo = torch.randn(rows, k // group, 1, generator=g) * 0.1
    q = torch.randint(0, 16, (rows, k // group, group), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # every block spans its whole range, as Q4_1's do
    w = (lo + d * q).reshape(rows, k)
    assert (asym_int8(w, group, torch.float32) - w).abs().max() < 1e-6
    assert (sym_int8(w, group) - w).abs().max() > 1e-4
    x = torch.randn(rows, k, generator=g)
    step = (x.reshape(rows, -1, group).amax(-1) - x.reshape(rows, -1, group).amin(-1)) / 255
    err = (asym_int8(x, group, torch.float32) - x).abs().reshape(rows, -1, group).amax(-1)
    assert (err <= step / 2 + 1e-6).all()
    half_sym = x.reshape(rows, -1, group).abs().amax(-1) / 127 / 2
    assert ((sym_int8(x, group) - x).abs().reshape(rows, -1, group).amax(-1) <= half_sym + 1e-6).all()
