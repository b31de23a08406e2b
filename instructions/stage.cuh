// Weight staging: the first rows of a GEMV task's weight slab(s), copied into shared memory
// by bulk copies (the TMA on sm_90 and sm_100) while the block still runs the GEMV before it.
//
// Why: the GEMVs' rows phases read their first rows with a memory round trip per batch of
// loads; staged rows cost only shared-memory reads. When: bulk copies in flight delay every
// latency-bound load of the SM and of the memory system (prologues, attention, the combine:
// eval/PERF_NOTES.md item 40), so a task is staged only during the rows phase of the GEMV
// before it in the queue, which streams weights anyway: after that GEMV's prologue.
//
// Protocol (vm/megakernel.cu): the block owns two staging regions of `cap` bytes, each with an
// mbarrier. Task k of the queue owns region k % 2 and the (k / 2)-th phase of its barrier, so
// its parity is (k / 2) % 2. Every task's phase is begun exactly once, by one thread (the
// stager): task 0's at the queue start, with no bytes; task k+1's during task k, by the GEMV
// (with its planned rows) or, when task k is no GEMV, at task k's start, with no bytes. A GEMV
// waits for its phase before its first staged row; before a region is reused, and before the
// block exits, the stager waits for its last phase, so no copy lands in memory in use.
// Producer and consumer agree on what is staged through amk_stage_plan and the one rule "only
// a task that follows a GEMV is staged".
#pragma once
#include "common.cuh"

// Builds that compile staging in: the generic one and those of float-weight programs. A
// quantized program's float GEMV is only its LM head (too large to gain from a prefix), and
// the staging code pushed the sm_90 int4 build from 24 / 88 to 80 / 248 spilled bytes.
// vm/loader.py's stage_compiled() mirrors this.
#define AMK_STAGE_ON \
  (AMK_HAS_STAGE && ((AMK_GEMV_WDTYPES) == 0x3f || !(AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_I8) || AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_U4))))

// What of a GEMV task is staged: rows 0..rows-1 of W (and of W2 for a pair), each row_bytes,
// in this order in the region: W's rows, then W2's.
struct AmkStagePlan {
  int rows, row_bytes, mats;
  AMK_DEVICE unsigned bytes() const { return (unsigned)rows * (unsigned)row_bytes * (unsigned)mats; }
};

// Float weights only: a second (staged) copy of the quantized row loops costs the int4 build
// ~2x its spills, over the budget of tests/test_vm_compile.py.
AMK_DEVICE constexpr bool amk_stage_dtype(int dt) {
  return dt == AMK_DTYPE_F32 || dt == AMK_DTYPE_BF16 || dt == AMK_DTYPE_F16;
}

// A matrix can be staged when its slab rows are whole 16-byte vectors at 16-byte aligned
// addresses (the bulk copy's rules); row_bytes is then the bytes of one row's K slice.
AMK_DEVICE bool amk_stage_row_ok(const AmkBuffer& b, const AmkOperand& o, int K, int& row_bytes) {
  const long long bits = amk_dtype_bits(b.dtype);
  if (!amk_stage_dtype(b.dtype) || (K * bits) % 128 != 0 || (o.off * bits) % 128 != 0 || (o.stride * bits) % 128 != 0) return false;
  row_bytes = (int)(K * bits / 8);
  return (b.ptr + o.off * bits / 8) % 16 == 0;
}

// The plan for task t (W operand w of buffer wb; the pair's second matrix w2 / w2b or nullptr)
// with `cap` bytes of region: as many whole rows as fit, none if the task is no GEMV.
AMK_DEVICE AmkStagePlan amk_stage_plan(const AmkTask& t, const AmkBuffer& wb, const AmkOperand& w,
                                       const AmkBuffer* w2b, const AmkOperand* w2, int cap) {
  AmkStagePlan p{0, 0, w2 != nullptr ? 2 : 1};
  if (t.op != AMK_OP_GEMV || cap <= 0) return p;
#ifdef AMK_STAGE_NO_ROWS
  if (AMK_STAGE_NO_ROWS) return p;  // experiment: the shared-memory carve-out without staging
#endif
  const int K = t.ip[AMK_P_K_HI] - t.ip[AMK_P_K_LO];
  int rb2 = 0;
  if (K <= 0 || !amk_stage_row_ok(wb, w, K, p.row_bytes)) return p;
  if (w2 != nullptr && (!amk_stage_row_ok(*w2b, *w2, K, rb2) || rb2 != p.row_bytes)) return p;
  const int fit = cap / (p.mats * p.row_bytes);
  p.rows = t.ip[AMK_P_ROWS] < fit ? t.ip[AMK_P_ROWS] : fit;
  return p;
}

// Copy task t's planned rows into region (t, bufs: the shared-memory copies of the next task's
// record and W / W2 descriptors, so that the issue waits on no global load: read from the
// global tables it cost ~4 us a task) and begin the region's phase expecting their bytes.
AMK_DEVICE void amk_stage_issue(const AmkTask& t, const AmkBuffer* bufs, char* region, unsigned long long* bar,
                                int cap) {
  AmkStagePlan p{0, 0, 1};
  const AmkOperand* w = nullptr;
  const AmkOperand* w2 = nullptr;
  if (t.op == AMK_OP_GEMV && t.role[AMK_ROLE_W] >= 0) {
    w = &t.in[t.role[AMK_ROLE_W]];
    if (t.role[AMK_ROLE_W2] >= 0) w2 = &t.in[t.role[AMK_ROLE_W2]];
    p = amk_stage_plan(t, bufs[w->buf], *w, w2 ? &bufs[w2->buf] : nullptr, w2, cap);
  }
  amk_stage_expect(bar, p.bytes());
  for (int m = 0; m < p.mats && p.rows > 0; ++m) {
    const AmkOperand& o = m == 0 ? *w : *w2;
    const AmkBuffer& b = bufs[o.buf];
    const long long bits = amk_dtype_bits(b.dtype);
    const char* src = (const char*)b.ptr + o.off * bits / 8;
    char* dst = region + (long long)m * p.rows * p.row_bytes;
    const long long stride = o.stride * bits / 8;
    if (stride == p.row_bytes) {  // back-to-back rows: one copy
      amk_stage_copy(dst, src, p.bytes() / p.mats, bar);
    } else {
      for (int r = 0; r < p.rows; ++r) amk_stage_copy(dst + (long long)r * p.row_bytes, src + r * stride, p.row_bytes, bar);
    }
  }
}

// The block's staging state, in shared memory (so that the ops carry one pointer, AmkCtx::stage,
// not a handful of registers). Written by the stager thread only: the task fields before the
// op's start barrier, `begun` whenever it begins a phase.
struct alignas(8) AmkStage {
  unsigned long long bar[2];  // the mbarriers of the two regions
  char* regions;              // two regions of cap bytes (0: staging is off)
  int cap, stager, queue_len;
  int task, task_cap;         // the running task's index in the queue; cap its stager used (0: none)
  int begun;                  // tasks of the queue whose phase has begun
  AmkTask next;               // the next task's record, W and W2 descriptors (slots 0, 1)
  AmkBuffer next_bufs[2];

  // Begin task k's phase: its planned rows with `with_cap` bytes of region (t, bufs), none with 0.
  AMK_DEVICE void begin(int k, const AmkTask* t, const AmkBuffer* bufs, int with_cap) {
    const int j = k & 1;
    if (k >= 2) amk_stage_wait(&bar[j], ((k >> 1) - 1) & 1);  // the region's last reader is done
    if (with_cap > 0) amk_stage_issue(*t, bufs, regions + j * (long long)cap, &bar[j], with_cap);
    else amk_stage_expect(&bar[j], 0);
    begun = k + 1;
  }
  // Wait for the last phase of both regions (before the block exits).
  AMK_DEVICE void drain() {
    for (int k = begun - 2 < 0 ? 0 : begun - 2; k < begun; ++k) amk_stage_wait(&bar[k & 1], (k >> 1) & 1);
  }
};

// Called by a GEMV after its prologue (every thread; the stager acts): stage the next task.
AMK_DEVICE void amk_stage_next(const AmkCtx& c) {
  if (!AMK_STAGE_ON) return;
  AmkStage& s = *c.stage;
  if ((int)threadIdx.x == s.stager && s.cap > 0 && s.begun == s.task + 1 && s.task + 1 < s.queue_len)
    s.begin(s.task + 1, &s.next, s.next_bufs, s.cap);
}

// The rows of a task that are staged in shared memory: row r < rows of W at p + r * row_bytes,
// of W2 at p + (rows + r) * row_bytes.
struct AmkStaged {
  const char* p;
  int rows, row_bytes;
};

// A GEMV's staged rows (the plan its stager used), once they have landed. Every thread.
AMK_DEVICE AmkStaged amk_staged_rows(const AmkCtx& c) {
  AmkStage& s = *c.stage;
  if (!AMK_STAGE_ON || s.task_cap <= 0) return AmkStaged{nullptr, 0, 0};
  const AmkOperand& w = amk_in(c, AMK_ROLE_W);
  const bool pair = amk_has(c, AMK_ROLE_W2);
  const AmkOperand* w2 = pair ? &amk_in(c, AMK_ROLE_W2) : nullptr;
  const AmkStagePlan p = amk_stage_plan(*c.t, amk_buf(c, w), w, pair ? &amk_buf(c, *w2) : nullptr, w2, s.task_cap);
  if (p.rows > 0) amk_stage_wait(&s.bar[s.task & 1], (s.task >> 1) & 1);
  return AmkStaged{s.regions + (s.task & 1) * (long long)s.cap, p.rows, p.row_bytes};
}
