"""GPU target records: data only. A new GPU is a new entry here, never a code change.

Figures are vendor specifications (SM counts, per-SM limits, L2, HBM bandwidth).
"""

from __future__ import annotations

from amk.schedule.ir import DType, GpuTarget

_NV_DTYPES = [DType.F32, DType.F16, DType.BF16, DType.I32, DType.I8, DType.U4]
_AMD_DTYPES = _NV_DTYPES

KiB = 1024
MiB = 1024 * 1024

TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in [
        GpuTarget(name="a100", arch="sm_80", vendor="nvidia", products=["A100-SXM4-80GB"],
                  compute_units=108, warp_size=32, max_threads_per_cu=2048, max_blocks_per_cu=32,
                  smem_per_cu=164 * KiB, regs_per_cu=65536, l2_bytes=40 * MiB, hbm_gbps=2039.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="a10g", arch="sm_86", vendor="nvidia", products=["A10G"],
                  compute_units=80, warp_size=32, max_threads_per_cu=1536, max_blocks_per_cu=16,
                  smem_per_cu=100 * KiB, regs_per_cu=65536, l2_bytes=6 * MiB, hbm_gbps=600.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="l4", arch="sm_89", vendor="nvidia", products=["L4"],
                  compute_units=58, warp_size=32, max_threads_per_cu=1536, max_blocks_per_cu=24,
                  smem_per_cu=100 * KiB, regs_per_cu=65536, l2_bytes=48 * MiB, hbm_gbps=300.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="l40s", arch="sm_89", vendor="nvidia", products=["L40S"],
                  compute_units=142, warp_size=32, max_threads_per_cu=1536, max_blocks_per_cu=24,
                  smem_per_cu=100 * KiB, regs_per_cu=65536, l2_bytes=96 * MiB, hbm_gbps=864.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="h100", arch="sm_90", vendor="nvidia", products=["H100-SXM5-80GB"],
                  compute_units=132, warp_size=32, max_threads_per_cu=2048, max_blocks_per_cu=32,
                  smem_per_cu=228 * KiB, regs_per_cu=65536, l2_bytes=50 * MiB, hbm_gbps=3350.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="h200", arch="sm_90", vendor="nvidia", products=["H200-SXM-141GB"],
                  compute_units=132, warp_size=32, max_threads_per_cu=2048, max_blocks_per_cu=32,
                  smem_per_cu=228 * KiB, regs_per_cu=65536, l2_bytes=50 * MiB, hbm_gbps=4800.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="rtx5090", arch="sm_120", vendor="nvidia", products=["GeForce RTX 5090"],
                  compute_units=170, warp_size=32, max_threads_per_cu=1536, max_blocks_per_cu=24,
                  smem_per_cu=100 * KiB, regs_per_cu=65536, l2_bytes=96 * MiB, hbm_gbps=1792.0,
                  dtypes=_NV_DTYPES),
        GpuTarget(name="mi300x", arch="gfx942", vendor="amd", products=["Instinct MI300X"],
                  compute_units=304, warp_size=64, max_threads_per_cu=2048, max_blocks_per_cu=32,
                  smem_per_cu=64 * KiB, regs_per_cu=131072, l2_bytes=32 * MiB, xcds=8,
                  l2_per_xcd=4 * MiB, hbm_gbps=5300.0, dtypes=_AMD_DTYPES),
        GpuTarget(name="mi350x", arch="gfx950", vendor="amd", products=["Instinct MI350X"],
                  compute_units=256, warp_size=64, max_threads_per_cu=2048, max_blocks_per_cu=32,
                  smem_per_cu=160 * KiB, regs_per_cu=131072, l2_bytes=32 * MiB, xcds=8,
                  l2_per_xcd=4 * MiB, hbm_gbps=8000.0, dtypes=_AMD_DTYPES),
    ]
}

# arch names resolve to the first record of that arch (sm_90 -> h100)
_BY_ARCH: dict[str, GpuTarget] = {}
for _t in TARGETS.values():
    _BY_ARCH.setdefault(_t.arch, _t)

DEFAULT_TARGET = "h100"


def get_target(name: str | None) -> GpuTarget:
    """Look a target up by record name (h100) or architecture (sm_90, gfx942)."""
    key = (name or DEFAULT_TARGET).lower()
    if key in TARGETS:
        return TARGETS[key]
    if key in _BY_ARCH:
        return _BY_ARCH[key]
    known = ", ".join(sorted(set(TARGETS) | set(_BY_ARCH)))
    raise ValueError(f"unknown target {name!r}; known: {known}")


def coresident_blocks(target: GpuTarget, threads_per_block: int, blocks_per_cu: int = 1) -> int:
    """How many blocks of this size can be resident at once (cooperative-launch bound)."""
    per_cu = min(blocks_per_cu, target.max_blocks_per_cu, target.max_threads_per_cu // max(threads_per_block, 1))
    return target.compute_units * max(per_cu, 0)
