// gemv_int4.cuh: the pieces of the decode INT4 GEMV (kernels/gemv_int4.cu holds its entry
// points; kernels/lab/gemv_*.cu build the earlier versions from the same pieces).
//   compile-time (all from nanoqwen.yaml `tuning:`, nanoqwen_lib.config): NQ_GEMV_{WARPS,UNROLL,MTILES,MIN_CTAS},
//   NQ_GEMV_FOLD (prmt/mma unpack without the per-pair subtraction, see [fold])
//
// Shapes (runtime): qweight uint32 [N, K/8], scales fp16 [N, K/128], K a multiple of 128,
// any N >= 1. Tuned for the 7B decode shapes (N 3584..37888, K 3584 / 18944) on an H200.
//
// Work split ("tiles", v2; the launcher's default). A CTA owns 16*MTILES output rows (one tensor-core m-tile per MTILES) and a
// contiguous range of K-groups [gs, ge): blockIdx.y is the split-K slice (ksplit slices in
// all). Its WARPS warps share the range group by group (warp w takes local groups w,
// w+WARPS, ...), so every warp streams the same rows. Lane (g, t) = (lane/4, lane%4) reads
// 16 bytes (32 weights) of rows g and g+8 at byte 16t of each group's 64-byte run: four
// lanes cover one group of one row, and the warp's load is eight 64-byte runs. Partial sums
// meet in shared memory (fixed order); with ksplit > 1 each CTA stores its slice's sums to
// an FP32 workspace and the CTA that arrives last at the tile's counter adds the slices in
// slice order (deterministic) and runs the epilogue, then resets the counter to 0.
//
// What it degrades to: N not a multiple of 16 reads the last row again for the missing rows
// (never stored); a CTA's range is capped by its dynamic shared memory (the launcher picks
// ksplit so that ceil(G/ksplit) groups fit).
#pragma once
#include "hopper.cuh"   // common.cuh, and the mma.sync wrapper

#ifndef NQ_GEMV_X_GROUP_HALVES
#error "NQ_GEMV_X_GROUP_HALVES: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_GEMV_WARPS   // warps per CTA (split of the CTA's K range)
#error "NQ_GEMV_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_GEMV_UNROLL   // groups per warp whose loads are in flight together
#error "NQ_GEMV_UNROLL: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_GEMV_MIN_CTAS   // __launch_bounds__ minimum CTAs per SM (caps registers)
#error "NQ_GEMV_MIN_CTAS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_GEMV_MTILES   // 16-row tensor-core tiles per CTA (they share the x fragments)
#error "NQ_GEMV_MTILES: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_GEMV_FOLD   // 1: the MMA reads offset codes, one correction per group ([fold])
#error "NQ_GEMV_FOLD: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif

static_assert(NQ_LAYOUT_ID == 1, "this kernel reads layout 1 (INT4, ValueShuffle)");
static_assert(NQ_GROUP_SIZE == 128, "the lane map covers one group with 4 lanes x 16 bytes");
static_assert(NQ_GEMV_WARPS >= 1 && NQ_GEMV_WARPS <= 16, "1..16 warps per CTA");
static_assert(NQ_GEMV_UNROLL >= 1 && NQ_GEMV_UNROLL <= 8, "1..8 groups in flight per warp");
static_assert(NQ_GEMV_MTILES == 1 || NQ_GEMV_MTILES == 2, "one or two m-tiles per CTA");
static_assert(NQ_GEMV_FOLD == 0 || NQ_GEMV_FOLD == 1, "NQ_GEMV_FOLD is 0 or 1");

namespace nq {

constexpr int kWarps = NQ_GEMV_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = NQ_GEMV_UNROLL;
constexpr int kMTiles = NQ_GEMV_MTILES;
constexpr int kRows = 16 * kMTiles;
constexpr int kGroupWords = NQ_GROUP_SIZE / 8;                 // 16 uint32 per row per group
// FP16 activations in shared memory: each lane's 32-half run is followed by 8 halves of
// padding, so the four lanes t = 0..3 of a 16-byte read start at banks 0, 20, 8, 28 (no
// conflicts); lanes with the same t read the same address (broadcast).
// NQ_GEMV_FOLD=1 keeps the group's correction in that padding (see [fold-stage]).
constexpr int kSmemGroupHalves = NQ_GEMV_X_GROUP_HALVES;   // 160 (the launcher sizes shared memory by it)
static_assert(kSmemGroupHalves == NQ_GROUP_SIZE + NQ_GROUP_SIZE / 4, "each 32-half lane run is followed by 8 halves");

// ---- bit tricks ------------------------------------------------------------------------
// [unpack]
using nqptx::prmt;   // the PTX wrappers of common.cuh
using nqptx::hsub2;
// One ValueShuffle word -> four half2 (w0,w1) (w2,w3) (w4,w5) (w6,w7), exact signed codes.
// The word's 16-bit halves hold w0 w2 w4 w6 (low) and w1 w3 w5 w7 (high), 4 bits each, so
// one mask picks the same nibble of both halves: a consecutive pair at once.
// Magic numbers: an fp16 whose exponent makes the mantissa's bit 0 worth 1 is 1024 + m
// (0x6400 | m); with bit 4 worth 1 it is 64 + m/16 (0x5400 | m). A code s in [-8, 7] is a
// two's-complement nibble n; n ^ 8 = s + 8 (the offset-binary form), so
//   ((w & 0x000F000F) ^ 0x64086408) = fp16x2(1032 + s)   and  - 1032 gives s exactly,
//   ((w & 0x00F000F0) ^ 0x54805480) = fp16x2(72 + s)     and  -   72 gives s exactly
// (one LOP3 and one HSUB2 per pair). prmt moves bytes 1 and 3 down to 0 and 2 (w >> 8
// inside each half) so the same two masks reach (w4,w5) and (w6,w7).
constexpr uint32_t kMagicLo = 0x64086408u;   // fp16x2(1032, 1032)
constexpr uint32_t kMagicHi = 0x54805480u;   // fp16x2(72, 72)

__device__ __forceinline__ void unpack_int4x8_half2(uint32_t w, uint32_t (&p)[4]) {
  const uint32_t w_hi = prmt(w, 0u, 0x3311u);        // bytes (1,1,3,3): nibbles 2,3 -> 0,1
  p[0] = hsub2((w & 0x000F000Fu) ^ kMagicLo, kMagicLo);      // (w0, w1)
  p[1] = hsub2((w & 0x00F000F0u) ^ kMagicHi, kMagicHi);      // (w2, w3)
  p[2] = hsub2((w_hi & 0x000F000Fu) ^ kMagicLo, kMagicLo);   // (w4, w5)
  p[3] = hsub2((w_hi & 0x00F000F0u) ^ kMagicHi, kMagicHi);   // (w6, w7)
}
// [/unpack]

// [fold]
// NQ_GEMV_FOLD=1: the same unpack without the HSUB2s. The MMA reads 1032 + s (lo pairs) and
// 72 + s (hi pairs), both exact in fp16, and since it is linear, per row and group
//   sum_k (off_k + s_k) x_k = sum_k s_k x_k + 1032 * sum_lo x_k + 72 * sum_hi x_k.
// Which k are lo: in group() the A registers pa[0], pa[2] (lo pairs) share k-slots with
// B's b0 = xv[j].x / xv[j].z, pa[1], pa[3] (hi pairs) with b1 = xv[j].y / xv[j].w, so the
// halves 0,1,4,5 of every 16-byte x chunk are lo slots and 2,3,6,7 hi: k % 4 < 2 is lo.
// The staging stores fold = 1032 * sum_lo + 72 * sum_hi (fp32, of exactly the fp16 x the
// MMA reads) per group in the padding behind each lane's run; group() subtracts it from
// the two row sums before the scale (one FADD per row instead of 16 HSUB2 per row).
// The magic words come from shared memory too ({fold, kMagicLo, kMagicHi, 0}, one LDS.128
// per group). A LOP3 takes one 32-bit immediate, so (w & mask) ^ magic needs one of the two
// constants in a register; given literals, ptxas rematerializes that register before every
// LOP3 (the IMAD.MOV.U32 / MOV, one per pair, of the unfolded SASS) and, given a value it can
// trace to a literal (x | 0 with an opaque 0), splits the LOP3 in two. Loaded magic words
// are neither: the mask stays the immediate, and each pair is a single LOP3.
// Numerics: the running sums are those of (off + s) x, ~1032 / |s| times larger, and so is
// their fp32 rounding: per row and group |error| <~ n u (1032 sum_lo |x| + 72 sum_hi |x|),
// n ~ 8 MMA steps + the staging sums and fold, u = 2^-24 (2^-23 if the tensor core
// truncates). For random-sign x the sums cancel and the error is far below this bound
// (modelled: ~2^-20 of sum |w x| per output, against the fp16 rounding of 2^-11 |out|).
__device__ __forceinline__ void unpack_int4x8_offset(uint32_t w, uint32_t magic_lo, uint32_t magic_hi,
                                                     uint32_t (&p)[4]) {
  const uint32_t w_hi = prmt(w, 0u, 0x3311u);
  p[0] = (w & 0x000F000Fu) ^ magic_lo;      // (w0, w1) + 1032
  p[1] = (w & 0x00F000F0u) ^ magic_hi;      // (w2, w3) + 72
  p[2] = (w_hi & 0x000F000Fu) ^ magic_lo;   // (w4, w5) + 1032
  p[3] = (w_hi & 0x00F000F0u) ^ magic_hi;   // (w6, w7) + 72
}
constexpr float kFoldLo = 1032.f, kFoldHi = 72.f;
constexpr int kFoldOffsetWords = NQ_GROUP_SIZE / 8;   // the padding behind a lane's 32 halves
// [/fold]

// The m16n8k16 wrapper of hopper.cuh ([mma]). A rows are weight rows (g, g+8), the 16 k-slots
// are whatever k the lanes agree on (slot 2t,2t+1 / 2t+8,2t+9 belong to lane t in A and B
// alike), B's 8 columns all hold x, so c[0] (row g) and c[2] (row g+8) are the dot products
// and c[1], c[3] copies.
using hopper::mma_16816;

// [loads]
// Weights are read exactly once per token: keep them out of L1.
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;   // j is a compile-time constant
}

// ---- one group's registers: 32 weights of each of the lane's rows, and their scales ----
struct GroupRegs {
  uint4 w[kMTiles][2];     // [m-tile][row g / row g+8]
  float s[kMTiles][2];
};

struct Geometry {          // what every lane needs to address its rows
  int N, K, G, KW;         // rows, inputs, groups per row, words per row
  int row0, gs, ng;        // first row of the CTA, first group of its range, groups in it
  int lane, warp, g, t;
};

__device__ __forceinline__ void load_rows(GroupRegs& r, const uint32_t* __restrict__ qw,
                                          const half* __restrict__ scales, const Geometry& q,
                                          int row0, int grp) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * m + 8 * h + q.g, q.N - 1);
      const uint4* src = reinterpret_cast<const uint4*>(qw + (size_t)row * q.KW + (size_t)grp * kGroupWords);
      r.w[m][h] = ldg_stream(src + q.t);
      r.s[m][h] = __half2float(scales[(size_t)row * q.G + grp]);
    }
}
// [/loads]

__device__ __forceinline__ void load_group(GroupRegs& r, const uint32_t* __restrict__ qw,
                                           const half* __restrict__ scales, const Geometry& q, int grp) {
  load_rows(r, qw, scales, q, q.row0, grp);
}

__device__ __forceinline__ void load_group_or_zero(GroupRegs& r, const uint32_t* __restrict__ qw,
                                                   const half* __restrict__ scales, const Geometry& q,
                                                   int grp, bool live) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.w[m][h] = make_uint4(0u, 0u, 0u, 0u);
      r.s[m][h] = 0.f;
    }
  if (live) load_group(r, qw, scales, q, grp);
}

// ---- paths: how x reaches shared memory and how one group is multiplied ----------------
// [prmt-group]
struct PrmtMmaPath {
  // x: the lane's 32 halves of this group in padded shared memory (16-byte aligned).
  static __device__ __forceinline__ int smem_offset_bytes(int local_group, int t) {
    return (local_group * kSmemGroupHalves + t * (NQ_GROUP_SIZE / 4 + 8)) * 2;
  }
  static __device__ __forceinline__ void group(float (&acc)[kMTiles][2], const GroupRegs& r,
                                               const unsigned char* xs, int /*grp*/,
                                               const float* /*xscale*/) {
    uint4 xv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) xv[j] = reinterpret_cast<const uint4*>(xs)[j];
#if NQ_GEMV_FOLD
    // {fold, magic lo, magic hi, 0} from the padding behind the lane's run (see [fold]).
    const uint4 fv = reinterpret_cast<const uint4*>(xs)[kFoldOffsetWords / 4];
    const float fold = __uint_as_float(fv.x);
    const uint32_t mlo = fv.y, mhi = fv.z;
#endif
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};          // sum(code * x) over the group, rows g, g+8
#pragma unroll
      for (int j = 0; j < 4; ++j) {               // word j: k = 32t + 8j .. +7 of the group
        uint32_t pa[4], pb[4];
#if NQ_GEMV_FOLD
        unpack_int4x8_offset(word_of(r.w[m][0], j), mlo, mhi, pa);
        unpack_int4x8_offset(word_of(r.w[m][1], j), mlo, mhi, pb);
#else
        unpack_int4x8_half2(word_of(r.w[m][0], j), pa);
        unpack_int4x8_half2(word_of(r.w[m][1], j), pb);
#endif
        mma_16816(c, pa[0], pb[0], pa[1], pb[1], xv[j].x, xv[j].y);   // k = 8j + 0..3
        mma_16816(c, pa[2], pb[2], pa[3], pb[3], xv[j].z, xv[j].w);   // k = 8j + 4..7
      }
#if NQ_GEMV_FOLD
      // A phantom group (branchless, zero words and zero scale) is c ~ fold, finite: the
      // FMA with scale 0 adds exactly (+-)0.
      c[0] -= fold;
      c[2] -= fold;
#endif
      acc[m][0] = fmaf(c[0], r.s[m][0], acc[m][0]);   // W = code * scale, per group
      acc[m][1] = fmaf(c[2], r.s[m][1], acc[m][1]);
    }
  }
  // Every lane of a row's quad holds the full sum already (B's columns are equal).
  static __device__ __forceinline__ void finish(float (&)[kMTiles][2]) {}
};
// [/prmt-group]

// ---- staging: the CTA's K range of activations into shared memory ----------------------
// Who stages: every thread of the CTA (AllThreads), or a subset named by index and count
// (the lab's bulk kernels; whole warps, as stage_fold's shuffles need).
struct AllThreads {
  __device__ int tid() const { return threadIdx.x; }
  __device__ int count() const { return blockDim.x; }
};
#if NQ_GEMV_FOLD
// [fold-stage]
// Stores chunk c (8 halves) at c + c/4 and, per group, {fold, kMagicLo, kMagicHi, 0} with
// fold = 1032 * sum_lo + 72 * sum_hi (see [fold]) in the padding behind each of the four
// lane runs (bytes 64 + 80t of the group: banks 16, 4, 24, 12, no conflicts). The 16 chunks
// of a group are 16 consecutive c, i.e. one half-warp of one pass (the staging threads and
// the chunk count are multiples of 16): the half-warp adds its chunk sums by shuffles, in a fixed
// order (xor butterfly: every lane ends with the same bits), and lanes with c % 4 == 0
// write the copies. Passes are warp-uniform so that the full-mask shuffles are legal.
template <class Chunk, class Threads>
__device__ __forceinline__ void stage_fold(unsigned char* xs, const Geometry& q, const Chunk& chunk,
                                           const Threads& th) {
  uint4* dst = reinterpret_cast<uint4*>(xs);
  const int n = q.ng * (NQ_GROUP_SIZE / 8);
  for (int c0 = th.tid() & ~31; c0 < n; c0 += th.count()) {
    const int c = c0 + (th.tid() & 31);
    const bool live = c < n;                       // the same for the whole half-warp
    const uint4 v = live ? chunk(c) : make_uint4(0u, 0u, 0u, 0u);
    const half2* h = reinterpret_cast<const half2*>(&v);
    float lo = (__low2float(h[0]) + __high2float(h[0])) + (__low2float(h[2]) + __high2float(h[2]));
    float hi = (__low2float(h[1]) + __high2float(h[1])) + (__low2float(h[3]) + __high2float(h[3]));
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      lo += __shfl_xor_sync(0xffffffffu, lo, o);
      hi += __shfl_xor_sync(0xffffffffu, hi, o);
    }
    if (live) {
      dst[c + c / 4] = v;
      if ((c & 3) == 0)
        dst[c + c / 4 + 4] = make_uint4(__float_as_uint(fmaf(kFoldLo, lo, kFoldHi * hi)), kMagicLo, kMagicHi, 0u);
    }
  }
}
// [/fold-stage]
#endif

// Plain: copy x, 16 bytes at a time, into the padded layout (chunk c -> c + c/4).
// Plain copy, chunk c -> c + c/4. The all-threads form is spelled with threadIdx / blockDim:
// ptxas schedules the tiles kernel differently when the same loop reads them through th.
__device__ __forceinline__ void copy_x(unsigned char* xs, const uint4* src, const Geometry& q, const AllThreads&) {
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = threadIdx.x; c < q.ng * (NQ_GROUP_SIZE / 8); c += blockDim.x) dst[c + c / 4] = src[c];
}
template <class Threads>
__device__ __forceinline__ void stage_x(unsigned char* xs, const half* __restrict__ x, const Geometry& q,
                                        const Threads& th) {
  const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)q.gs * NQ_GROUP_SIZE);
#if NQ_GEMV_FOLD
  stage_fold(xs, q, [&](int c) { return src[c]; }, th);
#else
  copy_x(xs, src, q, th);
#endif
}

// [swiglu]
// silu(g) * u in fp32: expf (2 ulp) and __fdividef (2 ulp; exact IEEE division is a long
// subroutine). The clamp keeps 1 + e^-g below 2^126, where __fdividef returns 0: for
// g < -88 silu(g) is below 1e-36 and rounds to fp16 0 either way.
__device__ __forceinline__ float silu_mul(half g, half u) {
  const float gf = __half2float(g);
  return __fdividef(gf, 1.0f + expf(fminf(-gf, 88.0f))) * __half2float(u);
}
// act = fp16(silu(g) * u) for one chunk of 8 (g and u: the same 8 k of gate and up).
__device__ __forceinline__ uint4 swiglu8(const uint4& gv, const uint4& uv) {
  const half* gh = reinterpret_cast<const half*>(&gv);
  const half* uh = reinterpret_cast<const half*>(&uv);
  uint4 av;
  half* ah = reinterpret_cast<half*>(&av);
#pragma unroll
  for (int i = 0; i < 8; ++i) ah[i] = __float2half_rn(silu_mul(gh[i], uh[i]));
  return av;
}

// SwiGLU: act = fp16(silu(g) * u) for the CTA's range, g = gate_up[k], u = gate_up[K + k].
template <class Threads>
__device__ __forceinline__ void stage_swiglu(unsigned char* xs, const half* __restrict__ gate_up,
                                             const Geometry& q, const Threads& th) {
  const uint4* gsrc = reinterpret_cast<const uint4*>(gate_up + (size_t)q.gs * NQ_GROUP_SIZE);
  const uint4* usrc = reinterpret_cast<const uint4*>(gate_up + (size_t)q.K + (size_t)q.gs * NQ_GROUP_SIZE);
  auto act = [&](int c) { return swiglu8(gsrc[c], usrc[c]); };
#if NQ_GEMV_FOLD
  stage_fold(xs, q, act, th);   // the sums are of the fp16-rounded act, the values the MMA reads
#else
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = th.tid(); c < q.ng * (NQ_GROUP_SIZE / 8); c += th.count()) dst[c + c / 4] = act(c);
#endif
}
// [/swiglu]

// ---- the body of the GEMVs ----------------------------------------------------------------
// [epilogue]
struct Epilogue {
  half* out; const half* bias; const half* residual;   // bias / residual may be null
  float* ws; int* counters; int ksplit;
};

// out[row] = fp16(residual + (dot + bias)); residual may alias out (each row is read and
// written by the same thread, once).
__device__ __forceinline__ void store_row(const Epilogue& e, int row, float dot) {
  float v = dot;
  if (e.bias) v += __half2float(e.bias[row]);
  if (e.residual) v = __half2float(e.residual[row]) + v;
  e.out[row] = __float2half_rn(v);
}
// [/epilogue]

template <class Path, class Stage>
__device__ __forceinline__ void gemv_body(const Stage& stage, const uint32_t* __restrict__ qw,
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
      // A group past the range loads nothing: zero words are codes 0 and add exactly 0.
      load_group_or_zero(r[u], qw, scales, q, q.gs + lg, lg < q.ng);
    }
  };
  float acc[kMTiles][2];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) acc[m][0] = acc[m][1] = 0.f;
  auto compute_batch = [&](const GroupRegs (&r)[kUnroll], int b) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int lg = local_group(b, u);
      // No branch per group, so the groups' MMA chains interleave. A group past the range
      // reads the staged activations of local group 0 (finite) against its zero codes
      // (kernels/lab/gemv_v1.cu keeps the guarded form, one branch per group).
      const int lg_safe = lg < q.ng ? lg : 0;
      Path::group(acc, r[u], xs + Path::smem_offset_bytes(lg_safe, q.t), q.gs + lg_safe, xscale);
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

// The staging of each path: by all threads of the CTA, or (bulk) by the threads named.
struct StageX { const half* x;
  template <class Threads = AllThreads>
  __device__ void operator()(unsigned char* xs, const Geometry& q, const Threads& th = Threads()) const {
    stage_x(xs, x, q, th); } };
struct StageSwiglu { const half* gate_up;
  template <class Threads = AllThreads>
  __device__ void operator()(unsigned char* xs, const Geometry& q, const Threads& th = Threads()) const {
    stage_swiglu(xs, gate_up, q, th); } };
}  // namespace nq
