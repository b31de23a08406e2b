"""Operand roles of every op: which input/output slot means what.

One table shared by the lowering (which builds operands), the validator (arity and shape
rules), the ReferenceVM and the GPU loader (which read them). Roles depend only on a
task's params and on its weight buffer's dtype and whether it names a zero (quantized
weights bring a scale, and U4 or asymmetric I8 a zero, companion).
"""

from __future__ import annotations

from amk.schedule.ir import DType, Epilogue, Op

ROPE_EPILOGUES = (Epilogue.ROPE, Epilogue.ROPE_APPEND)
APPEND_EPILOGUES = (Epilogue.ROPE_APPEND, Epilogue.APPEND)


def quant_roles(prefix: str, dtype: DType, zero: bool | None = None) -> list[str]:
    """A quantized weight's companions: its scale, and its zero for U4 (always) or an
    asymmetric I8 (`zero`: whether the weight buffer names one; None: as its dtype implies)."""
    if dtype not in (DType.I8, DType.U4):
        return []
    has_zero = dtype == DType.U4 if zero is None else zero
    return [f"{prefix}_scale"] + ([f"{prefix}_zero"] if has_zero else [])


def epilogue_roles(epilogue: Epilogue, has_bias: bool, head_norm: bool, residual_partials: int = 0) -> list[str]:
    roles = ["bias"] if has_bias else []
    if epilogue == Epilogue.ADD:
        roles.append("residual")
        if residual_partials > 0:  # (GEMV only: the residual read as residual + these partials)
            roles.append("res_part")
    if head_norm:
        roles.append("head_gamma")
    if epilogue in ROPE_EPILOGUES:
        roles += ["inv_freq", "pos"]
    elif epilogue == Epilogue.APPEND:
        roles.append("pos")
    return roles


def input_roles(params, weight_dtype: DType = DType.F32, weight_zero: bool | None = None) -> list[str]:
    """Names of a task's input operands, in order. `weight_dtype` and `weight_zero` (whether
    the weight buffer has a zero companion; None: as its dtype implies) matter for GEMV only."""
    op = params.op
    if op == Op.GEMV:
        roles = ["w", "o", "ml"] if params.combine_splits > 0 else ["w", "x"]
        if params.x_partials > 0:
            roles.append("x_part")
        if params.norm_eps is not None:
            roles.append("gamma")
        roles += quant_roles("w", weight_dtype, weight_zero)
        if params.epilogue == Epilogue.SILU_MUL:
            roles.append("w2")
            roles += quant_roles("w2", weight_dtype, weight_zero)
        if params.split_k == 1:
            roles += epilogue_roles(params.epilogue, params.has_bias, params.head_norm_eps is not None,
                                    params.residual_partials)
        return roles
    if op == Op.REDUCE:
        return ["partials"] + epilogue_roles(params.epilogue, params.has_bias, params.head_norm_eps is not None)
    return list(_FIXED_INPUTS[op])


def weight_input_roles(params, weight) -> list[str]:
    """`input_roles` of a task whose weight buffer is `weight` (an ir.Buffer, or anything with
    its dtype and zero; None: no weight): its dtype and whether it names a zero."""
    if weight is None:
        return input_roles(params)
    return input_roles(params, weight.dtype, weight.zero is not None)


def output_roles(params) -> list[str]:
    op = params.op
    if op == Op.GEMV:
        if params.split_k > 1:
            return ["partial"]
        return ["y", "pair"] if params.argmax_pair_base is not None else ["y"]
    return list(_FIXED_OUTPUTS[op])


def gemv_rows_width(params) -> int:
    """Values per output row of a GEMV partial (2 for the fused gate/up pair)."""
    return 2 if params.epilogue == Epilogue.SILU_MUL else 1


_FIXED_INPUTS = {
    Op.EMBED: ("token", "table"),
    Op.RMSNORM: ("x", "gamma"),
    Op.ROPE: ("x", "inv_freq", "pos"),
    Op.HEAD_NORM: ("x", "gamma"),
    Op.KV_APPEND: ("src", "pos"),
    Op.ATTN_PARTIAL: ("q", "k", "v", "pos"),
    Op.ATTN_COMBINE: ("o", "ml"),
    Op.SILU_MUL: ("gate", "up"),
    Op.ADD: ("a", "b"),
    Op.ARGMAX: ("logits",),
}

_FIXED_OUTPUTS = {
    Op.EMBED: ("x",),
    Op.RMSNORM: ("y",),
    Op.REDUCE: ("y",),
    Op.ROPE: ("y",),
    Op.HEAD_NORM: ("y",),
    Op.KV_APPEND: ("cache",),
    Op.ATTN_PARTIAL: ("o", "ml"),
    Op.ATTN_COMBINE: ("y",),
    Op.SILU_MUL: ("y",),
    Op.ADD: ("y",),
    Op.ARGMAX: ("token",),
}
