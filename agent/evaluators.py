"""Trial evaluators: one gated trial of a `ScheduleConfig`, and the worker that runs them.

A trial is four stages, each of which can end it:

    lower      ScheduleConfig -> Program            verdict "invalid"   (the lowering refuses)
    validate   Program -> ValidationResult          verdict "rejected"  (+ the violations)
    gate       logits vs a reference                verdict "incorrect" (or "drift" with max_quant_drift)
    measure    latency, p10/p90, floor              verdict "artifact"  (below the physical floor)

and a passing trial has verdict "pass". Every reported latency is gated on a PASS in the
same trial. Two evaluators implement the stages:

* `CpuEvaluator` (tests, CI): the ReferenceVM runs the program on the CPU for the gate, and
  the latency is the analytic `CostModel` (below), deterministic, so p10 = p90 = latency.
* `CudaEvaluator` (the GPU): the megakernel (`amk.vm.loader.CudaVM`) runs the gate on the
  device and is timed per step with CUDA events, interleaved A/B against the incumbent
  (`ab_test`), until a Mann-Whitney U test separates the two or the rounds run out.

The correctness gate (`gate`): teacher-forced logits over a fixed prompt against a
reference at the same precision, max |ours - ref| <= tol[dtype] * max(1, max |ref|), no
NaN, and argmax equal at every position whose reference top-2 margin exceeds that
tolerance (a near-tie may flip within tolerance; those positions are counted as
`ambiguous`). The reference is Hugging Face eager at the program dtype for an unquantized
program; a quantized program is gated against the CPU reference of the same quantized
weights: on the GPU the ReferenceVM of the very program, on the CPU the ReferenceVM of the
canonical program with the same quantization knobs and the default schedule (so the gate
checks that the schedule changed nothing). The quality of a quantized (or re-typed)
program against the unquantized model is reported as `quality` (relative max-abs logits
drift, argmax agreement) and only gated when `max_quant_drift` is set.

The worker (`serve`) is the child process of a campaign: it loads the model once, then
answers evaluate requests over a pipe. Test hooks: `AMK_AUTOTUNE_FAULT="crash@3,hang@5,
corrupt@2,raise@4,slow@1"` makes trial 3 kill its process, trial 5 hang, trial 2 run with a
corrupted weight (a genuinely incorrect program), trial 4 raise and trial 1 take 3 s more.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from amk.schedule import placement
from amk.schedule.config import ScheduleConfig

PASS = "pass"
# verdicts a trial can end with; the last four are set by the campaign, not the evaluator
VERDICTS = ("pass", "invalid", "rejected", "incorrect", "drift", "artifact", "error", "hang",
            "crash", "timeout", "interrupted")
FAULT_ENV = "AMK_AUTOTUNE_FAULT"

# relative logits tolerance of the gate, by program dtype
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
DTYPE_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def config_hash(cfg: ScheduleConfig | dict | None) -> Optional[str]:
    """A stable short hash of a config's fields (the journal's dedup key)."""
    if cfg is None:
        return None
    d = cfg.model_dump(mode="json") if isinstance(cfg, ScheduleConfig) else cfg
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ============================================================================ the cost model
@dataclass(frozen=True)
class CostModel:
    """An analytic latency model of one decode step of a Program, for the CPU evaluator.

    It simulates the persistent blocks: each queue walks its tasks in order; a task is
    ready when every counter it waits on is complete (all its producers finished) plus
    `sync_us` if any producer ran on another queue (one cross-SM hop: release, atomic,
    acquire poll through L2). A task costs `dispatch_us` (fetch, decode, block barrier)
    plus its bytes over the queue's bandwidth share. Weight (immutable) bytes may stream
    before the wait is satisfied when `prefetch_depth >= 1` (and, for a GEMV, its weights are at
    least `prefetch_min_kb`); otherwise they start after it and pay one `mem_latency_us`.
    KV-cache bytes (at the model context) always wait.

        bw_sm  = min(sm_peak_factor * BW / SMs, inflight / mem_latency)     per SM
        inflight = threads_per_block * blocks_per_sm * bytes_per_load * loads_in_flight
        bw_q   = min(bw_sm / blocks_per_sm, BW / queues)                     per queue
        with prefetch: finish = max(free + dispatch + w/bw_q, ready) + kv/bw_q
        without:       finish = max(free + dispatch, ready) + mem_latency + (w + kv)/bw_q

    So the model's terms are the issue's "bytes per queue / per-SM bandwidth share + hops x
    sync latency + tasks x dispatch overhead", with the overlap a real schedule gets. It can
    never beat the floor: bw_q <= BW / queues, so the busiest queue alone takes at least
    total bytes / BW. Knobs that only matter on silicon (quant_unpack, kv_block beyond the
    bytes it rounds) are flat here. Constants are H100-like; relative, not absolute, truth.
    """

    sync_us: float = 0.8
    dispatch_us: float = 0.15
    mem_latency_us: float = 0.6
    sm_peak_factor: float = 3.0
    bytes_per_load: int = 16
    loads_in_flight: int = 4

    def estimate(self, program, ctx: int) -> dict:
        """{latency_us, stream_us (busiest queue's bytes alone), waits_crossed, bw_queue_gbps, ...}."""
        from amk.schedule.ir import DTYPE_BITS, IMMUTABLE_KINDS, BufferKind, KvMode, Op

        tg = program.target
        bw = tg.hbm_gbps * 1e3  # bytes per microsecond
        q_count = max(len(program.queues), 1)
        per_cu = max(program.blocks_per_cu, 1)
        inflight = program.threads_per_block * per_cu * self.bytes_per_load * self.loads_in_flight
        bw_sm = min(self.sm_peak_factor * bw / tg.compute_units, inflight / self.mem_latency_us)
        bw_q = min(bw_sm / per_cu, bw / q_count)
        vm = (program.meta.get("vm") or {}) if isinstance(program.meta, dict) else {}
        prefetch = int(vm.get("prefetch_depth", 1))
        hint_min = int(vm.get("prefetch_min_kb", 0)) * 1024  # GEMV tasks with fewer weight bytes: no hints
        bufs = program.buffers
        pos = max(ctx - 1, 0)

        w_bytes, kv_bytes = [0.0] * len(program.tasks), [0.0] * len(program.tasks)
        for t in program.tasks:
            p = t.params
            # immutable inputs (the loader's measure for prefetch_min_kb too); EMBED reads one row
            w_bytes[t.id] = float(placement.weight_bytes(t, bufs)) if t.op != Op.EMBED else 0.0
            for op in t.inputs:
                b = bufs[op.buf]
                if t.op == Op.EMBED and b.kind in IMMUTABLE_KINDS:
                    w_bytes[t.id] += b.shape[-1] * DTYPE_BITS[b.dtype] / 8  # one row
                elif b.kind == BufferKind.KV_CACHE and op.kv == KvMode.PREFIX:
                    n = pos + 1
                    if t.op == Op.ATTN_PARTIAL:
                        chunk = _ceil_div(_ceil_div(n, p.splits), p.block) * p.block
                        n = max(0, min(n, (p.split + 1) * chunk) - p.split * chunk)
                    kv_bytes[t.id] += n * op.len * DTYPE_BITS[b.dtype] / 8

        producers: dict[int, list[int]] = defaultdict(list)
        queue_of = [-1] * len(program.tasks)
        for qi, q in enumerate(program.queues):
            for tid in q:
                queue_of[tid] = qi
        for t in program.tasks:
            producers[t.out_counter].append(t.id)
        remaining = {c: len(v) for c, v in producers.items()}
        done_at: dict[int, float] = defaultdict(float)
        cross = {c: {queue_of[i] for i in v} for c, v in producers.items()}
        finish = [0.0] * len(program.tasks)
        free = [0.0] * q_count
        head = [0] * len(program.queues)
        blocked: dict[int, list[int]] = defaultdict(list)
        todo = list(range(len(program.queues)))
        crossed = 0
        while todo:
            qi = todo.pop()
            queue = program.queues[qi]
            while head[qi] < len(queue):
                t = program.tasks[queue[head[qi]]]
                unmet = next((w.counter for w in t.waits if remaining.get(w.counter, 0) > 0), None)
                if unmet is not None:
                    blocked[unmet].append(qi)
                    break
                ready, hop = 0.0, False
                for w in t.waits:
                    ready = max(ready, done_at[w.counter])
                    hop = hop or bool(cross[w.counter] - {qi})
                if hop:
                    ready += self.sync_us
                    crossed += 1
                w_t, kv_t = w_bytes[t.id] / bw_q, kv_bytes[t.id] / bw_q
                start = free[qi] + self.dispatch_us
                if prefetch >= 1 and not (t.params.op == Op.GEMV and w_bytes[t.id] < hint_min):
                    end = max(start + w_t, ready) + kv_t
                else:
                    end = max(start, ready) + self.mem_latency_us + w_t + kv_t
                finish[t.id] = free[qi] = end
                head[qi] += 1
                c = t.out_counter
                done_at[c] = max(done_at[c], end)
                remaining[c] -= 1
                if remaining[c] == 0:
                    todo.extend(blocked.pop(c, []))
        if any(head[i] < len(q) for i, q in enumerate(program.queues)):
            raise RuntimeError("cost model: the queues deadlock (the validator should have refused this program)")
        per_queue_bytes = [sum(w_bytes[i] + kv_bytes[i] for i in q) for q in program.queues]
        return {
            "latency_us": max(finish, default=0.0),
            "stream_us": max(per_queue_bytes, default=0.0) / bw_q,
            "waits_crossed": crossed,
            "max_queue_tasks": max((len(q) for q in program.queues), default=0),
            "bw_queue_gbps": bw_q / 1e3,
            "queues": len(program.queues),
            "model": asdict(self),
        }


# ============================================================================ floor and statistics
def floor_guard(latency_us: Optional[float], floor_us: Optional[float], p10_us: Optional[float] = None) -> Optional[str]:
    """Why a latency is a measurement artifact (below bytes / measured bandwidth), or None."""
    if latency_us is None or floor_us is None:
        return None
    worst = min(x for x in (latency_us, p10_us) if x is not None)
    if not worst > 0 or not math.isfinite(worst):
        return f"latency {worst!r} us is not a positive number"
    if worst < floor_us:
        return (f"latency {worst:.3f} us is below the physical floor {floor_us:.3f} us "
                f"(bytes / bandwidth): a measurement artifact, not a result")
    return None


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(p10, median, p90) by linear interpolation."""
    s = sorted(xs)
    if not s:
        return (math.nan,) * 3

    def q(f: float) -> float:
        i = f * (len(s) - 1)
        lo, hi = math.floor(i), math.ceil(i)
        return s[lo] + (s[hi] - s[lo]) * (i - lo)

    return q(0.1), q(0.5), q(0.9)


def mann_whitney(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation, tie-corrected)."""
    n1, n2 = len(a), len(b)
    if n1 < 2 or n2 < 2:
        return 1.0
    allv = sorted([(x, 0) for x in a] + [(x, 1) for x in b])
    ranks = [0.0] * len(allv)
    ties = 0.0
    i = 0
    while i < len(allv):
        j = i
        while j + 1 < len(allv) and allv[j + 1][0] == allv[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = r
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    r1 = sum(r for r, (_, g) in zip(ranks, allv) if g == 0)
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(var)
    return math.erfc(max(z, 0.0) / math.sqrt(2))


def bootstrap_ratio(a: list[float], b: list[float], n: int = 400, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of median(b) / median(a)."""
    rng = random.Random(seed)
    rs = []
    for _ in range(n):
        ra = quantiles([rng.choice(a) for _ in a])[1]
        rb = quantiles([rng.choice(b) for _ in b])[1]
        rs.append(rb / ra)
    lo, _, hi = quantiles(rs)
    return lo, hi


# ============================================================================ the model, loaded once
@dataclass
class EvalOptions:
    context: Optional[int] = None  # KV positions attended in the timed/modelled step (None: min(kv_capacity, 512))
    prompt_len: int = 8
    max_quant_drift: Optional[float] = None
    cost_model: CostModel = field(default_factory=CostModel)
    device: str = "cuda"
    # CUDA timing: rounds of `steps_per_round` steps per side, interleaved ABBA
    steps_per_round: int = 20
    min_rounds: int = 3
    max_rounds: int = 12
    alpha: float = 0.01
    min_effect: float = 0.005  # a "faster" candidate must be at least 0.5% faster
    step_timeout_s: float = 10.0
    vm_cache: int = 3

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "EvalOptions":
        d = dict(d or {})
        if isinstance(d.get("cost_model"), dict):
            d["cost_model"] = CostModel(**d["cost_model"])
        return cls(**d)


class ModelContext:
    """The model of a campaign (spec + source weights), the target, and cached references."""

    def __init__(self, init: dict):
        from amk.schedule.importer import load_model
        from amk.schedule.targets import get_target

        self.init = init
        self.spec, self.weights = load_model(init.get("model"), random_init=init.get("random_init", False),
                                             seed=init.get("seed", 0), dtype=init.get("dtype"))
        self.target = get_target(init.get("target"))
        self.kv_capacity = int(init.get("kv_capacity", 512))
        self.options = EvalOptions.from_dict(init.get("options"))
        ctx = self.options.context or min(self.kv_capacity, 512)
        self.context = max(1, min(ctx, self.kv_capacity))
        rng = random.Random(1234)
        n = max(1, min(self.options.prompt_len, self.kv_capacity))
        self.prompt = [rng.randrange(self.spec.vocab_size) for _ in range(n)]
        self._hf: dict[str, Any] = {}
        self._canonical: dict[str, Any] = {}

    def warm(self) -> None:
        """Build the HF reference of the model dtype and load the validator's compiled checks
        now, so that neither is charged to a trial's timeout."""
        from amk.eval.synthetic import warm_validator

        warm_validator()
        self.hf_logits(self.spec.dtype)

    def model_key(self) -> str:
        """What performance depends on: shapes, dtype, KV capacity and context (not the name or weights)."""
        d = self.spec.model_dump(mode="json", exclude={"name", "hf_config"})
        d.update(kv_capacity=self.kv_capacity, context=self.context, dtype_arg=self.init.get("dtype"))
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def info(self) -> dict:
        s = self.spec
        return {"model": s.name, "model_key": self.model_key(), "family": s.family, "layers": s.num_layers,
                "hidden": s.hidden_size, "vocab": s.vocab_size, "dtype": s.dtype, "target": self.target.name,
                "kv_capacity": self.kv_capacity, "context": self.context, "prompt": self.prompt}

    def program_dtype(self, cfg: ScheduleConfig) -> str:
        return cfg.dtype or self.spec.dtype

    def hf_logits(self, dtype: str):
        """Teacher-forced HF eager logits over the prompt at `dtype` (fp32 tensor), cached."""
        if dtype not in self._hf:
            from amk.eval.oracle import hf_logits
            from amk.schedule.importer import build_hf_model

            model = build_hf_model(self.spec, self.weights, dtype=dtype)
            self._hf[dtype] = hf_logits(model, self.prompt)
            del model
        return self._hf[dtype]

    def lower(self, cfg: ScheduleConfig):
        from amk.schedule.lower import lower

        return lower(self.spec, cfg, self.target, kv_capacity=self.kv_capacity)

    def bind(self, program):
        from amk.schedule.lower import bind_weights

        return bind_weights(program, self.spec, self.weights)

    def canonical_quant_logits(self, cfg: ScheduleConfig):
        """ReferenceVM logits of the default-schedule program with `cfg`'s quantization knobs."""
        canon = ScheduleConfig(quant=cfg.quant, quant_group=cfg.quant_group, quant_asym=cfg.quant_asym,
                               quant_lm_head=cfg.quant_lm_head, dtype=cfg.dtype, max_queues=cfg.max_queues)
        key = config_hash(canon)
        if key not in self._canonical:
            from amk.vm.reference import ReferenceVM

            prog = self.lower(canon)
            self._canonical[key] = ReferenceVM(prog, self.bind(prog)).logits_for(self.prompt)
        return self._canonical[key]

    def quality(self, cfg: ScheduleConfig, logits) -> Optional[dict]:
        """Drift of a quantized / re-typed program from the unquantized model at its own dtype."""
        if cfg.quant == "none" and (cfg.dtype is None or cfg.dtype == self.spec.dtype):
            return None
        ref = self.hf_logits(self.spec.dtype)
        scale = max(1.0, float(ref.abs().max()))
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
        return {"vs": f"hf-eager {self.spec.dtype} unquantized", "drift_rel": float((logits - ref).abs().max()) / scale,
                "argmax_agree": float(agree)}


def gate(ours, ref, dtype: str) -> dict:
    """The correctness gate: {ok, max_abs_err, tol, argmax_mismatch, ambiguous, reasons}."""
    import torch

    ours, ref = ours.float().cpu(), ref.float().cpu()
    reasons = []
    if ours.shape != ref.shape:
        return {"ok": False, "reasons": [f"logits shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"]}
    scale = max(1.0, float(ref.abs().max()))
    tol = TOLERANCE.get(dtype, 1e-3) * scale
    finite = bool(torch.isfinite(ours).all())
    err = float((ours - ref).abs().max()) if finite else math.inf
    top2 = ref.topk(2, dim=-1).values if ref.shape[-1] > 1 else torch.cat([ref, ref - 1], -1)
    clear = (top2[:, 0] - top2[:, 1]) > tol
    mismatch = (ours.argmax(-1) != ref.argmax(-1)) & clear
    if not finite:
        reasons.append("logits contain NaN/Inf")
    elif err > tol:
        reasons.append(f"logits max-abs error {err:.3g} > tolerance {tol:.3g} ({dtype})")
    if int(mismatch.sum()):
        reasons.append(f"argmax differs at {int(mismatch.sum())} of {len(ref)} positions")
    return {"ok": not reasons, "max_abs_err": err, "tol": tol, "argmax_mismatch": int(mismatch.sum()),
            "ambiguous": int((~clear).sum()), "reasons": reasons}


# ============================================================================ evaluators
def _faults() -> dict[int, str]:
    out = {}
    for part in filter(None, (os.environ.get(FAULT_ENV) or "").split(",")):
        kind, _, n = part.strip().partition("@")
        if n.strip().isdigit():
            out[int(n)] = kind.strip()
    return out


def fault_for(trial: Optional[int]) -> Optional[str]:
    return _faults().get(trial) if trial is not None else None


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:500]


class Evaluator:
    """One gated trial: `evaluate(config, trial=, parent=, best=) -> result dict` (see module doc)."""

    kind = "base"

    def __init__(self, ctx: ModelContext):
        self.ctx = ctx
        self.options = ctx.options

    def info(self) -> dict:
        return {"evaluator": self.kind, "device": self.device_name()}

    def device_name(self) -> str:
        return self.kind

    # -- shared stages -------------------------------------------------------------------
    def _compile(self, cfg: ScheduleConfig, res: dict):
        """Lower + validate; on failure fills res and returns None."""
        from amk.schedule.validate import validate

        try:
            program = self.ctx.lower(cfg)
        except (ValueError, AssertionError, KeyError) as exc:
            res.update(verdict="invalid", violations=[f"lowering refused: {_one_line(exc)}"])
            return None
        result = validate(program)
        if not result.accepted:
            res.update(verdict="rejected", violations=[f"[{v.check}] {v.reason}" for v in result.violations[:20]])
            return None
        from amk.schedule.stats import program_stats

        stats = program_stats(program)
        res["stats"] = {k: stats[k] for k in ("tasks", "counters", "waits", "queues", "max_queue_len",
                                              "max_hops_per_layer", "weight_bytes", "streamed_bytes")}
        res["program_hash"] = result.certificate.program_hash if result.certificate else None
        res["resolved"] = program.meta.get("resolved") if isinstance(program.meta, dict) else None
        if len(program.tasks) <= 50_000:
            q = [0] * len(program.tasks)
            for qi, tasks in enumerate(program.queues):
                for tid in tasks:
                    q[tid] = qi
            res["queue_of"] = q
        return program, result

    def _step_bytes(self, program, cfg: ScheduleConfig) -> int:
        from amk.eval.roofline import step_bytes

        return int(step_bytes(self.ctx.spec, self.ctx.program_dtype(cfg), self.ctx.context, program)["total"])

    def _reference(self, cfg: ScheduleConfig, program, tensors):
        raise NotImplementedError

    def _gate(self, cfg: ScheduleConfig, logits, ref, ref_name: str, res: dict) -> bool:
        g = gate(logits, ref, self.ctx.program_dtype(cfg))
        g["reference"] = ref_name
        res["gate"] = g
        q = self.ctx.quality(cfg, logits.float().cpu())
        if q is not None:
            res["quality"] = q
        if not g["ok"]:
            res.update(verdict="incorrect", violations=list(g["reasons"]))
            return False
        lim = self.options.max_quant_drift
        if q is not None and lim is not None and q["drift_rel"] > lim:
            res.update(verdict="drift", violations=[f"quantization drift {q['drift_rel']:.3g} > --max-quant-drift {lim:g}"])
            return False
        return True

    def evaluate(self, cfg: ScheduleConfig, *, trial: Optional[int] = None, parent: Optional[ScheduleConfig] = None,
                 best: Optional[ScheduleConfig] = None) -> dict:
        raise NotImplementedError


def _corrupt(tensors: dict) -> None:
    """Fault hook: scale one float weight so the program computes a different function."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() == 2 and "embed" not in name:
            tensors[name] = t * 1.5 + 0.05 * torch.ones_like(t)
            return


class CpuEvaluator(Evaluator):
    """ReferenceVM correctness on the CPU plus the analytic `CostModel` as the latency."""

    kind = "cpu"

    def device_name(self) -> str:
        return f"cost-model:{self.ctx.target.name}"

    def info(self) -> dict:
        return {**super().info(), "bandwidth_gbps": self.ctx.target.hbm_gbps, "bandwidth_source": "target spec",
                "cost_model": asdict(self.options.cost_model)}

    def evaluate(self, cfg, *, trial=None, parent=None, best=None) -> dict:
        from amk.vm.reference import ReferenceVM

        t0 = time.perf_counter()
        res: dict[str, Any] = {"verdict": PASS, "violations": []}
        compiled = self._compile(cfg, res)
        if compiled is None:
            return res
        program, validation = compiled
        tensors = self.ctx.bind(program)
        if fault_for(trial) == "corrupt":
            _corrupt(tensors)
        logits = ReferenceVM(program, tensors, validation=validation).logits_for(self.ctx.prompt)
        if cfg.quant == "none":
            dt = self.ctx.program_dtype(cfg)
            ref, ref_name = self.ctx.hf_logits(dt), f"hf-eager {dt}"
        else:
            ref, ref_name = self.ctx.canonical_quant_logits(cfg), "reference-vm, same quantization, default schedule"
        if not self._gate(cfg, logits, ref, ref_name, res):
            return res
        est = self.options.cost_model.estimate(program, self.ctx.context)
        lat = est.pop("latency_us")
        res.update(latency_us=lat, p10_us=lat, p90_us=lat, cost=est,
                   floor_us=self._step_bytes(program, cfg) / (self.ctx.target.hbm_gbps * 1e3),
                   seconds=time.perf_counter() - t0)
        return res


class CudaEvaluator(Evaluator):
    """The megakernel on the GPU: gate on the device, per-step CUDA-event timing, A/B."""

    kind = "cuda"

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the cuda evaluator needs a CUDA GPU (torch.cuda.is_available() is False)")
        self.device = torch.device(self.options.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.bandwidth_gbps, self.bandwidth_source = self._bandwidth()
        self._vms: OrderedDict[str, Any] = OrderedDict()

    def _bandwidth(self) -> tuple[float, str]:
        try:
            from amk.eval.peak_bandwidth import measure_bandwidth

            return float(measure_bandwidth(device=str(self.device))), "amk.eval.peak_bandwidth (2 GiB copy, median)"
        except ImportError:
            import torch

            n = (1 << 30) // 4
            src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=self.device)
            dst = torch.empty_like(src)
            best = 0.0
            for _ in range(8):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                dst.copy_(src)
                e.record()
                e.synchronize()
                best = max(best, 2 * n * 4 / (s.elapsed_time(e) * 1e-3) / 1e9)
            del src, dst
            return best, "1 GiB copy, best of 8"

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name(self.device)

    def info(self) -> dict:
        return {**super().info(), "bandwidth_gbps": self.bandwidth_gbps, "bandwidth_source": self.bandwidth_source}

    # -- VMs -------------------------------------------------------------------------------
    def _entry(self, cfg: ScheduleConfig, res: dict, trial: Optional[int] = None):
        """(program, validation, vm) of cfg, cached (LRU); None with res filled on failure."""
        key = config_hash(cfg)
        if key in self._vms and fault_for(trial) != "corrupt":
            self._vms.move_to_end(key)
            program, validation, vm, extra = self._vms[key]
            res.update(extra)
            return program, validation, vm
        compiled = self._compile(cfg, res)
        if compiled is None:
            return None
        program, validation = compiled
        from amk.vm.loader import CudaVM

        tensors = self.ctx.bind(program)
        if fault_for(trial) == "corrupt":
            _corrupt(tensors)
        vm = CudaVM(program, tensors, device=str(self.device), validation=validation,
                    timeout_s=self.options.step_timeout_s)
        extra = {k: res[k] for k in ("stats", "program_hash", "resolved", "queue_of") if k in res}
        self._vms[key] = (program, validation, vm, extra)
        while len(self._vms) > self.options.vm_cache:
            _, (_, _, old, _) = self._vms.popitem(last=False)
            try:
                old.close()
            except Exception:
                pass
        return program, validation, vm

    def _step_times(self, vm, n: int, pos0: int) -> list[float]:
        """n back-to-back decode steps at positions pos0.., each timed with CUDA events (us)."""
        import torch

        cap = vm.program.kv_capacity
        window = max(1, min(16, cap - pos0)) if cap else 16
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        if hasattr(vm, "_launch") and hasattr(vm, "_finish"):
            events = []
            for i in range(n):
                starts[i].record()
                events.append(vm._launch(1 + i % 7, pos0 + i % window))
                ends[i].record()
            vm._finish(events)
        else:  # the public interface: each step syncs; still timed on the device
            for i in range(n):
                starts[i].record()
                vm.step(1 + i % 7, pos0 + i % window)
                ends[i].record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    def _timing_pos(self) -> int:
        return max(0, min(self.ctx.context, self.ctx.kv_capacity) - 16)

    def ab_test(self, vm_a, vm_b) -> dict:
        """Interleaved A/B (ABBA rounds) until Mann-Whitney separates them or max_rounds.

        The sequential test looks after every round from min_rounds on, at alpha /
        max_rounds (Bonferroni over the looks), so repeated looking does not inflate false
        "faster" verdicts. decision: faster (b beats a by > min_effect), slower, or same."""
        o = self.options
        pos0 = self._timing_pos()
        a: list[float] = []
        b: list[float] = []
        for vm in (vm_a, vm_b):  # warm-up, untimed
            self._step_times(vm, 3, pos0)
        p = 1.0
        rounds = 0
        for r in range(o.max_rounds):
            rounds = r + 1
            order = (vm_a, vm_b) if r % 2 == 0 else (vm_b, vm_a)
            for vm in order:
                (a if vm is vm_a else b).extend(self._step_times(vm, o.steps_per_round, pos0))
            if rounds >= o.min_rounds:
                p = mann_whitney(a, b)
                if p < o.alpha / o.max_rounds:
                    break
        ma, mb = quantiles(a)[1], quantiles(b)[1]
        ratio = mb / ma if ma > 0 else math.inf
        sig = p < o.alpha / o.max_rounds
        decision = "same"
        if sig and ratio < 1 - o.min_effect:
            decision = "faster"
        elif sig and ratio > 1 + o.min_effect:
            decision = "slower"
        lo, hi = bootstrap_ratio(a, b)
        return {"decision": decision, "ratio": ratio, "ratio_ci90": [lo, hi], "p_value": p, "rounds": rounds,
                "samples": len(b), "a_median_us": ma, "b_median_us": mb, "_b": b}

    def evaluate(self, cfg, *, trial=None, parent=None, best=None) -> dict:
        from amk.vm.loader import VMError, VMHangError
        from amk.vm.reference import ReferenceVM

        t0 = time.perf_counter()
        res: dict[str, Any] = {"verdict": PASS, "violations": []}
        try:
            entry = self._entry(cfg, res, trial)
            if entry is None:
                return res
            program, validation, vm = entry
            logits = vm.logits_for(self.ctx.prompt).float().cpu()
            if cfg.quant == "none":
                dt = self.ctx.program_dtype(cfg)
                ref, ref_name = self.ctx.hf_logits(dt), f"hf-eager {dt}"
            else:
                ref = ReferenceVM(program, self.ctx.bind(program), validation=validation).logits_for(self.ctx.prompt)
                ref_name = "reference-vm, same program"
            if not self._gate(cfg, logits, ref, ref_name, res):
                self._vms.pop(config_hash(cfg), None)
                return res
            samples: list[float] = []
            ab: dict[str, dict] = {}
            done: dict[str, dict] = {}
            for role, other in (("parent", parent), ("best", best)):
                h = config_hash(other)
                if other is None or h == config_hash(cfg):
                    continue
                if h in done:
                    ab[role] = done[h]
                    continue
                scratch: dict = {}
                other_entry = self._entry(other, scratch)
                if other_entry is None:
                    continue
                r = self.ab_test(other_entry[2], vm)
                samples += r.pop("_b")
                ab[role] = done[h] = r
            if not samples:
                self._step_times(vm, 3, self._timing_pos())
                for _ in range(self.options.min_rounds):
                    samples += self._step_times(vm, self.options.steps_per_round, self._timing_pos())
            p10, med, p90 = quantiles(samples)
            res.update(latency_us=med, p10_us=p10, p90_us=p90, samples=len(samples), ab=ab,
                       floor_us=self._step_bytes(program, cfg) / (self.bandwidth_gbps * 1e3),
                       seconds=time.perf_counter() - t0)
            return res
        except VMHangError as exc:
            res.update(verdict="hang", violations=[_one_line(exc)], restart=True)
        except (VMError, RuntimeError) as exc:
            res.update(verdict="error", violations=[_one_line(exc)], restart=True)
        self._vms.clear()
        return res


EVALUATORS = {"cpu": CpuEvaluator, "cuda": CudaEvaluator}


def make_evaluator(kind: str, ctx: ModelContext) -> Evaluator:
    """'cpu', 'cuda', or 'package.module:Class' (a custom Evaluator subclass)."""
    if kind in EVALUATORS:
        return EVALUATORS[kind](ctx)
    if ":" in kind:
        import importlib

        mod, _, name = kind.partition(":")
        return getattr(importlib.import_module(mod), name)(ctx)
    raise ValueError(f"unknown evaluator {kind!r}; use cpu or cuda")


def run_trial(evaluator: Evaluator, msg: dict) -> dict:
    """One request: apply the fault hooks, evaluate, never raise."""
    trial = msg.get("trial")
    fault = fault_for(trial)
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
        os._exit(139)
    if fault == "hang":
        while True:
            time.sleep(3600)
    if fault == "slow":  # a trial that takes a few seconds: a window for the tests' stop signals
        time.sleep(3.0)
    cfg = ScheduleConfig.model_validate(msg["config"])
    parent = ScheduleConfig.model_validate(msg["parent"]) if msg.get("parent") else None
    best = ScheduleConfig.model_validate(msg["best"]) if msg.get("best") else None
    try:
        if fault == "raise":
            raise RuntimeError("injected fault (AMK_AUTOTUNE_FAULT)")
        return evaluator.evaluate(cfg, trial=trial, parent=parent, best=best)
    except Exception as exc:
        return {"verdict": "error", "violations": [_one_line(exc)], "restart": True,
                "traceback": traceback.format_exc()[-4000:]}


# ============================================================================ the worker process
def _watch_parent(pid: int) -> None:
    """Exit when the campaign process dies (a killed campaign must not leave a hung trial).
    The campaign's pid, not getppid(): under a forkserver the parent is the server, which
    lives as long as any of its children."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


def serve(conn, init: dict) -> None:
    """Worker main: load the model, reply {ok, info}, then answer evaluate requests."""
    if init.get("env") is not None:
        os.environ.clear()
        os.environ.update(init["env"])
    campaign_pid = int(init.get("campaign_pid") or os.getppid())
    # Ctrl-C, `timeout` and `kill -- -PGID` signal the whole process group: stopping is the
    # campaign's to handle (it finishes or aborts the trial in flight, then ends this worker;
    # _watch_parent ends it if the campaign dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.dup2(2, 1)  # stray prints must not reach the campaign's stdout (--json)
        sys.stdout = sys.stderr
    except OSError:
        pass
    threading.Thread(target=_watch_parent, args=(campaign_pid,), daemon=True).start()
    try:
        ctx = ModelContext(init)
        ev = make_evaluator(init.get("evaluator", "cpu"), ctx)
        ctx.warm()
        conn.send({"ok": True, "info": {**ctx.info(), **ev.info()}})
    except BaseException as exc:  # report, then exit: the campaign decides
        conn.send({"ok": False, "error": _one_line(exc), "traceback": traceback.format_exc()[-4000:]})
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg.get("cmd") == "stop":
            return
        conn.send(run_trial(ev, msg))
