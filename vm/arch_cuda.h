// NVIDIA (sm_80 and newer) primitives behind vm/portability.h.
// Only this header names PTX; vm/arch_hip.h provides the same functions for AMD.
#pragma once

#ifndef AMK_WARP_SIZE
#define AMK_WARP_SIZE 32
#endif

#define AMK_DEVICE __device__ __forceinline__
#define AMK_DEVICE_NOINLINE __device__ __noinline__  // cold paths kept out of the hot code
#define AMK_KERNEL(threads, min_blocks) __global__ void __launch_bounds__(threads, min_blocks)

// GEMV 16-byte loads in flight per lane (instructions/gemv.cuh). sm_120's ptxas spends
// registers more freely; two in flight keeps the whole megakernel free of spills there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200 && !defined(AMK_GEMV_UNROLL)
#define AMK_GEMV_UNROLL 2
#endif
// Quantized weights: 8 on sm_90, 4 below (8 spills there), 2 on sm_120; a build that compiles
// both quantized formats (the generic, all-dtype build) keeps 2 to stay free of spills.
#if defined(__CUDA_ARCH__) && !defined(AMK_GEMV_UNROLL_Q)
#define AMK_GEMV_UNROLL_Q                                                                  \
  (AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_I8) && AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_U4) ? 2            \
   : __CUDA_ARCH__ >= 1200                                                 ? 2            \
   : __CUDA_ARCH__ >= 900                                                  ? 8            \
                                                                           : 4)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200 && !defined(AMK_ARGMAX_UNROLL)
#define AMK_ARGMAX_UNROLL 2  // and the logit vectors in flight per thread (instructions/argmax.cuh)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200 && !defined(AMK_SPLIT_SUM_UNROLL)
#define AMK_SPLIT_SUM_UNROLL 4  // and the split loads per batch of REDUCE / the combine (instructions/vec.cuh; 8 spills)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200 && !defined(AMK_STAGE_UNROLL)
#define AMK_STAGE_UNROLL 1  // and the activation vectors per batch (instructions/vec.cuh; 2 spills 1.7 KB)
#endif

#define AMK_FULL_MASK 0xffffffffu

// Shared memory: one variable per block, and the launch's dynamic shared memory (16-byte aligned).
#define AMK_BLOCK_SHARED(type, name) __shared__ type name
#define AMK_DYNAMIC_SHARED(name) extern __shared__ float4 name[]

// ---------------------------------------------------------------- memory ordering
// Acquire load at GPU scope: later loads of this thread (and, after a __syncthreads, of its
// block) observe everything the releasing producer made visible.
AMK_DEVICE unsigned amk_ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release increment at GPU scope, issued by one thread after a __syncthreads: the release is
// cumulative over the block's stores that the barrier ordered before it. One red.release
// rather than __threadfence() + atomicAdd: __threadfence is a sequentially consistent fence,
// stronger than a release needs (SmolLM2 shape 1379 -> 1334 us, eval/PERF_NOTES.md item 25).
AMK_DEVICE void amk_release_add_gpu(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

AMK_DEVICE void amk_fence_gpu() { __threadfence(); }

AMK_DEVICE int amk_ld_volatile(const volatile int* p) { return *p; }

AMK_DEVICE void amk_nanosleep(unsigned ns) { __nanosleep(ns); }

// Wall-clock nanoseconds (the global timer), for the spin budget.
AMK_DEVICE unsigned long long amk_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Hint the L2 to fetch the line holding p (immutable data only).
AMK_DEVICE void amk_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// ---------------------------------------------------------------- warps
AMK_DEVICE float amk_shfl_xor(float v, int mask) { return __shfl_xor_sync(AMK_FULL_MASK, v, mask, AMK_WARP_SIZE); }
AMK_DEVICE int amk_shfl_xor_int(int v, int mask) { return __shfl_xor_sync(AMK_FULL_MASK, v, mask, AMK_WARP_SIZE); }

AMK_DEVICE void amk_syncthreads() { __syncthreads(); }

// ---------------------------------------------------------------- 16-byte loads
struct amk_u32x4 {
  unsigned x, y, z, w;
};

// 16-byte load of immutable data (weights): read-only path, no L1 allocation.
AMK_DEVICE amk_u32x4 amk_ld16_weight(const void* p) {
  amk_u32x4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// 16-byte load from shared memory (GEMV weights the ring brought there, instructions/gemv.cuh).
AMK_DEVICE amk_u32x4 amk_ld16_shared(const void* p) {
  amk_u32x4 r;
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
  return r;
}

// ---------------------------------------------------------------- bulk copies (sm_90+)
// Global -> shared memory by the TMA, completed on an mbarrier: one thread issues a whole run
// of weight bytes and no register holds them while they are in flight (the GEMV weight ring).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AMK_HAS_STAGE 1
#ifndef AMK_STAGE_L2_EVICT_FIRST
#define AMK_STAGE_L2_EVICT_FIRST 1  // the copies' L2 lines evict-first (0: the default policy)
#endif
#ifndef AMK_STAGE_INIT_FENCE
#define AMK_STAGE_INIT_FENCE 1  // experiment: 0 skips the mbarrier-init fence (the barrier is used by its own warp)
#endif
AMK_DEVICE unsigned amk_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
AMK_DEVICE void amk_stage_bar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(amk_smem_addr(bar)) : "memory");
  if (AMK_STAGE_INIT_FENCE) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Before the barrier's memory serves anything else (another op's shared memory).
AMK_DEVICE void amk_stage_bar_inval(unsigned long long* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(amk_smem_addr(bar)) : "memory");
}
// Arrive on bar expecting `bytes` more of asynchronous copies: its phase completes when they land.
AMK_DEVICE void amk_stage_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(amk_smem_addr(bar)), "r"(bytes)
               : "memory");
}
// Orders this thread's (and, after a barrier, its block's) earlier generic accesses of shared
// memory before its later bulk copies into it.
AMK_DEVICE void amk_stage_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Copy `bytes` (a multiple of 16, both ends 16-byte aligned) of immutable global data into shared memory.
AMK_DEVICE void amk_stage_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  if (AMK_STAGE_L2_EVICT_FIRST) {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 ::"r"(amk_smem_addr(dst)), "l"(src), "r"(bytes), "r"(amk_smem_addr(bar)), "l"(policy)
                 : "memory");
    return;
  }
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(amk_smem_addr(dst)), "l"(src), "r"(bytes), "r"(amk_smem_addr(bar))
               : "memory");
}
// Wait until the phase of bar with this parity has completed (its copies are visible).
AMK_DEVICE void amk_stage_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(amk_smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
#endif

// Byte i of the result is byte (s >> 4i) & 7 of y:x (x bytes 0-3): one PRMT, which builds
// a float from a weight byte and constant exponent bytes (instructions/vec.cuh).
AMK_DEVICE unsigned amk_byte_perm(unsigned x, unsigned y, unsigned s) { return __byte_perm(x, y, s); }

// ---------------------------------------------------------------- conversions
// Exact round-to-nearest-even conversions, matching torch's .to(dtype).
AMK_DEVICE float amk_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

AMK_DEVICE unsigned short amk_f32_to_bf16(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

AMK_DEVICE float amk_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

AMK_DEVICE unsigned short amk_f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// ---------------------------------------------------------------- exact arithmetic
// Element-wise steps that the reference does as separate torch ops must not be contracted
// into FMAs: these round each step exactly once, as torch does.
AMK_DEVICE float amk_mul(float a, float b) { return __fmul_rn(a, b); }
AMK_DEVICE float amk_add(float a, float b) { return __fadd_rn(a, b); }
AMK_DEVICE float amk_sub(float a, float b) { return __fsub_rn(a, b); }
AMK_DEVICE float amk_div(float a, float b) { return __fdiv_rn(a, b); }
AMK_DEVICE float amk_rsqrt(float a) { return __fdiv_rn(1.0f, __fsqrt_rn(a)); }

AMK_DEVICE void amk_syncwarp() { __syncwarp(); }
