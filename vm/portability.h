// The vendor seam: everything above this header is vendor-neutral device code.
//
// Per-architecture primitives live in their own header with the same function names:
//   vm/arch_cuda.h  NVIDIA (PTX: ld.acquire.gpu, globaltimer, cvt.rn.bf16, ...)
//   vm/arch_hip.h   AMD (__hip_atomic_* with __HIP_MEMORY_SCOPE_AGENT, wave64, s_sleep, ...)
// Each provides: AMK_DEVICE, AMK_DEVICE_NOINLINE, AMK_WARP_SIZE (overridable with -DAMK_WARP_SIZE=..),
// amk_ld_acquire_gpu, amk_release_add_gpu, amk_fence_gpu, amk_ld_volatile, amk_nanosleep,
// amk_timer_ns, amk_prefetch_l2, amk_prefetch_l1, amk_shfl_xor[_int], amk_syncthreads, amk_syncwarp,
// amk_ld16_weight, amk_log2_pow2, bf16/f16 <-> f32 conversions and the exact arithmetic helpers (amk_mul,
// amk_add, amk_sub, amk_div, amk_rsqrt; the rest of the math is below), and the
// shared-memory declarations AMK_BLOCK_SHARED(type, name) / AMK_DYNAMIC_SHARED(name).
// A chiplet architecture (vm/arch_hip_gfx94.h) also provides amk_ld_acquire_xcd /
// amk_release_add_xcd and defines AMK_HAS_XCD_SCOPE; elsewhere XCD scope is device scope.
#pragma once

#if defined(AMK_ARCH_EMU)
#include "arch_emu.h"  // host emulation for CPU tests (tests/emu/): one OS thread per GPU thread
#elif defined(__HIPCC__) || defined(__HIPCC_RTC__)
#include "arch_hip.h"
#else
#include "arch_cuda.h"
#endif

#include "tables.h"

// ---------------------------------------------------------------- the same on every vendor
// exp and sincos are the libm-accurate ones (not the fast intrinsics); -inf and a quiet NaN by bits.
AMK_DEVICE float amk_exp(float a) { return expf(a); }
AMK_DEVICE void amk_sincos(float a, float* s, float* c) { sincosf(a, s, c); }  // one range reduction for both
AMK_DEVICE bool amk_isnan(float a) { return a != a; }
AMK_DEVICE float amk_neg_inf() { return __int_as_float((int)0xff800000u); }
AMK_DEVICE float amk_nan() { return __int_as_float(0x7fffffff); }

// ---------------------------------------------------------------- integer dot products
#ifndef AMK_HAS_IDP
// Where the architecture header has none (HIP, the CPU emulator): arch_cuda.h's signed dp2a / dp4a
// in plain integer arithmetic.
AMK_DEVICE int amk_idp_byte(unsigned b, int i) { return (int)(signed char)((b >> (8 * i)) & 0xffu); }
AMK_DEVICE int amk_idp_half(unsigned a, int i) { return (int)(short)((a >> (16 * i)) & 0xffffu); }
AMK_DEVICE int amk_dp2a_lo(unsigned a, unsigned b, int c) {
  return c + amk_idp_half(a, 0) * amk_idp_byte(b, 0) + amk_idp_half(a, 1) * amk_idp_byte(b, 1);
}
AMK_DEVICE int amk_dp2a_hi(unsigned a, unsigned b, int c) {
  return c + amk_idp_half(a, 0) * amk_idp_byte(b, 2) + amk_idp_half(a, 1) * amk_idp_byte(b, 3);
}
AMK_DEVICE int amk_dp4a(unsigned a, unsigned b, int c) {
  for (int i = 0; i < 4; ++i) c += amk_idp_byte(a, i) * amk_idp_byte(b, i);
  return c;
}
#endif
// float -> int, rounded to nearest even
#if defined(AMK_ARCH_EMU)
AMK_DEVICE int amk_f2i_rn(float v) { return (int)lrintf(v); }
#else
AMK_DEVICE int amk_f2i_rn(float v) { return __float2int_rn(v); }
#endif

// ---------------------------------------------------------------- counter scopes
#ifndef AMK_HAS_XCD_SCOPE
// One L2 for the whole GPU: the cheaper XCD scope is device scope.
AMK_DEVICE unsigned amk_ld_acquire_xcd(const unsigned* p) { return amk_ld_acquire_gpu(p); }
AMK_DEVICE void amk_release_add_xcd(unsigned* p, unsigned v) { amk_release_add_gpu(p, v); }
#endif

// Wait / signal a counter at its memory scope (AmkScope, from the Program's Counter.scope).
AMK_DEVICE unsigned amk_ld_acquire(const unsigned* p, int scope) {
  return scope == AMK_SCOPE_XCD ? amk_ld_acquire_xcd(p) : amk_ld_acquire_gpu(p);
}
AMK_DEVICE void amk_release_add(unsigned* p, unsigned v, int scope) {
  if (scope == AMK_SCOPE_XCD) amk_release_add_xcd(p, v);
  else amk_release_add_gpu(p, v);
}

// ---------------------------------------------------------------- reductions
AMK_DEVICE float amk_warp_sum(float v) {
#pragma unroll
  for (int m = AMK_WARP_SIZE / 2; m > 0; m >>= 1) v += amk_shfl_xor(v, m);
  return v;
}

AMK_DEVICE float amk_warp_max(float v) {
#pragma unroll
  for (int m = AMK_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, amk_shfl_xor(v, m));
  return v;
}

// Block-wide sum; every thread gets the result. `red` is >= 32 floats of shared memory.
// Contains barriers: call from all threads of the block. `red_fresh`: no earlier reduction of
// this op reads `red` (the scheduler's barriers come before an op), so its guard barrier goes.
AMK_DEVICE float amk_block_sum(float v, float* red, bool red_fresh = false) {
  const int lane = threadIdx.x % AMK_WARP_SIZE, warp = threadIdx.x / AMK_WARP_SIZE;
  const int nwarps = (blockDim.x + AMK_WARP_SIZE - 1) / AMK_WARP_SIZE;
  v = amk_warp_sum(v);
  if (!red_fresh) amk_syncthreads();  // red may still be read by a previous reduction
  if (lane == 0) red[warp] = v;
  amk_syncthreads();
  float s = 0.0f;
  for (int w = 0; w < nwarps; ++w) s += red[w];  // same order in every thread
  return s;
}
