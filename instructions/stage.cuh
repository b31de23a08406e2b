// Weight staging: the first rows of a GEMV task's weight slab(s), copied into shared memory
// by bulk copies (the TMA on sm_90+) while the block still runs the task before it.
//
// Why: the small GEMVs (q/k/v, o) are latency bound, not bandwidth bound: each warp's rows
// are a few dependent memory round trips. The L2 prefetch during the wait (vm/megakernel.cu)
// only starts at the wait, and the op still pays an L2 round trip per batch of loads. A slab
// staged in shared memory during the previous task costs the op only its shared-memory reads,
// and the bytes arrive while HBM would otherwise idle (attention, combine, hops).
//
// Protocol (vm/megakernel.cu): the block owns two staging regions of `cap` bytes, each with an
// mbarrier. Thread 0 stages the k-th task of its queue into region k % 2 at the start of task
// k-1 (task 0: at its own start); every task begins exactly one phase of its region's barrier
// (zero bytes when nothing is staged), so the phase parity of task k is (k / 2) % 2. A GEMV
// waits for that phase before its first staged row; before a region is reused, and before the
// block exits, thread 0 waits for its last phase, so no copy lands in memory that is reused.
// Producer and consumer compute what is staged with the same function, amk_stage_plan.
#pragma once
#include "common.cuh"

struct alignas(8) AmkStageBars {
  unsigned long long bar[2];  // the mbarriers of the block's two regions
};

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
  const int K = t.ip[AMK_P_K_HI] - t.ip[AMK_P_K_LO];
  int rb2 = 0;
  if (K <= 0 || !amk_stage_row_ok(wb, w, K, p.row_bytes)) return p;
  if (w2 != nullptr && (!amk_stage_row_ok(*w2b, *w2, K, rb2) || rb2 != p.row_bytes)) return p;
  const int fit = cap / (p.mats * p.row_bytes);
  p.rows = t.ip[AMK_P_ROWS] < fit ? t.ip[AMK_P_ROWS] : fit;
  return p;
}

// Thread 0: begin the region's next phase and copy task t's planned rows into it. t is the
// record in the global table (bufs: the global buffer table), which may be a later task.
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
