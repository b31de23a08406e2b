"""The fast path's compiled checks (numba), over a `CompactProgram`'s integer columns.

Each function decides some of the checks for a program that passes them and returns a
negative `REJECT_*` code at the first failure (`fast.verify` then hands the program to the
explaining path, which names every violation). Nothing here explains anything.

Numba does not bounds-check: every index read from the program (buffer, counter, task,
slot) is range-checked before it is used as one. The functions are plain Python when numba
is missing (`AVAILABLE` is then False and `validate()` does not use them for checking).

One function here is not a check: `narrow_arrays`, the encoding of the integer columns
that the program digest (`validate.program_hash`) hashes, with or without numba.
"""

from __future__ import annotations

import numpy as np

from amk.schedule import ir

try:  # numba compiles these on first use and caches the machine code next to this file
    import numba

    jit = numba.njit(cache=True, nogil=True)
    inline = numba.njit(cache=True, nogil=True, inline="always")  # helpers: no call (and array refcount) per use
    AVAILABLE = True
except ImportError:  # pragma: no cover - the GPU image has no numba; validate() then explains every program
    def jit(f):
        return f

    inline = jit

    AVAILABLE = False

# why a program was handed to the explaining path (negative: counts are >= 0)
REJECT_CAPACITY, REJECT_REFERENCE, REJECT_ARITY, REJECT_OPERAND, REJECT_CONSISTENCY = -1, -2, -3, -4, -5
REJECT_QUANT, REJECT_ALIAS, REJECT_WAIT, REJECT_QUEUE, REJECT_SCOPE = -6, -7, -8, -9, -10
REJECT_TILE, REJECT_COMPLETE, REJECT_CYCLE, REJECT_RACE, REJECT_STALE, REJECT_BUFFER = -11, -12, -13, -14, -15, -16

# columns of the per-buffer table the checks read (`buffer_table`)
B_KIND, B_DTYPE, B_EXTENT, B_GROUP, B_SCALE, B_ZERO, B_MUTABLE, B_OUTPUT, B_BASE = range(9)
BUFINFO_COLUMNS = 9
# columns of the per-entry table (an entry: distinct params and weight dtype/group), one row
# per entry: the E_* values, then an elementwise flag per operand slot (E_FLAGS + slot),
# then the rule of each slot, RULE_COLUMNS apiece (E_RULES + RULE_COLUMNS * slot + R_*).
# Slot s of a task: inputs 0.., outputs MAX_INPUTS.. (a row is built once per distinct
# params and memoised, so a program's table is its entries' rows stacked: no per-program work)
(E_WANT_IN, E_WANT_OUT, E_OP, E_HIDDEN, E_COL, E_K, E_K_LO, E_QUANT,
 E_SLOT_W, E_SLOT_W2, E_SLOT_W_SCALE, E_SLOT_W_ZERO, E_SLOT_W2_SCALE, E_SLOT_W2_ZERO) = range(14)
ENTRY_COLUMNS = 14
SLOTS = ir.MAX_INPUTS + ir.MAX_OUTPUTS
# columns of a rule
R_KINDS, R_DTYPES, R_KV, R_LEN, R_COUNT, R_STRIDE, R_OFF = range(7)
RULE_COLUMNS = 7
E_FLAGS = ENTRY_COLUMNS
E_RULES = E_FLAGS + SLOTS
ENTRY_WIDTH = E_RULES + RULE_COLUMNS * SLOTS
OP_EMBED, OP_RMSNORM = int(ir.Op.EMBED), int(ir.Op.RMSNORM)  # the ops with cross-operand rules
# columns of CompactProgram.buffers
C_KIND, C_DTYPE, C_RANK, C_D0, C_D1 = 0, 1, 2, 3, 4
C_SCALE, C_ZERO, C_GROUP = 3 + ir.MAX_RANK, 4 + ir.MAX_RANK, 5 + ir.MAX_RANK
_K = ir.BufferKind
KIND_WEIGHT, KIND_CONST, KIND_KV, KIND_OUTPUT = int(_K.WEIGHT), int(_K.CONST), int(_K.KV_CACHE), int(_K.IO_OUTPUT)
KIND_IO_INPUT, KIND_MAX = int(_K.IO_INPUT), max(int(k) for k in _K)
DTYPE_I8, DTYPE_U4, DTYPE_MAX = int(ir.DType.I8), int(ir.DType.U4), max(int(d) for d in ir.DType)
FLOAT_DTYPES = sum(1 << int(d) for d in (ir.DType.F32, ir.DType.F16, ir.DType.BF16))
SCOPE_XCD, SCOPE_MAX = int(ir.Scope.XCD), max(int(c) for c in ir.Scope)


@jit
def buffer_table(buffers, kv_capacity, dtype_mask):
    """`form.check_buffers`' rules (rank, dims, size cap, dtype on this target, KV shape,
    quantized weights and their scale/zero companions). Returns (code, `B_*` table, each
    buffer's (dtype, group, has a zero) variant, how many variants)."""
    nb = buffers.shape[0]
    info = np.zeros((nb, BUFINFO_COLUMNS), np.int64)
    variant = np.zeros(nb, np.int64)
    var_dtype = np.empty(nb, np.int64)
    var_group = np.empty(nb, np.int64)
    var_zero = np.empty(nb, np.bool_)
    nv = 0
    if kv_capacity < 0:
        return REJECT_BUFFER, info, variant, nv
    base = 0
    for b in range(nb):
        kind, dtype, rank = buffers[b, C_KIND], buffers[b, C_DTYPE], buffers[b, C_RANK]
        scale, zero, group = buffers[b, C_SCALE], buffers[b, C_ZERO], buffers[b, C_GROUP]
        if kind < 0 or kind > KIND_MAX or dtype < 0 or dtype > DTYPE_MAX or rank < 1 or rank > ir.MAX_RANK:
            return REJECT_BUFFER, info, variant, nv
        if (dtype_mask >> dtype) & 1 == 0 or scale < -1 or zero < -1 or group < -1:
            return REJECT_BUFFER, info, variant, nv
        numel = 1
        for d in range(ir.MAX_RANK):
            dim = buffers[b, C_D0 + d]
            if d >= rank:
                if dim != -1:  # one encoding per program: the digest is over these columns
                    return REJECT_BUFFER, info, variant, nv
                continue
            if dim < 1 or dim > ir.MAX_BUFFER_ELEMS:
                return REJECT_BUFFER, info, variant, nv
            numel *= dim
            if numel > ir.MAX_BUFFER_ELEMS:
                return REJECT_BUFFER, info, variant, nv
        if kind == KIND_KV and (rank != 2 or buffers[b, C_D0] != kv_capacity or (FLOAT_DTYPES >> dtype) & 1 == 0):
            return REJECT_BUFFER, info, variant, nv
        if dtype == DTYPE_I8 or dtype == DTYPE_U4:
            if not _quant_buffer_ok(buffers, b, nb):
                return REJECT_BUFFER, info, variant, nv
        elif scale != -1 or zero != -1 or group != -1:
            return REJECT_BUFFER, info, variant, nv
        extent = buffers[b, C_D1] if kind == KIND_KV else numel
        info[b, B_KIND], info[b, B_DTYPE], info[b, B_EXTENT], info[b, B_BASE] = kind, dtype, extent, base
        info[b, B_GROUP], info[b, B_SCALE], info[b, B_ZERO] = max(group, 0), scale, zero
        info[b, B_MUTABLE] = kind != KIND_WEIGHT and kind != KIND_CONST and kind != KIND_IO_INPUT
        info[b, B_OUTPUT] = kind == KIND_OUTPUT
        if info[b, B_MUTABLE]:  # the access axis spans the mutable buffers only (race_free ranks it)
            base += extent
        v = 0
        while v < nv and (var_dtype[v] != dtype or var_group[v] != group or var_zero[v] != (zero != -1)):
            v += 1
        if v == nv:
            var_dtype[nv], var_group[nv], var_zero[nv] = dtype, group, zero != -1
            nv += 1
        variant[b] = v
    return 0, info, variant, nv


@inline
def _quant_buffer_ok(buffers, b, nb):
    """A quantized weight: a 2-D WEIGHT whose group divides its columns (an even count for
    U4), with an immutable float [rows, cols / group] scale, and a zero of the same form (U4
    always; I8 where it names one: asymmetric)."""
    if buffers[b, C_KIND] != KIND_WEIGHT or buffers[b, C_RANK] != 2:
        return False
    rows, cols, group = buffers[b, C_D0], buffers[b, C_D1], buffers[b, C_GROUP]
    if group < 1 or cols % group != 0:
        return False
    u4 = buffers[b, C_DTYPE] == DTYPE_U4
    if u4 and cols % 2 != 0:
        return False
    for k in range(2 if u4 or buffers[b, C_ZERO] != -1 else 1):
        c = buffers[b, C_SCALE] if k == 0 else buffers[b, C_ZERO]
        if c < 0 or c >= nb or buffers[c, C_RANK] != 2 or buffers[c, C_D0] != rows or buffers[c, C_D1] != cols // group:
            return False
        kind, dtype = buffers[c, C_KIND], buffers[c, C_DTYPE]
        if (kind != KIND_WEIGHT and kind != KIND_CONST) or dtype < 0 or (FLOAT_DTYPES >> dtype) & 1 == 0:
            return False
    return True


@jit
def task_entries(n_in, n_out, n_wait, out_counter, operands, waits, task_params, n_params, gemv_params, buf_variant,
                 n_variants, nc, max_in, max_out, max_waits, buffers):
    """Caps and references, params used in order of first use; then each task's entry (its
    params and, for a GEMV, its weight buffer's dtype, group and zero). Returns (code, where
    each task's operands start, where its waits start [nt + 1], entry per task, per entry its
    first task, its weight's dtype and group and whether it names a zero [ne, 4] (-1, -1, 0:
    no weight), weight buffer per task)."""
    nt = n_in.shape[0]
    nb = buf_variant.shape[0]
    op_start = np.empty(nt, np.int64)
    w_start = np.zeros(nt + 1, np.int64)
    entry = np.full(nt, -1, np.int64)
    wbuf = np.full(nt, -1, np.int64)
    first = np.full((nt, 4), -1, np.int64)
    first[:, 3] = 0
    ne = 0
    at = 0
    for t in range(nt):
        if n_in[t] < 0 or n_out[t] < 0 or n_wait[t] < 0:
            return REJECT_CAPACITY, op_start, w_start, entry, first[:0], wbuf
        if n_in[t] > max_in or n_out[t] > max_out or n_wait[t] > max_waits:
            return REJECT_CAPACITY, op_start, w_start, entry, first[:0], wbuf
        op_start[t] = at
        at += n_in[t] + n_out[t]
        w_start[t + 1] = w_start[t] + n_wait[t]
    if at != operands.shape[0] or w_start[nt] != waits.shape[0]:
        return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
    for i in range(operands.shape[0]):
        if operands[i, 0] < 0 or operands[i, 0] >= nb:
            return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
    for i in range(waits.shape[0]):
        if waits[i, 0] < 0 or waits[i, 0] >= nc:
            return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
    slot_of = np.full(n_params * (n_variants + 1), -1, np.int64)
    used = np.zeros(n_params, np.bool_)
    n_used = 0
    for t in range(nt):
        if out_counter[t] < 0 or out_counter[t] >= nc:
            return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
        p = task_params[t]
        if p < 0 or p >= n_params:
            return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
        if not used[p]:  # one encoding per program: params listed in order of first use
            if p != n_used:
                return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
            used[p] = True
            n_used += 1
        v = 0
        if gemv_params[p] and n_in[t] > 0:
            wbuf[t] = operands[op_start[t], 0]
            v = buf_variant[wbuf[t]] + 1
        key = p * (n_variants + 1) + v
        if slot_of[key] < 0:
            slot_of[key] = ne
            first[ne, 0] = t
            if wbuf[t] >= 0:
                first[ne, 1], first[ne, 2] = buffers[wbuf[t], C_DTYPE], buffers[wbuf[t], C_GROUP]
                first[ne, 3] = buffers[wbuf[t], C_ZERO] != -1
            ne += 1
        entry[t] = slot_of[key]
    if n_used != n_params:
        return REJECT_REFERENCE, op_start, w_start, entry, first[:0], wbuf
    return 0, op_start, w_start, entry, first[:ne], wbuf


@inline
def _operand_ok(operands, i, ent, e, r, bufinfo):
    """Operand i against the rule at column r of entry e: kind, dtype, KV mode, shape,
    bounds. (Bitwise `|` rather than `or`: one branch instead of a dozen, ~2x faster on the
    common all-pass path.)"""
    buf, off, ln, count, stride, kv = operands[i, 0], operands[i, 1], operands[i, 2], operands[i, 3], operands[i, 4], operands[i, 5]
    kind, dtype, ext = bufinfo[buf, B_KIND], bufinfo[buf, B_DTYPE], bufinfo[buf, B_EXTENT]
    r_len, r_count, r_stride, r_off = ent[e, r + R_LEN], ent[e, r + R_COUNT], ent[e, r + R_STRIDE], ent[e, r + R_OFF]
    bad = (((ent[e, r + R_KINDS] >> kind) & 1) == 0) | (((ent[e, r + R_DTYPES] >> dtype) & 1) == 0) | (kv != ent[e, r + R_KV])
    bad |= (off < 0) | (ln < 1) | (count < 1) | (stride < 0) | (off > ext) | (ln > ext - off)
    bad |= ((r_len >= 0) & (r_len != ln)) | ((r_count >= 0) & (r_count != count)) | ((r_off >= 0) & (r_off != off))
    repeated = count != 1
    bad |= repeated & (((r_stride >= 0) & (r_stride != stride)) | (stride < ln) | (kv != 0))
    if bad:
        return False
    # the last repetition ends in bounds: (count - 1) * stride <= ext - off - ln, without overflow
    return not repeated or (count - 1) <= (ext - off - ln) // stride  # stride >= ln >= 1 here


@jit
def check_tasks(op_start, n_in, n_out, entry, wbuf, operands, bufinfo, entinfo, max_in):
    """Arity, every operand against its role's rule (kind, dtype, KV mode, shape, bounds),
    the cross-operand rules (EMBED, RMSNORM, quantized companions) and self-aliasing.
    `entinfo`: the entry table (ENTRY_WIDTH columns)."""
    nt = n_in.shape[0]
    if entinfo.shape[1] != ENTRY_WIDTH:
        return REJECT_ARITY
    for t in range(nt):
        e = entry[t]
        if n_in[t] != entinfo[e, E_WANT_IN] or n_out[t] != entinfo[e, E_WANT_OUT]:
            return REJECT_ARITY
        s0 = op_start[t]
        for j in range(n_in[t] + n_out[t]):  # (arity is capped: every slot is < SLOTS)
            slot = j if j < n_in[t] else max_in + j - n_in[t]
            if not _operand_ok(operands, s0 + j, entinfo, e, E_RULES + RULE_COLUMNS * slot, bufinfo):
                return REJECT_OPERAND
    # from here on every operand is in bounds, so region ends fit in int64
    for t in range(nt):
        e = entry[t]
        s0 = op_start[t]
        x = s0 + n_in[t]  # the first output
        op = entinfo[e, E_OP]
        if op == OP_EMBED:
            table = s0 + 1
            if operands[table, 2] != operands[x, 2] or operands[table, 1] + operands[table, 2] > entinfo[e, E_HIDDEN]:
                return REJECT_CONSISTENCY
        elif op == OP_RMSNORM:
            if operands[s0 + 1, 2] != operands[x, 2] or entinfo[e, E_COL] + operands[x, 2] > entinfo[e, E_HIDDEN]:
                return REJECT_CONSISTENCY
        if entinfo[e, E_QUANT] and not _quant_ok(s0, entinfo, e, wbuf[t], operands, bufinfo):
            return REJECT_QUANT
        if not _no_self_alias(s0, n_in[t], n_out[t], e, operands, entinfo):
            return REJECT_ALIAS
    return 0


@inline
def _quant_ok(s0, ent, e, w_buf, operands, bufinfo):
    """A quantized GEMV's scale/zero operands name its weight's own companions, at its rows."""
    for prefix in range(2):
        slot_w = ent[e, E_SLOT_W] if prefix == 0 else ent[e, E_SLOT_W2]
        if slot_w < 0:
            continue
        w_op = s0 + slot_w
        wb = operands[w_op, 0]
        if bufinfo[wb, B_DTYPE] != bufinfo[w_buf, B_DTYPE] or bufinfo[wb, B_GROUP] != bufinfo[w_buf, B_GROUP]:
            return False
        group = bufinfo[wb, B_GROUP] if bufinfo[wb, B_GROUP] > 0 else 1
        k = ent[e, E_K]
        want_off = (operands[w_op, 1] // k) * (k // group) + ent[e, E_K_LO] // group
        for comp in range(2):
            if prefix == 0:
                slot = ent[e, E_SLOT_W_SCALE] if comp == 0 else ent[e, E_SLOT_W_ZERO]
            else:
                slot = ent[e, E_SLOT_W2_SCALE] if comp == 0 else ent[e, E_SLOT_W2_ZERO]
            if slot < 0:
                continue
            want_buf = bufinfo[wb, B_SCALE] if comp == 0 else bufinfo[wb, B_ZERO]
            if operands[s0 + slot, 0] != want_buf or operands[s0 + slot, 1] != want_off:
                return False
    return True


@inline
def _no_self_alias(s0, nin, nout, e, operands, entinfo):
    """No output overlaps one of the task's own inputs, except an elementwise operand
    updated exactly in place."""
    for r in range(s0 + nin, s0 + nin + nout):
        for j in range(nin):
            q = s0 + j
            if operands[q, 0] != operands[r, 0]:
                continue
            same = True
            for c in range(1, 6):
                if operands[q, c] != operands[r, c]:
                    same = False
            if same and entinfo[e, E_FLAGS + j] != 0:
                continue
            if operands[q, 5] != operands[r, 5] and (operands[q, 5] == 0 or operands[r, 5] == 0):
                continue
            hi_r = operands[r, 1] + (operands[r, 3] - 1) * operands[r, 4] + operands[r, 2]
            hi_q = operands[q, 1] + (operands[q, 3] - 1) * operands[q, 4] + operands[q, 2]
            if operands[r, 1] < hi_q and operands[q, 1] < hi_r:
                return False
    return True


@jit
def check_waits_and_queues(w_start, out_counter, waits, nc, queue_len, queue_tasks, scope, n_xcd):
    """Thresholds (every wait a full join of >= 1 producers), no self-wait, no counter
    waited on twice; every task in exactly one queue; counter scopes are Scope codes and
    the XCD scope rule holds. Returns (code, queue of each task, position in it)."""
    nt = out_counter.shape[0]
    queue_of = np.full(nt, -1, np.int64)
    pos = np.full(nt, -1, np.int64)
    for c in range(nc):
        if scope[c] < 0 or scope[c] > SCOPE_MAX:
            return REJECT_REFERENCE, queue_of, pos
    nprod = np.zeros(nc, np.int64)
    for t in range(nt):
        nprod[out_counter[t]] += 1
    for t in range(nt):
        for i in range(w_start[t], w_start[t + 1]):
            c, thr = waits[i, 0], waits[i, 1]
            if thr < 1 or thr != nprod[c] or c == out_counter[t]:
                return REJECT_WAIT, queue_of, pos
            for j in range(w_start[t], i):
                if waits[j, 0] == c:
                    return REJECT_WAIT, queue_of, pos
    if queue_tasks.shape[0] != nt:
        return REJECT_QUEUE, queue_of, pos
    at = 0
    for q in range(queue_len.shape[0]):
        if queue_len[q] < 0:
            return REJECT_QUEUE, queue_of, pos
        for k in range(queue_len[q]):
            if at >= nt:
                return REJECT_QUEUE, queue_of, pos
            t = queue_tasks[at]
            if t < 0 or t >= nt or queue_of[t] >= 0:
                return REJECT_QUEUE, queue_of, pos
            queue_of[t] = q
            pos[t] = k
            at += 1
    if at != nt:
        return REJECT_QUEUE, queue_of, pos
    # scope: a task waiting on an XCD-scoped counter runs on the XCD of every producer
    lo = np.full(nc, n_xcd, np.int64)
    hi = np.full(nc, -1, np.int64)
    for t in range(nt):
        c = out_counter[t]
        if scope[c] == SCOPE_XCD:
            x = queue_of[t] % n_xcd
            lo[c] = min(lo[c], x)
            hi[c] = max(hi[c], x)
    for t in range(nt):
        x = queue_of[t] % n_xcd
        for i in range(w_start[t], w_start[t + 1]):
            c = waits[i, 0]
            if scope[c] == SCOPE_XCD and hi[c] >= 0 and (x != lo[c] or x != hi[c]):
                return REJECT_SCOPE, queue_of, pos
    return 0, queue_of, pos


@jit
def accesses(op_start, n_in, n_out, operands, bufinfo):
    """Every mutable-buffer access as an interval on one axis (each buffer its own range; a
    KV cache by column): (task, buffer, lo, hi, write), in operand order, and where each
    task's intervals start [nt + 1]."""
    nt = n_in.shape[0]
    n = 0
    for i in range(operands.shape[0]):
        if bufinfo[operands[i, 0], B_MUTABLE]:
            n += operands[i, 3] if operands[i, 5] == 0 else 1
    a_task = np.empty(n, np.int64)
    a_buf = np.empty(n, np.int64)
    a_lo = np.empty(n, np.int64)
    a_hi = np.empty(n, np.int64)
    a_write = np.empty(n, np.bool_)
    a_start = np.empty(nt + 1, np.int64)
    k = 0
    for t in range(nt):
        a_start[t] = k
        s0 = op_start[t]
        for j in range(n_in[t] + n_out[t]):
            i = s0 + j
            b = operands[i, 0]
            if not bufinfo[b, B_MUTABLE]:
                continue
            reps = operands[i, 3] if operands[i, 5] == 0 else 1
            off, ln, stride = operands[i, 1], operands[i, 2], operands[i, 4]
            size, base = bufinfo[b, B_EXTENT], bufinfo[b, B_BASE]
            for c in range(reps):
                lo = min(max(off + c * stride, 0), size)
                hi = min(max(off + c * stride + ln, 0), size)
                if hi > lo:
                    a_task[k], a_buf[k], a_lo[k], a_hi[k], a_write[k] = t, b, lo + base, hi + base, j >= n_in[t]
                    k += 1
    a_start[nt] = k
    return a_task[:k], a_buf[:k], a_lo[:k], a_hi[:k], a_write[:k], a_start


@jit
def check_tiles(a_task, a_buf, a_lo, a_hi, a_write, s_lo, nseg, out_counter, bufinfo, nb):
    """The writers of one counter tile each buffer they write without overlap or gap;
    every IO_OUTPUT buffer is written whole. (Buffers own disjoint ranges of the access
    axis, so ordering by position orders by buffer too; `s_lo` ranks the positions.)"""
    w = np.flatnonzero(a_write)
    task, buf, lo, hi = a_task[w], a_buf[w], a_lo[w], a_hi[w]
    counter = out_counter[task]
    srt = np.argsort(counter * (nseg + 1) + s_lo[w])  # by (counter, position); ties are overlaps either way
    for i in range(1, srt.shape[0]):
        a, b = srt[i - 1], srt[i]
        if counter[a] == counter[b] and buf[a] == buf[b] and task[a] != task[b] and lo[b] != hi[a]:
            return REJECT_TILE
    out = np.flatnonzero(bufinfo[buf, B_OUTPUT] != 0)
    srt = out[np.argsort(lo[out])]
    covered = np.zeros(nb, np.int64)
    reach = -1
    cur = -1
    for i in srt:
        if buf[i] != cur:
            cur, reach = buf[i], -1
        start = max(lo[i], reach)
        if hi[i] > start:
            covered[cur] += hi[i] - start
        reach = max(reach, hi[i])
    for b in range(nb):
        if bufinfo[b, B_OUTPUT] and covered[b] < bufinfo[b, B_EXTENT]:
            return REJECT_COMPLETE
    return 0


@jit
def order_and_clocks(out_counter, w_start, waits, nc, queue_len, queue_tasks, queue_of, pos):
    """Kahn's algorithm over tasks and counters (producer -> counter -> waiter, and queue
    order); the union graph must be acyclic. Returns (code, the tasks in a linear extension
    of happens-before, vector clocks): clock[t, q] is the highest position of queue q that
    happens before (or is) task t."""
    nt = out_counter.shape[0]
    nq = queue_len.shape[0]
    n = nt + nc
    # successors (CSR): task -> its counter and its queue successor; counter -> its waiters
    qnext = np.full(nt, -1, np.int64)
    qprev = np.full(nt, nt, np.int64)
    at = 0
    for q in range(nq):
        for k in range(queue_len[q] - 1):
            qnext[queue_tasks[at + k]] = queue_tasks[at + k + 1]
            qprev[queue_tasks[at + k + 1]] = queue_tasks[at + k]
        at += queue_len[q]
    wait_deg = np.zeros(nc + 1, np.int64)
    for i in range(waits.shape[0]):
        wait_deg[waits[i, 0] + 1] += 1
    c_ptr = np.cumsum(wait_deg)
    waiters = np.empty(waits.shape[0], np.int64)
    fill = c_ptr[:-1].copy()
    indeg = np.zeros(n, np.int64)
    for t in range(nt):
        for i in range(w_start[t], w_start[t + 1]):
            c = waits[i, 0]
            waiters[fill[c]] = t
            fill[c] += 1
            indeg[t] += 1
        indeg[nt + out_counter[t]] += 1
        if qnext[t] >= 0:
            indeg[qnext[t]] += 1
    clock = np.empty((nt + 1, max(nq, 1)), np.int32)  # (a task's row is written whole before it is read)
    clock[nt, :] = -1  # row nt: no queue predecessor
    cclock = np.full((nc, max(nq, 1)), -1, np.int32)
    topo = np.empty(nt, np.int64)
    stack = np.empty(n, np.int64)
    top = 0
    for v in range(n):
        if indeg[v] == 0:
            stack[top] = v
            top += 1
    done = 0
    r = 0
    while top > 0:
        top -= 1
        v = stack[top]
        done += 1
        if v < nt:
            t = v
            p = qprev[t]
            for q in range(nq):
                clock[t, q] = clock[p, q]
            for i in range(w_start[t], w_start[t + 1]):  # every wait is a full join (checked)
                wc = waits[i, 0]
                for q in range(nq):
                    clock[t, q] = max(clock[t, q], cclock[wc, q])
            clock[t, queue_of[t]] = pos[t]
            c = out_counter[t]
            for q in range(nq):
                cclock[c, q] = max(cclock[c, q], clock[t, q])
            topo[r] = t
            r += 1
            succ = (nt + c, qnext[t])
            for s in succ:
                if s >= 0:
                    indeg[s] -= 1
                    if indeg[s] == 0:
                        stack[top] = s
                        top += 1
        else:
            c = v - nt
            for i in range(c_ptr[c], c_ptr[c + 1]):
                s = waiters[i]
                indeg[s] -= 1
                if indeg[s] == 0:
                    stack[top] = s
                    top += 1
    if done != n:
        return REJECT_CYCLE, topo, clock
    return 0, topo, clock


@jit
def segments(a_lo, a_hi):
    """Each interval's first and end segment when the axis is cut at every interval end:
    the rank of lo and of hi among the distinct ends. Small axes (the usual case) are
    ranked by marking the ends in a table, large ones by sorting."""
    n = a_lo.shape[0]
    top = 0
    for i in range(n):
        top = max(top, a_hi[i])
    if top <= 16 * n + 4096:  # a table no bigger than the intervals themselves, give or take
        rank = np.zeros(top + 1, np.int32)
        for i in range(n):
            rank[a_lo[i]] = 1
            rank[a_hi[i]] = 1
        seen = 0
        for v in range(top + 1):  # rank[v]: distinct ends below v
            mark = rank[v]
            rank[v] = seen
            seen += mark
        s_lo, s_hi = np.empty(n, np.int32), np.empty(n, np.int32)
        for i in range(n):
            s_lo[i], s_hi[i] = rank[a_lo[i]], rank[a_hi[i]]
        return s_lo, s_hi, seen
    points = np.unique(np.concatenate((a_lo, a_hi)))
    return (np.searchsorted(points, a_lo).astype(np.int32), np.searchsorted(points, a_hi).astype(np.int32),
            points.shape[0])


@jit
def race_free(s_lo, s_hi, nseg, a_write, a_start, topo, clock, queue_of, pos):
    """Every conflicting access pair ordered by happens-before, no read of what nothing
    wrote earlier this step. Returns the ordering checks made (>= 0), or a REJECT code.

    The axis is cut at every interval end; the accesses of each segment, taken in happens-
    before order, must each come after the segment's previous writer, and each reader before the
    next writer (the writers then form a chain that orders everything by transitivity).
    A task's accesses of one segment count once (an in-place task reads and writes it).
    Access k covers segments s_lo[k] .. s_hi[k] - 1 of nseg (`segments`)."""
    n = s_lo.shape[0]
    if n == 0:
        return 0
    # a task as one int64, its queue << 32 | its position (both fit in 31 bits: one load
    # per check). Per segment: the last writer (-1: none); the readers since then, in the
    # segment's own run of `readers` (sized by how many reading accesses cover it: a writer
    # scans them in order, no list to chase). Task a happens before task b iff
    # clock[b, queue of a] >= position of a.
    writer = np.full(nseg, -1, np.int64)
    cover = np.zeros(nseg + 1, np.int64)  # reading accesses starting at each segment, less those ending there
    for k in range(n):
        if not a_write[k]:
            cover[s_lo[k]] += 1
            cover[s_hi[k]] -= 1
    fill = np.zeros(nseg + 1, np.int64)  # segment s's run starts at fill[s] (then: where its next reader goes)
    c = 0
    for s in range(nseg):
        c += cover[s]
        fill[s + 1] = fill[s] + c
    readers = np.empty(fill[nseg], np.int64)
    pending = fill[:nseg].copy()  # the segment's readers since its last writer: readers[pending[s]:fill[s]]
    # a task takes its reads, then its writes, each segment once: stamp[s] is 2t + 1 once
    # task t has read s, 2t + 2 once it has written it (an in-place segment is both, in turn)
    stamp = np.zeros(nseg, np.int64)
    checks = 0
    for t in topo:  # tasks in happens-before order
        seen = clock[t]  # per queue, the last position that happens before t
        me = (np.int64(queue_of[t]) << 32) | pos[t]
        read, wrote = 2 * t + 1, 2 * t + 2
        for k in range(a_start[t], a_start[t + 1]):
            if a_write[k]:
                continue
            for s in range(s_lo[k], s_hi[k]):
                if stamp[s] == read:
                    continue
                stamp[s] = read
                w = writer[s]
                if w < 0:
                    return REJECT_STALE
                if seen[w >> 32] < (w & 0xFFFFFFFF):
                    return REJECT_RACE
                checks += 1
                p = fill[s]
                readers[p] = me
                fill[s] = p + 1
        for k in range(a_start[t], a_start[t + 1]):
            if not a_write[k]:
                continue
            for s in range(s_lo[k], s_hi[k]):
                st = stamp[s]
                if st == wrote:
                    continue
                stamp[s] = wrote
                w = writer[s]
                if st == read:
                    fill[s] -= 1  # this task's own read, the last one listed: it happens before its write
                elif w >= 0:
                    if seen[w >> 32] < (w & 0xFFFFFFFF):
                        return REJECT_RACE
                    checks += 1
                end = fill[s]
                for p in range(pending[s], end):
                    r = readers[p]
                    if seen[r >> 32] < (r & 0xFFFFFFFF):
                        return REJECT_RACE
                checks += end - pending[s]
                pending[s] = end
                writer[s] = me
    return checks


@jit
def check_program(op_start, n_in, n_out, w_start, entry, wbuf, out_counter, operands, waits, queue_len, queue_tasks,
                  bufinfo, entinfo, scope, n_xcd, max_in):
    """Everything after the entry tables, in one call: tasks, waits and queues, tiles and
    completeness, order, races. The ordering checks made, or a REJECT code."""
    nb, nc = bufinfo.shape[0], scope.shape[0]
    code = check_tasks(op_start, n_in, n_out, entry, wbuf, operands, bufinfo, entinfo, max_in)
    if code < 0:
        return code
    code, queue_of, pos = check_waits_and_queues(w_start, out_counter, waits, nc, queue_len, queue_tasks, scope, n_xcd)
    if code < 0:
        return code
    a_task, a_buf, a_lo, a_hi, a_write, a_start = accesses(op_start, n_in, n_out, operands, bufinfo)
    s_lo, s_hi, nseg = segments(a_lo, a_hi)
    code = check_tiles(a_task, a_buf, a_lo, a_hi, a_write, s_lo, nseg, out_counter, bufinfo, nb)
    if code < 0:
        return code
    code, topo, clock = order_and_clocks(out_counter, w_start, waits, nc, queue_len, queue_tasks, queue_of, pos)
    if code < 0:
        return code
    return race_free(s_lo, s_hi, nseg, a_write, a_start, topo, clock, queue_of, pos)


@jit
def narrow_arrays(matrices, vectors):
    """The bytes the program digest hashes for `matrices` (2-D int64, C order), then
    `vectors` (1-D int64, each taken as one column): per array its rows and columns (8
    bytes each), then per column a width byte w and the column's values in order as w-byte
    two's complement integers (little-endian hosts), w the smallest of 1, 2, 4, 8 that holds
    them all. An exact encoding of the values, deterministic, in a fraction of their 8
    bytes each (narrowed by column: an operand's buffer id and its offset need different
    widths). Compiled loops; without numba, `narrow_arrays_numpy` (the same bytes) stands
    in for it."""
    size = 0
    for a in matrices:
        size += _narrow_size(a.shape[0], a.shape[1])
    for v in vectors:
        size += _narrow_size(v.shape[0], 1)
    out = np.empty(size, np.uint8)
    at = 0
    for a in matrices:
        at = _narrow_into(out, at, a)
    for v in vectors:
        at = _narrow_into(out, at, v.reshape(v.shape[0], 1))
    return out[:at]


@inline
def _narrow_size(rows, cols):
    """An upper bound of one array's encoding size (every value at 8 bytes)."""
    return 16 + cols * (1 + 8 * rows)


@inline
def _width(lo, hi):
    """The fewest bytes (1, 2, 4, 8) whose two's complement holds lo..hi."""
    w = 1
    while w < 8 and (lo < -(1 << (8 * w - 1)) or hi >= 1 << (8 * w - 1)):
        w *= 2
    return w


@inline
def _narrow_into(out, at, a):
    """Writes the encoding of the 2-D array `a` at out[at:]; returns where it ends."""
    rows, cols = a.shape
    head = out[at:at + 16].view(np.int64)
    head[0], head[1] = rows, cols
    at += 16
    for c in range(cols):
        lo, hi = 0, 0
        if rows:
            lo, hi = a[0, c], a[0, c]
        for r in range(1, rows):
            lo, hi = min(lo, a[r, c]), max(hi, a[r, c])
        w = _width(lo, hi)
        out[at] = w
        at += 1
        end = at + w * rows
        if w == 1:
            d1 = out[at:end].view(np.int8)
            for r in range(rows):
                d1[r] = a[r, c]
        elif w == 2:
            d2 = out[at:end].view(np.int16)
            for r in range(rows):
                d2[r] = a[r, c]
        elif w == 4:
            d4 = out[at:end].view(np.int32)
            for r in range(rows):
                d4[r] = a[r, c]
        else:
            d8 = out[at:end].view(np.int64)
            for r in range(rows):
                d8[r] = a[r, c]
        at = end
    return at


def narrow_arrays_numpy(matrices, vectors):
    """`narrow_arrays` in numpy array operations (no per-value Python): what the program
    digest uses without numba. Same bytes (`tests/test_compact.py`)."""
    size, width = _python(_narrow_size), _python(_width)  # the compiled helpers' own Python
    arrays = list(matrices) + [v.reshape(-1, 1) for v in vectors]
    out = np.empty(sum(size(*a.shape) for a in arrays), np.uint8)
    at = 0
    for a in arrays:
        out[at:at + 16].view(np.int64)[:] = a.shape
        at += 16
        for col in a.T:
            w = width(*((int(col.min()), int(col.max())) if col.size else (0, 0)))
            out[at] = w
            at += 1
            end = at + w * col.size
            out[at:end].view(f"<i{w}")[:] = col
            at = end
    return out[:at]


def _python(f):
    """The Python function behind a numba-compiled one (itself without numba)."""
    return getattr(f, "py_func", f)
