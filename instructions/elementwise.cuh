// SILU_MUL: y = silu(gate) * up, silu rounded to y's dtype first  (ir.SiluMulParams);
// ADD: y = a + b  (ir.AddParams)
#pragma once
#include "common.cuh"

AMK_DEVICE void amk_op_silu_mul(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const AmkOperand &g = amk_in(c, AMK_ROLE_GATE), &u = amk_in(c, AMK_ROLE_UP), &y = t.out[0];
  const AmkBuffer &gb = amk_buf(c, g), &ub = amk_buf(c, u), &yb = amk_buf(c, y);
  for (int i = threadIdx.x; i < t.ip[AMK_P_N]; i += blockDim.x)
    amk_store(yb, amk_flat(y, i),
              amk_mul(amk_round(yb.dtype, amk_silu(amk_load(gb, amk_flat(g, i)))), amk_load(ub, amk_flat(u, i))));
}

AMK_DEVICE void amk_op_add(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const AmkOperand &a = amk_in(c, AMK_ROLE_A), &b = amk_in(c, AMK_ROLE_B), &y = t.out[0];
  const AmkBuffer &ab = amk_buf(c, a), &bb = amk_buf(c, b), &yb = amk_buf(c, y);
  for (int i = threadIdx.x; i < t.ip[AMK_P_N]; i += blockDim.x)
    amk_store(yb, amk_flat(y, i), amk_add(amk_load(ab, amk_flat(a, i)), amk_load(bb, amk_flat(b, i))));
}
