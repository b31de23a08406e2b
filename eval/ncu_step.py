"""One decode step of a random-weight model between cudaProfilerStart/Stop, for Nsight Compute's
PC sampling (where the megakernel's warps stall, per SASS instruction and source line):

    AMK_NVRTC_LINEINFO=1 ncu --profile-from-start off --section WarpStateStats --section SourceCounters \\
        -o step python -m amk.eval.ncu_step --shape llama-3.2-1b --ctx 1024
    ncu --import step.ncu-rep --page source --csv --print-source cuda,sass > step_source.csv
    python -m amk.eval.ncu_step --summarize step_source.csv

A diagnostic (no correctness gate, profiler overhead): see eval/PERF_NOTES.md.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict


def summarize(path: str, top: int = 40) -> None:
    """Stall samples per source line (file:line) from `--page source --csv --print-source cuda,sass`."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head_i = next(i for i, r in enumerate(rows) if any("Sampling" in c for c in r))
    head = rows[head_i]
    col = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
    src = next((i for i, c in enumerate(head) if c in ("Source", "# Address", "Address")), 0)
    per = defaultdict(float)
    total = 0.0
    where = "?"
    for r in rows[head_i + 1:]:
        if len(r) <= col:
            continue
        m = re.search(r"([\w./-]+\.(?:cuh|cu|h)):(\d+)", " ".join(r[:src + 2]))
        if m:
            where = f"{m.group(1).split('/')[-1]}:{m.group(2)}"
        try:
            v = float(r[col].replace(",", "") or 0)
        except ValueError:
            continue
        per[where] += v
        total += v
    print(f"{total:.0f} stall samples; top {top} source lines:")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {v / max(total, 1) * 100:5.1f} %  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--config", default=None, help="a ScheduleConfig JSON file")
    ap.add_argument("--summarize", default=None, metavar="CSV", help="summarize an exported source page and exit")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return
    import torch

    import amk.api
    from amk.eval.shapes import random_weights_like, shape_config
    from amk.schedule.importer import spec_from_hf_config
    from amk.vm.loader import CudaVM

    spec = spec_from_hf_config(shape_config(a.shape), name=a.shape, dtype="bfloat16")
    weights = random_weights_like(spec, "cuda", "bfloat16", 0)
    config = None
    if a.config:
        from amk.schedule.config import ScheduleConfig

        config = ScheduleConfig.model_validate_json(open(a.config).read())
    mk = amk.api.compile(loaded=(spec, weights), config=config, dtype="bfloat16", kv_capacity=a.ctx + 8)
    vm = CudaVM(mk.program, mk.tensors, device="cuda", validation=mk.validation)
    for pos in range(a.ctx):
        evs = vm._launch(pos % 1000 + 1, pos)
        if pos % 64 == 63:
            vm._finish([evs])
    vm._finish([evs])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    vm.run_step(7, a.ctx)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled one step at position", a.ctx)


if __name__ == "__main__":
    main()
