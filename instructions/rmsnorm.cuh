// RMSNORM: y = x[col:col+n] * rsqrt(mean(x^2) + eps) * gamma  (ir.RmsNormParams)
// Also the shared pieces of every RMSNorm: the block-wide inverse RMS, the scaling of one
// element (amk_rms_apply, also the GEMV prologue's) and the per-head (one warp) norm used
// by HEAD_NORM and the GEMV/REDUCE rope epilogue.
#pragma once
#include "common.cuh"
#include "vec.cuh"

// rsqrt(ss / n + eps): the inverse RMS from a sum of squares over n elements.
AMK_DEVICE float amk_inv_rms(float ss, int n, float eps) { return amk_rsqrt(amk_add(amk_div(ss, (float)n), eps)); }

// rsqrt(mean_{i<n} x[i]^2 + eps) over the first n elements of a flat operand; all threads.
AMK_DEVICE float amk_block_inv_rms(const AmkCtx& c, const AmkOperand& x, int n, float eps, float* red) {
  float ss = 0.0f;
  amk_for_elems(amk_buf(c, x), x, 0, n, [&](int, float v) { ss += v * v; });
  return amk_inv_rms(amk_block_sum(ss, red), n, eps);
}

// One normalised element: rnd(rnd(x * r) * g), rnd rounding to dtype `dt` (HF: weight *
// (x * r).to(half)); for F32 it is (x * r) * g.
AMK_DEVICE float amk_rms_apply(float x, float r, float g, int dt) {
  return amk_round(dt, amk_mul(amk_round(dt, amk_mul(x, r)), g));
}

// One warp normalises a head held in shared memory in place: h = h * rsqrt(mean(h^2)+eps) * g,
// with the rounding points of dtype `dt` (the output buffer's).
AMK_DEVICE void amk_warp_head_norm(const AmkCtx& c, float* h, int hd, const AmkOperand& g, float eps, int dt) {
  const AmkBuffer& gb = amk_buf(c, g);
  float ss = 0.0f;
  for (int i = amk_lane(); i < hd; i += AMK_WARP_SIZE) ss += h[i] * h[i];
  ss = amk_warp_sum(ss);
  const float r = amk_rsqrt(amk_add(amk_div(ss, (float)hd), eps));
  for (int i = amk_lane(); i < hd; i += AMK_WARP_SIZE) h[i] = amk_rms_apply(h[i], r, amk_load(gb, amk_flat(g, i)), dt);
  amk_syncwarp();
}

AMK_DEVICE long long amk_smem_rmsnorm(const AmkTask&) { return AMK_WARP_SIZE; }

AMK_DEVICE void amk_op_rmsnorm(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  float* red = amk_smem(c, amk_smem_rmsnorm(t));
  if (!red) return;
  const AmkOperand& x = amk_in(c, AMK_ROLE_X);
  const AmkOperand& g = amk_in(c, AMK_ROLE_GAMMA);
  const AmkOperand& y = t.out[0];
  const int hidden = t.ip[AMK_P_NORM_HIDDEN], col = t.ip[AMK_P_NORM_COL];
  const float r = amk_block_inv_rms(c, x, hidden, t.fp[AMK_F_NORM_EPS_RMS], red);
  const AmkBuffer &xb = amk_buf(c, x), &gb = amk_buf(c, g), &yb = amk_buf(c, y);
  for (int i = threadIdx.x; i < y.len; i += blockDim.x) {
    const float v = amk_rms_apply(amk_load(xb, amk_flat(x, col + i)), r, amk_load(gb, amk_flat(g, i)), yb.dtype);
    amk_store(yb, amk_flat(y, i), v);
  }
}
