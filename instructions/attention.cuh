// ATTN_PARTIAL and ATTN_COMBINE: split-KV decode attention for one KV head  (ir.AttnPartialParams,
// ir.AttnCombineParams).
//
// ATTN_PARTIAL computes exactly sum_j exp(t_j - m) v_j with m the split's maximum (no online
// rescaling), in two passes over the split's rows [j0, j1):
//   pass 1: every score t_j = scale * q.k_j for all q heads; the maximum per head (an integer
//           max on an order-preserving key, over each warp's rows with shuffles, then one
//           shared atomic per warp: exact, so the result does not depend on the order); the
//           first `score_cap` scores per head stay in shared memory.
//   pass 2: tiles of score_cap rows (the first tile reuses the cached scores, later ones
//           recompute theirs with the same code, bit for bit): p = exp(t - m), l += sum p,
//           o += sum p v.
// A row of head_dim elements is split over G lanes (G = head_dim / VEC rounded up to a power
// of two, VEC elements per 16-byte load), so one warp covers 32/G rows at a time and every
// lane keeps AMK_ATTN_UNROLL rows' loads in flight: the K and V bytes stream like the GEMV
// weights do instead of one 2-byte load per lane and row. The score pass over half-precision
// rows (the usual cache) gives a lane 4 vectors of a row instead (amk_attn_scores_wide). Rows
// that are not 16-byte aligned take element loads with the same lane layout. The P.V pass
// accumulates AMK_ATTN_HB query heads at a time in registers; warps reduce across their row
// groups with shuffles and across warps through shared memory in a fixed order (deterministic).
// Over half-precision rows it keeps AMK_ATTN_PV_ROWS rows' vectors a lane in flight and
// reduce-scatters the row groups instead (amk_attn_pv_wide).
//
// Shared memory (words): qs[QH*hd] | o[QH*hd] | m[QH] | l[QH] | mkey[QH] | wpart[nwarps*HB*hd] | cache[QH*cap]
#pragma once
#include "common.cuh"
#include "vec.cuh"
#include "combine.cuh"

#ifndef AMK_ATTN_HB
#define AMK_ATTN_HB 4  // query heads per register block of the P.V pass (vm/loader.py ATTN_HEAD_BLOCK)
#endif
#ifndef AMK_ATTN_UNROLL
#if (AMK_GEMV_WDTYPES) != 0x3f  // a build for one program's weight dtypes (vm/loader.py makes only these):
#define AMK_ATTN_UNROLL 3        // 3 x 32 rows per pass cover a split of <= 96 rows in one K round trip
#else                            // every dtype compiled in (the compile checks; PERF_NOTES 16): a
#define AMK_ATTN_UNROLL 2        // third row spills on sm_80 beside every GEMV variant
#endif
#endif

AMK_DEVICE long long amk_smem_attn_partial(const AmkTask& t, int nwarps) {
  const long long qh = t.ip[AMK_P_ATTN_Q_HEADS], hd = t.ip[AMK_P_ATTN_HEAD_DIM];
  return 2 * qh * hd + 3 * qh + (long long)nwarps * AMK_ATTN_HB * hd + qh * t.ip[AMK_P_ATTN_SCORE_CAP];
}

// Order-preserving int key of a float (larger float, larger key; NaN above +inf), so that
// an integer atomic max is an exact float max.
AMK_DEVICE int amk_order_key(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
AMK_DEVICE float amk_order_unkey(int k) { return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff); }

// The rows of one KV-cache operand (row j, element d at j * width + off + d; F32, BF16 or
// F16) and how the lanes of a warp share them: a lane holds AMK_KV_LANE floats of a row,
// NV 16-byte vectors of VEC elements (chunk ch = sub + c * G, c < NV).
#define AMK_KV_LANE 8
// AMK_ATTN_SHIFTS: the K / V row geometry (AMK_ATTN_KV_SHIFTS) and the wide passes' lane split
// by shifts and masks instead of divisions by values known only at run time, which the partial's
// first K loads wait for (as items 172 and 178 found in the GEMV). On an H200 (eval/PERF_NOTES.md
// items 179, 183, 184): the 1B -0.52 %, the 8B -0.53 %, the SmolLM2 shape -0.09 %, the int8 1B
// -1.34 %; the row geometry's part alone, the int4 1B -2.24 %. On by default where ptxas spills
// no more with it than without: float and symmetric int8 weights without the o-proj's combine
// prologue, and the row geometry alone for int4 weights (sm_90's int4 loads-ahead build then
// spills 8 B instead of 24), the quantized weights not on sm_80 (its int8 and int4 loads-ahead
// builds spill 8-24 B more there). The asymmetric int8, the combine and the every-dtype builds
// spilled 4-68 B with either part (the #else keeps their code as it was).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define AMK_ATTN_SHIFTS_QUANT 0  // sm_80: the quantized builds keep the divisions
#else
#define AMK_ATTN_SHIFTS_QUANT 1
#endif
#ifndef AMK_ATTN_SHIFTS
#define AMK_ATTN_SHIFTS \
  (((AMK_GEMV_WDTYPES) & (AMK_ATTN_SHIFTS_QUANT ? 0x20 : 0x30)) == 0 && !AMK_GEMV_I8_ZERO && !AMK_GEMV_COMBINE)
#endif
#ifndef AMK_ATTN_KV_SHIFTS
#define AMK_ATTN_KV_SHIFTS \
  (AMK_ATTN_SHIFTS || (AMK_ATTN_SHIFTS_QUANT && ((AMK_GEMV_WDTYPES) & 0x30) == 0x20 && !AMK_GEMV_COMBINE))
#endif
// A warp's lanes G (a power of two: the wide passes' rows) to a row: R = WARP / G rows, and the
// lane's row grp and place sub in it. SHIFTS: by a shift and a mask; else by the divisions that
// the builds which spill with the shifts keep (AMK_ATTN_SHIFTS 0).
struct AmkLaneRows {
  int R, grp, sub;
};
template <bool SHIFTS>
AMK_DEVICE AmkLaneRows amk_lane_rows(int G, int lane) {
  if constexpr (SHIFTS) {
    const int lg = amk_log2_pow2(G);
    return AmkLaneRows{AMK_WARP_SIZE >> lg, lane >> lg, lane & (G - 1)};
  } else {
    return AmkLaneRows{AMK_WARP_SIZE / G, lane / G, lane % G};
  }
}

struct AmkKvRows {
  const AmkBuffer* b;
  amk_i64 off, width;
  int hd, dt, bytes;
  int VEC, NV;  // elements per 16-byte vector; vectors per lane and row
  bool vec;     // every row 16-byte aligned and hd a multiple of VEC: vector loads, else element loads
  int C, G, R;  // VEC-element chunks per row, lanes per row (power of two), rows per warp
};

// Where a KV operand's rows start and how far apart they are, in elements of b's storage: row-major,
// or a head-major head's own block (the loader refuses a partial's head that is not one whole block).
AMK_DEVICE void amk_kv_run(const AmkBuffer& b, const AmkOperand& o, amk_i64& off, amk_i64& pitch) {
  off = amk_kv_at(b, 0, o.off);
#if AMK_KV_HEAD_MAJOR
  pitch = b.kv_head > 0 ? b.kv_head : b.width;
#else
  pitch = b.width;
#endif
}

AMK_DEVICE AmkKvRows amk_kv_rows(const AmkBuffer& b, const AmkOperand& o, int hd) {
  AmkKvRows r;
  r.b = &b, r.hd = hd, r.dt = b.dtype;
#if AMK_KV_HEAD_MAJOR
  amk_kv_run(b, o, r.off, r.width);
#define AMK_KV_ROWS_OFF r.off  // the alignment tests below: the storage's offset and pitch
#define AMK_KV_ROWS_PITCH r.width
#else
  r.off = o.off, r.width = b.width;
#define AMK_KV_ROWS_OFF o.off  // (as written before head-major caches: the same PTX)
#define AMK_KV_ROWS_PITCH b.width
#endif
  r.bytes = b.dtype == AMK_DTYPE_F32 ? 4 : 2;
#if AMK_ATTN_KV_SHIFTS
  const int lgv = b.dtype == AMK_DTYPE_F32 ? 2 : 3;  // VEC = 16 / bytes
  r.VEC = 1 << lgv;
  r.NV = AMK_KV_LANE >> lgv;
  r.vec = (hd & (r.VEC - 1)) == 0 && (b.ptr + (unsigned long long)(AMK_KV_ROWS_OFF * r.bytes)) % 16 == 0 &&
          (AMK_KV_ROWS_PITCH * r.bytes) % 16 == 0;
  r.C = (hd + r.VEC - 1) >> lgv;
  r.G = 1;
  while (r.G < r.C && r.G < AMK_WARP_SIZE) r.G <<= 1;
  r.R = AMK_WARP_SIZE >> amk_log2_pow2(r.G);
#else
  r.VEC = 16 / r.bytes;
  r.NV = AMK_KV_LANE / r.VEC;
  r.vec = hd % r.VEC == 0 && (b.ptr + (unsigned long long)(AMK_KV_ROWS_OFF * r.bytes)) % 16 == 0 && (AMK_KV_ROWS_PITCH * r.bytes) % 16 == 0;
  r.C = (hd + r.VEC - 1) / r.VEC;
  r.G = 1;
  while (r.G < r.C && r.G < AMK_WARP_SIZE) r.G <<= 1;
  r.R = AMK_WARP_SIZE / r.G;
#endif
#undef AMK_KV_ROWS_OFF
#undef AMK_KV_ROWS_PITCH
  return r;
}

// Element j of a 16-byte vector holding F32, BF16 or F16 values.
AMK_DEVICE float amk_v16_get(const amk_u32x4& v, int j, int dt) {
  if (dt == AMK_DTYPE_F32) return __uint_as_float(amk_word(v, j));
  const unsigned u = amk_word(v, j >> 1);
  return amk_half_to_f32(dt, (unsigned short)(j & 1 ? u >> 16 : u & 0xffffu));
}

// One element of a KV row (F32, BF16 or F16).
AMK_DEVICE float amk_kv_elem(const AmkKvRows& r, amk_i64 e) {
  if (r.bytes == 4) return ((const float*)r.b->ptr)[e];
  return amk_half_to_f32(r.dt, ((const unsigned short*)r.b->ptr)[e]);
}

// This lane's AMK_KV_LANE floats of row j (zeros outside the row, or for j < 0); float x is
// element x % VEC of vector x / VEC. Every index into `out` is a compile-time constant, so
// the caller's arrays stay in registers.
AMK_DEVICE void amk_kv_load(const AmkKvRows& r, int j, int sub, float* out) {
#pragma unroll
  for (int x = 0; x < AMK_KV_LANE; ++x) out[x] = 0.0f;
  if (j < 0) return;
  const amk_i64 row = (amk_i64)j * r.width + r.off;
  if (r.vec && r.bytes == 2) {  // one vector of 8 halves
    if (sub < r.C) {
      const amk_u32x4 raw = amk_ld16((const char*)r.b->ptr + (row + (amk_i64)sub * 8) * 2);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = amk_v16_get(raw, i, r.dt);
    }
  } else if (r.vec) {  // two vectors of 4 floats
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int ch = sub + c * r.G;
      if (ch >= r.C) continue;
      const amk_u32x4 raw = amk_ld16((const char*)r.b->ptr + (row + (amk_i64)ch * 4) * 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) out[c * 4 + i] = amk_v16_get(raw, i, AMK_DTYPE_F32);
    }
  } else {  // unaligned rows: element loads, same layout
#pragma unroll
    for (int x = 0; x < AMK_KV_LANE; ++x) {
      const int c = x / r.VEC, d = (sub + c * r.G) * r.VEC + x % r.VEC;
      if (c < r.NV && d < r.hd) out[x] = amk_kv_elem(r, row + d);
    }
  }
}

// Dimension of a lane's float x (>= hd: none).
AMK_DEVICE int amk_kv_dim(const AmkKvRows& r, int sub, int x) {
  const int c = x / r.VEC;
  return c < r.NV ? (sub + c * r.G) * r.VEC + x % r.VEC : r.hd;
}

// A score from its dot product q.k, rounded as HF computes it in the query's dtype:
// rnd(rnd(q.k) * scale). Both score passes use it, so their scores agree bit for bit.
AMK_DEVICE float amk_attn_scaled(float dot, float scale, int qdt) {
  return amk_round(qdt, amk_mul(amk_round(qdt, dot), scale));
}

#define AMK_ATTN_NO_KEY (-2147483647 - 1)  // below every float's key

// Pass 1's maximum for N heads: each head's largest key over the warp's row groups (lanes g
// apart), then one shared atomic per warp and head (heads n >= valid have none); integer
// keys, so exact and independent of the order.
template <int N>
AMK_DEVICE void amk_attn_key_max(int (&key)[N], int g, int* mkey, int valid) {
  for (int m = g; m < AMK_WARP_SIZE; m <<= 1)
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int other = amk_shfl_xor_int(key[n], m);
      key[n] = other > key[n] ? other : key[n];
    }
  if (amk_lane() == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (n < valid && key[n] != AMK_ATTN_NO_KEY) atomicMax(&mkey[n], key[n]);
  }
}

// The wide score pass is compiled into the builds the loader makes (one program's weight
// dtypes); the every-dtype build of the compile checks leaves it out, where it tips the
// scheduler loop into a 12-byte spill on sm_90. The emulator turns it on (tests/emu_vm.py).
#ifndef AMK_ATTN_WIDE
#define AMK_ATTN_WIDE ((AMK_GEMV_WDTYPES) != 0x3f)
#endif
// AMK_ATTN_ONLY_WIDE (eval/PERF_NOTES.md item 198): the split-layout passes left out of the build
// where a wide pass exists. The loader sets it where every partial's rows are wide (a lowered
// Llama's bf16 caches: loader._only_wide_define); a partial whose rows would need them reports an
// error. Measured on the H200: SmolLM2 shape -2.1 %, 1B -0.6 %.
#ifndef AMK_ATTN_ONLY_WIDE
#define AMK_ATTN_ONLY_WIDE 0
#endif
#define AMK_ATTN_SCORES_SPLIT (!(AMK_ATTN_ONLY_WIDE) || !(AMK_ATTN_WIDE))  // the split score pass compiled

// Rows the wide passes take: half precision, read with vectors, head_dim a multiple of 32 so
// that 4 vectors a lane make whole-lane groups (C / 4 a power of two, hence C one too).
AMK_DEVICE bool amk_attn_wide_rows(const AmkKvRows& r) {
  const int g = r.C / 4;
  return r.vec && r.bytes == 2 && r.C % 4 == 0 && g >= 1 && g <= AMK_WARP_SIZE && (g & (g - 1)) == 0;
}

// Can the score pass give each lane 4 vectors (32 halves) of a K row?
AMK_DEVICE bool amk_attn_wide_ok(const AmkKvRows& K) { return AMK_ATTN_WIDE && amk_attn_wide_rows(K); }

// Element i of a 16-byte vector of BF16 or F16 values (dt), with only the conversions this
// build compiles in (AMK_DTYPES: the loader's builds have one of the two, the emulator both).
AMK_DEVICE float amk_attn_v16_half(const amk_u32x4& v, int i, int dt) {
  if constexpr (!AMK_WITH_DTYPE(AMK_DTYPE_F16)) return AmkWFmt<AMK_DTYPE_BF16>::get(v, i);
  else if constexpr (!AMK_WITH_DTYPE(AMK_DTYPE_BF16)) return AmkWFmt<AMK_DTYPE_F16>::get(v, i);
  else return amk_v16_get(v, i, dt);
}

// Heads a block of the wide score pass scores together: 4 (AMK_ATTN_HB) where only float
// weights are compiled in; fewer in builds with quantized GEMV weights, whose rows take the
// registers four heads' chains would hold (4 measured int8 / int4 1B +0.6-1.2 %, item 85; int8
// 1B +1.5 % on an H200, item 224). In builds of one symmetric weight format (int8 or int4) two in
// the loads-ahead loop, three in the plain one (the loader picks the block for the program's q heads
// a KV head, at most three: vm/loader.py score_head_block), as measured on an H200: the int8 1B
// -0.46 % (item 230), the int8 SmolLM2 shape -1.80 % (item 244; +2.6 % in the larger build of item
// 224), the int4 SmolLM2 shape -1.23 % and the int4 1B -0.91 % (item 246). One in the others
// (asymmetric int8, both formats).
#ifndef AMK_ATTN_SCORE_HB
#if ((AMK_GEMV_WDTYPES) & 0x30) == 0  // 0x30: I8, U4
#define AMK_ATTN_SCORE_HB AMK_ATTN_HB
#elif ((AMK_GEMV_WDTYPES) & 0x30) != 0x30 && AMK_GEMV_LOADS_AHEAD && !AMK_GEMV_I8_ZERO
#define AMK_ATTN_SCORE_HB 2
#elif ((AMK_GEMV_WDTYPES) & 0x30) != 0x30 && !AMK_GEMV_I8_ZERO
#define AMK_ATTN_SCORE_HB 3
#else
#define AMK_ATTN_SCORE_HB 1
#endif
#endif

// amk_attn_scores for half-precision rows with a lane taking 4 contiguous vectors of a row
// (G = head_dim / 32 lanes per row: 2 at head_dim 64, one shuffle level), so a warp scores
// 32 / G rows per load and a head's dot product is four independent chains of 8 products
// per lane. The split layout (8 halves a lane) spent most of a pass in its dependent chains
// (four heads, each 8 FMAs, three shuffle levels, then the key's): ~4 us per pass of 96 rows.
// This one: 1B ctx 8192 2110 -> 1961 us, ctx 1024 1607 -> 1587 (eval/PERF_NOTES.md items
// 31-32). Same results contract: exact maximum keys, the first cap scores cached; the sums'
// order differs from the split layout's (both are fp32 dots).
// The heads go in blocks of AMK_ATTN_SCORE_HB, all of a block's heads scored together for each
// row (independent chains, q read as 16-byte vectors), and each lane keeps its largest key per
// head in a register over all its rows: one warp reduction and one shared atomic per head and
// pass, where a reduction and an atomic per head and row group made every head of every row
// group one dependent chain (item 85: the score pass read K from shared memory no faster).
// AMK_ATTN_K_AHEAD (eval/PERF_NOTES.md items 213-219): at the pass's start each lane hints its rows
// of the later rounds into the L1, for splits of several rounds (the 1B's 512 rows at ctx 8192: 4
// rounds of 128 at head_dim 64). Measured there on an H200: -0.23 % and -0.35 %, so the rounds'
// chains, not their K round trips, set the pass (two row groups loaded a round, so that one's
// chains overlap the next one's loads, lost 2.5 %: it spills in the combine). A hint only: loads
// and sums are unchanged. The loader sets it for float-weight builds where a split has two full
// rounds or more (loader._k_ahead_define; the int8 1B at ctx 8192 lost 0.49 % with it).
#ifndef AMK_ATTN_K_AHEAD
#define AMK_ATTN_K_AHEAD 0
#endif
AMK_DEVICE void amk_attn_scores_wide(const AmkKvRows& K, const float* qs, int ja, int jb, int qh, float scale,
                                     int qdt, int* mkey, float* cache, int cap) {
  constexpr int HB = AMK_ATTN_SCORE_HB;
  const int G = K.C / 4, hd = K.hd;
  const AmkLaneRows lr = amk_lane_rows<AMK_ATTN_SHIFTS>(G, amk_lane());
  const int R = lr.R, grp = lr.grp, sub = lr.sub;
  const int step = amk_nwarps() * R;
  const char* base = (const char*)K.b->ptr + (K.off + (amk_i64)sub * 32) * 2;
#if AMK_ATTN_K_AHEAD
  for (int j = ja + amk_warp() * R + step + grp; j < jb; j += step) amk_prefetch_l1(base + (amk_i64)j * K.width * 2);
#endif
#pragma unroll 1
  for (int hb = 0; hb < qh; hb += HB) {
    int key[HB];  // this lane's largest key per head of the block, over its rows
#pragma unroll
    for (int hh = 0; hh < HB; ++hh) key[hh] = AMK_ATTN_NO_KEY;
#pragma unroll 1
    for (int jw = ja + amk_warp() * R; jw < jb; jw += step) {  // warp-uniform: shuffles below are safe
      const int j = jw + grp;
      amk_u32x4 raw[4];
      const char* row = base + (amk_i64)j * K.width * 2;
#pragma unroll
      for (int c = 0; c < 4; ++c) raw[c] = j < jb ? amk_ld16(row + c * 16) : amk_u32x4{0u, 0u, 0u, 0u};
      float t[HB];
#pragma unroll
      for (int hh = 0; hh < HB; ++hh) {
        // (16-byte aligned: hd % 32 == 0; a block's heads past qh re-score the last one, dropped below)
        const float4* q = (const float4*)(qs + min(hb + hh, qh - 1) * hd + sub * 32);
        float part[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float4 qa = q[2 * c], qb = q[2 * c + 1];
          const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
          part[c] = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) part[c] += qv[i] * amk_attn_v16_half(raw[c], i, K.dt);
        }
        t[hh] = (part[0] + part[1]) + (part[2] + part[3]);
      }
      for (int m = G / 2; m > 0; m >>= 1)  // the row's G lanes
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) t[hh] += amk_shfl_xor(t[hh], m);
#pragma unroll
      for (int hh = 0; hh < HB; ++hh) {
        if (hb + hh >= qh) break;  // uniform
        const float sc = amk_attn_scaled(t[hh], scale, qdt);
        if (j < jb) {
          const int k = amk_order_key(sc);
          key[hh] = k > key[hh] ? k : key[hh];
          if (sub == 0 && j - ja < cap) cache[(hb + hh) * cap + (j - ja)] = sc;
        }
      }
    }
    if (mkey != nullptr) amk_attn_key_max(key, G, &mkey[hb], qh - hb);
  }
}

// amk_attn_scores over the split layout: a lane holds AMK_KV_LANE floats of a row.
AMK_DEVICE void amk_attn_scores_split(const AmkKvRows& K, const float* qs, int ja, int jb, int qh, float scale,
                                       int qdt, int* mkey, float* cache, int cap) {
  constexpr int U = AMK_ATTN_UNROLL;
  const int lane = amk_lane(), grp = lane / K.G, sub = lane % K.G, hd = K.hd;
  const int step = amk_nwarps() * K.R;
#pragma unroll 1
  for (int jw = ja + amk_warp() * K.R; jw < jb; jw += step * U) {  // warp-uniform: shuffles below are safe
    float kf[U][AMK_KV_LANE];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = jw + u * step + grp;
      amk_kv_load(K, j < jb ? j : -1, sub, kf[u]);
    }
    // one head at a time over the U rows: U independent dot products, shuffle chains and
    // keys in flight together (the latency of one chain is what a warp waits on), and one
    // max reduction and atomic per head for all U rows
#pragma unroll 1
    for (int h = 0; h < qh; ++h) {
      float t[U];
#pragma unroll
      for (int u = 0; u < U; ++u) t[u] = 0.0f;
#pragma unroll
      for (int x = 0; x < AMK_KV_LANE; ++x) {
        const int d = amk_kv_dim(K, sub, x);  // (recomputed: registers are at the kernel's limit)
        if (d >= hd) continue;
        const float qx = qs[h * hd + d];
#pragma unroll
        for (int u = 0; u < U; ++u) t[u] += qx * kf[u][x];
      }
      for (int m = K.G / 2; m > 0; m >>= 1)
#pragma unroll
        for (int u = 0; u < U; ++u) t[u] += amk_shfl_xor(t[u], m);
      int key = AMK_ATTN_NO_KEY;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = jw + u * step + grp;
        t[u] = amk_attn_scaled(t[u], scale, qdt);
        if (j < jb) {
          const int k = amk_order_key(t[u]);
          key = k > key ? k : key;
          if (sub == 0 && j - ja < cap) cache[h * cap + (j - ja)] = t[u];
        }
      }
      if (mkey != nullptr) {
        int keys[1] = {key};
        amk_attn_key_max(keys, K.G, &mkey[h], 1);
      }
    }
  }
}

// Scores of rows [ja, jb) for every q head, all warps. Pass 1 (mkey != nullptr): atomic max
// into mkey[h], rows j - ja < cap cached at cache[h * cap + j - ja]; a recompute pass
// (mkey == nullptr): every row cached the same way.
AMK_DEVICE void amk_attn_scores(const AmkKvRows& K, const float* qs, int ja, int jb, int qh, float scale, int qdt,
                                int* mkey, float* cache, int cap) {
  if (amk_attn_wide_ok(K)) return amk_attn_scores_wide(K, qs, ja, jb, qh, scale, qdt, mkey, cache, cap);
#if AMK_ATTN_SCORES_SPLIT
  amk_attn_scores_split(K, qs, ja, jb, qh, scale, qdt, mkey, cache, cap);
#endif
}

// o[hb + hh] += the warps' partials wpart[w][hh] of a head block, summed in warp order.
AMK_DEVICE void amk_attn_pv_warps(float* o, const float* wpart, int hb, int qh, int hd, int nw) {
  constexpr int HB = AMK_ATTN_HB;
  for (int idx = threadIdx.x; idx < HB * hd; idx += blockDim.x) {
    const int hh = amk_quot(idx, hd), d = idx - hh * hd;
    if (hb + hh >= qh) continue;
    float s = 0.0f;
    for (int w = 0; w < nw; ++w) s += wpart[(w * HB + hh) * hd + d];
    o[(hb + hh) * hd + d] += s;
  }
}

// The wide P.V pass (amk_attn_pv_wide) is on wherever the wide score pass is (the loader's
// builds; the emulator turns both on), except in builds with U4 GEMV weights (dtype 5): there
// it tips the sm_90 build from 24 / 88 to 40-68 / 108-184 bytes of spill (stores / loads)
// even at 2 rows a lane, so kernel-wide values the register allocator evicts, not the pass's
// own registers (eval/PERF_NOTES.md item 44). -DAMK_ATTN_PV_WIDE=0 gives the split layout for
// every V row, =1 forces the wide pass in.
#ifndef AMK_ATTN_PV_WIDE
#define AMK_ATTN_PV_WIDE ((AMK_ATTN_WIDE) && (((AMK_GEMV_WDTYPES) >> 5) & 1) == 0)
#endif
#define AMK_ATTN_PV_SPLIT (!(AMK_ATTN_ONLY_WIDE) || !(AMK_ATTN_PV_WIDE))  // the split P.V pass compiled
// Does the wide P.V pass take V's rows (in a build with AMK_ATTN_PV_WIDE)? A macro: as a function
// returning bool the same test compiled to other PTX in amk_attn_pv (sm_90 bf16), moving the
// measured builds' code.
#define AMK_ATTN_PV_WIDE_ROWS(V) (amk_attn_wide_rows(V) && AMK_WITH_DTYPE((V).dt))
#ifndef AMK_ATTN_PV_VECS
#define AMK_ATTN_PV_VECS 1  // 16-byte vectors (8 dims) of a V row a lane owns in the wide P.V pass
#endif
#ifndef AMK_ATTN_PV_ROWS
#define AMK_ATTN_PV_ROWS 8  // rows a lane has in flight per round of the wide P.V pass
#endif

// The wide P.V pass's reduce-scatter over a warp's row groups, levels m = M, M / 2, ..., G:
// lanes m apart swap halves of their first 2 * H values and the lane with bit m set keeps
// the upper half (its offset off grows by H); afterwards a lane's acc[i < n] is the sum over
// the groups of value off + i. Fixed partners and order (deterministic); compile-time
// indices only, so acc stays in registers.
template <int H, int M>
AMK_DEVICE void amk_attn_pv_scatter(float* acc, int G, int lane, int& off, int& n) {
  if constexpr (H >= 1 && M >= 1) {
    if (G > M) return;  // block-uniform
    const bool upper = (lane & M) != 0;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float send = upper ? acc[i] : acc[i + H];
      const float keep = upper ? acc[i + H] : acc[i];
      acc[i] = keep + amk_shfl_xor(send, M);
    }
    off += upper ? H : 0;
    n = H;
    amk_attn_pv_scatter<H / 2, M / 2>(acc, G, lane, off, n);
  }
}

// amk_attn_pv for half-precision rows (amk_attn_wide_rows): a lane owns a fixed slice of
// NV * 8 dims (NV = AMK_ATTN_PV_VECS contiguous 16-byte vectors; G = C / NV lanes a row) and
// loads U = AMK_ATTN_PV_ROWS rows of it per round, kept packed (4 registers a vector) until
// they are used, so a warp has U * 32 / G rows in flight where the split layout had
// AMK_ATTN_UNROLL * 32 / G: at head_dim 64, 8 warps, 256 rows a round instead of 96 (a split
// of 512 rows at ctx 8192: 2 V round trips instead of 6). acc[hh * D + x] (D = NV * 8) holds
// HB heads of the slice in fp32, summed over the lane's rows in a fixed order. The row groups
// of a warp (lanes sub + g * G) are then combined by a reduce-scatter (amk_attn_pv_scatter),
// so each lane ends with N / R sums (N = HB * D, R = warp size / G groups) after N (1 - 1 / R)
// shuffles, where the split layout's butterfly of all values takes N log2(R) (at head_dim
// 64: 24 shuffles a lane instead of 64). The warps' partials then go through shared memory
// in order, as in the split layout (amk_attn_pv_warps).
AMK_DEVICE void amk_attn_pv_wide(const AmkKvRows& V, const float* p, int cap, int jt, int tn, int qh, float* o,
                                 float* wpart) {
  constexpr int HB = AMK_ATTN_HB, NV = AMK_ATTN_PV_VECS, U = AMK_ATTN_PV_ROWS, D = 8 * NV, N = HB * D;
  static_assert(NV == 1 || NV == 2 || NV == 4, "AMK_ATTN_PV_VECS: 1, 2 or 4 vectors (C / 4 lanes a row at most)");
  static_assert(32 * HB >= AMK_WARP_SIZE, "the reduce-scatter needs N >= R (up to warp size * NV / 4 groups)");
  const int G = V.C / NV, lane = amk_lane(), warp = amk_warp(), nw = amk_nwarps();
  const AmkLaneRows lr = amk_lane_rows<AMK_ATTN_SHIFTS>(G, lane);
  const int R = lr.R, grp = lr.grp, sub = lr.sub, hd = V.hd, step = nw * R;
  const amk_i64 pitch = V.width * 2, upitch = step * pitch;  // bytes from one row to the next; to row + step
  const char* base = (const char*)V.b->ptr + (V.off + (amk_i64)(jt + grp) * V.width + (amk_i64)sub * D) * 2;
#pragma unroll 1
  for (int hb = 0; hb < qh; hb += HB) {
    float acc[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (int rw = warp * R; rw < tn; rw += step * U) {  // warp-uniform: shuffles below are safe
      amk_u32x4 raw[U][NV];
      const char* row = base + rw * pitch;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int jj = rw + u * step + grp;
#pragma unroll
        for (int c = 0; c < NV; ++c)
          raw[u][c] = jj < tn ? amk_ld16(row + u * upitch + c * 16) : amk_u32x4{0u, 0u, 0u, 0u};
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (rw + u * step >= tn) break;  // warp-uniform: no row of this warp left
        const int jj = rw + u * step + grp;
        float pw[HB];
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) pw[hh] = jj < tn && hb + hh < qh ? p[(hb + hh) * cap + jj] : 0.0f;
#pragma unroll
        for (int c = 0; c < NV; ++c)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float v = amk_attn_v16_half(raw[u][c], i, V.dt);
#pragma unroll
            for (int hh = 0; hh < HB; ++hh) acc[hh * D + c * 8 + i] += pw[hh] * v;
          }
      }
    }
    int off = 0, n = N;  // the warp's sums of values off .. off + n - 1 of this lane's slice
    amk_attn_pv_scatter<N / 2, AMK_WARP_SIZE / 2>(acc, G, lane, off, n);
#pragma unroll
    for (int i = 0; i < N; ++i) {
#if defined(__HIPCC__) || defined(__HIPCC_RTC__)
      if (i >= n) continue;  // clang-19 cannot unroll it with the break in a gfx942 bf16 build without
#else                        // AMK_ATTN_ONLY_WIDE (acc indexed at run time); nvcc's builds keep theirs
      if (i >= n) break;
#endif
      const int idx = off + i, hh = idx / D, d = sub * D + idx % D;
      wpart[(warp * HB + hh) * hd + d] = acc[i];
    }
    amk_syncthreads();
    amk_attn_pv_warps(o, wpart, hb, qh, hd, nw);
    amk_syncthreads();
  }
}

// amk_attn_pv over the split layout.
AMK_DEVICE void amk_attn_pv_split(const AmkKvRows& V, const float* p, int cap, int jt, int tn, int qh,
                                  float* o, float* wpart) {
  constexpr int U = AMK_ATTN_UNROLL, HB = AMK_ATTN_HB;
  const int lane = amk_lane(), warp = amk_warp(), nw = amk_nwarps(), grp = lane / V.G, sub = lane % V.G;
  const int hd = V.hd, step = nw * V.R;
#pragma unroll 1
  for (int hb = 0; hb < qh; hb += HB) {
    float acc[HB][AMK_KV_LANE];
#pragma unroll
    for (int hh = 0; hh < HB; ++hh)
#pragma unroll
      for (int x = 0; x < AMK_KV_LANE; ++x) acc[hh][x] = 0.0f;
#pragma unroll 1
    for (int rw = warp * V.R; rw < tn; rw += step * U) {
      float vf[U][AMK_KV_LANE];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int jj = rw + u * step + grp;
        amk_kv_load(V, jj < tn ? jt + jj : -1, sub, vf[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int jj = rw + u * step + grp;
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) {
          const float pw = jj < tn && hb + hh < qh ? p[(hb + hh) * cap + jj] : 0.0f;
#pragma unroll
          for (int x = 0; x < AMK_KV_LANE; ++x) acc[hh][x] += pw * vf[u][x];
        }
      }
    }
    // sum the row groups of this warp (lanes sub, sub + G, ...), then the warps in order
#pragma unroll 1
    for (int m = V.G; m < AMK_WARP_SIZE; m <<= 1)
#pragma unroll
      for (int hh = 0; hh < HB; ++hh)
#pragma unroll
        for (int x = 0; x < AMK_KV_LANE; ++x) acc[hh][x] += amk_shfl_xor(acc[hh][x], m);
    if (grp == 0) {
#pragma unroll
      for (int x = 0; x < AMK_KV_LANE; ++x) {
        const int d = amk_kv_dim(V, sub, x);
        if (d >= hd) continue;
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) wpart[(warp * HB + hh) * hd + d] = acc[hh][x];
      }
    }
    amk_syncthreads();
    amk_attn_pv_warps(o, wpart, hb, qh, hd, nw);
    amk_syncthreads();
  }
}

// o[h] += sum_{jj < tn} p[h * cap + jj] * v_{jt + jj} for every q head; all threads, ends
// with a barrier. wpart: nwarps * HB * hd words of scratch.
AMK_DEVICE void amk_attn_pv(const AmkKvRows& V, const float* p, int cap, int jt, int tn, int qh, float* o,
                            float* wpart) {
#if AMK_ATTN_PV_WIDE
  if (AMK_ATTN_PV_WIDE_ROWS(V)) return amk_attn_pv_wide(V, p, cap, jt, tn, qh, o, wpart);
#endif
#if AMK_ATTN_PV_SPLIT
  amk_attn_pv_split(V, p, cap, jt, tn, qh, o, wpart);
#endif
}

#ifndef AMK_DIAG_PV_MARK
#define AMK_DIAG_PV_MARK 0  // trace diagnostic: mark 2 before the P.V pass instead of after it
#endif
// AMK_ATTN_ONE_TILE (experiment, off; eval/PERF_NOTES.md item 205): the later tiles' second
// score pass (a whole inlined copy of amk_attn_scores) left out of the build, for programs where
// every split's rows fit its cached scores (loader.attn_score_cap: the chunk of the longest
// context within SCORE_CACHE_WORDS / q_heads; the 1B and SmolLM2 at ctx 1024 and 8192); a longer
// split reports a shape error. The kind of never-taken branch in a hot op that item 198 removed.
#ifndef AMK_ATTN_ONE_TILE
#define AMK_ATTN_ONE_TILE 0
#endif
AMK_DEVICE void amk_attn_partial_rows(const AmkCtx& c, const AmkKvRows& K, const AmkKvRows& V, const float* qs,
                                      float* o, float* mh, float* lh, int* mkey, float* wpart, float* cache, int cap,
                                      int j0, int j1, int qh, float scale, int qdt) {
#if AMK_ATTN_ONLY_WIDE
  if ((!AMK_ATTN_SCORES_SPLIT && !amk_attn_wide_ok(K)) ||
      (!AMK_ATTN_PV_SPLIT && !AMK_ATTN_PV_WIDE_ROWS(V))) {  // rows this build left out
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, K.dt, V.dt);
    return;
  }
#endif
#if AMK_ATTN_ONE_TILE
  if (j1 - j0 > cap) {  // a split longer than its cached scores: the tiles this build left out
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, j1 - j0, cap);
    return;
  }
#endif
  // pass 1: scores, the maximum per head, the first cap scores cached
  amk_attn_scores(K, qs, j0, j1, qh, scale, qdt, mkey, cache, cap);
  amk_syncthreads();
  for (int h = threadIdx.x; h < qh; h += blockDim.x) mh[h] = amk_order_unkey(mkey[h]);
  amk_syncthreads();
  amk_trace_mark(c, 1);  // scores and maxima done

  // pass 2: tiles of cap rows
  const int nw = amk_nwarps(), warp = amk_warp(), lane = amk_lane();
  for (int jt = j0; jt < j1; jt += cap) {
    const int tn = min(cap, j1 - jt);
#if !AMK_ATTN_ONE_TILE
    if (jt != j0) {  // a later tile: its scores again (pass 1 cached only the first cap)
      amk_attn_scores(K, qs, jt, jt + tn, qh, scale, qdt, nullptr, cache, cap);
      amk_syncthreads();
    }
#endif
    for (int idx = threadIdx.x; idx < qh * tn; idx += blockDim.x) {
      const int h = idx / tn, jj = idx - h * tn;
      cache[h * cap + jj] = amk_exp(amk_sub(cache[h * cap + jj], mh[h]));
    }
    amk_syncthreads();
    for (int h = warp; h < qh; h += nw) {  // l: one warp per head, fixed order
      float s = 0.0f;
      for (int jj = lane; jj < tn; jj += AMK_WARP_SIZE) s += cache[h * cap + jj];
      s = amk_warp_sum(s);
      if (lane == 0) lh[h] = amk_add(lh[h], s);
    }
#if AMK_DIAG_PV_MARK
    amk_trace_mark(c, 2);  // diagnostic: exp and l done (the P.V pass follows)
#endif
    amk_attn_pv(V, cache, cap, jt, tn, qh, o, wpart);
  }
}

// The cache rows [j0, j1) of one split at position pos (ir.AttnPartialParams: chunks of
// ceil(ceil((pos+1)/splits)/block)*block rows). Its two divisions run after pos arrives and
// before the partial's first K loads, so where splits and block are powers of two (16 and 16 in
// the default lowerings) they are shifts and a mask (eval/PERF_NOTES.md item 186: SmolLM2 shape
// -0.89 %, 1B -0.35 %); the divisions otherwise, and where AMK_SPLIT_DIVIDE (default
// AMK_QUOT_DIVIDE: the quantized builds, items 189-190) says so. Its own define, so that items 186
// and 187 could be measured apart: on the int4 1B these shifts alone measured even (item 190).
#ifndef AMK_SPLIT_DIVIDE
#define AMK_SPLIT_DIVIDE AMK_QUOT_DIVIDE
#endif
AMK_DEVICE void amk_attn_split_rows(int pos, int splits, int split, int block, int& j0, int& j1) {
  const int len = pos + 1;
  const bool pow2 = !AMK_SPLIT_DIVIDE && ((splits & (splits - 1)) | (block & (block - 1))) == 0;
  const int per = pow2 ? (len + splits - 1) >> amk_log2_pow2(splits) : (len + splits - 1) / splits;
  const int chunk = pow2 ? (per + block - 1) & -block : (per + block - 1) / block * block;
  j0 = min(split * chunk, len);
  j1 = min(j0 + chunk, len);
}

// While the partial waits for this step's q/k/v: hint the L2 to fetch the split's K and V
// rows, so that its loads after the wait hit L2 instead of HBM. A hint only (the prefetch
// cannot change what a load returns), so reading pos and the rows before the wait is safe
// even though the step appends one row. t and bufs: the global tables (the task may not be
// the one in shared memory); threads tid < nthr; stops when *keep_going drops to 0.
AMK_DEVICE void amk_attn_prefetch_rows(const AmkTask* t, const AmkBuffer* bufs, int tid, int nthr,
                                       const volatile int* keep_going) {
  const int rp = t->role[AMK_ROLE_POS], rk = t->role[AMK_ROLE_K], rv = t->role[AMK_ROLE_V];
  if (rp < 0 || rk < 0 || rv < 0) return;
  const AmkOperand& po = t->in[rp];
  const int pos = amk_load_int(bufs[po.buf], amk_flat(po, 0));
  int j0, j1;
  amk_attn_split_rows(pos, t->ip[AMK_P_ATTN_SPLITS], t->ip[AMK_P_ATTN_SPLIT], t->ip[AMK_P_ATTN_BLOCK], j0, j1);
  long long budget = 1ll << 62;
  for (int kv = 0; kv < 2; ++kv) {  // K then V rows j0 .. j1-1: runs of head_dim elements, one cache row apart
    const AmkOperand& o = t->in[kv == 0 ? rk : rv];
    const AmkBuffer& b = bufs[o.buf];
    if (pos < 0 || pos >= b.rows) return;
    const long long bytes = amk_dtype_bits(b.dtype) / 8;  // hints only: the op itself rejects non-float KV
#if AMK_KV_HEAD_MAJOR
    amk_i64 off, pitch;
    amk_kv_run(b, o, off, pitch);
    if (!amk_prefetch_runs((const char*)b.ptr, ((long long)j0 * pitch + off) * bytes, pitch * bytes,
#else
    if (!amk_prefetch_runs((const char*)b.ptr, ((long long)j0 * b.width + o.off) * bytes, b.width * bytes,
#endif
                           t->ip[AMK_P_ATTN_HEAD_DIM] * bytes, j1 - j0, tid, nthr, budget, keep_going))
      return;
  }
}

AMK_DEVICE void amk_op_attn_partial(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const int hd = t.ip[AMK_P_ATTN_HEAD_DIM], qh = t.ip[AMK_P_ATTN_Q_HEADS];
  const int splits = t.ip[AMK_P_ATTN_SPLITS], split = t.ip[AMK_P_ATTN_SPLIT], block = t.ip[AMK_P_ATTN_BLOCK];
  const int cap = t.ip[AMK_P_ATTN_SCORE_CAP];
  const float scale = t.fp[AMK_F_ATTN_SCALE];
  const int nw = amk_nwarps();
  if (hd > AMK_MAX_HEAD_DIM || cap < 1) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, hd, cap);
    return;
  }
  float* qs = amk_smem(c, amk_smem_attn_partial(t, nw));
  if (!qs) return;
  float* o = qs + qh * hd;
  float* mh = o + qh * hd;
  float* lh = mh + qh;
  int* mkey = (int*)(lh + qh);
  float* wpart = (float*)(mkey + qh);
  float* cache = wpart + nw * AMK_ATTN_HB * hd;

  const AmkOperand &q = amk_in(c, AMK_ROLE_Q), &k = amk_in(c, AMK_ROLE_K), &v = amk_in(c, AMK_ROLE_V);
  const AmkBuffer &qb = amk_buf(c, q), &kb = amk_buf(c, k), &vb = amk_buf(c, v);
  // the accumulators cleared before q's loads go out, not after they land (the SmolLM2 shape ~-2 %
  // across device calls, not paired: eval/PERF_NOTES.md item 157)
  for (int i = threadIdx.x; i < qh * hd; i += blockDim.x) o[i] = 0.0f;
  for (int h = threadIdx.x; h < qh; h += blockDim.x) lh[h] = 0.0f, mkey[h] = amk_order_key(amk_neg_inf());
  const int pos = amk_read_pos(c, amk_in(c, AMK_ROLE_POS));  // in flight while q is staged
  amk_for_elems(qb, q, 0, qh * hd, [&](int i, float x) { qs[i] = x; });
  if (!amk_check_pos(c, pos)) return;
  int j0, j1;
  amk_attn_split_rows(pos, splits, split, block, j0, j1);
  if (kb.dtype != vb.dtype) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, kb.dtype, vb.dtype);
    return;
  }
  amk_syncthreads();

  if (kb.dtype != AMK_DTYPE_F32 && kb.dtype != AMK_DTYPE_BF16 && kb.dtype != AMK_DTYPE_F16) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, kb.dtype);
    return;
  }
  amk_trace_mark(c, 0);  // q staged, pos read
  amk_attn_partial_rows(c, amk_kv_rows(kb, k, hd), amk_kv_rows(vb, v, hd), qs, o, mh, lh, mkey, wpart, cache, cap,
                        j0, j1, qh, scale, qb.dtype);
  amk_syncthreads();
#if !AMK_DIAG_PV_MARK
  amk_trace_mark(c, 2);  // P.V done
#endif

  const AmkOperand &oo = t.out[0], &ml = t.out[1];
  const AmkBuffer &ob = amk_buf(c, oo), &mb = amk_buf(c, ml);
  for (int i = threadIdx.x; i < qh * hd; i += blockDim.x) amk_store(ob, amk_flat(oo, i), o[i]);
  for (int h = threadIdx.x; h < qh; h += blockDim.x) {
    amk_store(mb, amk_flat(ml, 2 * h), mh[h]);
    amk_store(mb, amk_flat(ml, 2 * h + 1), lh[h]);
  }
}

// ATTN_COMBINE: one KV head's splits combined (combine.cuh). The (m, l) pairs of every split
// are staged once with parallel loads; the weights and the denominator per head follow in
// shared memory; each output element then sums its splits with batched loads.
// (with AMK_COMBINE_EARLY=2, the copied splits after them; vm/loader.py counts them in every build)
AMK_DEVICE AmkCombineShape amk_attn_combine_shape(const AmkTask& t) {
  return AmkCombineShape{1, t.ip[AMK_P_ATTN_Q_HEADS], t.ip[AMK_P_ATTN_HEAD_DIM], t.ip[AMK_P_ATTN_SPLITS]};
}
AMK_DEVICE long long amk_smem_attn_combine(const AmkTask& t) {
  const AmkCombineShape s = amk_attn_combine_shape(t);
  return AMK_COMBINE_EARLY == 2 ? amk_combine_copied_at(s) + amk_combine_copied_words(s) : amk_combine_smem_words(s);
}

// AMK_COMBINE_ONLY_HELD (experiment, off; eval/PERF_NOTES.md item 199): ATTN_COMBINE without its
// path from memory, for programs whose every combine holds its splits in registers
// (AmkCombineHeld::fits: the SmolLM2 shape, the 1B at ctx 1024; not the 8B); one that does not
// reports an error. Only in builds that hold them at all (AMK_COMBINE_EARLY: not int8 or int4).
// With AMK_ATTN_ONLY_WIDE it gave part of that one's gain back (item 200), so it stays off.
#ifndef AMK_COMBINE_ONLY_HELD
#define AMK_COMBINE_ONLY_HELD 0
#endif
AMK_DEVICE void amk_op_attn_combine(const AmkCtx& c) {
  const AmkTask& t = *c.t;
  const AmkCombineShape sh = amk_attn_combine_shape(t);
  float* wm = amk_smem(c, amk_smem_attn_combine(t));
  if (!wm) return;
  float* ls = wm + sh.pairs();
  float* den = ls + sh.pairs();
  float* copied = wm + amk_combine_copied_at(sh);  // AMK_COMBINE_EARLY=2's words
  const AmkOperand &po = amk_in(c, AMK_ROLE_O), &ml = amk_in(c, AMK_ROLE_ML), &y = t.out[0];
  const AmkBuffer &pb = amk_buf(c, po), &yb = amk_buf(c, y);
  const int i = threadIdx.x, n = sh.qh * sh.hd;
  const bool held = AmkCombineHeld::fits(pb, po, sh);  // AMK_COMBINE_EARLY: the splits loaded first
  const bool copy = AmkCombineCopied::fits(pb, po, sh);  // (2: or copied first)
  AmkCombineHeld splits_of_i;
  if (held && i < n) splits_of_i.load(pb.ptr, po, sh, i);
  if (copy) AmkCombineCopied::copy(pb.ptr, po, sh, copied);
  amk_combine_stage_ml(amk_buf(c, ml), ml, sh, wm, ls);
  amk_syncthreads();
  amk_trace_mark(c, 0);  // (m, l) staged
  amk_combine_weights(sh, wm, ls, den);
  if (copy) amk_cp_async_wait();
  amk_syncthreads();
  amk_trace_mark(c, 1);  // weights and denominators done
  if (copy) {
    for (int j = i; j < n; j += blockDim.x) {
      const int h = amk_quot(j, sh.hd);
      amk_store(yb, amk_flat(y, j), amk_div(AmkCombineCopied::sum(copied, wm, sh, h, j), den[h]));
    }
    return;
  }
  if (held) {
    if (i < n) {
      const int h = amk_quot(i, sh.hd);
      amk_store(yb, amk_flat(y, i), amk_div(splits_of_i.sum(wm, sh, h), den[h]));
    }
    return;
  }
#if AMK_COMBINE_ONLY_HELD && AMK_COMBINE_EARLY
  if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, sh.splits, n);  // a combine this build cannot hold
#else
  const auto out = amk_combine_outputs(pb.ptr, po, wm, den, sh,
                                       [&](int i, float v) { amk_store(yb, amk_flat(y, i), v); });
  const bool ok = amk_float_dispatch(pb.dtype, out);
#if AMK_DIAG_TWICE
  amk_syncthreads();
  amk_trace_mark(c, 2);  // cold output loop done
  amk_float_dispatch(pb.dtype, out);
#endif
  if (!ok && threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, pb.dtype);
#endif
}
