// lm_head.cu: logits = fp32(W . x) for an FP16 weight W [V, H], batch 1, FP32 accumulation.
//   nq_lm_head   logits fp32 [V]; with token_out != null also the argmax (ties -> lowest
//                index), merged by the last CTA as in nq_argmax (decode_ops.cu)
// nq-variants: NQ_LMHEAD_ROWS_PER_WARP=2; NQ_LMHEAD_UNROLL=2
//
// A persistent grid (a few CTAs per SM) walks the rows: each warp takes ROWS_PER_WARP rows
// at a time and its lanes stride along them 16 bytes apart (coalesced 512-byte runs), with
// UNROLL x ROWS_PER_WARP 16-byte loads in flight per lane. x is staged once per CTA as fp32
// in shared memory. At 2 bytes per weight the FP32 path has ~15 lane-ops per weight to
// spend at the read ceiling, so plain FFMA is enough (no tensor cores here).
// Tuned for V = 152064, H = 3584 (1.09 GB); H must be a multiple of 8.
#include "common.cuh"
#include "argmax.cuh"
#include "rowops.cuh"   // dot8

#ifndef NQ_LMHEAD_WARPS
#error "NQ_LMHEAD_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_LMHEAD_ROWS_PER_WARP
#error "NQ_LMHEAD_ROWS_PER_WARP: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_LMHEAD_UNROLL
#error "NQ_LMHEAD_UNROLL: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
static_assert(NQ_LMHEAD_ROWS_PER_WARP >= 1 && NQ_LMHEAD_ROWS_PER_WARP <= 8, "1..8 rows per warp");
static_assert(NQ_LMHEAD_UNROLL >= 1 && NQ_LMHEAD_UNROLL <= 8, "1..8 chunks in flight per row");

namespace nq {
constexpr int kLmWarps = NQ_LMHEAD_WARPS;
constexpr int kLmThreads = 32 * kLmWarps;
constexpr int kLmRows = NQ_LMHEAD_ROWS_PER_WARP;
constexpr int kLmUnroll = NQ_LMHEAD_UNROLL;

__device__ __forceinline__ uint4 ldg_stream16(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

}  // namespace nq

// x fp16 [H], W fp16 [V, H], logits fp32 [V]. grid: any (persistent); block 32*WARPS;
// dynamic smem 4*H bytes. part_val/part_idx [gridDim.x] and counter [1] are used only
// when token_out is not null (counter zero before the first launch, left zero after).
extern "C" __global__ void __launch_bounds__(nq::kLmThreads)
nq_lm_head(const half* __restrict__ x, const half* __restrict__ W, float* __restrict__ logits,
           int V, int H, float* part_val, int* part_idx, unsigned* counter, int* token_out) {
  extern __shared__ __align__(16) float xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = H / 8;                         // 16-byte chunks per row
  for (int i = threadIdx.x; i < H; i += nq::kLmThreads) xs[i] = __half2float(x[i]);
  __syncthreads();   // all threads: xs complete
  const float4* xs4 = reinterpret_cast<const float4*>(xs);

  nq::ArgBest best{NQ_NEG_INF, V};
  for (int r0 = (blockIdx.x * nq::kLmWarps + warp) * nq::kLmRows; r0 < V;
       r0 += gridDim.x * nq::kLmWarps * nq::kLmRows) {
    const uint4* rows[nq::kLmRows];
#pragma unroll
    for (int r = 0; r < nq::kLmRows; ++r)
      rows[r] = reinterpret_cast<const uint4*>(W + (size_t)min(r0 + r, V - 1) * H);
    float acc[nq::kLmRows];
#pragma unroll
    for (int r = 0; r < nq::kLmRows; ++r) acc[r] = 0.f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * nq::kLmUnroll) {
      uint4 w[nq::kLmUnroll][nq::kLmRows];
#pragma unroll
      for (int u = 0; u < nq::kLmUnroll; ++u)
#pragma unroll
        for (int r = 0; r < nq::kLmRows; ++r)
          if (c0 + 32 * u < chunks) w[u][r] = nq::ldg_stream16(rows[r] + c0 + 32 * u);
#pragma unroll
      for (int u = 0; u < nq::kLmUnroll; ++u) {
        const int c = c0 + 32 * u;
        if (c < chunks) {
          const float4 xa = xs4[2 * c], xb = xs4[2 * c + 1];
#pragma unroll
          for (int r = 0; r < nq::kLmRows; ++r) acc[r] = nq::dot8(acc[r], w[u][r], xa, xb);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < nq::kLmRows; ++r) {
      for (int o = 16; o >= 1; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
      if (r0 + r < V) {
        if (lane == 0) logits[r0 + r] = acc[r];
        best.take(acc[r], r0 + r);   // every lane holds the same sum; rows rise within a lane
      }
    }
  }
  if (token_out) nq::argmax_finish<nq::kLmThreads>(best, part_val, part_idx, counter, token_out);
}
