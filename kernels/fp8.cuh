// fp8.cuh: shared by the FP8 GEMMs (fp8.cu: mma.sync; lab/wgmma_fp8.cu: wgmma). One contract:
// out[t,n] = fp16(acc * ts[t] * s[n] [+ bias[n]] [+ residual[t,n]]), acc the FP32 sum of
// E4M3 products, ts the token's activation scale, s the weight row's scale.
#pragma once
#include "common.cuh"

#ifndef NQ_FP8_MAX
#error "NQ_FP8_MAX comes from nanoqwen.yaml (format.fp8_max) via nanoqwen_lib.config.cuda_defines"
#endif
static_assert(NQ_FP8_LAYOUT_ID == 2, "these kernels read layout 2 (FP8 E4M3 codes, one FP32 scale per row)");
static_assert(NQ_FP8_MAX == 448, "E4M3 (e4m3fn): largest finite value 448");

namespace nqfp8 {
// The GEMMs' epilogue for one accumulator; elements past T or N are not stored. residual
// may alias out (the element is read, then written, by the same thread).
__device__ __forceinline__ void store_scaled(half* out, const float* __restrict__ ts, const float* __restrict__ scales,
                                             const half* bias, const half* residual, int t, int n, int T, int N,
                                             float acc) {
  if (t >= T || n >= N) return;
  float y = acc * (ts[t] * scales[n]);
  if (bias) y += __half2float(bias[n]);
  if (residual) y += __half2float(residual[(size_t)t * N + n]);
  out[(size_t)t * N + n] = __float2half_rn(y);
}
}  // namespace nqfp8
