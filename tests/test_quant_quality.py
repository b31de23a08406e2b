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
