// 16-byte vectors: decoding the elements of one 16-byte load per storage format, and the
// coherent 16-byte load for data written during the launch (activations, the KV cache).
// Weights, which never change, use amk_ld16_weight (read-only path) instead.
#pragma once
#include "common.cuh"

struct alignas(16) AmkV16 {
  unsigned x, y, z, w;
};

// Plain (coherent) 16-byte load; p must be 16-byte aligned.
AMK_DEVICE amk_u32x4 amk_ld16(const void* p) {
  const AmkV16 v = *(const AmkV16*)p;
  amk_u32x4 r;
  r.x = v.x, r.y = v.y, r.z = v.z, r.w = v.w;
  return r;
}

// Why a lane reads x in its own order: the GEMV lanes of a row take consecutive weight
// vectors, so their fp32 slices of x sit 4 x (elements per vector) bytes apart in shared
// memory, and the same 16-byte read of every lane (its vector's c-th chunk of 4 floats) falls
// into the same 4 of the 32 banks: 2-way conflicts for bf16, 4-way for int8, 8-way for int4
// (which capped the int4 rows: eval/PERF_NOTES.md item 33). Each lane visits its vector's C
// chunks rotated by s, so the 8 lanes of a quarter warp read 8 different bank groups (int4:
// 4, rotated by whole words of two chunks; finer rotations cost ptxas registers it does not
// have); the weight words are rotated to match (AmkXRot::words), so chunk c of the rotated
// words pairs with x chunk (c + s) mod C.
// AMK_GEMV_XPAD (on by default) does without the rotation for quantized weights (C >= 4): the
// GEMV stages x with 4 unused floats after each such vector's slice (AmkXPad, gemv.cuh), so the
// slices of consecutive lanes sit 4 x (elements + 4) bytes apart and a quarter warp's 16-byte
// reads hit 8 different bank groups in natural order: no SELs to rotate the words, constant x
// offsets. (16-bit weights measured slower padded than rotated: eval/PERF_NOTES.md item 69.)
#ifndef AMK_GEMV_XPAD
#define AMK_GEMV_XPAD 1
#endif
#ifndef AMK_GEMV_XROT
#define AMK_GEMV_XROT 1
#endif
template <int C>  // chunks of 4 floats per vector: 1 (f32), 2 (16-bit), 4 (int8), 8 (int4)
struct AmkXRot {
  int s;
  // for the lane at position sub of its row: vectors 8 / C apart share a bank group
  static AMK_DEVICE AmkXRot of(int sub) {
    constexpr bool on = AMK_GEMV_XROT && !(AMK_GEMV_XPAD && C >= 4);  // padded x (AMK_GEMV_XPAD) needs none
    if constexpr (C == 8) return AmkXRot{on ? (sub & 3) << 1 : 0};
    else return AmkXRot{on ? (sub / (8 / C)) & (C - 1) : 0};
  }
  AMK_DEVICE const float* chunk(const float* xv, int c) const { return xv + (((c + s) & (C - 1)) << 2); }
  AMK_DEVICE float x(const float* xv, int j) const { return chunk(xv, j >> 2)[j & 3]; }  // x of element j
  AMK_DEVICE amk_u32x4 words(amk_u32x4 v) const {  // chunk c of the result = chunk (c + s) mod C of v
    if constexpr (C == 2) {
      if (s & 1) v = amk_u32x4{v.z, v.w, v.x, v.y};
    } else if constexpr (C >= 4) {
      const int w = C == 4 ? s : s >> 1;  // whole words (int4: two chunks a word)
      if (w & 1) v = amk_u32x4{v.y, v.z, v.w, v.x};
      if (w & 2) v = amk_u32x4{v.z, v.w, v.x, v.y};
    }
    return v;
  }
};

// The float with the bits of E (its top byte; the others zero) and byte k of w as its byte P
// (0: the mantissa's lowest, 2: the highest whole byte): one byte permute (a PRMT on CUDA),
// where shift, mask and or took three instructions (eval/PERF_NOTES.md item 35).
template <unsigned E, int P>
AMK_DEVICE float amk_biased_byte(unsigned w, int k) {
  constexpr unsigned keep = P == 0 ? 0x7440u : 0x7044u;  // result bytes other than P: zero, zero, E's top
  return __uint_as_float(amk_byte_perm(w, E, keep | ((unsigned)k << (4 * P))));
}

// Word i (0-3) of a 16-byte vector.
AMK_DEVICE unsigned amk_word(const amk_u32x4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Element j of a 16-byte vector of format DT, as fp32 (VEC elements of BITS bits each).
template <int DT> struct AmkWFmt;
template <> struct AmkWFmt<AMK_DTYPE_F32> {
  static constexpr int VEC = 4, BITS = 32;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = amk_word(v, j);
    return __uint_as_float(u);
  }
};
template <> struct AmkWFmt<AMK_DTYPE_BF16> {
  static constexpr int VEC = 8, BITS = 16;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = amk_word(v, j >> 1);
    return amk_bf16_to_f32((unsigned short)(j & 1 ? u >> 16 : u & 0xffffu));
  }
};
template <> struct AmkWFmt<AMK_DTYPE_F16> {
  static constexpr int VEC = 8, BITS = 16;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = amk_word(v, j >> 1);
    return amk_f16_to_f32((unsigned short)(j & 1 ? u >> 16 : u & 0xffffu));
  }
};
// How a quantized dot turns codes into floats (ScheduleConfig.quant_unpack, a build define):
// 1 a byte permute into a biased float's mantissa (amk_biased_byte; the default), 2 an
// integer-to-float conversion per code. The same products; I8 sums are bit-identical, U4
// ones differ in the last bits (the byte-permute form subtracts 128 * sum(x) at the end).
#ifndef AMK_Q_UNPACK
#define AMK_Q_UNPACK 1
#endif
static_assert(AMK_Q_UNPACK == 1 || AMK_Q_UNPACK == 2, "AMK_Q_UNPACK: 1 byte permute, 2 integer conversion");

// Strategy 2: sum_j code_j * x[j] over a vector of format F, each code converted by F::get.
template <class F, class R>
AMK_DEVICE float amk_qdot_converted(const amk_u32x4& v, const float* x, R rot) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < F::VEC; ++j) s += F::get(v, j) * rot.x(x, j);
  return s;
}

// AMK_GEMV_I8_XQ (eval/PERF_NOTES.md item 235): int8 rows dotted in integers. The GEMV rewrites each
// 16-column vector's slice of x, in place, as 24-bit fixed point with the slice's own step
// (amk_xq_pack), so a weight vector's dot is 8 dp2a (the high 16 bits) and 4 dp4a (the low 8)
// instead of 16 byte permutes, subtractions and FMAs with 4 shared loads of float x. A slice needs
// AmkXqFmt::WORDS of the 16 (padded: 20) floats it had. x moves by at most max|x| / 2^24 of its slice
// (an fp32 rounding of the slice's largest element; smaller elements lose bits), so a dot may move
// by sum_j |w_j| max|x|_slice(j) / 2^24 beyond an fp32 dot's rounding (tests/vm_cases.py xq_bound).
// A 32-bit form (hi and lo 16-bit, 16 dp2a) met the fp32 bound but lost most of the gain (the int8
// 1B -0.94 % against -3.44 %, H200). The loader sets it for symmetric int8 loads-ahead builds on NVIDIA
// targets (vm/loader.py _xq_define); 0 elsewhere.
// AMK_GEMV_U4_XQ (item 236): the same for int4, a 32-column slice a vector (the int4 1B -4.69 %,
// H200); the loader sets it for int4 builds of either rows loop on NVIDIA targets (item 240: the
// int4 SmolLM2 shape -3.75 % in the plain loop), 0 elsewhere.
// A code word's nibbles split into even and odd bytes (two LOP3), each dotted against x in the
// order they hold: 16 dp2a and 8 dp4a a vector instead of 32 byte moves and FMAs; the zero's term
// still comes from x's float chunk sums, taken before the packing (or by it: gemv.cuh AMK_GEMV_XQ_XSUMS).
// The GEMV rows pack x themselves, under their first weight loads (gemv.cuh amk_gemv_xq_pack_x).
#ifndef AMK_GEMV_I8_XQ
#define AMK_GEMV_I8_XQ 0
#endif
#ifndef AMK_GEMV_U4_XQ
#define AMK_GEMV_U4_XQ 0
#endif
// |q| at most 32767 * 256 - 128 (plus one for rounding): q = 256 hi + lo with lo a signed byte keeps hi
// inside 16 bits
constexpr float AMK_XQ_QMAX = 8388224.0f;
constexpr int AMK_XQ_TINY_BITS = 0x1f800000;  // a slice with max|x| under 2^-64 packs as zeros (QMAX / m finite)
// A packed slice of a weight format's vector: words [0, LO) the high parts (16-bit pairs: column j's in
// half hi_half(j) of word hi_word(j)), [LO, SCALE) the low bytes (column j's in byte lo_byte(j) of word
// LO + lo_word(j)), SCALE the step: the order in which the dot meets the codes.
template <int DT> struct AmkXqFmt;
template <> struct AmkXqFmt<AMK_DTYPE_I8> {  // natural order
  static constexpr int COLS = 16, LO = 8, SCALE = 12, WORDS = 13;
  static constexpr AMK_DEVICE int hi_word(int j) { return j >> 1; }
  static constexpr AMK_DEVICE int hi_half(int j) { return j & 1; }
  static constexpr AMK_DEVICE int lo_word(int j) { return j >> 2; }
  static constexpr AMK_DEVICE int lo_byte(int j) { return j & 3; }
};
// Code word i (columns 8i..8i+7, a nibble each) splits into its even nibbles' bytes (columns 8i, 8i+2,
// 8i+4, 8i+6) and its odd ones'; high words 4i..4i+3 pair the even bytes 0-1, 2-3, then the odd, and
// low words 2i, 2i+1 hold the even, then the odd columns.
template <> struct AmkXqFmt<AMK_DTYPE_U4> {
  static constexpr int COLS = 32, LO = 16, SCALE = 24, WORDS = 25;
  static constexpr AMK_DEVICE int hi_word(int j) { return 4 * (j >> 3) + 2 * (j & 1) + ((j >> 2) & 1); }
  static constexpr AMK_DEVICE int hi_half(int j) { return (j >> 1) & 1; }
  static constexpr AMK_DEVICE int lo_word(int j) { return 2 * (j >> 3) + (j & 1); }
  static constexpr AMK_DEVICE int lo_byte(int j) { return (j >> 1) & 3; }
};
static_assert(AmkXqFmt<AMK_DTYPE_I8>::WORDS <= 16 + 4 && AmkXqFmt<AMK_DTYPE_U4>::WORDS <= 32 + 4,
              "a packed slice fits the padded slot of its vector's columns");
// The sum of 8 columns in the order of x's chunk sums (gemv.cuh amk_gemv_xsums, and the int4 pack's
// own, amk_xq_pack: the two must give the same bits).
AMK_DEVICE float amk_sum8(float4 a, float4 b) { return ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w)); }
// Slice x[0, COLS) of `slot` -> x[j] ~ scale * q[j], q[j] = round(x[j] * QMAX / max|x|) (error at most
// max|x| / 2^24, an fp32 rounding of the slice's largest element). A NaN or infinite element makes
// the scale NaN, so the dot is NaN as the float one would be (not masked: a poisoned x stays visible).
// xsum (SUM): also the slice's sum of x, in the order of gemv.cuh amk_gemv_xsums (8-column trees, then
// the lanes' sums as its shuffles add them), so the same bits.
template <int DT, bool SUM = false>
AMK_DEVICE void amk_xq_pack(float* slot, float* xsum = nullptr) {
  using L = AmkXqFmt<DT>;
  float x[L::COLS];
#pragma unroll
  for (int c = 0; c < L::COLS / 4; ++c) {
    const float4 v = ((const float4*)slot)[c];
    x[4 * c] = v.x, x[4 * c + 1] = v.y, x[4 * c + 2] = v.z, x[4 * c + 3] = v.w;
  }
  if constexpr (SUM) {
    static_assert(L::COLS == 32, "a slice is one chunk of x's sums: four lanes' 8 columns each");
    float part[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const float* e = x + 8 * l;
      part[l] = amk_sum8(float4{e[0], e[1], e[2], e[3]}, float4{e[4], e[5], e[6], e[7]});
    }
    *xsum = (part[0] + part[2]) + (part[1] + part[3]);  // (shuffles by 2, then by 1)
  }
  int mb = 0;  // max |x| by its bits: non-negative floats order as integers, and NaN and inf sort last
#pragma unroll
  for (int j = 0; j < L::COLS; ++j) mb = max(mb, __float_as_int(x[j]) & 0x7fffffff);
  const bool finite = mb < 0x7f800000;
  const float m = __int_as_float(mb), inv = finite && mb >= AMK_XQ_TINY_BITS ? AMK_XQ_QMAX / m : 0.0f;
  unsigned hi[L::LO] = {}, lo[L::SCALE - L::LO] = {};
#pragma unroll
  for (int j = 0; j < L::COLS; ++j) {
    // |q| <= QMAX + 1 (two roundings in x * inv), inside 32767 * 256 + 127: no clamp needed
    const int q = amk_f2i_rn(x[j] * inv), l = (int)(signed char)(q & 0xff), h = (q - l) >> 8;
    hi[L::hi_word(j)] |= ((unsigned)h & 0xffffu) << (16 * L::hi_half(j));
    lo[L::lo_word(j)] |= ((unsigned)l & 0xffu) << (8 * L::lo_byte(j));
  }
  float4* out = (float4*)slot;
#pragma unroll
  for (int c = 0; c < L::LO / 4; ++c)
    out[c] = float4{__uint_as_float(hi[4 * c]), __uint_as_float(hi[4 * c + 1]), __uint_as_float(hi[4 * c + 2]),
                    __uint_as_float(hi[4 * c + 3])};
#pragma unroll
  for (int c = 0; c < (L::SCALE - L::LO) / 4; ++c)
    *(float4*)(slot + L::LO + 4 * c) = float4{__uint_as_float(lo[4 * c]), __uint_as_float(lo[4 * c + 1]),
                                              __uint_as_float(lo[4 * c + 2]), __uint_as_float(lo[4 * c + 3])};
  slot[L::SCALE] = finite ? m / AMK_XQ_QMAX : amk_nan();
}
// sum_j code_j * x[j] over a 16-byte int8 vector (word i: codes 4i..4i+3) and its packed slice.
// The sums are exact integers (|a| < 2^27, |b| < 2^19); a's conversion rounds beyond 2^24, then the
// fma and the step's product round once each.
AMK_DEVICE float amk_xq_dot(const amk_u32x4& v, const float* slot) {
  using L = AmkXqFmt<AMK_DTYPE_I8>;
  const float4 h0 = ((const float4*)slot)[0], h1 = ((const float4*)slot)[1], l = *(const float4*)(slot + L::LO);
  const float scale = slot[L::SCALE];
  int a = 0, b = 0;
  a = amk_dp2a_lo((unsigned)__float_as_int(h0.x), v.x, a), a = amk_dp2a_hi((unsigned)__float_as_int(h0.y), v.x, a);
  a = amk_dp2a_lo((unsigned)__float_as_int(h0.z), v.y, a), a = amk_dp2a_hi((unsigned)__float_as_int(h0.w), v.y, a);
  a = amk_dp2a_lo((unsigned)__float_as_int(h1.x), v.z, a), a = amk_dp2a_hi((unsigned)__float_as_int(h1.y), v.z, a);
  a = amk_dp2a_lo((unsigned)__float_as_int(h1.z), v.w, a), a = amk_dp2a_hi((unsigned)__float_as_int(h1.w), v.w, a);
  b = amk_dp4a((unsigned)__float_as_int(l.x), v.x, b), b = amk_dp4a((unsigned)__float_as_int(l.y), v.y, b);
  b = amk_dp4a((unsigned)__float_as_int(l.z), v.z, b), b = amk_dp4a((unsigned)__float_as_int(l.w), v.w, b);
  return scale * fmaf((float)a, 256.0f, (float)b);
}
// sum_j code_j * x[j] over a 16-byte int4 vector (word i: codes 8i..8i+7, low nibble first) and its
// packed slice. Codes 0..15 are the same bytes signed or not, so the signed dp2a / dp4a serve. The
// sums are exact and under 2^24 (|a| <= 32 * 15 * 32767), so a's conversion is exact too.
AMK_DEVICE float amk_xq_dot_u4(const amk_u32x4& v, const float* slot) {
  using L = AmkXqFmt<AMK_DTYPE_U4>;
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  const float4 l01 = *(const float4*)(slot + L::LO), l23 = *(const float4*)(slot + L::LO + 4);
  const float lw[8] = {l01.x, l01.y, l01.z, l01.w, l23.x, l23.y, l23.z, l23.w};
  int a = 0, b = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned even = w[i] & 0x0F0F0F0Fu, odd = (w[i] >> 4) & 0x0F0F0F0Fu;
    const float4 h = ((const float4*)slot)[i];
    a = amk_dp2a_lo((unsigned)__float_as_int(h.x), even, a), a = amk_dp2a_hi((unsigned)__float_as_int(h.y), even, a);
    a = amk_dp2a_lo((unsigned)__float_as_int(h.z), odd, a), a = amk_dp2a_hi((unsigned)__float_as_int(h.w), odd, a);
    b = amk_dp4a((unsigned)__float_as_int(lw[2 * i]), even, b), b = amk_dp4a((unsigned)__float_as_int(lw[2 * i + 1]), odd, b);
  }
  return slot[L::SCALE] * fmaf((float)a, 256.0f, (float)b);
}

template <> struct AmkWFmt<AMK_DTYPE_I8> {
  static constexpr int VEC = 16, BITS = 8;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = amk_word(v, j >> 2);
    return (float)(signed char)((u >> (8 * (j & 3))) & 0xffu);
  }
  // sum_j code_j * x[j] over the vector, exactly-converted codes: code + 128 as the low byte
  // of 2^23's mantissa is the float 2^23 + code + 128, so one byte permute (PRMT) and one
  // exact subtraction replace the (quarter-rate) integer-to-float conversion.
  static AMK_DEVICE float dot(const amk_u32x4& v, const float* x, AmkXRot<4> rot) {
    if constexpr (AMK_GEMV_I8_XQ) return amk_xq_dot(v, x);  // x: the packed slice (rot is none: padded x)
    if constexpr (AMK_Q_UNPACK == 2) return amk_qdot_converted<AmkWFmt>(v, x, rot);
    const unsigned w[4] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u, v.z ^ 0x80808080u, v.w ^ 0x80808080u};
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      s += (amk_biased_byte<0x4B000000u, 0>(w[j >> 2], j & 3) - 8388736.0f) * rot.x(x, j);
    return s;
  }
};
template <> struct AmkWFmt<AMK_DTYPE_U4> {  // element j: word j/8, bits 4*(j%8) (low nibble first)
  static constexpr int VEC = 32, BITS = 4;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = amk_word(v, j >> 3);
    return (float)((u >> (4 * (j & 7))) & 15u);
  }
  // sum_j code_j * x[j] over the vector, given xsum = sum_j x[j]: a code in bits 16..19 of
  // 128.0f's mantissa is the float 128 + code (exact), so each element costs one byte move
  // and one FMA; the 128 * xsum taken off at the end cancels ~4 bits (relative error ~1e-6).
  static AMK_DEVICE float dot(const amk_u32x4& v, const float* x, float xsum, AmkXRot<8> rot) {
    if constexpr (AMK_GEMV_U4_XQ) return amk_xq_dot_u4(v, x);  // x: the packed slice (rot is none: padded x)
    if constexpr (AMK_Q_UNPACK == 2) return amk_qdot_converted<AmkWFmt>(v, x, rot);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned even = w[i] & 0x0F0F0F0Fu, odd = (w[i] >> 4) & 0x0F0F0F0Fu;  // nibbles 0,2,4,6 | 1,3,5,7
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        s += amk_biased_byte<0x43000000u, 2>(even, b) * rot.x(x, 8 * i + 2 * b);
        s += amk_biased_byte<0x43000000u, 2>(odd, b) * rot.x(x, 8 * i + 2 * b + 1);
      }
    }
    return s - 128.0f * xsum;
  }
};


// ---------------------------------------------------------------- batched element reads
// f(i, element first + i of flat operand o as fp32) for i in [0, n), spread over the block's
// threads. Every thread issues a whole batch of loads before it uses the first: a loop that
// stores each value (to shared or global memory) before the next load pays one full memory
// latency per element, because the compiler cannot prove the store and the next load
// disjoint (measured: a K = 8192 GEMV prologue of 32 such round trips per thread). One
// contiguous, 16-byte aligned float run takes 16-byte loads, AMK_STAGE_UNROLL per batch;
// everything else (tails, strided operands, integer dtypes) element loads, AMK_STAGE_ELEM_UNROLL per
// batch. The element -> thread mapping is fixed, so sums over f stay deterministic.
#ifndef AMK_STAGE_UNROLL
#define AMK_STAGE_UNROLL 4
#endif
// Element loads a batch: 4, not 16, because each is a dtype switch and an amk_flat inlined at
// every call site, and the code cost more than the loads in flight gained (PERF_NOTES item 81:
// 41 KB less code in the Llama build, SmolLM2 shape -1.4 %, 1B -0.5 %).
#ifndef AMK_STAGE_ELEM_UNROLL
#define AMK_STAGE_ELEM_UNROLL 4
#endif

template <int DT, class F>
AMK_DEVICE int amk_for_elems_vec(const char* base, int n, F& f, int tid, int T) {
  using Fmt = AmkWFmt<DT>;
  constexpr int U = AMK_STAGE_UNROLL;
  const int nvec = n / Fmt::VEC;
#pragma unroll 1
  for (int v0 = tid; v0 < nvec; v0 += T * U) {
    amk_u32x4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * T < nvec) raw[u] = amk_ld16(base + (amk_i64)(v0 + u * T) * 16);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * T;
      if (v < nvec) {
#pragma unroll
        for (int j = 0; j < Fmt::VEC; ++j) f(v * Fmt::VEC + j, Fmt::get(raw[u], j));
      }
    }
  }
  return nvec * Fmt::VEC;  // elements covered
}

// The vector path for DT where this build compiles it (AMK_DTYPES), else nothing covered.
template <int DT, class F>
AMK_DEVICE int amk_for_elems_vec_if(const char* base, int n, F& f, int tid, int T) {
  if constexpr (AMK_WITH_DTYPE(DT)) return amk_for_elems_vec<DT>(base, n, f, tid, T);
  else return 0;
}

// (threads tid = 0..T-1 of a group share the elements: the whole block by default)
template <class F>
AMK_DEVICE void amk_for_elems(const AmkBuffer& b, const AmkOperand& o, amk_i64 first, int n, F f, int tid, int T) {
  int done = 0;
  const int bytes = b.dtype == AMK_DTYPE_F32 ? 4 : (b.dtype == AMK_DTYPE_BF16 || b.dtype == AMK_DTYPE_F16) ? 2 : 0;
  if (bytes != 0 && (o.count <= 1 || first + n <= o.len)) {  // inside the first (contiguous) run
    const char* base = (const char*)b.ptr + (o.off + first) * bytes;
    if ((unsigned long long)base % 16 == 0) {
      if (b.dtype == AMK_DTYPE_F32) done = amk_for_elems_vec_if<AMK_DTYPE_F32>(base, n, f, tid, T);
      else if (b.dtype == AMK_DTYPE_BF16) done = amk_for_elems_vec_if<AMK_DTYPE_BF16>(base, n, f, tid, T);
      else done = amk_for_elems_vec_if<AMK_DTYPE_F16>(base, n, f, tid, T);
    }
  }
  constexpr int U = AMK_STAGE_ELEM_UNROLL;
#pragma unroll 1
  for (int i0 = done + tid; i0 < n; i0 += T * U) {
    float v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * T < n) v[u] = amk_load(b, amk_flat(o, first + i0 + u * T));
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * T < n) f(i0 + u * T, v[u]);
  }
}

template <class F>
AMK_DEVICE void amk_for_elems(const AmkBuffer& b, const AmkOperand& o, amk_i64 first, int n, F f) {
  amk_for_elems(b, o, first, n, f, threadIdx.x, blockDim.x);
}

// f(i, rnd(x + rnd(sum_s part[s]))) for element first + i of x and of each of part's count
// runs (fp32), the partials summed in order s = 0, 1, ... and rnd rounding to x's dtype: what a
// split-K REDUCE with the ADD epilogue would have stored into x (ir.GemvParams x_partials).
// Every load of a batch is issued before the first add: up to AMK_X_PARTS_UNROLL partials (4:
// SmolLM2's 3 slices) cost one round trip. A contiguous, 16-byte aligned x with 16-byte aligned
// partial runs takes 16-byte loads, a vector of x a thread (eval/PERF_NOTES.md item 139: the
// element loads alone, 4 a batch, took the SmolLM2 gate/up prologue from 2.0 to 5.4 us); the
// rest element loads, AMK_STAGE_ELEM_UNROLL a batch.
#ifndef AMK_X_PARTS_UNROLL
#define AMK_X_PARTS_UNROLL 4
#endif
#ifndef AMK_X_PARTS_VEC
#define AMK_X_PARTS_VEC 1  // 0: element loads only (the tests' way to reach that path)
#endif
// s[j] (+)= part[k][at(j)] for the partials k of [k0, k0 + AMK_X_PARTS_UNROLL), j < N: all loads first
template <int N, class At>
AMK_DEVICE void amk_add_partials(float (&s)[N], amk_u64 ptr, const AmkOperand& part, int k0, At at) {
  constexpr int KU = AMK_X_PARTS_UNROLL;
  float t[KU][N];
#pragma unroll
  for (int k = 0; k < KU; ++k)
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (k0 + k < part.count && at(j) >= 0)
        t[k][j] = amk_load_as<AMK_DTYPE_F32>(ptr, part.off + (amk_i64)(k0 + k) * part.stride + at(j));
#pragma unroll
  for (int k = 0; k < KU; ++k)
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (k0 + k < part.count && at(j) >= 0) s[j] = k0 + k == 0 ? t[k][j] : amk_add(s[j], t[k][j]);
}

// v read with the sum s of its partials: rnd(v + rnd(s)), rnd rounding to v's dtype dt (the
// REDUCE's ADD epilogue: the sum rounded as its accumulator, then the stored residual add)
AMK_DEVICE float amk_plus_partial_sum(int dt, float v, float s) { return amk_round(dt, amk_add(v, amk_round(dt, s))); }

template <int DT, class F>
AMK_DEVICE int amk_plus_partials_vec(const char* base, amk_u64 pptr, const AmkOperand& part, amk_i64 first, int n,
                                     int xdt, F& f, int tid, int T) {
  using Fmt = AmkWFmt<DT>;
  constexpr int VEC = Fmt::VEC;
  const int nvec = n / VEC;
#pragma unroll 1
  for (int v = tid; v < nvec; v += T) {
    const amk_u32x4 raw = amk_ld16(base + (amk_i64)v * 16);
    float s[VEC];
#pragma unroll 1
    for (int k0 = 0; k0 < part.count; k0 += AMK_X_PARTS_UNROLL)
      amk_add_partials(s, pptr, part, k0, [&](int j) { return first + (amk_i64)v * VEC + j; });
#pragma unroll
    for (int j = 0; j < VEC; ++j) f(v * VEC + j, amk_plus_partial_sum(xdt, Fmt::get(raw, j), s[j]));
  }
  return nvec * VEC;
}

template <class F>
AMK_DEVICE void amk_for_elems_plus_partials(const AmkBuffer& xb, const AmkOperand& x, const AmkBuffer& pb,
                                            const AmkOperand& part, amk_i64 first, int n, F f, int tid, int T) {
  int done = 0;
  const char* base = (const char*)xb.ptr + (x.off + first) * amk_dtype_bits(xb.dtype) / 8;
  const bool aligned = (unsigned long long)base % 16 == 0 && (pb.ptr + 4 * (part.off + first)) % 16 == 0 &&
                       (part.count <= 1 || part.stride % 4 == 0);
  if (AMK_X_PARTS_VEC && aligned && (x.count <= 1 || first + n <= x.len)) {  // inside x's first (contiguous) run
    if (xb.dtype == AMK_DTYPE_BF16) {
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_BF16)) done = amk_plus_partials_vec<AMK_DTYPE_BF16>(base, pb.ptr, part, first, n, xb.dtype, f, tid, T);
    } else if (xb.dtype == AMK_DTYPE_F16) {
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F16)) done = amk_plus_partials_vec<AMK_DTYPE_F16>(base, pb.ptr, part, first, n, xb.dtype, f, tid, T);
    } else if (xb.dtype == AMK_DTYPE_F32) {
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F32)) done = amk_plus_partials_vec<AMK_DTYPE_F32>(base, pb.ptr, part, first, n, xb.dtype, f, tid, T);
    }
  }
  constexpr int U = AMK_STAGE_ELEM_UNROLL;
#pragma unroll 1
  for (int i0 = done + tid; i0 < n; i0 += T * U) {
    float v[U], s[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * T < n) v[u] = amk_load(xb, amk_flat(x, first + i0 + u * T));
#pragma unroll 1
    for (int k0 = 0; k0 < part.count; k0 += AMK_X_PARTS_UNROLL)
      amk_add_partials(s, pb.ptr, part, k0, [&](int u) { return i0 + u * T < n ? first + i0 + u * T : -1; });
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * T < n) f(i0 + u * T, amk_plus_partial_sum(xb.dtype, v[u], s[u]));
  }
}

// sum over k = 0 .. n-1 of term(k, load(k)), added in order k = 0, 1, ... (the first term as
// it is), the loads issued in batches of U before their first use: the split-K REDUCE and the
// attention combine sum their splits this way, in the reference's order.
#ifndef AMK_SPLIT_SUM_UNROLL
#define AMK_SPLIT_SUM_UNROLL 16  // split loads in flight per thread (REDUCE, the attention combine)
#endif
template <int U, class Load, class Term>
AMK_DEVICE float amk_ordered_sum(int n, Load load, Term term) {
  float s = 0.0f;
#pragma unroll 1
  for (int k0 = 0; k0 < n; k0 += U) {
    float v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (k0 + u < n) v[u] = load(k0 + u);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (k0 + u < n) {
        const float x = term(k0 + u, v[u]);
        s = k0 + u == 0 ? x : amk_add(s, x);
      }
  }
  return s;
}
