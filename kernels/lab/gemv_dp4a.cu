// lab/gemv_dp4a.cu: the decode GEMV on INT8 activations and __dp4a (measured against prmt +
// mma.sync in book/04-int4-gemv.md: faster on the big shapes, but x rounded to 8 bits).
//   nq_quantize_act_int8  x fp16 [K] -> int8 per group of 128 (scale = absmax/127), dp4a byte order
//   nq_gemv_int4_dp4a     out as nq_gemv_int4 from the int8 activations, __dp4a on INT4->INT8 weights
// nq-variants: NQ_GEMV_UNROLL=2; NQ_GEMV_WARPS=8,NQ_GEMV_UNROLL=2
#include "lab/dp4a.cuh"

// xq int8 [K] in dp4a byte order, xscale fp32 [K/128]. Dynamic smem ceil(G/ksplit)*128 B.
extern "C" __global__ void __launch_bounds__(nq::kThreads, NQ_GEMV_MIN_CTAS)
nq_gemv_int4_dp4a(const int8_t* __restrict__ xq, const float* __restrict__ xscale,
                  const uint32_t* __restrict__ qw, const half* __restrict__ scales, half* out,
                  const half* bias, const half* residual, float* ws, int* counters,
                  int N, int K, int ksplit) {
  nq::gemv_body<nq::Dp4aPath>(nq::StageXq{xq}, qw, scales, xscale,
                              nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}

// One half-warp per group of 128: lane l quantizes x[8l .. 8l+7] of it. scale = absmax/127
// (fp32, IEEE division), q = rint(x / scale) (0 when the group is all zero). Within each run
// of 8, bytes are stored as [q0 q4 q1 q5 | q2 q6 q3 q7], the order the dp4a GEMV's
// INT4 -> INT8 expansion produces (see Dp4aPath). grid ceil(G / (blockDim/16)).
extern "C" __global__ void nq_quantize_act_int8(const half* __restrict__ x, int8_t* __restrict__ xq,
                                                float* __restrict__ xscale, int K) {
  const int G = K / NQ_GROUP_SIZE;
  const int grp = (blockIdx.x * blockDim.x + threadIdx.x) / 16;
  const int l = threadIdx.x & 15;
  const bool live = grp < G;
  uint4 v = make_uint4(0, 0, 0, 0);
  if (live) v = reinterpret_cast<const uint4*>(x + (size_t)grp * NQ_GROUP_SIZE)[l];
  const half* h = reinterpret_cast<const half*>(&v);
  float f[8], amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) { f[i] = __half2float(h[i]); amax = fmaxf(amax, fabsf(f[i])); }
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!live) return;
  const float scale = amax / 127.0f;
  uint32_t b[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) b[i] = (uint32_t)(scale > 0.f ? __float2int_rn(f[i] / scale) : 0) & 0xFFu;
  const uint32_t lo = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24;   // q0 q1 q2 q3
  const uint32_t hi = b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24;   // q4 q5 q6 q7
  // prmt selector nibbles pick bytes of {hi:lo} (0-3 lo, 4-7 hi) for result bytes 0..3.
  uint2 out = make_uint2(nq::prmt(lo, hi, 0x5140u), nq::prmt(lo, hi, 0x7362u));
  reinterpret_cast<uint2*>(xq + (size_t)grp * NQ_GROUP_SIZE)[l] = out;
  if (l == 0) xscale[grp] = scale;
}
