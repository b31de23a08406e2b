"""RoPE in q/k GEMV tasks smaller than a head (ScheduleConfig.rope_rows).

Rotate-half RoPE pairs dimension i of a head with i + head_dim/2, so a q/k GEMV task whose
epilogue applies RoPE needs both halves of every head it computes: in the Hugging Face row
order that is whole heads (48 tasks for Llama-3.2-1B's q/k/v, on a third of an H100's SMs).
Permuting each q/k head's rows so that every run of `r` rows holds r/2 dimensions of the
first half followed by their partners lets a task of r rows apply RoPE with the unchanged
epilogue (a "head" of r dimensions whose inverse frequencies are the run's slice of the
table). The table holds each q head's frequencies once, so a task of several runs, across
heads too (ScheduleConfig.rope_multi_run), reads one contiguous slice: entries r0/2 onwards.
q.k is unchanged when q and k are permuted alike, so attention needs nothing else; the k
cache holds the permuted layout (`permute_k_history` writes an HF-layout history).

Run c of a head (c < head_dim / r) holds dimensions [c*r/2, (c+1)*r/2) then
[head_dim/2 + c*r/2, head_dim/2 + (c+1)*r/2). With r = head_dim this is the identity.
"""

from __future__ import annotations

import torch

from amk.schedule.ir import Program

META_KEY = "rope_rows"  # program.meta[META_KEY] = {"rows": r, "head_dim": d, "permuted": [buffer names]}


def head_order(head_dim: int, rows: int) -> list[int]:
    """order[p] = the head dimension at permuted position p."""
    if rows < 2 or rows % 2 or head_dim % rows:
        raise ValueError(f"rope rows {rows} must be an even divisor of head_dim {head_dim}")
    half, h2 = rows // 2, head_dim // 2
    out: list[int] = []
    for c in range(head_dim // rows):
        out += list(range(c * half, (c + 1) * half)) + list(range(h2 + c * half, h2 + (c + 1) * half))
    return out


def row_order(heads: int, head_dim: int, rows: int) -> torch.Tensor:
    """The permutation of all heads * head_dim rows (each head permuted within itself)."""
    one = torch.tensor(head_order(head_dim, rows), dtype=torch.long)
    return (torch.arange(heads, dtype=torch.long)[:, None] * head_dim + one[None, :]).reshape(-1)


def choose(rows: int | str, head_dim: int, qk_heads: int, share: int, whole_heads_only: bool,
           multi_run: bool = False) -> int:
    """The run length: `rows` if given; 'auto' = the smallest even divisor r >= 8 of head_dim
    with at most `share` q/k tasks (qk_heads * head_dim / r), else whole heads; with multi_run
    (tasks of several runs) the smallest even divisor r >= 8, the finest whole-run cut."""
    if whole_heads_only:
        if rows not in ("auto", head_dim):
            raise ValueError(f"rope_rows={rows} needs whole heads here (head norm, or RoPE not fused): "
                             f"use 'auto' or {head_dim}")
        return head_dim
    if rows != "auto":
        head_order(head_dim, int(rows))  # validates
        return int(rows)
    for r in range(8, head_dim + 1, 2):
        if head_dim % r == 0 and (multi_run or qk_heads * (head_dim // r) <= share):
            return r
    return head_dim


def permuted_rows(program: Program) -> tuple[int, int, set[str]]:
    """(rows, head_dim, names of buffers whose rows are permuted); nothing when whole heads."""
    m = program.meta.get(META_KEY)
    if not m:
        return 0, 0, set()
    return int(m["rows"]), int(m["head_dim"]), set(m["permuted"])


def permute_rows(t: torch.Tensor, head_dim: int, rows: int) -> torch.Tensor:
    """A q/k weight (or bias, or quantized companion) with its rows in the permuted order."""
    n = t.shape[0]
    if n % head_dim:
        raise ValueError(f"{n} rows are not whole heads of {head_dim}")
    return t[row_order(n // head_dim, head_dim, rows)].contiguous()


def unpermute_rows(t: torch.Tensor, head_dim: int, rows: int) -> torch.Tensor:
    """The inverse of `permute_rows` (a program's q/k rows back in the Hugging Face order)."""
    n = t.shape[0]
    out = torch.empty_like(t)
    out[row_order(n // head_dim, head_dim, rows)] = t
    return out


def in_hf_order(program: Program, name: str, t: torch.Tensor) -> torch.Tensor:
    """Buffer `name`'s rows (a weight the program holds, or its dequantized values) in the
    Hugging Face order."""
    r, d, permuted = permuted_rows(program)
    return unpermute_rows(t, d, r) if name in permuted else t


def permute_k_history(program: Program, k: torch.Tensor) -> torch.Tensor:
    """k cache rows [n, kv_heads * head_dim] in the Hugging Face layout -> the program's."""
    r, d, _ = permuted_rows(program)
    if not r or r == d:
        return k
    perm = row_order(k.shape[-1] // d, d, r).to(k.device)
    return k[..., perm]
