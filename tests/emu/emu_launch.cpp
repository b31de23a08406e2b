// Launch the emulated megakernel: nblocks x nthreads OS threads run amk_megakernel at once
// (all blocks co-resident, as a cooperative launch guarantees). Built by tests/emu_vm.py.
#include "megakernel.cu"

#include <memory>

extern "C" int amk_emu_launch(const AmkTask* tasks, const int* queue_start, const int* queue_tasks,
                              const AmkBuffer* bufs, unsigned* counters, int* status, const int* host_abort,
                              unsigned epoch, unsigned long long spin_timeout_ns, int smem_bytes, int prefetch_depth,
                              int nblocks, int nthreads) {
  std::vector<std::unique_ptr<AmkEmuBlock>> blocks;
  for (int b = 0; b < nblocks; ++b) blocks.emplace_back(new AmkEmuBlock(nthreads, smem_bytes));
  std::vector<std::thread> threads;
  threads.reserve((size_t)nblocks * nthreads);
  for (int b = 0; b < nblocks; ++b)
    for (int t = 0; t < nthreads; ++t)
      threads.emplace_back([=, &blocks] {
        threadIdx = {(unsigned)t, 0, 0};
        blockIdx = {(unsigned)b, 0, 0};
        blockDim = {(unsigned)nthreads, 1, 1};
        amk_emu_block = blocks[b].get();
        amk_megakernel(tasks, queue_start, queue_tasks, bufs, counters, status, host_abort, epoch, spin_timeout_ns,
                       smem_bytes, prefetch_depth);
      });
  for (auto& th : threads) th.join();
  return 0;
}
