// GEMV: a slab of rows of y = W x, with the RMSNorm prologue, quantized weights, split-K
// partials and the fused epilogues  (ir.GemvParams).
//
// Layout of the work: x (normalised when the prologue is on) is staged once into shared
// memory as fp32; each warp owns rows r = warp, warp + nwarps, ... and streams its row with
// 16-byte loads, several of them in flight per lane (AMK_GEMV_UNROLL[_Q]), accumulating in fp32; one warp
// reduction per row lands in the shared accumulator array, which the epilogue finishes.
// The weight slab is immutable, so the scheduler prefetches it into L2 before the task's
// waits; coarse slabs (many rows per task) keep many bytes in flight per SM.
//
// Shared memory (4-byte words): xs[round4(K)] | acc[rows * m] | red[32] | xsums[round4(K / 32)]
#pragma once
#include "epilogue.cuh"
#include "rmsnorm.cuh"
#include "vec.cuh"

// 16-byte loads in flight per lane (per matrix): float formats, quantized formats (whose
// vectors carry 16 or 32 weights and so need more registers to unpack).
#ifndef AMK_GEMV_UNROLL
#define AMK_GEMV_UNROLL 8  // 254 registers on sm_80/sm_90 without spills (12 spills)
#endif
#ifndef AMK_GEMV_UNROLL_Q
#define AMK_GEMV_UNROLL_Q 8  // HIP and the CPU emulator; CUDA picks per architecture (vm/arch_cuda.h)
#endif

AMK_DEVICE long long amk_round4(long long n) { return (n + 3) & ~3ll; }

// The U4 zero term needs sum(x) over each 32-column vector of codes (AmkWFmt<U4>::VEC).
#define AMK_XSUM_CHUNK 32

AMK_DEVICE long long amk_smem_gemv(const AmkTask& t) {
  const long long k = t.ip[AMK_P_K_HI] - t.ip[AMK_P_K_LO];
  return amk_round4(k) + amk_round4((long long)t.ip[AMK_P_ROWS] * amk_row_width(t)) + AMK_WARP_SIZE +
         amk_round4(k / AMK_XSUM_CHUNK) + (t.ip[AMK_P_HAS_NORM] != 0 ? amk_round4(k) : 0);  // .. | norm weights
}

// One weight matrix of the task: rows x [k_lo, k_hi) plus its quantization companions.
struct AmkGemvW {
  const AmkBuffer* wb;
  amk_i64 off, stride;  // elements: row r starts at off + r * stride
  const AmkBuffer* sb;  // scale tile (I8, U4) or nullptr
  amk_i64 soff, sstride;
  const AmkBuffer* zb;  // zero tile (U4) or nullptr
  amk_i64 zoff, zstride;
  int group, g0, k_lo;  // scale column of slice column c: (k_lo + c) / group - g0
};

AMK_DEVICE AmkGemvW amk_gemv_w(const AmkCtx& c, int role_w, int role_s, int role_z) {
  AmkGemvW w;
  const AmkOperand& o = amk_in(c, role_w);
  w.wb = &amk_buf(c, o);
  w.off = o.off;
  w.stride = o.stride;
  w.sb = w.zb = nullptr;
  w.soff = w.sstride = w.zoff = w.zstride = 0;
  w.group = w.wb->group > 0 ? w.wb->group : 1;
  w.k_lo = c.t->ip[AMK_P_K_LO];
  w.g0 = w.k_lo / w.group;
  if (amk_has(c, role_s)) {
    const AmkOperand& s = amk_in(c, role_s);
    w.sb = &amk_buf(c, s), w.soff = s.off, w.sstride = s.stride;
  }
  if (amk_has(c, role_z)) {
    const AmkOperand& z = amk_in(c, role_z);
    w.zb = &amk_buf(c, z), w.zoff = z.off, w.zstride = z.stride;
  }
  return w;
}

// Quantized weights come with their companions: I8 a scale, U4 a scale and a zero.
AMK_DEVICE bool amk_gemv_w_ok(const AmkGemvW& w) {
  const int dt = w.wb->dtype;
  return (dt == AMK_DTYPE_I8 || dt == AMK_DTYPE_U4) == (w.sb != nullptr) && (dt == AMK_DTYPE_U4) == (w.zb != nullptr);
}

// Dequantize a code with the scale (and zero) of its group: I8 w = q*s; U4 w = q*s + z.
AMK_DEVICE float amk_dequant(const AmkGemvW& w, float q, float s, float z) {
  if (w.sb == nullptr) return q;
  const float v = amk_mul(q, s);
  return w.zb ? amk_add(v, z) : v;
}

AMK_DEVICE float amk_w_scale(const AmkGemvW& w, int r, int c) {
  return w.sb ? amk_load(*w.sb, w.soff + r * w.sstride + (w.k_lo + c) / w.group - w.g0) : 1.0f;
}
AMK_DEVICE float amk_w_zero(const AmkGemvW& w, int r, int c) {
  return w.zb ? amk_load(*w.zb, w.zoff + r * w.zstride + (w.k_lo + c) / w.group - w.g0) : 0.0f;
}

// Element (r, c) of the slab, dequantized: the scalar path (tails, unaligned slabs).
AMK_DEVICE float amk_w_at(const AmkGemvW& w, int r, int c) {
  const float q = amk_load(*w.wb, w.off + r * w.stride + c);
  return amk_dequant(w, q, amk_w_scale(w, r, c), amk_w_zero(w, r, c));
}

// Where the scale (and zero) of a vector sits: vector v of the slice (columns v*VEC..) is in
// group (k_lo / VEC + v) / (group / VEC) - g0 of its row: a shift, because the vector path
// takes only slices inside one group or groups of a power-of-two number of vectors (every
// group size in use; amk_gemv_vec_ok sends the rest to the scalar path).
struct AmkGroupOf {
  int v0, shift;
  AMK_DEVICE int operator()(int v) const { return (v0 + v) >> shift; }
};
template <int VEC>
AMK_DEVICE bool amk_group_of(const AmkGemvW& w, int K, AmkGroupOf& g) {
  const int vpg = w.group / VEC;
  if ((w.k_lo + K - 1) / w.group == w.g0) {  // the slice lies in one group (per-channel scales)
    g.v0 = 0, g.shift = 30;
    return true;
  }
  if ((vpg & (vpg - 1)) != 0) return false;
  for (g.shift = 0; (1 << g.shift) < vpg; ++g.shift) {
  }
  g.v0 = w.k_lo / VEC - w.g0 * vpg;  // (k_lo / VEC + v) / vpg - g0 == (v0 + v) >> shift
  return true;
}

AMK_DEVICE bool amk_float_dtype(const AmkBuffer* b) {  // or no buffer
  return b == nullptr || b->dtype == AMK_DTYPE_F32 || b->dtype == AMK_DTYPE_BF16 || b->dtype == AMK_DTYPE_F16;
}

// Can every row of this matrix be streamed with aligned 16-byte vectors, one scale per vector?
// If so (and it is quantized), `grp` maps the slice's vectors to their scale columns.
template <int DT>
AMK_DEVICE bool amk_gemv_vec_ok(const AmkGemvW& w, int K, AmkGroupOf& grp) {
  using F = AmkWFmt<DT>;
  if (w.off % F::VEC != 0 || w.stride % F::VEC != 0) return false;
  const unsigned long long base = w.wb->ptr + (unsigned long long)(w.off * F::BITS / 8);
  if (base % 16 != 0) return false;
  grp = AmkGroupOf{0, 0};
  if (w.sb == nullptr) return true;
  return w.group % F::VEC == 0 && w.k_lo % F::VEC == 0 && amk_float_dtype(w.sb) && amk_float_dtype(w.zb) &&
         amk_group_of<F::VEC>(w, K, grp);
}

// Loads in flight per lane and matrix: a pair (gate/up) splits the budget between its two
// matrices, which keeps the lane's bytes in flight and the registers of a single matrix.
template <int DT, bool PAIR>
struct AmkGemvUnroll {
  static constexpr int base = (DT == AMK_DTYPE_I8 || DT == AMK_DTYPE_U4) ? AMK_GEMV_UNROLL_Q : AMK_GEMV_UNROLL;
  static constexpr int value = PAIR && base > 1 ? base / 2 : base;
};

// A row of scales (or zeros) in a float dtype, read as raw bits now and converted at use:
// no per-load dispatch on the dtype in the weight loop, and the loads stay independent.
struct AmkQRow {
  const char* p;
  int dt;
  AMK_DEVICE unsigned raw(int g) const {
    return dt == AMK_DTYPE_F32 ? ((const unsigned*)p)[g] : ((const unsigned short*)p)[g];
  }
  AMK_DEVICE float value(unsigned r) const {
    return dt == AMK_DTYPE_F32 ? __uint_as_float(r) : amk_half_to_f32(dt, (unsigned short)r);
  }
  // The aligned 4-byte word that holds element g (the ring copies words), and g's bits in it.
  // A 16-bit element's word may take the 2 bytes after the row's end: allocations are
  // padded far beyond that (torch rounds them to 512 B).
  AMK_DEVICE const void* word(int g) const {
    return (const void*)((unsigned long long)(p + (long long)g * (dt == AMK_DTYPE_F32 ? 4 : 2)) & ~3ull);
  }
  AMK_DEVICE unsigned raw_in_word(unsigned word, int g) const {
    if (dt == AMK_DTYPE_F32) return word;
    return ((unsigned long long)(p + 2ll * g) & 2ull) ? word >> 16 : word & 0xffffu;
  }
};
AMK_DEVICE AmkQRow amk_qrow(const AmkBuffer* b, amk_i64 off) {
  AmkQRow q;
  q.dt = b ? b->dtype : AMK_DTYPE_F32;
  q.p = b ? (const char*)b->ptr + off * (amk_dtype_bits(q.dt) / 8) : nullptr;
  return q;
}

// One quantized vector's contribution: scale * sum(code * x) (+ zero * sum(x) for U4).
template <int DT>
AMK_DEVICE float amk_qvec(const amk_u32x4& raw, const float* xv, float xsum, float sc, float z) {
  if constexpr (DT == AMK_DTYPE_U4) return sc * AmkWFmt<DT>::dot(raw, xv, xsum) + z * xsum;
  else return sc * AmkWFmt<DT>::dot(raw, xv);
}

// Code vector (raw) of the slice's vector v, dequantized, dotted with x: sc / z are its
// scale and zero as raw bits (quantized formats).
template <int DT>
AMK_DEVICE float amk_gemv_vec(const amk_u32x4& raw, const float* xs, const float* xsums, int v, const AmkQRow& sr,
                              unsigned sc, const AmkQRow& zr, unsigned z) {
  using F = AmkWFmt<DT>;
  const float* xv = xs + v * F::VEC;
  if constexpr (DT == AMK_DTYPE_I8 || DT == AMK_DTYPE_U4) {
    constexpr bool Z = DT == AMK_DTYPE_U4;
    return amk_qvec<DT>(raw, xv, Z ? xsums[v] : 0.0f, sr.value(sc), Z ? zr.value(z) : 0.0f);
  } else {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < F::VEC; ++j) s += F::get(raw, j) * xv[j];
    return s;
  }
}

// A row's sums over its L lanes (a power of two).
template <bool PAIR>
AMK_DEVICE void amk_gemv_lanes_sum(int L, float& s1, float& s2) {
  for (int m = L / 2; m > 0; m >>= 1) {
    s1 += amk_shfl_xor(s1, m);
    if (PAIR) s2 += amk_shfl_xor(s2, m);
  }
}

// The scale and zero rows of row r of a matrix (nullptr rows for float weights).
struct AmkQRows {
  AmkQRow s, z;
};
AMK_DEVICE AmkQRows amk_qrows(const AmkGemvW& w, int r) {
  return AmkQRows{amk_qrow(w.sb, w.soff + r * w.sstride), amk_qrow(w.zb, w.zoff + r * w.zstride)};
}
template <int DT>
AMK_DEVICE const char* amk_gemv_row_ptr(const AmkGemvW& w, int r) {
  return (const char*)w.wb->ptr + (w.off + r * w.stride) * AmkWFmt<DT>::BITS / 8;
}

// Dot of row r of w (and of w2 when PAIR) with xs[0:K), by the L lanes (a power of two) of
// the warp whose lane % L is `sub`; the result lands in all L of them. `valid` false: this
// lane group has no row (it still takes part in the shuffles). Several lane groups per warp
// keep short rows' loads in flight together: with K = 576 one row is 72 vectors, so a warp
// that walked its rows one at a time waited one memory latency per 1.1 KB. Quantized
// weights load their vectors' scales (and zeros) with the codes, before the first use, and
// apply them once per vector (xsums: the per-vector sums of xs, for the U4 zero term).
template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_row_vec(const AmkGemvW& w, const AmkGemvW& w2, const AmkGroupOf& grp, const float* xs,
                                 const float* xsums, int r, bool valid, int K, int L, int sub, float& a1, float& a2) {
  using F = AmkWFmt<DT>;
  constexpr bool Q = DT == AMK_DTYPE_I8 || DT == AMK_DTYPE_U4, Z = DT == AMK_DTYPE_U4;
  constexpr int U = AmkGemvUnroll<DT, PAIR>::value;
  const int nvec = valid ? K / F::VEC : 0;
  const char* row1 = amk_gemv_row_ptr<DT>(w, r);
  const char* row2 = PAIR ? amk_gemv_row_ptr<DT>(w2, r) : nullptr;
  AmkQRows q1{}, q2{};
  if (Q) {
    q1 = amk_qrows(w, r);
    if (PAIR) q2 = amk_qrows(w2, r);
  }
  float s1 = 0.0f, s2 = 0.0f;
#pragma unroll 1
  for (int v0 = sub; v0 < nvec; v0 += L * U) {
    amk_u32x4 raw1[U], raw2[U];
    unsigned sc1[U], sc2[U], z1[U], z2[U];  // raw bits
#pragma unroll
    for (int u = 0; u < U; ++u) {  // issue every load before the first use
      const int v = v0 + u * L;
      if (v < nvec) {
        raw1[u] = amk_ld16_weight(row1 + (amk_i64)v * 16);
        if (PAIR) raw2[u] = amk_ld16_weight(row2 + (amk_i64)v * 16);
        if constexpr (Q) {
          const int g = grp(v);
          sc1[u] = q1.s.raw(g);
          if (PAIR) sc2[u] = q2.s.raw(g);
          if constexpr (Z) {
            z1[u] = q1.z.raw(g);
            if (PAIR) z2[u] = q2.z.raw(g);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * L;
      if (v < nvec) {
        s1 += amk_gemv_vec<DT>(raw1[u], xs, xsums, v, q1.s, Q ? sc1[u] : 0u, q1.z, Z ? z1[u] : 0u);
        if (PAIR) s2 += amk_gemv_vec<DT>(raw2[u], xs, xsums, v, q2.s, Q ? sc2[u] : 0u, q2.z, Z ? z2[u] : 0u);
      }
    }
  }
  if (valid) {
    for (int col = (K / F::VEC) * F::VEC + sub; col < K; col += L) {  // tail
      s1 += amk_w_at(w, r, col) * xs[col];
      if (PAIR) s2 += amk_w_at(w2, r, col) * xs[col];
    }
  }
  amk_gemv_lanes_sum<PAIR>(L, s1, s2);
  a1 = s1;
  a2 = s2;
}

// Lanes per row: the fewest (a power of two, >= 4 so that a load instruction still covers
// whole 32-byte sectors) whose U loads each cover a row in one round.
template <int DT, bool PAIR>
AMK_DEVICE int amk_gemv_lanes(int K) {
  using F = AmkWFmt<DT>;
  constexpr int U = AmkGemvUnroll<DT, PAIR>::value;
  const int nvec = K / F::VEC;
  int L = AMK_WARP_SIZE;
  while (L > 4 && (L / 2) * U >= nvec) L >>= 1;
  return L;
}

// Scalar fallback for slabs that are not 16-byte aligned; whole warp.
template <bool PAIR>
AMK_DEVICE void amk_gemv_row_scalar(const AmkGemvW& w, const AmkGemvW& w2, const float* xs, int r, int K, float& a1,
                                    float& a2) {
  float s1 = 0.0f, s2 = 0.0f;
  for (int col = amk_lane(); col < K; col += AMK_WARP_SIZE) {
    s1 += amk_w_at(w, r, col) * xs[col];
    if (PAIR) s2 += amk_w_at(w2, r, col) * xs[col];
  }
  a1 = amk_warp_sum(s1);
  a2 = PAIR ? amk_warp_sum(s2) : 0.0f;
}

// ---------------------------------------------------------------- the weight ring
// Where cp.async exists (AMK_HAS_ASYNC_COPY), each warp streams its rows through a ring of
// AMK_GEMV_RING_SLOTS slots in the shared memory the op itself leaves free, instead of
// through registers. A round is what the register path loads at once (U vectors per lane
// and matrix, with their scale and zero words); round i goes to slot i % S, and S - 1 rounds
// stay in flight while the warp computes on one (the register path has none in flight while
// it computes: a quantized row's arithmetic and its next load ran one after the other). The
// first S - 1 rounds are issued before the task's wait (weights are immutable), so they
// arrive during the wait and the prologue. Every lane reads back only what it copied, so the
// ring needs no barrier; the sums are the register path's, in the same order.
#ifndef AMK_GEMV_RING_SLOTS
#define AMK_GEMV_RING_SLOTS 4  // 2..8; 0 turns the ring off
#endif
#ifndef AMK_RING_NOEARLY
#define AMK_RING_NOEARLY 0
#endif
#if defined(AMK_HAS_ASYNC_COPY) && AMK_GEMV_RING_SLOTS >= 2
#define AMK_GEMV_RING 1
#else
#define AMK_GEMV_RING 0
#endif
#if AMK_GEMV_RING

// A slot: n = u * M + matrix indexes a lane's vectors; lane-minor layouts keep the 16- and
// 4-byte reads of a warp free of bank conflicts.
template <int DT, bool PAIR>
struct AmkRingFmt {
  static constexpr bool Q = DT == AMK_DTYPE_I8 || DT == AMK_DTYPE_U4, Z = DT == AMK_DTYPE_U4;
  static constexpr int U = AmkGemvUnroll<DT, PAIR>::value, M = PAIR ? 2 : 1, N = U * M;
  static constexpr int CODES = N * AMK_WARP_SIZE * 16, WORDS = Q ? N * AMK_WARP_SIZE * 4 : 0;
  static constexpr int SLOT = CODES + WORDS * (Z ? 2 : 1);  // bytes, whole warp
  static AMK_DEVICE int code(int n, int lane) { return (n * AMK_WARP_SIZE + lane) * 16; }
  static AMK_DEVICE int scale(int n, int lane) { return CODES + (n * AMK_WARP_SIZE + lane) * 4; }
  static AMK_DEVICE int zero(int n, int lane) { return CODES + WORDS + (n * AMK_WARP_SIZE + lane) * 4; }
};

// A matrix as the ring's loop needs it, in bytes: row r's codes at w + r * w_row, its scales
// and zeros at s.p + r * s_row, z.p + r * z_row (a few registers, where AmkGemvW has ~18).
struct AmkRingSrc {
  const char* w;
  AmkQRow s, z;
  int w_row, s_row, z_row;  // a row's bytes fit in 32 bits (K < 2^31 / 4)
  AMK_DEVICE AmkQRow s_of(int r) const { return AmkQRow{s.p ? s.p + (long long)r * s_row : nullptr, s.dt}; }
  AMK_DEVICE AmkQRow z_of(int r) const { return AmkQRow{z.p ? z.p + (long long)r * z_row : nullptr, z.dt}; }
};
template <int DT>
AMK_DEVICE AmkRingSrc amk_ring_src(const AmkGemvW& w) {
  AmkRingSrc o;
  o.w = amk_gemv_row_ptr<DT>(w, 0);
  o.w_row = (int)(w.stride * AmkWFmt<DT>::BITS / 8);
  o.s = amk_qrow(w.sb, w.soff), o.z = amk_qrow(w.zb, w.zoff);
  o.s_row = (int)(w.sstride * (amk_dtype_bits(o.s.dt) / 8)), o.z_row = (int)(w.zstride * (amk_dtype_bits(o.z.dt) / 8));
  return o;
}

// One warp's ring: its slots, its rounds (row groups x rounds per row group), lanes per row,
// and the matrices it streams. It sits in shared memory in front of the warp's slots: read
// there each round, it holds no registers across the loop (held in registers, ~40 of them
// spilled in the quantized builds).
struct AmkRing {
  char* base;
  int slots, rounds, rpr, L;
  AmkGroupOf grp;
  AmkRingSrc src[2];
};
#define AMK_RING_HEAD 256  // bytes in front of a warp's slots, for its AmkRing
static_assert(sizeof(AmkRing) <= AMK_RING_HEAD, "the ring's header outgrew its place");

// The same plan before the wait and in the op (it depends only on the task and the launch's
// shared memory), written by lane 0 into the warp's header. nullptr: a row has a tail past its
// last whole vector (the register path takes it), or too little shared memory is left beyond
// the op's own for two slots per warp.
template <int DT, bool PAIR>
AMK_DEVICE const AmkRing* amk_ring_plan(const AmkCtx& c, const AmkGemvW& w, const AmkGemvW& w2, const AmkGroupOf& grp,
                                        int rows, int K) {
  using R = AmkRingFmt<DT, PAIR>;
  if (K % AmkWFmt<DT>::VEC != 0) return nullptr;
  const int own = (int)amk_round4(amk_smem_gemv(*c.t));  // words: the ring starts 16-byte aligned
  const int nw = amk_nwarps(), spare = own < c.smem_words ? (c.smem_words - own) * 4 / nw - AMK_RING_HEAD : 0;
  const int fit = spare > 0 ? spare / R::SLOT : 0, slots = fit < AMK_GEMV_RING_SLOTS ? fit : AMK_GEMV_RING_SLOTS;
  if (slots < 2) return nullptr;
  char* head = (char*)(c.smem + own) + amk_warp() * (AMK_RING_HEAD + slots * R::SLOT);
  AmkRing* g = (AmkRing*)head;
  if (amk_lane() == 0) {
    g->base = head + AMK_RING_HEAD;
    g->slots = slots;
    g->L = amk_gemv_lanes<DT, PAIR>(K);
    const int per_warp = AMK_WARP_SIZE / g->L, first = amk_warp() * per_warp, step = nw * per_warp;
    g->rpr = (K / AmkWFmt<DT>::VEC + g->L * R::U - 1) / (g->L * R::U);
    g->rounds = first < rows ? (rows - first + step - 1) / step * g->rpr : 0;
    g->grp = grp;
    g->src[0] = amk_ring_src<DT>(w);
    g->src[1] = PAIR ? amk_ring_src<DT>(w2) : g->src[0];
  }
  amk_syncwarp();
  return g;
}

// Round i of this warp: its lane group's row and first vector.
struct AmkRound {
  int r, v0;
};
template <int U>
AMK_DEVICE AmkRound amk_ring_round(const AmkRing& g, int i) {
  const int lane = amk_lane(), L = g.L, rpr = g.rpr;
  return AmkRound{(amk_warp() + (i / rpr) * amk_nwarps()) * (AMK_WARP_SIZE / L) + lane / L, (i % rpr) * L * U + lane % L};
}

// Copy round i (if the warp has it) into its slot and commit the group: a round past the end
// commits an empty group, so that "round i is in" is always "all but the S - 1 newest".
template <int DT, bool PAIR>
AMK_DEVICE void amk_ring_issue(const AmkRing& g, int rows, int K, int i) {
  using R = AmkRingFmt<DT, PAIR>;
  if (i < g.rounds) {
    const AmkRound rd = amk_ring_round<R::U>(g, i);
    const int lane = amk_lane(), nvec = rd.r < rows ? K / AmkWFmt<DT>::VEC : 0;
    char* slot = g.base + (i % g.slots) * R::SLOT;
#pragma unroll
    for (int j = 0; j < R::M; ++j) {
      const AmkRingSrc& src = g.src[j];
      const char* row = src.w + (long long)rd.r * src.w_row;
      const AmkQRow s = src.s_of(rd.r), z = src.z_of(rd.r);
#pragma unroll 1
      for (int u = 0; u < R::U; ++u) {  // a copy holds no registers while in flight: no unrolling
        const int v = rd.v0 + u * g.L, n = u * R::M + j;
        if (v < nvec) {
          amk_cp_async16(slot + R::code(n, lane), row + (amk_i64)v * 16);
          if constexpr (R::Q) amk_cp_async4(slot + R::scale(n, lane), s.word(g.grp(v)));
          if constexpr (R::Z) amk_cp_async4(slot + R::zero(n, lane), z.word(g.grp(v)));
        }
      }
    }
  }
  amk_cp_async_commit();
}

// The rows through the ring; `pre` rounds were issued before the wait (0 or S - 1).
template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_rows_ring(const AmkRing& g, int pre, const float* xs, const float* xsums, float* acc,
                                   int rows, int K) {
  using R = AmkRingFmt<DT, PAIR>;
  const int lane = amk_lane();
  int issued = pre;
  for (; issued < g.slots - 1; ++issued) amk_ring_issue<DT, PAIR>(g, rows, K, issued);
  float s[2] = {0.0f, 0.0f};
#pragma unroll 1
  for (int i = 0; i < g.rounds; ++i) {  // warp-uniform
    amk_ring_issue<DT, PAIR>(g, rows, K, issued++);  // into the slot read last round
    amk_cp_async_wait(g.slots - 1);
    const AmkRound rd = amk_ring_round<R::U>(g, i);
    const bool valid = rd.r < rows;
    const int nvec = valid ? K / AmkWFmt<DT>::VEC : 0;
    const char* slot = g.base + (i % g.slots) * R::SLOT;
#pragma unroll
    for (int j = 0; j < R::M; ++j) {
      const AmkQRow sr = g.src[j].s_of(rd.r), zr = g.src[j].z_of(rd.r);
#pragma unroll 2
      for (int u = 0; u < R::U; ++u) {  // shared-memory reads: a short batch hides their latency
        const int v = rd.v0 + u * g.L, n = u * R::M + j;
        if (v < nvec) {
          const int gv = R::Q ? g.grp(v) : 0;
          s[j] += amk_gemv_vec<DT>(amk_lds16(slot + R::code(n, lane)), xs, xsums, v, sr,
                                   R::Q ? sr.raw_in_word(amk_lds4(slot + R::scale(n, lane)), gv) : 0u, zr,
                                   R::Z ? zr.raw_in_word(amk_lds4(slot + R::zero(n, lane)), gv) : 0u);
        }
      }
    }
    if (i % g.rpr == g.rpr - 1) {  // the row group's last round
      amk_gemv_lanes_sum<PAIR>(g.L, s[0], s[1]);
      if (lane % g.L == 0 && valid) {
        acc[rd.r * R::M] = s[0];
        if (PAIR) acc[rd.r * R::M + 1] = s[1];
      }
      s[0] = s[1] = 0.0f;
    }
  }
  amk_cp_async_wait(0);
}
#endif  // AMK_GEMV_RING

// Both matrices stream as aligned vectors (grp: their vectors' scale columns)?
template <int DT, bool PAIR>
AMK_DEVICE bool amk_gemv_vec_pair_ok(const AmkGemvW& w, const AmkGemvW& w2, int K, AmkGroupOf& grp) {
  AmkGroupOf grp2;  // w2 has the same group and k_lo, so the same mapping
  return amk_gemv_vec_ok<DT>(w, K, grp) && (!PAIR || amk_gemv_vec_ok<DT>(w2, K, grp2));
}

// `pre`: rounds of the weight ring issued before the wait (amk_gemv_ring_start).
template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_rows(const AmkCtx& c, int pre, const AmkGemvW& w, const AmkGemvW& w2, const float* xs,
                              const float* xsums, float* acc, int rows, int K) {
  AmkGroupOf grp;
  constexpr int m = PAIR ? 2 : 1;
  if (amk_gemv_vec_pair_ok<DT, PAIR>(w, w2, K, grp)) {
#if AMK_GEMV_RING
    if (const AmkRing* g = amk_ring_plan<DT, PAIR>(c, w, w2, grp, rows, K)) {
      amk_gemv_rows_ring<DT, PAIR>(*g, pre, xs, xsums, acc, rows, K);
      return;
    }
#endif
    const int L = amk_gemv_lanes<DT, PAIR>(K), per_warp = AMK_WARP_SIZE / L, sub = amk_lane() % L;
#pragma unroll 1
    for (int r0 = amk_warp() * per_warp; r0 < rows; r0 += amk_nwarps() * per_warp) {  // warp-uniform
      const int r = r0 + amk_lane() / L;
      float a1, a2;
      amk_gemv_row_vec<DT, PAIR>(w, w2, grp, xs, xsums, r, r < rows, K, L, sub, a1, a2);
      if (sub == 0 && r < rows) {
        acc[r * m] = a1;
        if (PAIR) acc[r * m + 1] = a2;
      }
    }
    return;
  }
#pragma unroll 1
  for (int r = amk_warp(); r < rows; r += amk_nwarps()) {
    float a1, a2;
    amk_gemv_row_scalar<PAIR>(w, w2, xs, r, K, a1, a2);
    if (amk_lane() == 0) {
      acc[r * m] = a1;
      if (PAIR) acc[r * m + 1] = a2;
    }
  }
}

// fn(AmkIntC<DT>, AmkIntC<PAIR>) for the weight dtype dt, if this build compiles it
// (AMK_GEMV_WDTYPES); false if not.
template <int V>
struct AmkIntC {
  static constexpr int value = V;
};
template <int DT, bool PAIR, class Fn>
AMK_DEVICE bool amk_gemv_visit_if(Fn& fn) {
  if constexpr (AMK_WITH_GEMV_WDTYPE(DT)) {
    fn(AmkIntC<DT>{}, AmkIntC<PAIR>{});
    return true;
  } else {
    return false;
  }
}
template <class Fn>
AMK_DEVICE bool amk_gemv_visit(int dt, bool pair, Fn&& fn) {
  switch (dt * 2 + (pair ? 1 : 0)) {
#define AMK_GEMV_CASE(DT)                                   \
  case DT * 2: return amk_gemv_visit_if<DT, false>(fn); \
  case DT * 2 + 1: return amk_gemv_visit_if<DT, true>(fn);
    AMK_GEMV_CASE(AMK_DTYPE_F32)
    AMK_GEMV_CASE(AMK_DTYPE_BF16)
    AMK_GEMV_CASE(AMK_DTYPE_F16)
    AMK_GEMV_CASE(AMK_DTYPE_I8)
    AMK_GEMV_CASE(AMK_DTYPE_U4)
#undef AMK_GEMV_CASE
    default: return false;
  }
}

// The matrices of a GEMV task: w, and w2 (gate/up's second) or w again.
struct AmkGemvWs {
  AmkGemvW w, w2;
  bool ok;  // quantized weights come with their companions, and w2 has w's dtype
};
AMK_DEVICE AmkGemvWs amk_gemv_ws(const AmkCtx& c) {
  AmkGemvWs m;
  m.w = amk_gemv_w(c, AMK_ROLE_W, AMK_ROLE_W_SCALE, AMK_ROLE_W_ZERO);
  m.w2 = amk_row_width(*c.t) == 2 ? amk_gemv_w(c, AMK_ROLE_W2, AMK_ROLE_W2_SCALE, AMK_ROLE_W2_ZERO) : m.w;
  m.ok = amk_gemv_w_ok(m.w) && amk_gemv_w_ok(m.w2) && m.w2.wb->dtype == m.w.wb->dtype;
  return m;
}

// Before the task's wait (vm/megakernel.cu), every thread: the first S - 1 rounds of its
// warp's weight ring, if the op will stream through one; returns how many it issued, which
// the op gets back as AmkCtx::ring_pre.
AMK_DEVICE int amk_gemv_ring_start(const AmkCtx& c) {
#if AMK_GEMV_RING
  const AmkTask& t = *c.t;
  if (t.op != AMK_OP_GEMV || AMK_RING_NOEARLY) return 0;
  const int rows = t.ip[AMK_P_ROWS], K = t.ip[AMK_P_K_HI] - t.ip[AMK_P_K_LO];
  const AmkGemvWs ws = amk_gemv_ws(c);
  if (!ws.ok) return 0;
  int pre = 0;
  amk_gemv_visit(ws.w.wb->dtype, amk_row_width(t) == 2, [&](auto dt, auto pair) {
    constexpr int DT = decltype(dt)::value;
    constexpr bool PAIR = decltype(pair)::value != 0;
    AmkGroupOf grp;
    if (!amk_gemv_vec_pair_ok<DT, PAIR>(ws.w, ws.w2, K, grp)) return;
    if (const AmkRing* g = amk_ring_plan<DT, PAIR>(c, ws.w, ws.w2, grp, rows, K))
      for (; pre < g->slots - 1; ++pre) amk_ring_issue<DT, PAIR>(*g, rows, K, pre);
  });
  return pre;
#else
  return 0;
#endif
}

AMK_DEVICE void amk_op_gemv(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int rows = t.ip[AMK_P_ROWS], k_lo = t.ip[AMK_P_K_LO], K = t.ip[AMK_P_K_HI] - k_lo;
  const int m = amk_row_width(t);
  float* xs = amk_smem(c, amk_smem_gemv(t));
  if (!xs) return;
  float* acc = xs + amk_round4(K);
  float* red = acc + amk_round4((long long)rows * m);

  // prologue: stage x (or its RMSNorm) as fp32, every load of a thread in flight at once
  const AmkOperand& x = amk_in(c, AMK_ROLE_X);
  const AmkBuffer& xb = amk_buf(c, x);
  const bool norm = t.ip[AMK_P_HAS_NORM] != 0;  // x is then the whole row (for its RMS), else the K slice
  float* xsums = red + AMK_WARP_SIZE;
  if (norm) {
    // x and the norm weights staged at once, by the two halves of the block: one memory
    // round trip where loading the weights after the sum of squares took a second one
    float* gs = xsums + amk_round4(K / AMK_XSUM_CHUNK);
    const AmkOperand& g = amk_in(c, AMK_ROLE_GAMMA);
    const int half = blockDim.x / 2;
    if ((int)threadIdx.x < half) amk_for_elems(xb, x, k_lo, K, [&](int i, float v) { xs[i] = v; }, threadIdx.x, half);
    else amk_for_elems(amk_buf(c, g), g, k_lo, K, [&](int i, float v) { gs[i] = v; }, threadIdx.x - half, blockDim.x - half);
    const int hidden = t.ip[AMK_P_K];
    const float eps = t.fp[AMK_F_NORM_EPS];
    float inv;
    if (k_lo == 0 && K == hidden) {  // the whole row is staged: its squares come from shared memory
      amk_syncthreads();
      float ss = 0.0f;
      for (int i = threadIdx.x; i < K; i += blockDim.x) ss += xs[i] * xs[i];
      inv = amk_inv_rms(amk_block_sum(ss, red), hidden, eps);
    } else {
      inv = amk_block_inv_rms(c, x, hidden, eps, red);  // its barriers also publish xs and gs
    }
    for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = amk_rms_apply(xs[i], inv, gs[i], xb.dtype);
  } else {
    amk_for_elems(xb, x, 0, K, [&](int i, float v) { xs[i] = v; });
  }
  const AmkGemvWs ws = amk_gemv_ws(c);
  const AmkGemvW &w = ws.w, &w2 = ws.w2;
  amk_syncthreads();
  if (w.wb->dtype == AMK_DTYPE_U4) {  // sums of xs over each vector's 32 columns, a warp per vector
    for (int v = amk_warp(); v < K / AMK_XSUM_CHUNK; v += amk_nwarps()) {
      const float sum = amk_warp_sum(amk_lane() < AMK_XSUM_CHUNK ? xs[v * AMK_XSUM_CHUNK + amk_lane()] : 0.0f);
      if (amk_lane() == 0) xsums[v] = sum;
    }
    amk_syncthreads();
  }
  amk_trace_mark(c, 0);  // prologue done

  if (!ws.ok) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, w.wb->dtype, w2.wb->dtype);
    return;
  }
  const bool ok = amk_gemv_visit(w.wb->dtype, m == 2, [&](auto dt, auto pair) {
    amk_gemv_rows<decltype(dt)::value, decltype(pair)::value != 0>(c, c.ring_pre, w, w2, xs, xsums, acc, rows, K);
  });
  if (!ok) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, w.wb->dtype);
    return;
  }
  amk_syncthreads();
  amk_trace_mark(c, 1);  // rows done

  if (t.ip[AMK_P_SPLIT_K] > 1) {  // partial sums of this K slice; REDUCE runs the epilogue
    const AmkOperand& y = t.out[0];
    const AmkBuffer& yb = amk_buf(c, y);
    for (int e = threadIdx.x; e < rows * m; e += blockDim.x) amk_store(yb, amk_flat(y, e), acc[e]);
  } else {
    amk_epilogue(c, acc, rows);
  }
}
