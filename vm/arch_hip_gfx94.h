// XCD-scoped counter signal and wait for the chiplet CDNA parts (gfx940..gfx942 MI300,
// gfx950 MI350): eight XCDs, each with its own L2 shared by its CUs. Included by
// vm/arch_hip.h for those targets only.
//
// These are LLVM's agent-scope sequences for gfx94x (AMDGPUUsage, "Memory Model GFX942")
// without the L2 maintenance: a producer and a consumer on one XCD meet in that XCD's L2,
// so the release needs its stores there (the vector L1 is write-through: s_waitcnt
// vmcnt(0)) but no buffer_wbl2, and the acquire needs this CU's L1 invalidated
// (buffer_inv sc0) but not the L2 (buffer_inv sc1). The counter itself is a relaxed
// agent-scope atomic. Only valid when every producer and waiter of the counter runs on
// one XCD: the validator's `scope` check proves it before a program may run.
#pragma once

#define AMK_HAS_XCD_SCOPE 1

AMK_DEVICE unsigned amk_ld_acquire_xcd(const unsigned* p) {
  const unsigned v = __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
  asm volatile("s_waitcnt vmcnt(0)\n\tbuffer_inv sc0" ::: "memory");
  return v;
}

AMK_DEVICE void amk_release_add_xcd(unsigned* p, unsigned v) {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  asm volatile("s_waitcnt vmcnt(0)" ::: "memory");
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
