// dp4a.cuh (lab): the INT8-activation path of the decode GEMV: x quantized per group of 128
// (nq_quantize_act_int8), INT4 weights expanded to INT8 without sign extension, __dp4a.
// Used by kernels/lab/gemv_dp4a.cu (tiles) and kernels/lab/gemv_stream.cu (stream-K).
#pragma once
#include "gemv_int4.cuh"

typedef signed char int8_t;

namespace nq {

// [dp4a-group]
struct Dp4aPath {
  // xq: the lane's 32 int8 of this group (dp4a byte order, see nq_quantize_act_int8).
  static __device__ __forceinline__ int smem_offset_bytes(int local_group, int t) {
    return local_group * NQ_GROUP_SIZE + t * (NQ_GROUP_SIZE / 4);
  }
  // INT4 -> INT8 without sign extension: a nibble moved to the top of its byte is the
  // signed byte 16*s. (w << 4) & 0xF0F0F0F0 puts slots 0,2,4,6 = w0,w4,w1,w5 there, and
  // w & 0xF0F0F0F0 slots 1,3,5,7 = w2,w6,w3,w7; the quantizer stores x in the same order.
  static __device__ __forceinline__ void group(float (&acc)[kMTiles][2], const GroupRegs& r,
                                               const unsigned char* xs, int grp,
                                               const float* __restrict__ xscale) {
    const uint4 xa = reinterpret_cast<const uint4*>(xs)[0];   // words 0, 1 of the lane
    const uint4 xb = reinterpret_cast<const uint4*>(xs)[1];   // words 2, 3
    const uint32_t xq[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    const float xsc = xscale[grp] * 0.0625f;                   // / 16 undoes the nibble shift
#pragma unroll
    for (int m = 0; m < kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int dot = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w = word_of(r.w[m][h], j);
          dot = __dp4a((int)((w << 4) & 0xF0F0F0F0u), (int)xq[2 * j], dot);
          dot = __dp4a((int)(w & 0xF0F0F0F0u), (int)xq[2 * j + 1], dot);
        }
        // |dot| <= 32 * 128 * 127 < 2^24: exact in fp32.
        acc[m][h] = fmaf((float)dot, r.s[m][h] * xsc, acc[m][h]);
      }
  }
  // The four lanes of a quad hold partial sums over k-quarters: add them.
  static __device__ __forceinline__ void finish(float (&acc)[kMTiles][2]) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc[m][h] += __shfl_xor_sync(0xffffffffu, acc[m][h], 1);
        acc[m][h] += __shfl_xor_sync(0xffffffffu, acc[m][h], 2);
      }
  }
};
// [/dp4a-group]

// INT8 activations: a plain copy (no padding: 32-byte lane runs are conflict-free).
__device__ __forceinline__ void stage_xq(unsigned char* xs, const int8_t* __restrict__ xq, const Geometry& q) {
  const uint4* src = reinterpret_cast<const uint4*>(xq + (size_t)q.gs * NQ_GROUP_SIZE);
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = threadIdx.x; c < q.ng * (NQ_GROUP_SIZE / 16); c += blockDim.x) dst[c] = src[c];
}

struct StageXq { const int8_t* xq;
  __device__ void operator()(unsigned char* xs, const Geometry& q) const { stage_xq(xs, xq, q); } };
}  // namespace nq
