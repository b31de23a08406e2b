"""How long is one all-to-all stage with a counter signal, and with the flag in the data?

eval/PERF_NOTES.md (session 47) puts ~0.75 us of every hop of the megakernel in the signal's own
path: the producer's release (a barrier, then `red.release.gpu`, which waits for the block's
stores), then a poller's `ld.acquire.gpu` round trip, and only then the consumer's loads of the
data. This stand-alone kernel measures that chain without the rest of the VM, against a form
that needs no counter: NCCL's LL protocol, where each 4-byte value travels with a 4-byte flag in
one 8-byte store, so a consumer's load of the data is its poll and a producer needs no fence.

One block of 256 threads a SM, all co-resident (a cooperative launch). Each of `--stages` stages
reads the whole vector x_s of `--n` uint32 values (every block all of it: the megakernel's
GEMV prologue reads all of x) and writes its own slice of x_{s+1}[i] = (sum(x_s) + i + s) & 1023,
so each stage depends on every block's part of the one before. Variants:
  counter  the megakernel's protocol: stores, barrier, thread 0 red.release.gpu +1 on the
           stage's counter; consumers: thread 0 spins on ld.acquire.gpu until all blocks
           signalled, barrier, then loads x (L2, ld.cg)
  counter_backoff  the same with the megakernel's poll back-off between polls (vm/megakernel.cu:
           64 ns a missing signal, at least 64 and at most 1024 ns; 256 at most while the counter
           moves), so that 132 pollers of one counter do not congest its L2 slice
  counter_b<MIN>_<PER>_<MAX>_<MOVING>  the back-off with other settings (--backoff, repeatable:
           the AMK_SPIN_MIN_NS, _NS_PER_SIGNAL, _MAX_NS and _MOVING_NS of the megakernel)
  ll       8-byte stores of (value, flag = epoch + s + 1); consumers load their elements of x
           with ld.relaxed.gpu until every flag is the stage's (no counter, no fence, no barrier
           before the loads)
  ll_sleep the same with a 64 ns sleep after a poll that found a stale flag (every thread of
           every block polls: this much less traffic on the L2 while they wait)
Prints the median time a stage (over launches, each `--stages` stages long) with p10 / p90, and
checks each variant's last vector against the host's; a variant that differs or times out is
marked and gives no time.

    python -m amk.eval.hop_microbench [--n 576] [--stages 2000] [--launches 12] [--backoff 16,16,256,256] [--json]
    (a CUDA GPU and CuPy)
"""

from __future__ import annotations

import argparse
import json

SRC = r"""
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Where block b's slice of the n values starts (the blocks' slices cover [0, n) in order).
__device__ __forceinline__ int slice_start(int n, int b) { return (int)((long long)n * b / gridDim.x); }

// Sum of v over the block (256 threads); every thread gets it. red: 8 words of shared memory.
__device__ __forceinline__ unsigned block_sum(unsigned v, unsigned* red) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned s = 0;
  for (int w = 0; w < 8; ++w) s += red[w];
  __syncthreads();  // red is reused by the next stage
  return s;
}

extern "C" __global__ void __launch_bounds__(256, 1)
hop_counter(unsigned* x, unsigned* counters, int n, int stages, unsigned long long timeout_ns, int* err,
            int backoff, unsigned min_ns, unsigned ns_per_signal, unsigned max_ns, unsigned moving_ns) {
  __shared__ unsigned red[8];
  __shared__ int go;
  const int B = gridDim.x, lo = slice_start(n, blockIdx.x), hi = slice_start(n, blockIdx.x + 1);
  const unsigned long long t0 = now_ns();
  for (int s = 0; s < stages; ++s) {
    if (s > 0) {
      if (threadIdx.x == 0) {
        go = 1;
        bool moved = false;  // the counter changed at the previous poll
        unsigned c;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counters + s - 1) : "memory");
        while (c < (unsigned)B) {
          if (backoff) {  // the megakernel's (vm/megakernel.cu amk_wait_all, AMK_SPIN_*)
            unsigned ns = ((unsigned)B - c) * ns_per_signal;
            ns = ns > max_ns ? max_ns : ns;
            if (moving_ns > 0 && moved && ns > moving_ns) ns = moving_ns;
            __nanosleep(ns < min_ns ? min_ns : ns);
          }
          const unsigned seen = c;
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counters + s - 1) : "memory");
          moved = c != seen;
          if (c < (unsigned)B && now_ns() - t0 > timeout_ns) {
            atomicExch(err, 1);
            go = 0;
            break;
          }
        }
      }
      __syncthreads();
      if (!go) return;
    }
    const unsigned* xs = x + (long long)s * n;
    unsigned part = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) part += __ldcg(xs + i);
    const unsigned total = block_sum(part, red);
    unsigned* y = x + (long long)(s + 1) * n;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) y[i] = (total + i + s) & 1023u;
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + s) : "memory");
  }
}

extern "C" __global__ void __launch_bounds__(256, 1)
hop_ll(unsigned long long* x, int n, int stages, unsigned epoch, unsigned long long timeout_ns, int* err,
       int sleep_ns) {
  __shared__ unsigned red[8];
  __shared__ int bad;
  const int B = gridDim.x, lo = slice_start(n, blockIdx.x), hi = slice_start(n, blockIdx.x + 1);
  const unsigned long long t0 = now_ns();
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int s = 0; s < stages; ++s) {
    const unsigned long long* xs = x + (long long)s * n;
    const unsigned want = epoch + (unsigned)s;
    unsigned part = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      unsigned long long w;
      for (;;) {
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(xs + i) : "memory");
        if ((unsigned)(w >> 32) == want) break;
        if (sleep_ns) __nanosleep(sleep_ns);
        if (now_ns() - t0 > timeout_ns) {
          atomicExch(err, 1);
          bad = 1;
          break;
        }
      }
      part += (unsigned)w;
    }
    const unsigned total = block_sum(part, red);  // (its barriers publish `bad`)
    if (bad) return;
    unsigned long long* y = x + (long long)(s + 1) * n;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const unsigned long long w = ((unsigned long long)(want + 1u) << 32) | ((total + i + s) & 1023u);
      asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(y + i), "l"(w) : "memory");
    }
  }
}
"""


VM_BACKOFF = (64, 64, 1024, 256)  # vm/megakernel.cu's AMK_SPIN_MIN_NS, _NS_PER_SIGNAL, _MAX_NS, _MOVING_NS


def parse_backoff(text: str) -> tuple[int, int, int, int]:
    """"MIN,PER,MAX,MOVING" (ns, non-negative integers) -> a tuple; ValueError names what is wrong."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--backoff {text!r}: want four non-negative integers MIN,PER,MAX,MOVING (ns)")
    return tuple(int(p) for p in parts)


def expected_last(x0, stages: int):
    """x_stages on the host: x_{s+1}[i] = (sum(x_s) + i + s) & 1023, in uint32 as the kernels."""
    import numpy as np

    x = np.asarray(x0, dtype=np.uint64)
    idx = np.arange(len(x), dtype=np.uint64)
    for s in range(stages):
        x = ((int(x.sum()) & 0xFFFFFFFF) + idx + s) & 1023
    return x.astype(np.uint32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m amk.eval.hop_microbench", description=(__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=576, help="vector length (uint32 values; SmolLM2's hidden size: 576)")
    ap.add_argument("--stages", type=int, default=2000, help="dependent stages a launch")
    ap.add_argument("--launches", type=int, default=12, help="timed launches a variant (after two warm-up ones)")
    ap.add_argument("--backoff", action="append", default=[], metavar="MIN,PER,MAX,MOVING",
                    help="also time the counter protocol with this poll back-off (ns; repeatable)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if a.n < 1 or a.stages < 1 or a.launches < 1:
        ap.error("--n, --stages and --launches take positive integers")
    try:
        backoffs = [parse_backoff(b) for b in a.backoff]
    except ValueError as e:
        ap.error(str(e))

    import cupy as cp
    import numpy as np

    from amk.eval.bench import summarize

    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), enable_cooperative_groups=True)
    k_counter, k_ll = mod.get_function("hop_counter"), mod.get_function("hop_ll")
    rng = np.random.default_rng(0)
    x0 = rng.integers(0, 1024, a.n, dtype=np.uint32)
    want = expected_last(x0, a.stages)
    timeout = np.uint64(2_000_000_000)  # 2 s: a lost signal ends the launch with err set, not a hang
    err = cp.zeros(1, dtype=cp.int32)
    results = []

    def run(name, launch, last):
        times, ok = [], True
        err.fill(0)
        for i in range(a.launches + 2):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            prepare = launch(i)
            e0.record()
            prepare()
            e1.record()
            e1.synchronize()
            if int(err.get()[0]) or not np.array_equal(last(), want):
                ok = False
                break
            if i >= 2:
                times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / a.stages)
        row = {"variant": name, "n": a.n, "stages": a.stages, "blocks": sms, "correct": ok}
        if ok:
            stats = summarize(times)  # (eval/bench.py's: median, p10, p90)
            row.update({f"{k}_us": stats[k] for k in ("median", "p10", "p90")})
        else:
            row["median_us"] = None
        results.append(row)

    xc = cp.zeros((a.stages + 1) * a.n, dtype=cp.uint32)
    counters = cp.zeros(a.stages, dtype=cp.uint32)

    def launch_counter(backoff):
        """backoff: None (a tight poll) or (min, per signal, max, moving) ns."""
        args = (np.int32(0),) + (np.uint32(0),) * 4 if backoff is None else \
            (np.int32(1),) + tuple(np.uint32(v) for v in backoff)

        def launch(i):
            xc[: a.n] = cp.asarray(x0)
            xc[a.n:].fill(0xFFFFFFFF)  # poison: a stage read before its signal shows in the result
            counters.fill(0)
            cp.cuda.Device().synchronize()
            return lambda: k_counter((sms,), (256,), (xc, counters, np.int32(a.n), np.int32(a.stages), timeout, err)
                                     + args)
        return launch

    counter_last = lambda: xc[a.stages * a.n:].get()  # noqa: E731
    run("counter", launch_counter(None), counter_last)
    run("counter_backoff", launch_counter(VM_BACKOFF), counter_last)
    for b in backoffs:
        run("counter_b" + "_".join(map(str, b)), launch_counter(b), counter_last)

    xl = cp.zeros((a.stages + 1) * a.n, dtype=cp.uint64)

    launches = [0]  # launches so far over both LL variants: each one's flags differ from every earlier one's

    def launch_ll(sleep_ns):
        def launch(i):
            epoch = np.uint32(1 + launches[0] * (a.stages + 2))
            launches[0] += 1
            xl[: a.n] = cp.asarray((np.uint64(epoch) << np.uint64(32)) | x0.astype(np.uint64))
            cp.cuda.Device().synchronize()
            return lambda: k_ll((sms,), (256,), (xl, np.int32(a.n), np.int32(a.stages), epoch, timeout, err,
                                                 np.int32(sleep_ns)))
        return launch

    ll_last = lambda: (xl[a.stages * a.n:].get() & np.uint64(0xFFFFFFFF)).astype(np.uint32)  # noqa: E731
    run("ll", launch_ll(0), ll_last)
    run("ll_sleep", launch_ll(64), ll_last)

    if a.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"{a.stages} dependent all-to-all stages of {a.n} values over {sms} blocks; us a stage "
              f"(median | p10 | p90 of {a.launches} launches)")
        for r in results:
            if r["correct"]:
                print(f"  {r['variant']:16s} {r['median_us']:7.3f} | {r['p10_us']:7.3f} | {r['p90_us']:7.3f}")
            else:
                print(f"  {r['variant']:16s} WRONG or timed out: no time")
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
