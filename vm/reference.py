"""ReferenceVM: a Program executed on the CPU, the oracle every GPU run is judged by.

It simulates the persistent blocks for real: each queue is a block walking its tasks in
order; a queue head runs only once every wait `counter >= threshold` holds; a finished
task stores its outputs (rounded to the buffer dtype) and adds 1 to its out_counter.
Op semantics come from `amk.instructions.semantics`, operand addressing from
`amk.vm.regions`. Before each step every ACTIVATION / SCRATCH / IO buffer is filled with
poison (NaN, or a sentinel integer) so a read of something the step never wrote shows.
KV caches persist across steps until `reset()` (which poisons them too).

Memory is one flat tensor per buffer in its dtype; U4 weights are held unpacked, one code
per byte, so a U4 operand indexes logical elements like any other buffer.
"""

from __future__ import annotations

import importlib
import random
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

from amk.instructions.semantics import apply, dequantize, rounding_points, unpack_u4
from amk.schedule.ir import (
    IMMUTABLE_KINDS,
    Buffer,
    BufferKind,
    DType,
    Op,
    Operand,
    Program,
    Task,
    ValidationResult,
)
from amk.schedule.opspec import output_roles, weight_input_roles
from amk.vm.bindings import TORCH_DTYPE, bound_tensor_mismatch
from amk.vm.progress import StepProgress
from amk.vm.regions import RegionError, is_kv, region

# what an unwritten element reads as: NaN for floats, an impossible value for integers
POISON = {DType.F32: float("nan"), DType.F16: float("nan"), DType.BF16: float("nan"),
          DType.I32: -(2**31), DType.I8: -128, DType.U4: 255}
QUANTIZED = (DType.I8, DType.U4)


class DeadlockError(RuntimeError):
    """No queue head can run but tasks remain."""


@dataclass
class _Arg:
    """One operand bound to VM memory: a fixed view, or (KV) rebuilt per position."""

    role: str
    operand: Operand
    buf: Buffer
    fixed: Optional[torch.Tensor] = None  # the view (fp32 for immutable floats), None for KV


@dataclass
class _Bound:
    task: Task
    inputs: list[_Arg]
    outputs: list[_Arg]
    extra: dict = field(default_factory=dict)  # GEMV: the quantization group
    rounding: dict = field(default_factory=dict)  # the op's half-precision rounders (semantics.rounding_points)


def _refuse_if_rejected(program: Program, validation: Optional[ValidationResult], check: bool) -> None:
    """Refuse a rejected program. Without a given result, run the validator when
    `check` and the module exists (`amk.schedule.validate`)."""
    if validation is None and check:
        try:
            mod = importlib.import_module("amk.schedule.validate")
        except ModuleNotFoundError as e:
            if e.name != "amk.schedule.validate":
                raise
            mod = None
        if mod is not None:
            validation = mod.validate(program)
    if validation is not None and not validation.accepted:
        raise ValueError(f"ReferenceVM refuses program {program.name!r}: {validation.summary()}")


class ReferenceVM:
    def __init__(self, program: Program, tensors: dict[str, torch.Tensor], *,
                 validation: Optional[ValidationResult] = None, check: bool = True,
                 cache_weights: bool = True, threads: Optional[int] = 1):
        """`tensors`: buffer name -> contents of every WEIGHT and CONST buffer (I8 as int8,
        U4 as uint8 packed two per byte). `validation`: a result to honour instead of
        running the validator; `check=False` skips validation (tests of broken programs).
        `cache_weights`: dequantize each GEMV's quantized weight tile once, here.
        `threads`: torch intra-op threads while a step runs (restored after). 1 keeps the
        results independent of the machine and the many tiny ops clear of thread
        oversubscription (a loaded 2-core box ran 4x slower with 2); None leaves torch's."""
        _refuse_if_rejected(program, validation, check)
        self.program = program
        self.threads = threads
        self.buffers: dict[int, Buffer] = {b.id: b for b in program.buffers}
        self.mem: dict[int, torch.Tensor] = {}
        self._f32: dict[int, torch.Tensor] = {}  # fp32 copies of immutable float buffers
        self._load(tensors)
        self._tasks: dict[int, _Bound] = {t.id: self._bind(t, cache_weights) for t in program.tasks}
        self._check_queues()
        self._by_name = {b.name: b for b in program.buffers}
        self.last_order: list[int] = []  # task ids in the order the last step ran them
        self.reset()

    # ------------------------------------------------------------------ memory
    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        problem = bound_tensor_mismatch(self.program, tensors.keys())
        if problem:
            raise ValueError(problem)
        for b in self.program.buffers:
            if b.kind in IMMUTABLE_KINDS:
                self.mem[b.id] = self._immutable(b, tensors[b.name])
                if self.mem[b.id].is_floating_point():
                    self._f32[b.id] = self.mem[b.id].to(torch.float32)
            else:
                self.mem[b.id] = torch.empty(b.numel, dtype=TORCH_DTYPE[b.dtype])

    @staticmethod
    def _immutable(b: Buffer, t: torch.Tensor) -> torch.Tensor:
        want = TORCH_DTYPE[b.dtype]
        if t.dtype != want:
            raise ValueError(f"buffer {b.name} is {b.dtype.name}: expected a {want} tensor, got {t.dtype}")
        flat = t.detach().contiguous().reshape(-1)
        if b.dtype == DType.U4:
            return unpack_u4(flat, b.numel)
        if flat.numel() != b.numel:
            raise ValueError(f"buffer {b.name} has {b.numel} elements, tensor has {flat.numel()}")
        return flat

    def _poison(self, kinds) -> None:
        for b in self.program.buffers:
            if b.kind in kinds:
                self.mem[b.id].fill_(POISON[b.dtype])

    def reset(self) -> None:
        """Forget the KV cache (poisoned, so reading a row never appended shows)."""
        self._poison({BufferKind.KV_CACHE})

    def read_buffer(self, name: str) -> torch.Tensor:
        """A buffer's current contents (flat, its dtype; U4 unpacked), for inspection."""
        return self.mem[self._by_name[name].id].clone()

    # ------------------------------------------------------------------ binding
    def _bind(self, task: Task, cache_weights: bool) -> _Bound:
        """Resolve a task's operands to views once; only KV operands move per step."""
        p = task.params
        wb = self.buffers[task.inputs[0].buf] if p.op == Op.GEMV and task.inputs else None
        wdtype = wb.dtype if wb is not None else DType.F32
        iroles, oroles = weight_input_roles(p, wb), output_roles(p)
        where = f"task {task.id} {task.name!r} ({p.op.name})"
        if len(iroles) != len(task.inputs) or len(oroles) != len(task.outputs):
            raise ValueError(f"{where}: operands {len(task.inputs)} in / {len(task.outputs)} out, "
                             f"roles {iroles} / {oroles}")
        try:
            ins = [self._arg(r, o) for r, o in zip(iroles, task.inputs)]
            outs = [self._arg(r, o) for r, o in zip(oroles, task.outputs)]
        except (RegionError, KeyError) as e:
            raise ValueError(f"{where}: {e}") from e
        for a in outs:
            if a.buf.kind in IMMUTABLE_KINDS or a.buf.kind == BufferKind.IO_INPUT:
                raise ValueError(f"{where}: writes read-only buffer {a.buf.name}")
            if a.fixed is not None and region(a.operand, a.buf).overlapping:
                raise ValueError(f"{where}: output region on {a.buf.name} overlaps itself")
        bound = _Bound(task, ins, outs, rounding=rounding_points(
            p, {a.role: TORCH_DTYPE[a.buf.dtype] for a in ins}, [TORCH_DTYPE[a.buf.dtype] for a in outs]))
        if p.op == Op.GEMV and wdtype in QUANTIZED:
            self._bind_quantized(bound, where, cache_weights)
        return bound

    def _arg(self, role: str, op: Operand) -> _Arg:
        buf = self.buffers[op.buf]
        if is_kv(buf):
            region(op, buf, 0)  # check the static part (columns, mode) now
            return _Arg(role, op, buf)
        src = self._f32.get(buf.id, self.mem[buf.id])
        view = region(op, buf).view(src)
        return _Arg(role, op, buf, view[0] if op.count == 1 else view)  # [len] or [count, len]

    def _bind_quantized(self, bound: _Bound, where: str, cache: bool) -> None:
        """Check the scale/zero companions; optionally dequantize the weight tiles now
        (weights are immutable, so doing it once gives the same values every step)."""
        args = {a.role: a for a in bound.inputs}
        p = bound.task.params
        w = args["w"].buf
        for mat in ("w", "w2"):
            if mat not in args:
                continue
            wb = args[mat].buf
            if wb.group is None or wb.scale is None or (wb.dtype == DType.U4 and wb.zero is None):
                raise ValueError(f"{where}: quantized {wb.name} lacks group/scale/zero")
            if args[f"{mat}_scale"].buf.id != wb.scale or (f"{mat}_zero" in args and args[f"{mat}_zero"].buf.id != wb.zero):
                raise ValueError(f"{where}: {mat} companions are not {wb.name}'s scale/zero buffers")
            if wb.group != w.group:
                raise ValueError(f"{where}: w and w2 differ in group size")
        bound.extra["group"] = w.group
        if not cache:
            return
        drop = set()
        for mat in ("w", "w2"):
            if mat in args:
                z = args.get(f"{mat}_zero")
                codes = args[mat].fixed.reshape(p.rows, p.k_hi - p.k_lo)
                args[mat].fixed = dequantize(codes, args[f"{mat}_scale"].fixed,
                                             z.fixed if z else None, group=w.group, k_lo=p.k_lo)
                drop |= {f"{mat}_scale", f"{mat}_zero"}
        bound.inputs = [a for a in bound.inputs if a.role not in drop]
        bound.extra = {}

    def _check_queues(self) -> None:
        seen = [tid for q in self.program.queues for tid in q]
        if sorted(seen) != sorted(self._tasks):
            raise ValueError("queues must list every task exactly once")
        counters = {c.id for c in self.program.counters}
        for b in self._tasks.values():
            used = [b.task.out_counter] + [w.counter for w in b.task.waits]
            if not set(used) <= counters:
                raise ValueError(f"task {b.task.id} {b.task.name!r} uses undeclared counters {set(used) - counters}")

    # ------------------------------------------------------------------ execution
    def _kv_view(self, a: _Arg, pos: int) -> torch.Tensor:
        """A KV operand's view at this step's position ([1, len] APPEND, [pos+1, len] PREFIX)."""
        return region(a.operand, a.buf, pos).view(self.mem[a.buf.id])

    def _run_task(self, b: _Bound, pos: int) -> None:
        inputs = {a.role: (a.fixed if a.fixed is not None else self._kv_view(a, pos)) for a in b.inputs}
        results = apply(b.task.params, inputs, **b.extra, **b.rounding)
        for a, val in zip(b.outputs, results):
            dst = a.fixed if a.fixed is not None else self._kv_view(a, pos)
            if val.shape != dst.shape:
                if val.numel() != dst.numel():
                    t = b.task
                    raise ValueError(f"task {t.id} {t.name!r}: {a.role} has {val.numel()} values for a region of {dst.numel()}")
                val = val.reshape(dst.shape)
            dst.copy_(val)  # rounds to the buffer dtype

    def _execute(self, pos: int, order: str, seed: Optional[int]) -> None:
        """Walk the queues as persistent blocks would. Event-driven: a queue whose head
        waits sits on the first counter it lacks and is re-checked when that counter moves."""
        if order not in ("queue", "random"):
            raise ValueError(f"order must be 'queue' or 'random', got {order!r}")
        rng = random.Random(seed) if order == "random" else None
        queues, tasks = self.program.queues, self._tasks
        counters = {c.id: 0 for c in self.program.counters}
        heads = [0] * len(queues)
        ready: deque[int] = deque()
        # counter -> threshold -> queues whose head lacks exactly that; counters move by 1,
        # so a queue is woken once, when its counter reaches the threshold it sits on
        blocked: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))

        def admit(q: int) -> None:
            if heads[q] == len(queues[q]):
                return
            for w in tasks[queues[q][heads[q]]].task.waits:
                if counters[w.counter] < w.threshold:
                    blocked[w.counter][w.threshold].append(q)
                    return
            ready.append(q)

        for q in range(len(queues)):
            admit(q)
        self.last_order = order_run = []
        while ready:
            if rng is None:
                q = ready.popleft()  # round-robin: a queue that ran goes to the back
            else:
                i = rng.randrange(len(ready))
                ready[i], ready[-1] = ready[-1], ready[i]
                q = ready.pop()
            bound = tasks[queues[q][heads[q]]]
            self._run_task(bound, pos)
            order_run.append(bound.task.id)
            heads[q] += 1
            c = bound.task.out_counter
            counters[c] += 1
            waiting = blocked.get(c)
            if waiting:
                for waiter in waiting.pop(counters[c], ()):
                    admit(waiter)
            admit(q)
        if any(h < len(qu) for h, qu in zip(heads, queues)):
            raise DeadlockError(self._stuck(heads, counters))

    def _stuck(self, heads: list[int], counters: dict[int, int]) -> str:
        lines = []
        for q, (h, qu) in enumerate(zip(heads, self.program.queues)):
            if h < len(qu):
                t = self._tasks[qu[h]].task
                lacks = ", ".join(f"counter {w.counter} >= {w.threshold} (is {counters[w.counter]})"
                                  for w in t.waits if counters[w.counter] < w.threshold)
                lines.append(f"  queue {q}: task {t.id} {t.name!r} waits {lacks}")
        return f"deadlock after {len(self.last_order)} tasks; stuck queue heads:\n" + "\n".join(lines)

    @contextmanager
    def _torch_threads(self):
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def run_step(self, token: int, pos: int, *, order: str = "queue", seed: Optional[int] = None) -> dict[str, torch.Tensor]:
        """One decode step: write `token`/`pos`, run every task, return the IO_OUTPUT
        buffers by name (copies, shaped as declared). `order="random"` picks a random
        runnable queue head at each step of the simulation (seeded)."""
        cap = self.program.kv_capacity
        if pos < 0 or (cap and pos >= cap):
            raise ValueError(f"position {pos} outside [0, kv_capacity={cap})")
        self._poison({BufferKind.ACTIVATION, BufferKind.SCRATCH, BufferKind.IO_OUTPUT, BufferKind.IO_INPUT})
        for name, value in (("token", token), ("pos", pos)):
            b = self._by_name.get(name)
            if b is not None and b.kind == BufferKind.IO_INPUT:
                self.mem[b.id][0] = value
        with self._torch_threads():
            self._execute(pos, order, seed)
        return {b.name: self.mem[b.id].clone().reshape(b.shape) for b in self.program.buffers
                if b.kind == BufferKind.IO_OUTPUT}

    # ------------------------------------------------------------------ decoding
    @staticmethod
    def _step_seeds(order: str, seed: Optional[int]):
        """Per-step seeds drawn from one generator, so one seed fixes a whole run."""
        rng = random.Random(seed)
        while True:
            yield rng.getrandbits(63) if order == "random" else None

    @staticmethod
    def _next_token(out: dict[str, torch.Tensor]) -> int:
        if "next_token" in out:
            return int(out["next_token"].reshape(-1)[0])
        if "logits" in out:
            return int(torch.argmax(out["logits"].float().reshape(-1)))
        raise KeyError("program has neither a `next_token` nor a `logits` output")

    def _check_steps(self, steps: int) -> None:
        cap = self.program.kv_capacity
        if cap and steps > cap:
            raise ValueError(f"{steps} steps exceed kv_capacity {cap}")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, order: str = "queue",
                 seed: Optional[int] = None, progress: bool = False) -> list[int]:
        """Greedy decoding from an empty cache: the prompt one token per step (pos 0..),
        then the program's own `next_token`. Returns the max_new_tokens new ids."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_new_tokens <= 0:
            return []
        steps = len(prompt_ids) + max_new_tokens - 1  # the last new token is never fed back
        self._check_steps(steps)
        self.reset()
        seeds = self._step_seeds(order, seed)
        new: list[int] = []
        bar = StepProgress("step", steps, progress)
        for pos in range(steps):
            token = prompt_ids[pos] if pos < len(prompt_ids) else new[-1]
            out = self.run_step(token, pos, order=order, seed=next(seeds))
            if pos >= len(prompt_ids) - 1:
                new.append(self._next_token(out))
            bar.tick()
        bar.close()
        return new

    def logits_for(self, prompt_ids: list[int], *, order: str = "queue", seed: Optional[int] = None) -> torch.Tensor:
        """Teacher-forced logits [len(prompt_ids), vocab] (fp32), one step per position."""
        self._check_steps(len(prompt_ids))
        self.reset()
        seeds = self._step_seeds(order, seed)
        rows = [self.run_step(t, pos, order=order, seed=next(seeds))["logits"].to(torch.float32).reshape(-1)
                for pos, t in enumerate(prompt_ids)]
        return torch.stack(rows)
