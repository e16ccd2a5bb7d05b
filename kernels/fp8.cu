// fp8.cu: the kernels of the FP8 E4M3 weight encoding (file layout 2: codes uint8 [N, K],
// K contiguous; one FP32 scale per output row, s[n] = row absmax / NQ_FP8_MAX).
//
//   nq_gemv_fp8          decode, batch 1: out[n] = fp16(s[n] * sum_k e4m3(c[n,k]) x[k]
//                        [+ bias[n]] [+ residual[n]]); codes converted in registers
//                        (cvt.rn.f16x2.e4m3x2, two per instruction), FP32 accumulation
//   nq_quantize_rows_fp8 prefill activations: xq[t,k] = E4M3(x[t,k] / ts[t]),
//                        ts[t] = row absmax / NQ_FP8_MAX (round to nearest even, satfinite)
//   nq_gemm_fp8          prefill: out[t,n] = fp16(ts[t] s[n] sum_k xq[t,k] c[n,k] [+ bias[n]]
//                        [+ residual[t,n]]), mma.sync.m16n8k32 with E4M3 operands, FP32
//                        accumulation; both scales in the epilogue
//
// v0, correctness first: plain 16-byte loads, one shared-memory stage; PERFLOG.md says
// what is measured. Requires sm_89 or newer (E4M3 cvt and MMA); this build targets sm_90.
#include "fp8.cuh"
#include "hopper.cuh"   // the E4M3 mma.sync wrapper
#ifndef NQ_FP8_GEMV_THREADS
#error "NQ_FP8_GEMV_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_FP8_QUANT_THREADS
#error "NQ_FP8_QUANT_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_FP8_GEMM_BM
#error "NQ_FP8_GEMM_BM: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_FP8_GEMM_BN
#error "NQ_FP8_GEMM_BN: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_FP8_GEMM_BK
#error "NQ_FP8_GEMM_BK: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_FP8_GEMM_THREADS
#error "NQ_FP8_GEMM_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif

namespace nqfp8 {
constexpr int kGemvThreads = NQ_FP8_GEMV_THREADS;       // 8 warps, one output row per warp at a time
constexpr int kQuantThreads = NQ_FP8_QUANT_THREADS;
constexpr int kBM = NQ_FP8_GEMM_BM, kBN = NQ_FP8_GEMM_BN, kBK = NQ_FP8_GEMM_BK;   // GEMM tile: tokens x features x k
constexpr int kGemmThreads = NQ_FP8_GEMM_THREADS;       // 4 warps as 2 (tokens) x 2 (features), 32 x 32 each
constexpr int kStride = kBK + 16;       // shared row stride in bytes (16-byte aligned, fewer bank conflicts)

// Two E4M3 (low byte = first) -> two fp16 in one register (low half = first).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  uint32_t d;
  const unsigned short v = (unsigned short)(two & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(v));
  return d;
}

// Two floats -> two E4M3 in the low 16 bits (first in the low byte), RNE, saturating.
__device__ __forceinline__ uint32_t f32x2_to_e4m3x2(float first, float second) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(second), "f"(first));
  return d;
}

// sum of 16 products: 16 E4M3 codes (one uint4, k ascending from the low byte) times 16
// fp16 activations (two uint4, k ascending), in FP32.
__device__ __forceinline__ float dot16(const uint4 codes, const uint4 xa, const uint4 xb, float acc) {
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  const half2* xh0 = reinterpret_cast<const half2*>(&xa);
  const half2* xh1 = reinterpret_cast<const half2*>(&xb);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = e4m3x2_to_f16x2(w[i]), hi = e4m3x2_to_f16x2(w[i] >> 16);
    const half2 x01 = i < 2 ? xh0[2 * i] : xh1[2 * i - 4];
    const half2 x23 = i < 2 ? xh0[2 * i + 1] : xh1[2 * i - 3];
    const float2 c01 = __half22float2(*reinterpret_cast<const half2*>(&lo));
    const float2 c23 = __half22float2(*reinterpret_cast<const half2*>(&hi));
    const float2 f01 = __half22float2(x01), f23 = __half22float2(x23);
    acc = fmaf(c01.x, f01.x, acc);
    acc = fmaf(c01.y, f01.y, acc);
    acc = fmaf(c23.x, f23.x, acc);
    acc = fmaf(c23.y, f23.y, acc);
  }
  return acc;
}

}  // namespace nqfp8

// [gemv-fp8]
// x fp16 [K]; codes uint8 [N, K]; scales fp32 [N]; bias, residual fp16 [N] or null (residual
// may be out: in place); out fp16 [N]. K a multiple of 16; grid ceil(N / 8), block 256,
// dynamic shared memory 2 K bytes (x as fp16).
extern "C" __global__ void __launch_bounds__(nqfp8::kGemvThreads)
nq_gemv_fp8(const half* __restrict__ x, const unsigned char* __restrict__ codes, const float* __restrict__ scales,
            const half* bias, const half* residual, half* out, int N, int K) {
  extern __shared__ __align__(16) half xs[];
  for (int i = threadIdx.x; i < K / 8; i += nqfp8::kGemvThreads)
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();   // all threads: xs is complete (no barrier after this point)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * (nqfp8::kGemvThreads / 32) + warp;
  if (row >= N) return;
  const uint4* w = reinterpret_cast<const uint4*>(codes + (size_t)row * K);
  const uint4* x4 = reinterpret_cast<const uint4*>(xs);
  float acc = 0.f;
  const int chunks = K / 16;
#pragma unroll 4
  for (int c = lane; c < chunks; c += 32) acc = nqfp8::dot16(__ldcs(w + c), x4[2 * c], x4[2 * c + 1], acc);
  for (int o = 16; o >= 1; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) {
    float y = acc * scales[row];
    if (bias) y += __half2float(bias[row]);
    if (residual) y += __half2float(residual[row]);
    out[row] = __float2half_rn(y);
  }
}
// [/gemv-fp8]

// x fp16 [T, K] -> xq uint8 [T, K], ts fp32 [T]; K a multiple of 8; grid T, block 256.
extern "C" __global__ void __launch_bounds__(nqfp8::kQuantThreads)
nq_quantize_rows_fp8(const half* __restrict__ x, unsigned char* __restrict__ xq, float* __restrict__ ts, int K) {
  __shared__ float part[nqfp8::kQuantThreads / 32];
  const half* row = x + (size_t)blockIdx.x * K;
  float amax = 0.f;
  for (int c = threadIdx.x; c < K / 8; c += nqfp8::kQuantThreads) {
    const uint4 v = reinterpret_cast<const uint4*>(row)[c];
    const half2* h = reinterpret_cast<const half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  for (int o = 16; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = amax;
  __syncthreads();   // all threads: part[] is complete
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < nqfp8::kQuantThreads / 32; ++w) amax = fmaxf(amax, part[w]);
  const float s = amax / (float)NQ_FP8_MAX;            // IEEE division, as the reference
  if (threadIdx.x == 0) ts[blockIdx.x] = s;
  const float d = s == 0.f ? 1.f : s;
  unsigned char* dst = xq + (size_t)blockIdx.x * K;
  for (int c = threadIdx.x; c < K / 8; c += nqfp8::kQuantThreads) {
    const uint4 v = reinterpret_cast<const uint4*>(row)[c];
    const half2* h = reinterpret_cast<const half2*>(&v);
    uint32_t packed[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 a = __half22float2(h[2 * i]), b = __half22float2(h[2 * i + 1]);
      packed[i] = s == 0.f ? 0u
                           : nqfp8::f32x2_to_e4m3x2(a.x / d, a.y / d) | (nqfp8::f32x2_to_e4m3x2(b.x / d, b.y / d) << 16);
    }
    reinterpret_cast<uint2*>(dst)[c] = make_uint2(packed[0], packed[1]);
  }
}

// [gemm-fp8]
// xq uint8 [T, K] (E4M3), ts fp32 [T]; codes uint8 [N, K], scales fp32 [N]; bias fp16 [N]
// or null; residual fp16 [T, N] or null (may be out); out fp16 [T, N]. K a multiple of 64;
// grid (ceil(T / 64), ceil(N / 64)), block 128.
extern "C" __global__ void __launch_bounds__(nqfp8::kGemmThreads)
nq_gemm_fp8(const unsigned char* __restrict__ xq, const float* __restrict__ ts,
            const unsigned char* __restrict__ codes, const float* __restrict__ scales,
            const half* bias, const half* residual, half* out, int T, int N, int K) {
  using namespace nqfp8;
  __shared__ __align__(16) unsigned char xs[kBM * kStride];
  __shared__ __align__(16) unsigned char ws[kBN * kStride];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int wm = warp >> 1, wn = warp & 1;              // this warp's 32 x 32 quadrant
  const int t0 = blockIdx.x * kBM, n0 = blockIdx.y * kBN;
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

  for (int k0 = 0; k0 < K; k0 += kBK) {
    // 64 rows x 64 bytes per operand = 256 uint4: two per thread each; zeros past T or N.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = threadIdx.x + i * kGemmThreads, r = idx >> 2, c = (idx & 3) * 16;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      const uint4 xv = t0 + r < T ? *reinterpret_cast<const uint4*>(xq + (size_t)(t0 + r) * K + k0 + c) : zero;
      const uint4 wv = n0 + r < N ? __ldcs(reinterpret_cast<const uint4*>(codes + (size_t)(n0 + r) * K + k0 + c)) : zero;
      *reinterpret_cast<uint4*>(xs + r * kStride + c) = xv;
      *reinterpret_cast<uint4*>(ws + r * kStride + c) = wv;
    }
    __syncthreads();   // all threads: both tiles are in shared memory
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 32) {
      // Operand fragments: A and B take the same k for the same (register, byte) slot,
      // k = kk + 4 tig + byte (registers 0/1 of A, 0 of B) and + 16 (registers 2/3, 1).
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const unsigned char* r0 = xs + (wm * 32 + i * 16 + g) * kStride + kk + 4 * tig;
        const unsigned char* r1 = r0 + 8 * kStride;
        a[i][0] = *reinterpret_cast<const uint32_t*>(r0);
        a[i][1] = *reinterpret_cast<const uint32_t*>(r1);
        a[i][2] = *reinterpret_cast<const uint32_t*>(r0 + 16);
        a[i][3] = *reinterpret_cast<const uint32_t*>(r1 + 16);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned char* c0 = ws + (wn * 32 + j * 8 + g) * kStride + kk + 4 * tig;
        b[j][0] = *reinterpret_cast<const uint32_t*>(c0);
        b[j][1] = *reinterpret_cast<const uint32_t*>(c0 + 16);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) hopper::mma_e4m3_16832(acc[i][j], a[i], b[j]);
    }
    __syncthreads();   // all threads: done reading before the next tiles overwrite them
  }
  // Epilogue: d0, d1 at (row g, cols 2 tig, 2 tig + 1); d2, d3 at row g + 8.
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int t = t0 + wm * 32 + i * 16 + g + (r >= 2 ? 8 : 0);
        const int n = n0 + wn * 32 + j * 8 + 2 * tig + (r & 1);
        store_scaled(out, ts, scales, bias, residual, t, n, T, N, acc[i][j][r]);
      }
}
// [/gemm-fp8]
