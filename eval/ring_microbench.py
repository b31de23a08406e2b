"""Does a per-warp ring of TMA bulk copies stream weights faster than register loads?

A stand-alone kernel (not the megakernel), one block of 8 warps per SM, each warp streaming
its own contiguous slice of a byte matrix (60 rounds a warp: 260 MB on an H100) in rounds of
4 KB (32 lanes x 8 vectors of 16 bytes, the GEMV's round), with or without the int8 GEMV's
arithmetic per vector (byte-permute, subtract, FMA with x from shared memory). `reg`: each
lane loads its 8 vectors into registers, then sums them (the megakernel's register path).
`ring`: lane 0 keeps `slots` rounds in flight in shared memory by cp.async.bulk on an mbarrier
a slot, copies of `piece` bytes (with or without a proxy fence before each), and the warp sums
from there (the megakernel's weight ring of eval/PERF_NOTES.md item 106, measured slower there
and reverted; its code is at b14d8b4). Prints GB/s per variant (median of 20 launches) and
flags a ring variant whose sums differ from the register path's.

    python -m amk.eval.ring_microbench [--rounds 60] [--copies 1] [--json]   # an sm_90 GPU, CuPy
"""
from __future__ import annotations

import argparse
import json

SRC = r"""
#define ROUND 4096
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ float vec_sum(uint4 v, const float* xs, int work) {
  if (!work) return (float)((v.x ^ v.y ^ v.z ^ v.w) & 0xffu);
  const unsigned w[4] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u, v.z ^ 0x80808080u, v.w ^ 0x80808080u};
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    s += (__uint_as_float(__byte_perm(w[j >> 2], 0x4B000000u, 0x7440u | (j & 3))) - 8388736.0f) * xs[j];
  return s;
}

extern "C" __global__ void __launch_bounds__(256, 1)
stream_reg(const char* __restrict__ w, long long rounds, float* out, int work) {
  extern __shared__ float4 dyn[];
  float* xs = (float*)dyn;
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) xs[i] = 1.0f + i * 1e-6f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const char* base = w + ((long long)blockIdx.x * 8 + warp) * rounds * ROUND;
  float s = 0.0f;
#pragma unroll 1
  for (long long r = 0; r < rounds; ++r) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(base + r * ROUND + u * 512 + lane * 16));
#pragma unroll
    for (int u = 0; u < 8; ++u) s += vec_sum(v[u], xs + ((u * 32 + lane) * 20) % 4000, work);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256, 1)
stream_ring(const char* __restrict__ w, long long rounds, float* out, int work, int slots, int per_slot, int piece,
            int fence) {
  extern __shared__ float4 dyn[];
  float* xs = (float*)dyn;
  unsigned long long* bars = (unsigned long long*)(xs + 4096);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot_bytes = per_slot * ROUND;
  char* ring = (char*)(bars + 8 * 8) + (long long)warp * slots * slot_bytes;
  unsigned long long* bar = bars + warp * 8;
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) xs[i] = 1.0f + i * 1e-6f;
  const char* base = w + ((long long)blockIdx.x * 8 + warp) * rounds * ROUND;
  const long long nchunks = rounds / per_slot;
  auto issue = [&](long long j) {
    const int k = (int)(j % slots);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(smem_addr(bar + k)), "r"(slot_bytes) : "memory");
    for (int off = 0; off < slot_bytes; off += piece) {
      if (fence) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem_addr(ring + k * slot_bytes + off)), "l"(base + j * slot_bytes + off), "r"(piece),
                   "r"(smem_addr(bar + k)) : "memory");
    }
  };
  if (lane == 0) {
    for (int k = 0; k < slots; ++k)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar + k)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (lane == 0)
    for (long long j = 0; j < slots && j < nchunks; ++j) issue(j);
  __syncwarp();
  float s = 0.0f;
#pragma unroll 1
  for (long long j = 0; j < nchunks; ++j) {
    const int k = (int)(j % slots);
    const unsigned parity = (unsigned)(j / slots) & 1u;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(smem_addr(bar + k)), "r"(parity) : "memory");
    const char* slot = ring + k * slot_bytes;
#pragma unroll 1
    for (int q = 0; q < per_slot; ++q) {
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(smem_addr(slot + q * ROUND + u * 512 + lane * 16)));
        s += vec_sum(v, xs + ((u * 32 + lane) * 20) % 4000, work);
      }
    }
    __syncwarp();
    if (lane == 0 && j + slots < nchunks) issue(j + slots);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


# (slots a warp, rounds a slot, bytes a bulk copy, a proxy fence before each copy)
RING_VARIANTS = [(2, 1, 4096, 1), (3, 1, 4096, 1), (4, 1, 4096, 1), (3, 1, 2048, 1), (3, 1, 4096, 0),
                 (2, 2, 8192, 1), (3, 2, 8192, 0), (2, 4, 16384, 0), (2, 1, 4096, 0), (3, 1, 1024, 0),
                 (6, 1, 4096, 0)]


def main(argv=None) -> int:
    import cupy as cp
    import numpy as np

    ap = argparse.ArgumentParser(prog="python -m amk.eval.ring_microbench", description=(__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="4 KB rounds a warp (x 8 warps x SMs: the bytes streamed)")
    ap.add_argument("--copies", type=int, default=1,
                    help="copies of the matrix, launch i streaming copy i %% N (with few rounds, N copies beyond "
                         "the L2's 50 MB keep each launch's bytes out of it)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.copies < 1:
        ap.error("--rounds and --copies take positive integers")
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=None)
    reg, ring = mod.get_function("stream_reg"), mod.get_function("stream_ring")
    nbytes = sms * 8 * a.rounds * 4096
    w = cp.random.randint(0, 256, nbytes * a.copies, dtype=cp.uint8)
    out = cp.zeros(sms * 256, dtype=cp.float32)
    results = []

    def timed(fn, args, smem):
        fn.max_dynamic_shared_size_bytes = smem
        times = []
        for i in range(25):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn((sms,), (256,), (w[(i % a.copies) * nbytes:], *args), shared_mem=smem)
            e1.record()
            e1.synchronize()
            if i >= 5:
                times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
        return float(np.median(times))

    for work in (0, 1):
        t = timed(reg, (np.int64(a.rounds), out, np.int32(work)), 4096 * 4)
        results.append({"variant": "reg", "work": work, "GBps": nbytes / t / 1e9})
        ref = float(cp.asnumpy(out).astype(np.float64).sum())
        for slots, per_slot, piece, fence in RING_VARIANTS:
            smem = 4096 * 4 + 8 * 8 * 8 + 8 * slots * per_slot * 4096
            if a.rounds % per_slot or smem > dev.attributes["MaxSharedMemoryPerBlockOptin"]:
                continue
            out.fill(0)
            t = timed(ring, (np.int64(a.rounds), out, np.int32(work), np.int32(slots), np.int32(per_slot),
                             np.int32(piece), np.int32(fence)), smem)
            same = abs(float(cp.asnumpy(out).astype(np.float64).sum()) - ref) <= 1e-3 * max(1.0, abs(ref))
            results.append({"variant": f"ring slots={slots} round/slot={per_slot} piece={piece} fence={fence}",
                            "work": work, "GBps": nbytes / t / 1e9, "same_sum_as_reg": same})
    if a.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"{nbytes / 1e6:.0f} MB streamed by {sms} blocks x 8 warps ({a.rounds} rounds a warp, {a.copies} "
              f"copies); GB/s (median of 20)")
        for r in results:
            flag = "" if r.get("same_sum_as_reg", True) else "  SUM DIFFERS"
            print(f"  work={r['work']}  {r['GBps']:7.0f}  {r['variant']}{flag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
