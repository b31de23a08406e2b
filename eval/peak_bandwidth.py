"""Measured HBM bandwidth: a large device-to-device copy, timed with CUDA events.

    gbps = measure_bandwidth()          # median over `iters` copies of a 2 GiB buffer
    python -m amk.eval.peak_bandwidth   # prints it (and --json)

Bytes counted per copy: read + written (2 x the buffer), so the figure is what a kernel
that streams every byte once through HBM can hope for. The buffer is far larger than L2
(50 MB on H100) and is filled with random bits, never zeros (METHOD.md). The floor of a
decode step is `bytes_read / this` (amk.eval.roofline).
"""

from __future__ import annotations

import json
import statistics
import sys

GiB = 1024**3


class BandwidthError(RuntimeError):
    """No CUDA device, or the measurement looks broken."""


def measure_bandwidth(size_bytes: int = 2 * GiB, iters: int = 20, warmup: int = 3, device: str = "cuda") -> float:
    """Median GB/s (1e9 bytes/s, read + written) of `iters` copies of a `size_bytes` buffer."""
    return bandwidth_report(size_bytes, iters, warmup, device)["gbps"]


def bandwidth_report(size_bytes: int = 2 * GiB, iters: int = 20, warmup: int = 3, device: str = "cuda") -> dict:
    """The measurement with its spread: {gbps (median), gbps_p10, gbps_p90, bytes, iters, gpu}."""
    import torch

    if not torch.cuda.is_available():
        raise BandwidthError("measuring HBM bandwidth needs a CUDA GPU (torch.cuda.is_available() is False)")
    if iters < 1 or size_bytes < 64 * 1024**2:
        raise BandwidthError("need iters >= 1 and a buffer of at least 64 MiB (far above L2)")
    dev = torch.device(device)
    n = size_bytes // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        dst.copy_(src)
        e.record()
    torch.cuda.synchronize(dev)
    if not torch.equal(dst[:1024], src[:1024]) or not torch.equal(dst[-1024:], src[-1024:]):
        raise BandwidthError("the timed copy did not copy (destination differs from source)")
    moved = 2 * n * 4
    rates = sorted(moved / (s.elapsed_time(e) * 1e-3) / 1e9 for s, e in zip(starts, ends))
    del src, dst
    torch.cuda.empty_cache()
    q = statistics.quantiles(rates, n=10, method="inclusive") if len(rates) > 1 else [rates[0]] * 9
    return {"gbps": statistics.median(rates), "gbps_p10": q[0], "gbps_p90": q[-1], "bytes_moved": moved,
            "iters": iters, "gpu": torch.cuda.get_device_name(dev)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        rep = bandwidth_report()
    except BandwidthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if "--json" in argv:
        print(json.dumps(rep, indent=2, sort_keys=True))
    else:
        print(f"{rep['gpu']}: {rep['gbps']:.0f} GB/s device-to-device copy (read + write; "
              f"p10 {rep['gbps_p10']:.0f}, p90 {rep['gbps_p90']:.0f}; {rep['bytes_moved'] / 1e9:.1f} GB per copy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
