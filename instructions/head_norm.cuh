// HEAD_NORM: RMSNorm over each head separately  (ir.HeadNormParams)
#pragma once
#include "rmsnorm.cuh"
#include "rope.cuh"

AMK_DEVICE void amk_op_head_norm(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int hd = t.ip[AMK_P_HEADS_HEAD_DIM], heads = t.ip[AMK_P_HEADS_HEADS];
  float* xs = amk_smem(c, amk_smem_heads(t));
  if (!xs) return;
  amk_stage(c, xs, amk_in(c, AMK_ROLE_X), heads * hd);
  const AmkOperand& g = amk_in(c, AMK_ROLE_GAMMA);
  const AmkOperand& y = t.out[0];
  const AmkBuffer& yb = amk_buf(c, y);
  for (int h = amk_warp(); h < heads; h += amk_nwarps()) {
    float* head = xs + h * hd;
    amk_warp_head_norm(c, head, hd, g, t.fp[AMK_F_HEADS_EPS], yb.dtype);
    for (int i = amk_lane(); i < hd; i += AMK_WARP_SIZE) amk_store(yb, amk_flat(y, (amk_i64)h * hd + i), head[i]);
  }
}
