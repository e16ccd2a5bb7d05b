// lab/gemv_v1.cu: version 1 of the tiles GEMV: one branch per group (`if (lg < ng)`), so the
// groups' MMA chains of a batch do not interleave (the engine's gemv_int4.cu is branchless).
//   nq_gemv_int4, nq_gemv_int4_swiglu   the engine's contract and grid
// nq-variants: NQ_GEMV_FOLD=1
#include "gemv_int4.cuh"

namespace nq {
// As gemv_body (gemv_int4.cuh), with the guard of version 1 in the batch loops.
template <class Path, class Stage>
__device__ __forceinline__ void gemv_body_v1(const Stage& stage, const uint32_t* __restrict__ qw,
                                          const half* __restrict__ scales, const float* xscale,
                                          const Epilogue& e, int N, int K) {
  extern __shared__ __align__(16) unsigned char xs[];
  __shared__ float red[kWarps][kRows];
  __shared__ int is_last;

  Geometry q;
  q.N = N; q.K = K; q.G = K / NQ_GROUP_SIZE; q.KW = K / 8;
  q.row0 = blockIdx.x * kRows;
  q.gs = (int)((long long)blockIdx.y * q.G / e.ksplit);
  q.ng = (int)((long long)(blockIdx.y + 1) * q.G / e.ksplit) - q.gs;
  q.lane = threadIdx.x & 31; q.warp = threadIdx.x >> 5; q.g = q.lane >> 2; q.t = q.lane & 3;

  // Local groups of this warp: warp, warp + kWarps, ...; batches of kUnroll of them.
  const int mine = q.warp < q.ng ? (q.ng - q.warp + kWarps - 1) / kWarps : 0;
  const int batches = (mine + kUnroll - 1) / kUnroll;
  auto local_group = [&](int b, int u) { return q.warp + kWarps * (b * kUnroll + u); };

  GroupRegs ra[kUnroll], rb[kUnroll];
  auto load_batch = [&](GroupRegs (&r)[kUnroll], int b) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int lg = local_group(b, u);
      if (lg < q.ng) load_group(r[u], qw, scales, q, q.gs + lg);
    }
  };
  float acc[kMTiles][2];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) acc[m][0] = acc[m][1] = 0.f;
  auto compute_batch = [&](const GroupRegs (&r)[kUnroll], int b) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int lg = local_group(b, u);
      if (lg < q.ng) Path::group(acc, r[u], xs + Path::smem_offset_bytes(lg, q.t), q.gs + lg, xscale);
    }
  };

  // [main-loop]
  // The first batch's weight loads fly while the CTA stages its activations.
  if (batches > 0) load_batch(ra, 0);
  stage(xs, q);
  __syncthreads();   // all threads: the staged activations are complete
  // Ping-pong between two register sets: batch b+1 is in flight while b is multiplied.
#pragma unroll 1
  for (int b = 0; b < batches; b += 2) {
    if (b + 1 < batches) load_batch(rb, b + 1);
    compute_batch(ra, b);
    if (b + 1 < batches) {
      if (b + 2 < batches) load_batch(ra, b + 2);
      compute_batch(rb, b + 1);
    }
  }
  Path::finish(acc);
  // [/main-loop]

  if (q.t == 0)
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      red[q.warp][16 * m + q.g] = acc[m][0];
      red[q.warp][16 * m + q.g + 8] = acc[m][1];
    }
  __syncthreads();   // all threads: red[][] is complete
  const int tid = threadIdx.x;
  const int row = q.row0 + tid;
  float dot = 0.f;
  if (tid < kRows) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) dot += red[w][tid];
  }
  if (e.ksplit == 1) {
    if (tid < kRows && row < N) store_row(e, row, dot);
    return;
  }
  // Split-K: publish this slice, then the last CTA of the tile adds the slices in order.
  if (tid < kRows && row < N) {
    e.ws[(size_t)blockIdx.y * N + row] = dot;
    __threadfence();                       // the slice is visible before the counter moves
  }
  __syncthreads();   // all threads: this CTA's slice is stored and fenced
  if (tid == 0) is_last = atomicAdd(&e.counters[blockIdx.x], 1) == e.ksplit - 1;
  __syncthreads();   // all threads: is_last is known
  if (!is_last) return;
  __threadfence();
  if (tid < kRows && row < N) {
    float v = 0.f;
    for (int s = 0; s < e.ksplit; ++s) v += __ldcg(&e.ws[(size_t)s * N + row]);   // L2, not L1
    store_row(e, row, v);
  }
  if (tid == 0) e.counters[blockIdx.x] = 0;   // ready for the next launch
}
}  // namespace nq

// grid (ceil(N / (16*MTILES)), ksplit), block 32*WARPS, dynamic smem ceil(G/ksplit)*320 B.
extern "C" __global__ void __launch_bounds__(nq::kThreads, NQ_GEMV_MIN_CTAS)
nq_gemv_int4(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
             half* out, const half* bias, const half* residual, float* ws, int* counters,
             int N, int K, int ksplit) {
  nq::gemv_body_v1<nq::PrmtMmaPath>(nq::StageX{x}, qw, scales, nullptr,
                                 nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}

// gate_up fp16 [2K] (gate rows then up rows); K = intermediate. Same grid as nq_gemv_int4.
extern "C" __global__ void __launch_bounds__(nq::kThreads, NQ_GEMV_MIN_CTAS)
nq_gemv_int4_swiglu(const half* __restrict__ gate_up, const uint32_t* __restrict__ qw,
                    const half* __restrict__ scales, half* out, const half* bias, const half* residual,
                    float* ws, int* counters, int N, int K, int ksplit) {
  nq::gemv_body_v1<nq::PrmtMmaPath>(nq::StageSwiglu{gate_up}, qw, scales, nullptr,
                                 nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}
