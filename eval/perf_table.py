"""Render paper_results/perf_h100.md from the rows `amk bench --out` merged into perf_h100.json.

    python -m amk.eval.perf_table paper_results/perf_h100.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def render(doc: dict) -> str:
    lines = ["# Decode latency on the H100 (batch 1, one decode step, median of interleaved rounds)", "",
             "Each row is one `amk bench` run, correctness-gated in the same run; its command and commit are below.", "",
             "| model | dtype | ctx | floor us | megakernel us (p10-p90) | % floor | cuda_graph us | torch_compile us | "
             "hf_eager us | vs faster baseline | device memory over weights + KV |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        t = r.get("variants", {})

        def med(name):
            v = t.get(name)
            return f"{v['median_us']:.1f}" if v else "-"

        v = t.get("megakernel", {})
        mk = {"median": v.get("median_us", float("nan")), "p10": v.get("p10_us", float("nan")), "p90": v.get("p90_us", float("nan"))}
        sp = r.get("speedup", {}).get(r.get("faster_baseline", ""), {})
        m = r.get("device_memory")
        mem = f"{m['overhead_pct']:.2f}% ({m['other'] / 1e6:.1f} MB)" if m else "not recorded"
        what = " (shape)" if r.get("shape_only") else " (checkpoint)" if r.get("weights") == "checkpoint" else ""
        if r.get("quant", "none") != "none":
            what += f" {r['quant']}"
        lines.append(f"| {r['model']}{what} | {r['dtype']} | {r['ctx']} | "
                     f"{r['floor_us']:.1f} | {mk.get('median', float('nan')):.1f} ({mk.get('p10', float('nan')):.0f}-"
                     f"{mk.get('p90', float('nan')):.0f}) | {r['megakernel_pct_of_floor']:.1f}% | {med('cuda_graph')} | "
                     f"{med('torch_compile')} | {med('hf_eager')} | {sp.get('median', float('nan')):.2f}x | {mem} |")
    lines += [""] + [f"- `{r['command']}` (commit {r['git_commit']}, {r['gpu']})" for r in doc["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    path = Path((argv or sys.argv[1:] or ["paper_results/perf_h100.json"])[0])
    from amk.commands.common import write_atomic

    write_atomic(path.with_suffix(".md"), render(json.loads(path.read_text())))
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
