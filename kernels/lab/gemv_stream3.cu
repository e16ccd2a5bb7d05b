// lab/gemv_stream3.cu: the decode INT4 GEMV over layout 3 (INT4 lane-fragment), weights from DRAM straight to registers.
//   nq_gemv_s3          out = fp16([residual +] W.x [+ bias]); x fp16 [K]
//   nq_gemv_s3_swiglu   same, x = fp16(silu(g) * u) formed from gate_up fp16 [2K] per CTA
//   compile-time: NQ_S3_{WARPS,RING,MIN_CTAS,FOLD} (nanoqwen.yaml tuning lab/gemv_stream3)
// nq-variants: NQ_S3_FOLD=1; NQ_S3_WARPS=8,NQ_S3_MIN_CTAS=3; NQ_S3_WARPS=8,NQ_S3_MIN_CTAS=3,NQ_S3_FOLD=1; NQ_S3_RING=2; NQ_S3_RING=8,NQ_S3_MIN_CTAS=2; NQ_S3_RING=8,NQ_S3_MIN_CTAS=2,NQ_S3_FOLD=1; NQ_S3_MIN_CTAS=6
//
// Layout 3 and the per-group pieces: kernels/stream3.cuh ([s3-layout], [s3-load], [s3-group], [s3-fold]).
//
// [s3-work]
// Work: a warp owns one 16-row tile and one contiguous K slice of it, [gs, ge) of the G groups:
// a contiguous byte run of (ge - gs) * 1056 bytes, read front to back. A CTA is NQ_S3_WARPS
// warps on consecutive tiles with the same slice (grid (ceil(T / WARPS), ksplit)), so the CTA
// stages x (or the SwiGLU act) of its slice once, in shared memory padded as gemv_int4.cuh does
// (320 bytes a group: lane run t at 80 t, conflict-free LDS.128). ksplit > 1: the slices meet
// in the FP32 workspace and the last CTA of a tile set adds them in slice order (deterministic,
// as gemv_int4.cuh's gemv_body), then runs the epilogue.
//
// Bytes in flight (the point of the kernel; counted before the first measurement).
// Little's law: ~4.5 TB/s x ~700 ns DRAM latency = ~3.2 MB in flight over 132 SMs = ~24 KB
// per SM. A warp keeps a ring of NQ_S3_RING groups of registers (9 per lane per group: two
// uint4 + one half2 of scales); it refills a slot right after multiplying it, so RING - 1 to
// RING groups = 3.1-4.2 KB (RING 4) are in flight per warp from its first load to its last.
// gate_up (T = 2368 tiles, ksplit 1): 592 CTAs of 4 warps, ~4.5 CTAs = 18 warps per SM
// (one wave: NQ_S3_MIN_CTAS = 5 caps registers at 96, so 5 CTAs = 660 slots fit; 101 uncapped
// would allot 104 a lane and fit only 4 = 528 slots, two waves), ~57-76 KB per SM in flight,
// 2-3x the 24 KB needed. down (T = 224, ksplit ~10): ~17 warps per SM, ~70 KB per SM.
// The first RING loads are issued before the x staging, so staging hides under them.
// [/s3-work]
#include "stream3.cuh"   // layout 3: Slot, load_slot, group, stage_fold (and gemv_int4.cuh: silu_mul, Epilogue, store_row)

#ifndef NQ_S3_WARPS   // warps (tiles) per CTA
#error "NQ_S3_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_S3_RING   // groups in flight per warp
#error "NQ_S3_RING: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_S3_MIN_CTAS   // __launch_bounds__ minimum CTAs per SM (caps registers)
#error "NQ_S3_MIN_CTAS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_S3_FOLD   // 1: the MMA reads offset codes, one correction per group (gemv_int4.cuh [fold])
#error "NQ_S3_FOLD: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
static_assert(NQ_S3_WARPS >= 1 && NQ_S3_WARPS <= 16, "1..16 warps per CTA");
static_assert(NQ_S3_RING >= 1 && NQ_S3_RING <= 8, "1..8 groups in flight per warp");
static_assert(NQ_S3_FOLD == 0 || NQ_S3_FOLD == 1, "NQ_S3_FOLD is 0 or 1");

namespace nqs3 {
constexpr int kWarps = NQ_S3_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kRing = NQ_S3_RING;

// x (chunk c of the slice: 8 halves) -> padded shared memory, c -> c + c/4 in 16-byte units.
__device__ __forceinline__ void stage_x(unsigned char* xs, const half* __restrict__ x, int gs, int ng, int) {
  const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)gs * NQ_GROUP_SIZE);
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = threadIdx.x; c < ng * (NQ_GROUP_SIZE / 8); c += kThreads) dst[c + c / 4] = src[c];
}
// SwiGLU: act = fp16(silu(g) * u), g = gate_up[k], u = gate_up[K + k] (gemv_int4.cuh [swiglu]).
__device__ __forceinline__ void stage_swiglu(unsigned char* xs, const half* __restrict__ gate_up, int gs, int ng,
                                             int K) {
  const uint4* gsrc = reinterpret_cast<const uint4*>(gate_up + (size_t)gs * NQ_GROUP_SIZE);
  const uint4* usrc = reinterpret_cast<const uint4*>(gate_up + (size_t)K + (size_t)gs * NQ_GROUP_SIZE);
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = threadIdx.x; c < ng * (NQ_GROUP_SIZE / 8); c += kThreads) {
    dst[c + c / 4] = nq::swiglu8(gsrc[c], usrc[c]);
  }
}

__device__ __forceinline__ void stage_fold(unsigned char* xs, int ng) {
  nqs3::stage_fold<NQ_S3_FOLD != 0>(xs, ng, threadIdx.x, kThreads);
}

// [s3-body]
template <bool kSwiglu>
__device__ __forceinline__ void body(const half* __restrict__ act, const unsigned char* __restrict__ w,
                                     const nq::Epilogue& e, int N, int K) {
  extern __shared__ __align__(16) unsigned char xs[];
  __shared__ int is_last;
  const int G = K / NQ_GROUP_SIZE, T = (N + 15) / 16;
  const int gs = (int)((long long)blockIdx.y * G / e.ksplit);
  const int ng = (int)((long long)(blockIdx.y + 1) * G / e.ksplit) - gs;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x * kWarps + warp;
  const bool live = tile < T;                       // warp-uniform
  const unsigned char* base = w + ((size_t)(live ? tile : 0) * G + gs) * kBlockBytes;

  // The first kRing groups fly while the CTA stages its activations.
  Slot r[kRing];
#pragma unroll
  for (int u = 0; u < kRing; ++u)
    if (live && u < ng) load_slot(r[u], base + (size_t)u * kBlockBytes, lane);
  if (kSwiglu) stage_swiglu(xs, act, gs, ng, K);
  else stage_x(xs, act, gs, ng, K);
  __syncthreads();   // all threads: the staged activations are complete
  stage_fold(xs, ng);
  __syncthreads();   // all threads: the folds and magic words are complete

  float acc0 = 0.f, acc1 = 0.f;
  if (live) {
    const unsigned char* xl = xs + t * kXLaneBytes;
    // [s3-main-loop]
#pragma unroll 1
    for (int b = 0; b < ng; b += kRing) {
#pragma unroll
      for (int u = 0; u < kRing; ++u) {
        if (b + u < ng) {                             // warp-uniform
          group<NQ_S3_FOLD != 0>(acc0, acc1, r[u], xl + (b + u) * kXGroupBytes);
          if (b + u + kRing < ng) load_slot(r[u], base + (size_t)(b + u + kRing) * kBlockBytes, lane);
        }
      }
    }
    // [/s3-main-loop]
  }
  // Every lane of a row's quad holds the full sum (B's columns are all x); t == 0 stores.
  const int row0 = tile * 16 + g, row1 = row0 + 8;
  if (e.ksplit == 1) {
    if (live && t == 0) {
      if (row0 < N) nq::store_row(e, row0, acc0);
      if (row1 < N) nq::store_row(e, row1, acc1);
    }
    return;
  }
  // Split-K: publish this slice, then the last CTA of the tile set adds the slices in order.
  if (live && t == 0) {
    if (row0 < N) e.ws[(size_t)blockIdx.y * N + row0] = acc0;
    if (row1 < N) e.ws[(size_t)blockIdx.y * N + row1] = acc1;
    __threadfence();                       // the slice is visible before the counter moves
  }
  __syncthreads();   // all threads: this CTA's slice is stored and fenced
  if (threadIdx.x == 0) is_last = atomicAdd(&e.counters[blockIdx.x], 1) == e.ksplit - 1;
  __syncthreads();   // all threads: is_last is known
  if (!is_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < 16 * kWarps; i += kThreads) {
    const int row = blockIdx.x * 16 * kWarps + i;
    if (row < N) {
      float v = 0.f;
      for (int s = 0; s < e.ksplit; ++s) v += __ldcg(&e.ws[(size_t)s * N + row]);   // L2, not L1
      nq::store_row(e, row, v);
    }
  }
  if (threadIdx.x == 0) e.counters[blockIdx.x] = 0;   // ready for the next launch
}
// [/s3-body]
}  // namespace nqs3

// [s3-entry]
// w: layout 3, ceil(N/16) * (K/128) * 1056 bytes, 16-byte aligned. grid (ceil(ceil(N/16) / WARPS),
// ksplit), block 32 * WARPS, dynamic shared memory ceil(G / ksplit) * 320 bytes.
extern "C" __global__ void __launch_bounds__(nqs3::kThreads, NQ_S3_MIN_CTAS)
nq_gemv_s3(const half* __restrict__ x, const unsigned char* __restrict__ w, half* out, const half* bias,
           const half* residual, float* ws, int* counters, int N, int K, int ksplit) {
  nqs3::body<false>(x, w, nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}

// gate_up fp16 [2K] (gate then up), K = intermediate.
extern "C" __global__ void __launch_bounds__(nqs3::kThreads, NQ_S3_MIN_CTAS)
nq_gemv_s3_swiglu(const half* __restrict__ gate_up, const unsigned char* __restrict__ w, half* out,
                  const half* bias, const half* residual, float* ws, int* counters, int N, int K, int ksplit) {
  nqs3::body<true>(gate_up, w, nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}
// [/s3-entry]
