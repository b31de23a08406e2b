// REDUCE: sum the split-K partials of a GEMV, then run its epilogue  (ir.ReduceParams)
#pragma once
#include "epilogue.cuh"
#include "vec.cuh"

AMK_DEVICE long long amk_smem_reduce(const AmkTask& t) { return (long long)t.ip[AMK_P_ROWS] * amk_row_width(t); }

AMK_DEVICE void amk_op_reduce(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  float* acc = amk_smem(c, amk_smem_reduce(t));
  if (!acc) return;
  const AmkOperand& p = amk_in(c, AMK_ROLE_PARTIALS);
  const AmkBuffer& pb = amk_buf(c, p);
  const int n = t.ip[AMK_P_ROWS] * amk_row_width(t), splits = t.ip[AMK_P_SPLIT_K];
  for (int e = threadIdx.x; e < n; e += blockDim.x)  // split order 0, 1, ... as the reference sums
    acc[e] = amk_ordered_sum<16>(
        splits, [&](int k) { return amk_load(pb, p.off + (amk_i64)k * p.stride + e); }, [](int, float v) { return v; });
  amk_syncthreads();
  amk_epilogue(c, acc, t.ip[AMK_P_ROWS]);
}
