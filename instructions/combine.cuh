// The split-KV attention combine, shared by ATTN_COMBINE (one KV head a task) and the GEMV's
// combine prologue (every KV head, into the o-proj's staged x; ir.GemvParams combine_*):
//   o[h] = sum_s exp(m_s,h - M_h) o_s,h / sum_s exp(m_s,h - M_h) l_s,h,  M_h = max_s m_s,h.
// The partials' layout is ATTN_PARTIAL's: [groups (KV heads), splits, q_heads, head_dim] and
// (m, l) pairs [groups, splits, q_heads]; with one group it is ATTN_COMBINE's operand.
#pragma once
#include "common.cuh"
#include "vec.cuh"

struct AmkCombineShape {
  int groups, qh, hd, splits;
  AMK_DEVICE int heads() const { return groups * qh; }
  AMK_DEVICE int pairs() const { return groups * splits * qh; }  // (m, l) pairs
};

// Shared memory (words): m (then the weights) | l | the denominators.
AMK_DEVICE long long amk_combine_smem_words(AmkCombineShape s) { return 2ll * s.pairs() + s.heads(); }

// Stage every (m, l) pair with parallel loads: wm[i] = m, ls[i] = l, i = (g * S + s) * qh + qi.
AMK_DEVICE void amk_combine_stage_ml(const AmkBuffer& mb, const AmkOperand& ml, AmkCombineShape s, float* wm,
                                     float* ls) {
  for (int i = threadIdx.x; i < s.pairs(); i += blockDim.x) {
    wm[i] = amk_load(mb, amk_flat(ml, 2 * i));
    ls[i] = amk_load(mb, amk_flat(ml, 2 * i + 1));
  }
}

// Each split's weight exp(m - M) in place of m, and each head's denominator: a warp per head,
// its lanes over the splits, a fixed reduction tree. An empty split (m = -inf) weighs 0.
AMK_DEVICE void amk_combine_weights(AmkCombineShape s, float* wm, const float* ls, float* den) {
  for (int h = amk_warp(); h < s.heads(); h += amk_nwarps()) {
    const int g = amk_quot(h, s.qh);
    const int w0 = g * s.splits * s.qh + (h - g * s.qh);  // split s of head h: w0 + s * qh
    float mx = amk_neg_inf();
    for (int k = amk_lane(); k < s.splits; k += AMK_WARP_SIZE) mx = fmaxf(mx, wm[w0 + k * s.qh]);
    mx = amk_warp_max(mx);
    float d = 0.0f;
    for (int k = amk_lane(); k < s.splits; k += AMK_WARP_SIZE) {
      const float w = amk_exp(amk_sub(wm[w0 + k * s.qh], mx));
      wm[w0 + k * s.qh] = w;
      d = amk_add(d, amk_mul(w, ls[w0 + k * s.qh]));
    }
    d = amk_warp_sum(d);
    if (amk_lane() == 0) den[h] = d;
  }
}

// Every output i in [0, heads * hd), its splits summed in order, then store(i, value). Split s
// of output i (head h, group g) is partial element off + i + g * (S - 1) * n + s * step, n =
// qh * hd: the lowering gives each split one run of n (or one run for all), so there is no
// division; other layouts (one group only) take amk_flat. Where a thread has 4 outputs or more
// anyway (the GEMV prologue's every head), F32 partials of 4-aligned runs are summed 4 outputs
// at a time with 16-byte loads; with fewer (ATTN_COMBINE: one output a thread) each thread
// keeps its output's AMK_SPLIT_SUM_UNROLL split loads in flight at once, one round trip for
// up to 16 splits where the vector loop's batches would take two.
// The split layout both loops read: split k of output i at off + i + k * step (in its group)
// where the partials are one run of n = qh * hd elements a split (or one run for all).
AMK_DEVICE amk_i64 amk_split_step(const AmkOperand& po, amk_i64 n) { return po.count <= 1 ? n : po.stride; }
AMK_DEVICE bool amk_split_runs(const AmkOperand& po, amk_i64 n) { return po.count <= 1 || po.len == n; }

// Output i's head h, its group g and the first of its split weights w0 (split k at w0 + k * qh).
// By divisions: their shifts (amk_quot) cost the int4 and int8 1B 0.4 % here (eval/PERF_NOTES.md
// item 188, where this loop runs: the quantized builds' ATTN_COMBINE, without AMK_COMBINE_EARLY).
struct AmkCombineHead {
  int h, g, w0;
};
AMK_DEVICE AmkCombineHead amk_combine_head(AmkCombineShape s, int i) {
  const int h = i / s.hd, g = h / s.qh;
  return {h, g, g * s.splits * s.qh + h % s.qh};
}

template <class Store>
struct AmkCombineOutputs {
  amk_u64 ptr;
  const AmkOperand& po;
  const float* wm;
  const float* den;
  AmkCombineShape s;
  Store store;
  template <int DT>
  AMK_DEVICE void run() const {
    const amk_i64 n = (amk_i64)s.qh * s.hd, step = amk_split_step(po, n);
    const bool runs = amk_split_runs(po, n);
    const bool many = s.heads() * s.hd >= 4 * (int)blockDim.x;
    if (DT == AMK_DTYPE_F32 && many && runs && s.hd % 4 == 0 && step % 4 == 0 && (ptr + 4 * po.off) % 16 == 0) {
      for (int j = threadIdx.x; j < s.heads() * s.hd / 4; j += blockDim.x) sum4(j * 4, step);
      return;
    }
    for (int i = threadIdx.x; i < s.heads() * s.hd; i += blockDim.x) {
      const AmkCombineHead at = amk_combine_head(s, i);
      const int h = at.h, g = at.g, w0 = at.w0;
      const amk_i64 base = po.off + i + g * (s.splits - 1) * n;
      const float num = amk_ordered_sum<AMK_SPLIT_SUM_UNROLL>(
          s.splits, [&](int k) { return amk_load_as<DT>(ptr, runs ? base + k * step : amk_flat(po, k * n + i)); },
          [&](int k, float o) { return amk_mul(wm[w0 + k * s.qh], o); });
      store(i, amk_div(num, den[h]));
    }
  }
  // outputs i .. i + 3 (one head): the splits' 16-byte loads batched, each sum in split order
  AMK_DEVICE void sum4(int i, amk_i64 step) const {
    constexpr int U = AMK_SPLIT_SUM_UNROLL / 2;  // 16-byte loads in flight
    const AmkCombineHead at = amk_combine_head(s, i);
    const int h = at.h, g = at.g, w0 = at.w0;
    const float* base = (const float*)ptr + po.off + i + (amk_i64)g * (s.splits - 1) * s.qh * s.hd;
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int k0 = 0; k0 < s.splits; k0 += U) {
      amk_u32x4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (k0 + u < s.splits) v[u] = amk_ld16(base + (k0 + u) * step);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (k0 + u < s.splits) {
          const float w = wm[w0 + (k0 + u) * s.qh];
          const float o[4] = {__uint_as_float(v[u].x), __uint_as_float(v[u].y), __uint_as_float(v[u].z),
                              __uint_as_float(v[u].w)};
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = k0 + u == 0 ? amk_mul(w, o[e]) : amk_add(a[e], amk_mul(w, o[e]));
        }
    }
    for (int e = 0; e < 4; ++e) store(i + e, amk_div(a[e], den[h]));
  }
};
template <class Store>
AMK_DEVICE AmkCombineOutputs<Store> amk_combine_outputs(amk_u64 ptr, const AmkOperand& po, const float* wm,
                                                        const float* den, AmkCombineShape s, Store store) {
  return AmkCombineOutputs<Store>{ptr, po, wm, den, s, store};
}

// AMK_COMBINE_EARLY: where ATTN_COMBINE has one output a thread, at most AMK_SPLIT_SUM_UNROLL
// splits and F32 partials in runs, each thread loads its output's split values at the op's
// start, beside the (m, l) pairs, so that their L2 round trip (the partials were just written by
// other SMs) overlaps the staging's and the weights' instead of following them. The sum is the
// same, in split order. Measured (eval/PERF_NOTES.md item 131, paired): SmolLM2 shape -1.3 %,
// 1B -1.5 %. The int4 builds spill with it (sm_90 int4_ahead 68 / 132 B), so they keep the loop
// that loads after. The int8 builds spilled with it too in session 40 (item 126) but no longer do;
// on an H200 (item 224) the int8 SmolLM2 shape (the plain loop) measured -0.96 % with it and the
// int8 1B (the loads-ahead loop, set by the loader's -D) +0.23 %, so int8 builds of the
// loads-ahead loop keep it off, as do the asymmetric int8 builds (sm_90 spills 4 / 4 B).
// 2 (eval/PERF_NOTES.md item 256): the splits copied into shared memory instead, with asynchronous
// copies (amk_cp_async16: no register holds them, so no build spills for them), issued at the op's
// start as 1's loads are and waited for after the weights; any number of splits, one group, F32
// partials in 16-byte-aligned runs (AmkCombineCopied::fits). The same sum, in split order. On an H200
// against 0: the int4 SmolLM2 shape -0.80 / -0.92 %, the int4 1B -1.28 %, the int8 1B -0.99 %, so the
// int4 builds and the symmetric int8 builds of the loads-ahead loop take it; against 1 the bf16
// SmolLM2 shape +2.25 %, so the float builds keep 1. The asymmetric int8 builds keep 0 (not measured),
// as does the every-dtype build (both quantized formats: sm_120 spills 48 / 64 B with 2).
#ifndef AMK_COMBINE_EARLY
#if ((AMK_GEMV_WDTYPES) & 0x10) != 0 && (AMK_GEMV_I8_ZERO || ((AMK_GEMV_WDTYPES) & 0x20) != 0)
#define AMK_COMBINE_EARLY 0
#elif ((AMK_GEMV_WDTYPES) & 0x20) != 0 || (((AMK_GEMV_WDTYPES) & 0x10) != 0 && AMK_GEMV_LOADS_AHEAD)
#define AMK_COMBINE_EARLY 2
#else
#define AMK_COMBINE_EARLY 1
#endif
#endif
struct AmkCombineHeld {
  float v[AMK_SPLIT_SUM_UNROLL];
  // can this task hold its outputs' splits in registers? (one group, one output a thread)
  AMK_DEVICE static bool fits(const AmkBuffer& pb, const AmkOperand& po, AmkCombineShape s) {
    const amk_i64 n = (amk_i64)s.qh * s.hd;
    return AMK_COMBINE_EARLY == 1 && s.groups == 1 && n <= (amk_i64)blockDim.x && s.splits <= AMK_SPLIT_SUM_UNROLL &&
           pb.dtype == AMK_DTYPE_F32 && amk_split_runs(po, n);
  }
  AMK_DEVICE void load(amk_u64 ptr, const AmkOperand& po, AmkCombineShape s, int i) {
    const amk_i64 step = amk_split_step(po, (amk_i64)s.qh * s.hd);
#pragma unroll
    for (int k = 0; k < AMK_SPLIT_SUM_UNROLL; ++k)
      if (k < s.splits) v[k] = ((const float*)ptr)[po.off + i + k * step];
  }
  // (h: the output's head, amk_quot(i, s.hd), which the caller has for the denominator)
  AMK_DEVICE float sum(const float* wm, AmkCombineShape s, int h) const {
    float a = 0.0f;
#pragma unroll
    for (int k = 0; k < AMK_SPLIT_SUM_UNROLL; ++k)
      if (k < s.splits) a = k == 0 ? amk_mul(wm[h], v[0]) : amk_add(a, amk_mul(wm[k * s.qh + h], v[k]));
    return a;
  }
};
// AMK_COMBINE_EARLY=2: the splits of every output copied into shared memory, split k's n outputs at
// words [k * n, (k + 1) * n) of its own 16-byte-aligned area after the combine's other words.
AMK_DEVICE long long amk_combine_copied_at(AmkCombineShape s) { return (amk_combine_smem_words(s) + 3) & ~3ll; }
AMK_DEVICE long long amk_combine_copied_words(AmkCombineShape s) { return (long long)s.splits * s.qh * s.hd; }
struct AmkCombineCopied {
  AMK_DEVICE static bool fits(const AmkBuffer& pb, const AmkOperand& po, AmkCombineShape s) {
    const amk_i64 n = (amk_i64)s.qh * s.hd, step = amk_split_step(po, n);
    return AMK_COMBINE_EARLY == 2 && s.groups == 1 && pb.dtype == AMK_DTYPE_F32 && amk_split_runs(po, n) &&
           n % 4 == 0 && step % 4 == 0 && (pb.ptr + 4 * po.off) % 16 == 0;
  }
  // Every thread issues its share of the 16-byte copies: chunk e of split k, walked without a division.
  AMK_DEVICE_NOINLINE static void copy(amk_u64 ptr, const AmkOperand& po, AmkCombineShape s, float* dst) {
    const int n4 = s.qh * s.hd / 4;
    const amk_i64 step = amk_split_step(po, 4ll * n4);
    const float* src = (const float*)ptr + po.off;
    int k = 0, e = threadIdx.x;
    for (;;) {
      while (e >= n4 && k < s.splits) e -= n4, ++k;
      if (k >= s.splits) break;
      amk_cp_async16(dst + 4 * (k * n4 + e), src + k * step + 4 * e);
      e += blockDim.x;
    }
  }
  // Output i's splits summed in split order, as AmkCombineHeld::sum does (their shared-memory reads
  // batched, AMK_SPLIT_SUM_UNROLL at a time, rather than one a dependent step)
  AMK_DEVICE static float sum(const float* copied, const float* wm, AmkCombineShape s, int h, int i) {
    const int n = s.qh * s.hd;
    return amk_ordered_sum<AMK_SPLIT_SUM_UNROLL>(
        s.splits, [&](int k) { return copied[k * n + i]; }, [&](int k, float o) { return amk_mul(wm[k * s.qh + h], o); });
  }
};
