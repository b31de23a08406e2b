// The AMK megakernel: one persistent block per queue walks its tasks in order.
//
// Per task:  copy the record and its buffer descriptors to shared memory -> dispatch the op,
//            which may first set up from the record alone, then waits: thread 0 spins (acquire)
//            until every wait is met while warps 1.. prefetch immutable inputs into L2 (this
//            task's, or prefetch_depth-1 tasks ahead) -> barrier -> the op's body -> barrier ->
//            thread 0 releases +1 on the task's out_counter.
//
// Counters are monotonic across steps: the host passes `epoch` (1 for the first step after
// a reset, +1 per step) and a wait for threshold t on a counter with P producers per step
// is met at (epoch-1)*P + t, so nothing is reset or re-uploaded between steps.
//
// No wait is unbounded: the spinning thread gives up after `spin_timeout_ns`, when another
// block has reported an error, or when the host watchdog raises `*host_abort` (mapped host
// memory); the block then skips the rest of its queue and the step fails cleanly.
//
// Launched cooperatively (one block per queue, all co-resident) so that spinning on another
// block's counter can never starve it of an SM. No grid-wide barrier is needed.
#include "portability.h"
#include "ops.cuh"

#ifndef AMK_BLOCK_THREADS
#define AMK_BLOCK_THREADS 1024
#endif
#ifndef AMK_MIN_BLOCKS
#define AMK_MIN_BLOCKS 1  // persistent blocks per SM (Program.blocks_per_cu)
#endif
// Poll back-off, in proportion to the signals a wait still misses: a counter far from its
// target (120 of 132 producers outstanding) is polled rarely, so ~131 pollers do not congest
// its L2 slice (a flat 256 ns made the step 4.5x slower), and one a signal or two short of it
// is polled often, so the hop after the last signal stays short (a doubling back-off capped at
// 4096 ns cost 4-8 us per hop: the pollers slept through the signal). The cap bounds how long
// a poller sleeps through a burst of last signals (96 q/k/v producers finish within a few us):
// 1024 ns measured 1B 1.745 -> 1.691 ms, 8B 7.346 -> 7.304 ms against 4096 (eval/PERF_NOTES.md).
// 64 ns a missing signal (128 before): 1B -7, 8B -24, SmolLM2 shape -10 us, paired (item 63).
// The loader sets the cap from ScheduleConfig.poll_cap_ns: 'auto' gives programs of short GEMV
// tasks 128 ns (SmolLM2 -0.4 %, 1B -0.65 % on an H200; the 8B +0.13 %: items 165, 167).
#ifndef AMK_SPIN_MAX_NS
#define AMK_SPIN_MAX_NS 1024
#endif
#ifndef AMK_SPIN_MIN_NS
#define AMK_SPIN_MIN_NS 64
#endif
#ifndef AMK_SPIN_NS_PER_SIGNAL
#define AMK_SPIN_NS_PER_SIGNAL 64
#endif
// While the counter moved since the last poll (its producers' burst of last signals), sleep at
// most this long, however many signals are still missing: a poller that saw 100 missing no
// longer sleeps the cap through the burst's end. 256 against off (0): SmolLM2 shape -8.5, 1B
// -5.3, 8B -10 us, the same sign in all five pairs (eval/PERF_NOTES.md item 104). 0: off.
#ifndef AMK_SPIN_MOVING_NS
#define AMK_SPIN_MOVING_NS 256
#endif
// KiB of a task's immutable inputs hinted into L2 during its wait (ScheduleConfig.prefetch_kb):
// the first rounds of its loads. The whole slab (8 MiB) filled the memory system with hints
// that the latency-bound stages' loads waited behind (8B 7.00 -> 6.80 ms at 64).
#ifndef AMK_PREFETCH_KB
#define AMK_PREFETCH_KB 64
#endif

// The next task's record hinted into the L2 while this one runs (one thread, right after this
// record's copy): 6 MB of records a step are read once each, so the copy that starts every hop
// (the first of its two dependent round trips, eval/PERF_NOTES.md item 103) may miss the L2.
// Paired, 1 against 0: SmolLM2 shape -0.3 / -0.7 %, 1B -0.4 / -0.3 %, 8B +0.1 % (item 108).
#ifndef AMK_PREFETCH_NEXT_RECORD
#define AMK_PREFETCH_NEXT_RECORD 1
#endif

// 1: an attention partial's wait also hints its K and V rows into the L2 (amk_attn_prefetch_rows);
// 0 (the default): only the GEMVs' weights are hinted. The row hints made a SmolLM2 partial's first
// phase (q and pos) 1.48 -> 2.18 us with its passes no faster, and without them, paired on an H200:
// the 1B -1.03 %, at ctx 8192 -0.60 %, the int8 1B -0.41 % (eval/PERF_NOTES.md item 234).
#ifndef AMK_PREFETCH_ATTN_ROWS
#define AMK_PREFETCH_ATTN_ROWS 0
#endif

static_assert(AMK_BLOCK_THREADS % AMK_WARP_SIZE == 0, "blocks are whole warps");

// Hint the L2 to fetch a task's immutable inputs (slots in t.prefetch_in; an attention
// partial's KV rows too where AMK_PREFETCH_ATTN_ROWS is 1, instructions/attention.cuh),
// spread over threads tid = 0..nthr-1, until *keep_going drops to 0 (the wait it overlaps is
// over: from then on the op's own loads fetch the rest). Reads the record from the global
// table: it may be a task further down the queue.
AMK_DEVICE void amk_prefetch_task(const AmkTask* __restrict__ t, const AmkBuffer* __restrict__ bufs, int tid,
                                  int nthr, const volatile int* keep_going) {
  if (AMK_PREFETCH_ATTN_ROWS && t->op == AMK_OP_ATTN_PARTIAL) amk_attn_prefetch_rows(t, bufs, tid, nthr, keep_going);
  long long budget = (long long)AMK_PREFETCH_KB * 1024 / 128;  // 128-byte line slots
  const int mask = t->prefetch_in;
  for (int s = 0; s < t->n_in && mask != 0 && budget > 0; ++s) {
    if (!((mask >> s) & 1)) continue;
    const AmkOperand& o = t->in[s];
    const AmkBuffer& b = bufs[o.buf];
    const int bits = amk_dtype_bits(b.dtype);
    const long long count = o.count > 0 ? o.count : 1;
    const bool dense = count == 1 || o.stride == o.len;  // back-to-back runs: one byte range
    if (!amk_prefetch_runs((const char*)b.ptr, o.off * bits / 8, o.stride * bits / 8,
                           (o.len * (dense ? count : 1) * bits + 7) / 8, dense ? 1 : count, tid, nthr, budget,
                           keep_going))
      return;
  }
}

// Thread 0 only: wait until every counter of the task has reached its threshold.
AMK_DEVICE bool amk_wait_all(const AmkCtx& c, const unsigned* counters, unsigned epoch,
                             unsigned long long timeout_ns, const int* host_abort) {
  const AmkTask& t = *c.t;
  for (int w = 0; w < t.n_wait; ++w) {
    const AmkWait& wt = t.waits[w];
    const unsigned target = (epoch - 1u) * wt.producers + wt.threshold;
    const unsigned* p = counters + wt.counter;
    unsigned v = amk_ld_acquire(p, wt.scope);
    if ((int)(v - target) >= 0) continue;
    const unsigned long long t0 = amk_timer_ns();
    unsigned iter = 0;
    bool moved = false;  // the counter changed at the previous poll
    for (;;) {
      const unsigned missing = target - v;  // > 0 here (modulo 2^32, like the thresholds)
      unsigned ns = AMK_SPIN_MAX_NS;
      if (missing < AMK_SPIN_MAX_NS / AMK_SPIN_NS_PER_SIGNAL) ns = missing * AMK_SPIN_NS_PER_SIGNAL;
      if (AMK_SPIN_MOVING_NS > 0 && moved && ns > AMK_SPIN_MOVING_NS) ns = AMK_SPIN_MOVING_NS;
      amk_nanosleep(ns < AMK_SPIN_MIN_NS ? AMK_SPIN_MIN_NS : ns);
      const unsigned seen = v;
      v = amk_ld_acquire(p, wt.scope);
      if ((int)(v - target) >= 0) break;
      moved = v != seen;
      if ((++iter & 63) == 0) {  // every 64 polls: give up on another block's error, an abort, the budget
        if (amk_ld_volatile(&c.status[AMK_ST_CODE]) != 0) return false;
        if (host_abort != nullptr && amk_ld_volatile(host_abort) != 0) {
          amk_report(c, AMK_ERR_ABORTED, wt.counter, v, target);
          return false;
        }
        if (amk_timer_ns() - t0 > timeout_ns) {
          amk_report(c, AMK_ERR_SPIN_TIMEOUT, wt.counter, v, target);
          return false;
        }
      }
    }
  }
  return true;
}

extern "C" AMK_KERNEL(AMK_BLOCK_THREADS, AMK_MIN_BLOCKS)
amk_megakernel(const AmkTask* __restrict__ tasks, const int* __restrict__ queue_start,
               const int* __restrict__ queue_tasks, const AmkBuffer* __restrict__ bufs,
               unsigned* counters, int* status, const int* host_abort, unsigned epoch,
               unsigned long long spin_timeout_ns, int smem_bytes, int prefetch_depth
#ifdef AMK_TRACE
               , unsigned long long* trace  // [ntasks, AMK_TRACE_COLS]: wait start, wait met, op done, marks, body done (ns)
#endif
               ) {
  AMK_DYNAMIC_SHARED(amk_dyn_smem);
  AMK_BLOCK_SHARED(AmkTask, s_task);
  AMK_BLOCK_SHARED(AmkTaskBuffers, s_bufs);
  AMK_BLOCK_SHARED(int, s_go);
  AMK_BLOCK_SHARED(int, s_waiting);
#ifdef AMK_TRACE
  struct AmkMarks { unsigned long long met, t[AMK_TRACE_MARKS]; };  // written to the row at body done
  AMK_BLOCK_SHARED(AmkMarks, s_marks);
#endif

  AmkCtx c;
  c.t = &s_task;
  c.bufs = s_bufs.b;
  c.smem = (float*)amk_dyn_smem;
  c.smem_words = smem_bytes / 4;
  c.status = status;
  c.queue = blockIdx.x;
  c.trace_row = nullptr;
  c.marks = nullptr;

  const int q0 = queue_start[blockIdx.x], q1 = queue_start[blockIdx.x + 1];
  for (int qi = q0; qi < q1; ++qi) {
    const int* src = (const int*)(tasks + queue_tasks[qi]);
    // (warp 1's first thread, not the waiter; thread 0 in a block of one warp)
    const bool hint_next = AMK_PREFETCH_NEXT_RECORD && threadIdx.x == AMK_WARP_SIZE % blockDim.x && qi + 1 < q1;
    const int next = hint_next ? queue_tasks[qi + 1] : 0;  // loaded beside this record's index
    for (int i = threadIdx.x; i < (int)(sizeof(AmkTask) / 4); i += blockDim.x) ((int*)&s_task)[i] = src[i];
    if (hint_next) {
      const char* rec = (const char*)(tasks + next);
      for (int off = 0; off < (int)sizeof(AmkTask); off += 128) amk_prefetch_l2(rec + off);
      amk_prefetch_l2(rec + sizeof(AmkTask) - 1);
    }
    amk_syncthreads();
    // The task's buffer descriptors move to shared memory before the wait (operand slot s
    // reads descriptor s), so the op's address arithmetic never waits on the buffer table.
    const int n_in = min(s_task.n_in, (int)AMK_MAX_INPUTS), n_ops = n_in + min(s_task.n_out, (int)AMK_MAX_OUTPUTS);
    if ((int)threadIdx.x < n_ops) {
      AmkOperand& o = (int)threadIdx.x < n_in ? s_task.in[threadIdx.x] : s_task.out[threadIdx.x - n_in];
      s_bufs.b[threadIdx.x] = bufs[o.buf];
      o.buf = threadIdx.x;
    }
    if (threadIdx.x == 0) s_waiting = 1, s_go = -1;  // -1: not waited yet
    const int out_counter = s_task.out_counter, out_scope = s_task.out_scope;
    amk_syncthreads();

#ifdef AMK_TRACE
    c.trace_row = trace + (long long)AMK_TRACE_COLS * queue_tasks[qi];
    c.marks = s_marks.t;
    if (threadIdx.x == 0) {
      c.trace_row[0] = amk_timer_ns();
      for (int k = 0; k < AMK_TRACE_MARKS; ++k) s_marks.t[k] = 0;  // 0 = not marked
    }
#endif
    // The op calls this once, with every thread, when it has done what it may before the wait
    // (amk_dispatch). Thread 0 waits; meanwhile warps 1.. start the L2 fetch of immutable inputs
    // (weights) of this task or of the one prefetch_depth-1 ahead (the first ones at queue
    // start), and stop when the wait is over: a prefetch that ran to completion before a short
    // wait delayed the op by the time it took to issue (6 us per 508 KB gate/up slab).
    const auto wait = [&]() -> bool {
      if (threadIdx.x == 0) {
        s_go = amk_wait_all(c, counters, epoch, spin_timeout_ns, host_abort);
        *(volatile int*)&s_waiting = 0;
      } else if (prefetch_depth > 0 && (int)threadIdx.x >= AMK_WARP_SIZE) {
        const int first = qi == q0 ? qi : qi + prefetch_depth - 1, last = min(qi + prefetch_depth, q1);
        for (int a = first; a < last; ++a)
          amk_prefetch_task(tasks + queue_tasks[a], bufs, threadIdx.x - AMK_WARP_SIZE, blockDim.x - AMK_WARP_SIZE,
                            &s_waiting);
      }
#ifdef AMK_TRACE
      if (threadIdx.x == 0) s_marks.met = amk_timer_ns();
#endif
      amk_syncthreads();
      return s_go == 1;
    };
    amk_dispatch(c, wait);
    amk_syncthreads();
    if (s_go != 1) {  // the wait gave up (reported), or the op never waited (a VM bug)
      if (s_go < 0 && threadIdx.x == 0) amk_report(c, AMK_ERR_BAD_OP, s_task.op);
      break;
    }
#ifdef AMK_TRACE
    if (threadIdx.x == 0) {
      c.trace_row[AMK_TRACE_BODY_DONE] = amk_timer_ns();
      c.trace_row[1] = s_marks.met;
      for (int k = 0; k < AMK_TRACE_MARKS; ++k) c.trace_row[3 + k] = s_marks.t[k];
    }
#endif
    if (threadIdx.x == 0) amk_release_add(&counters[out_counter], 1u, out_scope);
#ifdef AMK_TRACE
    if (threadIdx.x == 0) c.trace_row[2] = amk_timer_ns();
#endif
  }
}
