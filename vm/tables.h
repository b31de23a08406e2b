// AMK device tables: the packed form of a Program that the megakernel walks.
//
// Plain C++ (no CUDA keywords) so a host compiler can check the layout against the
// numpy dtypes that vm/loader.py packs (tests/test_vm_compile.py does exactly that).
// Every field is 4 or 8 bytes and 8-byte fields sit at 8-byte offsets: no implicit padding.
//
// Edit this file and `vm/loader.py` (TASK_DTYPE, ROLES, the _pack_* functions) together.
#pragma once

#include "abi.h"

typedef long long amk_i64;
typedef unsigned long long amk_u64;
typedef unsigned int amk_u32;

// ---------------------------------------------------------------- operands
// One Operand of ir.py, buffer id already resolved to an index into the buffer table.
// flat:  element i of [0, len*count) is buf[off + (i / len) * stride + i % len]
// kv:    APPEND: row `pos` columns [off, off+len); PREFIX: rows 0..pos, same columns.
struct AmkOperand {
  amk_i64 off;
  amk_i64 stride;
  int buf;
  int len;
  int count;
  int kv;  // AmkKvMode
};

// ---------------------------------------------------------------- waits
// Wait until counter >= (epoch - 1) * producers + threshold (wrap-safe compare).
// `producers` is how many tasks signal the counter per step, so counters never need a
// reset between steps: after step e every counter holds exactly e * producers.
// `scope` (AmkScope) is the counter's memory scope: the acquire's reach.
struct AmkWait {
  int counter;
  amk_u32 threshold;
  amk_u32 producers;
  int scope;
};

// ---------------------------------------------------------------- operand roles
// Where each named operand of opspec.input_roles() sits in AmkTask::in (-1: absent).
// The loader derives role -> slot from amk.schedule.opspec, so the device never re-derives
// which optional inputs a GEMV has. Names mirror opspec's role strings.
enum AmkRole {
  AMK_ROLE_W = 0,
  AMK_ROLE_X,
  AMK_ROLE_GAMMA,
  AMK_ROLE_W_SCALE,
  AMK_ROLE_W_ZERO,
  AMK_ROLE_W2,
  AMK_ROLE_W2_SCALE,
  AMK_ROLE_W2_ZERO,
  AMK_ROLE_BIAS,
  AMK_ROLE_RESIDUAL,
  AMK_ROLE_HEAD_GAMMA,
  AMK_ROLE_INV_FREQ,
  AMK_ROLE_POS,
  AMK_ROLE_TOKEN,
  AMK_ROLE_TABLE,
  AMK_ROLE_SRC,
  AMK_ROLE_Q,
  AMK_ROLE_K,
  AMK_ROLE_V,
  AMK_ROLE_O,
  AMK_ROLE_ML,
  AMK_ROLE_GATE,
  AMK_ROLE_UP,
  AMK_ROLE_A,
  AMK_ROLE_B,
  AMK_ROLE_LOGITS,
  AMK_ROLE_PARTIALS,
  AMK_ROLE_X_PART,
  AMK_ROLE_RES_PART,
  AMK_ROLE_COUNT
};
#define AMK_ROLE_SLOTS 32  // >= AMK_ROLE_COUNT, a multiple of 4

// ---------------------------------------------------------------- op params
// Flat int / float parameter arrays. Index names per op; GEMV and REDUCE share the
// epilogue block (P_ROWS .. P_HAS_HEAD_NORM, F_HEAD_NORM_EPS) so one epilogue serves both.
#define AMK_NIPARAM 16
#define AMK_NFPARAM 4

enum AmkParamIndex {
  // GEMV / REDUCE (shared epilogue block)
  AMK_P_ROWS = 0,
  AMK_P_EPILOGUE = 1,
  AMK_P_HAS_BIAS = 2,
  AMK_P_HEAD_DIM = 3,
  AMK_P_HAS_HEAD_NORM = 4,
  AMK_P_SPLIT_K = 5,
  AMK_P_K = 6,         // GEMV only
  AMK_P_K_LO = 7,      // GEMV only
  AMK_P_K_HI = 8,      // GEMV only
  AMK_P_HAS_NORM = 9,  // GEMV only
  AMK_P_UNPACK = 10,   // GEMV only (VM knob)
  AMK_P_X_PAD = 11,    // GEMV only: log2 of the columns between x's 4-float pads, 0: dense (loader.gemv_x_pad_shift)
  AMK_P_COMBINE_SPLITS = 12,    // GEMV only: > 0: x is the attention combine of the o/ml partials
  AMK_P_COMBINE_Q_HEADS = 13,   // GEMV only
  AMK_P_COMBINE_HEAD_DIM = 14,  // GEMV only
  AMK_P_ARGMAX_PAIR_BASE = 15,  // GEMV only: the argmax pair's index base (its second output), -1: none
  AMK_F_HEAD_NORM_EPS = 0,
  AMK_F_NORM_EPS = 1,
  // EMBED
  AMK_P_EMBED_VOCAB = 0,
  AMK_P_EMBED_HIDDEN = 1,
  // RMSNORM
  AMK_P_NORM_HIDDEN = 0,
  AMK_P_NORM_COL = 1,
  AMK_F_NORM_EPS_RMS = 0,
  // ROPE / HEAD_NORM
  AMK_P_HEADS_HEAD_DIM = 0,
  AMK_P_HEADS_HEADS = 1,
  AMK_F_HEADS_EPS = 0,
  // KV_APPEND, SILU_MUL, ADD, ARGMAX
  AMK_P_N = 0,
  AMK_P_ARGMAX_MODE = 1,  // ARGMAX only
  AMK_P_ARGMAX_BASE = 2,
  // ATTN_PARTIAL / ATTN_COMBINE
  AMK_P_ATTN_HEAD_DIM = 0,
  AMK_P_ATTN_Q_HEADS = 1,
  AMK_P_ATTN_SPLITS = 2,
  AMK_P_ATTN_SPLIT = 3,       // partial only
  AMK_P_ATTN_BLOCK = 4,       // partial only
  AMK_P_ATTN_SCORE_CAP = 5,   // partial only: scores kept in shared memory per head
  AMK_F_ATTN_SCALE = 0,
};

// ---------------------------------------------------------------- task record
struct AmkTask {
  int op;           // AmkOp
  int out_counter;  // counter index
  int n_in;
  int n_out;
  int n_wait;
  int id;           // Task.id, for error reports
  int prefetch_in;  // bitmask of input slots to prefetch before waiting (immutable only)
  int out_scope;    // AmkScope of out_counter: the release's reach
  AmkWait waits[AMK_MAX_WAITS];
  signed char role[AMK_ROLE_SLOTS];
  int ip[AMK_NIPARAM];
  float fp[AMK_NFPARAM];
  AmkOperand in[AMK_MAX_INPUTS];
  AmkOperand out[AMK_MAX_OUTPUTS];
};

// ---------------------------------------------------------------- buffer table
struct AmkBuffer {
  amk_u64 ptr;    // device address
  amk_i64 numel;  // logical elements
  amk_i64 width;  // last dimension (row width of a KV cache)
  amk_i64 rows;   // numel / width
  int dtype;      // AmkDType
  int kind;       // AmkBufferKind
  int group;      // quantization group (0 if none)
  int kv_head;    // a KV cache's layout: 0 rows of width; h > 0 head-major blocks [rows, h] (vm/kv_layout.py)
};

// The buffer descriptors of one task, by operand slot (in[0..n_in) then out[..]): the
// megakernel's shared-memory copy for the running task.
struct AmkTaskBuffers {
  AmkBuffer b[AMK_MAX_INPUTS + AMK_MAX_OUTPUTS];
};

// ---------------------------------------------------------------- status block
// A small device int32 array the kernel reports into; the host reads it after each step.
enum AmkStatusIndex {
  AMK_ST_CODE = 0,     // AmkError, first error wins (atomicCAS from 0)
  AMK_ST_TASK = 1,     // Task.id of the reporting task
  AMK_ST_BLOCK = 2,    // queue (block) index
  AMK_ST_DETAIL = 3,   // counter index / position / token ...
  AMK_ST_DETAIL2 = 4,  // observed counter value / limit ...
  AMK_ST_DETAIL3 = 5,  // expected counter value ...
  AMK_ST_WORDS = 8
};

enum AmkError {
  AMK_ERR_NONE = 0,
  AMK_ERR_SPIN_TIMEOUT = 1,  // a wait exceeded the device spin budget
  AMK_ERR_ABORTED = 2,       // the host watchdog raised the abort flag
  AMK_ERR_BAD_OP = 3,        // unknown op or epilogue code
  AMK_ERR_SMEM = 4,          // the task needs more shared memory than was launched
  AMK_ERR_POS_RANGE = 5,     // position outside the KV cache
  AMK_ERR_TOKEN_RANGE = 6,   // token id outside the embedding table
  AMK_ERR_DTYPE = 7,         // dtype the op cannot handle
  AMK_ERR_SHAPE = 8,         // params inconsistent with operands
};

#define AMK_OPERAND_BYTES 32
#define AMK_WAIT_BYTES 16
#define AMK_TASK_BYTES 592
#define AMK_BUFFER_BYTES 48

static_assert(sizeof(AmkOperand) == AMK_OPERAND_BYTES, "AmkOperand layout");
static_assert(sizeof(AmkWait) == AMK_WAIT_BYTES, "AmkWait layout");
static_assert(sizeof(AmkTask) == AMK_TASK_BYTES, "AmkTask layout");
static_assert(sizeof(AmkBuffer) == AMK_BUFFER_BYTES, "AmkBuffer layout");
