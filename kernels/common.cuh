// common.cuh: shared by every kernel. Constants arrive as -D defines from nanoqwen.yaml
// (nanoqwen_lib.config.cuda_defines); the static_asserts guard the invariants the kernels
// and the file format rely on.
#pragma once
#include <cuda_fp16.h>
// NVRTC ships no <stdint.h>; the fixed-width types we use, spelled out.
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;

#ifndef NQ_GROUP_SIZE
#error "NQ_GROUP_SIZE must come from nanoqwen.yaml via -D (nanoqwen_lib.gpu.cuda_build)"
#endif
#ifndef NQ_PAGE_TOKENS
#error "NQ_PAGE_TOKENS must come from nanoqwen.yaml via -D"
#endif

static_assert(NQ_GROUP_SIZE % 8 == 0, "a group holds whole uint32 words of 8 nibbles");
static_assert(NQ_ALIGN == 128, "buffers and payloads are 128-byte aligned");
static_assert(NQ_KV_DTYPE_BYTES == 2, "the KV cache is FP16");

#ifdef NQ_HEAD_DIM
// One KV head's K (or V) for one page, and the page across all KV heads.
constexpr int NQ_HEAD_SLICE_BYTES = NQ_PAGE_TOKENS * NQ_HEAD_DIM * NQ_KV_DTYPE_BYTES;
static_assert(NQ_HEAD_SLICE_BYTES % 128 == 0, "a KV head slice must be a whole number of 128-byte lines");
static_assert(NQ_HEAD_SLICE_BYTES % 16 == 0, "cp.async.bulk sizes are multiples of 16 bytes");
constexpr int NQ_PAGE_BYTES = NQ_HEAD_SLICE_BYTES * NQ_NUM_KV_HEADS;
static_assert(NQ_PAGE_BYTES % 128 == 0, "KV page bytes must be a multiple of 128");
static_assert(NQ_HEAD_DIM == 64 || NQ_HEAD_DIM == 128, "head_dim 64 or 128");
static_assert(NQ_NUM_HEADS % NQ_NUM_KV_HEADS == 0, "GQA: query heads per KV head is whole");
#endif
#ifdef NQ_HIDDEN
static_assert(NQ_HIDDEN % NQ_GROUP_SIZE == 0, "hidden is whole groups");
static_assert(NQ_INTERMEDIATE % NQ_GROUP_SIZE == 0, "intermediate is whole groups");
#endif

// ---- PTX wrappers shared by the INT4 kernels (decode GEMV and prefill GEMM) -------------
namespace nqptx {
// [ptx-wrappers]
// d = the four bytes of {b, a} picked by the four selector nibbles of sel.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// Two fp16 subtractions in one instruction, round to nearest.
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// [/ptx-wrappers]
}  // namespace nqptx
