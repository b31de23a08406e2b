// Umbrella header: every op's device function, and the dispatch by op code.
#pragma once
#include "common.cuh"
#include "embed.cuh"
#include "rmsnorm.cuh"
#include "gemv.cuh"
#include "reduce.cuh"
#include "rope.cuh"
#include "head_norm.cuh"
#include "kv_append.cuh"
#include "attention.cuh"
#include "elementwise.cuh"
#include "argmax.cuh"

// An op this build leaves out (AMK_OPS, common.cuh) reports AMK_ERR_BAD_OP like an unknown one.
#define AMK_OP_CASE(op, fn)                \
  case op:                                 \
    if constexpr (AMK_WITH_OP(op)) {       \
      fn(c);                               \
      return;                              \
    }                                      \
    break;

// Run one task; all threads of the block; the task record is in shared memory. Every path calls
// wait() once, with every thread: it returns once the task's waits are met (false: give up, and
// do nothing more), and nothing that another task writes may be read before it. The GEMV calls
// it itself, after its setup from the record (which took 0.25 us after the wait: eval/
// PERF_NOTES.md item 156); the other ops wait first. (So two call sites, each inlining the wait.)
template <class Wait>
AMK_DEVICE void amk_dispatch(const AmkCtx& c, Wait& wait) {
  if constexpr (AMK_WITH_OP(AMK_OP_GEMV) && AMK_GEMV_SETUP_FIRST) {
    if (c.t->op == AMK_OP_GEMV) {
      amk_op_gemv(c, wait);
      return;
    }
  }
  if (!wait()) return;
  const auto waited = []() { return true; };
  switch (c.t->op) {
    AMK_OP_CASE(AMK_OP_EMBED, amk_op_embed)
    AMK_OP_CASE(AMK_OP_RMSNORM, amk_op_rmsnorm)
    case AMK_OP_GEMV:  // (after the one wait, where the setup does not come first: two wait sites
                       // spilled the every-dtype build even with nothing set up before the wait)
      if constexpr (AMK_WITH_OP(AMK_OP_GEMV) && !AMK_GEMV_SETUP_FIRST) {
        amk_op_gemv(c, waited);
        return;
      }
      break;
    AMK_OP_CASE(AMK_OP_REDUCE, amk_op_reduce)
    AMK_OP_CASE(AMK_OP_ROPE, amk_op_rope)
    AMK_OP_CASE(AMK_OP_KV_APPEND, amk_op_kv_append)
    AMK_OP_CASE(AMK_OP_ATTN_PARTIAL, amk_op_attn_partial)
    AMK_OP_CASE(AMK_OP_ATTN_COMBINE, amk_op_attn_combine)
    AMK_OP_CASE(AMK_OP_SILU_MUL, amk_op_silu_mul)
    AMK_OP_CASE(AMK_OP_ADD, amk_op_add)
    AMK_OP_CASE(AMK_OP_ARGMAX, amk_op_argmax)
    AMK_OP_CASE(AMK_OP_HEAD_NORM, amk_op_head_norm)
    default: break;
  }
  if (threadIdx.x == 0) amk_report(c, AMK_ERR_BAD_OP, c.t->op);
}
