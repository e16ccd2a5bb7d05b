// engine_step.cu: the decode step's bookkeeping, done on the device so that a CUDA graph
// can replay the whole step with no host work in between.
//
//   nq_step_begin  one thread: context_len = position + 1; on a page boundary
//                  (the graph variant captured with new_page = 1) pop a physical page from
//                  the device free list into block_table[position / 16]; slot = where this
//                  position's K/V go.
//   nq_step_end    one thread: generated[position] = token (argmax just wrote it);
//                  position += 1.
//
// The scalars live in one int32 buffer, one per 128-byte line (stride NQ_SCALAR_STRIDE):
// token, position, context_len, slot, free_top, error.
#include "common.cuh"
#include "decode_contract.cuh"   // S_* (the scalar slots), kErr*: from nanoqwen_lib/gpu/decode_contract.py
using namespace pd;

#ifndef NQ_SCALAR_STRIDE
#error "NQ_SCALAR_STRIDE comes from nanoqwen_lib.config.cuda_defines"
#endif
static_assert(NQ_SCALAR_STRIDE * 4 % 128 == 0, "each scalar on its own 128-byte line");

extern "C" __global__ void nq_step_begin(int* scalars, int* block_table, const int* free_pages,
                                         int new_page, int max_pages) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const int p = scalars[S_POSITION * NQ_SCALAR_STRIDE];
  const int page = p / NQ_PAGE_TOKENS;
  // the host checks limits first
  if (page >= max_pages) { scalars[S_ERROR * NQ_SCALAR_STRIDE] = kErrMaxPages; return; }
  if (new_page) {
    const int top = scalars[S_FREE_TOP * NQ_SCALAR_STRIDE] - 1;
    if (top < 0) { scalars[S_ERROR * NQ_SCALAR_STRIDE] = kErrNoPage; return; }   // pool exhausted
    block_table[page] = free_pages[top];
    scalars[S_FREE_TOP * NQ_SCALAR_STRIDE] = top;
  }
  scalars[S_SLOT * NQ_SCALAR_STRIDE] = block_table[page] * NQ_PAGE_TOKENS + p % NQ_PAGE_TOKENS;
  scalars[S_CONTEXT * NQ_SCALAR_STRIDE] = p + 1;
}

extern "C" __global__ void nq_step_end(int* scalars, int* generated) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const int p = scalars[S_POSITION * NQ_SCALAR_STRIDE];
  generated[p] = scalars[S_TOKEN * NQ_SCALAR_STRIDE];
  scalars[S_POSITION * NQ_SCALAR_STRIDE] = p + 1;
}
