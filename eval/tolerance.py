"""The half-precision logits tolerance, tied to Hugging Face's own rounding error.

A bf16/fp16 variant (the megakernel or a baseline) cannot be judged against HF eager at
the same precision: two correct half-precision implementations that round at different
points, or accumulate a GEMV in a different order, flip last bits that later layers
amplify, so their distance says little about either. Instead every variant is compared
with an fp32 reference computed from the same (half-valued) weights, and passes when

    err(variant) <= bound = max(FACTOR * err(HF eager, same precision), FLOOR_REL)

where err = max |logits - ref32| / max |ref32| over the steps judged, and at every step
its argmax equals the reference's or is a near-tie: ref32[its argmax] >= max(ref32) -
bound * max|ref32|. FLOOR_REL (two bf16 ulps of the largest logit) keeps a bound from
collapsing where HF happens to land very close to the reference.
"""

from __future__ import annotations

from typing import Sequence

import torch

FACTOR = 2.0
FLOOR_REL = 2.0**-7


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (inf if got is not finite)."""
    g, r = got.detach().double().reshape(-1).cpu(), ref.detach().double().reshape(-1).cpu()
    if g.shape != r.shape or not bool(torch.isfinite(g).all()):
        return float("inf")
    scale = float(r.abs().max())
    diff = float((g - r).abs().max())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def half_bound(hf_errs: Sequence[float], factor: float = FACTOR, floor: float = FLOOR_REL) -> float:
    """The bound for every variant: factor x HF's worst error over the steps, at least floor."""
    return max(factor * max(hf_errs), floor)


def judge_steps(got: Sequence[torch.Tensor], ref32: Sequence[torch.Tensor], bound: float) -> dict:
    """One variant's logits at each step against the fp32 reference's, under `bound`."""
    errs, equal, near, finite = [], 0, 0, True
    for g, r in zip(got, ref32, strict=True):
        g, r = g.detach().double().reshape(-1).cpu(), r.detach().double().reshape(-1).cpu()
        errs.append(rel_err(g, r))
        ok = bool(torch.isfinite(g).all())
        finite = finite and ok
        ag, ar = (int(torch.argmax(g)) if ok else -1), int(torch.argmax(r))
        if ag == ar:
            equal += 1
        elif ok and float(r[ag]) >= float(r[ar]) - bound * float(r.abs().max()):
            near += 1
    n = len(errs)
    worst = max(errs) if errs else 0.0
    return {"passed": finite and worst <= bound and equal + near == n, "err_vs_fp32": worst,
            "err_vs_fp32_steps": errs, "bound": bound, "argmax_equal": equal, "near_ties": near, "steps": n,
            "finite": finite}


def half_gate(variants: dict[str, Sequence[torch.Tensor]], hf: Sequence[torch.Tensor],
              ref32: Sequence[torch.Tensor], *, factor: float = FACTOR, floor: float = FLOOR_REL) -> dict:
    """Every variant (name -> logits per step) judged under the bound HF's logits (`hf`,
    same steps) set; HF itself is recorded, and judged like the others."""
    hf_errs = [rel_err(h, r) for h, r in zip(hf, ref32, strict=True)]
    bound = half_bound(hf_errs, factor, floor)
    checks = {name: judge_steps(lg, ref32, bound) for name, lg in variants.items()}
    return {"rule": f"err vs fp32 <= max({factor:g} x err(hf), {floor:g}); argmax equal or a near-tie within it",
            "hf_err_vs_fp32": max(hf_errs), "hf_err_vs_fp32_steps": hf_errs, "bound": bound,
            "passed": all(c["passed"] for c in checks.values()), "checks": checks}
