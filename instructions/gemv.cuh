// GEMV: a slab of rows of y = W x, with the RMSNorm prologue, quantized weights, split-K
// partials and the fused epilogues  (ir.GemvParams).
//
// Layout of the work: x (normalised when the prologue is on) is staged once into shared
// memory as fp32; each warp owns rows r = warp, warp + nwarps, ... and streams its row with
// 16-byte loads, several of them in flight per lane (AMK_GEMV_UNROLL[_Q]), accumulating in fp32; one warp
// reduction per row lands in the shared accumulator array, which the epilogue finishes.
// The weight slab is immutable, so the scheduler prefetches it into L2 before the task's
// waits; coarse slabs (many rows per task) keep many bytes in flight per SM.
//
// Shared memory (4-byte words): xs[amk_xs_words(K)] | acc[rows * m] | red[32] | xsums[round4(K / 32)]
//   | [norm weights: round4(K)] | [the epilogue's staged operands (AmkEpiStage), without split-K]
//   | [the combine prologue's (m, l) weights and denominators (combine.cuh)]
#pragma once
#include "combine.cuh"
#include "epilogue.cuh"
#include "rmsnorm.cuh"
#include "vec.cuh"

// 16-byte loads in flight per lane (per matrix): float formats, quantized formats (whose
// vectors carry 16 or 32 weights and so need more registers to unpack).
#ifndef AMK_GEMV_UNROLL
#define AMK_GEMV_UNROLL 8  // 254 registers on sm_80/sm_90 without spills (12 spills)
#endif
#ifndef AMK_DIAG_Q_NO_SCALE_LOADS
#define AMK_DIAG_Q_NO_SCALE_LOADS 0
#endif
#ifndef AMK_DIAG_Q_NO_MATH
#define AMK_DIAG_Q_NO_MATH 0
#endif
#ifndef AMK_DIAG_Q_NO_W_LOADS
#define AMK_DIAG_Q_NO_W_LOADS 0
#endif
// Trace diagnostic only (results unchanged): 1 moves the GEMV's trace marks into its prologue
// (0 at the op's entry, 1 once thread 0 has x staged and, with the norm, its block sum, 2 at the
// prologue's end; the last phase is then rows + epilogue + release); 2 stages the prologue twice
// (it writes shared memory only), mark 0 between, so a trace shows a cold prologue beside a warm
// one (marks 1 and 2 as without it).
#ifndef AMK_DIAG_PROLOGUE
#define AMK_DIAG_PROLOGUE 0
#endif
// Trace diagnostic only (results unchanged): 1 runs the GEMV's rows twice, trace mark 1 between
// and 2 after, so a trace shows the rows from memory (marks 0 -> 1) beside the same rows again with
// their weights in the L2 (1 -> 2; the weight loads allocate no L1 lines). Not with AMK_DIAG_PROLOGUE
// or AMK_DIAG_TWICE (their marks).
#ifndef AMK_DIAG_ROWS_TWICE
#define AMK_DIAG_ROWS_TWICE 0
#endif
#if AMK_DIAG_ROWS_TWICE && (AMK_DIAG_PROLOGUE || AMK_DIAG_TWICE)
#error "AMK_DIAG_ROWS_TWICE uses the trace marks that AMK_DIAG_PROLOGUE and AMK_DIAG_TWICE set: one diagnostic at a time"
#endif
// 1: the GEMV sets up from its record (shared-memory carve, operands, epilogue shape) before its
// wait, overlapping it (a trace put that setup at 0.25 us after the wait; the 1B -1.1 %, the
// SmolLM2 shape -2.5 % on an H200: eval/PERF_NOTES.md item 156); 0: it waits first, as every other
// op does. The every-dtype build (both quantized formats) keeps 0: it spills with 1.
#ifndef AMK_GEMV_SETUP_FIRST
#define AMK_GEMV_SETUP_FIRST (AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_I8) && AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_U4) ? 0 : 1)
#endif
#ifndef AMK_GEMV_UNROLL_Q
#define AMK_GEMV_UNROLL_Q 8  // HIP and the CPU emulator; CUDA picks per architecture (vm/arch_cuda.h)
#endif

AMK_DEVICE long long amk_round4(long long n) { return (n + 3) & ~3ll; }

// Where x element i sits in shared memory: with AMK_GEMV_XPAD (vec.cuh), 4 unused floats after
// every quantized weight vector's slice of VEC = 16 (I8) or 32 (U4) elements; float weights
// keep x dense (fp32: 4-float slices, conflict-free as they are; 16-bit: rotated, AmkXRot).
// The loader decides whether x is padded and packs log2(VEC) into the task record
// (AMK_P_X_PAD), so placing x needs no buffer-table load (eval/PERF_NOTES.md item 74); the
// rows loop steps by VEC + pad, so that spacing must be the format's VEC. Builds without
// quantized weights keep x dense at compile time.
#define AMK_GEMV_XPAD_ON (AMK_GEMV_XPAD && (AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_I8) || AMK_WITH_GEMV_WDTYPE(AMK_DTYPE_U4)))
struct AmkXPad {
  int shift, pad;
  AMK_DEVICE int at(int i) const { return i + (i >> shift) * pad; }
};
AMK_DEVICE AmkXPad amk_xpad_of(const AmkTask& t) {
  const int shift = AMK_GEMV_XPAD_ON ? t.ip[AMK_P_X_PAD] : 0;
  return AmkXPad{shift, shift ? 4 : 0};
}
// The words x takes (vm/loader.py gemv_x_words).
AMK_DEVICE long long amk_xs_words(long long k, AmkXPad p) { return amk_round4(k + (k >> p.shift) * p.pad); }

// The zero terms need sum(x) over 32-column chunks: a U4 vector of codes (AmkWFmt<U4>::VEC), or
// two I8 vectors (AMK_GEMV_I8_ZERO; its groups are whole chunks, schedule/lower.py ZERO_CHUNK).
#define AMK_XSUM_CHUNK 32

// AMK_QCOMP_DTYPE: the one float dtype of every scale and zero of the program, where the loader
// knows it (knob_defines), so that a companion's load and conversion compile to one load and
// one shift instead of a dtype test, two predicated loads and a select; -1 (the default):
// tested at run time. A weight whose companions are of another dtype takes the scalar path
// (amk_gemv_vec_ok), so a wrong define costs speed, never results.
#ifndef AMK_QCOMP_DTYPE
#define AMK_QCOMP_DTYPE -1
#endif

// The epilogue operands the prologue stages (none when a REDUCE task runs the epilogue).
AMK_DEVICE AmkEpiStage amk_gemv_epi_stage(const AmkTask& t) {
  return t.ip[AMK_P_SPLIT_K] > 1 ? AmkEpiStage{0, 0, 0, 0} : amk_epi_stage_of(t);
}

// The combine prologue's shape (ir.GemvParams combine_*): the KV heads of the task's K slice;
// splits 0 if none.
AMK_DEVICE AmkCombineShape amk_gemv_combine(const AmkTask& t) {
  const int qh = t.ip[AMK_P_COMBINE_Q_HEADS], hd = t.ip[AMK_P_COMBINE_HEAD_DIM];
  const int splits = t.ip[AMK_P_COMBINE_SPLITS];
  if (!AMK_GEMV_COMBINE || splits <= 0) return AmkCombineShape{0, 0, 0, 0};
  return AmkCombineShape{(t.ip[AMK_P_K_HI] - t.ip[AMK_P_K_LO]) / (qh * hd), qh, hd, splits};
}

// Whether the task writes an argmax pair beside y (ir.GemvParams argmax_pair_base): its second output.
// (only without split-K: the validator's rule)
AMK_DEVICE bool amk_gemv_has_pair(const AmkTask& t) { return AMK_GEMV_ARGMAX && t.n_out > 1; }

AMK_DEVICE long long amk_smem_gemv(const AmkTask& t) {
  const long long k = t.ip[AMK_P_K_HI] - t.ip[AMK_P_K_LO];
  const AmkCombineShape cs = amk_gemv_combine(t);
  return amk_xs_words(k, amk_xpad_of(t)) + amk_round4((long long)t.ip[AMK_P_ROWS] * amk_row_width(t)) + AMK_WARP_SIZE +
         amk_round4(k / AMK_XSUM_CHUNK) + (t.ip[AMK_P_HAS_NORM] != 0 ? amk_round4(k) : 0) +  // .. | norm weights
         amk_round4(amk_gemv_epi_stage(t).words()) + (cs.splits > 0 ? amk_round4(amk_combine_smem_words(cs)) : 0) +
         (amk_gemv_has_pair(t) ? 2 * AMK_WARP_SIZE : 0);  // .. | the argmax pair's reduction
}

// Quantized weight formats: codes with a scale (and, U4, a zero) per group of columns.
template <int DT>
constexpr bool amk_quant_w = DT == AMK_DTYPE_I8 || DT == AMK_DTYPE_U4;

// One weight matrix of the task: rows x [k_lo, k_hi) plus its quantization companions.
struct AmkGemvW {
  const AmkBuffer* wb;
  amk_i64 off, stride;  // elements: row r starts at off + r * stride
  const AmkBuffer* sb;  // scale tile (I8, U4) or nullptr
  amk_i64 soff, sstride;
  const AmkBuffer* zb;  // zero tile (U4; I8 with AMK_GEMV_I8_ZERO) or nullptr
  amk_i64 zoff, zstride;
  int group, g0, k_lo;  // scale column of slice column c: (k_lo + c) / group - g0
};

AMK_DEVICE AmkGemvW amk_gemv_w(const AmkCtx& c, int role_w, int role_s, int role_z) {
  AmkGemvW w;
  const AmkOperand& o = amk_in(c, role_w);
  w.wb = &amk_buf(c, o);
  w.off = o.off;
  w.stride = o.stride;
  w.sb = w.zb = nullptr;
  w.soff = w.sstride = w.zoff = w.zstride = 0;
  w.group = w.wb->group > 0 ? w.wb->group : 1;
  w.k_lo = c.t->ip[AMK_P_K_LO];
  // Float weights (group 1) branch around the run-time division, ~27 instructions around a
  // MUFU.RCP (twice for gate/up) in every GEMV prologue (PERF_NOTES item 181: 1B -0.35 %).
  w.g0 = w.group > 1 ? w.k_lo / w.group : w.k_lo;
  if (amk_has(c, role_s)) {
    const AmkOperand& s = amk_in(c, role_s);
    w.sb = &amk_buf(c, s), w.soff = s.off, w.sstride = s.stride;
  }
  if (amk_has(c, role_z)) {
    const AmkOperand& z = amk_in(c, role_z);
    w.zb = &amk_buf(c, z), w.zoff = z.off, w.zstride = z.stride;
  }
  return w;
}

// Quantized weights come with their companions: I8 a scale (and, in builds with
// AMK_GEMV_I8_ZERO, possibly a zero), U4 a scale and a zero.
AMK_DEVICE bool amk_gemv_w_ok(const AmkGemvW& w) {
  const int dt = w.wb->dtype;
  return (dt == AMK_DTYPE_I8 || dt == AMK_DTYPE_U4) == (w.sb != nullptr) &&
         ((dt == AMK_DTYPE_U4) == (w.zb != nullptr) || (AMK_GEMV_I8_ZERO && dt == AMK_DTYPE_I8));
}

// Dequantize a code with the scale (and zero) of its group: w = q*s (+ z).
AMK_DEVICE float amk_dequant(const AmkGemvW& w, float q, float s, float z) {
  if (w.sb == nullptr) return q;
  const float v = amk_mul(q, s);
  return w.zb ? amk_add(v, z) : v;
}

// Is the companions' one dtype (AMK_QCOMP_DTYPE) left out of AMK_DTYPES? The loader leaves it out
// where no other buffer has it (eval/PERF_NOTES.md item 243: the F16 scales of a bf16 model then
// compile no F16 copy of the ops' float loops), and the companions' loads below convert it
// themselves. Where the build compiles it they go through amk_load / amk_half_to_f32, as before
// (the same code). (amk_half_to_f32 keeps its shortcut for the buffers of AMK_DTYPES: taking the
// companions' dtype into it would make the KV rows' conversion a run-time select.)
constexpr AMK_DEVICE bool amk_qcomp_apart() {
  return AMK_QCOMP_DTYPE >= 0 && (((AMK_DTYPES) >> (AMK_QCOMP_DTYPE & 31)) & 1) == 0;
}
// A 16-bit float companion's bits (of dtype dt: BF16, else F16) as fp32.
AMK_DEVICE float amk_qcomp_half_to_f32(int dt, unsigned short h) {
  if constexpr (amk_qcomp_apart()) return dt == AMK_DTYPE_BF16 ? amk_bf16_to_f32(h) : amk_f16_to_f32(h);
  else return amk_half_to_f32(dt, h);
}
// Element i of a companion as fp32 (the scalar path's loads). Where the build leaves the companions'
// dtype out, every companion is of that dtype (vm/loader.py refuses a build where one is not).
AMK_DEVICE float amk_qcomp_load(const AmkBuffer& b, amk_i64 i) {
  if constexpr (amk_qcomp_apart()) {
    if (b.dtype != AMK_QCOMP_DTYPE) return amk_nan();
    if constexpr (AMK_QCOMP_DTYPE == AMK_DTYPE_F32) return ((const float*)b.ptr)[i];
    else return amk_qcomp_half_to_f32(AMK_QCOMP_DTYPE, ((const unsigned short*)b.ptr)[i]);
  } else {
    return amk_load(b, i);
  }
}

AMK_DEVICE float amk_w_scale(const AmkGemvW& w, int r, int c) {
  return w.sb ? amk_qcomp_load(*w.sb, w.soff + r * w.sstride + (w.k_lo + c) / w.group - w.g0) : 1.0f;
}
AMK_DEVICE float amk_w_zero(const AmkGemvW& w, int r, int c) {
  return w.zb ? amk_qcomp_load(*w.zb, w.zoff + r * w.zstride + (w.k_lo + c) / w.group - w.g0) : 0.0f;
}

// Where element (r, c) of the slab sits in its buffer.
AMK_DEVICE amk_i64 amk_w_elem(const AmkGemvW& w, int r, int c) { return w.off + r * w.stride + c; }

// Element (r, c) of the slab, dequantized: the scalar path (tails, unaligned slabs).
AMK_DEVICE float amk_w_at(const AmkGemvW& w, int r, int c) {
  const float q = amk_load(*w.wb, amk_w_elem(w, r, c));
  return amk_dequant(w, q, amk_w_scale(w, r, c), amk_w_zero(w, r, c));
}

// Where the scale (and zero) of a vector sits: vector v of the slice (columns v*VEC..) is in
// group (k_lo / VEC + v) / (group / VEC) - g0 of its row: a shift, because the vector path
// takes only slices inside one group or groups of a power-of-two number of vectors (every
// group size in use; amk_gemv_vec_ok sends the rest to the scalar path).
struct AmkGroupOf {
  int v0, shift;
  AMK_DEVICE int operator()(int v) const { return (v0 + v) >> shift; }
};
// A quantized build maps without a run-time division (the one-group test is the same as
// g0 = k_lo / group; item 178): a division ahead of a task's first weight loads delays them by
// more than its instructions (item 172). The float builds compile the mapping too, never to run
// it (float weights have no scales), and keep the older form: any change to that cold copy moved
// ptxas's schedule of the bf16 loads-ahead loop (item 176).
template <int VEC, bool QUANT>
AMK_DEVICE bool amk_group_of(const AmkGemvW& w, int K, AmkGroupOf& g) {
  const int vpg = w.group / VEC;
  const bool one_group = QUANT ? w.k_lo + K <= (w.g0 + 1) * w.group : (w.k_lo + K - 1) / w.group == w.g0;
  if (one_group) {  // the slice lies in one group (per-channel scales)
    g.v0 = 0, g.shift = 30;
    return true;
  }
  if ((vpg & (vpg - 1)) != 0) return false;
  if constexpr (QUANT) {
    g.shift = amk_log2_pow2(vpg);
  } else {
    for (g.shift = 0; (1 << g.shift) < vpg; ++g.shift) {
    }
  }
  g.v0 = w.k_lo / VEC - w.g0 * vpg;  // (k_lo / VEC + v) / vpg - g0 == (v0 + v) >> shift
  return true;
}

AMK_DEVICE bool amk_float_dtype(const AmkBuffer* b) {  // or no buffer
  return b == nullptr || b->dtype == AMK_DTYPE_F32 || b->dtype == AMK_DTYPE_BF16 || b->dtype == AMK_DTYPE_F16;
}
AMK_DEVICE bool amk_qcomp_dtype(const AmkBuffer* b) {  // a companion the vector rows can read (or none)
  return amk_float_dtype(b) && (AMK_QCOMP_DTYPE < 0 || b == nullptr || b->dtype == AMK_QCOMP_DTYPE);
}

// Can every row of this matrix be streamed with aligned 16-byte vectors, one scale per vector?
// If so (and it is quantized), `grp` maps the slice's vectors to their scale columns.
template <int DT>
AMK_DEVICE bool amk_gemv_vec_ok(const AmkGemvW& w, int K, AmkGroupOf& grp) {
  using F = AmkWFmt<DT>;
  if (w.off % F::VEC != 0 || w.stride % F::VEC != 0) return false;
  const unsigned long long base = w.wb->ptr + (unsigned long long)(w.off * F::BITS / 8);
  if (base % 16 != 0) return false;
  grp = AmkGroupOf{0, 0};
  if (w.sb == nullptr) return true;
  // an I8 zero's term comes from whole 32-column chunks of the slice: the scalar path otherwise
  const bool chunks = DT != AMK_DTYPE_I8 || w.zb == nullptr || (w.k_lo % AMK_XSUM_CHUNK == 0 && K % AMK_XSUM_CHUNK == 0);
  return chunks && w.group % F::VEC == 0 && w.k_lo % F::VEC == 0 && amk_qcomp_dtype(w.sb) && amk_qcomp_dtype(w.zb) &&
         amk_group_of<F::VEC, amk_quant_w<DT>>(w, K, grp);
}

// Loads in flight per lane and matrix: a pair (gate/up) splits the budget between its two
// matrices, which keeps the lane's bytes in flight and the registers of a single matrix.
template <int DT, bool PAIR>
struct AmkGemvUnroll {
  static constexpr int base = amk_quant_w<DT> ? AMK_GEMV_UNROLL_Q : AMK_GEMV_UNROLL;
  static constexpr int value = PAIR && base > 1 ? base / 2 : base;
};

// A row of scales (or zeros) in a float dtype, read as raw bits now and converted at use:
// no per-load dispatch on the dtype in the weight loop, and the loads stay independent.
struct AmkQRow {
  const char* p;
  int dt;
  AMK_DEVICE int dtype() const { return AMK_QCOMP_DTYPE >= 0 ? AMK_QCOMP_DTYPE : dt; }
  AMK_DEVICE unsigned raw(int g) const {
    return dtype() == AMK_DTYPE_F32 ? ((const unsigned*)p)[g] : ((const unsigned short*)p)[g];
  }
  AMK_DEVICE float value(unsigned r) const {
    return dtype() == AMK_DTYPE_F32 ? __uint_as_float(r) : amk_qcomp_half_to_f32(dtype(), (unsigned short)r);
  }
};
AMK_DEVICE AmkQRow amk_qrow(const AmkBuffer* b, amk_i64 off) {
  AmkQRow q;
  q.dt = b ? b->dtype : AMK_DTYPE_F32;
  q.p = b ? (const char*)b->ptr + off * (amk_dtype_bits(q.dt) / 8) : nullptr;
  return q;
}

// One quantized vector's contribution: scale * sum(code * x) (+ zero * sum(x) for U4; an I8
// zero's term is added per 32-column chunk by amk_gemv_row_vec).
// (raw: the vector's words rotated by rot.words; xv: the vector's x in natural order)
template <int DT, class R>
AMK_DEVICE float amk_qvec(const amk_u32x4& raw, const float* xv, float xsum, float sc, float z, R rot) {
  if constexpr (DT == AMK_DTYPE_U4) return sc * AmkWFmt<DT>::dot(raw, xv, xsum, rot) + z * xsum;
  else return sc * AmkWFmt<DT>::dot(raw, xv, rot);
}

// s += one weight vector's dot with x: amk_qvec for the quantized formats (sc, z: its scale and
// zero), else element by element, in order (the rows loops' shared step).
template <int DT, class R>
AMK_DEVICE void amk_gemv_vec_acc(float& s, const amk_u32x4& w, const float* xv, float xsum, float sc, float z,
                                 R rot) {
  if constexpr (amk_quant_w<DT>) {
    s += amk_qvec<DT>(w, xv, xsum, sc, z, rot);
  } else {
#pragma unroll
    for (int j = 0; j < AmkWFmt<DT>::VEC; ++j) s += AmkWFmt<DT>::get(w, j) * rot.x(xv, j);
  }
}

// A row's columns past its whole vectors (from col0), then the sum over its L lanes, which every
// one of them gets. valid false: the lane group has no row (it still takes part in the shuffles).
// AMK_GEMV_WHOLE_VECS (0 = off; the loader sets it for float and symmetric int8 loads-ahead builds
// where every GEMV spans whole vectors: loader._whole_vecs_define): the tail left out; a vector-row
// task with a tail reports "unsupported dtype" (amk_gemv_rows). Its loop of scalar weight loads
// sits in both rows loops' row end, a never-taken branch in a hot loop as items 198 and 206 took
// out. On an H200 (eval/PERF_NOTES.md items 207, 211, 212): loads ahead, 1B -0.73 %, int8 1B
// -1.14 %, 8B -1.17 %; the SmolLM2 shape's plain loop +0.24 %, so not there.
#ifndef AMK_GEMV_WHOLE_VECS
#define AMK_GEMV_WHOLE_VECS 0
#endif
// AMK_GEMV_TAIL_TYPED (1 = on; eval/PERF_NOTES.md item 245): a float tail's weights read as the rows'
// own dtype (amk_load_as), not through amk_w_at (amk_load's switch over the build's dtypes, a jump
// table in quantized builds, and the scale and zero loads float weights never have), and quantized
// rows compiled without a tail: the validator aligns a quantized K slice to its group, whose vectors
// amk_gemv_vec_ok requires whole, so no program that runs has one (amk_gemv_rows refuses one). Less
// code at every rows loop's row end (sm_90: bf16 -8.7 KB, int8 -15.5 KB, int4 -14.7 KB); the same
// values. On an H200: the int8 SmolLM2 shape -1.04 %, the int4 1B (loads ahead; spilling 8 / 8 B on
// sm_90 with it) -1.25 %, the bf16 SmolLM2 shape -0.11 %; but the int4 SmolLM2 shape +1.00 % (its
// plain loop spills 4 / 4 B with it), so int4 builds of the plain loop keep the quantized tail
// (AMK_GEMV_Q_NO_TAIL below).
#ifndef AMK_GEMV_TAIL_TYPED
#define AMK_GEMV_TAIL_TYPED 1
#endif
// AMK_GEMV_Q_NO_TAIL (eval/PERF_NOTES.md items 254, 255): the quantized rows compiled without a tail,
// apart from the float tail's typed read. 0 keeps the quantized rows' tail (through amk_w_at, as before
// item 245) while the float one is read typed: the plain int4 build (and the every-dtype build, which
// has int4 and the plain loop) then spills 4 / 4 B on sm_90 as with neither half (12 / 20 B with both),
// in 305,408 B of code against 313,472 (neither) and 297,728 (both); the int4 SmolLM2 shape -1.03 %
// against neither half on an H200.
#ifndef AMK_GEMV_Q_NO_TAIL
#if ((AMK_GEMV_WDTYPES) & 0x20) != 0 && !AMK_GEMV_LOADS_AHEAD  // 0x20: U4
#define AMK_GEMV_Q_NO_TAIL 0
#else
#define AMK_GEMV_Q_NO_TAIL AMK_GEMV_TAIL_TYPED
#endif
#endif
// Rows of weight dtype DT compiled without the tail (a vector-row slice of whole vectors only).
template <int DT>
constexpr bool amk_gemv_no_tail = AMK_GEMV_WHOLE_VECS || (AMK_GEMV_Q_NO_TAIL && amk_quant_w<DT>);
template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_row_tail_sum(const AmkGemvW& w, const AmkGemvW& w2, const float* xs, AmkXPad xp, int r,
                                      bool valid, int col0, int K, int L, int sub, float& s1, float& s2) {
  if constexpr (!amk_gemv_no_tail<DT>) {
    if (valid) {
      for (int col = col0 + sub; col < K; col += L) {
        const float x = xs[xp.at(col)];
        if constexpr (AMK_GEMV_TAIL_TYPED && !amk_quant_w<DT>) {
          s1 += amk_load_as<DT>(w.wb->ptr, amk_w_elem(w, r, col)) * x;
          if (PAIR) s2 += amk_load_as<DT>(w2.wb->ptr, amk_w_elem(w2, r, col)) * x;
        } else {  // (a quantized tail too, with AMK_GEMV_Q_NO_TAIL=0)
          s1 += amk_w_at(w, r, col) * x;
          if (PAIR) s2 += amk_w_at(w2, r, col) * x;
        }
      }
    }
  }
  for (int k = L / 2; k > 0; k >>= 1) {
    s1 += amk_shfl_xor(s1, k);
    if (PAIR) s2 += amk_shfl_xor(s2, k);
  }
}

// Dot of row r of w (and of w2 when PAIR) with xs[0:K), by the L lanes (a power of two) of
// the warp whose lane % L is `sub`; the result lands in all L of them. `valid` false: this
// lane group has no row (it still takes part in the shuffles). Several lane groups per warp
// keep short rows' loads in flight together: with K = 576 one row is 72 vectors, so a warp
// that walked its rows one at a time waited one memory latency per 1.1 KB. Quantized
// weights load their vectors' scales (and zeros) with the codes, before the first use, and
// apply them once per vector (xsums: the sums of xs over 32-column chunks, for the zero terms:
// a U4 vector is one chunk; an I8 one is half a chunk, and the even vector of each pair adds
// its chunk's term, the zero being its group's, as the groups are whole chunks).
template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_row_vec(const AmkGemvW& w, const AmkGemvW& w2, const AmkGroupOf& grp, const float* xs,
                                 AmkXPad xp, const float* xsums, int r, bool valid, int K, int L, int sub, float& a1,
                                 float& a2) {
  using F = AmkWFmt<DT>;
  constexpr bool Q = amk_quant_w<DT>, Z = DT == AMK_DTYPE_U4;
  constexpr bool ZI8 = AMK_GEMV_I8_ZERO && DT == AMK_DTYPE_I8;  // (a weight without a zero reads 0)
  constexpr int U = AmkGemvUnroll<DT, PAIR>::value;
  const int nvec = valid ? K / F::VEC : 0, xstride = F::VEC + xp.pad;  // x floats a vector takes
  const auto rot = AmkXRot<F::VEC / 4>::of(sub);  // this lane's order of x chunks (vec.cuh)
  const char* row1 = (const char*)w.wb->ptr + (w.off + r * w.stride) * F::BITS / 8;
  const char* row2 = PAIR ? (const char*)w2.wb->ptr + (w2.off + r * w2.stride) * F::BITS / 8 : nullptr;
  AmkQRow sr1{}, sr2{}, zr1{}, zr2{};
  if (Q) {
    sr1 = amk_qrow(w.sb, w.soff + r * w.sstride), zr1 = amk_qrow(w.zb, w.zoff + r * w.zstride);
    if (PAIR) sr2 = amk_qrow(w2.sb, w2.soff + r * w2.sstride), zr2 = amk_qrow(w2.zb, w2.zoff + r * w2.zstride);
  }
  float s1 = 0.0f, s2 = 0.0f;
#pragma unroll 1
  for (int v0 = sub; v0 < nvec; v0 += L * U) {
    amk_u32x4 raw1[U], raw2[U];
    unsigned sc1[U], sc2[U], z1[U], z2[U];  // raw bits
#pragma unroll
    for (int u = 0; u < U; ++u) {  // issue every load before the first use
      const int v = v0 + u * L;
      if (v < nvec) {
#if AMK_DIAG_Q_NO_W_LOADS  // trace diagnostic only (wrong results): the quantized codes not loaded
        if constexpr (Q) {
          raw1[u] = raw2[u] = amk_u32x4{(unsigned)v, (unsigned)r, (unsigned)u, (unsigned)sub};
        } else
#endif
        {
          raw1[u] = amk_ld16_weight(row1 + (amk_i64)v * 16);
          if (PAIR) raw2[u] = amk_ld16_weight(row2 + (amk_i64)v * 16);
        }
        if constexpr (Q) {
          const int g = grp(v);
#if AMK_DIAG_Q_NO_SCALE_LOADS  // trace diagnostic only (wrong results): no scale loads in the rows loop
          sc1[u] = sc2[u] = (unsigned)g & 0x3c00u;
#else
          sc1[u] = sr1.raw(g);
          if (PAIR) sc2[u] = sr2.raw(g);
#endif
          if constexpr (Z) {
            z1[u] = zr1.raw(g);
            if (PAIR) z2[u] = zr2.raw(g);
          } else if constexpr (ZI8) {
            // loaded with the codes (at its use instead, sm_90's 24 / 44 B spill goes but the 1B was
            // 5 % slower: eval/PERF_NOTES.md item 132); only even vectors use theirs (v's parity is
            // sub's, L being even)
            const bool use = (v & 1) == 0;
            z1[u] = use && zr1.p ? zr1.raw(g) : 0u;
            if (PAIR) z2[u] = use && zr2.p ? zr2.raw(g) : 0u;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * L;
      if (v < nvec) {  // (the words are rotated here, at their use: a use right after a load would wait for it)
        const float* xv = xs + v * xstride;
        const amk_u32x4 w1 = rot.words(raw1[u]), w2v = PAIR ? rot.words(raw2[u]) : w1;
        if constexpr (Q && AMK_DIAG_Q_NO_MATH) {  // trace diagnostic only (wrong results): one FFMA a vector
          s1 += __uint_as_float(w1.x ^ w1.y ^ w1.z ^ w1.w) * xv[0] * sr1.value(sc1[u]);
          if (PAIR) s2 += __uint_as_float(w2v.x ^ w2v.y ^ w2v.z ^ w2v.w) * xv[4] * sr2.value(sc2[u]);
        } else {
          const float xsum = Z ? xsums[v] : 0.0f;
          amk_gemv_vec_acc<DT>(s1, w1, xv, xsum, Q ? sr1.value(sc1[u]) : 0.0f, Z ? zr1.value(z1[u]) : 0.0f, rot);
          if (PAIR) amk_gemv_vec_acc<DT>(s2, w2v, xv, xsum, Q ? sr2.value(sc2[u]) : 0.0f, Z ? zr2.value(z2[u]) : 0.0f, rot);
          if constexpr (ZI8) {
            if ((v & 1) == 0) {  // (an empty zero row reads 0 bits: 0.0f in every float dtype)
              const float cx = xsums[v >> 1];
              s1 += zr1.value(z1[u]) * cx;
              if (PAIR) s2 += zr2.value(z2[u]) * cx;
            }
          }
        }
      }
    }
  }
  amk_gemv_row_tail_sum<DT, PAIR>(w, w2, xs, xp, r, valid, (K / F::VEC) * F::VEC, K, L, sub, s1, s2);
  a1 = s1;
  a2 = s2;
}

// Lanes per row: the fewest (a power of two, >= 4 so that a load instruction still covers
// whole 32-byte sectors) whose U loads each cover a row in one round.
template <int DT, bool PAIR>
AMK_DEVICE int amk_gemv_lanes(int K) {
  using F = AmkWFmt<DT>;
  constexpr int U = AmkGemvUnroll<DT, PAIR>::value;
  const int nvec = K / F::VEC;
  int L = AMK_WARP_SIZE;
  while (L > 4 && (L / 2) * U >= nvec) L >>= 1;
  return L;
}

// Scalar fallback for slabs that are not 16-byte aligned; whole warp.
template <bool PAIR>
AMK_DEVICE void amk_gemv_row_scalar(const AmkGemvW& w, const AmkGemvW& w2, const float* xs, AmkXPad xp, int r, int K,
                                    float& a1, float& a2) {
  float s1 = 0.0f, s2 = 0.0f;
  for (int col = amk_lane(); col < K; col += AMK_WARP_SIZE) {
    const float x = xs[xp.at(col)];
    s1 += amk_w_at(w, r, col) * x;
    if (PAIR) s2 += amk_w_at(w2, r, col) * x;
  }
  a1 = amk_warp_sum(s1);
  a2 = PAIR ? amk_warp_sum(s2) : 0.0f;
}

// AMK_GEMV_I8_MMA, AMK_GEMV_U4_MMA (off; eval/PERF_NOTES.md items 148-153): quantized rows on the
// tensor cores, to issue fewer instructions a weight byte than amk_gemv_row_vec (a PRMT, a FADD
// and an FFMA a code). Measured slower on the 1B (int8 +17.7 %, int4 +8.6 %): the rows wait on
// their loads, not on issue, and a lane here holds fewer bytes in flight, each load spanning 8
// rows (item 153). A warp takes 16 rows, a pass 4 vectors of them as mma.sync.m16n8k16 (f16 in,
// fp32 sums). Lane (g, t) loads vector t of the pass of rows g and g + 8; pairs of its codes
// are its A fragments, which fixes a permutation of the pass's columns, and the same columns of
// x make its B fragment. Every column of B is x, so every column of D is the dot: d[0] is row
// g's, d[2] row g + 8's. Codes become exact halves (1024 + code, less 1024; I8 biased by 128).
// x / 64 is split into hi + lo halves (22 of its 24 bits; |x| < 4.2e6), once a task in place
// (amk_gemv_split_x). A group's MMAs sum apart, then one FFMA by the row's scale (and its zero
// times the group's x sum).
#ifndef AMK_GEMV_I8_MMA
#define AMK_GEMV_I8_MMA 0
#endif
#ifndef AMK_GEMV_U4_MMA
#define AMK_GEMV_U4_MMA 0
#endif
#define AMK_GEMV_Q_MMA (AMK_GEMV_I8_MMA || AMK_GEMV_U4_MMA)
#if AMK_GEMV_Q_MMA && (defined(__HIPCC__) || defined(__HIPCC_RTC__))
#error "AMK_GEMV_I8_MMA / AMK_GEMV_U4_MMA need NVIDIA's mma.sync"
#endif
#if AMK_GEMV_Q_MMA
// passes of one matrix a batch of loads (a pass: 2 loads of 16 bytes a lane). More spill on sm_90:
// int8 4 (224 / 308 B), int4 2 (96 / 304 B, in the vector rows too).
#ifndef AMK_GEMV_I8_MMA_UNROLL
#define AMK_GEMV_I8_MMA_UNROLL 2
#endif
#ifndef AMK_GEMV_U4_MMA_UNROLL
#define AMK_GEMV_U4_MMA_UNROLL 1
#endif

// x is split as x / 64 (exact: a power of two), which keeps |x| < 4.2e6 inside the halves' range
// (65504 x 64) at the cost of the lo half's resolution near zero (absolute 2^-24 x 64 per column,
// far under the fp32 bound on a dot); the group sums are scaled back by 64.
constexpr float AMK_MMA_X_DOWN = 1.0f / 64.0f, AMK_MMA_X_UP = 64.0f;

// A format's codes as A fragments. MMA m of a pass takes, from its lane's 16-byte vector of a row,
// the half pair `lo` (logical columns 2t, 2t + 1) and `hi` (2t + 8, 2t + 9). A pair holds the codes
// of columns c and c + SPAN of a group of 2 SPAN columns; x is split with the same pairing.
template <int DT> struct AmkMmaFmt;
template <> struct AmkMmaFmt<AMK_DTYPE_I8> {  // word m: codes 0, 1 (lo) and 2, 3 (hi)
  static constexpr bool ON = AMK_GEMV_I8_MMA;
  static constexpr int MMAS = 4, SPAN = 1, UNROLL = AMK_GEMV_I8_MMA_UNROLL;
  static AMK_DEVICE void pairs(unsigned w, int, unsigned& lo, unsigned& hi) {
    const unsigned b = w ^ 0x80808080u;                                          // c + 128
    lo = amk_f16x2_sub(amk_byte_perm(b, 0x64646464u, 0x4140u), 0x64806480u);  // (1024 + c + 128) - 1152
    hi = amk_f16x2_sub(amk_byte_perm(b, 0x64646464u, 0x4342u), 0x64806480u);
  }
};
template <> struct AmkMmaFmt<AMK_DTYPE_U4> {  // word m / 2: nibbles (e, e + 4), e = 2 (m % 2) (lo) and e + 1 (hi)
  static constexpr bool ON = AMK_GEMV_U4_MMA;
  static constexpr int MMAS = 8, SPAN = 4, UNROLL = AMK_GEMV_U4_MMA_UNROLL;
  static AMK_DEVICE void pairs(unsigned w, int m, unsigned& lo, unsigned& hi) {
    const int e = 2 * (m & 1);
    lo = amk_f16x2_sub(amk_and_or(w >> (4 * e), 0x000F000Fu, 0x64006400u), 0x64006400u);  // (1024 + n) - 1024
    hi = amk_f16x2_sub(amk_and_or(w >> (4 * e + 4), 0x000F000Fu, 0x64006400u), 0x64006400u);
  }
};

template <int DT>
AMK_DEVICE bool amk_gemv_q_mma_ok(const AmkGemvW& w, const AmkGroupOf& grp, int K) {
  return w.sb != nullptr && (DT == AMK_DTYPE_U4 || w.zb == nullptr) && K % (4 * AmkWFmt<DT>::VEC) == 0 &&
         (grp.shift == 30 || (grp.shift >= 2 && (grp.v0 & 3) == 0));  // a pass inside one group
}

// Whether amk_gemv_rows takes the MMA rows for this task (block-uniform: the prologue splits x
// for them, amk_gemv_split_x).
template <int DT>
AMK_DEVICE bool amk_gemv_q_mma_takes_dt(const AmkGemvW& w, const AmkGemvW& w2, int K) {
  AmkGroupOf grp, grp2;
  return AmkMmaFmt<DT>::ON && AMK_WITH_GEMV_WDTYPE(DT) && w.wb->dtype == DT && amk_gemv_vec_ok<DT>(w, K, grp) &&
         amk_gemv_vec_ok<DT>(w2, K, grp2) && amk_gemv_q_mma_ok<DT>(w, grp, K) && amk_gemv_q_mma_ok<DT>(w2, grp2, K);
}
AMK_DEVICE bool amk_gemv_q_mma_takes(const AmkGemvW& w, const AmkGemvW& w2, int K) {
  return amk_gemv_q_mma_takes_dt<AMK_DTYPE_I8>(w, w2, K) || amk_gemv_q_mma_takes_dt<AMK_DTYPE_U4>(w, w2, K);
}

// (a, b) as hi + lo half pairs
AMK_DEVICE void amk_f16x2_split(float a, float b, unsigned& hi, unsigned& lo) {
  hi = amk_f16x2_rn(a, b);
  lo = amk_f16x2_rn(a - amk_f16_to_f32((unsigned short)hi), b - amk_f16_to_f32((unsigned short)(hi >> 16)));
}

// x's columns in place, paired as the format pairs its codes (c + e, c + e + SPAN in each group of
// 2 SPAN columns), as the words {hi, hi'} and {lo, lo'} at c + 2e, c + 2e + 1: the MMA rows' B
// fragments, one 16-byte shared load for two MMAs, split once a task instead of once a warp.
template <int SPAN>
AMK_DEVICE void amk_gemv_split_x(float* xs, AmkXPad xp, int K) {
  for (int c = 2 * SPAN * threadIdx.x; c < K; c += 2 * SPAN * blockDim.x) {  // a group never straddles the padding
    float* p = xs + xp.at(c);
    float v[2 * SPAN];
#pragma unroll
    for (int i = 0; i < 2 * SPAN; ++i) v[i] = p[i] * AMK_MMA_X_DOWN;
#pragma unroll
    for (int e = 0; e < SPAN; ++e) {
      unsigned hi, lo;
      amk_f16x2_split(v[e], v[e + SPAN], hi, lo);
      p[2 * e] = __uint_as_float(hi), p[2 * e + 1] = __uint_as_float(lo);
    }
  }
}

// How the MMA rows deal a task to the warps: tiles of 16 rows, each cut into `slices` ranges of
// passes, one (tile, slice) a warp. A task has fewer tiles than warps (1B: 1 to 4 of 8), and a
// warp that took a tile's whole K left the others idle: one warp streamed a 1B down task alone
// (+96 % int8 1B, session 45). With slices > 1 a warp takes one item at most (items <= warps),
// and the slices' sums meet in shared memory over x's words (slices x tiles x 16 x NM <= K).
struct AmkMmaDeal {
  int tiles, slices, passes;
  AMK_DEVICE int items() const { return tiles * slices; }
  AMK_DEVICE int pass_lo(int s) const { return (int)((long long)passes * s / slices); }
  AMK_DEVICE int slice_words(int nm) const { return tiles * 16 * nm; }  // one slice's scratch
};
AMK_DEVICE AmkMmaDeal amk_mma_deal(int rows, int K, int passes, int nm) {
  AmkMmaDeal d{(rows + 15) / 16, 1, passes};
  if (d.tiles < amk_nwarps()) {
    d.slices = min(amk_nwarps() / d.tiles, passes);
    while (d.slices > 1 && d.slices * d.slice_words(nm) > K) --d.slices;
  }
  return d;
}

template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_rows_q_mma(const AmkGemvW& w, const AmkGemvW& w2, const AmkGroupOf& grp, float* xs,
                                    AmkXPad xp, const float* xsums, float* acc, int rows, int K) {
  using M = AmkMmaFmt<DT>;
  constexpr int NM = PAIR ? 2 : 1, VEC = AmkWFmt<DT>::VEC;
  constexpr int U = M::UNROLL / NM > 0 ? M::UNROLL / NM : 1;  // passes a batch of loads
  constexpr int BYTES = 16;  // a lane's vector of a row, a pass
  const int lane = amk_lane(), g = lane >> 2, t = lane & 3, xstride = VEC + xp.pad;
  const AmkMmaDeal deal = amk_mma_deal(rows, K, K / (4 * VEC), NM);
  const AmkGemvW* ws[2] = {&w, &w2};
  float s[NM][2] = {};  // the rows' sums (of the warp's last item)
  int r[2] = {rows, rows}, sl = 0;
  const auto store = [&](float* out) {  // the sums of the rows inside the slab, by one lane a row pair
    if (t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r[h] < rows) {
          out[r[h] * NM] = s[0][h];
          if (PAIR) out[r[h] * NM + 1] = s[NM - 1][h];
        }
    }
  };
#pragma unroll 1
  for (int item = amk_warp(); item < deal.items(); item += amk_nwarps()) {  // warp-uniform: the MMA takes all 32 lanes
    sl = item / deal.tiles;
    const int r0 = 16 * (item % deal.tiles), p_lo = deal.pass_lo(sl), p_hi = deal.pass_lo(sl + 1);
    r[0] = r0 + g, r[1] = r0 + g + 8;
    const bool live[2] = {r[0] < rows, r[1] < rows};  // a row past the slab loads nothing (its sums are dropped)
    const char* row[NM][2];
    AmkQRow sc[NM][2], zr[NM][2];
#pragma unroll
    for (int i = 0; i < NM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = live[h] ? r[h] : r0;
        const AmkGemvW& wi = *ws[i];
        row[i][h] = (const char*)wi.wb->ptr + (wi.off + (amk_i64)rr * wi.stride) * AmkWFmt<DT>::BITS / 8 + BYTES * t;
        sc[i][h] = amk_qrow(wi.sb, wi.soff + (amk_i64)rr * wi.sstride);
        zr[i][h] = amk_qrow(wi.zb, wi.zoff + (amk_i64)rr * wi.zstride);
        s[i][h] = 0.0f;
      }
    float d[NM][2][4] = {};  // the hi and lo MMAs sum apart: two dependent chains, not one
    float gx = 0.0f;         // the group's x sum so far (for the zeros)
    auto add_group = [&](int gi) {  // the group's sums (its part in this slice), scaled (and its zero's term), into s
#pragma unroll
      for (int i = 0; i < NM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          s[i][h] += sc[i][h].value(sc[i][h].raw(gi)) * AMK_MMA_X_UP * (d[i][0][2 * h] + d[i][1][2 * h]);
          if (DT == AMK_DTYPE_U4 && zr[i][h].p) s[i][h] += zr[i][h].value(zr[i][h].raw(gi)) * gx;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) d[i][0][e] = d[i][1][e] = 0.0f;
      }
      gx = 0.0f;
    };
    int gcur = grp(4 * p_lo);
#pragma unroll 1
    for (int p0 = p_lo; p0 < p_hi; p0 += U) {
      amk_u32x4 q[U][NM][2];
#pragma unroll
      for (int u = 0; u < U; ++u)  // every load of the batch before the first use
        if (p0 + u < p_hi) {
#pragma unroll
          for (int i = 0; i < NM; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              q[u][i][h] = live[h] ? amk_ld16_weight(row[i][h] + (amk_i64)(p0 + u) * 4 * BYTES) : amk_u32x4{};
        }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u;
        if (p >= p_hi) break;
        const int gp = grp(4 * p);
        if (gp != gcur) {  // (warp-uniform)
          add_group(gcur);
          gcur = gp;
        }
        if (DT == AMK_DTYPE_U4)  // a U4 vector is one chunk of xsums
          gx += (xsums[4 * p] + xsums[4 * p + 1]) + (xsums[4 * p + 2] + xsums[4 * p + 3]);
        const float4* xv = (const float4*)(xs + (4 * p + t) * xstride);  // split by amk_gemv_split_x
#pragma unroll
        for (int m = 0; m < M::MMAS; ++m) {
          const float4 xw = xv[m];
          const unsigned bh[2] = {(unsigned)__float_as_int(xw.x), (unsigned)__float_as_int(xw.z)},
                         bl[2] = {(unsigned)__float_as_int(xw.y), (unsigned)__float_as_int(xw.w)};
          const int word = m * 4 / M::MMAS;
#pragma unroll
          for (int i = 0; i < NM; ++i) {
            unsigned a[4];
            M::pairs(amk_word(q[u][i][0], word), m, a[0], a[2]);
            M::pairs(amk_word(q[u][i][1], word), m, a[1], a[3]);
            amk_mma_16816_f16(d[i][0], a, bh);
            amk_mma_16816_f16(d[i][1], a, bl);
          }
        }
      }
    }
    add_group(gcur);
    if (deal.slices == 1) store(acc);
  }
  if (deal.slices > 1) {  // block-uniform: each slice's sums over x's words, then their sum in slice order
    amk_syncthreads();     // every warp is done with x
    store(xs + sl * deal.slice_words(NM));
    amk_syncthreads();
    for (int e = threadIdx.x; e < rows * NM; e += blockDim.x) {
      float v = xs[e];
      for (int k = 1; k < deal.slices; ++k) v += xs[k * deal.slice_words(NM) + e];
      acc[e] = v;
    }
  }
}
#endif

// xsums[v] = the sum of xs over columns 32v..32v+31, for each whole chunk v < K / 32. A lane
// adds 8 columns (two 16-byte loads: x's padding, if any, comes after 16 or 32 columns, so the
// 8 are contiguous and aligned) and 4 lanes a chunk by two shuffles: a warp takes 8 chunks at
// once (a 32-lane warp; 16 on a 64-lane one). Before, a warp took one chunk at a time, each by a
// five-shuffle reduction: 32 such rounds a warp for the 8192 columns of a 1B down task (int4 1B
// 1468.7 -> 1395.3 us, -5.0 %, paired; eval/PERF_NOTES.md item 133).
AMK_DEVICE void amk_gemv_xsums(const float* xs, AmkXPad xp, float* xsums, int K) {
  constexpr int per_lane = 8, lanes = AMK_XSUM_CHUNK / per_lane;
  const int chunks = K / AMK_XSUM_CHUNK, span = AMK_WARP_SIZE / lanes;  // chunks a warp takes at once
  for (int c0 = amk_warp() * span; c0 < chunks; c0 += amk_nwarps() * span) {  // warp-uniform
    const int v = c0 + amk_lane() / lanes;
    float sum = 0.0f;
    if (v < chunks) {
      const float4* p = (const float4*)(xs + xp.at(v * AMK_XSUM_CHUNK + (amk_lane() % lanes) * per_lane));
      sum = amk_sum8(p[0], p[1]);
    }
    for (int m = lanes / 2; m > 0; m >>= 1) sum += amk_shfl_xor(sum, m);
    if (v < chunks && amk_lane() % lanes == 0) xsums[v] = sum;
  }
}

#define AMK_GEMV_XQ (AMK_GEMV_I8_XQ || AMK_GEMV_U4_XQ)
// Whether this build dots DT's rows against packed x (vec.cuh AMK_GEMV_I8_XQ, AMK_GEMV_U4_XQ).
template <int DT>
constexpr bool amk_xq_on = (DT == AMK_DTYPE_I8 && AMK_GEMV_I8_XQ) || (DT == AMK_DTYPE_U4 && AMK_GEMV_U4_XQ);
constexpr AMK_DEVICE int amk_log2_const(int v) { return v > 1 ? 1 + amk_log2_const(v >> 1) : 0; }
// x can be packed for DT: every column in whole vectors (no tail reads x as floats), each slice in a
// padded slot of VEC + 4 floats (the loader pads quantized x by the vector, gemv_x_pad_shift;
// AmkXqFmt::WORDS fit).
template <int DT>
AMK_DEVICE bool amk_gemv_xq_fits(int K, AmkXPad xp) {
  constexpr int VEC = AmkWFmt<DT>::VEC, LG = amk_log2_const(VEC);
  return K % VEC == 0 && xp.shift == LG;
}
// AMK_GEMV_XQ_XSUMS (1 = on, the default; eval/PERF_NOTES.md item 239): where int4 rows pack x
// (AMK_GEMV_U4_XQ), the pack also writes x's chunk sums (a slice is one chunk), the same bits, so
// the prologue's own pass over x and its barrier go: the sums are taken under the first loads with
// the rest of the pack. (Only the vector rows read the sums: the scalar rows add each code's zero.)
// On an H200 the int4 1B gained 1.28 %; 0 keeps the prologue's pass, for the A/B.
#ifndef AMK_GEMV_XQ_XSUMS
#define AMK_GEMV_XQ_XSUMS 1
#endif
// Whether DT's rows take x's chunk sums themselves (AMK_GEMV_XQ_XSUMS), not the prologue.
template <int DT>
constexpr bool amk_gemv_rows_sum_x = DT == AMK_DTYPE_U4 && amk_xq_on<DT> && AMK_GEMV_XQ_XSUMS;
static_assert(AmkXqFmt<AMK_DTYPE_U4>::COLS == AMK_XSUM_CHUNK, "an int4 slice is one chunk of x's sums");
// Does w carry a zero whose term the vector rows add from x's chunk sums (U4, and I8 with a zero in
// AMK_GEMV_I8_ZERO builds) that the rows' pack does not take (amk_gemv_rows_sum_x)? The prologue then
// sums x over each 32-column chunk (amk_gemv_xsums).
AMK_DEVICE bool amk_gemv_needs_xsums(const AmkGemvW& w) {
  return (w.wb->dtype == AMK_DTYPE_U4 && !amk_gemv_rows_sum_x<AMK_DTYPE_U4>) ||
         (AMK_GEMV_I8_ZERO && w.zb != nullptr && w.wb->dtype == AMK_DTYPE_I8);
}
// x in place as fixed point, a vector's slice a thread at a time (vec.cuh amk_xq_pack). The rows
// call it themselves (amk_gemv_rows: those that take the vector path, so the test is the rows'
// own), the loads-ahead loop after a lane's first round of weight loads is issued, so the pass
// runs under their latency (eval/PERF_NOTES.md item 237: packing before the rows, as items 235 and
// 236 measured, cost the int8 1B +1.3 % and the int4 1B +0.9 % on the H200). Sharing a slice among
// 2 or 4 lanes, so that more of the block packs, lost (item 238).
template <int DT>
AMK_DEVICE void amk_gemv_xq_pack_x(float* xs, AmkXPad xp, float* xsums, int K) {
  constexpr int VEC = AmkWFmt<DT>::VEC;
  for (int v = threadIdx.x; v < K / VEC; v += blockDim.x)
    amk_xq_pack<DT, amk_gemv_rows_sum_x<DT>>(xs + v * (VEC + xp.pad), xsums + v);
}
#if AMK_GEMV_XQ
static_assert(AMK_GEMV_XPAD && !AMK_GEMV_Q_MMA, "AMK_GEMV_*_XQ read x padded and unrotated, and not with the MMA rows");
#endif

// AMK_GEMV_LOADS_AHEAD (0 = off): a warp issues its next round's loads (of the row, or of its
// next row; quantized: with their scales and zeros) as soon as this round's sums are done,
// before the row's tail, reduction and store, so those run under the loads' latency instead of
// ahead of them. A 1B row of K = 2048 is one round, so every row's reduction (5 dependent
// shuffles) and store leave the HBM idle for that warp in the plain loop. Unlike item 166's
// rolled refills (each vector's own register refilled at once), no load is issued between two
// uses of the loaded registers, so ptxas's one dependency barrier for the weight loads still
// costs one wait a round (`compile_check --load-waits`, eval/PERF_NOTES.md item 168). The sums
// are the plain loop's, in its order: bit-identical results. On an H200 (items 170, 173-177):
// the 1B -1.36 %, the 8B -1.38 %, the int8 1B -1.35 %, the int4 1B -1.28 % (spilling 24 B on
// sm_90); the SmolLM2 shape +3.0 %, +0.4 to +0.6 % once the first loads no longer waited for the
// loop bounds (taking this loop only for tasks of several rows a lane group, or branching around
// the last step's empty issue, lost or gained nothing and was removed). Asymmetric int8 keeps the
// plain loop, and the AMK_DIAG_Q_* trace diagnostics apply to the plain loop only. (A struct
// holding a round's loads for both loops spilled at sm_90's 254 registers even in the plain
// loop, so the loops share only the vector dot, amk_gemv_vec_acc.) Its default (0) is in common.cuh.

// pack_x: pack x for DT's integer dots (amk_xq_on) once the first loads are out
template <int DT, bool PAIR>
AMK_DEVICE void amk_gemv_rows_ahead(const AmkGemvW& w, const AmkGemvW& w2, const AmkGroupOf& grp, float* xs,
                                    AmkXPad xp, float* xsums, float* acc, int rows, int K, bool pack_x) {
  using F = AmkWFmt<DT>;
  constexpr bool Q = amk_quant_w<DT>, Z = DT == AMK_DTYPE_U4;
  constexpr int U = AmkGemvUnroll<DT, PAIR>::value, m = PAIR ? 2 : 1;
  // L is a power of two: a lane's row and place in it are a shift and a mask, where a division by
  // a value known only at run time is ~20 instructions ahead of the first weight load
  const int L = amk_gemv_lanes<DT, PAIR>(K), lg = amk_log2_pow2(L), per_warp = AMK_WARP_SIZE >> lg;
  const int sub = amk_lane() & (L - 1);
  const int nvec = K / F::VEC, xstride = F::VEC + xp.pad;
  const int first = amk_warp() * per_warp, step = amk_nwarps() * per_warp;
  const auto rot = AmkXRot<F::VEC / 4>::of(sub);
  const auto row_of = [&](const AmkGemvW& ww, int r) {
    return (const char*)ww.wb->ptr + (ww.off + (amk_i64)r * ww.stride) * F::BITS / 8;
  };
  amk_u32x4 raw1[U], raw2[U];
  unsigned sc1[U], sc2[U], z1[U], z2[U];  // quantized: the vectors' scales and zeros, raw bits
  const auto issue = [&](const char* p1, const char* p2, int r, bool ok, int j) {  // round j's loads of row r
    AmkQRow sr1{}, sr2{}, zr1{}, zr2{};
    if (Q) {
      sr1 = amk_qrow(w.sb, w.soff + r * w.sstride), zr1 = amk_qrow(w.zb, w.zoff + r * w.zstride);
      if (PAIR) sr2 = amk_qrow(w2.sb, w2.soff + r * w2.sstride), zr2 = amk_qrow(w2.zb, w2.zoff + r * w2.zstride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = sub + (j * U + u) * L;
      if (ok && v < nvec) {
        raw1[u] = amk_ld16_weight(p1 + (amk_i64)v * 16);
        if (PAIR) raw2[u] = amk_ld16_weight(p2 + (amk_i64)v * 16);
        if constexpr (Q) {
          const int g = grp(v);
          sc1[u] = sr1.raw(g);
          if (PAIR) sc2[u] = sr2.raw(g);
          if constexpr (Z) {
            z1[u] = zr1.raw(g);
            if (PAIR) z2[u] = zr2.raw(g);
          }
        }
      }
    }
  };
  AmkQRow qd1{}, qd2{}, zd1{}, zd2{};  // the scale and zero dtypes (rows of one matrix share them)
  if (Q) {
    qd1 = amk_qrow(w.sb, 0), zd1 = amk_qrow(w.zb, 0);
    if (PAIR) qd2 = amk_qrow(w2.sb, 0), zd2 = amk_qrow(w2.zb, 0);
  }
  int r = first + (amk_lane() >> lg), j = 0;  // this lane group's row and round at the current step
  const char* p1 = row_of(w, r);
  const char* p2 = PAIR ? row_of(w2, r) : nullptr;
  issue(p1, p2, r, r < rows, 0);
  if constexpr (amk_xq_on<DT>) {
    if (pack_x) {  // (block-uniform) under the first loads' latency
      amk_gemv_xq_pack_x<DT>(xs, xp, xsums, K);
      amk_syncthreads();
    }
  }
  // the loop's bounds after the first loads are out (r < rows implies steps > 0), so that their
  // divisions run under the loads' latency (ahead of them, they cost a task of one row a lane
  // group the time its first round waits for)
  const int R = nvec > L * U ? (nvec + L * U - 1) / (L * U) : 1;  // rounds a row (warp-uniform)
  const int steps = first < rows ? (rows - first + step - 1) / step * R : 0;  // this warp's rounds, all rows
  float s1 = 0.0f, s2 = 0.0f;
#pragma unroll 1
  for (int s = 0; s < steps; ++s) {
    const bool ok = r < rows, row_end = j + 1 == R;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = sub + (j * U + u) * L;
      if (ok && v < nvec) {
        const float* xv = xs + v * xstride;
        const amk_u32x4 w1 = rot.words(raw1[u]), w2v = PAIR ? rot.words(raw2[u]) : w1;
        const float xsum = Z ? xsums[v] : 0.0f;
        amk_gemv_vec_acc<DT>(s1, w1, xv, xsum, Q ? qd1.value(sc1[u]) : 0.0f, Z ? zd1.value(z1[u]) : 0.0f, rot);
        if (PAIR) amk_gemv_vec_acc<DT>(s2, w2v, xv, xsum, Q ? qd2.value(sc2[u]) : 0.0f, Z ? zd2.value(z2[u]) : 0.0f, rot);
      }
    }
    const int rn = row_end ? r + step : r, jn = row_end ? 0 : j + 1;  // the next step's
    const char* n1 = row_end ? row_of(w, rn) : p1;
    const char* n2 = PAIR ? (row_end ? row_of(w2, rn) : p2) : nullptr;
    issue(n1, n2, rn, s + 1 < steps && rn < rows, jn);
    if (row_end) {  // the row's tail, reduction and store, under the next round's loads
      amk_gemv_row_tail_sum<DT, PAIR>(w, w2, xs, xp, r, ok, nvec * F::VEC, K, L, sub, s1, s2);
      if (sub == 0 && ok) {
        acc[r * m] = s1;
        if (PAIR) acc[r * m + 1] = s2;
      }
      s1 = s2 = 0.0f;
    }
    r = rn, j = jn, p1 = n1, p2 = n2;
  }
}

// AMK_GEMV_ONLY_VEC (0 = off; the loader sets it where every GEMV task streams vectors,
// loader._only_vec_define): the scalar rows (unaligned slabs, odd groups), which such a program
// never runs, left out of the build (the plain vector loop of a loads-ahead build is then dead
// code too: a vector row takes the loads-ahead one). A GEMV that would need them reports
// "unsupported dtype" (amk_gemv_rows returns false). On an H200 (eval/PERF_NOTES.md items 203,
// 206): the SmolLM2 shape -0.82 %, the 1B -0.40 %, as item 198's never-taken attention branches.
#ifndef AMK_GEMV_ONLY_VEC
#define AMK_GEMV_ONLY_VEC 0
#endif

// AMK_GEMV_AHEAD_MULTI (experiment, 0 = off; eval/PERF_NOTES.md item 208): in a build of the plain
// loop, the loads-ahead loop for tasks whose lane groups take more than N rows each (the
// SmolLM2 shape's LM head: ~370 rows a task, 1.8 TB/s in the plain loop, where the 1B's streams
// 3.75 in the loads-ahead one; its layers' tasks take one row a lane group and keep the plain
// loop, which beats the loads-ahead one there: item 170). Item 171 tried the same choice and
// lost 3.6 %, with a run-time division (32 / L) ahead of every task's first loads; here it is
// a multiplication by a shift of the warp size. Both loops' sums are in the same order: the
// results are bit for bit the plain loop's.
#ifndef AMK_GEMV_AHEAD_MULTI
#define AMK_GEMV_AHEAD_MULTI 0
#endif


// Rows [0, rows) of the task into acc; false where this build left their path out.
// pack_x: pack x for DT's integer dots where the rows take them (amk_xq_on; false on a second pass
// over x already packed)
template <int DT, bool PAIR>
AMK_DEVICE bool amk_gemv_rows(const AmkGemvW& w, const AmkGemvW& w2, float* xs, AmkXPad xp, float* xsums,
                              float* acc, int rows, int K, bool pack_x) {
  AmkGroupOf grp, grp2;  // w2 has the same group and k_lo, so the same mapping
  const bool vec = amk_gemv_vec_ok<DT>(w, K, grp) && (!PAIR || amk_gemv_vec_ok<DT>(w2, K, grp2)) &&
                   (!amk_xq_on<DT> || amk_gemv_xq_fits<DT>(K, xp));  // (else x stays float: the scalar rows)
  constexpr int m = PAIR ? 2 : 1;
  if constexpr (amk_gemv_no_tail<DT>) {
    if (vec && K % AmkWFmt<DT>::VEC != 0) return false;  // a tail past the whole vectors: left out
  }
#if AMK_GEMV_Q_MMA
  if constexpr (amk_quant_w<DT>) {
    if (amk_gemv_q_mma_takes_dt<DT>(w, w2, K)) {
      amk_gemv_rows_q_mma<DT, PAIR>(w, w2, grp, xs, xp, xsums, acc, rows, K);
      return true;
    }
  }
#endif
  constexpr bool ahead_loop = !(AMK_GEMV_I8_ZERO && DT == AMK_DTYPE_I8);  // (asymmetric int8 has none)
  if constexpr (AMK_GEMV_LOADS_AHEAD && ahead_loop) {
    if (vec) {
      amk_gemv_rows_ahead<DT, PAIR>(w, w2, grp, xs, xp, xsums, acc, rows, K, pack_x);
      return true;
    }
  }
#if AMK_GEMV_AHEAD_MULTI
  if constexpr (!AMK_GEMV_LOADS_AHEAD && ahead_loop) {
    // rows a step of all the block's lane groups: warps x (warp size / lanes a row)
    if (vec && rows > AMK_GEMV_AHEAD_MULTI * (amk_nwarps() * (AMK_WARP_SIZE >> amk_log2_pow2(amk_gemv_lanes<DT, PAIR>(K))))) {
      amk_gemv_rows_ahead<DT, PAIR>(w, w2, grp, xs, xp, xsums, acc, rows, K, pack_x);
      return true;
    }
  }
#endif
  if (vec) {
    if constexpr (amk_xq_on<DT>) {
      if (pack_x) {  // (block-uniform; this loop issues no loads ahead)
        amk_gemv_xq_pack_x<DT>(xs, xp, xsums, K);
        amk_syncthreads();
      }
    }
    const int L = amk_gemv_lanes<DT, PAIR>(K), lg = amk_log2_pow2(L), per_warp = AMK_WARP_SIZE >> lg;
    const int sub = amk_lane() & (L - 1);  // (shifts and masks: no division ahead of the first loads)
#pragma unroll 1
    for (int r0 = amk_warp() * per_warp; r0 < rows; r0 += amk_nwarps() * per_warp) {  // warp-uniform
      const int r = r0 + (amk_lane() >> lg);
      float a1, a2;
      amk_gemv_row_vec<DT, PAIR>(w, w2, grp, xs, xp, xsums, r, r < rows, K, L, sub, a1, a2);
      if (sub == 0 && r < rows) {
        acc[r * m] = a1;
        if (PAIR) acc[r * m + 1] = a2;
      }
    }
    return true;
  }
#if AMK_GEMV_ONLY_VEC
  return false;
#else
#pragma unroll 1
  for (int r = amk_warp(); r < rows; r += amk_nwarps()) {
    float a1, a2;
    amk_gemv_row_scalar<PAIR>(w, w2, xs, xp, r, K, a1, a2);
    if (amk_lane() == 0) {
      acc[r * m] = a1;
      if (PAIR) acc[r * m + 1] = a2;
    }
  }
  return true;
#endif
}

// The rows for weight dtype DT, if this build compiles it (AMK_GEMV_WDTYPES) and their path (AMK_GEMV_ONLY_VEC);
// false if not.
template <int DT, bool PAIR>
AMK_DEVICE bool amk_gemv_rows_if(const AmkGemvW& w, const AmkGemvW& w2, float* xs, AmkXPad xp,
                                 float* xsums, float* acc, int rows, int K, bool pack_x) {
  if constexpr (AMK_WITH_GEMV_WDTYPE(DT)) {
    return amk_gemv_rows<DT, PAIR>(w, w2, xs, xp, xsums, acc, rows, K, pack_x);
  } else {
    return false;
  }
}

template <bool PAIR>
AMK_DEVICE bool amk_gemv_dispatch(const AmkGemvW& w, const AmkGemvW& w2, float* xs, AmkXPad xp,
                                  float* xsums, float* acc, int rows, int K, bool pack_x) {
  switch (w.wb->dtype) {
    case AMK_DTYPE_F32: return amk_gemv_rows_if<AMK_DTYPE_F32, PAIR>(w, w2, xs, xp, xsums, acc, rows, K, pack_x);
    case AMK_DTYPE_BF16: return amk_gemv_rows_if<AMK_DTYPE_BF16, PAIR>(w, w2, xs, xp, xsums, acc, rows, K, pack_x);
    case AMK_DTYPE_F16: return amk_gemv_rows_if<AMK_DTYPE_F16, PAIR>(w, w2, xs, xp, xsums, acc, rows, K, pack_x);
    case AMK_DTYPE_I8: return amk_gemv_rows_if<AMK_DTYPE_I8, PAIR>(w, w2, xs, xp, xsums, acc, rows, K, pack_x);
    case AMK_DTYPE_U4: return amk_gemv_rows_if<AMK_DTYPE_U4, PAIR>(w, w2, xs, xp, xsums, acc, rows, K, pack_x);
    default: return false;
  }
}

// AMK_GEMV_NORM_ONE_BARRIER: the RMSNorm prologue of a whole row with one barrier before its
// apply pass instead of three. Each thread sums the squares of the x elements it loads, and the
// barrier that publishes x also publishes the warps' sums (no pass over shared memory, no
// separate block reduction). On since measured (eval/PERF_NOTES.md item 121: 1B -0.2 %, 8B
// -0.3 %); 0 keeps the old order of the sum of squares, for comparison.
#ifndef AMK_GEMV_NORM_ONE_BARRIER
#define AMK_GEMV_NORM_ONE_BARRIER 1
#endif

// The combine prologue: x is the attention output of every KV head, combined from the partials
// (combine.cuh) and rounded to y's dtype, where the standalone combine would have stored it.
// cw: the combine's shared memory (amk_combine_smem_words).
AMK_DEVICE void amk_gemv_combine_x(const AmkCtx& c, AmkCombineShape cs, float* xs, AmkXPad xp, float* cw) {
  const AmkOperand &po = amk_in(c, AMK_ROLE_O), &ml = amk_in(c, AMK_ROLE_ML);
  const AmkBuffer& pb = amk_buf(c, po);
  float *ls = cw + cs.pairs(), *den = ls + cs.pairs();
  amk_combine_stage_ml(amk_buf(c, ml), ml, cs, cw, ls);
  amk_syncthreads();
  amk_combine_weights(cs, cw, ls, den);
  amk_syncthreads();
  const int ydt = amk_buf(c, c.t->out[0]).dtype;
  const auto out = amk_combine_outputs(pb.ptr, po, cw, den, cs, [&](int i, float v) { xs[xp.at(i)] = amk_round(ydt, v); });
  if (!amk_float_dispatch(pb.dtype, out) && threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, pb.dtype);
}

// The setup before wait() reads the task record and buffer descriptors only.
template <class Wait>
AMK_DEVICE void amk_op_gemv(const AmkCtx& c, const Wait& wait) {
  const AmkTask& t = *c.t;
  const int rows = t.ip[AMK_P_ROWS], k_lo = t.ip[AMK_P_K_LO], K = t.ip[AMK_P_K_HI] - k_lo;
  const int m = amk_row_width(t);
  const AmkXPad xp = amk_xpad_of(t);
  float* xs = amk_smem(c, amk_smem_gemv(t));
  if (!xs) {  // (reported)
    wait();
    return;
  }
  float* acc = xs + amk_xs_words(K, xp);
  float* red = acc + amk_round4((long long)rows * m);

  // prologue: stage x (or its RMSNorm, or the attention combine) as fp32, every load of a thread
  // in flight at once
  const AmkCombineShape cs = amk_gemv_combine(t);
  const AmkOperand& x = amk_in(c, cs.splits > 0 ? AMK_ROLE_O : AMK_ROLE_X);  // (a combine reads no x)
  const AmkBuffer& xb = amk_buf(c, x);
  const bool norm = t.ip[AMK_P_HAS_NORM] != 0;  // x is then the whole row (for its RMS), else the K slice
  float* xsums = red + AMK_WARP_SIZE;
  float* gs = xsums + amk_round4(K / AMK_XSUM_CHUNK);
  float* epi = gs + (norm ? amk_round4(K) : 0);
  // the epilogue's operands, loaded now into a register a thread (word i by thread i) so that
  // their round trip overlaps x's; stored to shared memory after it
  const AmkEpiStage es = amk_gemv_epi_stage(t);
  if (!wait()) return;  // (amk_dispatch passes a no-op where it waited already)
  if ((!AMK_GEMV_COMBINE && t.ip[AMK_P_COMBINE_SPLITS] > 0) ||  // a build without the combine prologue
      (!AMK_GEMV_PARTIALS && (amk_has(c, AMK_ROLE_X_PART) || amk_has(c, AMK_ROLE_RES_PART)))) {  // or the partials
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_BAD_OP, t.op);
    return;
  }
  if (AMK_DIAG_PROLOGUE == 1) amk_trace_mark(c, 0);  // the op's entry
  for (int pass = 0; pass < (AMK_DIAG_PROLOGUE == 2 ? 2 : 1); ++pass) {  // (one pass but in the diagnostic)
    if (pass == 1) {  // the same again, warm
      amk_syncthreads();
      amk_trace_mark(c, 0);
    }
    const float ev = (int)threadIdx.x < es.words() ? amk_epi_stage_word(c, es, threadIdx.x) : 0.0f;
    if (norm) {
      // x and the norm weights staged at once, by the two halves of the block: one memory
      // round trip where loading the weights after the sum of squares took a second one
      const AmkOperand& g = amk_in(c, AMK_ROLE_GAMMA);
      const int half = blockDim.x / 2;
      float ss = 0.0f;  // AMK_GEMV_NORM_ONE_BARRIER: the squares of the x elements this thread stages
      const auto stage_x = [&](int i, float v) {
        xs[xp.at(i)] = v;
        if (AMK_GEMV_NORM_ONE_BARRIER) ss += v * v;
      };
      if ((int)threadIdx.x < half) {
        if (AMK_GEMV_PARTIALS && amk_has(c, AMK_ROLE_X_PART)) {  // x as the REDUCE it replaces would have left it
          const AmkOperand& xp_op = amk_in(c, AMK_ROLE_X_PART);
          amk_for_elems_plus_partials(xb, x, amk_buf(c, xp_op), xp_op, k_lo, K, stage_x, threadIdx.x, half);
        } else {
          amk_for_elems(xb, x, k_lo, K, stage_x, threadIdx.x, half);
        }
      } else amk_for_elems(amk_buf(c, g), g, k_lo, K, [&](int i, float v) { gs[i] = v; }, threadIdx.x - half, blockDim.x - half);
      const int hidden = t.ip[AMK_P_K];
      const float eps = t.fp[AMK_F_NORM_EPS];
      float inv;
      if (k_lo == 0 && K == hidden) {  // the whole row is staged
        if (!AMK_GEMV_NORM_ONE_BARRIER) {  // its squares come from shared memory
          amk_syncthreads();
          for (int i = threadIdx.x; i < K; i += blockDim.x) ss += xs[xp.at(i)] * xs[xp.at(i)];
        }  // else they were summed as x was loaded, and the block sum's one barrier publishes x too
        inv = amk_inv_rms(amk_block_sum(ss, red, AMK_GEMV_NORM_ONE_BARRIER), hidden, eps);
      } else {
        inv = amk_block_inv_rms(c, x, hidden, eps, red);  // its barriers also publish xs and gs
      }
      if (AMK_DIAG_PROLOGUE == 1) amk_trace_mark(c, 1);  // x staged, its RMS known
      for (int i = threadIdx.x; i < K; i += blockDim.x) xs[xp.at(i)] = amk_rms_apply(xs[xp.at(i)], inv, gs[i], xb.dtype);
    } else if (AMK_GEMV_COMBINE && cs.splits > 0) {
      amk_gemv_combine_x(c, cs, xs, xp, epi + amk_round4(es.words()));
    } else {
      amk_for_elems(xb, x, 0, K, [&](int i, float v) { xs[xp.at(i)] = v; });
      if (AMK_DIAG_PROLOGUE == 1) amk_trace_mark(c, 1);  // x staged
    }
    if ((int)threadIdx.x < es.words()) epi[threadIdx.x] = ev;
    for (int i = threadIdx.x + blockDim.x; i < es.words(); i += blockDim.x) epi[i] = amk_epi_stage_word(c, es, i);
  }
  const AmkGemvW w = amk_gemv_w(c, AMK_ROLE_W, AMK_ROLE_W_SCALE, AMK_ROLE_W_ZERO);
  const AmkGemvW w2 = m == 2 ? amk_gemv_w(c, AMK_ROLE_W2, AMK_ROLE_W2_SCALE, AMK_ROLE_W2_ZERO) : w;
  amk_syncthreads();
  if (amk_gemv_needs_xsums(w)) {
    amk_gemv_xsums(xs, xp, xsums, K);
    amk_syncthreads();
  }
  amk_trace_mark(c, AMK_DIAG_PROLOGUE == 1 ? 2 : AMK_DIAG_PROLOGUE == 2 ? 1 : 0);  // prologue done

  if (!amk_gemv_w_ok(w) || !amk_gemv_w_ok(w2) || w2.wb->dtype != w.wb->dtype) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_SHAPE, w.wb->dtype, w2.wb->dtype);
    return;
  }
#if AMK_GEMV_Q_MMA
  if (amk_gemv_q_mma_takes(w, w2, K)) {  // (after the shape check; a trace counts it in the rows phase)
    if (w.wb->dtype == AMK_DTYPE_U4) amk_gemv_split_x<AmkMmaFmt<AMK_DTYPE_U4>::SPAN>(xs, xp, K);
    else amk_gemv_split_x<AmkMmaFmt<AMK_DTYPE_I8>::SPAN>(xs, xp, K);
    amk_syncthreads();
  }
#endif
  const auto rows_pass = [&](bool pack_x) {
    return m == 2 ? amk_gemv_dispatch<true>(w, w2, xs, xp, xsums, acc, rows, K, pack_x)
                  : amk_gemv_dispatch<false>(w, w, xs, xp, xsums, acc, rows, K, pack_x);
  };
  bool ok = rows_pass(true);
#if AMK_DIAG_ROWS_TWICE
  amk_syncthreads();
  amk_trace_mark(c, 1);  // rows done from memory; the same again (acc rewritten with the same sums)
  ok = ok && rows_pass(false);  // (x is packed already where the rows packed it)
#endif
  if (!ok) {
    if (threadIdx.x == 0) amk_report(c, AMK_ERR_DTYPE, w.wb->dtype);
    return;
  }
  amk_syncthreads();
  if (AMK_DIAG_PROLOGUE == 0) amk_trace_mark(c, AMK_DIAG_ROWS_TWICE ? 2 : 1);  // rows done
  if (AMK_DIAG_PROLOGUE == 2) amk_trace_mark(c, 2);

  if (t.ip[AMK_P_SPLIT_K] > 1) {  // partial sums of this K slice; REDUCE runs the epilogue
    const AmkOperand& y = t.out[0];
    const AmkBuffer& yb = amk_buf(c, y);
    for (int e = threadIdx.x; e < rows * m; e += blockDim.x) amk_store(yb, amk_flat(y, e), acc[e]);
  } else {
    // (after the epilogue's operands and the combine's words, as amk_smem_gemv counts them)
    float* pair_red = amk_gemv_has_pair(t) ? epi + amk_round4(es.words()) +
                                                 (cs.splits > 0 ? amk_round4(amk_combine_smem_words(cs)) : 0)
                                           : nullptr;
    amk_epilogue(c, acc, rows, epi, pair_red);
#if AMK_DIAG_TWICE
    amk_syncthreads();
    amk_trace_mark(c, 2);  // cold epilogue done
    amk_epilogue(c, acc, rows, epi);
#endif
  }
}
