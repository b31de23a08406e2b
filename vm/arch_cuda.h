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
// The same into this SM's L1 (data the launch wrote: only after the wait that ordered its writes).
AMK_DEVICE void amk_prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// ---------------------------------------------------------------- warps
AMK_DEVICE float amk_shfl_xor(float v, int mask) { return __shfl_xor_sync(AMK_FULL_MASK, v, mask, AMK_WARP_SIZE); }
AMK_DEVICE int amk_shfl_xor_int(int v, int mask) { return __shfl_xor_sync(AMK_FULL_MASK, v, mask, AMK_WARP_SIZE); }

AMK_DEVICE void amk_syncthreads() { __syncthreads(); }

// ---------------------------------------------------------------- asynchronous copies
// 16 bytes from global to shared memory with no register between (cp.async, sm_80 on), through the
// L2 only (.cg: no L1 line that an earlier step's read could have left stale); the words are the
// block's after amk_cp_async_wait in each copying thread and then amk_syncthreads.
AMK_DEVICE void amk_cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem)
               : "memory");
}
AMK_DEVICE void amk_cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

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

// Byte i of the result is byte (s >> 4i) & 7 of y:x (x bytes 0-3): one PRMT, which builds
// a float from a weight byte and constant exponent bytes (instructions/vec.cuh).
AMK_DEVICE unsigned amk_byte_perm(unsigned x, unsigned y, unsigned s) { return __byte_perm(x, y, s); }
AMK_DEVICE int amk_log2_pow2(int v) { return __ffs(v) - 1; }  // v a power of two

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

// ---------------------------------------------------------------- half pairs and tensor cores (sm_80+)
// Used only by the quantized MMA rows (AMK_GEMV_I8_MMA / AMK_GEMV_U4_MMA, instructions/gemv.cuh).
// A pair holds element 0 in its low 16 bits.
AMK_DEVICE unsigned amk_f16x2_rn(float lo, float hi) {  // each rounded to nearest even
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
AMK_DEVICE unsigned amk_f16x2_sub(unsigned a, unsigned b) {
  unsigned r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
AMK_DEVICE unsigned amk_and_or(unsigned a, unsigned b, unsigned c) {  // (a & b) | c in one LOP3
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
// d += A B over one warp, A 16 x 16 and B 16 x 8 halves, d fp32 (mma.sync.m16n8k16). Lane g * 4 + t
// holds a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9],
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g], d = D[g][2t, 2t+1], D[g+8][2t, 2t+1].
AMK_DEVICE void amk_mma_16816_f16(float d[4], const unsigned a[4], const unsigned b[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---------------------------------------------------------------- integer dot products (sm_61+)
// Used only by int8 and int4 rows against x in fixed point (AMK_GEMV_I8_XQ, AMK_GEMV_U4_XQ,
// instructions/vec.cuh).
// dp2a: c + a.h0 * b.byte(k) + a.h1 * b.byte(k + 1), k 0 (lo) or 2 (hi); dp4a: c + sum a.byte(i) * b.byte(i);
// every operand signed.
#define AMK_HAS_IDP 1
AMK_DEVICE int amk_dp2a_lo(unsigned a, unsigned b, int c) {
  int d;
  asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
AMK_DEVICE int amk_dp2a_hi(unsigned a, unsigned b, int c) {
  int d;
  asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
AMK_DEVICE int amk_dp4a(unsigned a, unsigned b, int c) {
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
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
