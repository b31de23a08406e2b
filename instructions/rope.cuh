// ROPE: rotate-half RoPE per head at the runtime position  (ir.RopeParams)
// amk_warp_rope is shared with the GEMV/REDUCE ROPE and ROPE_APPEND epilogues.
#pragma once
#include "common.cuh"
#include "vec.cuh"

// AMK_DIAG_ROPE_TRIG (diagnostic, off; traces only, other numerics): cos and sin by the fast
// intrinsics, which took the q and k tasks' epilogue from 1.84 to 1.67 us in the SmolLM2 shape's
// trace (sincosf: 1.76; eval/PERF_NOTES.md item 225).
#ifndef AMK_DIAG_ROPE_TRIG
#define AMK_DIAG_ROPE_TRIG 0
#endif

// One warp rotates a head h[0:hd) (shared memory) and stores it to elements
// e0 .. e0+hd of output operand y (flat, or KV row pos for kv == APPEND):
//   y[i] = h[i] cos - h[i+d/2] sin,  y[i+d/2] = h[i+d/2] cos + h[i] sin,  angle = pos * inv_freq[i],
// cos, sin and each product rounded to y's dtype (HF's half-precision RoPE; F32: no-ops).
// cos and sin come from one sincosf (one range reduction, one copy of its slow path in the code):
// the bits of cosf and sinf (`python -m amk.eval.trig_bits`: 0 of 31.4 M angles differ on the H100
// and the H200), SmolLM2 shape -0.48 %, 1B -0.41 % on the H200 (items 68 and 225).
// The head's frequencies are inv_freq[f0 : f0 + hd/2) (a GEMV epilogue's head h: f0 = h * hd/2;
// the standalone ROPE op shares f0 = 0); freq_s: inv_freq already in shared memory (the GEMV
// prologue staged it), or nullptr.
AMK_DEVICE void amk_warp_rope(const AmkCtx& c, const float* h, int hd, int pos, const AmkOperand& inv_freq,
                              const float* freq_s, int f0, const AmkOperand& y, amk_i64 e0) {
  const AmkBuffer& fb = amk_buf(c, inv_freq);
  const AmkBuffer& yb = amk_buf(c, y);
  const int half = hd / 2;
  const float p = (float)pos;
  const int dt = yb.dtype;
  for (int i = amk_lane(); i < half; i += AMK_WARP_SIZE) {
    const float ang = amk_mul(p, freq_s ? freq_s[f0 + i] : amk_load(fb, amk_flat(inv_freq, f0 + i)));
#if AMK_DIAG_ROPE_TRIG
    const float cs = amk_round(dt, __cosf(ang)), sn = amk_round(dt, __sinf(ang));
#else
    float sn_f, cs_f;
    amk_sincos(ang, &sn_f, &cs_f);
    const float cs = amk_round(dt, cs_f), sn = amk_round(dt, sn_f);
#endif
    const float x1 = h[i], x2 = h[i + half];
    amk_store(yb, amk_out_index(y, yb, pos, e0 + i),
              amk_sub(amk_round(dt, amk_mul(x1, cs)), amk_round(dt, amk_mul(x2, sn))));
    amk_store(yb, amk_out_index(y, yb, pos, e0 + i + half),
              amk_add(amk_round(dt, amk_mul(x2, cs)), amk_round(dt, amk_mul(x1, sn))));
  }
}

AMK_DEVICE long long amk_smem_heads(const AmkTask& t) {
  return (long long)t.ip[AMK_P_HEADS_HEADS] * t.ip[AMK_P_HEADS_HEAD_DIM];
}

// Stage x (heads*hd values) into shared memory as fp32; all threads; ends with a barrier.
AMK_DEVICE void amk_stage(const AmkCtx& c, float* dst, const AmkOperand& x, int n) {
  amk_for_elems(amk_buf(c, x), x, 0, n, [&](int i, float v) { dst[i] = v; });
  amk_syncthreads();
}

AMK_DEVICE void amk_op_rope(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int hd = t.ip[AMK_P_HEADS_HEAD_DIM], heads = t.ip[AMK_P_HEADS_HEADS];
  float* xs = amk_smem(c, amk_smem_heads(t));
  if (!xs) return;
  const int pos = amk_read_pos(c, amk_in(c, AMK_ROLE_POS));
  if (!amk_check_pos(c, pos)) return;
  amk_stage(c, xs, amk_in(c, AMK_ROLE_X), heads * hd);
  for (int h = amk_warp(); h < heads; h += amk_nwarps())
    amk_warp_rope(c, xs + h * hd, hd, pos, amk_in(c, AMK_ROLE_INV_FREQ), nullptr, 0, t.out[0], (amk_i64)h * hd);
}
