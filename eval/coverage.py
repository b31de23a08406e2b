"""The coverage zoo on the CPU: every supported architecture variant, compiled, validated,
run on the ReferenceVM and compared with Hugging Face eager on the same weights.

    python -m amk.eval.coverage [--out paper_results] [--only NAME ...] [--queues 16]

Rows: the real SmolLM2-135M (64 greedy tokens vs HF generate, teacher-forced perplexity,
fp32 logits) and every random-init zoo config (16 greedy tokens, logits). The CPU runs use
`--queues` per-SM queues (default 16) so a step has hundreds rather than ~19,000 tasks; the
tiling changes which task computes what, not the arithmetic each output row sees.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from amk.api import compile as amk_compile
from amk.eval.oracle import compare
from amk.schedule.config import ScheduleConfig
from amk.schedule.importer import build_hf_model, load_model, zoo_configs

LOGIT_TOL = 1e-4
PPL_REL_TOL = 1e-5
SMOL_TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital "
             "of Germany. Water boils at one hundred degrees Celsius at sea level.")


def _row(name: str, spec, weights, mk, prompt: list[int], new_tokens: int, ppl_ids=None) -> dict:
    model = build_hf_model(spec, weights)
    t = time.perf_counter()
    rep = compare(model, mk.logits_for, lambda p, n: mk.generate(p, n), prompt, max_new_tokens=new_tokens, ppl_ids=ppl_ids)
    row = {"model": name, "family": spec.family, "layers": spec.num_layers, "hidden": spec.hidden_size,
           "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
           "tied": spec.tie_word_embeddings, "tasks": len(mk.program.tasks), "queues": len(mk.program.queues),
           "validated": mk.validation.accepted, "logits_max_abs_err": rep.logits_max_abs_err,
           "greedy_tokens": new_tokens, "greedy_identical": rep.greedy_match, "seconds": None}
    ok = rep.logits_max_abs_err <= LOGIT_TOL and rep.greedy_match == new_tokens and mk.validation.accepted
    if ppl_ids is not None:
        row.update(ppl_amk=rep.ppl_ours, ppl_hf=rep.ppl_hf, ppl_rel_err=rep.ppl_rel_err)
        ok = ok and rep.ppl_rel_err <= PPL_REL_TOL
    row["seconds"] = round(time.perf_counter() - t, 1)
    row["pass"] = bool(ok)
    return row


def zoo_row(name: str, cfg: dict, queues: int, seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(cfg))
        spec, weights = load_model(str(path), random_init=True, seed=seed)
    mk = amk_compile(loaded=(spec, weights), config=ScheduleConfig(max_queues=queues), kv_capacity=64)
    rng = random.Random(seed)
    prompt = [rng.randrange(spec.vocab_size) for _ in range(8)]
    return _row(name, spec, weights, mk, prompt, 16)


def smollm2_row(queues: int) -> dict:
    from amk.schedule.importer import load_tokenizer

    spec, weights = load_model(None)
    tok = load_tokenizer(None)
    mk = amk_compile(loaded=(spec, weights), config=ScheduleConfig(max_queues=queues), kv_capacity=256)
    prompt = tok("The capital of France is")["input_ids"]
    ppl_ids = tok(SMOL_TEXT)["input_ids"][:48]
    return _row("smollm2-135m (real, Q4_1 GGUF)", spec, weights, mk, prompt, 64, ppl_ids=ppl_ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run the coverage zoo on the CPU against HF eager.")
    ap.add_argument("--out", type=Path, default=Path("paper_results"))
    ap.add_argument("--only", nargs="*", help="zoo names to run (default: all, plus smollm2)")
    ap.add_argument("--queues", type=int, default=16)
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    zoo = zoo_configs()
    names = args.only or list(zoo)
    rows = []
    from rich.progress import track

    if not args.skip_smollm2 and (not args.only or "smollm2" in args.only):
        rows.append(smollm2_row(args.queues))
        print(json.dumps(rows[-1]), flush=True)
    for name in track([n for n in names if n in zoo], description="coverage zoo"):
        rows.append(zoo_row(name, zoo[name], args.queues))
        print(json.dumps(rows[-1]), flush=True)
    from amk.commands.common import write_atomic
    from amk.eval.provenance import cpu_name, git_commit

    doc = {"command": "python -m amk.eval.coverage " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": git_commit(), "machine": cpu_name(), "logit_tol": LOGIT_TOL, "ppl_rel_tol": PPL_REL_TOL, "rows": rows,
           "all_pass": all(r["pass"] for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "coverage.json", json.dumps(doc, indent=2) + "\n")
    lines = ["# Coverage zoo (CPU ReferenceVM vs HF eager, fp32)", "",
             f"Command: `{doc['command']}` (commit {doc['commit'][:12]}, {doc['machine']})", "",
             "| model | family | L | hidden | heads/kv | hd | tied | tasks | logits max-abs | greedy | ppl rel err | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ppl = f"{r['ppl_rel_err']:.1e}" if "ppl_rel_err" in r else "-"
        lines.append(f"| {r['model']} | {r['family']} | {r['layers']} | {r['hidden']} | {r['heads']}/{r['kv_heads']} | "
                     f"{r['head_dim']} | {r['tied']} | {r['tasks']} | {r['logits_max_abs_err']:.2e} | "
                     f"{r['greedy_identical']}/{r['greedy_tokens']} | {ppl} | {'PASS' if r['pass'] else 'FAIL'} |")
    write_atomic(args.out / "coverage.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if doc["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
