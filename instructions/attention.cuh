// ATTN_PARTIAL and ATTN_COMBINE: split-KV decode attention for one KV head  (ir.AttnPartialParams,
// ir.AttnCombineParams).
//
// ATTN_PARTIAL computes exactly sum_j exp(t_j - m) v_j with m the split's maximum (no online
// rescaling): pass 1 computes every score t_j = scale * q.k_j (one warp per position, the
// head's k row in registers, all q heads) and the maximum; the first `score_cap` scores per
// head stay in shared memory, later ones are recomputed in pass 2 (bit-identical: same code).
// Pass 2 walks tiles of AMK_ATTN_TILE positions: p = exp(t - m) into shared memory, then each
// thread accumulates its (head, dim) outputs over the tile.
//
// Shared memory (words): qs[QH*hd] | o[QH*hd] | m[QH] | l[QH] | wmax[nwarps*QH] | p[QH*TILE] | cache[QH*cap]
#pragma once
#include "common.cuh"

#ifndef AMK_ATTN_TILE
#define AMK_ATTN_TILE 64
#endif
#define AMK_ATTN_MAX_KREG (AMK_MAX_HEAD_DIM / AMK_WARP_SIZE)

AMK_DEVICE long long amk_smem_attn_partial(const AmkTask& t, int nwarps) {
  const long long qh = t.ip[AMK_P_ATTN_Q_HEADS], hd = t.ip[AMK_P_ATTN_HEAD_DIM];
  return 2 * qh * hd + 2 * qh + nwarps * qh + qh * AMK_ATTN_TILE + qh * t.ip[AMK_P_ATTN_SCORE_CAP];
}

// One warp: the scores of position j for every q head; `emit(h, t)` runs in lane 0.
template <typename Emit>
AMK_DEVICE void amk_attn_scores(const AmkBuffer& kb, const AmkOperand& k, const float* qs, int j, int hd, int qh,
                                float scale, Emit emit) {
  const int lane = amk_lane();
  float kr[AMK_ATTN_MAX_KREG];
#pragma unroll
  for (int i = 0; i < AMK_ATTN_MAX_KREG; ++i) {
    const int d = lane + i * AMK_WARP_SIZE;
    kr[i] = d < hd ? amk_load(kb, amk_kv(k, kb, j, d)) : 0.0f;
  }
  for (int h = 0; h < qh; ++h) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < AMK_ATTN_MAX_KREG; ++i) {
      const int d = lane + i * AMK_WARP_SIZE;
      if (d < hd) s += qs[h * hd + d] * kr[i];
    }
    s = amk_warp_sum(s);
    if (lane == 0) emit(h, amk_mul(s, scale));
  }
}

AMK_DEVICE void amk_op_attn_partial(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int hd = t.ip[AMK_P_ATTN_HEAD_DIM], qh = t.ip[AMK_P_ATTN_Q_HEADS];
  const int splits = t.ip[AMK_P_ATTN_SPLITS], split = t.ip[AMK_P_ATTN_SPLIT], block = t.ip[AMK_P_ATTN_BLOCK];
  const int cap = t.ip[AMK_P_ATTN_SCORE_CAP];
  const float scale = t.fp[AMK_F_ATTN_SCALE];
  const int nw = amk_nwarps(), warp = amk_warp(), lane = amk_lane();
  constexpr int T = AMK_ATTN_TILE;
  if (hd > AMK_MAX_HEAD_DIM) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, hd);
    return;
  }
  float* qs = amk_smem(c, amk_smem_attn_partial(t, nw));
  if (!qs) return;
  float* o = qs + qh * hd;
  float* mh = o + qh * hd;
  float* lh = mh + qh;
  float* wmax = lh + qh;
  float* pt = wmax + nw * qh;
  float* cache = pt + qh * T;

  const int pos = amk_read_pos(c, amk_in(c, AMK_ROLE_POS));
  if (!amk_check_pos(c, pos)) return;
  const int len = pos + 1;
  const int per = (len + splits - 1) / splits;
  const int chunk = (per + block - 1) / block * block;
  const int j0 = split * chunk;
  const int j1 = min(j0 + chunk, len);

  const AmkOperand &q = amk_in(c, AMK_ROLE_Q), &k = amk_in(c, AMK_ROLE_K), &v = amk_in(c, AMK_ROLE_V);
  const AmkBuffer &qb = amk_buf(c, q), &kb = amk_buf(c, k), &vb = amk_buf(c, v);
  for (int i = threadIdx.x; i < qh * hd; i += blockDim.x) qs[i] = amk_load(qb, amk_flat(q, i)), o[i] = 0.0f;
  for (int i = threadIdx.x; i < nw * qh; i += blockDim.x) wmax[i] = amk_neg_inf();
  amk_syncthreads();

  // pass 1: scores and the per-head maximum
  for (int j = j0 + warp; j < j1; j += nw)
    amk_attn_scores(kb, k, qs, j, hd, qh, scale, [&](int h, float s) {
      wmax[warp * qh + h] = fmaxf(wmax[warp * qh + h], s);
      if (j - j0 < cap) cache[h * cap + (j - j0)] = s;
    });
  amk_syncthreads();
  for (int h = threadIdx.x; h < qh; h += blockDim.x) {
    float m = amk_neg_inf();
    for (int w = 0; w < nw; ++w) m = fmaxf(m, wmax[w * qh + h]);
    mh[h] = m;
    lh[h] = 0.0f;
  }
  amk_syncthreads();

  // pass 2: p = exp(t - m); o += p v; l += p
  for (int jt = j0; jt < j1; jt += T) {
    const int tn = min(T, j1 - jt);
    for (int jj = warp; jj < tn; jj += nw) {
      const int j = jt + jj;
      if (j - j0 < cap) {
        for (int h = lane; h < qh; h += AMK_WARP_SIZE) pt[h * T + jj] = amk_exp(amk_sub(cache[h * cap + (j - j0)], mh[h]));
      } else {
        amk_attn_scores(kb, k, qs, j, hd, qh, scale,
                        [&](int h, float s) { pt[h * T + jj] = amk_exp(amk_sub(s, mh[h])); });
      }
    }
    amk_syncthreads();
    for (int i = threadIdx.x; i < qh * hd; i += blockDim.x) {
      const int h = i / hd, d = i - h * hd;
      float a = o[i];
      for (int jj = 0; jj < tn; ++jj) a += pt[h * T + jj] * amk_load(vb, amk_kv(v, vb, jt + jj, d));
      o[i] = a;
    }
    for (int h = threadIdx.x; h < qh; h += blockDim.x) {
      float l = lh[h];
      for (int jj = 0; jj < tn; ++jj) l = amk_add(l, pt[h * T + jj]);
      lh[h] = l;
    }
    amk_syncthreads();
  }

  const AmkOperand &oo = t.out[0], &ml = t.out[1];
  const AmkBuffer &ob = amk_buf(c, oo), &mb = amk_buf(c, ml);
  for (int i = threadIdx.x; i < qh * hd; i += blockDim.x) amk_store(ob, amk_flat(oo, i), o[i]);
  for (int h = threadIdx.x; h < qh; h += blockDim.x) {
    amk_store(mb, amk_flat(ml, 2 * h), mh[h]);
    amk_store(mb, amk_flat(ml, 2 * h + 1), lh[h]);
  }
}

// ATTN_COMBINE: o = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
AMK_DEVICE void amk_op_attn_combine(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int hd = t.ip[AMK_P_ATTN_HEAD_DIM], qh = t.ip[AMK_P_ATTN_Q_HEADS], splits = t.ip[AMK_P_ATTN_SPLITS];
  const AmkOperand &po = amk_in(c, AMK_ROLE_O), &ml = amk_in(c, AMK_ROLE_ML), &y = t.out[0];
  const AmkBuffer &pb = amk_buf(c, po), &mb = amk_buf(c, ml), &yb = amk_buf(c, y);
  for (int i = threadIdx.x; i < qh * hd; i += blockDim.x) {
    const int h = i / hd, d = i - h * hd;
    float mx = amk_neg_inf();
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, amk_load(mb, amk_flat(ml, 2 * (s * qh + h))));
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float w = amk_exp(amk_sub(amk_load(mb, amk_flat(ml, 2 * (s * qh + h))), mx));
      num = amk_add(num, amk_mul(w, amk_load(pb, amk_flat(po, ((amk_i64)s * qh + h) * hd + d))));
      den = amk_add(den, amk_mul(w, amk_load(mb, amk_flat(ml, 2 * (s * qh + h) + 1))));
    }
    amk_store(yb, amk_flat(y, i), amk_div(num, den));
  }
}
