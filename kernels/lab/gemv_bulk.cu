// lab/gemv_bulk.cu: version 5 of the decode GEMV, persistent, the weights streamed into a
// shared-memory ring by cp.async.bulk (a negative result: PERFLOG.md v5).
//   nq_gemv_int4_bulk, nq_gemv_int4_swiglu_bulk  a producer warp + NQ_BULK_CONSUMER_WARPS consumers
//   NQ_BULK_COPY_ONLY=1   a measurement, not a kernel: the consumers release each stage unread
//   NQ_BULK_WAIT_NS > 0   the ring's waits carry that suspend-time hint
//   compile-time: NQ_BULK_{STAGES,GROUPS,MAX_ITEM_GROUPS,CONSUMER_WARPS,WAIT_NS,COPY_ONLY} (NQ_GEMV_MTILES must be 1)
// nq-variants: NQ_BULK_STAGES=8,NQ_BULK_GROUPS=4; NQ_BULK_GROUPS=16,NQ_BULK_STAGES=2,NQ_GEMV_FOLD=1; NQ_BULK_COPY_ONLY=1
#include "gemv_int4.cuh"

static_assert(NQ_GEMV_MTILES == 1, "the bulk kernels own 16-row tiles");

namespace nq {
using namespace hopper;   // mbarriers, bulk copies, fences

// The consumer warps stage x: a subset of the CTA's threads, named by index and count.
struct SomeThreads {
  int i, n;
  __device__ int tid() const { return i; }
  __device__ int count() const { return n; }
};
__device__ __forceinline__ void copy_x(unsigned char* xs, const uint4* src, const Geometry& q, const SomeThreads& th) {
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = th.i; c < q.ng * (NQ_GROUP_SIZE / 8); c += th.n) dst[c + c / 4] = src[c];
}

// ---- v5: the bulk kernels (persistent; the copy engine streams the weights) ---------------
// v2-v4 hold every weight in flight in registers (166-180 per thread, ~12 warps per SM), so
// an SM has ~50 KB of loads outstanding at best and every CTA boundary drains it; the FP8
// GEMV, with 64 light warps per SM, reads at ~83% of the ceiling (PERFLOG.md). Here the
// weights travel by cp.async.bulk into a ring of shared-memory stages, so bytes in flight
// no longer cost registers. Roles in a CTA of 1 + NQ_BULK_CONSUMER_WARPS warps (the paged
// attention's scheme; measured slower than the tiles kernel, PERFLOG.md v5):
//   warp 0      producer: lanes 0..15 each copy one row's segment of a stage (16 rows x
//               up to NQ_BULK_GROUPS groups x 64 B), after lane 0 posts the stage's bytes
//               on its full barrier (arrive.expect_tx)
//   warps 1..C  consumers (C = 4 or 8): stage all of x once, then per stage warp cw multiplies
//               the stage's groups cw, cw + C, ... exactly as the tiles kernel does (prmt or
//               FOLD unpack, mma.sync, scale FMA), reading the weights from shared memory
// Work items are (16-row tile, K slice) pairs, item = tile * ksplit + slice, dealt to the
// persistent CTAs round-robin; one stage counter runs across a CTA's items, so the ring
// never drains between them. A split item publishes its slice to the FP32 workspace and
// the last CTA of the tile adds the slices in slice order (deterministic), as in v2.
// Scales (2 bytes per row and group) go by ordinary loads, one item ahead, into registers
// and then shared memory: a bulk copy needs 16-byte aligned segments, which the rows of an
// [N, K/128] fp16 array are not.
#ifndef NQ_BULK_STAGES   // ring stages
#error "NQ_BULK_STAGES: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_BULK_GROUPS   // groups per stage
#error "NQ_BULK_GROUPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_BULK_MAX_ITEM_GROUPS   // most groups of one work item (its scale buffer)
#error "NQ_BULK_MAX_ITEM_GROUPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_BULK_CONSUMER_WARPS   // consumer warps per CTA (4 or 8)
#error "NQ_BULK_CONSUMER_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
// NQ_BULK_WAIT_NS > 0: the ring's waits carry that suspend-time hint (mbar_wait_suspend).
#ifndef NQ_BULK_WAIT_NS   // > 0: the ring's waits carry that suspend-time hint (ns)
#error "NQ_BULK_WAIT_NS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
// NQ_BULK_COPY_ONLY 1 is a measurement, not a kernel: the consumers wait for each stage and
// release it without reading it, so the launch times the copy path alone (its roofline) and
// its outputs are meaningless. Only tools/bench_gemv.py builds it, and labels it so.
#ifndef NQ_BULK_COPY_ONLY   // 1: a measurement (consumers release stages unread)
#error "NQ_BULK_COPY_ONLY: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
constexpr int kBulkStages = NQ_BULK_STAGES;
constexpr int kBulkGroups = NQ_BULK_GROUPS;                 // groups per stage
constexpr int kBulkConsumerWarps = NQ_BULK_CONSUMER_WARPS;
constexpr int kBulkConsumers = 32 * kBulkConsumerWarps;
constexpr int kBulkThreads = 32 + kBulkConsumers;
// A stage row is kBulkGroups * 64 bytes, padded to an odd multiple of 64: lane (g, t) reads
// 16 bytes at g * stride + 16 t, so rows g and g + 1 start 16 banks apart and each
// quarter-warp's eight 16-byte reads cover the 32 banks once.
constexpr int kBulkRowStride = kBulkGroups * 64 + (kBulkGroups % 2 == 0 ? 64 : 0);
constexpr int kBulkStageBytes = 16 * kBulkRowStride;
constexpr int kBulkMaxItemGroups = NQ_BULK_MAX_ITEM_GROUPS;
constexpr int kBulkScaleHalves = 16 * kBulkMaxItemGroups;  // one item's scales
constexpr int kBulkScaleRegs = (kBulkScaleHalves + kBulkConsumers - 1) / kBulkConsumers;
static_assert(kBulkGroups >= 1 && kBulkGroups <= 16, "1..16 groups per stage");
static_assert(kBulkStages >= 2 && kBulkStages <= 8, "2..8 stages");
static_assert(kBulkConsumerWarps == 4 || kBulkConsumerWarps == 8, "4 or 8 consumer warps");
static_assert(kBulkStageBytes % 128 == 0, "stages stay 128-byte aligned (bulk copies need 16)");
static_assert(kBulkScaleHalves % 8 == 0, "the scale buffers keep x's 16-byte alignment");

__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
  if (NQ_BULK_WAIT_NS > 0) mbar_wait_suspend(bar, parity, NQ_BULK_WAIT_NS);
  else mbar_wait(bar, parity);
}

__device__ __forceinline__ void bulk_consumer_barrier() {   // named barrier 1: the consumers only
  asm volatile("bar.sync 1, %0;" :: "n"(kBulkConsumers) : "memory");
}

struct BulkItem {            // item -> (tile, slice) and the slice's groups [gs, gs + ng)
  int tile, slice, gs, ng;
  __device__ BulkItem(int item, int ksplit, int G) {
    tile = item / ksplit;
    slice = item % ksplit;
    gs = (int)((long long)slice * G / ksplit);
    ng = (int)((long long)(slice + 1) * G / ksplit) - gs;
  }
};

// Dynamic shared memory: [ring: kBulkStages x kBulkStageBytes][x: G x 320 B][scales: 2 x kBulkScaleHalves fp16].
// grid: any (persistent; the launcher uses min(items, CTAs that fit)); block kBulkThreads.
template <class Stage>
__device__ __forceinline__ void gemv_bulk_body(const Stage& stage, const uint32_t* __restrict__ qw,
                                               const half* __restrict__ scales, const Epilogue& e,
                                               int N, int K) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kBulkStages], empty[kBulkStages];
  __shared__ float red[kBulkConsumerWarps][16];
  __shared__ int is_last;
  unsigned char* ring = smem;
  unsigned char* xs = smem + kBulkStages * kBulkStageBytes;
  const int G = K / NQ_GROUP_SIZE, KW = K / 8;
  half* sc = reinterpret_cast<half*>(xs + G * kSmemGroupHalves * 2);
  const int tiles = (N + 15) / 16, items = tiles * e.ksplit;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kBulkStages; ++s) {
      mbar_init(&full[s], 1);                       // the producer's arrive.expect_tx
      mbar_init(&empty[s], kBulkConsumerWarps);     // lane 0 of each consumer warp
    }
    fence_mbarrier_init();
  }
  __syncthreads();   // all threads, before the role split: barriers initialised

  if (warp == 0) {
    // [bulk-produce]
    int it = 0;                                      // stages issued so far, across items
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const BulkItem w(item, e.ksplit, G);
      const int row = min(w.tile * 16 + (lane & 15), N - 1);   // rows past N: copies of the last
      for (int j = 0; j < w.ng; j += kBulkGroups, ++it) {
        const int s = it % kBulkStages;
        bulk_wait(&empty[s], ((it / kBulkStages) & 1) ^ 1);    // the first round passes at once
        const int nc = min(kBulkGroups, w.ng - j);
        if (lane == 0) mbar_arrive_expect_tx(&full[s], 16 * nc * 64);
        __syncwarp();
        if (lane < 16)
          bulk_copy_g2s(ring + s * kBulkStageBytes + lane * kBulkRowStride,
                        qw + (size_t)row * KW + (size_t)(w.gs + j) * kGroupWords, nc * 64, &full[s]);
      }
    }
    // [/bulk-produce]
    return;
  }

  // [bulk-consume]
  const int ct = threadIdx.x - 32, cw = warp - 1;
  Geometry q;                    // staging covers all of K, with the consumer threads only
  q.N = N; q.K = K; q.G = G; q.KW = KW; q.row0 = 0; q.gs = 0; q.ng = G;
  q.lane = lane; q.warp = cw; q.g = lane >> 2; q.t = lane & 3;
  stage(xs, q, SomeThreads{ct, kBulkConsumers});   // the producer's first copies are in flight meanwhile
  // An item's scales: sc[buf][r * kBulkMaxItemGroups + i] = scales[row r of the tile][gs + i].
  half pre[kBulkScaleRegs];
  auto load_scales = [&](int item) {
    const BulkItem w(item, e.ksplit, G);
#pragma unroll
    for (int u = 0; u < kBulkScaleRegs; ++u) {
      const int i = ct + u * kBulkConsumers;
      const int r = i / kBulkMaxItemGroups, c = i % kBulkMaxItemGroups;
      pre[u] = (i < kBulkScaleHalves && c < w.ng)
                   ? scales[(size_t)min(w.tile * 16 + r, N - 1) * G + w.gs + c] : __float2half(0.f);
    }
  };
  if (blockIdx.x < items) load_scales(blockIdx.x);
  int it = 0, buf = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x, buf ^= 1) {
    const BulkItem w(item, e.ksplit, G);
    half* scb = sc + buf * kBulkScaleHalves;
#pragma unroll
    for (int u = 0; u < kBulkScaleRegs; ++u) {
      const int i = ct + u * kBulkConsumers;
      if (i < kBulkScaleHalves) scb[i] = pre[u];
    }
    bulk_consumer_barrier();     // consumers: this item's scales (and, the first time, x) are staged
    if (item + (int)gridDim.x < items) load_scales(item + gridDim.x);   // in flight for a whole item
    float acc[1][2] = {{0.f, 0.f}};
    for (int j = 0; j < w.ng; j += kBulkGroups, ++it) {
      const int s = it % kBulkStages;
      bulk_wait(&full[s], (it / kBulkStages) & 1);
      const int nc = min(kBulkGroups, w.ng - j);
      const unsigned char* st = ring + s * kBulkStageBytes + q.t * 16;
      for (int c = cw; c < nc && !NQ_BULK_COPY_ONLY; c += kBulkConsumerWarps) {    // warp-uniform
        GroupRegs r;
        r.w[0][0] = *reinterpret_cast<const uint4*>(st + q.g * kBulkRowStride + c * 64);
        r.w[0][1] = *reinterpret_cast<const uint4*>(st + (q.g + 8) * kBulkRowStride + c * 64);
        r.s[0][0] = __half2float(scb[q.g * kBulkMaxItemGroups + j + c]);
        r.s[0][1] = __half2float(scb[(q.g + 8) * kBulkMaxItemGroups + j + c]);
        const int grp = w.gs + j + c;
        PrmtMmaPath::group(acc, r, xs + PrmtMmaPath::smem_offset_bytes(grp, q.t), grp, nullptr);
      }
      fence_proxy_async_smem();  // our reads of the stage precede its refill by the copy engine
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
    if (q.t == 0) { red[cw][q.g] = acc[0][0]; red[cw][q.g + 8] = acc[0][1]; }
    bulk_consumer_barrier();     // consumers: red[][] is complete
    const int row = w.tile * 16 + ct;
    float dot = 0.f;
    if (ct < 16) {
#pragma unroll
      for (int v = 0; v < kBulkConsumerWarps; ++v) dot += red[v][ct];
    }
    if (e.ksplit == 1) {
      if (ct < 16 && row < N) store_row(e, row, dot);
    } else {
      if (ct < 16 && row < N) {
        e.ws[(size_t)w.slice * N + row] = dot;
        __threadfence();         // the slice is visible before the counter moves
      }
      bulk_consumer_barrier();   // consumers: this slice is stored and fenced
      if (ct == 0) is_last = atomicAdd(&e.counters[w.tile], 1) == e.ksplit - 1;
      bulk_consumer_barrier();   // consumers: is_last is known
      if (is_last) {
        __threadfence();
        if (ct < 16 && row < N) {
          float v = 0.f;
          for (int s2 = 0; s2 < e.ksplit; ++s2) v += __ldcg(&e.ws[(size_t)s2 * N + row]);   // L2, not L1
          store_row(e, row, v);
        }
        if (ct == 0) e.counters[w.tile] = 0;   // ready for the next launch
      }
    }
    bulk_consumer_barrier();     // consumers: red[][], is_last and this scale buffer may be reused
  }
  // [/bulk-consume]
}
}  // namespace nq

// v5 bulk: grid any (persistent), block nq::kBulkThreads, dynamic smem
// kBulkStages * kBulkStageBytes + G * 320 + 2 * kBulkScaleHalves * 2 bytes (ops_gemv.bulk_smem_bytes).
extern "C" __global__ void __launch_bounds__(nq::kBulkThreads)
nq_gemv_int4_bulk(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
                  half* out, const half* bias, const half* residual, float* ws, int* counters,
                  int N, int K, int ksplit) {
  nq::gemv_bulk_body(nq::StageX{x}, qw, scales, nq::Epilogue{out, bias, residual, ws, counters, ksplit}, N, K);
}

extern "C" __global__ void __launch_bounds__(nq::kBulkThreads)
nq_gemv_int4_swiglu_bulk(const half* __restrict__ gate_up, const uint32_t* __restrict__ qw,
                         const half* __restrict__ scales, half* out, const half* bias, const half* residual,
                         float* ws, int* counters, int N, int K, int ksplit) {
  nq::gemv_bulk_body(nq::StageSwiglu{gate_up}, qw, scales, nq::Epilogue{out, bias, residual, ws, counters, ksplit},
                     N, K);
}
