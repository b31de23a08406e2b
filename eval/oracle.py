"""The correctness oracle: AMK's output against Hugging Face eager on the same weights.

Three measures, each against a transformers model built from exactly the weights the
program was bound to (`amk.schedule.importer.build_hf_model`):
  * logits max-abs error over a prompt (teacher-forced, every position);
  * greedy agreement with HF `generate` (no sampling, no early stop at EOS);
  * teacher-forced perplexity over a text, relative difference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

StepLogits = Callable[[Sequence[int]], torch.Tensor]  # ids -> [len, vocab] logits, teacher-forced
Greedy = Callable[[Sequence[int], int], list[int]]  # (prompt ids, n) -> n new ids


@dataclass
class OracleReport:
    logits_max_abs_err: float | None = None
    greedy_ours: list[int] | None = None
    greedy_hf: list[int] | None = None
    greedy_match: int | None = None  # tokens equal before the first difference
    ppl_ours: float | None = None
    ppl_hf: float | None = None
    ppl_rel_err: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def hf_logits(model, ids: Sequence[int]) -> torch.Tensor:
    out = model(torch.tensor([list(ids)], dtype=torch.long, device=model.device), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, running the full `max_new_tokens` (EOS does not stop it)."""
    model.generation_config.eos_token_id = None
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def perplexity(logits: torch.Tensor, ids: Sequence[int]) -> float:
    """exp(mean NLL of ids[1:] given the logits at positions 0..n-2), in float64."""
    target = torch.tensor(list(ids[1:]), dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), target, reduction="mean")
    return float(math.exp(nll.item()))


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(model, ours_logits: StepLogits, ours_greedy: Greedy, prompt: Sequence[int], *,
            max_new_tokens: int = 16, ppl_ids: Sequence[int] | None = None) -> OracleReport:
    """Run all three measures; `ours_*` are closures over the AMK program under test."""
    rep = OracleReport()
    ours = ours_logits(prompt).float()
    ref = hf_logits(model, prompt)
    rep.logits_max_abs_err = float((ours - ref).abs().max())
    if max_new_tokens:
        rep.greedy_hf = hf_greedy(model, prompt, max_new_tokens)
        rep.greedy_ours = list(ours_greedy(prompt, max_new_tokens))
        rep.greedy_match = matching_prefix(rep.greedy_ours, rep.greedy_hf)
    if ppl_ids is not None:
        rep.ppl_hf = perplexity(hf_logits(model, ppl_ids), ppl_ids)
        rep.ppl_ours = perplexity(ours_logits(ppl_ids).float(), ppl_ids)
        rep.ppl_rel_err = abs(rep.ppl_ours - rep.ppl_hf) / rep.ppl_hf
    return rep
