// AMD (HIP, CDNA gfx9: MI300X gfx942, MI350X gfx950) primitives behind vm/portability.h.
// Same function names as vm/arch_cuda.h. Built at run time by hiprtc (vm/build_hip.py) and
// checked offline by clang (vm/hip_compile_check.py); never run on AMD hardware so far.
#pragma once

#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>  // hiprtc declares the runtime itself
#endif

#ifndef AMK_WARP_SIZE
#define AMK_WARP_SIZE 64  // CDNA wavefronts are 64 lanes wide
#endif

#define AMK_DEVICE __device__ __forceinline__
#define AMK_DEVICE_NOINLINE __device__ __attribute__((noinline))  // cold paths kept out of the hot code
// HIP's __launch_bounds__ takes waves per SIMD, not blocks per CU: state both limits directly
// (4 SIMDs per CU, so min_blocks blocks of `threads` need min_blocks*threads/(4*64) waves each).
#define AMK_KERNEL(threads, min_blocks)                                           \
  __global__ void __attribute__((amdgpu_flat_work_group_size(1, threads),         \
                                 amdgpu_waves_per_eu(((min_blocks) * (threads) + 4 * AMK_WARP_SIZE - 1) / (4 * AMK_WARP_SIZE))))

// Shared memory (LDS): one variable per block, and the launch's dynamic shared memory.
#define AMK_BLOCK_SHARED(type, name) __shared__ type name
#define AMK_DYNAMIC_SHARED(name) extern __shared__ float4 name[]

// ---------------------------------------------------------------- memory ordering
// Device ("agent") scope reaches every XCD: the release writes back this XCD's L2
// (buffer_wbl2 sc1), the acquire invalidates it (buffer_inv sc1).
AMK_DEVICE unsigned amk_ld_acquire_gpu(const unsigned* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}

// Release increment, issued by one thread after a __syncthreads (whose workgroup-scope
// fences order the other waves' stores before it, as on CUDA).
AMK_DEVICE void amk_release_add_gpu(unsigned* p, unsigned v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}

AMK_DEVICE void amk_fence_gpu() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }

AMK_DEVICE int amk_ld_volatile(const volatile int* p) { return *p; }

// s_sleep takes an immediate (units of 64 clocks, about 30 ns at 2.1 GHz): sleep in steps.
AMK_DEVICE void amk_nanosleep(unsigned ns) {
  for (unsigned slept = 0; slept < ns; slept += 64) __builtin_amdgcn_s_sleep(2);
}

// Wall-clock nanoseconds: the constant 100 MHz real-time counter of gfx9 (s_memrealtime;
// hipDeviceAttributeWallClockRate is 100000 kHz on MI200/MI300).
AMK_DEVICE unsigned long long amk_timer_ns() { return __builtin_amdgcn_s_memrealtime() * 10ull; }

// gfx9 has no L2 prefetch instruction: weights are fetched on first touch.
AMK_DEVICE void amk_prefetch_l2(const void*) {}
AMK_DEVICE void amk_prefetch_l1(const void*) {}

// ---------------------------------------------------------------- wavefronts
AMK_DEVICE float amk_shfl_xor(float v, int mask) { return __shfl_xor(v, mask, AMK_WARP_SIZE); }
AMK_DEVICE int amk_shfl_xor_int(int v, int mask) { return __shfl_xor(v, mask, AMK_WARP_SIZE); }

AMK_DEVICE void amk_syncthreads() { __syncthreads(); }
// A wavefront runs in lockstep: only keep the compiler from moving LDS accesses across.
AMK_DEVICE void amk_syncwarp() { __builtin_amdgcn_wave_barrier(); }

// ---------------------------------------------------------------- 16-byte loads
struct amk_u32x4 {
  unsigned x, y, z, w;
};

// No asynchronous global-to-shared copy on gfx9: a load and a store (the copying thread waits at once).
AMK_DEVICE void amk_cp_async16(void* smem, const void* gmem) { *(amk_u32x4*)smem = *(const amk_u32x4*)gmem; }
AMK_DEVICE void amk_cp_async_wait() {}

// 16-byte load of immutable data (weights), streamed once per step: a non-temporal load.
AMK_DEVICE amk_u32x4 amk_ld16_weight(const void* p) {
  typedef unsigned amk_v4u __attribute__((ext_vector_type(4)));
  const amk_v4u v = __builtin_nontemporal_load((const amk_v4u*)p);
  amk_u32x4 r;
  r.x = v.x, r.y = v.y, r.z = v.z, r.w = v.w;
  return r;
}

// Byte i of the result is byte (s >> 4i) & 7 of y:x (x bytes 0-3), as CUDA's __byte_perm
// (v_perm_b32): builds a float from a weight byte and constant exponent bytes (instructions/vec.cuh).
AMK_DEVICE unsigned amk_byte_perm(unsigned x, unsigned y, unsigned s) { return __byte_perm(x, y, s); }
AMK_DEVICE int amk_log2_pow2(int v) { return __ffs(v) - 1; }  // v a power of two

// ---------------------------------------------------------------- conversions
// Exact round-to-nearest-even conversions, matching torch's .to(dtype).
AMK_DEVICE float amk_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

AMK_DEVICE unsigned short amk_f32_to_bf16(float f) {
  const unsigned u = __float_as_uint(f);
  if (f != f) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN, sign kept
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

AMK_DEVICE float amk_f16_to_f32(unsigned short h) { return (float)__builtin_bit_cast(_Float16, h); }

AMK_DEVICE unsigned short amk_f32_to_f16(float f) { return __builtin_bit_cast(unsigned short, (_Float16)f); }

// ---------------------------------------------------------------- exact arithmetic
// Element-wise steps that the reference does as separate torch ops must not be contracted
// into FMAs (HIP compiles with -ffp-contract=fast): each rounds exactly once, as torch does.
// Division and square root are correctly rounded (-fhip-fp32-correctly-rounded-divide-sqrt).
#define AMK_NO_CONTRACT _Pragma("clang fp contract(off)")
AMK_DEVICE float amk_mul(float a, float b) { AMK_NO_CONTRACT return a * b; }
AMK_DEVICE float amk_add(float a, float b) { AMK_NO_CONTRACT return a + b; }
AMK_DEVICE float amk_sub(float a, float b) { AMK_NO_CONTRACT return a - b; }
AMK_DEVICE float amk_div(float a, float b) { AMK_NO_CONTRACT return a / b; }
AMK_DEVICE float amk_rsqrt(float a) { AMK_NO_CONTRACT return 1.0f / sqrtf(a); }

// ---------------------------------------------------------------- chiplets
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__)
#include "arch_hip_gfx94.h"  // one L2 per XCD: the cheaper XCD-scoped signal and wait
#endif
