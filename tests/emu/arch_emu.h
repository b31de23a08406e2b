// Host emulation of the device primitives (vm/portability.h's seam, selected by
// -DAMK_ARCH_EMU): the megakernel compiled by g++, every GPU thread an OS thread.
// Barriers are std::barrier; a warp shuffle goes through an exchange array and one warp
// barrier; counters use GCC atomics with the same acquire/release orders. Used by
// tests/test_vm_emulated.py to check the kernel code on machines without a GPU.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <thread>
#include <vector>

#ifndef AMK_WARP_SIZE
#define AMK_WARP_SIZE 32  // 64 for an AMD target's programs (the emu fixture of tests/test_vm_emulated.py)
#endif
#define AMK_DEVICE inline
#define AMK_DEVICE_NOINLINE inline
#define AMK_KERNEL(threads, min_blocks) void
#define AMK_FULL_MASK 0xffffffffu
#define __restrict__ __restrict

inline float __sinf(float x) { return sinf(x); }  // CUDA's fast sine (AMK_DIAG_DEAD_CODE's filler)

struct amk_dim3 {
  unsigned x, y, z;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

struct AmkEmuBlock {
  explicit AmkEmuBlock(int threads, int smem_bytes)
      : bar(threads), exch(2 * threads), mma(6 * threads), dyn(smem_bytes / 16 + 1), arena(8192) {
    for (int w = 0; w < threads / AMK_WARP_SIZE; ++w) warp_bars.emplace_back(new std::barrier<>(AMK_WARP_SIZE));
  }
  ~AmkEmuBlock() {
    for (auto* b : warp_bars) delete b;
  }
  std::barrier<> bar;
  std::vector<std::barrier<>*> warp_bars;
  std::vector<unsigned> exch;
  std::vector<unsigned> mma;  // each lane's A and B fragments (amk_mma_16816_f16)
  std::vector<float4> dyn;
  std::vector<float4> arena;  // AMK_BLOCK_SHARED variables, 1 KiB each
};

inline thread_local amk_dim3 threadIdx, blockIdx, blockDim;
inline thread_local AmkEmuBlock* amk_emu_block;

template <typename T, int ID>
inline T& amk_emu_shared() {
  static_assert(sizeof(T) <= 1024 && ID < 128, "emulated block-shared variable too large");
  return *reinterpret_cast<T*>(reinterpret_cast<char*>(amk_emu_block->arena.data()) + ID * 1024);
}
#define AMK_BLOCK_SHARED(type, name) type& name = amk_emu_shared<type, __COUNTER__>()
#define AMK_DYNAMIC_SHARED(name) float4* name = amk_emu_block->dyn.data()

// ---------------------------------------------------------------- memory ordering
AMK_DEVICE unsigned amk_ld_acquire_gpu(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
AMK_DEVICE void amk_release_add_gpu(unsigned* p, unsigned v) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
}
AMK_DEVICE void amk_fence_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
AMK_DEVICE int amk_ld_volatile(const volatile int* p) { return __atomic_load_n(const_cast<const int*>(p), __ATOMIC_ACQUIRE); }
AMK_DEVICE void amk_nanosleep(unsigned) { std::this_thread::yield(); }
AMK_DEVICE unsigned long long amk_timer_ns() {
  return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
AMK_DEVICE void amk_prefetch_l2(const void*) {}
AMK_DEVICE void amk_prefetch_l1(const void*) {}
AMK_DEVICE int atomicCAS(int* p, int cmp, int val) {
  __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}

// ---------------------------------------------------------------- barriers and warps
AMK_DEVICE int atomicMax(int* p, int v) {
  int cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return cur;
}
AMK_DEVICE void amk_syncthreads() { amk_emu_block->bar.arrive_and_wait(); }
AMK_DEVICE void amk_syncwarp() { amk_emu_block->warp_bars[threadIdx.x / AMK_WARP_SIZE]->arrive_and_wait(); }
// One warp barrier a shuffle: consecutive shuffles alternate between two exchange arrays, so a
// lane may write the next one's value while a slower lane still reads this one's (it cannot get
// two shuffles ahead: that needs the slow lane at the next barrier, after its read). The futex
// waits of the warp barriers were most of the emulated tests' time on a 2-core machine.
inline thread_local unsigned amk_emu_shfl_parity;
AMK_DEVICE unsigned amk_emu_shfl_xor(unsigned v, int mask) {
  const int t = threadIdx.x, lane = t % AMK_WARP_SIZE;
  unsigned* exch = amk_emu_block->exch.data() + (amk_emu_shfl_parity ^= 1u) * blockDim.x;
  exch[t] = v;
  amk_syncwarp();
  return exch[t - lane + (lane ^ mask)];
}
AMK_DEVICE float amk_shfl_xor(float v, int mask) {
  unsigned u;
  memcpy(&u, &v, 4);
  u = amk_emu_shfl_xor(u, mask);
  memcpy(&v, &u, 4);
  return v;
}
AMK_DEVICE int amk_shfl_xor_int(int v, int mask) { return (int)amk_emu_shfl_xor((unsigned)v, mask); }

// The asynchronous copies, done only at the copying thread's wait (the latest a GPU may do them), so
// that a read of the copied words before the wait and the barrier after it finds the old words.
// Both ends 16-byte aligned, as the GPU requires.
struct AmkEmuCopy {
  void* dst;
  const void* src;
};
inline thread_local std::vector<AmkEmuCopy> amk_emu_copies;
AMK_DEVICE void amk_cp_async16(void* smem, const void* gmem) {
  if (((uintptr_t)smem) % 16 || ((uintptr_t)gmem) % 16) __builtin_trap();
  amk_emu_copies.push_back({smem, gmem});
}
AMK_DEVICE void amk_cp_async_wait() {
  for (const AmkEmuCopy& c : amk_emu_copies) memcpy(c.dst, c.src, 16);
  amk_emu_copies.clear();
}

// ---------------------------------------------------------------- loads and conversions
struct amk_u32x4 {
  unsigned x, y, z, w;
};
AMK_DEVICE amk_u32x4 amk_ld16_weight(const void* p) {
  if (((uintptr_t)p) % 16) __builtin_trap();  // the GPU would fault on a misaligned vector load
  amk_u32x4 r;
  memcpy(&r, p, 16);
  return r;
}
AMK_DEVICE float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
AMK_DEVICE float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
AMK_DEVICE int __float_as_int(float f) {
  int i;
  memcpy(&i, &f, 4);
  return i;
}
AMK_DEVICE int amk_log2_pow2(int v) { return __builtin_ctz((unsigned)v); }  // v a power of two
// Byte i of the result is byte (s >> 4i) & 7 of y:x (x bytes 0-3), as CUDA's __byte_perm.
AMK_DEVICE unsigned amk_byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
AMK_DEVICE float amk_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
AMK_DEVICE unsigned short amk_f32_to_bf16(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}
AMK_DEVICE float amk_f16_to_f32(unsigned short h) {
  _Float16 x;
  memcpy(&x, &h, 2);
  return (float)x;
}
AMK_DEVICE unsigned short amk_f32_to_f16(float f) {
  const _Float16 x = (_Float16)f;
  unsigned short h;
  memcpy(&h, &x, 2);
  return h;
}

// Half pairs and the tensor-core MMA, with vm/arch_cuda.h's fragment layout. The MMA sums its
// products in k order in fp32 (the hardware's order and rounding inside differ: results agree to
// within fp32 rounding, not bit for bit).
AMK_DEVICE unsigned amk_f16x2_rn(float lo, float hi) { return amk_f32_to_f16(lo) | ((unsigned)amk_f32_to_f16(hi) << 16); }
AMK_DEVICE float amk_emu_half(unsigned pair, int i) { return amk_f16_to_f32((unsigned short)(pair >> (16 * i))); }
AMK_DEVICE unsigned amk_f16x2_sub(unsigned a, unsigned b) {  // exact for the integers it is used on
  return amk_f16x2_rn(amk_emu_half(a, 0) - amk_emu_half(b, 0), amk_emu_half(a, 1) - amk_emu_half(b, 1));
}
AMK_DEVICE unsigned amk_and_or(unsigned a, unsigned b, unsigned c) { return (a & b) | c; }
AMK_DEVICE void amk_mma_16816_f16(float d[4], const unsigned a[4], const unsigned b[2]) {
  const int t = threadIdx.x, lane = t % AMK_WARP_SIZE, base = t - lane;
  unsigned* f = amk_emu_block->mma.data();
  for (int i = 0; i < 4; ++i) f[6 * t + i] = a[i];
  f[6 * t + 4] = b[0], f[6 * t + 5] = b[1];
  amk_syncwarp();
  auto A = [&](int r, int k) {  // lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 (k >= 8)
    return amk_emu_half(f[6 * (base + (r % 8) * 4 + (k % 8) / 2) + (r >= 8) + 2 * (k >= 8)], k % 2);
  };
  auto B = [&](int k, int n) { return amk_emu_half(f[6 * (base + n * 4 + (k % 8) / 2) + 4 + (k >= 8)], k % 2); };
  for (int i = 0; i < 4; ++i) {
    const int r = lane / 4 + 8 * (i / 2), n = 2 * (lane % 4) + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
    d[i] = s;
  }
  amk_syncwarp();
}

// ---------------------------------------------------------------- arithmetic (-ffp-contract=off)
AMK_DEVICE float amk_mul(float a, float b) { return a * b; }
AMK_DEVICE float amk_add(float a, float b) { return a + b; }
AMK_DEVICE float amk_sub(float a, float b) { return a - b; }
AMK_DEVICE float amk_div(float a, float b) { return a / b; }
AMK_DEVICE float amk_rsqrt(float a) { return 1.0f / sqrtf(a); }
using std::max;
using std::min;
