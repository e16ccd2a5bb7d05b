// rows.cuh: row arithmetic shared by the instructions: the CTA sum, rmsnorm (decode_ops.cu's
// arithmetic), [pd-down-defer]'s folds of down's K slices.
#pragma once
#include "decode/sched.cuh"
#include "rowops.cuh"

namespace pd {

// CTA sum; every thread gets the total (same order in every thread). Uses red[kWarps].
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  cta_sync();   // all threads: red[] complete
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  cta_sync();   // all threads: red[] read before it is reused
  return s;
}

// 1 / rms of the fp16 vector x [H] (written in this kernel: read through L2), decode_ops.cu's
// nq_rmsnorm arithmetic.
// From each thread's partial sum of squares (all threads):
__device__ __forceinline__ float rms_inv_of(float ss, float* red, float eps) {
  return 1.0f / sqrtf(block_sum(ss, red) / (float)H + eps);
}
__device__ __forceinline__ float rms_inv(const half* x, float* red, float eps) {
  float ss = 0.f;
  for (int c = threadIdx.x; c < H / 8; c += kThreads) ss = nq::sumsq8(__ldcg(reinterpret_cast<const uint4*>(x) + c), ss);
  return rms_inv_of(ss, red, eps);
}
// y = fp16(x * r * w) for the 8 halves of chunk c.
__device__ __forceinline__ uint4 norm_chunk(const half* x, const half* w, float r, int c) {
  return nq::rmsnorm8(__ldcg(reinterpret_cast<const uint4*>(x) + c), __ldg(reinterpret_cast<const uint4*>(w) + c), r);
}

// [pd-down-defer] x's chunk c (8 rows) with down's slices added: fp16(x + (ws[0] + ws[1] + ...)),
// the fold's arithmetic (gemv's epilogue below), row by row.
__device__ __forceinline__ uint4 fold_chunk(uint4 xv, const float* ws, int c) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = 0.f;
#pragma unroll
  for (int s = 0; s < kDown.KS; ++s) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(ws + (size_t)s * H + 8 * c));
    const float4 b = __ldcg(reinterpret_cast<const float4*>(ws + (size_t)s * H + 8 * c + 4));
    v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w; v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
  }
  half* xh = reinterpret_cast<half*>(&xv);
#pragma unroll
  for (int i = 0; i < 8; ++i) xh[i] = __float2half_rn(__half2float(xh[i]) + v[i]);
  return xv;
}
// ... and one row's (o_proj's residual): x[row] with the slices added, as a float
__device__ __forceinline__ float fold_row(float x, const float* ws, int row) {
  float v = 0.f;
#pragma unroll
  for (int s = 0; s < kDown.KS; ++s) v += __ldcg(ws + (size_t)s * H + row);
  return __half2float(__float2half_rn(x + v));
}

}  // namespace pd
