"""`ScheduleConfig`: every knob of the lowering and the VM, in one validated record.

Each field changes the lowered `Program` (its tasks, tiles, queues, buffers or the VM
knobs in `program.meta["vm"]`); none is reserved. `PRESETS` names a few useful points of
the space, gpt-fast style. `ScheduleConfig.model_json_schema()` is what `amk schema`
prints, and the agent edit surface edits these fields as JSON.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from amk.schedule.ir import MAX_KV_SPLITS, MAX_QUEUES

Auto = Literal["auto"]
QuantMode = Literal["none", "int8", "int4", "gguf"]
ProgramDType = Literal["float32", "bfloat16", "float16"]
SmAssignment = Literal["round_robin", "lpt", "explicit"]


# 'auto' prefetch_depth turns the wait-time hints off when no layer GEMV task streams more than this.
SMALL_TASK_KB = 64
# 'auto' poll_cap_ns: the short cap where no layer GEMV task streams more than this, else the VM's.
SHORT_POLL_TASK_KB = 1024
SHORT_POLL_CAP_NS, VM_POLL_CAP_NS = 128, 1024  # (vm/megakernel.cu AMK_SPIN_MAX_NS is the VM's)

# Fields that take 'auto' or an int in lo..hi.
_AUTO_INT_RANGE = {"gemv_tasks_per_matrix": (1, 4096), "gemv_unroll": (1, 8), "gemv_unroll_quant": (1, 8),
                   "kv_splits": (1, MAX_KV_SPLITS), "argmax_splits": (1, 64), "prefetch_depth": (0, 4),
                   "poll_cap_ns": (64, 4096)}


class ScheduleConfig(BaseModel):
    """How one decode step of a model is lowered onto a persistent megakernel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --------------------------------------------------------------- work split
    gemv_tasks_per_matrix: Union[Auto, int] = Field(
        "auto",
        description="Row slabs per logical weight matrix (the q/k/v projections count as one "
        "concatenated matrix, gate/up as one, then o, down and the LM head), at most: slabs that "
        "cannot shorten a stage (its largest task) are not cut, e.g. beside whole-head RoPE slabs. "
        "Each slab is split_k tasks. Standalone elementwise ops (norm, add, silu-mul, rope, "
        "append) use the same tile count. 'auto' = about one task per queue: ceil(queues / split_k).",
    )
    split_k: int = Field(
        1, ge=1, le=16,
        description="Split every GEMV's K dimension into this many slices; partial sums go to "
        "fp32 scratch and a REDUCE task per row slab sums them and runs the epilogue.",
    )
    kv_splits: Union[Auto, int] = Field(
        "auto",
        description=f"Attention splits of the KV positions per KV head (1..{MAX_KV_SPLITS}); one "
        "ATTN_PARTIAL task per (kv head, split), then one ATTN_COMBINE per kv head. 'auto' = "
        "floor(queues / kv_heads) (every partial on its own queue), capped by the splits the KV "
        "capacity can fill, by one split per 64 positions of it, and by 16 (the split loads a "
        "combine output keeps in flight): more splits cost the combines more than they save "
        "(SmolLM2 at ctx 1024: 44 -> 16 splits, -5.4 % on an H100).",
    )
    argmax_splits: Union[Auto, int] = Field(
        "auto",
        description="Slices of the logits scanned by parallel PARTIAL argmax tasks, whose (max, index) "
        "pairs one MERGE task reduces to the token (1..64; 1 = one task scans them all). 'auto' = "
        "one slice per 2048 logits (one 16-byte load per thread of a 256-thread block at 16-bit "
        "logits), at most the queues and 64: 63 for Llama-3's vocabulary (-0.14 % on the 1B against "
        "slices of 8192 on an H200), 24 for SmolLM2's (-0.14 %).",
    )
    fuse_argmax: bool = Field(
        False,
        description="Each LM head GEMV task's epilogue also writes the (max, first index) pair of the "
        "logits it stores, and one MERGE task reduces those pairs to the token: the PARTIAL argmax "
        "stage (argmax_splits) and its cross-SM hop go, for a block reduction in every LM head task "
        "and a merge of one pair per LM head task. Not with split_k > 1 (a REDUCE finishes the "
        "logits there; the PARTIAL stage stays).",
    )
    kv_head_major: bool = Field(
        False,
        description="Store each KV cache head-major (meta['vm']['kv_head'], vm/kv_layout.py): a KV head's rows back to back, so that "
        "an attention split reads one contiguous run instead of head_dim elements from every row of "
        "the cache. Regions and results unchanged. A stand-alone read of the 1B's K at ctx 8192 on an "
        "H200 took 3.53 us instead of 5.90 with 16 KB a SM in flight, but the megakernel measured no gain "
        "(1B ctx 8192 +0.03 %, SmolLM2 +0.69 %: eval/PERF_NOTES.md item 221), so it is off.",
    )
    kv_block: int = Field(
        16, ge=8, le=1024,
        description="Granularity (positions, a power of two) of an attention split's chunk: "
        "chunk = ceil(ceil((pos+1)/splits)/kv_block)*kv_block. Small blocks keep the chunks "
        "even (ctx 1024 over 16 splits: 80 rows each with 16, but 128 rows on 9 splits with 64).",
    )

    # --------------------------------------------------------------- signalling (who shares a counter)
    kv_head_counters: bool = Field(
        True,
        description="A counter per KV head for the q/k/v GEMV tasks (with fuse_rope_append) and for the "
        "attention partials, instead of one per stage: each partial then waits only for the q/k/v "
        "slabs of its KV head and each combine only for its own partials, not for the slowest task "
        "of the whole stage. Paired on an H100: 1B -0.3 %, 8B -0.1 % (eval/PERF_NOTES.md item 116).",
    )

    # --------------------------------------------------------------- placement
    sm_assignment: SmAssignment = Field(
        "lpt",
        description="How tasks are dealt onto per-block queues: 'round_robin' in lowering "
        "order; 'lpt' longest-processing-time-first by estimated bytes, balanced within each "
        "DAG level; 'explicit' takes explicit_queues.",
    )
    explicit_queues: Optional[list[int]] = Field(
        None,
        description="With sm_assignment='explicit': the queue of every task, in lowering "
        "order (its length is checked against the lowered task count).",
    )
    blocks_per_sm: int = Field(
        1, ge=1, le=8,
        description="Persistent blocks per SM/CU (Program.blocks_per_cu); queues = SMs x this, "
        "and threads_per_block x this must fit one SM.",
    )
    max_queues: Optional[int] = Field(
        None, ge=1, le=MAX_QUEUES,
        description="Upper bound on the number of queues (persistent blocks); None = every "
        "co-resident block of the target.",
    )
    threads_per_block: int = Field(
        256, ge=64, le=1024,
        description="Threads per persistent block (Program.threads_per_block), a multiple of 32.",
    )
    xcd_placement: Union[Auto, bool] = Field(
        "auto",
        description="Chiplet-aware placement on multi-XCD targets (gfx942/gfx950: 8 XCDs, each with a "
        "private L2): every GEMV's output rows are cut into one contiguous slab per XCD whose tasks run "
        "only on that XCD's queues (queue q runs on XCD q % xcds: workgroups are dispatched round-robin "
        "over XCDs), attention partials stay on the XCD of their combine, and a counter whose producers "
        "and waiters all run on one XCD gets the cheaper XCD memory scope. 'auto' = on when the target "
        "has more than one XCD; true on a one-XCD target is refused.",
    )
    prefetch_depth: Union[Auto, int] = Field(
        "auto",
        description="VM knob (program.meta['vm']): how many upcoming tasks' weights a block "
        "starts loading before waiting on the current task's activations (0..4; 0 = none). 'auto' = "
        f"1, or 0 when no layer GEMV task streams more than {SMALL_TASK_KB} KiB of weights: such a task "
        "is a round or two of loads a warp, its own loads fetch it as soon as hints would, and the "
        "hints' traffic slows the latency-bound phases (SmolLM2 shape -1.5 %, eval/PERF_NOTES.md "
        "items 82 and 93).",
    )
    prefetch_kb: int = Field(
        64, ge=1, le=8192,
        description="VM knob (program.meta['vm'], a build define): at most this many KiB of a task's "
        "weights are hinted into L2 while its block waits (the first rounds of its loads). More "
        "fills the memory system's queues with hints that the latency-bound stages' loads then "
        "wait behind: the whole slab (8192) measured Llama-3.1-8B 7.00 -> 6.80 ms at 64 "
        "(eval/PERF_NOTES.md item 49).",
    )

    prefetch_min_kb: int = Field(
        0, ge=0, le=65536,
        description="VM knob (program.meta['vm']): GEMV tasks whose immutable inputs (weights, their "
        "scales, norm weights) total less than this many KiB get no L2 hints during their wait "
        "(0 = every task hinted; prefetch_depth 0 turns them all off). A per-stage alternative to "
        "prefetch_depth: hints help the rows of "
        "large tasks and slow the latency-bound phases (eval/PERF_NOTES.md items 75, 91, 95).",
    )

    poll_cap_ns: Union[Auto, int] = Field(
        "auto",
        description="VM knob (program.meta['vm'], the build define AMK_SPIN_MAX_NS): the longest a "
        "waiting block sleeps between two polls of a counter, in ns (64..4096; it sleeps 64 ns a "
        "missing signal, at least 64). 'auto' = "
        f"{SHORT_POLL_CAP_NS} when no layer GEMV task streams more than {SHORT_POLL_TASK_KB} KiB of "
        f"weights, else {VM_POLL_CAP_NS}: on an H200, 128 measured SmolLM2 shape -0.42 %, Llama-3.2-1B "
        "-0.65 % and Llama-3.1-8B (1.7 MiB tasks) +0.13 % against 1024 (eval/PERF_NOTES.md items "
        "165 and 167).",
    )
    gemv_loads_ahead: Union[Auto, bool] = Field(
        "auto",
        description="VM knob (program.meta['vm'], the build define AMK_GEMV_LOADS_AHEAD): a GEMV warp "
        "issues its next round's weight loads before the row's reduction and store, so those run "
        "under the loads' latency. 'auto' = on for programs whose largest layer GEMV task streams "
        f"more than {SMALL_TASK_KB} KiB, off otherwise and for asymmetric int8 (whose GEMV keeps the "
        "plain loop). On an H200 (eval/PERF_NOTES.md items 170, 173, 174 and 177): Llama-3.2-1B "
        "-1.35 % (-6.2 % against the plain loop since item 172; ctx 8192 -1.5 %), Llama-3.1-8B "
        "-1.4 %, the int8 1B -1.35 %, the int4 1B -1.28 % (though it spills 24 B on sm_90), but the "
        "SmolLM2 shape (tasks of at most 64 KiB) +0.4 to +0.6 %.",
    )
    gemv_unroll: Union[Auto, int] = Field(
        "auto",
        description="VM knob (program.meta['vm'], a build define): 16-byte weight loads each lane "
        "of a float-weight GEMV issues before using the first, per matrix (1..8). More bytes in "
        "flight per SM stream faster until registers spill. 'auto' = the architecture's default "
        "(8 on sm_80/sm_90, 2 on sm_120, where ptxas spends registers more freely).",
    )
    gemv_unroll_quant: Union[Auto, int] = Field(
        "auto",
        description="VM knob (program.meta['vm'], a build define): the same for int8/int4 weights, "
        "whose 16-byte vectors carry 16/32 codes plus a scale (and zero) load each (1..8). "
        "'auto' = the architecture's default (8 on sm_90, 4 on sm_80/86/89, 2 on sm_120; 2 in a "
        "build that compiles both quantized formats, such as the generic one).",
    )

    # --------------------------------------------------------------- fusion
    fuse_norm: bool = Field(
        True, description="RMSNorm in the prologue of the next GEMV (else standalone RMSNORM tasks)."
    )
    fuse_rope_append: bool = Field(
        True,
        description="Head norm + RoPE + KV-cache append in the q/k/v GEMV epilogues (else "
        "standalone HEAD_NORM, ROPE and KV_APPEND tasks).",
    )
    rope_rows: Union[Auto, int] = Field(
        "auto",
        description="Rows of a q/k GEMV task with the fused RoPE epilogue (an even divisor of "
        "head_dim). head_dim keeps whole heads per task (the Hugging Face layout: 48 tasks for "
        "Llama-3.2-1B's 32 + 8 + 8 heads, so q/k/v stream on a third of an H100's SMs). Smaller: "
        "each q/k head's rows are permuted so that every run of this many rows holds whole "
        "rotate-half pairs (q.k is unchanged when q and k are permuted alike; the k cache holds "
        "the permuted layout), and each such run is a task (or several: rope_multi_run). 'auto' = "
        "the smallest r giving at most about one q/k task per queue's share of the stage, whole "
        "heads with head norm (qk_norm) "
        "or without fuse_rope_append.",
    )
    rope_multi_run: bool = Field(
        True,
        description="Let a q/k GEMV task with the fused RoPE epilogue span several runs of rope_rows "
        "rows, across heads too (each run takes its own frequencies): q, k and v are then cut by "
        "their bytes like the other GEMVs, in whole runs, so that the stage fills every queue (the "
        "8B: tasks of 48 rows where one run a task gives 96 tasks of 64 on 132 SMs). 'auto' "
        "rope_rows is then the smallest even divisor >= 8 of head_dim. Measured on an H100: 8B "
        "-1.4 %, 1B -0.9 % (eval/PERF_NOTES.md item 114); False: one run a task.",
    )
    fuse_residual: bool = Field(
        True, description="Residual add in the o-proj/down GEMV epilogue (else standalone ADD tasks)."
    )
    fuse_attn_combine: bool = Field(
        False,
        description="The attention combine in the prologue of every o-proj GEMV task, which then reads "
        "the partials of all KV heads and computes the whole attention output itself: one stage and "
        "one cross-SM hop a layer fewer, for redundant combine work on every SM (each o task reads "
        "every partial from the L2). Not with split_k > 1 (the o-proj then keeps the standalone "
        "combine).",
    )
    o_proj_kv_slices: int = Field(
        0, ge=0, le=64,
        description="0: off. n >= 1: the o-proj is cut along K into n slices of whole KV heads (n "
        "must divide the KV heads); each o task combines its slice's attention partials in its "
        "prologue (no attention combine stage) and writes its rows' partial sum, which the gate/up "
        "norm prologue and the down GEMV's residual add read together with x (no REDUCE): the "
        "combine's and the o-proj's residual-add hops go, for n partial vectors read by every "
        "MLP task (eval/PERF_NOTES.md item 135). Needs split_k 1, fuse_norm and fuse_residual, and "
        "not fuse_attn_combine.",
    )
    fuse_silu_mul: bool = Field(
        True,
        description="One gate/up GEMV with a SILU_MUL epilogue (else separate gate and up GEMVs "
        "and standalone SILU_MUL tasks).",
    )

    # --------------------------------------------------------------- numerics
    quant: QuantMode = Field(
        "none",
        description="Weight-only quantization of the linear layers: int8 (symmetric, I8 codes x "
        "scale, or with quant_asym codes x scale + zero) or int4 (asymmetric, U4 codes x scale + group minimum), round-to-nearest from the "
        "float weights; or 'gguf' (GGUF sources only): every matrix the file holds as Q8_0 / Q4_0 / "
        "Q4_1 runs in its own blocks, undequantized (I8 / U4, group 32, the file's f16 scales), and "
        "every other matrix stays float (load_model(..., native_quant=True) supplies the blocks).",
    )
    quant_group: Union[Literal[32, 64, 128], Literal["channel"]] = Field(
        128,
        description="Quantization group along K (32/64/128; halved per matrix until it divides "
        "K); 'channel' = one group per output row (int8 only). quant='gguf' takes the file's "
        "blocks of 32 (set automatically; any other value is refused).",
    )
    quant_asym: bool = Field(
        False,
        description="int8 only: asymmetric groups, each group's codes -128..127 spanning its [min, "
        "max] with a scale and a zero (w = code x scale + zero, as int4 always has) instead of "
        "+-absmax: a one-sided group gets half the step, and a group already on a 4-bit grid (a "
        "Q4_1 checkpoint, such as the embedded SmolLM2: 64/64 greedy tokens at group 32, "
        "eval/PERF_NOTES.md item 129) is represented exactly. Costs a zero a group, loaded "
        "with the scales, and x's sums over 32-column chunks in each GEMV's prologue (the 1B 15.5 percent "
        "slower than symmetric int8, eval/PERF_NOTES.md item 133). Needs groups of whole 32-column chunks "
        "(quant_group 32/64/128, or 'channel' on matrices whose K is a multiple of 32).",
    )
    quant_lm_head: bool = Field(
        False,
        description="Quantize the LM head too (a tied head gets a separate quantized copy "
        "'lm_head.q'; with quant='gguf' that copy is the file's own blocks of the embedding or "
        "output tensor, where the file quantizes it in a native type); needs quant != 'none'.",
    )
    quant_unpack: int = Field(
        0, ge=0, le=2,
        description="VM knob: how the quantized GEMVs turn codes into floats, written to every "
        "quantized GEMV's params.unpack and built into the VM (a define; semantics unchanged): "
        "1 a byte permute into a biased float's mantissa, 2 an integer-to-float conversion per "
        "code, 0 the VM's default (1). Needs quant != 'none'.",
    )
    dtype: Optional[ProgramDType] = Field(
        None,
        description="Program dtype of weights, activations and KV cache; None = the model's dtype.",
    )

    # --------------------------------------------------------------- checks
    @field_validator(*_AUTO_INT_RANGE)
    @classmethod
    def _auto_or_in_range(cls, v, info):
        lo, hi = _AUTO_INT_RANGE[info.field_name]
        if v != "auto" and not lo <= v <= hi:
            raise ValueError(f"{info.field_name} must be 'auto' or in {lo}..{hi}")
        return v

    @field_validator("rope_rows")
    @classmethod
    def _rope_rows(cls, v):
        if v != "auto" and (v < 2 or v % 2):
            raise ValueError("rope_rows must be 'auto' or an even number >= 2")
        return v

    @field_validator("kv_block")
    @classmethod
    def _kv_block(cls, v):
        if v & (v - 1):
            raise ValueError("kv_block must be a power of two")
        return v

    @field_validator("threads_per_block")
    @classmethod
    def _threads(cls, v):
        if v % 32:
            raise ValueError("threads_per_block must be a multiple of 32")
        return v

    @field_validator("explicit_queues")
    @classmethod
    def _explicit(cls, v):
        if v is not None and any(not 0 <= q < MAX_QUEUES for q in v):
            raise ValueError(f"explicit_queues entries must be in 0..{MAX_QUEUES - 1}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _gguf_group(cls, data):
        """quant='gguf' fixes the group to the GGUF block size unless one is given."""
        if isinstance(data, dict) and data.get("quant") == "gguf" and "quant_group" not in data:
            data = {**data, "quant_group": 32}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.quant == "gguf" and self.quant_group != 32:
            raise ValueError("quant='gguf' uses the file's blocks of 32: quant_group must be 32")
        if (self.sm_assignment == "explicit") != (self.explicit_queues is not None):
            raise ValueError("explicit_queues is given exactly when sm_assignment == 'explicit'")
        if self.quant_group == "channel":
            if self.quant != "int8":
                raise ValueError("quant_group='channel' is for int8 only")
            if self.split_k > 1:
                raise ValueError("quant_group='channel' cannot be split along K (split_k must be 1)")
        if self.o_proj_kv_slices and (self.split_k != 1 or not self.fuse_norm or not self.fuse_residual
                                      or self.fuse_attn_combine):
            raise ValueError("o_proj_kv_slices needs split_k 1, fuse_norm and fuse_residual, and not fuse_attn_combine")
        if self.quant_asym and self.quant != "int8":
            raise ValueError("quant_asym is for int8 (int4 always has a zero; gguf takes the file's blocks)")
        if self.quant == "none" and (self.quant_lm_head or self.quant_unpack):
            raise ValueError("quant_lm_head / quant_unpack need quant != 'none'")
        return self

    def with_(self, **changes) -> "ScheduleConfig":
        """A copy with some fields changed, validated again."""
        return ScheduleConfig.model_validate({**self.model_dump(), **changes})


PRESETS: dict[str, ScheduleConfig] = {
    "default": ScheduleConfig(),
    "unfused": ScheduleConfig(fuse_norm=False, fuse_rope_append=False, fuse_residual=False, fuse_silu_mul=False),
    "split_k2": ScheduleConfig(split_k=2),
    "int8": ScheduleConfig(quant="int8", quant_group="channel"),
    "int8_g128": ScheduleConfig(quant="int8", quant_group=128),
    "int4": ScheduleConfig(quant="int4", quant_group=64),
    "int4_all": ScheduleConfig(quant="int4", quant_group=64, quant_lm_head=True),
    "gguf": ScheduleConfig(quant="gguf", quant_lm_head=True),  # GGUF sources only
}


def preset(name: str) -> ScheduleConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
