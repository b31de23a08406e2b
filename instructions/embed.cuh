// EMBED: x = table[token, c0:c0+n]  (ir.EmbedParams)
#pragma once
#include "common.cuh"

AMK_DEVICE long long amk_smem_embed(const AmkTask&) { return 0; }

AMK_DEVICE void amk_op_embed(const AmkCtx& c) {
  const AmkOperand& tok = amk_in(c, AMK_ROLE_TOKEN);
  const AmkOperand& tab = amk_in(c, AMK_ROLE_TABLE);
  const AmkOperand& y = c.t->out[0];
  const AmkBuffer& tb = amk_buf(c, tab);
  const AmkBuffer& yb = amk_buf(c, y);
  const int token = amk_load_int(amk_buf(c, tok), amk_flat(tok, 0));
  if (token < 0 || token >= tab.count) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_TOKEN_RANGE, token, tab.count);
    return;
  }
  const amk_i64 row = tab.off + (amk_i64)token * tab.stride;
  for (int i = threadIdx.x; i < y.len; i += blockDim.x) amk_store(yb, amk_flat(y, i), amk_load(tb, row + i));
}
