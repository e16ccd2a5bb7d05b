// gemv_int4.cu: the decode GEMVs the engines run, over INT4 ValueShuffle weights, batch 1,
// FP32 accumulation (the pieces are in gemv_int4.cuh; earlier versions in kernels/lab/gemv_*.cu).
//   nq_gemv_int4          out = fp16([residual +] W.x [+ bias]); x fp16 [K]; prmt/magic unpack, mma.sync
//   nq_gemv_int4_swiglu   same, x = fp16(silu(g) * u) formed on the fly from gate_up fp16 [2K]
// nq-variants: NQ_GEMV_UNROLL=2; NQ_GEMV_MTILES=2,NQ_GEMV_UNROLL=2; NQ_GEMV_WARPS=8,NQ_GEMV_UNROLL=2; NQ_GEMV_WARPS=2; NQ_GEMV_FOLD=1; NQ_GEMV_FOLD=1,NQ_GEMV_UNROLL=2; NQ_GEMV_FOLD=1,NQ_GEMV_MTILES=2,NQ_GEMV_UNROLL=2; NQ_GEMV_FOLD=1,NQ_GEMV_WARPS=8,NQ_GEMV_UNROLL=2; NQ_GEMV_FOLD=1,NQ_GEMV_WARPS=2
#include "gemv_int4.cuh"

// [entry]
// grid (ceil(N / (16*MTILES)), ksplit), block 32*WARPS, dynamic smem ceil(G/ksplit)*320 B.
extern "C" __global__ void __launch_bounds__(nq::kThreads, NQ_GEMV_MIN_CTAS)
nq_gemv_int4(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
             half* out, const half* bias, const half* residual, float* ws, int* counters,
             int N, int K, int ksplit) {
  nq::gemv_body<nq::PrmtMmaPath>(nq::StageX{x}, qw, scales, nullptr,
                                 nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}
// [/entry]

// gate_up fp16 [2K] (gate rows then up rows); K = intermediate. Same grid as nq_gemv_int4.
extern "C" __global__ void __launch_bounds__(nq::kThreads, NQ_GEMV_MIN_CTAS)
nq_gemv_int4_swiglu(const half* __restrict__ gate_up, const uint32_t* __restrict__ qw,
                    const half* __restrict__ scales, half* out, const half* bias, const half* residual,
                    float* ws, int* counters, int N, int K, int ksplit) {
  nq::gemv_body<nq::PrmtMmaPath>(nq::StageSwiglu{gate_up}, qw, scales, nullptr,
                                 nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}
