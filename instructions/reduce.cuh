// REDUCE: sum the split-K partials of a GEMV, then run its epilogue  (ir.ReduceParams)
#pragma once
#include "epilogue.cuh"
#include "vec.cuh"

AMK_DEVICE long long amk_smem_reduce(const AmkTask& t) { return (long long)t.ip[AMK_P_ROWS] * amk_row_width(t); }

// acc[e] = sum over the splits of the partials, in split order 0, 1, ... as the reference
// sums; typed loads (amk_float_dispatch).
struct AmkReduceSums {
  amk_u64 ptr;
  const AmkOperand& p;
  float* acc;
  int n, splits;
  template <int DT>
  AMK_DEVICE void run() const {
    for (int e = threadIdx.x; e < n; e += blockDim.x)
      acc[e] = amk_ordered_sum<AMK_SPLIT_SUM_UNROLL>(
          splits, [&](int k) { return amk_load_as<DT>(ptr, p.off + (amk_i64)k * p.stride + e); },
          [](int, float v) { return v; });
  }
};

AMK_DEVICE void amk_op_reduce(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  float* acc = amk_smem(c, amk_smem_reduce(t));
  if (!acc) return;
  const AmkOperand& p = amk_in(c, AMK_ROLE_PARTIALS);
  const AmkBuffer& pb = amk_buf(c, p);
  const int n = t.ip[AMK_P_ROWS] * amk_row_width(t), splits = t.ip[AMK_P_SPLIT_K];
  const bool ok = amk_float_dispatch(pb.dtype, AmkReduceSums{pb.ptr, p, acc, n, splits});
  if (!ok) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, pb.dtype);
    return;
  }
  amk_syncthreads();
  amk_epilogue(c, acc, t.ip[AMK_P_ROWS], nullptr);
}
