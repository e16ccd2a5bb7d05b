// lab/gemv_stream.cu: version 3 of the decode GEMV, persistent stream-K kernels (slower than
// the tiles kernel: PERFLOG.md v3).
//   nq_gemv_int4_stream, nq_gemv_int4_swiglu_stream  prmt/mma path, x staged whole per CTA
//   nq_gemv_int4_dp4a_stream                         the dp4a path (lab/dp4a.cuh)
//   compile-time: NQ_GEMV_STREAM_{WARPS,RING} (and the tiles knobs; NQ_GEMV_MTILES must be 1)
// nq-variants: NQ_GEMV_STREAM_WARPS=8,NQ_GEMV_STREAM_RING=8; NQ_GEMV_FOLD=1; NQ_GEMV_FOLD=1,NQ_GEMV_STREAM_WARPS=8,NQ_GEMV_STREAM_RING=8
#include "lab/dp4a.cuh"

static_assert(NQ_GEMV_MTILES == 1, "the stream kernels own 16-row tiles");

namespace nq {
// ---- v3: the stream kernels (persistent, stream-K) ----------------------------------------
// The work is T = ceil(N/16) tiles x G groups = U units of 16 rows x 128 inputs (1 KB of
// weights), numbered tile-major. Global warp w of NW = gridDim.x * STREAM_WARPS owns units
// [start(w), start(w+1)), start(w) = floor(w * U / NW): every warp streams the same number
// of bytes (+-1 unit), with a ring of UNROLL units in flight that runs across tile
// boundaries, so no warp waits at a tile's end. The CTA stages all of x once. A tile the
// warp covered whole is stored at once; a partial tile's sums go to slot (tile, w - w1)
// of the workspace, w1 = owner of the tile's first unit; the warp whose units complete the
// tile's count of G adds the slots in warp order (deterministic) and stores the rows.
#ifndef NQ_GEMV_STREAM_WARPS   // warps per CTA (one CTA per SM at 16)
#error "NQ_GEMV_STREAM_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_GEMV_STREAM_RING   // units in flight per warp
#error "NQ_GEMV_STREAM_RING: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
constexpr int kStreamWarps = NQ_GEMV_STREAM_WARPS;
constexpr int kRing = NQ_GEMV_STREAM_RING;
constexpr int kStreamThreads = 32 * kStreamWarps;

struct StreamGrid {
  long long U;  // units
  int NW;       // warps in the grid
  __device__ __forceinline__ long long start(int w) const { return (long long)w * U / NW; }
  // The largest w with start(w) <= u: the warp that owns unit u.
  __device__ __forceinline__ int owner(long long u) const { return (int)(((u + 1) * NW - 1) / U); }
};

template <class Path>
__device__ __forceinline__ void stream_flush(float (&acc)[kMTiles][2], const Epilogue& e, const Geometry& q,
                                             const StreamGrid& sg, int w, int tile, int units, int cmax) {
  Path::finish(acc);
  const int row_a = tile * 16 + q.g, row_b = row_a + 8;
  if (units == q.G) {                              // the whole tile is this warp's
    if (q.t == 0) {
      if (row_a < q.N) store_row(e, row_a, acc[0][0]);
      if (row_b < q.N) store_row(e, row_b, acc[0][1]);
    }
    return;
  }
  const long long first = (long long)tile * q.G;
  const int w1 = sg.owner(first);
  float* slots = e.ws + (size_t)tile * cmax * 16;
  if (q.t == 0) {
    slots[(w - w1) * 16 + q.g] = acc[0][0];
    slots[(w - w1) * 16 + q.g + 8] = acc[0][1];
    __threadfence();                               // the slot is visible before the count moves
  }
  __syncwarp();
  int last = 0;
  if (q.lane == 0) last = atomicAdd(&e.counters[tile], units) + units == q.G;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  const int w2 = sg.owner(first + q.G - 1);
  if (q.lane < 16) {
    float v = 0.f;
    for (int ww = w1; ww <= w2; ++ww)              // warp order; empty warps wrote nothing
      if (sg.start(ww) < sg.start(ww + 1)) v += __ldcg(&slots[(ww - w1) * 16 + q.lane]);
    const int row = tile * 16 + q.lane;
    if (row < q.N) store_row(e, row, v);
  }
  if (q.lane == 0) e.counters[tile] = 0;           // ready for the next launch
}

template <class Path, class Stage>
__device__ __forceinline__ void gemv_stream_body(const Stage& stage, const uint32_t* __restrict__ qw,
                                                 const half* __restrict__ scales, const float* xscale,
                                                 const Epilogue& e, int N, int K, int cmax) {
  extern __shared__ __align__(16) unsigned char xs[];
  Geometry q;
  q.N = N; q.K = K; q.G = K / NQ_GROUP_SIZE; q.KW = K / 8; q.row0 = 0; q.gs = 0; q.ng = q.G;
  q.lane = threadIdx.x & 31; q.warp = threadIdx.x >> 5; q.g = q.lane >> 2; q.t = q.lane & 3;
  const int tiles = (N + 15) / 16;
  StreamGrid sg{(long long)tiles * q.G, (int)gridDim.x * kStreamWarps};
  const int w = blockIdx.x * kStreamWarps + q.warp;
  const long long u0 = sg.start(w);
  const int n = (int)(sg.start(w + 1) - u0);

  // Load cursor (tile, group) runs kRing units ahead of the compute cursor.
  int ld_tile = (int)(u0 / q.G), ld_grp = (int)(u0 % q.G);
  GroupRegs ring[kRing];
#pragma unroll
  for (int j = 0; j < kRing; ++j) {
    if (j < n) {
      load_rows(ring[j], qw, scales, q, ld_tile * 16, ld_grp);
      if (++ld_grp == q.G) { ld_grp = 0; ++ld_tile; }
    }
  }
  stage(xs, q);
  __syncthreads();   // all threads: x (all of K) is staged; no barrier follows

  int c_tile = (int)(u0 / q.G), c_grp = (int)(u0 % q.G), c_units = 0;
  float acc[kMTiles][2] = {{0.f, 0.f}};
#pragma unroll 1
  for (int i = 0; i < n; i += kRing) {
#pragma unroll
    for (int j = 0; j < kRing; ++j) {
      if (i + j < n) {                             // warp-uniform
        Path::group(acc, ring[j], xs + Path::smem_offset_bytes(c_grp, q.t), c_grp, xscale);
        if (i + j + kRing < n) {                 // refill the slot just consumed
          load_rows(ring[j], qw, scales, q, ld_tile * 16, ld_grp);
          if (++ld_grp == q.G) { ld_grp = 0; ++ld_tile; }
        }
        ++c_units;
        if (c_grp == q.G - 1 || i + j == n - 1) {  // the tile ends, or this warp's range does
          stream_flush<Path>(acc, e, q, sg, w, c_tile, c_units, cmax);
          acc[0][0] = acc[0][1] = 0.f;
          c_units = 0;
        }
        if (++c_grp == q.G) { c_grp = 0; ++c_tile; }
      }
    }
  }
}

}  // namespace nq

// ---- v3 entry points: grid = any number of CTAs (persistent), block 32*STREAM_WARPS,
// dynamic smem = all of K staged (K*5/2 bytes fp16, K bytes int8). ws holds
// ceil(N/16) * cmax * 16 floats, cmax = (G-1)*NW/U + 2 (NW warps, U units); counters one
// int per tile, zero before the first launch and left zero after each.
extern "C" __global__ void __launch_bounds__(nq::kStreamThreads, 1)
nq_gemv_int4_stream(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
                    half* out, const half* bias, const half* residual, float* ws, int* counters,
                    int N, int K, int cmax) {
  nq::gemv_stream_body<nq::PrmtMmaPath>(nq::StageX{x}, qw, scales, nullptr,
                                        nq::Epilogue{out, bias, residual, ws, counters, 1}, N, K, cmax);
}

extern "C" __global__ void __launch_bounds__(nq::kStreamThreads, 1)
nq_gemv_int4_swiglu_stream(const half* __restrict__ gate_up, const uint32_t* __restrict__ qw,
                           const half* __restrict__ scales, half* out, const half* bias, const half* residual,
                           float* ws, int* counters, int N, int K, int cmax) {
  nq::gemv_stream_body<nq::PrmtMmaPath>(nq::StageSwiglu{gate_up}, qw, scales, nullptr,
                                        nq::Epilogue{out, bias, residual, ws, counters, 1}, N, K, cmax);
}

extern "C" __global__ void __launch_bounds__(nq::kStreamThreads, 1)
nq_gemv_int4_dp4a_stream(const int8_t* __restrict__ xq, const float* __restrict__ xscale,
                         const uint32_t* __restrict__ qw, const half* __restrict__ scales, half* out,
                         const half* bias, const half* residual, float* ws, int* counters,
                         int N, int K, int cmax) {
  nq::gemv_stream_body<nq::Dp4aPath>(nq::StageXq{xq}, qw, scales, xscale,
                                     nq::Epilogue{out, bias, residual, ws, counters, 1}, N, K, cmax);
}
