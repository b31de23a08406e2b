// ARGMAX: token = first index of the maximum logit; NaN counts as the maximum, like
// torch.argmax  (ir.ArgmaxParams). A PARTIAL task scans a slice and writes its (max, index)
// pair; a MERGE task picks the token from the slices' pairs (several blocks scan at once).
#pragma once
#include "common.cuh"
#include "vec.cuh"

#ifndef AMK_ARGMAX_UNROLL
#define AMK_ARGMAX_UNROLL 4  // 16-byte loads in flight per thread
#endif

#define AMK_ARGMAX_NONE 0x7fffffff  // "no index yet": loses to any real one

AMK_DEVICE bool amk_argmax_better(float a, int ia, float b, int ib) {
  const bool an = amk_isnan(a), bn = amk_isnan(b);
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}

// (best, bi) becomes (v, i) if (v, i) is a candidate and beats it (or there is none yet).
AMK_DEVICE void amk_argmax_keep(float& best, int& bi, float v, int i) {
  if (i != AMK_ARGMAX_NONE && (bi == AMK_ARGMAX_NONE || amk_argmax_better(v, i, best, bi))) best = v, bi = i;
}

// (best, bi) becomes (val, i) where it beats it, for a thread that sees its indices in increasing
// order: so an equal value never replaces the best. Take the first element (even -inf: all -inf
// gives index 0, as torch), a larger value, or the first NaN. Selects, where the general
// comparison branched per element: the op 32.3 -> 24.2 us (PERF_NOTES item 42).
AMK_DEVICE void amk_argmax_take(float& best, int& bi, float val, int i) {
  const bool take = bi == AMK_ARGMAX_NONE || val > best || (amk_isnan(val) && !amk_isnan(best));
  best = take ? val : best;
  bi = take ? i : bi;
}

// Every warp's best (best, bi) into red[warp], red_i[warp], then a barrier: all threads call it.
AMK_DEVICE void amk_argmax_warps(float best, int bi, float* red, int* red_i) {
#pragma unroll
  for (int m = AMK_WARP_SIZE / 2; m > 0; m >>= 1) {
    const float ov = amk_shfl_xor(best, m);
    amk_argmax_keep(best, bi, ov, amk_shfl_xor_int(bi, m));
  }
  if (amk_lane() == 0) red[amk_warp()] = best, red_i[amk_warp()] = bi;
  amk_syncthreads();
}

// Thread 0's, after amk_argmax_warps: the block's best into red[0], red_i[0].
AMK_DEVICE void amk_argmax_of_warps(float* red, int* red_i) {
  for (int w = 1; w < amk_nwarps(); ++w) amk_argmax_keep(red[0], red_i[0], red[w], red_i[w]);
}

// The index of amk_argmax_of_warps's best (0 where there was none).
AMK_DEVICE int amk_argmax_found(const int* red_i) { return red_i[0] == AMK_ARGMAX_NONE ? 0 : red_i[0]; }

// This thread's best over the 16-byte vectors of x[0:n) (x contiguous from element `off`);
// returns how many leading elements the vectors covered (0 when x is not 16-byte aligned).
// The winner does not depend on which thread saw which element: ties go to the lower index.
template <int DT>
AMK_DEVICE int amk_argmax_vec(const AmkBuffer& xb, amk_i64 off, int n, float& best, int& bi) {
  using F = AmkWFmt<DT>;
  constexpr int U = AMK_ARGMAX_UNROLL;
  const char* base = (const char*)xb.ptr + off * (F::BITS / 8);
  if (((unsigned long long)base) % 16 != 0) return 0;
  const int nvec = n / F::VEC;
#pragma unroll 1
  for (int v0 = threadIdx.x; v0 < nvec; v0 += blockDim.x * U) {
    amk_u32x4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * (int)blockDim.x < nvec) raw[u] = amk_ld16(base + (amk_i64)(v0 + u * blockDim.x) * 16);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * blockDim.x;
      if (v >= nvec) break;
#pragma unroll
      for (int j = 0; j < F::VEC; ++j) amk_argmax_take(best, bi, F::get(raw[u], j), v * F::VEC + j);
    }
  }
  return nvec * F::VEC;
}

// The vector path where this build compiles DT (AMK_DTYPES); else the element loop does it all.
template <int DT>
AMK_DEVICE int amk_argmax_vec_if(const AmkBuffer& xb, amk_i64 off, int n, float& best, int& bi) {
  if constexpr (AMK_WITH_DTYPE(DT)) return amk_argmax_vec<DT>(xb, off, n, best, bi);
  else return 0;
}

AMK_DEVICE long long amk_smem_argmax(const AmkTask&) { return 2 * AMK_WARP_SIZE; }

AMK_DEVICE void amk_op_argmax(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  float* red = amk_smem(c, amk_smem_argmax(t));
  if (!red) return;
  int* red_i = (int*)(red + AMK_WARP_SIZE);
  const AmkOperand& x = amk_in(c, AMK_ROLE_LOGITS);
  const AmkBuffer& xb = amk_buf(c, x);
  const int n = t.ip[AMK_P_N], mode = t.ip[AMK_P_ARGMAX_MODE];
  float best = amk_neg_inf();
  int bi = AMK_ARGMAX_NONE;
  if (mode == AMK_ARGMAXMODE_MERGE) {  // n (value, index) pairs: the index breaks ties
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
      const float v = amk_load(xb, amk_flat(x, 2 * k));
      const int i = (int)amk_load(xb, amk_flat(x, 2 * k + 1));
      amk_argmax_keep(best, bi, v, i);
    }
  } else {
    int done = 0;  // elements covered by 16-byte vectors
    if (x.count <= 1) {
      if (xb.dtype == AMK_DTYPE_F32) done = amk_argmax_vec_if<AMK_DTYPE_F32>(xb, x.off, n, best, bi);
      else if (xb.dtype == AMK_DTYPE_BF16) done = amk_argmax_vec_if<AMK_DTYPE_BF16>(xb, x.off, n, best, bi);
      else if (xb.dtype == AMK_DTYPE_F16) done = amk_argmax_vec_if<AMK_DTYPE_F16>(xb, x.off, n, best, bi);
    }
    for (int i = done + threadIdx.x; i < n; i += blockDim.x) amk_argmax_keep(best, bi, amk_load(xb, amk_flat(x, i)), i);
  }
  amk_trace_mark(c, 0);  // thread 0's scan done
  amk_argmax_warps(best, bi, red, red_i);
  amk_trace_mark(c, 1);  // every warp's best in
  if (threadIdx.x == 0) {
    amk_argmax_of_warps(red, red_i);
    const AmkOperand& y = t.out[0];
    const AmkBuffer& yb = amk_buf(c, y);
    const int found = amk_argmax_found(red_i);
    if (mode == AMK_ARGMAXMODE_PARTIAL) {  // (max, base + index), exact in fp32 (base + n <= 2^24)
      amk_store(yb, amk_flat(y, 0), red[0]);
      amk_store(yb, amk_flat(y, 1), (float)(t.ip[AMK_P_ARGMAX_BASE] + found));
    } else {
      amk_store_int(yb, amk_flat(y, 0), found);
    }
  }
}
