"""The roofline floor of one batch-1 decode step, and how close a measured latency gets.

    b = step_bytes(spec, "bfloat16", ctx=1024, program=mk.program)
    f = floor_us(b["total"], gbps)          # bytes / measured HBM bandwidth
    pct_of_floor(latency_us, f)             # 100 = at the floor
    check_floor({"megakernel": {...}}, f)   # raises FloorViolation below it

Bytes per step = every weight byte the step reads (program_stats' `streamed_bytes` when a
Program exists: quantized codes + scales, one embedding row; the closed form below from
the ModelSpec otherwise) + the KV cache it attends over: 2 (K and V) x layers x ctx x
kv_heads x head_dim x dtype bytes. Activations, the new KV row and the logits are left
out (kilobytes), so the floor is a lower bound: no correct step can beat it.
"""

from __future__ import annotations

from typing import Mapping, Optional

from amk.schedule.modelspec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class FloorViolation(RuntimeError):
    """A measured latency below the physical floor: a measurement artifact, never a result."""


def weight_bytes_streamed(spec: ModelSpec, dtype: str) -> int:
    """Closed form, unquantized: every consumed weight at `dtype`, except that an untied
    model reads one row of its embedding table (the LM head is its own matrix), plus the
    fp32 RoPE inverse-frequency table (head_dim/2 entries a q head: the q/k epilogues' slices)."""
    width = DTYPE_BYTES[dtype]
    total = spec.weight_bytes(width) + spec.num_heads * spec.head_dim // 2 * 4
    if not spec.tie_word_embeddings:
        total -= (spec.vocab_size - 1) * spec.hidden_size * width
    return total


def kv_bytes(spec: ModelSpec, dtype: str, ctx: int) -> int:
    """K and V bytes read by attention over `ctx` cached positions, all layers."""
    return 2 * spec.num_layers * ctx * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[dtype]


def step_bytes(spec: ModelSpec, dtype: str, ctx: int, program=None) -> dict:
    """{weights, kv, total, weights_source}: bytes one decode step must read from HBM."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if ctx < 0:
        raise ValueError("ctx must be >= 0")
    if program is not None:
        from amk.schedule.stats import program_stats

        weights, source = int(program_stats(program)["streamed_bytes"]), "program_stats.streamed_bytes"
    else:
        weights, source = weight_bytes_streamed(spec, dtype), "closed form (ModelSpec)"
    kv = kv_bytes(spec, dtype, ctx)
    return {"weights": weights, "kv": kv, "total": weights + kv, "weights_source": source}


def floor_us(total_bytes: int, bandwidth_gbps: float) -> float:
    """Microseconds to move `total_bytes` at `bandwidth_gbps` (1e9 bytes/s)."""
    if not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_gbps}")
    return total_bytes / (bandwidth_gbps * 1e9) * 1e6


def pct_of_floor(latency_us: float, floor: float) -> float:
    """Percent of the floor reached: 100 * floor / latency (100 = at the floor)."""
    if not latency_us > 0:
        raise ValueError(f"latency must be > 0, got {latency_us}")
    return 100.0 * floor / latency_us


def check_floor(stats: Mapping[str, Mapping[str, float]], floor: float, keys=("p10_us", "median_us", "p90_us"),
                what: Optional[str] = None) -> None:
    """Raise FloorViolation if any variant's reported latency (`keys` of its stats) is below
    `floor` microseconds. Such a number is an artifact (a step that did not run, a timer
    around the wrong work, a byte count too large), so it is refused, not reported."""
    bad = [(name, k) for name, s in stats.items() for k in keys if k in s and s[k] < floor]
    if bad:
        listed = ", ".join(f"{name} {k.removesuffix('_us')}" for name, k in bad)
        raise FloorViolation(f"{listed} below the physical floor of {floor:.1f} us"
                             f"{' (' + what + ')' if what else ''}: a measurement artifact, no latency reported")


def model_floor(spec: ModelSpec, dtype: str, ctx: int, bandwidth_gbps: float, program=None) -> dict:
    """step_bytes plus the floor in microseconds at the given bandwidth."""
    b = step_bytes(spec, dtype, ctx, program)
    return {**b, "bandwidth_gbps": bandwidth_gbps, "floor_us": floor_us(b["total"], bandwidth_gbps)}
