"""What both VMs (ReferenceVM and CudaVM) agree on when binding a program to tensors: the
torch dtype of every IR dtype, and that the caller supplies exactly the immutable buffers."""

from __future__ import annotations

from typing import Optional

import torch

from amk.schedule.ir import IMMUTABLE_KINDS, DType, Program

TORCH_DTYPE = {
    DType.F32: torch.float32,
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.I32: torch.int32,
    DType.I8: torch.int8,
    DType.U4: torch.uint8,  # packed two per byte when given; the ReferenceVM unpacks to one per element
}


def bound_tensor_mismatch(program: Program, names) -> Optional[str]:
    """Why `names` are not exactly the program's WEIGHT/CONST buffer names, or None."""
    want = {b.name for b in program.buffers if b.kind in IMMUTABLE_KINDS}
    missing, extra = want - set(names), set(names) - want
    if not (missing or extra):
        return None
    return f"tensors must be exactly the WEIGHT/CONST buffers; missing {sorted(missing)}, unexpected {sorted(extra)}"
