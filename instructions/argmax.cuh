// ARGMAX: token = first index of the maximum logit; NaN counts as the maximum, like
// torch.argmax  (ir.ArgmaxParams)
#pragma once
#include "common.cuh"

AMK_DEVICE bool amk_argmax_better(float a, int ia, float b, int ib) {
  const bool an = amk_isnan(a), bn = amk_isnan(b);
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}

AMK_DEVICE long long amk_smem_argmax(const AmkTask&) { return 2 * AMK_WARP_SIZE; }

AMK_DEVICE void amk_op_argmax(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  float* red = amk_smem(c, amk_smem_argmax(t));
  if (!red) return;
  int* red_i = (int*)(red + AMK_WARP_SIZE);
  const AmkOperand& x = amk_in(c, AMK_ROLE_LOGITS);
  const AmkBuffer& xb = amk_buf(c, x);
  const int n = t.ip[AMK_P_N];
  float best = amk_neg_inf();
  int bi = n;  // sentinel: loses to any real index
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = amk_load(xb, amk_flat(x, i));
    if (bi == n || amk_argmax_better(v, i, best, bi)) best = v, bi = i;
  }
#pragma unroll
  for (int m = AMK_WARP_SIZE / 2; m > 0; m >>= 1) {
    const float ov = amk_shfl_xor(best, m);
    const int oi = amk_shfl_xor_int(bi, m);
    if (oi != n && (bi == n || amk_argmax_better(ov, oi, best, bi))) best = ov, bi = oi;
  }
  if (amk_lane() == 0) red[amk_warp()] = best, red_i[amk_warp()] = bi;
  amk_syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < amk_nwarps(); ++w)
      if (red_i[w] != n && (red_i[0] == n || amk_argmax_better(red[w], red_i[w], red[0], red_i[0])))
        red[0] = red[w], red_i[0] = red_i[w];
    const AmkOperand& y = t.out[0];
    amk_store_int(amk_buf(c, y), amk_flat(y, 0), red_i[0] == n ? 0 : red_i[0]);
  }
}
