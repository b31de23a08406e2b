"""How fast does a library GEMV stream a weight matrix? The reference for the megakernel's rows.

The megakernel's traces (`python -m amk.eval.trace_step`) give each GEMV's rows phase; dividing
the matrix's bytes by it gives the bandwidth its loads reached. This times torch's bf16
matrix-vector product (cuBLAS) on the same shapes, out of the L2 (copies of the matrix are
rotated so that every call reads HBM), beside a plain device-to-device copy, so the
megakernel's figure can be read against what the same GPU streams in one kernel doing only that.

    python -m amk.eval.gemv_bandwidth [--shape 128256x2048 ...] [--iters 50] [--json]   # a CUDA GPU

Default shapes: the Llama-3.2-1B's LM head (128256 x 2048), fused gate/up (16384 x 2048),
down (2048 x 8192) and q/k/v (3072 x 2048). GB/s counts the weight bytes read (1e9 bytes/s).
"""

from __future__ import annotations

import argparse
import json

DEFAULT_SHAPES = ("128256x2048", "16384x2048", "2048x8192", "3072x2048")
L2_CLEAR_BYTES = 256 * 1024**2  # rotate copies until at least this much is cycled: several L2s


def parse_shape(text: str) -> tuple[int, int]:
    """"ROWSxCOLS" -> (rows, cols); ValueError names what is wrong."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape {text!r}: want ROWSxCOLS with positive integers, e.g. 128256x2048")
    return int(parts[0]), int(parts[1])


def copies_needed(matrix_bytes: int) -> int:
    """Rotated copies so that a call's matrix was last read L2_CLEAR_BYTES of traffic ago."""
    return max(1, -(-L2_CLEAR_BYTES // matrix_bytes))


def time_gemv(rows: int, cols: int, iters: int) -> dict:
    import torch

    from amk.eval.bench import summarize

    elt = 2  # bf16
    n = copies_needed(rows * cols * elt)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n)]
    x = torch.randn(cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = (ws[0].float() @ x.float())
    got = torch.mv(ws[0], x).float()
    ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))
    times = []
    for i in range(iters + 3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        w = ws[i % n]
        e0.record()
        torch.mv(w, x)
        e1.record()
        e1.synchronize()
        if i >= 3:
            times.append(e0.elapsed_time(e1) * 1e3)  # us
    s = summarize(times)
    gbytes = rows * cols * elt / 1e9
    return {"shape": f"{rows}x{cols}", "bytes": rows * cols * elt, "copies": n, "correct": ok,
            "median_us": s["median"], "p10_us": s["p10"], "p90_us": s["p90"],
            "gbps": gbytes / (s["median"] * 1e-6)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m amk.eval.gemv_bandwidth", description=(__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", default=[], help="ROWSxCOLS of a bf16 weight (repeatable)")
    ap.add_argument("--iters", type=int, default=50, help="timed calls a shape (after 3 warm-up ones)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in (a.shape or DEFAULT_SHAPES)]
    except ValueError as e:
        ap.error(str(e))
    if a.iters < 1:
        ap.error("--iters takes a positive integer")
    import torch

    if not torch.cuda.is_available():
        print("gemv_bandwidth needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    from amk.eval.peak_bandwidth import bandwidth_report

    copy = bandwidth_report()
    rows = [time_gemv(r, c, a.iters) for r, c in shapes]
    out = {"gpu": torch.cuda.get_device_name(), "copy_gbps": copy["gbps"], "gemv": rows}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['gpu']}: device-to-device copy {copy['gbps']:.0f} GB/s (read + written)")
        for r in rows:
            flag = "" if r["correct"] else "  WRONG (no time counts)"
            print(f"  torch.mv bf16 {r['shape']:>12s}: {r['median_us']:8.2f} us (p10 {r['p10_us']:.2f}, "
                  f"p90 {r['p90_us']:.2f}) = {r['gbps']:6.0f} GB/s of weights{flag}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
