"""Does the KV cache's layout set the attention partial's read rate? (eval/PERF_NOTES.md item 221)

One block of 256 threads per (KV head, split), as the megakernel's ATTN_PARTIAL tasks are dealt,
each reads its split's K rows (head_dim 64 halves: 8 lanes a 128-byte row, 32 rows a pass,
--unroll passes' loads in flight: 4 is the wide score pass's 16 KB a SM) from
  strided     [capacity, kv_heads * 64]: the row-major cache, a head's row every kv_heads * 128 bytes
  contiguous  [kv_heads, capacity, 64]: head-major (ScheduleConfig.kv_head_major), a head's rows
              back to back
for --layers layers' caches in turn in one launch (more than the L2 holds: each row comes from
HBM, as in a decode step). Prints the median time a layer's K (the median of --reps timings of 4
launches each) and the rate.

    python -m amk.eval.kv_layout_microbench [--kv-heads 8] [--splits 16] [--rows 528] [--layers 16]
        [--unroll 1 4 8] [--json]      (a CUDA GPU and CuPy)
Defaults: the 1B at ctx 8192 (528-row splits). A diagnostic, not a latency figure of the megakernel:
ptxas moves each vector's XOR up between the loads, so "passes in flight" is nominal (about four
loads a lane are); a form with the lane geometry as run-time values kept about two and read 1.1-1.7x
slower (PERF_NOTES item 221).
"""

from __future__ import annotations

import argparse
import json

SRC = r"""
extern "C" __global__ void kv_read(const uint4* __restrict__ base, long long layer_vecs, int layers, int contiguous,
                                   int cap, int heads, int rows_a_split, int unroll, unsigned* out) {
  const int h = blockIdx.x % heads, s = blockIdx.x / heads;
  unsigned acc = 0;
  for (int l = 0; l < layers; ++l) {  // every layer in turn
    const uint4* L = base + layer_vecs * l;
    const int lane8 = threadIdx.x & 7, r0 = threadIdx.x >> 3;  // 8 lanes a 128-byte row, 32 rows a pass
    const int j0 = s * rows_a_split;
    for (int r = r0; r < rows_a_split; r += 32 * unroll) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {  // unroll <= 8 passes' loads issued before any is used
        const int rr = r + 32 * u;
        if (u < unroll && rr < rows_a_split) {
          const long long j = j0 + rr;
          const long long idx = contiguous ? ((long long)h * cap + j) * 8 + lane8 : j * (heads * 8) + h * 8 + lane8;
          v[u] = L[idx];
        } else v[u] = make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (acc == 0x12345678u) out[0] = acc;  // (keeps the loads; a checksum's atomics moved the figures)
}
"""


LAUNCHES = 4  # a timing's launches, back to back (the host's launch cost overlaps the kernels)


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--splits", type=int, default=16)
    ap.add_argument("--rows", type=int, default=528, help="K rows a split")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--unroll", type=int, nargs="+", default=[1, 4, 8], help="passes in flight, 1..8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if any(not 1 <= u <= 8 for u in a.unroll):
        ap.error("--unroll: 1..8")
    if min(a.kv_heads, a.splits, a.rows, a.layers, a.reps) < 1:
        ap.error("--kv-heads, --splits, --rows, --layers and --reps: 1 or more")
    return a


def main(argv=None) -> int:
    import cupy as cp

    a = _args(argv)
    kernel = cp.RawModule(code=SRC, options=("-std=c++17",)).get_function("kv_read")
    cap = a.splits * a.rows
    layer_vecs = cap * a.kv_heads * 8  # 16-byte vectors: 8 a row of 64 halves
    words = cp.random.randint(0, 2**31, size=layer_vecs * a.layers * 4, dtype=cp.uint32)
    out = cp.zeros(1, dtype=cp.uint32)
    layer_mb = layer_vecs * 16 / 1e6
    res = {"kv_heads": a.kv_heads, "head_dim": 64, "splits": a.splits, "rows": a.rows, "layers": a.layers,
           "layer_mb": layer_mb, "us_a_layer": {}, "tb_s": {}}
    for unroll in a.unroll:
        for contiguous in (0, 1):
            name = f"{'contiguous' if contiguous else 'strided'}_unroll{unroll}"
            args = (words, cp.int64(layer_vecs), cp.int32(a.layers), cp.int32(contiguous), cp.int32(cap),
                    cp.int32(a.kv_heads), cp.int32(a.rows), cp.int32(unroll), out)
            times = []
            for _ in range(a.reps):
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                for _ in range(LAUNCHES):
                    kernel((a.kv_heads * a.splits,), (256,), args)
                stop.record()
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1000 / (LAUNCHES * a.layers))
            us = sorted(times)[len(times) // 2]
            res["us_a_layer"][name], res["tb_s"][name] = us, layer_mb / us
            if not a.json:
                print(f"{name:22s} {us:7.2f} us a layer's K ({layer_mb:.1f} MB: {layer_mb / us:.2f} TB/s)", flush=True)
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
