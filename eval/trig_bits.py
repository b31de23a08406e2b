"""Whether CUDA's `sincosf` gives the same bits as `sinf` and `cosf` on this GPU, over RoPE
angles (positions 0..131071 times the inverse frequencies of theta 1e4 / 1e5 / 5e5 at head
dims 64 and 128) and 2 M uniform angles in +-2e5 (eval/PERF_NOTES.md item 68). Needs a GPU.

    python3 -m amk.eval.trig_bits
"""

import cupy as cp
import numpy as np

_SRC = r'''
extern "C" __global__ void k(const float* a, float* s1, float* c1, float* s2, float* c2, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { s1[i] = sinf(a[i]); c1[i] = cosf(a[i]); float s, c; sincosf(a[i], &s, &c); s2[i] = s; c2[i] = c; }
}'''


def main() -> int:
    k = cp.RawKernel(_SRC, "k")
    angs = []
    for theta, hd in ((10000.0, 64), (500000.0, 64), (10000.0, 128), (500000.0, 128), (100000.0, 64)):
        inv = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
        pos = np.arange(0, 131072, dtype=np.float32)
        angs.append((pos[:, None] * inv[None, :]).astype(np.float32).ravel())
    rng = np.random.default_rng(0)
    angs.append(rng.uniform(-2e5, 2e5, 2_000_000).astype(np.float32))
    a = cp.asarray(np.concatenate(angs))
    n = a.size
    outs = [cp.empty(n, cp.float32) for _ in range(4)]
    k(((n + 255) // 256,), (256,), (a, *outs, np.int32(n)))
    s1, c1, s2, c2 = (o.view(cp.uint32) for o in outs)
    print(f"angles {n}: sin bits differ {int((s1 != s2).sum())}, cos bits differ {int((c1 != c2).sum())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
