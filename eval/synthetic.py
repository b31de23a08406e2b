"""Synthetic layered programs: decode-step-shaped DAGs of any size, for validator tests,
benchmarks and fuzzing, without a model.

Per layer: `width` GEMV tasks with a fused norm read the whole residual stream x and
each write a slab of `a`; then `width` GEMV tasks read all of `a` and add their slab
back into x in place. Embedding tasks start the stream; an LM head and an argmax end it.
Tasks are placed round-robin over the queues in creation (topological) order.
"""

from __future__ import annotations

from amk.schedule import ir
from amk.schedule.ir import BufferKind as K, DType as D, Epilogue, Operand as Opd
from amk.schedule.targets import get_target


def layered_program(layers: int = 2, width: int = 4, hidden: int = 64, vocab: int = 128,
                    queues: int | None = None, target: str = "h100", norm_eps: float = 1e-5) -> ir.Program:
    """`norm_eps`: the fused norm's epsilon. Programs that differ only in `vocab` have params
    the validator has not seen (its memos miss); ones that differ only in `norm_eps` reuse
    its memos (they key such floats by class)."""
    tgt = get_target(target)
    nq = queues or min(tgt.compute_units, 2 * width)
    bufs: list[ir.Buffer] = []
    counters: list[ir.Counter] = []
    tasks: list[ir.Task] = []

    def buf(name, kind, dtype, shape):
        bufs.append(ir.Buffer(id=len(bufs), name=name, kind=kind, dtype=dtype, shape=shape))
        return len(bufs) - 1

    def counter(name):
        counters.append(ir.Counter(id=len(counters), name=name))
        return len(counters) - 1

    def task(name, params, inputs, outputs, waits, out_counter):
        tasks.append(ir.Task(id=len(tasks), name=name, params=params, inputs=inputs, outputs=outputs,
                             waits=[ir.Wait(counter=c, threshold=t) for c, t in waits], out_counter=out_counter))

    token = buf("token", K.IO_INPUT, D.I32, [1])
    table = buf("embed", K.WEIGHT, D.F32, [vocab, hidden])
    x = buf("x", K.ACTIVATION, D.F32, [hidden])
    a = buf("a", K.ACTIVATION, D.F32, [hidden])
    slab = hidden // width
    assert slab * width == hidden, "hidden must be a multiple of width"

    c = counter("embed")
    for i in range(width):
        task(f"embed.{i}", ir.EmbedParams(vocab=vocab, hidden=hidden),
             [Opd(buf=token, off=0, len=1), Opd(buf=table, off=i * slab, len=slab, count=vocab, stride=hidden)],
             [Opd(buf=x, off=i * slab, len=slab)], [], c)
    prev = (c, width)
    for layer in range(layers):
        gamma = buf(f"l{layer}.gamma", K.WEIGHT, D.F32, [hidden])
        w1 = buf(f"l{layer}.w1", K.WEIGHT, D.F32, [hidden, hidden])
        w2 = buf(f"l{layer}.w2", K.WEIGHT, D.F32, [hidden, hidden])
        ca = counter(f"l{layer}.a")
        for i in range(width):
            task(f"l{layer}.a.{i}", ir.GemvParams(rows=slab, k=hidden, k_hi=hidden, norm_eps=norm_eps),
                 [Opd(buf=w1, off=i * slab * hidden, len=hidden, count=slab, stride=hidden), Opd(buf=x, off=0, len=hidden),
                  Opd(buf=gamma, off=0, len=hidden)],
                 [Opd(buf=a, off=i * slab, len=slab)], [prev], ca)
        cb = counter(f"l{layer}.b")
        for i in range(width):
            task(f"l{layer}.b.{i}", ir.GemvParams(rows=slab, k=hidden, k_hi=hidden, epilogue=Epilogue.ADD),
                 [Opd(buf=w2, off=i * slab * hidden, len=hidden, count=slab, stride=hidden), Opd(buf=a, off=0, len=hidden),
                  Opd(buf=x, off=i * slab, len=slab)],
                 [Opd(buf=x, off=i * slab, len=slab)], [(ca, width)], cb)
        prev = (cb, width)
    head = buf("lm_head", K.WEIGHT, D.F32, [vocab, hidden])
    logits = buf("logits", K.IO_OUTPUT, D.F32, [vocab])
    nxt = buf("next_token", K.IO_OUTPUT, D.I32, [1])
    ch = counter("head")
    task("head", ir.GemvParams(rows=vocab, k=hidden, k_hi=hidden),
         [Opd(buf=head, off=0, len=hidden, count=vocab, stride=hidden), Opd(buf=x, off=0, len=hidden)],
         [Opd(buf=logits, off=0, len=vocab)], [prev], ch)
    task("argmax", ir.ArgmaxParams(n=vocab), [Opd(buf=logits, off=0, len=vocab)], [Opd(buf=nxt, off=0, len=1)], [(ch, 1)],
         counter("argmax"))
    qs: list[list[int]] = [[] for _ in range(nq)]
    for t in tasks:
        qs[t.id % nq].append(t.id)
    return ir.Program(name=f"layered-{layers}x{width}", target=tgt, buffers=bufs, counters=counters, tasks=tasks,
                      queues=[q for q in qs if q])


def warm_validator() -> None:
    """Load the validator's compiled fast path now (from numba's cache, or compiling it once
    after an install or a change), by validating a tiny program, so that a later timed
    validation is not charged for it."""
    from amk.schedule.validate import validate

    assert validate(layered_program(layers=1, width=2, hidden=64)).accepted
