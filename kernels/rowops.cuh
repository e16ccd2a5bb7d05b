// rowops.cuh: the per-chunk arithmetic of the decode step's row operations (a chunk: 8 fp16,
// 16 bytes), one definition for the kernel-per-op kernels (decode_ops.cu's rmsnorm,
// lm_head.cu) and the persistent step (decode_persistent.cu), so both round alike.
#pragma once
#include "common.cuh"

namespace nq {
// [rowops]
// ss + the squares of the chunk's 8 values, FP32, in element order.
__device__ __forceinline__ float sumsq8(const uint4& v, float ss) {
  const half2* h = reinterpret_cast<const half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    ss = fmaf(f.x, f.x, ss);
    ss = fmaf(f.y, f.y, ss);
  }
  return ss;
}
// RMSNorm of a chunk: fp16(x * r * w), r = 1 / rms of the row.
__device__ __forceinline__ uint4 rmsnorm8(const uint4& v, const uint4& wv, float r) {
  const half2* h = reinterpret_cast<const half2*>(&v);
  const half2* wh = reinterpret_cast<const half2*>(&wv);
  uint4 o;
  half2* oh = reinterpret_cast<half2*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]), g = __half22float2(wh[i]);
    oh[i] = __floats2half2_rn(f.x * r * g.x, f.y * r * g.y);
  }
  return o;
}
// acc + dot(8 fp16 weights, 8 fp32 activations xa | xb), FP32 FMAs in element order.
__device__ __forceinline__ float dot8(float acc, const uint4& w, const float4& xa, const float4& xb) {
  const half2* h = reinterpret_cast<const half2*>(&w);
  const float2 w0 = __half22float2(h[0]), w1 = __half22float2(h[1]);
  const float2 w2 = __half22float2(h[2]), w3 = __half22float2(h[3]);
  acc = fmaf(w0.x, xa.x, acc); acc = fmaf(w0.y, xa.y, acc);
  acc = fmaf(w1.x, xa.z, acc); acc = fmaf(w1.y, xa.w, acc);
  acc = fmaf(w2.x, xb.x, acc); acc = fmaf(w2.y, xb.y, acc);
  acc = fmaf(w3.x, xb.z, acc); acc = fmaf(w3.y, xb.w, acc);
  return acc;
}
// [/rowops]
}  // namespace nq
