// decode_ops.cu: the small kernels of a decode step (batch 1), each a few microseconds.
//   nq_rmsnorm   y = fp16(fp32(x) * rsqrt(mean(fp32(x)^2) + eps) * fp32(w)); one CTA per row
//                (decode: 1 row; prefill: one per prompt token)
//   nq_embed     out[r] = table[token[r]]; ids are read from device memory (graph-safe);
//                rows on blockIdx.y (decode: 1 row; prefill: one per prompt token)
//   nq_argmax    int32 argmax of fp32 logits, ties -> lowest index; one launch, last-CTA merge
// nq-variants: NQ_DECODE_THREADS=256
//
// nq_argmax and nq_lm_head (lm_head.cu) share the merge: each CTA reduces its share to one
// (value, index) pair, stores it, fences, and bumps a counter; the CTA that arrives last
// merges the pairs, writes the token and resets the counter to 0 for the next launch.
#include "common.cuh"
#include "argmax.cuh"
#include "rowops.cuh"   // sumsq8, rmsnorm8

#ifndef NQ_DECODE_THREADS   // threads per CTA of every kernel in this file
#error "NQ_DECODE_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
static_assert(NQ_DECODE_THREADS % 32 == 0 && NQ_DECODE_THREADS <= 1024, "whole warps, <= 1024");

namespace nq {
constexpr int kDecThreads = NQ_DECODE_THREADS;

// Sum over the CTA; every thread gets the total. Reached by all threads of the CTA.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[kDecThreads / 32];
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();   // all threads: part[] is complete
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kDecThreads / 32; ++w) s += part[w];   // same order in every thread
  return s;
}
}  // namespace nq

// [rmsnorm]
// x, out fp16 [rows, H], w fp16 [H], H a multiple of 8; grid rows, block NQ_DECODE_THREADS.
// out may not alias x.
extern "C" __global__ void __launch_bounds__(nq::kDecThreads)
nq_rmsnorm(const half* __restrict__ x, const half* __restrict__ w, half* __restrict__ out, int H, float eps) {
  x += (size_t)blockIdx.x * H;
  out += (size_t)blockIdx.x * H;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float ss = 0.f;
  for (int c = threadIdx.x; c < H / 8; c += nq::kDecThreads) ss = nq::sumsq8(x4[c], ss);
  const float r = 1.0f / sqrtf(nq::block_sum(ss) / (float)H + eps);   // IEEE sqrt and divide
  for (int c = threadIdx.x; c < H / 8; c += nq::kDecThreads)
    reinterpret_cast<uint4*>(out)[c] = nq::rmsnorm8(x4[c], reinterpret_cast<const uint4*>(w)[c], r);
}
// [/rmsnorm]

// token int32 [rows] (device), table fp16 [V, H], out fp16 [rows, H]; H a multiple of 8;
// grid (x: chunks of a row, y: rows). A token outside [0, V) fills its row with NaN, so a
// bad id cannot pass silently.
extern "C" __global__ void __launch_bounds__(nq::kDecThreads)
nq_embed(const int* __restrict__ token, const half* __restrict__ table, half* __restrict__ out, int H, int V) {
  const int tok = token[blockIdx.y];
  out += (size_t)blockIdx.y * H;
  const bool ok = tok >= 0 && tok < V;
  const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)(ok ? tok : 0) * H);
  const uint4 nan4 = make_uint4(0x7E007E00u, 0x7E007E00u, 0x7E007E00u, 0x7E007E00u);
  for (int c = blockIdx.x * nq::kDecThreads + threadIdx.x; c < H / 8; c += gridDim.x * nq::kDecThreads)
    reinterpret_cast<uint4*>(out)[c] = ok ? src[c] : nan4;
}

// logits fp32 [V]; part_val/part_idx [gridDim.x], counter [1] (zero before the first launch,
// left zero after each); token_out int32 [1]. NaN logits are never chosen.
extern "C" __global__ void __launch_bounds__(nq::kDecThreads)
nq_argmax(const float* __restrict__ logits, int V, float* part_val, int* part_idx,
          unsigned* counter, int* token_out) {
  nq::ArgBest best{NQ_NEG_INF, V};
  const int V4 = ((size_t)logits & 15) == 0 ? V / 4 : 0;
  const int stride = gridDim.x * nq::kDecThreads;
  for (int c = blockIdx.x * nq::kDecThreads + threadIdx.x; c < V4; c += stride) {
    const float4 v = reinterpret_cast<const float4*>(logits)[c];
    best.take(v.x, 4 * c); best.take(v.y, 4 * c + 1); best.take(v.z, 4 * c + 2); best.take(v.w, 4 * c + 3);
  }
  for (int i = 4 * V4 + blockIdx.x * nq::kDecThreads + threadIdx.x; i < V; i += stride)
    best.take(logits[i], i);
  nq::argmax_finish<nq::kDecThreads>(best, part_val, part_idx, counter, token_out);
}
