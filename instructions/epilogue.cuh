// The GEMV / split-K REDUCE epilogue: what happens to each finished row value
// a = rnd(acc (+ bias))  (ir.GemvParams, "Order of the epilogue").
//   STORE y = a;  ADD y = residual + a;  SILU_MUL y = rnd(silu(a_gate)) * rnd(a_up);
//   ROPE / ROPE_APPEND: per head optional head RMSNorm, then rotate-half RoPE;
//   APPEND: cache row[pos] = a.
// rnd rounds to y's dtype (the half-precision rounding points of ir.py Numerics, where the
// unfused ops' stores would round); for an F32 y it does nothing.
#pragma once
#include "argmax.cuh"
#include "common.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"

// The epilogue operands that do not depend on the rows: the residual (ADD), the bias, the
// RoPE frequencies and the position. The GEMV prologue stages them in shared memory with its
// own loads (amk_epi_stage_*), so that the epilogue makes no dependent global load after the
// rows: each was an L2 round trip taken while the other SMs stream weights. Words:
// residual[n_res] | bias[n_bias] | inv_freq[n_freq] | pos (an int's bits, if has_pos).
struct AmkEpiStage {
  int n_res, n_bias, n_freq, has_pos;
  AMK_DEVICE int values() const { return n_res + n_bias + n_freq; }
  AMK_DEVICE int words() const { return values() + has_pos; }
};

AMK_DEVICE AmkEpiStage amk_epi_stage_of(const AmkTask& t) {
  const int ep = t.ip[AMK_P_EPILOGUE], rows = t.ip[AMK_P_ROWS];
  const bool rope = ep == AMK_EPILOGUE_ROPE || ep == AMK_EPILOGUE_ROPE_APPEND;
  AmkEpiStage s;
  s.n_res = ep == AMK_EPILOGUE_ADD ? rows : 0;
  s.n_bias = AMK_EPI_BIAS && t.ip[AMK_P_HAS_BIAS] != 0 ? rows : 0;
  s.n_freq = rope ? rows / 2 : 0;  // head_dim/2 frequencies for each head (ir.GemvParams)
  s.has_pos = rope || ep == AMK_EPILOGUE_APPEND ? 1 : 0;
  return s;
}

// Residual row i of an ADD epilogue; with split-K partials (ir.GemvParams residual_partials)
// read as the REDUCE they replace would have stored it (vec.cuh amk_plus_partial_sum; the sum
// by amk_ordered_sum, as the REDUCE sums). The residual's and the partials' loads are
// independent: one round trip for up to AMK_X_PARTS_UNROLL partials. (A GEMV's epilogue reads
// its residual staged: amk_epi_stage_word.)
AMK_DEVICE float amk_residual_at(const AmkCtx& c, amk_i64 i) {
  const AmkOperand& res = amk_in(c, AMK_ROLE_RESIDUAL);
  const float v = amk_in_at(c, res, i);
  if (!AMK_GEMV_PARTIALS || !amk_has(c, AMK_ROLE_RES_PART)) return v;
  const AmkOperand& part = amk_in(c, AMK_ROLE_RES_PART);
  const amk_u64 ptr = amk_buf(c, part).ptr;
  const float s = amk_ordered_sum<AMK_X_PARTS_UNROLL>(
      part.count, [&](int k) { return amk_load_as<AMK_DTYPE_F32>(ptr, part.off + (amk_i64)k * part.stride + i); },
      [](int, float p) { return p; });
  return amk_plus_partial_sum(amk_buf(c, res).dtype, v, s);
}

// Staged word i < s.words(), read from its operand (the position as an int's bits).
AMK_DEVICE float amk_epi_stage_word(const AmkCtx& c, const AmkEpiStage& s, int i) {
  if (i < s.n_res) return amk_residual_at(c, i);
  if (i < s.n_res + s.n_bias) return amk_in_at(c, amk_in(c, AMK_ROLE_BIAS), i - s.n_res);
  if (i < s.values()) return amk_in_at(c, amk_in(c, AMK_ROLE_INV_FREQ), i - s.n_res - s.n_bias);
  return __int_as_float(amk_read_pos(c, amk_in(c, AMK_ROLE_POS)));
}

// The argmax pair of the rows a GEMV stored (its second output, ir.GemvParams argmax_pair_base:
// STORE without bias, so row r stored rnd(acc[r])), as a pass of its own after the stores: only the
// LM head's tasks run it. (Kept in the store loop, a running best cost every GEMV of the build: 1B
// +1.39 %, eval/PERF_NOTES.md item 195.) The pair is two F32s of one run (the validator's rule), so
// stored without amk_flat and amk_store's dtype switch. All threads call it.
AMK_DEVICE void amk_epilogue_pair(const AmkCtx& c, const float* acc, int rows, int dt, float* red) {
  float best = 0.0f;
  int bi = AMK_ARGMAX_NONE;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) amk_argmax_take(best, bi, amk_round(dt, acc[r]), r);
  int* red_i = (int*)(red + AMK_WARP_SIZE);
  amk_argmax_warps(best, bi, red, red_i);
  if (threadIdx.x == 0) {
    const AmkOperand& y = c.t->out[1];
    float* pair = (float*)amk_buf(c, y).ptr + y.off;
    amk_argmax_of_warps(red, red_i);
    pair[0] = red[0];
    pair[1] = (float)(c.t->ip[AMK_P_ARGMAX_PAIR_BASE] + amk_argmax_found(red_i));  // exact: base + rows <= 2^24
  }
}

// acc: rows*m fp32 accumulators in shared memory (element (r, j) at r*m + j, j=0 gate or
// plain, j=1 up), written by this block and complete (a barrier precedes the call).
// staged: the operands amk_epi_stage_of names, in shared memory, or nullptr (read them here).
// All threads call it. May rewrite acc in place (bias add, head norm).
// pair_red: 2 * AMK_WARP_SIZE words of shared memory for the argmax pair of the values a GEMV
// stores (its second output, ir.GemvParams argmax_pair_base; STORE only), else nullptr.
AMK_DEVICE void amk_epilogue(const AmkCtx& c, float* acc, int rows, const float* staged, float* pair_red = nullptr) {
  const AmkTask& t = *c.t;
  const int ep = t.ip[AMK_P_EPILOGUE];
  const AmkOperand& y = t.out[0];
  const AmkBuffer& yb = amk_buf(c, y);
  const AmkEpiStage es = amk_epi_stage_of(t);
  int pos = 0;
  if (es.has_pos) {
    pos = staged ? __float_as_int(staged[es.values()]) : amk_read_pos(c, amk_in(c, AMK_ROLE_POS));
    if (!amk_check_pos(c, pos)) return;
  }
  const bool has_bias = AMK_EPI_BIAS && t.ip[AMK_P_HAS_BIAS] != 0;
  const AmkOperand* bias = has_bias ? &amk_in(c, AMK_ROLE_BIAS) : nullptr;
  const float* bias_s = staged ? staged + es.n_res : nullptr;
  auto bias_at = [&](amk_i64 i) { return bias_s ? bias_s[i] : amk_in_at(c, *bias, i); };
  const int dt = yb.dtype;
  const bool compiled = ep >= 0 && ep < 32 && AMK_WITH_EPILOGUE(ep);  // else reported as unknown below
  switch (compiled ? ep : -1) {
    case AMK_EPILOGUE_STORE:
    case AMK_EPILOGUE_ADD:
    case AMK_EPILOGUE_APPEND: {
      if constexpr (!AMK_WITH_EPILOGUE(AMK_EPILOGUE_STORE) && !AMK_WITH_EPILOGUE(AMK_EPILOGUE_ADD) &&
                    !AMK_WITH_EPILOGUE(AMK_EPILOGUE_APPEND))
        break;
      const AmkOperand* res = ep == AMK_EPILOGUE_ADD ? &amk_in(c, AMK_ROLE_RESIDUAL) : nullptr;
      for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        float a = acc[r];
        if (bias) a = amk_add(a, bias_at(r));
        a = amk_round(dt, a);
        // (read before the in-place store; unstaged only in a REDUCE, which has no residual partials)
        if (res) a = amk_add(staged ? staged[r] : amk_in_at(c, *res, r), a);
        amk_store(yb, amk_out_index(y, yb, pos, r), a);
      }
      if (AMK_GEMV_ARGMAX && pair_red != nullptr) amk_epilogue_pair(c, acc, rows, dt, pair_red);
#if AMK_DIAG_DEAD_CODE
      // Diagnostic (eval/PERF_NOTES.md item 197): code that never runs (rows >= 1, the validator's
      // rule, which the compiler cannot know), one register chain, ~3 KB of sm_90 code per unit over
      // both inlined copies (3: item 195's 9.7 KB), where item 195's pair sat: what code costs by
      // its size alone.
      if (rows < 0) {
        float v = acc[threadIdx.x];
#pragma unroll
        for (int i = 0; i < 64 * AMK_DIAG_DEAD_CODE; ++i) v = __sinf(v + (float)i);
        amk_store(yb, threadIdx.x, v);
      }
#endif
      break;
    }
    case AMK_EPILOGUE_SILU_MUL:
      if constexpr (!AMK_WITH_EPILOGUE(AMK_EPILOGUE_SILU_MUL)) break;
      for (int r = threadIdx.x; r < rows; r += blockDim.x)
        amk_store(yb, amk_flat(y, r),
                  amk_mul(amk_round(dt, amk_silu(amk_round(dt, acc[2 * r]))), amk_round(dt, acc[2 * r + 1])));
      break;
    case AMK_EPILOGUE_ROPE:
    case AMK_EPILOGUE_ROPE_APPEND: {
      if constexpr (!AMK_WITH_EPILOGUE(AMK_EPILOGUE_ROPE) && !AMK_WITH_EPILOGUE(AMK_EPILOGUE_ROPE_APPEND)) break;
      const int hd = t.ip[AMK_P_HEAD_DIM];
      const int heads = hd > 0 ? rows / hd : 0;
      if (heads * hd != rows || (hd & 1)) {
        if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, rows, hd);
        return;
      }
      const bool head_norm = AMK_EPI_HEAD_NORM && t.ip[AMK_P_HAS_HEAD_NORM] != 0;
      for (int h = amk_warp(); h < heads; h += amk_nwarps()) {
        float* head = acc + h * hd;
        for (int i = amk_lane(); i < hd; i += AMK_WARP_SIZE) {
          float a = head[i];
          if (bias) a = amk_add(a, bias_at((amk_i64)h * hd + i));
          head[i] = amk_round(dt, a);
        }
        amk_syncwarp();
        if (head_norm) amk_warp_head_norm(c, head, hd, amk_in(c, AMK_ROLE_HEAD_GAMMA), t.fp[AMK_F_HEAD_NORM_EPS], dt);
        amk_warp_rope(c, head, hd, pos, amk_in(c, AMK_ROLE_INV_FREQ), staged ? staged + es.n_res + es.n_bias : nullptr,
                      h * (hd / 2), y, (amk_i64)h * hd);
      }
      break;
    }
    default:
      if (threadIdx.x == 0) amk_report(c, AMK_ERR_BAD_OP, ep);
  }
}

// Values per output row: 2 for the fused gate/up pair (opspec.gemv_rows_width).
AMK_DEVICE int amk_row_width(const AmkTask& t) { return t.ip[AMK_P_EPILOGUE] == AMK_EPILOGUE_SILU_MUL ? 2 : 1; }
