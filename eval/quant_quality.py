"""Quality of weight-only quantization on SmolLM2-135M, on the CPU ReferenceVM.

The model is the embedded SmolLM2-135M-Instruct GGUF (Q4_1 linears, Q8_0 embedding).
The reference is the fp32 program over transformers' float32 dequantization of that file
(the only real checkpoint on the machine; note that it already lies on a Q4_1 grid, so
int4 group-32 round-to-nearest of it is nearly lossless). Against it:

  * int8 round-to-nearest, per channel and groups 32 / 64 / 128, symmetric, and asymmetric
    (`quant_asym`: codes spanning each group's [min, max], a scale and a zero) at groups 32 / 64;
    int4 round-to-nearest (scale + group minimum), groups 32 / 64 / 128; the LM head stays
    float (ScheduleConfig default);
  * the GGUF-native program (quant='gguf', quant_lm_head=True): the file's Q4_1 / Q8_0
    blocks run as they are. It must generate the same 64 tokens as transformers' model
    built from the same file (`build_hf_model` on the dequantized weights).

Each program: greedy agreement over 64 new tokens with the fp32 program (free-running,
first difference and count of equal positions), teacher-forced perplexity over a fixed
text and its relative difference, top-1 agreement and max-abs logit drift over that text.
Beside them, the fp32 program's top-2 logit margin at every step of its own greedy run, and
at each program's first difference: a near-tie there (a margin under the quantization's
logit error) flips whatever the quantizer does, and says why greedy agreement breaks.
Writes paper_results/quant_quality.json and .md.

    python -m amk.eval.quant_quality [--out paper_results] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from amk.eval.oracle import hf_greedy, hf_logits, matching_prefix, perplexity
from amk.eval.provenance import cpu_name as _cpu, git_commit as _git_commit

PROMPT = "The three primary colors are"
TEXT = ("The Moon is Earth's only natural satellite. It orbits at an average distance of about 384,400 km, "
        "roughly thirty times the diameter of Earth. Its gravitational influence produces the ocean tides and "
        "slightly lengthens the day. The Moon is in synchronous rotation with Earth, so the same side always "
        "faces us. Its surface is covered in dark volcanic plains, bright ancient highlands and impact craters.")

CONFIGS: dict[str, dict] = {
    "fp32": {},
    "int8 channel": dict(quant="int8", quant_group="channel"),
    "int8 g32": dict(quant="int8", quant_group=32),
    "int8 g64": dict(quant="int8", quant_group=64),
    "int8 g128": dict(quant="int8", quant_group=128),
    "int8 g32 asym": dict(quant="int8", quant_group=32, quant_asym=True),
    "int8 g64 asym": dict(quant="int8", quant_group=64, quant_asym=True),
    "int4 g32": dict(quant="int4", quant_group=32),
    "int4 g64": dict(quant="int4", quant_group=64),
    "int4 g128": dict(quant="int4", quant_group=128),
    "gguf native": dict(quant="gguf", quant_lm_head=True),
}


def _say(msg: str) -> None:
    print(f"[quant_quality] {msg}", file=sys.stderr, flush=True)


def measure(tokens: int = 64, max_queues: int = 16, kv_capacity: int = 256, text_tokens: int | None = None) -> dict:
    from amk.api import compile as amk_compile
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.importer import build_hf_model, load_model, load_tokenizer

    t0 = time.perf_counter()
    spec, weights, native = load_model(None, native_quant=True)
    tok = load_tokenizer(None)
    prompt = list(tok(PROMPT)["input_ids"])
    text = list(tok(TEXT)["input_ids"])[:text_tokens]
    _say(f"loaded {spec.name} in {time.perf_counter() - t0:.0f} s; prompt {len(prompt)} tokens, text {len(text)}")

    hf = build_hf_model(spec, weights)
    hf_tokens = hf_greedy(hf, prompt, tokens)
    hf_ppl = perplexity(hf_logits(hf, text), text)

    rows: dict[str, dict] = {}
    ref_tokens = ref_logits = None
    for name, kw in CONFIGS.items():
        t = time.perf_counter()
        cfg = ScheduleConfig(max_queues=max_queues, **kw)
        mk = amk_compile(None, cfg, loaded=(spec, weights, native), kv_capacity=kv_capacity)
        vm = mk.vm("cpu")
        greedy = vm.generate(prompt, tokens)
        logits = vm.logits_for(text)
        stats = mk.program.meta["stats"]
        row = {"config": cfg.model_dump(mode="json", include={"quant", "quant_group", "quant_asym", "quant_lm_head"}),
               "weight_bytes": stats["weight_bytes"], "tokens": greedy, "text": mk.decode(greedy),
               "ppl": perplexity(logits, text)}
        if ref_tokens is None:
            ref_tokens, ref_logits, ref_ppl = greedy, logits, row["ppl"]
            margins = greedy_margins(vm.logits_for(prompt + greedy[:-1])[len(prompt) - 1:])
        row["greedy_prefix_vs_fp32"] = matching_prefix(greedy, ref_tokens)
        first = row["greedy_prefix_vs_fp32"]
        row["fp32_margin_at_first_difference"] = margins[first] if first < len(margins) else None
        row["greedy_equal_positions_vs_fp32"] = sum(a == b for a, b in zip(greedy, ref_tokens))
        row["ppl_rel_diff_vs_fp32"] = (row["ppl"] - ref_ppl) / ref_ppl
        row["top1_agreement_vs_fp32"] = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        row["logits_max_abs_diff_vs_fp32"] = float((logits - ref_logits).abs().max())
        row["greedy_prefix_vs_hf"] = matching_prefix(greedy, hf_tokens)
        if kw.get("quant") == "gguf":
            row["native"] = dict(mk.native.summary(), buffers=len(mk.program.meta["gguf_native"]))
            row["hf_tokens_identical"] = greedy == hf_tokens
        row["seconds"] = time.perf_counter() - t
        rows[name] = row
        _say(f"{name}: {row['greedy_prefix_vs_fp32']}/{tokens} tokens as fp32, ppl {row['ppl']:.4f} "
             f"({row['ppl_rel_diff_vs_fp32']:+.3%}), {row['seconds']:.0f} s")
        del mk, vm
    return {"model": spec.name, "prompt": PROMPT, "prompt_tokens": len(prompt), "text_tokens": len(text),
            "new_tokens": tokens, "max_queues": max_queues, "hf": {"tokens": hf_tokens, "ppl": hf_ppl},
            "fp32_greedy_margins": margins, "results": rows}


def greedy_margins(step_logits: torch.Tensor) -> list[float]:
    """Per greedy step (rows: the logits that chose each new token), the top-1 minus top-2
    logit: how far that step is from a tie."""
    top2 = torch.topk(step_logits.double(), 2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def markdown(doc: dict) -> str:
    r, n = doc["results"], doc["new_tokens"]
    g = r["gguf native"]
    lines = [
        "# Weight-only quantization quality (SmolLM2-135M-Instruct, ReferenceVM)", "",
        f"Command: `{doc['command']}` (commit {doc['commit'][:12]}, {doc['machine']['cpu']})", "",
        f"Reference: the fp32 program over transformers' float32 dequantization of the embedded GGUF "
        f"(Q4_1 linears, Q8_0 embedding), so int4 g32 of it is close to lossless. Greedy: {n} new tokens after "
        f"\"{doc['prompt']}\" ({doc['prompt_tokens']} tokens); perplexity: teacher-forced over a fixed "
        f"{doc['text_tokens']}-token text. RTN configs keep the LM head float; 'asym' is int8 with a "
        "zero a group (`quant_asym`: codes spanning the group's [min, max]), which lands on the Q4_1 grid "
        "(16 levels from each 32-block's minimum: codes 17 apart) where symmetric int8 cannot.", "",
        f"| program | weight MB | greedy = fp32 (prefix / positions of {n}) | ppl | ppl vs fp32 | top-1 vs fp32 | "
        "max-abs logit diff | fp32 top-2 margin at the first difference |", "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in r.items():
        m = row.get("fp32_margin_at_first_difference")
        lines.append(f"| {name} | {row['weight_bytes'] / 1e6:.1f} | {row['greedy_prefix_vs_fp32']} / "
                     f"{row['greedy_equal_positions_vs_fp32']} | {row['ppl']:.4f} | {row['ppl_rel_diff_vs_fp32']:+.3%} | "
                     f"{row['top1_agreement_vs_fp32']:.3f} | {row['logits_max_abs_diff_vs_fp32']:.3g} | "
                     f"{'-' if m is None else f'{m:.3f}'} |")
    margins = doc.get("fp32_greedy_margins")
    if margins:
        close = sorted(range(len(margins)), key=margins.__getitem__)[:4]
        lines += ["", f"The fp32 program's own greedy run is nearest a tie at steps "
                  + ", ".join(f"{i} ({margins[i]:.3f})" for i in sorted(close))
                  + " (top-1 minus top-2 logit; steps from 0). A program whose logits move by more than that there "
                  "picks the other token, whatever its perplexity."]
    nat = g.get("native", {})
    lines += ["", "## GGUF-native program vs transformers on the same file", "",
              f"- {nat.get('buffers')} matrices run in the file's own blocks ({nat.get('types')}; "
              f"dequantized fallbacks: {nat.get('dequantized') or 'none'}); the tied LM head reads the Q8_0 "
              "embedding blocks.",
              f"- greedy tokens identical to HF's model built from the file: **{g['greedy_prefix_vs_hf']}/{n}** "
              f"({'identical' if g['hf_tokens_identical'] else 'DIFFERENT'}); HF perplexity {doc['hf']['ppl']:.4f}, "
              f"ours {g['ppl']:.4f}.",
              f"- fp32 program vs HF: {r['fp32']['greedy_prefix_vs_hf']}/{n} tokens identical.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("paper_results"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-queues", type=int, default=16)
    ap.add_argument("--text-tokens", type=int, default=None, help="cut the perplexity text (smoke runs)")
    args = ap.parse_args(argv)
    rows = measure(args.tokens, args.max_queues, text_tokens=args.text_tokens)
    doc = {"command": "python -m amk.eval.quant_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": _git_commit(), "machine": {"cpu": _cpu(), "cores_allowed": len(os.sched_getaffinity(0)),
                                                "python": platform.python_version(), "torch": torch.__version__},
           **rows}
    from amk.commands.common import write_atomic

    write_atomic(args.out / "quant_quality.json", json.dumps(doc, indent=2) + "\n")
    md = markdown(doc)
    write_atomic(args.out / "quant_quality.md", md)
    print(md)
    return 0 if doc["results"]["gguf native"]["hf_tokens_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
