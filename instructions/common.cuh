// Shared helpers of the op device functions: the task context, element loads/stores by
// dtype (Numerics of ir.py: read -> fp32, compute fp32, round on store), operand
// addressing (Regions of ir.py) and error reporting.
#pragma once

#include "portability.h"

// Build-time specialization (vm/loader.py derives these from the program): bit d set = the
// code paths of AmkDType d are compiled in, for any buffer (AMK_DTYPES) and for GEMV weights
// (AMK_GEMV_WDTYPES). The megakernel is one function; every template instance it does not
// need makes it larger, and a kernel far beyond the instruction cache pays instruction
// fetches at every switch between ops. A dtype left out reports AMK_ERR_DTYPE. Default: all.
#ifndef AMK_DTYPES
#define AMK_DTYPES 0x3f
#endif
#ifndef AMK_GEMV_WDTYPES
#define AMK_GEMV_WDTYPES 0x3f
#endif
#define AMK_WITH_DTYPE(dt) ((((AMK_DTYPES) >> (dt)) & 1) != 0)
#define AMK_WITH_GEMV_WDTYPE(dt) ((((AMK_GEMV_WDTYPES) >> (dt)) & 1) != 0)
// The same for the ops and the GEMV / REDUCE epilogues: bit k of AMK_OPS = op code k (AmkOp),
// bit e of AMK_EPILOGUES = epilogue e (AmkEpilogue); AMK_EPI_BIAS / AMK_EPI_HEAD_NORM 0 = no
// epilogue of the program adds a bias / normalizes heads. A program of only the fused ops
// needs 70 % of the code of all of them (PERF_NOTES item 81). Default: everything.
#ifndef AMK_OPS
#define AMK_OPS 0xfff
#endif
#ifndef AMK_EPILOGUES
#define AMK_EPILOGUES 0x3f
#endif
#ifndef AMK_EPI_BIAS
#define AMK_EPI_BIAS 1
#endif
#ifndef AMK_EPI_HEAD_NORM
#define AMK_EPI_HEAD_NORM 1
#endif
// AMK_GEMV_COMBINE 1: a GEMV may have the attention combine prologue (ir.GemvParams combine_*).
// Off unless the program has one (vm/loader.py knob_defines turns it on): compiled into the
// build of every op and dtype it makes ptxas spill on sm_80/90/120.
#ifndef AMK_GEMV_COMBINE
#define AMK_GEMV_COMBINE 0
#endif
// AMK_GEMV_I8_ZERO 1: an I8 weight may have a zero companion (ScheduleConfig.quant_asym), whose
// term the GEMV's rows add per 32-column chunk of x (gemv.cuh amk_gemv_row_vec). Off unless the program has
// one (knob_defines), so that the int8 builds' registers and code stay as they were.
#ifndef AMK_GEMV_I8_ZERO
#define AMK_GEMV_I8_ZERO 0
#endif
// AMK_GEMV_LOADS_AHEAD 1: the GEMV rows' loads-ahead loop (gemv.cuh, where it is described); its
// default here, ahead of every header whose own defaults depend on it (combine.cuh, attention.cuh).
#ifndef AMK_GEMV_LOADS_AHEAD
#define AMK_GEMV_LOADS_AHEAD 0
#endif
// AMK_GEMV_PARTIALS 1: a GEMV may read x or its residual together with split-K partials
// (ir.GemvParams x_partials / residual_partials, ScheduleConfig.o_proj_kv_slices). Off unless the
// program has such a GEMV (knob_defines), so that other builds' code stays as it was.
#ifndef AMK_GEMV_PARTIALS
#define AMK_GEMV_PARTIALS 0
#endif
// AMK_GEMV_ARGMAX 1: a GEMV may write its rows' argmax pair beside y (ir.GemvParams
// argmax_pair_base, ScheduleConfig.fuse_argmax). Off unless the program has one (knob_defines).
#ifndef AMK_GEMV_ARGMAX
#define AMK_GEMV_ARGMAX 0
#endif
#define AMK_WITH_OP(op) ((((AMK_OPS) >> (op)) & 1) != 0)
#define AMK_WITH_EPILOGUE(e) ((((AMK_EPILOGUES) >> (e)) & 1) != 0)

// What every op function receives. `t` and `smem` are in shared memory.
struct AmkCtx {
  const AmkTask* t;
  const AmkBuffer* bufs;
  float* smem;     // dynamic shared memory
  int smem_words;  // its size in 4-byte words
  int* status;     // device status block (AmkStatusIndex)
  int queue;
  unsigned long long* trace_row;  // AMK_TRACE builds: this task's row of the trace table
  unsigned long long* marks;      // AMK_TRACE builds: its phase marks until body done (shared memory)
};

// Trace columns per task (AMK_TRACE builds): wait start, wait met, op done (its counter
// released), then up to three phase marks an op records inside itself (0 = not reached / not
// marked), then body done (the op returned and the block passed its barrier: what the release
// after it costs is op done minus this).
#define AMK_TRACE_COLS 7
#define AMK_TRACE_BODY_DONE 6
// Trace diagnostic only: the GEMV epilogue and the attention combine's output loop run twice,
// trace mark 2 between, so a trace shows a cold pass beside a warm one (idempotent for the
// models without biases or head norms; results otherwise wrong).
#ifndef AMK_DIAG_TWICE
#define AMK_DIAG_TWICE 0
#endif
// Diagnostic only: N units of never-run code in the GEMV epilogue (epilogue.cuh; 0: none).
#ifndef AMK_DIAG_DEAD_CODE
#define AMK_DIAG_DEAD_CODE 0
#endif
#define AMK_TRACE_MARKS 3
#ifdef AMK_TRACE
// Held in shared memory (as is "wait met") and written to the trace row with body done: a
// global store inside an op could wait behind the memory system and move the times after it
// (eval/PERF_NOTES.md item 99).
AMK_DEVICE void amk_trace_mark(const AmkCtx& c, int k) {
  if (threadIdx.x == 0) c.marks[k] = amk_timer_ns();
}
#else
AMK_DEVICE void amk_trace_mark(const AmkCtx&, int) {}
#endif

// Report an error (first one wins) from any thread; the host raises it after the step.
AMK_DEVICE void amk_report(const AmkCtx& c, int code, long long d1 = 0, long long d2 = 0, long long d3 = 0) {
  if (atomicCAS(&c.status[AMK_ST_CODE], 0, code) == 0) {
    c.status[AMK_ST_TASK] = c.t->id;
    c.status[AMK_ST_BLOCK] = c.queue;
    c.status[AMK_ST_DETAIL] = (int)d1;
    c.status[AMK_ST_DETAIL2] = (int)d2;
    c.status[AMK_ST_DETAIL3] = (int)d3;
  }
}

AMK_DEVICE const AmkOperand& amk_in(const AmkCtx& c, int role) { return c.t->in[c.t->role[role]]; }
AMK_DEVICE bool amk_has(const AmkCtx& c, int role) { return c.t->role[role] >= 0; }
AMK_DEVICE const AmkBuffer& amk_buf(const AmkCtx& c, const AmkOperand& o) { return c.bufs[o.buf]; }

// Shared-memory carve: returns nullptr (and reports) when the launch gave too little.
AMK_DEVICE float* amk_smem(const AmkCtx& c, long long words) {
  if (words > c.smem_words) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_SMEM, words * 4, (long long)c.smem_words * 4);
    return nullptr;
  }
  return c.smem;
}

// ---------------------------------------------------------------- element access
// Bits per element of a dtype (U4 4, I8 8, F16/BF16 16, F32/I32 32).
AMK_DEVICE int amk_dtype_bits(int dt) {
  return dt == AMK_DTYPE_U4 ? 4 : dt == AMK_DTYPE_I8 ? 8 : (dt == AMK_DTYPE_F16 || dt == AMK_DTYPE_BF16) ? 16 : 32;
}

// A 16-bit float of dtype dt (BF16, else F16) as fp32: the one runtime-dtype conversion the
// ops share (KV rows, quantization scales); typed code uses amk_load_as / AmkWFmt.
// A build without one of the two formats (AMK_DTYPES) compiles only the other: a buffer of a
// dtype left out cannot reach here (the loader compiles in every dtype of the program).
AMK_DEVICE float amk_half_to_f32(int dt, unsigned short h) {
  if constexpr (!AMK_WITH_DTYPE(AMK_DTYPE_F16)) return amk_bf16_to_f32(h);
  else if constexpr (!AMK_WITH_DTYPE(AMK_DTYPE_BF16)) return amk_f16_to_f32(h);
  else return dt == AMK_DTYPE_BF16 ? amk_bf16_to_f32(h) : amk_f16_to_f32(h);
}

// Code i of packed U4 data (low nibble first) as fp32.
AMK_DEVICE float amk_u4_at(const char* p, amk_i64 i) {
  const unsigned char byte = ((const unsigned char*)p)[i >> 1];
  return (float)((i & 1) ? (byte >> 4) : (byte & 15));
}

// Element i of a buffer as fp32. Cases for dtypes this build does not compile are left out
// (AMK_DTYPES: the loader includes every dtype the program has, but for the quantized weights'
// companions, gemv.cuh amk_qcomp_load, so a buffer of a dtype left out cannot reach here). A switch
// over four dtypes (a quantized build's F32, BF16, I32, I8 / U4) compiles to a jump table (BRX: 34 on
// sm_90); branching on the element's width instead measured nothing (eval/PERF_NOTES.md item 242,
// eval/patches/load_by_width_138c752.diff).
AMK_DEVICE float amk_load(const AmkBuffer& b, amk_i64 i) {
  const char* p = (const char*)b.ptr;
  switch (b.dtype) {
    case AMK_DTYPE_F32:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F32)) return ((const float*)p)[i];
      break;
    case AMK_DTYPE_F16:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F16)) return amk_f16_to_f32(((const unsigned short*)p)[i]);
      break;
    case AMK_DTYPE_BF16:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_BF16)) return amk_bf16_to_f32(((const unsigned short*)p)[i]);
      break;
    case AMK_DTYPE_I32:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_I32)) return (float)((const int*)p)[i];
      break;
    case AMK_DTYPE_I8:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_I8)) return (float)((const signed char*)p)[i];
      break;
    case AMK_DTYPE_U4:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_U4)) return amk_u4_at(p, i);
      break;
    default: break;
  }
  return amk_nan();
}

// f.template run<DT>() with DT the float dtype dt (F32, BF16, F16) when this build compiles
// it; false otherwise. Loops that load one operand many times dispatch once, outside, instead
// of switching per element. (A functor with a member template rather than a generic lambda:
// NVRTC does not give generic lambdas a device execution space.)
template <class F>
AMK_DEVICE bool amk_float_dispatch(int dt, const F& f) {
  if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F32))
    if (dt == AMK_DTYPE_F32) return f.template run<AMK_DTYPE_F32>(), true;
  if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_BF16))
    if (dt == AMK_DTYPE_BF16) return f.template run<AMK_DTYPE_BF16>(), true;
  if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F16))
    if (dt == AMK_DTYPE_F16) return f.template run<AMK_DTYPE_F16>(), true;
  return false;
}

// Element i of float buffer data of dtype DT (F32, BF16, F16) as fp32.
template <int DT>
AMK_DEVICE float amk_load_as(amk_u64 ptr, amk_i64 i) {
  if constexpr (DT == AMK_DTYPE_F32) return ((const float*)ptr)[i];
  else if constexpr (DT == AMK_DTYPE_BF16) return amk_bf16_to_f32(((const unsigned short*)ptr)[i]);
  else return amk_f16_to_f32(((const unsigned short*)ptr)[i]);
}

// v rounded to a float dtype's precision and back (RNE), as a store then a load would:
// the half-precision rounding points of ir.py Numerics. F32 (and any other dtype): v. A half
// format the build leaves out (AMK_DTYPES) is not compiled: no program of that build has one, and
// ptxas had copied whole loops for it (sm_90 code: bf16 build -1.3 KB, int8 -5 KB, int4 -14 KB).
AMK_DEVICE float amk_round(int dtype, float v) {
  if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_BF16))
    if (dtype == AMK_DTYPE_BF16) return amk_bf16_to_f32(amk_f32_to_bf16(v));
  if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F16))
    if (dtype == AMK_DTYPE_F16) return amk_f16_to_f32(amk_f32_to_f16(v));
  return v;
}

AMK_DEVICE void amk_store(const AmkBuffer& b, amk_i64 i, float v) {
  char* p = (char*)b.ptr;
  switch (b.dtype) {
    case AMK_DTYPE_F32:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F32)) ((float*)p)[i] = v;
      break;
    case AMK_DTYPE_F16:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_F16)) ((unsigned short*)p)[i] = amk_f32_to_f16(v);
      break;
    case AMK_DTYPE_BF16:
      if constexpr (AMK_WITH_DTYPE(AMK_DTYPE_BF16)) ((unsigned short*)p)[i] = amk_f32_to_bf16(v);
      break;
    default: break;  // integer outputs go through amk_store_int; loaders reject the rest
  }
}

AMK_DEVICE int amk_load_int(const AmkBuffer& b, amk_i64 i) {
  if (b.dtype == AMK_DTYPE_I32) return ((const int*)b.ptr)[i];
  return (int)amk_load(b, i);
}

AMK_DEVICE void amk_store_int(const AmkBuffer& b, amk_i64 i, int v) {
  if (b.dtype == AMK_DTYPE_I32) ((int*)b.ptr)[i] = v;
  else amk_store(b, i, (float)v);
}

// ---------------------------------------------------------------- L2 prefetch hints
// Hint the L2 to fetch `runs` runs of run_bytes bytes, run r at base + first_byte + r *
// stride_bytes: their 128-byte lines spread over threads tid < nthr, at most `budget` line
// slots (decremented). Returns false, having stopped, once *keep_going drops to 0 (the wait
// the prefetch overlaps is over). Hints only: they never change what a later load returns.
AMK_DEVICE bool amk_prefetch_runs(const char* base, long long first_byte, long long stride_bytes, long long run_bytes,
                                  long long runs, int tid, int nthr, long long& budget, const volatile int* keep_going) {
  const long long lines = (run_bytes + 127) / 128 + 1;  // per run: it may straddle one more line
  const long long total = runs * lines < budget ? runs * lines : budget;
  for (long long i = tid; i < total; i += nthr) {
    if (*keep_going == 0) return false;
    const long long r = i / lines, first = first_byte + r * stride_bytes;
    const long long byte = (first & ~127ll) + (i - r * lines) * 128;
    if (byte < first + run_bytes) amk_prefetch_l2(base + byte);
  }
  budget -= total;
  return true;
}

// ---------------------------------------------------------------- addressing
// Element i of an operand of several runs, out of line: inlined at every element access, its
// divisions were 30 % of the sm_90 bf16 kernel's instructions (compile_check --by-source: 43,440 ->
// 30,448 without them), crowding the instruction cache of the latency-bound phases (PERF_NOTES
// items 78-79: the 1B -0.8 %, the SmolLM2 shape -3.5 %).
AMK_DEVICE_NOINLINE amk_i64 amk_flat_runs(amk_i64 off, amk_i64 stride, int len, amk_i64 i) {
  if (i >= 0 && i <= 0xffffffffll) {  // a 32-bit division: the 64-bit one is a ~70-instruction call
    const unsigned ui = (unsigned)i, run = ui / (unsigned)len;
    return off + (amk_i64)run * stride + (ui - run * (unsigned)len);
  }
  const amk_i64 run = i / len;
  return off + run * stride + (i - run * len);
}

// AMK_FLAT_RUNS (1 = the kernel's default): 0 compiles amk_flat as one run, o.off + i, without
// amk_flat_runs' call (its argument set-up and the registers kept across it at every call site: sm_90
// bf16 247,680 -> 228,096 B, int8 278,272 -> 254,464 B; eval/PERF_NOTES.md items 249-250). The loader
// builds every program with 0 where no operand the kernel reads through amk_flat has several runs
// apart: in the programs the lowering makes, the operands of several runs (weights, scales and zeros,
// the embedding table, split-K and o_proj_kv_slices partials) are addressed run by run (off + k *
// stride) instead (vm/loader.py flat_runs_needed; a build with 0 for a program that needs the runs is
// refused). Measured on an H200: SmolLM2 shape bf16 -1.31 %, int8 -2.49 %, int4 -0.99 %; 1B -0.75 %,
// -0.43 %, -0.74 %; 8B -0.90 %, -0.18 %, +0.03 %.
#ifndef AMK_FLAT_RUNS
#define AMK_FLAT_RUNS 1
#endif
// Element i of a flat operand (the union of its count runs, in order).
AMK_DEVICE amk_i64 amk_flat(const AmkOperand& o, amk_i64 i) {
#if AMK_FLAT_RUNS
  return o.count <= 1 ? o.off + i : amk_flat_runs(o.off, o.stride, o.len, i);
#else
  return o.off + i;
#endif
}

// AMK_KV_HEAD_MAJOR: the program has head-major KV caches (meta['vm']['kv_head'], vm/kv_layout.py), which
// the loader's define compiles in; other builds keep the row-major index alone.
#ifndef AMK_KV_HEAD_MAJOR
#define AMK_KV_HEAD_MAJOR 0
#endif
// Element col of cache row `row` in b's storage: row-major, or in head col / kv_head's [rows, kv_head] block.
AMK_DEVICE amk_i64 amk_kv_at(const AmkBuffer& b, amk_i64 row, amk_i64 col) {
#if AMK_KV_HEAD_MAJOR
  if (b.kv_head > 0) {  // a power of two (vm/kv_layout.py): shifts, not divisions; col < width < 2^31
    const int lg = amk_log2_pow2(b.kv_head), c = (int)col;
    return (((amk_i64)(c >> lg) * b.rows + row) << lg) + (c & (b.kv_head - 1));
  }
#endif
  return row * b.width + col;
}

// Element i of a KV operand at cache row `row`.
AMK_DEVICE amk_i64 amk_kv(const AmkOperand& o, const AmkBuffer& b, amk_i64 row, amk_i64 i) {
#if AMK_KV_HEAD_MAJOR
  return amk_kv_at(b, row, o.off + i);
#else
  return row * b.width + o.off + i;  // (as written before head-major caches: the same PTX)
#endif
}

// Element i of an output operand: flat, or row `pos` of a KV cache (kv == APPEND).
AMK_DEVICE amk_i64 amk_out_index(const AmkOperand& o, const AmkBuffer& b, int pos, amk_i64 i) {
  return o.kv == AMK_KVMODE_APPEND ? amk_kv(o, b, pos, i) : amk_flat(o, i);
}

AMK_DEVICE float amk_in_at(const AmkCtx& c, const AmkOperand& o, amk_i64 i) {
  return amk_load(amk_buf(c, o), amk_flat(o, i));
}

// The runtime position from a `pos` operand, checked against every KV operand of the task
// by the caller (amk_check_pos). Read by all threads; returns the same value everywhere.
AMK_DEVICE int amk_read_pos(const AmkCtx& c, const AmkOperand& o) {
  return amk_load_int(amk_buf(c, o), amk_flat(o, 0));
}

// True when `pos` indexes a row of every KV operand of the task; reports otherwise.
AMK_DEVICE bool amk_check_pos(const AmkCtx& c, int pos) {
  bool ok = pos >= 0;
  for (int s = 0; s < c.t->n_in && ok; ++s)
    if (c.t->in[s].kv != AMK_KVMODE_NONE) ok = pos < c.bufs[c.t->in[s].buf].rows;
  for (int s = 0; s < c.t->n_out && ok; ++s)
    if (c.t->out[s].kv != AMK_KVMODE_NONE) ok = pos < c.bufs[c.t->out[s].buf].rows;
  if (!ok && threadIdx.x == 0) amk_report(c, AMK_ERR_POS_RANGE, pos);
  return ok;
}

AMK_DEVICE int amk_lane() { return threadIdx.x % AMK_WARP_SIZE; }
AMK_DEVICE int amk_warp() { return threadIdx.x / AMK_WARP_SIZE; }
AMK_DEVICE int amk_nwarps() { return blockDim.x / AMK_WARP_SIZE; }

// AMK_QUOT_DIVIDE: amk_quot and the attention split bounds divide even by powers of two, as
// before items 186-187 (which were measured on bf16 builds). On by default in builds with I8 or
// U4 weights (0x30): there the shifts cost the int4 1B 1.32 % and the int8 1B 0.24 %
// (eval/PERF_NOTES.md items 189-190, paired on an H200; not traced: the quantized builds are the
// ones at ptxas's register limit). On int4 the cost is amk_quot's part (item 187; +0.61 %), the
// split bounds' shifts alone measured even; the int4 SmolLM2 shape gains 0.23 % with the shifts
// (item 193), but the 1B is int4's target shape.
#ifndef AMK_QUOT_DIVIDE
#define AMK_QUOT_DIVIDE (((AMK_GEMV_WDTYPES) & 0x30) != 0)
#endif
// a / b for a >= 0 and b > 0 known only at run time, warp-uniform: a shift where b is a power of
// two (the head dims of every lowering so far), the division otherwise, one branch. On a stage's
// chain a run-time division costs more than its instructions (eval/PERF_NOTES.md items 186-187).
AMK_DEVICE int amk_quot(int a, int b) {
  if constexpr (!AMK_QUOT_DIVIDE) return (b & (b - 1)) == 0 ? a >> amk_log2_pow2(b) : a / b;
  return a / b;
}

AMK_DEVICE float amk_silu(float x) { return amk_div(x, amk_add(1.0f, amk_exp(-x))); }
