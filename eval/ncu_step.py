"""One decode step of a random-weight model between cudaProfilerStart/Stop, for Nsight Compute's
PC sampling (where the megakernel's warps stall, per SASS instruction and source line):

    AMK_NVRTC_LINEINFO=1 ncu --profile-from-start off --section WarpStateStats --section SourceCounters \\
        -o step python -m amk.eval.ncu_step --shape llama-3.2-1b --ctx 1024
    ncu --import step.ncu-rep --page source --csv --print-source cuda,sass > step_source.csv
    python -m amk.eval.ncu_step --summarize step_source.csv [--region attention.cuh:566-650 ...]

A diagnostic (no correctness gate, profiler overhead): see eval/PERF_NOTES.md.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def read_source_page(path: str) -> dict[tuple[str, int], dict[str, int]]:
    """Per source line (file name, line number): its warp-stall samples, 'samples' in all and
    one count per stall reason ('barrier', 'long_sb', 'no_inst', ...), from a source page
    exported with `--page source --csv --print-source cuda,sass` (sections of "File Path"
    rows, each followed by its source lines and their SASS rows)."""
    out: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    file, head = None, None
    for r in rows:
        if not r:
            continue
        if r[0] == "File Path":
            file = r[1].replace("\\", "/").split("/")[-1]
        elif r[0] == "Line No":
            head = r
        elif file and head and r[0].strip().isdigit():
            d = out[(file, int(r[0]))]
            for name, v in zip(head, r):
                if name == "Warp Stall Sampling (All Samples)" or (name.startswith("stall_") and "(" not in name):
                    try:
                        n = int(v.replace(",", "") or 0)
                    except ValueError:
                        continue
                    d["samples" if name.startswith("Warp") else name.removeprefix("stall_")] += n
    return out


def region_reasons(lines: dict, file: str, first: int, last: int) -> dict[str, float]:
    """The stall reasons of source lines first..last of `file`, as shares of their samples,
    with 'share': the region's share of all samples."""
    return stall_reasons(lines, lambda f, n: f == file and first <= n <= last)


def stall_reasons(lines: dict, keep=lambda f, n: True) -> dict[str, float]:
    """The stall reasons of the source lines `keep(file, line)` selects (all by default), as shares
    of their samples, with 'share': their share of all samples."""
    agg: dict[str, int] = defaultdict(int)
    for (f, n), d in lines.items():
        if keep(f, n):
            for k, v in d.items():
                agg[k] += v
    total = sum(d["samples"] for d in lines.values()) or 1
    own = agg.pop("samples", 0)
    out = {k: v / own for k, v in agg.items()} if own else {}
    out["share"] = own / total
    return out


def _mix(r: dict[str, float], leave_out: tuple[str, ...] = (), floor: float = 0.001) -> str:
    """A reason mix as text, largest first, down to `floor`; leave_out: reasons dropped, the rest
    rescaled to 100 % (a line's reasons sum to its samples, so without leave_out nothing moves)."""
    kept = {k: v for k, v in r.items() if k != "share" and k not in leave_out}
    scale = sum(kept.values()) or 1.0
    return ", ".join(f"{k} {v / scale * 100:.1f} %" for k, v in sorted(kept.items(), key=lambda kv: -kv[1])
                     if v / scale >= floor)


def summarize(path: str, top: int = 30, regions: tuple[str, ...] = ()) -> list[str]:
    """Lines of text: the share of stall samples per file, the stall reasons of each region
    ("file.cuh:FIRST-LAST"), the top source lines with their three largest stall reasons, and the
    reasons of all samples (and of those neither at a barrier nor asleep)."""
    lines = read_source_page(path)
    extra = []
    for reg in regions:
        file, _, span = reg.rpartition(":")
        first, _, last = span.partition("-")
        r = region_reasons(lines, file, int(first), int(last or first))
        extra.append(f"  {reg}: {r['share'] * 100:.1f} % of the samples; {_mix(r, floor=0.01)}")
    everything = stall_reasons(lines)
    total = sum(d["samples"] for d in lines.values()) or 1
    per_file: dict[str, int] = defaultdict(int)
    for (f, _), d in lines.items():
        per_file[f] += d["samples"]
    out = [f"{total} stall samples; per file: " + ", ".join(
        f"{f} {v / total * 100:.1f} %" for f, v in sorted(per_file.items(), key=lambda kv: -kv[1]))]
    out += extra
    for (f, n), d in sorted(lines.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        reasons = sorted(((k, v) for k, v in d.items() if k != "samples"), key=lambda kv: -kv[1])[:3]
        why = ", ".join(f"{k} {v / max(d['samples'], 1) * 100:.0f} %" for k, v in reasons if v)
        out.append(f"  {d['samples'] / total * 100:5.1f} %  {f}:{n}  ({why})")
    # (the warps parked at a barrier or asleep while one thread polls are most of a step's samples)
    out.append(f"  all samples by reason: {_mix(everything)}")
    out.append(f"  leaving out barrier and sleep: {_mix(everything, ('barrier', 'sleep'))}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--config", default=None, help="a ScheduleConfig JSON file")
    ap.add_argument("--summarize", default=None, metavar="CSV", help="summarize an exported source page and exit")
    ap.add_argument("--region", action="append", default=[], metavar="FILE:FIRST-LAST",
                    help="with --summarize: the stall reasons of these source lines (repeatable)")
    a = ap.parse_args()
    if a.summarize:
        print("\n".join(summarize(a.summarize, regions=tuple(a.region))))
        return
    import torch

    from amk.eval.trace_step import shape_vm

    _, vm = shape_vm(a.shape, a.ctx, a.config, 8)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    vm.run_step(7, a.ctx)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled one step at position", a.ctx)


if __name__ == "__main__":
    main()
