"""The decode benchmark: the megakernel against PyTorch baselines, gated on correctness and
judged against the roofline floor.

    row = run_bench(BenchOptions(model="llama-3.1-8b", random_init=True, dtype="bfloat16", ctx=1024))
    print(format_table(row))

One run, one process, one GPU:

1. Load the model (a shape-only config gets random weights drawn on the GPU), compile the
   megakernel with KV capacity ctx + check + warm-up + timed steps + a margin, and build
   the baselines over the *same* weight tensors (no copies): `cuda_graph`, `torch_compile`
   (reduce-overhead) and `hf_eager` (transformers, the oracle); see `eval/baselines.py`.
2. Write the same K/V rows 0..ctx-1 into every runner's cache, so each decode step
   attends over ctx (+1, +2, ...) positions: by default the model's own K/V over ctx
   random tokens (one HF prefill at the bench dtype, `prefix="model"`); `prefix="random"`
   writes N(0, 1) rows instead, which puts a real checkpoint far outside what it was
   trained on: its q.k scores grow large enough that bf16 score rounding alone moves the
   logits by tens of percent (SmolLM2-135M at ctx 1024: HF eager bf16 vs fp32, 23-118 %).
3. Correctness gate: `check_steps` steps at positions ctx, ctx+1, ...
   fp32: every runner's logits against the reference (hf_eager, else the first baseline):
   finite, max |diff| <= 1e-3 x max |ref logit|, argmax equal or a near-tie (the
   reference's logit at the other's argmax within that tolerance of its max).
   bf16/fp16 (`eval/tolerance.py`): every variant, HF eager included, against an fp32
   reference of the same half-valued weights (`fp32_reference`, untimed), within
   max(2 x HF eager's own error, 2^-7) x max |ref logit|, argmax equal or a near-tie
   within that bound; each variant's distance to HF eager is recorded too.
   A failing gate stops the run: no latency is measured or printed.
4. Timing: warm-up rounds, then `steps` rounds; each round runs every variant once at the
   same fresh position, the order rotating each round (interleaved A/B). Each step is
   timed with CUDA events; before its start event the stream is held by a spin kernel
   longer than the host needs to enqueue the step, so the events time the device work,
   not Python (steps where the host was slower are counted: `host_bound_steps`). Every
   step's inputs (token, position) are written on the device inside the timed region,
   for every variant alike. Reported: median / p10 / p90 per variant, and per-round
   ratios baseline / megakernel (their median: `speedup`).
5. Floor guard: any reported latency below bytes / measured bandwidth is refused as an
   artifact (`FloorViolation`), with no latency printed.

`device="cpu"` runs the same harness on the ReferenceVM with the `eager` and `hf_eager`
baselines (host timers): for tests of the harness only, never for results.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from amk.errors import AmkError
from amk.eval import roofline
from amk.eval.baselines import DEFAULT_GPU_BASELINES, FP32_REFERENCE, make_runner, optional_engines
from amk.eval.provenance import git_commit
from amk.schedule.modelspec import ModelSpec
from amk.schedule.rope_rows import in_hf_order, permute_k_history
from amk.vm.loader import experiment_defines
from amk.vm.kv_layout import kv_rows_view, stored_kv_head

GATE_TOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}  # half: only for fallback comparisons
HALF = ("bfloat16", "float16")  # gated by eval/tolerance.py against an fp32 reference
KV_MARGIN = 8  # spare cache rows beyond the last timed position
MEGAKERNEL = "megakernel"
REFERENCE_ORDER = ("hf_eager", "eager", "cuda_graph", "torch_compile")
TIMED_BASELINE_ORDER = ("cuda_graph", "torch_compile", "eager")  # "the faster baseline" is one of these
MAX_HOLD_US = 100_000.0


class BenchError(AmkError):
    """An expected failure of the benchmark (bad input, no GPU, a runner that cannot run)."""


class GateFailed(BenchError):
    """The correctness gate failed; `report` holds the figures (no latency was measured)."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


# ------------------------------------------------------------------------------- options
@dataclass
class BenchOptions:
    model: Optional[str] = None  # importer source, or a shape name of eval/shapes.py (with random_init)
    dtype: Optional[str] = None  # program dtype; None = the checkpoint's (float32 for random init)
    ctx: int = 1024  # cached positions before the first measured step
    config: Any = None  # ScheduleConfig or None
    random_init: bool = False
    seed: int = 0
    steps: int = 100  # timed rounds
    warmup: int = 20  # untimed rounds
    check_steps: int = 4  # correctness-gate steps
    baselines: Sequence[str] = DEFAULT_GPU_BASELINES
    target: Optional[str] = None  # GpuTarget name; None = from the GPU's name
    bandwidth_gbps: Optional[float] = None  # None = measure now (GPU)
    device: str = "cuda"
    command: Optional[str] = None  # recorded in the result; None = this process's argv
    prefix: str = "model"  # KV rows 0..ctx-1: the model's own over random tokens, or "random" N(0, 1)

    def positions(self) -> int:
        return self.check_steps + self.warmup + self.steps

    def kv_capacity(self) -> int:
        return self.ctx + self.positions() + KV_MARGIN


def check_options(o: BenchOptions) -> None:
    if o.ctx < 0:
        raise BenchError("--ctx must be >= 0")
    if o.steps < 1 or o.warmup < 1 or o.check_steps < 1:
        raise BenchError("--steps, --warmup and --check-steps must each be >= 1")
    if o.dtype not in (None, *GATE_TOL):
        raise BenchError(f"--dtype must be one of {', '.join(GATE_TOL)}, got {o.dtype!r}")
    if not o.baselines:
        raise BenchError("at least one baseline is needed (the gate and the ratio compare against it)")
    if o.prefix not in ("model", "random"):
        raise BenchError(f"prefix must be 'model' or 'random', got {o.prefix!r}")
    from amk.eval.baselines import BASELINES

    bad = [b for b in o.baselines if b not in BASELINES]
    if bad:
        raise BenchError(f"unknown baseline(s) {bad}; known: {', '.join(BASELINES)}")
    if o.device == "cpu":
        gpu_only = [b for b in o.baselines if b in ("cuda_graph", "torch_compile")]
        if gpu_only:
            raise BenchError(f"baselines {gpu_only} need a CUDA device")
        if o.bandwidth_gbps is None:
            raise BenchError("device cpu (a harness test) needs an explicit bandwidth")
    elif not o.device.startswith("cuda"):
        raise BenchError(f"device must be cuda or cpu, got {o.device!r}")


# ------------------------------------------------------------------------------- statistics
def summarize(xs: Sequence[float]) -> dict:
    """median, p10, p90 (linear interpolation), min, max and n of a sample."""
    a = np.asarray(list(xs), dtype=np.float64)
    if a.size == 0:
        raise ValueError("empty sample")
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90), "min": float(a.min()),
            "max": float(a.max()), "n": int(a.size)}


def compare_logits(got: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    """One step's logits against the reference: max |diff| relative to max |ref|, the
    relative L2 error, argmax agreement (or a near-tie within the tolerance), NaN/inf."""
    g, r = got.detach().double().reshape(-1).cpu(), ref.detach().double().reshape(-1).cpu()
    if g.shape != r.shape:
        return {"passed": False, "reason": f"shape {tuple(g.shape)} != {tuple(r.shape)}"}
    finite = bool(torch.isfinite(g).all())
    scale = float(r.abs().max())
    diff = float((g - r).abs().max()) if finite else float("inf")
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    rel_l2 = float((g - r).norm() / r.norm()) if finite and float(r.norm()) > 0 else float("inf")
    ag, ar = int(torch.argmax(g)) if finite else -1, int(torch.argmax(r))
    equal = ag == ar
    near_tie = (not equal) and finite and float(r[ag]) >= float(r[ar]) - tol * scale
    ok = finite and rel <= tol and (equal or near_tie)
    return {"passed": ok, "finite": finite, "max_abs_err": diff, "max_rel_err": rel, "rel_l2": rel_l2,
            "argmax": ag, "ref_argmax": ar, "argmax_equal": equal, "near_tie": near_tie}


def merge_rows(doc: Optional[dict], row: dict) -> dict:
    """`doc` ({"rows": [...]}) with `row` added, replacing a row of the same
    (model, dtype, ctx, quant) key; rows sorted by that key."""
    key = lambda r: (str(r.get("model")), str(r.get("dtype")), int(r.get("ctx", -1)), str(r.get("quant")))  # noqa: E731
    rows = [r for r in (doc or {}).get("rows", []) if key(r) != key(row)] + [row]
    out = dict(doc or {})
    out["rows"] = sorted(rows, key=key)
    return out


# ------------------------------------------------------------------------------- loading
def _device_target(device: str) -> Optional[str]:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device)).upper()
    for key in ("H200", "H100", "A100", "L40S", "L4", "A10G"):
        if key in name:
            return key.lower()
    return None


def load_weights(o: BenchOptions, dtype: Optional[str]):
    """(spec, weights on o.device in the final dtype, info). Shape names and config.json
    files with --random-init get weights drawn on the device; other sources go through
    the importer (random init on the CPU for --random-init) and are moved over."""
    from amk.eval.shapes import random_weights_like, shape_config
    from amk.schedule.importer import load_model, spec_from_hf_config

    cfg = shape_config(o.model)
    if cfg is None and o.random_init and o.model and o.model.endswith(".json") and Path(o.model).is_file():
        cfg = json.loads(Path(o.model).read_text())
    if cfg is not None:
        if not o.random_init:
            raise BenchError(f"{o.model} is a config without weights: add --random-init (shape-only benchmark)")
        path = Path(o.model)
        name = o.model if shape_config(o.model) is not None else (path.parent.name if path.stem == "config" else path.stem)
        dt = dtype or "float32"
        spec = spec_from_hf_config(cfg, name=name).model_copy(update={"dtype": dt})
        weights = random_weights_like(spec, o.device, dt, o.seed)
        return spec, weights, {"shape_only": True, "weights": f"random on {o.device} (seed {o.seed})"}
    spec, weights = load_model(o.model, random_init=o.random_init, seed=o.seed, dtype=dtype)
    weights = {k: v.to(o.device) for k, v in weights.items()}
    src = f"random (HF init, seed {o.seed})" if o.random_init else "checkpoint"
    return spec, weights, {"shape_only": o.random_init, "weights": src}


def quant_label(cfg) -> str:
    """A row's quantization: the mode, '+head' when the LM head is quantized too (rows are keyed by it)."""
    return cfg.quant + ("+head" if cfg.quant_lm_head else "")


def baseline_weights(mk, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[dict, ModelSpec, str]:
    """The weights (and the spec) the baselines compute with: the megakernel's own, dequantized
    where the program quantized them (equal math; the baselines then stream dtype-wide
    weights). A tied model whose LM head the program quantizes (a separate copy) becomes an
    untied one for the baselines: the float embedding, the dequantized head."""
    from amk.schedule.ir import DType
    from amk.schedule.quantize import dequantize
    from amk.schedule.weights import LM_HEAD_Q

    quant, spec = mk.config.quant, mk.spec
    if quant == "none":
        return weights, spec, "same tensors as the megakernel"
    by_name, by_id = {b.name: b for b in mk.program.buffers}, {b.id: b for b in mk.program.buffers}
    out = dict(weights)

    def dequantized(name: str):
        b = by_name.get(name)
        if b is None or b.dtype not in (DType.I8, DType.U4):
            return None
        zero = mk.tensors[by_id[b.zero].name] if b.zero is not None else None
        return dequantize(mk.tensors[name], mk.tensors[by_id[b.scale].name], zero).to(dtype)

    for name in spec.expected_tensor_names():
        deq = dequantized(name)
        if deq is not None:
            out[name] = in_hf_order(mk.program, name, deq).contiguous()  # q/k rows permuted for rope_rows
    head = dequantized(LM_HEAD_Q) if spec.tie_word_embeddings else None
    if head is not None:
        out["lm_head.weight"] = head.contiguous()
        spec = spec.model_copy(update={"tie_word_embeddings": False,
                                       "hf_config": {**spec.hf_config, "tie_word_embeddings": False}})
    return out, spec, (f"dequantized {quant} weights of the megakernel, in {str(dtype).removeprefix('torch.')}"
                       + (" (its quantized copy of the tied LM head as an untied head)" if head is not None else ""))


# ------------------------------------------------------------------------------- the megakernel
class MegakernelRunner:
    """The compiled program on its VM, behind the runners' interface: CudaVM on a GPU
    (launch without a host sync; `finish` waits and raises on device errors), the
    ReferenceVM on the CPU."""

    name = MEGAKERNEL

    def __init__(self, mk, device: str):
        self.mk, self.spec = mk, mk.spec
        self.cuda = device.startswith("cuda")
        self.vm = mk.vm(device)
        if self.cuda:
            missing = [m for m in ("_launch", "_finish", "_check_pos", "tensors") if not hasattr(self.vm, m)]
            if missing:
                raise BenchError(f"CudaVM lacks {missing}: the benchmark needs an asynchronous launch "
                                 "(launch, then finish) to time steps with CUDA events")
        self._event = None
        self._out: Optional[dict] = None
        self.capacity = mk.program.kv_capacity

    def _kv(self, name: str) -> torch.Tensor:
        vm = self.vm
        buf = next((b for b in self.mk.program.buffers if b.name == name), None)
        if buf is None:
            raise BenchError(f"the program has no KV cache buffer {name!r}")
        if hasattr(vm, "tensors") and name in vm.tensors:
            flat, h = vm.tensors[name], stored_kv_head(self.mk.program, buf)
        elif hasattr(vm, "mem") and hasattr(vm, "_by_name"):
            flat, h = vm.mem[vm._by_name[name].id], 0  # the ReferenceVM keeps the IR's rows
        else:
            raise BenchError(f"cannot reach the megakernel's KV cache buffer {name!r}")
        width = self.spec.num_kv_heads * self.spec.head_dim
        if flat.numel() != self.capacity * width:
            raise BenchError(f"KV buffer {name} holds {flat.numel()} elements, expected {self.capacity} x {width}")
        return kv_rows_view(buf, flat, h)  # [capacity, heads, h] in the IR's rows, whatever the layout

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        # k in the program's layout (q/k rows permuted for rope_rows < head_dim)
        for name, rows in (("k_cache", permute_k_history(self.mk.program, k.reshape(n, -1))), ("v_cache", v)):
            view = self._kv(f"layers.{layer}.{name}")
            view[:n].copy_(rows.reshape(n, *view.shape[1:]))

    def prepare(self, token: int, pos: int) -> None:
        pass

    def poison(self, on: bool) -> None:
        """Poison activations/outputs before every step (the gate), or not (timing)."""
        if hasattr(self.vm, "poison_each_step"):
            self.vm.poison_each_step = on

    def enqueue(self, token: int, pos: int) -> None:
        if self.cuda:
            self.vm._check_pos(pos)
            self._event = self.vm._launch(token, pos)
        else:
            self._out = self.vm.run_step(token, pos)

    def finish(self) -> None:
        if self.cuda and self._event is not None:
            ev, self._event = self._event, None
            self.vm._finish([ev])

    def logits(self) -> torch.Tensor:
        if self.cuda:
            return self.vm.tensors["logits"].float().reshape(-1).clone()
        if self._out is None:
            raise BenchError("megakernel: no step has run")
        return self._out["logits"].float().reshape(-1)

    def next_token(self) -> Optional[int]:
        """The program's own argmax output (`next_token`), if it has one."""
        out = self.vm.tensors if self.cuda else (self._out or {})
        return int(out["next_token"].reshape(-1)[0]) if "next_token" in out else None


# ------------------------------------------------------------------------------- phases
@torch.no_grad()
def model_kv_prefix(spec, weights: dict[str, torch.Tensor], ctx: int, seed: int, chunk: int = 1024):
    """The model's own K/V over ctx random tokens: per layer (k, v), each [ctx, kv_heads,
    head_dim] post-RoPE, from an HF prefill (sdpa, in `chunk`-token pieces) over `weights`
    (shared, not copied)."""
    from transformers import DynamicCache

    from amk.eval.baselines import build_hf_shared

    model = build_hf_shared(spec, weights)
    model.config._attn_implementation = "sdpa"  # only the prefix: memory-lean attention
    dev = weights["model.embed_tokens.weight"].device
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    ids = torch.randint(0, spec.vocab_size, (ctx,), generator=gen).to(dev)
    cache = DynamicCache(config=model.config)
    for a in range(0, ctx, chunk):
        b = min(a + chunk, ctx)
        model.model(input_ids=ids[None, a:b], position_ids=torch.arange(a, b, device=dev)[None],
                    past_key_values=cache, use_cache=True)
    layers = getattr(cache, "layers", None)
    kv = [(lay.keys, lay.values) for lay in layers] if layers is not None else list(zip(cache.key_cache, cache.value_cache))
    return [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in kv]


@torch.no_grad()
def fill_kv_prefix(runners: Sequence, spec, ctx: int, dtype: torch.dtype, device: str, seed: int,
                   weights: Optional[dict[str, torch.Tensor]] = None) -> None:
    """The same K/V rows 0..ctx-1 (post-RoPE layout [ctx, kv_heads, head_dim]) into every
    runner's cache, layer by layer: the model's own (`model_kv_prefix`) when `weights` are
    given, else N(0, 1) rows."""
    if ctx == 0:
        return
    prefix = model_kv_prefix(spec, weights, ctx, seed) if weights is not None else None
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 1_000_003)
    shape = (ctx, spec.num_kv_heads, spec.head_dim)
    for layer in range(spec.num_layers):
        if prefix is not None:
            k, v = (t.to(dtype).contiguous() for t in prefix[layer])
        else:
            k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        for r in runners:
            r.write_kv(layer, k, v)
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def correctness_gate(runners: Sequence, reference: str, tokens: Sequence[int], positions: Sequence[int],
                     tol: float) -> dict:
    """Step every runner at each (token, pos); compare each one's logits to `reference`'s."""
    if not any(r.name == reference for r in runners):
        raise BenchError(f"the gate's reference {reference!r} is not among the runners")
    steps: dict[str, list[dict]] = {r.name: [] for r in runners if r.name != reference}
    own_argmax: dict[str, list[bool]] = {}
    for tok, pos in zip(tokens, positions):
        logits = {}
        for r in runners:
            r.enqueue(tok, pos)
            r.finish()
            logits[r.name] = r.logits()
            nt = r.next_token() if hasattr(r, "next_token") else None
            if nt is not None:  # the device argmax must pick a maximal logit of the same step
                lg = logits[r.name]
                own_argmax.setdefault(r.name, []).append(0 <= nt < lg.numel() and bool(lg[nt] == lg.max()))
        for name in steps:
            steps[name].append(compare_logits(logits[name], logits[reference], tol))
    checks = {}
    for name, rows in steps.items():
        checks[name] = {
            "passed": all(s["passed"] for s in rows),
            "max_abs_err": max(s.get("max_abs_err", float("inf")) for s in rows),
            "max_rel_err": max(s.get("max_rel_err", float("inf")) for s in rows),
            "rel_l2": max(s.get("rel_l2", float("inf")) for s in rows),
            "argmax_equal": sum(bool(s.get("argmax_equal")) for s in rows),
            "near_ties": sum(bool(s.get("near_tie")) for s in rows),
            "finite": all(s.get("finite", False) for s in rows),
            "steps": len(rows),
        }
        if name in own_argmax:
            checks[name]["next_token_is_argmax"] = all(own_argmax[name])
            checks[name]["passed"] = checks[name]["passed"] and all(own_argmax[name])
    return {"reference": reference, "tolerance_rel_to_max_logit": tol, "steps": len(tokens),
            "positions": [int(positions[0]), int(positions[-1])] if positions else [],
            "passed": all(c["passed"] for c in checks.values()), "checks": checks}


def half_correctness_gate(runners: Sequence, ref32, yardstick: str, tokens: Sequence[int],
                          positions: Sequence[int]) -> dict:
    """The bf16/fp16 gate (`eval/tolerance.py`): every runner's logits against `ref32`'s
    (the fp32 reference of the same weights) under the bound `yardstick`'s (HF eager) own
    error sets; each runner's distance to the yardstick is recorded as well."""
    from amk.eval.tolerance import half_gate, rel_err

    if not any(r.name == yardstick for r in runners):
        raise BenchError(f"the gate's yardstick {yardstick!r} is not among the runners")
    logits: dict[str, list[torch.Tensor]] = {r.name: [] for r in list(runners) + [ref32]}
    own_argmax: dict[str, list[bool]] = {}
    for tok, pos in zip(tokens, positions):
        for r in list(runners) + [ref32]:
            r.enqueue(tok, pos)
            r.finish()
            lg = r.logits().float().cpu()
            logits[r.name].append(lg)
            nt = r.next_token() if hasattr(r, "next_token") else None
            if nt is not None:
                own_argmax.setdefault(r.name, []).append(0 <= nt < lg.numel() and bool(lg[nt] == lg.max()))
    ref = logits.pop(ref32.name)
    res = half_gate(logits, logits[yardstick], ref)
    checks = {}
    for name, c in res["checks"].items():
        vs_hf = [rel_err(a, b) for a, b in zip(logits[name], logits[yardstick])]
        checks[name] = {
            "passed": c["passed"], "max_rel_err": c["err_vs_fp32"], "max_rel_err_steps": c["err_vs_fp32_steps"],
            "rel_l2": max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(logits[name], ref)),
            "max_rel_err_vs_" + yardstick: max(vs_hf),
            "argmax_equal": c["argmax_equal"], "near_ties": c["near_ties"], "finite": c["finite"], "steps": c["steps"],
        }
        if name in own_argmax:
            checks[name]["next_token_is_argmax"] = all(own_argmax[name])
            checks[name]["passed"] = checks[name]["passed"] and all(own_argmax[name])
    return {"reference": FP32_REFERENCE, "yardstick": yardstick, "rule": res["rule"],
            "hf_err_vs_fp32": res["hf_err_vs_fp32"], "tolerance_rel_to_max_logit": res["bound"],
            "steps": len(tokens), "positions": [int(positions[0]), int(positions[-1])] if positions else [],
            "passed": all(c["passed"] for c in checks.values()), "checks": checks}


class _Clock:
    """CUDA events (device time) on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.device = torch.device(device)
        self.cycles_per_us = 0.0
        if self.cuda:
            self.cycles_per_us = self._calibrate()

    def _calibrate(self) -> float:
        cycles = 2_000_000
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.cuda._sleep(cycles)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        us = float(np.median(times))
        if not us > 0:
            raise BenchError("could not calibrate the spin kernel (torch.cuda._sleep)")
        return cycles / us

    def time_step(self, runner, token: int, pos: int, hold_us: float) -> tuple[float, float]:
        """(step time in us, host enqueue time in us)."""
        if not self.cuda:
            t0 = time.perf_counter()
            runner.enqueue(token, pos)
            t1 = time.perf_counter()
            runner.finish()
            return (time.perf_counter() - t0) * 1e6, (t1 - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold_us > 0:
            torch.cuda._sleep(int(hold_us * self.cycles_per_us))
        start.record()
        t0 = time.perf_counter()
        runner.enqueue(token, pos)
        enq = (time.perf_counter() - t0) * 1e6
        end.record()
        runner.finish()
        end.synchronize()
        return start.elapsed_time(end) * 1e3, enq


def time_rounds(runners: Sequence, clock: _Clock, tokens: Sequence[int], positions: Sequence[int],
                warmup: int) -> dict:
    """Interleaved rounds: each runs every runner once at the same position, the order
    rotated by one each round. The first `warmup` rounds (no hold) calibrate each runner's
    hold from its host enqueue time and are discarded."""
    n = len(runners)
    hold = {r.name: 0.0 for r in runners}
    enq_warm: dict[str, list[float]] = {r.name: [] for r in runners}
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    enq: dict[str, list[float]] = {r.name: [] for r in runners}
    for i, (tok, pos) in enumerate(zip(tokens, positions)):
        if i == warmup:
            for r in runners:
                p90 = float(np.percentile(enq_warm[r.name], 90))
                hold[r.name] = min(2.0 * p90 + 50.0, MAX_HOLD_US) if clock.cuda else 0.0
        order = [runners[(i + j) % n] for j in range(n)]
        for r in order:
            t, e = clock.time_step(r, tok, pos, hold[r.name])
            if i < warmup:
                enq_warm[r.name].append(e)
            else:
                times[r.name].append(t)
                enq[r.name].append(e)
    return {"times": times, "enqueue": enq, "hold": hold}


# ------------------------------------------------------------------------------- provenance
def _versions() -> dict:
    import transformers

    from amk.eval.provenance import cpu_name

    return {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "cpu": cpu_name()}


# ------------------------------------------------------------------------------- the run
def run_bench(o: BenchOptions, log=print) -> dict:
    """Build, gate, time, guard; returns the result row. Raises GateFailed, FloorViolation
    or BenchError (no latency is returned or printed in those cases)."""
    import amk
    from amk.eval.baselines import DTYPES
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.stats import program_stats

    check_options(o)
    cuda = o.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise BenchError("amk bench needs a CUDA GPU (torch.cuda.is_available() is False)")
    cfg = o.config or ScheduleConfig()
    if o.dtype and cfg.dtype and o.dtype != cfg.dtype:
        raise BenchError(f"--dtype {o.dtype} contradicts the config's dtype {cfg.dtype}")
    dtype_name = o.dtype or cfg.dtype

    bandwidth = o.bandwidth_gbps
    bw_source = "given"
    if bandwidth is None:
        from amk.eval.peak_bandwidth import bandwidth_report

        log("measuring HBM bandwidth (device-to-device copy) ...")
        bandwidth, bw_source = bandwidth_report(device=o.device)["gbps"], "measured in this run"

    t0 = time.perf_counter()
    log(f"loading {o.model or 'the default model'} ...")
    spec, weights, info = load_weights(o, dtype_name)
    dtype_name = spec.dtype
    tdtype = DTYPES[dtype_name]
    target = o.target or _device_target(o.device)
    log(f"compiling the megakernel ({spec.num_layers} layers, {dtype_name}, KV capacity {o.kv_capacity()}) ...")
    mk = amk.compile(o.model, cfg, target, dtype=dtype_name, random_init=True, seed=o.seed,
                     kv_capacity=o.kv_capacity(), loaded=(spec, weights))  # random_init: no tokenizer needed
    stats = program_stats(mk.program)
    base_w, base_spec, base_w_note = baseline_weights(mk, weights, tdtype)

    runners, baseline_errors = [MegakernelRunner(mk, o.device)], {}
    for kind in o.baselines:
        try:
            log(f"building baseline {kind} ...")
            runners.append(make_runner(kind, base_spec, base_w, o.kv_capacity()))
        except Exception as exc:  # noqa: BLE001 - one baseline failing must not hide the others
            baseline_errors[kind] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log(f"error: baseline {kind} could not be built: {baseline_errors[kind]}")
    total = o.positions()
    gen = torch.Generator().manual_seed(o.seed + 7)
    tokens = torch.randint(0, spec.vocab_size, (total,), generator=gen).tolist()
    positions = list(range(o.ctx, o.ctx + total))
    half = dtype_name in HALF
    ref32 = make_runner(FP32_REFERENCE, base_spec, base_w, o.kv_capacity()) if half else None
    fill_kv_prefix(runners + ([ref32] if ref32 else []), base_spec, o.ctx, tdtype, o.device, o.seed,
                   weights=base_w if o.prefix == "model" else None)

    for r in list(runners[1:]):
        try:
            log(f"preparing {r.name} (capture / compile) ...")
            r.prepare(tokens[0], positions[0])
        except Exception as exc:  # noqa: BLE001
            baseline_errors[r.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log(f"error: baseline {r.name} failed to prepare: {baseline_errors[r.name]}")
            runners.remove(r)
    if len(runners) < 2:
        raise BenchError(f"no baseline could run: {baseline_errors}")
    setup_s = time.perf_counter() - t0

    # ---- correctness gate (before any timing)
    reference = next(n for n in REFERENCE_ORDER if any(r.name == n for r in runners))
    g = o.check_steps
    runners[0].poison(True)
    if half:
        gate = half_correctness_gate(runners, ref32, reference, tokens[:g], positions[:g])
        del ref32  # untimed: only the gate needs it
    else:
        gate = correctness_gate(runners, reference, tokens[:g], positions[:g], GATE_TOL[dtype_name])
    gate["kv_prefix"] = o.prefix
    runners[0].poison(False)
    if not gate["passed"]:
        raise GateFailed("correctness gate FAILED: no latency measured", gate)

    # ---- timing
    clock = _Clock(o.device)
    log(f"timing: {o.warmup} warm-up + {o.steps} interleaved rounds of {', '.join(r.name for r in runners)} ...")
    res = time_rounds(runners, clock, tokens[g:], positions[g:], o.warmup)
    floor = roofline.model_floor(spec, dtype_name, o.ctx, bandwidth, mk.program)
    variants = {}
    for r in runners:
        s = summarize(res["times"][r.name])
        e = summarize(res["enqueue"][r.name])
        hold = res["hold"][r.name]
        variants[r.name] = {
            "median_us": s["median"], "p10_us": s["p10"], "p90_us": s["p90"], "min_us": s["min"], "max_us": s["max"],
            "n": s["n"], "pct_of_floor": roofline.pct_of_floor(s["median"], floor["floor_us"]),
            "enqueue_us_median": e["median"], "hold_us": hold,
            "host_bound_steps": int(sum(x > hold for x in res["enqueue"][r.name])) if clock.cuda else None,
        }
    roofline.check_floor(variants, floor["floor_us"], what=f"{floor['total']} bytes at {bandwidth:.0f} GB/s")

    mk_times = np.asarray(res["times"][MEGAKERNEL])
    speedups = {}
    for r in runners[1:]:
        ratio = np.asarray(res["times"][r.name]) / mk_times
        s = summarize(ratio)
        speedups[r.name] = {"median": s["median"], "p10": s["p10"], "p90": s["p90"]}
    timed = [r.name for r in runners[1:] if r.name in TIMED_BASELINE_ORDER] or [r.name for r in runners[1:]]
    best = min(timed, key=lambda n: variants[n]["median_us"])

    return {
        "model": spec.name, "family": spec.family, "shape_only": info["shape_only"], "weights": info["weights"],
        "dtype": dtype_name, "ctx": o.ctx, "quant": quant_label(mk.config), "config": mk.config.model_dump(mode="json"),
        "gpu": torch.cuda.get_device_name(torch.device(o.device)) if cuda else "cpu (harness test)",
        "target": mk.program.target.name, "device": o.device,
        "bandwidth_gbps": bandwidth, "bandwidth_source": bw_source,
        "bytes_per_step": {"weights": floor["weights"], "kv": floor["kv"], "total": floor["total"],
                           "weights_source": floor["weights_source"]},
        "floor_us": floor["floor_us"],
        "variants": variants,
        "speedup": speedups, "faster_baseline": best, "speedup_vs_faster_baseline": speedups[best]["median"],
        "megakernel_pct_of_floor": variants[MEGAKERNEL]["pct_of_floor"],
        "correctness": gate,
        "baseline_weights": base_w_note, "baseline_errors": baseline_errors, "skipped": optional_engines(),
        "program": {k: stats[k] for k in ("tasks", "queues", "counters", "max_hops_per_layer", "streamed_bytes")},
        "device_memory": runners[0].vm.device_memory() if hasattr(runners[0].vm, "device_memory") else None,
        "method": {"rounds": o.steps, "warmup_rounds": o.warmup, "check_steps": o.check_steps, "kv_prefix": o.prefix,
                   "kv_capacity": o.kv_capacity(), "positions": [positions[g + o.warmup], positions[-1]],
                   "timer": "cuda events, stream held by a spin kernel during enqueue" if cuda else "perf_counter",
                   "order": "interleaved rounds, order rotated each round", "seed": o.seed},
        "setup_s": setup_s, "git_commit": git_commit(),  # $AMK_GIT_COMMIT on a machine without .git
        "command": _with_vm_defines(o.command or " ".join(shlex.quote(a) for a in sys.argv)),
        "vm_defines": experiment_defines(),  # $AMK_VM_DEFINES build overrides ({} normally)
        "versions": _versions(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _with_vm_defines(command: str) -> str:
    """The command as run: an $AMK_VM_DEFINES experiment changes the kernel, so it is part of it."""
    defines = experiment_defines()
    return "AMK_VM_DEFINES=" + ",".join(f"{k}={v}" for k, v in defines.items()) + " " + command if defines else command


# ------------------------------------------------------------------------------- output
def format_gate(gate: dict) -> str:
    bound = f"tol {gate['tolerance_rel_to_max_logit']:g}"
    if "yardstick" in gate:
        bound += f" = max(2 x {gate['yardstick']}'s {gate['hf_err_vs_fp32']:.2e}, 2^-7)"
    lines = [f"correctness gate vs {gate['reference']} ({gate['steps']} steps, {bound}"
             f" x max|logit|): {'PASS' if gate['passed'] else 'FAIL'}",
             f"  {'variant':<14} {'max rel err':>12} {'rel L2':>10} {'argmax =':>9} {'near-tie':>9}  result"]
    for name, c in gate["checks"].items():
        lines.append(f"  {name:<14} {c['max_rel_err']:>12.2e} {c['rel_l2']:>10.2e} {c['argmax_equal']:>5}/{c['steps']:<3}"
                     f" {c['near_ties']:>9}  {'ok' if c['passed'] else 'FAIL'}")
    return "\n".join(lines)


def format_table(row: dict) -> str:
    b = row["bytes_per_step"]
    shape = " (shape only: random weights)" if row["shape_only"] else ""
    lines = [f"{row['model']}{shape}  {row['dtype']}  ctx {row['ctx']}  quant {row['quant']}  on {row['gpu']}",
             f"bandwidth {row['bandwidth_gbps']:.0f} GB/s ({row['bandwidth_source']}); bytes/step {b['total'] / 1e9:.3f} GB"
             f" (weights {b['weights'] / 1e9:.3f} + KV {b['kv'] / 1e9:.3f}); floor {row['floor_us']:.1f} us",
             format_gate(row["correctness"]), "",
             f"  {'variant':<14} {'median us':>10} {'p10':>10} {'p90':>10} {'% floor':>8} {'speedup':>8}"]
    for name, v in row["variants"].items():
        sp = row["speedup"].get(name)
        sp_s = f"{sp['median']:.2f}x" if sp else "-"
        lines.append(f"  {name:<14} {v['median_us']:>10.1f} {v['p10_us']:>10.1f} {v['p90_us']:>10.1f}"
                     f" {v['pct_of_floor']:>7.1f}% {sp_s:>8}")
    lines.append(f"speedup = baseline / megakernel, median over interleaved rounds; vs the faster baseline "
                 f"({row['faster_baseline']}): {row['speedup_vs_faster_baseline']:.2f}x")
    m = row.get("device_memory")
    if m:
        lines.append(f"megakernel device memory: weights {m['weights'] / 1e9:.3f} GB + KV {m['kv'] / 1e9:.3f} GB + "
                     f"other {m['other'] / 1e6:.1f} MB ({m['overhead_pct']:.2f} % over weights + KV)")
    if row.get("baseline_errors"):
        lines.append("baseline errors: " + "; ".join(f"{k}: {v}" for k, v in row["baseline_errors"].items()))
    return "\n".join(lines)
