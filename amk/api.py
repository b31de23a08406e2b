"""The public Python API: `amk.compile(...) -> Megakernel`.

    mk = amk.compile()                       # the embedded SmolLM2-135M
    mk.validation.accepted                   # always True: a rejected program never compiles
    mk.generate("The capital of France is", max_new_tokens=16)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from amk.errors import AmkError
from amk.schedule.config import ScheduleConfig
from amk.schedule.ir import GpuTarget, Program, ValidationResult
from amk.schedule.modelspec import ModelSpec


class ProgramRejected(AmkError):
    """The lowering produced a program the validator refuses: a compiler bug, never run."""


@dataclass
class Megakernel:
    """A validated program bound to its weights, runnable on the CPU oracle or a CUDA GPU."""

    spec: ModelSpec
    program: Program
    validation: ValidationResult
    tensors: dict[str, torch.Tensor]
    config: ScheduleConfig
    source_weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # the importer's, for the oracle
    native: Any = field(default=None, repr=False)  # quant='gguf': the file's quantized tensors (NativeWeights)
    # loads the tokenizer on first use (`tokenizer`): importing transformers costs seconds,
    # so compiling never pays for it, only encoding or decoding text does
    tokenizer_loader: Optional[Callable[[], Any]] = field(default=None, repr=False)
    _vms: dict[str, Any] = field(default_factory=dict, repr=False)
    _tokenizer: Any = field(default=None, init=False, repr=False)

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (None for a config-only model), loaded on first access."""
        if self._tokenizer is None and self.tokenizer_loader is not None:
            load, self.tokenizer_loader = self.tokenizer_loader, None
            self._tokenizer = load()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer, self.tokenizer_loader = value, None

    # -------------------------------------------------------------- prompts
    def encode(self, prompt: Union[str, Sequence[int]]) -> list[int]:
        """Token ids of a prompt. Without a tokenizer (a config-only model) a text prompt is
        its UTF-8 bytes modulo the vocabulary."""
        if not isinstance(prompt, str):
            ids = [int(i) for i in prompt]
        elif self.tokenizer is not None:
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = [b % self.spec.vocab_size for b in prompt.encode("utf-8")]
        if not ids:
            raise AmkError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise AmkError(f"token id {bad[0]} is outside the vocabulary of {self.spec.vocab_size}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # -------------------------------------------------------------- running
    def vm(self, device: str = "cpu"):
        """The VM for `device` ("cpu" = ReferenceVM, "cuda" = the megakernel), built once."""
        if device not in self._vms:
            if device == "cpu":
                from amk.vm.reference import ReferenceVM

                self._vms[device] = ReferenceVM(self.program, self.tensors, validation=self.validation)
            elif device.startswith("cuda"):
                if not torch.cuda.is_available():
                    raise AmkError("no CUDA GPU is available; use --device cpu")
                from amk.vm.loader import CudaVM

                self._vms[device] = CudaVM(self.program, self.tensors, device=device, validation=self.validation)
            else:
                raise AmkError(f"unknown device {device!r}; use cpu or cuda")
        return self._vms[device]

    def generate(self, prompt: Union[str, Sequence[int]], max_new_tokens: int = 32, *, device: str = "cpu",
                 progress: bool = False) -> list[int]:
        """Greedy continuation: the new token ids (one launch per token on CUDA)."""
        ids = self.encode(prompt)
        if len(ids) + max_new_tokens > self.program.kv_capacity:
            raise AmkError(f"{len(ids)} prompt + {max_new_tokens} new tokens exceed the KV capacity {self.program.kv_capacity}")
        vm = self.vm(device)
        vm.reset()
        return vm.generate(ids, max_new_tokens, progress=progress)

    def logits_for(self, ids: Sequence[int], *, device: str = "cpu") -> torch.Tensor:
        vm = self.vm(device)
        vm.reset()
        return vm.logits_for(list(ids))


def compile(model: Optional[str] = None, config: Optional[ScheduleConfig] = None, target: Union[str, GpuTarget, None] = None,
            *, dtype: Optional[str] = None, random_init: bool = False, seed: int = 0, kv_capacity: int = 2048,
            progress: bool = False, loaded: Optional[tuple] = None) -> Megakernel:
    """Import `model` (None = the embedded SmolLM2-135M), lower it for `target` under
    `config`, validate, and bind the weights. Raises `AmkError` subclasses for bad input,
    unsupported models and (never expected) rejected lowerings.

    `config.quant == 'gguf'` (GGUF sources only) runs the file's Q8_0/Q4_0/Q4_1 matrices in
    their own blocks; `loaded` is then `load_model(model, native_quant=True)`'s triple."""
    from amk.schedule.importer import load_model, load_tokenizer
    from amk.schedule.lower import bind_weights

    cfg = config or ScheduleConfig()
    gguf = cfg.quant == "gguf"
    loaded = loaded or load_model(model, random_init=random_init, seed=seed, dtype=dtype, progress=progress,
                                  native_quant=gguf)
    spec, weights = loaded[0], loaded[1]
    native = loaded[2] if len(loaded) > 2 else None
    if gguf and native is None:
        raise AmkError("quant='gguf' needs the GGUF file's quantized tensors: pass "
                       "loaded=load_model(source, native_quant=True)")
    native_tensors = native.tensors if native is not None else None
    c = _lower_and_validate(spec, cfg, target, dtype, kv_capacity, native_tensors)
    tensors = bind_weights(c.program, spec, weights, native=native_tensors)
    loader = None if random_init else functools.partial(load_tokenizer, model)  # loaded on first use
    return Megakernel(spec=spec, program=c.program, validation=c.validation, tensors=tensors, config=c.config,
                      source_weights=weights, native=native, tokenizer_loader=loader)


@dataclass
class CompiledProgram:
    """A validated program without weights (what `amk compile` writes)."""

    spec: ModelSpec
    program: Program
    validation: ValidationResult
    config: ScheduleConfig


def compile_program(model: Optional[str] = None, config: Optional[ScheduleConfig] = None,
                    target: Union[str, GpuTarget, None] = None, *, dtype: Optional[str] = None,
                    random_init: bool = False, kv_capacity: int = 2048, progress: bool = False) -> CompiledProgram:
    """`compile` without binding weights: import, lower, validate. With `random_init` no
    weights are drawn at all (the config is the model), so any shape compiles in little
    memory; a checkpoint is still read (its tensors are scanned, and GGUF quantized layouts
    lowered as they are)."""
    from amk.schedule.importer import load_model, load_spec

    cfg = config or ScheduleConfig()
    native_tensors = None
    if random_init:
        if cfg.quant == "gguf":
            raise AmkError("quant='gguf' needs a .gguf source with its weights, not --random-init")
        spec = load_spec(model, dtype=dtype, progress=progress)
    else:
        loaded = load_model(model, dtype=dtype, progress=progress, native_quant=cfg.quant == "gguf")
        spec = loaded[0]
        native_tensors = loaded[2].tensors if len(loaded) > 2 else None
    return _lower_and_validate(spec, cfg, target, dtype, kv_capacity, native_tensors)


def _lower_and_validate(spec: ModelSpec, cfg: ScheduleConfig, target, dtype: Optional[str], kv_capacity: int,
                        native_tensors) -> CompiledProgram:
    from amk.schedule.lower import lower
    from amk.schedule.targets import get_target
    from amk.schedule.validate import validate

    tgt = target if isinstance(target, GpuTarget) else _target(target, get_target)
    if dtype is not None and cfg.dtype is None:
        cfg = cfg.model_copy(update={"dtype": dtype})
    program = lower(spec, cfg, tgt, kv_capacity=kv_capacity, native=native_tensors)
    result = validate(program)
    if not result.accepted:
        raise ProgramRejected("the lowering produced a program the validator rejects (a compiler bug): "
                              + "; ".join(f"[{v.check}] {v.reason}" for v in result.violations[:3]))
    return CompiledProgram(spec=spec, program=program, validation=result, config=cfg)


def _target(name, get_target) -> GpuTarget:
    try:
        return get_target(name)
    except ValueError as exc:
        raise AmkError(str(exc)) from None
