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

// Element j of a 16-byte vector of format DT, as fp32 (VEC elements of BITS bits each).
template <int DT> struct AmkWFmt;
template <> struct AmkWFmt<AMK_DTYPE_F32> {
  static constexpr int VEC = 4, BITS = 32;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
    return __uint_as_float(u);
  }
};
template <> struct AmkWFmt<AMK_DTYPE_BF16> {
  static constexpr int VEC = 8, BITS = 16;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = (j >> 1) == 0 ? v.x : (j >> 1) == 1 ? v.y : (j >> 1) == 2 ? v.z : v.w;
    return amk_bf16_to_f32((unsigned short)(j & 1 ? u >> 16 : u & 0xffffu));
  }
};
template <> struct AmkWFmt<AMK_DTYPE_F16> {
  static constexpr int VEC = 8, BITS = 16;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = (j >> 1) == 0 ? v.x : (j >> 1) == 1 ? v.y : (j >> 1) == 2 ? v.z : v.w;
    return amk_f16_to_f32((unsigned short)(j & 1 ? u >> 16 : u & 0xffffu));
  }
};
template <> struct AmkWFmt<AMK_DTYPE_I8> {
  static constexpr int VEC = 16, BITS = 8;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = (j >> 2) == 0 ? v.x : (j >> 2) == 1 ? v.y : (j >> 2) == 2 ? v.z : v.w;
    return (float)(signed char)((u >> (8 * (j & 3))) & 0xffu);
  }
};
template <> struct AmkWFmt<AMK_DTYPE_U4> {  // element j: word j/8, bits 4*(j%8) (low nibble first)
  static constexpr int VEC = 32, BITS = 4;
  static AMK_DEVICE float get(const amk_u32x4& v, int j) {
    const unsigned u = (j >> 3) == 0 ? v.x : (j >> 3) == 1 ? v.y : (j >> 3) == 2 ? v.z : v.w;
    return (float)((u >> (4 * (j & 7))) & 15u);
  }
};

