"""The attention combine's output loop alone (instructions/attention.cuh AmkCombineOutputs), timed
with clock64 inside one kernel: one block per kv head as in the megakernel, the partials written
by an earlier kernel (so they sit in L2), a cold pass and then a warm one; beside it the same sums
written in simpler forms. A diagnostic for eval/PERF_NOTES.md (how many cycles the loop's code
takes outside the megakernel), not a benchmark of AMK.

    python -m amk.eval.combine_microbench [--splits 16] [--q-heads 4] [--head-dim 64] [--blocks 8]
"""

from __future__ import annotations

import argparse

KERNEL = r"""
#include "portability.h"
#include "ops.cuh"
extern "C" __global__ void combine_loop(const float* part, unsigned short* y, long long* out, int splits, int qh,
                                        int hd, int variant) {
  __shared__ float wm[64 * 16];
  __shared__ float den[16];
  __shared__ AmkOperand po, yo;
  __shared__ AmkBuffer yb;
  const int n = qh * hd;
  if (threadIdx.x == 0) {
    po = AmkOperand{(amk_i64)blockIdx.x * splits * n, 0, 0, splits * n, 1, 0};
    yo = AmkOperand{(amk_i64)blockIdx.x * n, 0, 1, n, 1, 0};
    yb = AmkBuffer{(amk_u64)y, (amk_i64)gridDim.x * n, (amk_i64)gridDim.x * n, 1, AMK_DTYPE_BF16, 0, 0, 0};
  }
  for (int i = threadIdx.x; i < splits * qh; i += blockDim.x) wm[i] = 1.0f / splits;
  for (int i = threadIdx.x; i < qh; i += blockDim.x) den[i] = 1.0f;
  __syncthreads();
  long long t[3];
  t[0] = clock64();
  for (int pass = 0; pass < 2; ++pass) {
    if (variant == 0) {  // the megakernel's code
      AmkCombineOutputs{(amk_u64)part, po, yb, yo, wm, den, qh, hd, splits}.template run<AMK_DTYPE_F32>();
    } else if (variant == 1) {  // the same ordered sum, the loads from a typed pointer
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float* p = part + po.off + i;
        const float* w = wm + i / hd;
        const float num = amk_ordered_sum<AMK_SPLIT_SUM_UNROLL>(
            splits, [&](int s) { return p[(amk_i64)s * n]; }, [&](int s, float o) { return amk_mul(w[s * qh], o); });
        amk_store(yb, amk_flat(yo, i), amk_div(num, den[i / hd]));
      }
    } else if (variant == 2) {  // a plain loop in the same order (mul, then add)
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float* p = part + po.off + i;
        const float* w = wm + i / hd;
        float s = 0.0f;
#pragma unroll 16
        for (int k = 0; k < splits; ++k) s = k == 0 ? amk_mul(w[0], p[0]) : amk_add(s, amk_mul(w[k * qh], p[(amk_i64)k * n]));
        amk_store(yb, amk_flat(yo, i), amk_div(s, den[i / hd]));
      }
    } else {  // a plain loop with fused multiply-adds (not the reference's rounding)
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float* p = part + po.off + i;
        const float* w = wm + i / hd;
        float s = 0.0f;
#pragma unroll 16
        for (int k = 0; k < splits; ++k) s += w[k * qh] * p[(amk_i64)k * n];
        ((unsigned short*)y)[yo.off + i] = amk_f32_to_bf16(s / den[i / hd]);
      }
    }
    __syncthreads();
    t[pass + 1] = clock64();
  }
  if (threadIdx.x == 0)
    for (int k = 0; k < 2; ++k) out[blockIdx.x * 2 + k] = t[k + 1] - t[k];
}
"""

VARIANTS = ("megakernel's AmkCombineOutputs", "ordered sum, typed pointer", "plain loop, mul then add",
            "plain loop, fused (other rounding)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", type=int, default=16)
    ap.add_argument("--q-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--instructions", default=None, help="another instructions/ folder (a tree to compare)")
    ap.add_argument("--define", action="append", default=[], help="extra -D NAME=VALUE for the build")
    a = ap.parse_args()
    import cupy as cp
    import numpy as np

    from amk.vm.build import source_dirs

    vm_dir, ins_dir = source_dirs()
    ins_dir = a.instructions or ins_dir
    arch = cp.cuda.Device().compute_capability
    opts = ("-std=c++17", f"-arch=sm_{arch}", f"-I{vm_dir}", f"-I{ins_dir}", f"-DAMK_BLOCK_THREADS={a.threads}",
            "-DAMK_DTYPES=13", "-DAMK_GEMV_WDTYPES=4", *(f"-D{d}" for d in a.define))
    fn = cp.RawModule(code=KERNEL, options=opts, backend="nvrtc").get_function("combine_loop")
    n = a.q_heads * a.head_dim
    part = cp.random.standard_normal(a.blocks * a.splits * n, dtype=cp.float32)
    y = cp.zeros(a.blocks * n, dtype=cp.uint16)
    out = cp.zeros(a.blocks * 2, dtype=cp.int64)
    clock_mhz = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) / 1e3
    print(f"combine output loop, {a.blocks} blocks x {a.threads} threads, {a.splits} splits, {n} outputs a block; "
          f"median over {a.reps} launches of the slowest block, cycles (us at {clock_mhz:.0f} MHz), cold | warm:")
    ref = None
    for v, name in enumerate(VARIANTS):
        rows = []
        for _ in range(a.reps):
            part += 0  # rewritten by a kernel: the partials sit in L2, as after the attention partials
            fn((a.blocks,), (a.threads,), (part, y, out, np.int32(a.splits), np.int32(a.q_heads),
                                           np.int32(a.head_dim), np.int32(v)))
            cp.cuda.Device().synchronize()
            rows.append(out.get().reshape(a.blocks, 2).max(axis=0))
        yv = y.get()
        same = "" if ref is None else ("  (outputs identical)" if (yv == ref).all() else "  (outputs differ)")
        ref = yv if ref is None else ref
        cold, warm = np.median(np.array(rows), axis=0)
        print(f"  {name:36s} {cold:7.0f} ({cold / clock_mhz:.2f} us) | {warm:7.0f} ({warm / clock_mhz:.2f} us){same}")


if __name__ == "__main__":
    main()
