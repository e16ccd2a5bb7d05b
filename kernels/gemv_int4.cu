// gemv_int4.cu: decode GEMVs over INT4 ValueShuffle weights, batch 1, FP32 accumulation.
//   nq_gemv_int4          out = fp16([residual +] W.x [+ bias]); x fp16 [K]; prmt/magic unpack, mma.sync
//   nq_gemv_int4_swiglu   same, x = fp16(silu(g) * u) formed on the fly from gate_up fp16 [2K]
//   nq_quantize_act_int8  x fp16 [K] -> int8 per group of 128 (scale = absmax/127), dp4a byte order
//   nq_gemv_int4_dp4a     out as nq_gemv_int4 from the int8 activations, __dp4a on INT4->INT8 weights
//   nq_gemv_int4{,_swiglu,_dp4a}_stream  the same three as persistent stream-K kernels (v3)
//   nq_gemv_int4{,_swiglu}_bulk  persistent, weights streamed into shared memory by cp.async.bulk (v5)
//   compile-time: NQ_BULK_{STAGES,GROUPS,MAX_ITEM_GROUPS} (bulk), NQ_GEMV_{WARPS,UNROLL,MTILES,BRANCHLESS,MIN_CTAS} (tiles), NQ_GEMV_STREAM_{WARPS,RING},
//   NQ_GEMV_FOLD (prmt/mma unpack without the per-pair subtraction, see [fold])
// nq-variants: NQ_GEMV_UNROLL=2; NQ_GEMV_MTILES=2,NQ_GEMV_UNROLL=2; NQ_GEMV_WARPS=8,NQ_GEMV_UNROLL=2; NQ_GEMV_WARPS=2; NQ_GEMV_BRANCHLESS=0; NQ_GEMV_STREAM_WARPS=8,NQ_GEMV_STREAM_RING=8; NQ_GEMV_FOLD=1; NQ_GEMV_FOLD=1,NQ_GEMV_UNROLL=2; NQ_GEMV_FOLD=1,NQ_GEMV_MTILES=2,NQ_GEMV_UNROLL=2; NQ_GEMV_FOLD=1,NQ_GEMV_WARPS=8,NQ_GEMV_UNROLL=2; NQ_GEMV_FOLD=1,NQ_GEMV_WARPS=2; NQ_GEMV_FOLD=1,NQ_GEMV_BRANCHLESS=0; NQ_GEMV_FOLD=1,NQ_GEMV_STREAM_WARPS=8,NQ_GEMV_STREAM_RING=8; NQ_BULK_STAGES=8,NQ_BULK_GROUPS=4; NQ_BULK_GROUPS=16,NQ_BULK_STAGES=2,NQ_GEMV_FOLD=1
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
#include "mbarrier.cuh"   // common.cuh, and the bulk-copy / mbarrier wrappers (v4 bulk kernels)

#ifndef NQ_GEMV_WARPS
#define NQ_GEMV_WARPS 4     // warps per CTA (split of the CTA's K range)
#endif
#ifndef NQ_GEMV_UNROLL
#define NQ_GEMV_UNROLL 4    // groups per warp whose loads are in flight together
#endif
#ifndef NQ_GEMV_BRANCHLESS
#define NQ_GEMV_BRANCHLESS 1  // 0: v1, one branch per group (the MMA chains do not interleave)
#endif
#ifndef NQ_GEMV_MIN_CTAS
#define NQ_GEMV_MIN_CTAS 1    // __launch_bounds__ minimum CTAs per SM (caps registers)
#endif
#ifndef NQ_GEMV_MTILES
#define NQ_GEMV_MTILES 1    // 16-row tensor-core tiles per CTA (they share the x fragments)
#endif
#ifndef NQ_GEMV_FOLD
#define NQ_GEMV_FOLD 0      // 1: the MMA reads offset codes, one correction per group ([fold])
#endif

static_assert(NQ_GROUP_SIZE == 128, "the lane map covers one group with 4 lanes x 16 bytes");
static_assert(NQ_GEMV_WARPS >= 1 && NQ_GEMV_WARPS <= 16, "1..16 warps per CTA");
static_assert(NQ_GEMV_UNROLL >= 1 && NQ_GEMV_UNROLL <= 8, "1..8 groups in flight per warp");
static_assert(NQ_GEMV_MTILES == 1 || NQ_GEMV_MTILES == 2, "one or two m-tiles per CTA");
static_assert(NQ_GEMV_FOLD == 0 || NQ_GEMV_FOLD == 1, "NQ_GEMV_FOLD is 0 or 1");

typedef signed char int8_t;

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
constexpr int kSmemGroupHalves = NQ_GROUP_SIZE + NQ_GROUP_SIZE / 4;   // 160

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

// [mma]
// D += A.B, m16n8k16, fp16 inputs, fp32 accumulators. A rows are weight rows (g, g+8), the
// 16 k-slots are whatever k the lanes agree on (slot 2t,2t+1 / 2t+8,2t+9 belong to lane t
// in A and B alike), B's 8 columns all hold x, so c[0] (row g) and c[2] (row g+8) are the
// dot products and c[1], c[3] copies.
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// [/mma]

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

// [dp4a-group]
struct Dp4aPath {
  // xq: the lane's 32 int8 of this group (dp4a byte order, see nq_quantize_act_int8).
  static __device__ __forceinline__ int smem_offset_bytes(int local_group, int t) {
    return local_group * NQ_GROUP_SIZE + t * (NQ_GROUP_SIZE / 4);
  }
  // INT4 -> INT8 without sign extension: a nibble moved to the top of its byte is the
  // signed byte 16*s. (w << 4) & 0xF0F0F0F0 puts slots 0,2,4,6 = w0,w4,w1,w5 there, and
  // w & 0xF0F0F0F0 slots 1,3,5,7 = w2,w6,w3,w7; the quantizer stores x in the same order.
  static __device__ __forceinline__ void group(float (&acc)[kMTiles][2], const GroupRegs& r,
                                               const unsigned char* xs, int grp,
                                               const float* __restrict__ xscale) {
    const uint4 xa = reinterpret_cast<const uint4*>(xs)[0];   // words 0, 1 of the lane
    const uint4 xb = reinterpret_cast<const uint4*>(xs)[1];   // words 2, 3
    const uint32_t xq[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    const float xsc = xscale[grp] * 0.0625f;                   // / 16 undoes the nibble shift
#pragma unroll
    for (int m = 0; m < kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int dot = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w = word_of(r.w[m][h], j);
          dot = __dp4a((int)((w << 4) & 0xF0F0F0F0u), (int)xq[2 * j], dot);
          dot = __dp4a((int)(w & 0xF0F0F0F0u), (int)xq[2 * j + 1], dot);
        }
        // |dot| <= 32 * 128 * 127 < 2^24: exact in fp32.
        acc[m][h] = fmaf((float)dot, r.s[m][h] * xsc, acc[m][h]);
      }
  }
  // The four lanes of a quad hold partial sums over k-quarters: add them.
  static __device__ __forceinline__ void finish(float (&acc)[kMTiles][2]) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc[m][h] += __shfl_xor_sync(0xffffffffu, acc[m][h], 1);
        acc[m][h] += __shfl_xor_sync(0xffffffffu, acc[m][h], 2);
      }
  }
};
// [/dp4a-group]

// ---- staging: the CTA's K range of activations into shared memory ----------------------
// Who stages: every thread of the CTA (tiles, stream), or a subset named by index and count
// (the bulk kernels' consumer warps; whole warps, as stage_fold's shuffles need).
struct AllThreads {
  __device__ int tid() const { return threadIdx.x; }
  __device__ int count() const { return blockDim.x; }
};
struct SomeThreads {
  int i, n;
  __device__ int tid() const { return i; }
  __device__ int count() const { return n; }
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
__device__ __forceinline__ void copy_x(unsigned char* xs, const uint4* src, const Geometry& q, const SomeThreads& th) {
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = th.i; c < q.ng * (NQ_GROUP_SIZE / 8); c += th.n) dst[c + c / 4] = src[c];
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

// SwiGLU: act = fp16(silu(g) * u) for the CTA's range, g = gate_up[k], u = gate_up[K + k].
template <class Threads>
__device__ __forceinline__ void stage_swiglu(unsigned char* xs, const half* __restrict__ gate_up,
                                             const Geometry& q, const Threads& th) {
  const uint4* gsrc = reinterpret_cast<const uint4*>(gate_up + (size_t)q.gs * NQ_GROUP_SIZE);
  const uint4* usrc = reinterpret_cast<const uint4*>(gate_up + (size_t)q.K + (size_t)q.gs * NQ_GROUP_SIZE);
  auto act = [&](int c) {
    const uint4 gv = gsrc[c], uv = usrc[c];
    const half* gh = reinterpret_cast<const half*>(&gv);
    const half* uh = reinterpret_cast<const half*>(&uv);
    uint4 av;
    half* ah = reinterpret_cast<half*>(&av);
#pragma unroll
    for (int i = 0; i < 8; ++i) ah[i] = __float2half_rn(silu_mul(gh[i], uh[i]));
    return av;
  };
#if NQ_GEMV_FOLD
  stage_fold(xs, q, act, th);   // the sums are of the fp16-rounded act, the values the MMA reads
#else
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = th.tid(); c < q.ng * (NQ_GROUP_SIZE / 8); c += th.count()) dst[c + c / 4] = act(c);
#endif
}
// [/swiglu]

// INT8 activations: a plain copy (no padding: 32-byte lane runs are conflict-free).
__device__ __forceinline__ void stage_xq(unsigned char* xs, const int8_t* __restrict__ xq, const Geometry& q) {
  const uint4* src = reinterpret_cast<const uint4*>(xq + (size_t)q.gs * NQ_GROUP_SIZE);
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int c = threadIdx.x; c < q.ng * (NQ_GROUP_SIZE / 16); c += blockDim.x) dst[c] = src[c];
}

// ---- the body shared by the three GEMVs ------------------------------------------------
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
#if NQ_GEMV_BRANCHLESS
      // A group past the range loads nothing: zero words are codes 0 and add exactly 0.
      load_group_or_zero(r[u], qw, scales, q, q.gs + lg, lg < q.ng);
#else
      if (lg < q.ng) load_group(r[u], qw, scales, q, q.gs + lg);
#endif
    }
  };
  float acc[kMTiles][2];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) acc[m][0] = acc[m][1] = 0.f;
  auto compute_batch = [&](const GroupRegs (&r)[kUnroll], int b) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int lg = local_group(b, u);
#if NQ_GEMV_BRANCHLESS
      // No branch per group, so the groups' MMA chains interleave. A group past the range
      // reads the staged activations of local group 0 (finite) against its zero codes.
      const int lg_safe = lg < q.ng ? lg : 0;
      Path::group(acc, r[u], xs + Path::smem_offset_bytes(lg_safe, q.t), q.gs + lg_safe, xscale);
#else
      if (lg < q.ng) Path::group(acc, r[u], xs + Path::smem_offset_bytes(lg, q.t), q.gs + lg, xscale);
#endif
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
struct StageXq { const int8_t* xq;
  __device__ void operator()(unsigned char* xs, const Geometry& q) const { stage_xq(xs, xq, q); } };


#if NQ_GEMV_MTILES == 1
// ---- v3: the stream kernels (persistent, stream-K) ----------------------------------------
// The work is T = ceil(N/16) tiles x G groups = U units of 16 rows x 128 inputs (1 KB of
// weights), numbered tile-major. Global warp w of NW = gridDim.x * STREAM_WARPS owns units
// [start(w), start(w+1)), start(w) = floor(w * U / NW): every warp streams the same number
// of bytes (+-1 unit), with a ring of UNROLL units in flight that runs across tile
// boundaries, so no warp waits at a tile's end. The CTA stages all of x once. A tile the
// warp covered whole is stored at once; a partial tile's sums go to slot (tile, w - w1)
// of the workspace, w1 = owner of the tile's first unit; the warp whose units complete the
// tile's count of G adds the slots in warp order (deterministic) and stores the rows.
#ifndef NQ_GEMV_STREAM_WARPS
#define NQ_GEMV_STREAM_WARPS 16   // warps per CTA (one CTA per SM at 16)
#endif
#ifndef NQ_GEMV_STREAM_RING
#define NQ_GEMV_STREAM_RING 4     // units in flight per warp
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
#ifndef NQ_BULK_STAGES
#define NQ_BULK_STAGES 4
#endif
#ifndef NQ_BULK_GROUPS
#define NQ_BULK_GROUPS 8
#endif
#ifndef NQ_BULK_MAX_ITEM_GROUPS
#define NQ_BULK_MAX_ITEM_GROUPS 40
#endif
#ifndef NQ_BULK_CONSUMER_WARPS
#define NQ_BULK_CONSUMER_WARPS 4
#endif
// NQ_BULK_WAIT_NS > 0: the ring's waits carry that suspend-time hint (mbar_wait_suspend).
#ifndef NQ_BULK_WAIT_NS
#define NQ_BULK_WAIT_NS 0
#endif
// NQ_BULK_COPY_ONLY 1 is a measurement, not a kernel: the consumers wait for each stage and
// release it without reading it, so the launch times the copy path alone (its roofline) and
// its outputs are meaningless. Only tools/bench_gemv.py builds it, and labels it so.
#ifndef NQ_BULK_COPY_ONLY
#define NQ_BULK_COPY_ONLY 0
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
#endif  // NQ_GEMV_MTILES == 1
}  // namespace nq

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

#if NQ_GEMV_MTILES == 1
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
#endif  // NQ_GEMV_MTILES == 1

#if NQ_GEMV_MTILES == 1
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
#endif  // NQ_GEMV_MTILES == 1
