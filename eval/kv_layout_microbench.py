"""Does the KV cache's layout set the attention partial's read rate? (eval/PERF_NOTES.md item 221)

One block of 256 threads per (KV head, split), as the megakernel's ATTN_PARTIAL tasks are dealt,
each reads its split's K rows (head_dim halves a row, 8 lanes a 128-byte row at head_dim 64, 32
rows a pass, --unroll passes' loads in flight: 4 is the wide score pass's 16 KB a SM) from
  strided     [capacity, kv_heads * head_dim]: the row-major cache, a head's row every
              kv_heads * head_dim * 2 bytes
  contiguous  [kv_heads, capacity, head_dim]: head-major (ScheduleConfig.kv_head_major), a
              head's rows back to back
for --layers layers' caches in turn in one launch (more than the L2 holds: each row comes from
HBM, as in a decode step). Prints the median time a layer's K (median over --reps timings of 5 launches) and
the rate; each warp XORs its words into a checksum (one atomic a warp) that the host checks.

    python -m amk.eval.kv_layout_microbench [--kv-heads 8] [--head-dim 64] [--splits 16] [--rows 528]
        [--layers 16] [--unroll 1 4 8] [--json]      (a CUDA GPU and CuPy)
Defaults: the 1B at ctx 8192 (528-row splits). A diagnostic, not a latency figure of the megakernel.
"""

from __future__ import annotations

import argparse
import json

SRC = r"""
extern "C" __global__ void kv_read(const uint4* __restrict__ base, long long layer_vecs, int layers, int contiguous,
                                   int cap, int heads, int vecs_a_row, int rows_a_split, int unroll,
                                   unsigned* __restrict__ sums) {
  const int h = blockIdx.x % heads, s = blockIdx.x / heads;
  const int lanes = vecs_a_row, lane = threadIdx.x % lanes, r0 = threadIdx.x / lanes, step = blockDim.x / lanes;
  unsigned acc = 0;
  for (int l = 0; l < layers; ++l) {
    const uint4* L = base + layer_vecs * l;
    for (int r = r0; r < rows_a_split; r += step * unroll) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {  // unroll <= 8 passes' loads issued before any is used
        const int rr = r + step * u;
        const long long j = (long long)s * rows_a_split + rr;
        const long long row = contiguous ? (long long)h * cap + j : j * heads + h;
        v[u] = u < unroll && rr < rows_a_split ? L[row * vecs_a_row + lane] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  // the checksum: a warp's lanes, then one atomic a warp (one a thread, 32K on one word, added
  // microseconds to every launch: the first committed form's figures were slower by that much)
  for (int m = 16; m > 0; m >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, m);
  if (threadIdx.x % 32 == 0) atomicXor(&sums[0], acc);
}
"""


LAUNCHES = 5  # a timing's launches (odd: see the checksum)


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64, help="a multiple of 8 (16-byte vectors of halves)")
    ap.add_argument("--splits", type=int, default=16)
    ap.add_argument("--rows", type=int, default=528, help="K rows a split")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--unroll", type=int, nargs="+", default=[1, 4, 8], help="passes in flight, 1..8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.head_dim < 8 or a.head_dim % 8 or 256 % (a.head_dim // 8):  # head_dim / 8 vectors a row
        ap.error("--head-dim: a multiple of 8 whose 16-byte vectors a row divide 256 threads")
    if any(not 1 <= u <= 8 for u in a.unroll):
        ap.error("--unroll: 1..8")
    return a


def main(argv=None) -> int:
    import cupy as cp
    import numpy as np

    a = _args(argv)
    kernel = cp.RawModule(code=SRC, options=("-std=c++17",)).get_function("kv_read")
    vecs_a_row = a.head_dim * 2 // 16
    cap = a.splits * a.rows
    layer_vecs = cap * a.kv_heads * vecs_a_row
    words = cp.random.randint(0, 2**31, size=layer_vecs * a.layers * 4, dtype=cp.int64).astype(cp.uint32)
    want = int(np.bitwise_xor.reduce(cp.asnumpy(words)))  # every word is read exactly once a launch
    sums = cp.zeros(1, dtype=cp.uint32)
    layer_mb = layer_vecs * 16 / 1e6
    out = {"kv_heads": a.kv_heads, "head_dim": a.head_dim, "splits": a.splits, "rows": a.rows, "layers": a.layers,
           "layer_mb": layer_mb, "us_a_layer": {}, "tb_s": {}}
    for unroll in a.unroll:
        for contiguous in (0, 1):
            name = f"{'contiguous' if contiguous else 'strided'}_unroll{unroll}"
            args = (words, cp.int64(layer_vecs), cp.int32(a.layers), cp.int32(contiguous), cp.int32(cap),
                    cp.int32(a.kv_heads), cp.int32(vecs_a_row), cp.int32(a.rows), cp.int32(unroll), sums)
            times = []
            for _ in range(a.reps):
                sums.fill(0)
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                # LAUNCHES back to back: the host's launch cost overlaps the kernels before them (one launch
                # a timing measured that cost too, ~40 us a launch: PERF_NOTES item 221)
                start.record()
                for _ in range(LAUNCHES):
                    kernel((a.kv_heads * a.splits,), (256,), args)
                stop.record()
                stop.synchronize()
                got = int(sums.get()[0])  # an odd number of launches: their XOR is one launch's
                if got != want:
                    raise SystemExit(f"{name}: checksum {got:#x}, expected {want:#x} (a row missed or read twice)")
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1000 / (LAUNCHES * a.layers))
            us = sorted(times)[len(times) // 2]
            out["us_a_layer"][name], out["tb_s"][name] = us, layer_mb / us
            if not a.json:
                print(f"{name:22s} {us:7.2f} us a layer's K ({layer_mb:.1f} MB: {layer_mb / us:.2f} TB/s)", flush=True)
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
