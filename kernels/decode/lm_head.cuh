// lm_head.cuh: the head instruction: final norm, the CTA's share of the FP16 lm_head rows,
// argmax merged by the last CTA (argmax.cuh), the step's bookkeeping.
#pragma once
#include "decode/rows.cuh"
#include "argmax.cuh"

namespace pd {

__device__ void head(Ctx& c, int idx, int num_layers, unsigned char* smem, float* red) {
  begin_instruction(c);
  const half* W = ptr<const half>(c.tab, T_LM_HEAD);
  const int r_begin = (int)((long long)blockIdx.x * V / c.grid), r_end = (int)((long long)(blockIdx.x + 1) * V / c.grid);
  if (threadIdx.x < 32) {
    const unsigned total = (unsigned)(r_end - r_begin) * H * 2u, cap = kCfg.prefetch_kb * 1024u;
    for (unsigned off = threadIdx.x * 16384u; off < min(total, cap); off += 32 * 16384u)
      prefetch_l2(reinterpret_cast<const unsigned char*>(W + (size_t)r_begin * H) + off, min(16384u, min(total, cap) - off) & ~15u);
  }
  wait_inputs(c);
  float* xs = reinterpret_cast<float*>(smem);
  const half* x = ptr<const half>(c.tab, T_X);
  const half* nw = ptr<const half>(c.tab, T_NORM);
  const float rinv = rms_inv(x, red, c.eps);
  for (int ch = threadIdx.x; ch < H / 8; ch += kThreads) {     // y = fp16(norm), staged as fp32
    const uint4 y = norm_chunk(x, nw, rinv, ch);
    const half* yh = reinterpret_cast<const half*>(&y);
#pragma unroll
    for (int i = 0; i < 8; ++i) xs[8 * ch + i] = __half2float(yh[i]);
  }
  cta_sync();   // all threads: xs complete
  const float4* xs4 = reinterpret_cast<const float4*>(xs);
  float* logits = ptr<float>(c.tab, T_LOGITS);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int chunks = H / 8;
  nq::ArgBest best{NQ_NEG_INF, V};
  for (int r0 = r_begin + warp * kLmRows; r0 < r_end; r0 += kWarps * kLmRows) {
    const uint4* rows[kLmRows];
#pragma unroll
    for (int r = 0; r < kLmRows; ++r) rows[r] = reinterpret_cast<const uint4*>(W + (size_t)min(r0 + r, r_end - 1) * H);
    float acc[kLmRows];
#pragma unroll
    for (int r = 0; r < kLmRows; ++r) acc[r] = 0.f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * kLmUnroll) {
      uint4 wv[kLmUnroll][kLmRows];
#pragma unroll
      for (int k = 0; k < kLmUnroll; ++k)
#pragma unroll
        for (int r = 0; r < kLmRows; ++r)
          if (c0 + 32 * k < chunks) wv[k][r] = nq::ldg_stream(rows[r] + c0 + 32 * k);
#pragma unroll
      for (int k = 0; k < kLmUnroll; ++k) {
        const int ch = c0 + 32 * k;
        if (ch < chunks) {
          const float4 xa = xs4[2 * ch], xb = xs4[2 * ch + 1];
#pragma unroll
          for (int r = 0; r < kLmRows; ++r) acc[r] = nq::dot8(acc[r], wv[k][r], xa, xb);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kLmRows; ++r) {
      for (int o = 16; o >= 1; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
      if (r0 + r < r_end) {
        if (lane == 0) logits[r0 + r] = acc[r];
        best.take(acc[r], r0 + r);
      }
    }
  }
  int* token = c.scalars + S_TOKEN * NQ_SCALAR_STRIDE;
  const bool wrote = nq::argmax_finish<kThreads, kLoaderWarp ? 1 : 0>(best, ptr<float>(c.tab, T_ARG_VAL), ptr<int>(c.tab, T_ARG_IDX),
                                                 ptr<unsigned>(c.tab, T_ARG_CNT), token);
  if (wrote && threadIdx.x == 0) {                 // engine_step.cu's nq_step_end
    int* s = c.scalars;
    const int p = s[S_POSITION * NQ_SCALAR_STRIDE];
    ptr<int>(c.tab, T_GENERATED)[p] = *token;
    s[S_POSITION * NQ_SCALAR_STRIDE] = p + 1;
  }
  signal_done(c, idx, num_layers, K_LM_HEAD, c.grid);
}

}  // namespace pd
