// KV_APPEND: cache[pos, off:off+n] = src  (ir.KvAppendParams)
#pragma once
#include "common.cuh"

AMK_DEVICE void amk_op_kv_append(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int pos = amk_read_pos(c, amk_in(c, AMK_ROLE_POS));
  if (!amk_check_pos(c, pos)) return;
  const AmkOperand& src = amk_in(c, AMK_ROLE_SRC);
  const AmkOperand& y = t.out[0];
  const AmkBuffer &sb = amk_buf(c, src), &yb = amk_buf(c, y);
  const int n = t.ip[AMK_P_N];
  for (int i = threadIdx.x; i < n; i += blockDim.x) amk_store(yb, amk_out_index(y, yb, pos, i), amk_load(sb, amk_flat(src, i)));
}
