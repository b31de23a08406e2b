// REDUCE: sum the split-K partials of a GEMV, then run its epilogue  (ir.ReduceParams)
#pragma once
#include "epilogue.cuh"

AMK_DEVICE long long amk_smem_reduce(const AmkTask& t) { return (long long)t.ip[AMK_P_ROWS] * amk_row_width(t); }

AMK_DEVICE void amk_op_reduce(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  float* acc = amk_smem(c, amk_smem_reduce(t));
  if (!acc) return;
  const AmkOperand& p = amk_in(c, AMK_ROLE_PARTIALS);
  const AmkBuffer& pb = amk_buf(c, p);
  const int n = t.ip[AMK_P_ROWS] * amk_row_width(t), splits = t.ip[AMK_P_SPLIT_K];
  constexpr int U = 16;  // partials loaded before the first add (config.split_k <= 16: one batch)
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    float s = 0.0f;
#pragma unroll 1
    for (int k0 = 0; k0 < splits; k0 += U) {
      float v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (k0 + u < splits) v[u] = amk_load(pb, p.off + (amk_i64)(k0 + u) * p.stride + e);
#pragma unroll
      for (int u = 0; u < U; ++u)  // split order 0, 1, ... as the reference sums
        if (k0 + u < splits) s = k0 + u == 0 ? v[u] : amk_add(s, v[u]);
    }
    acc[e] = s;
  }
  amk_syncthreads();
  amk_epilogue(c, acc, t.ip[AMK_P_ROWS]);
}
