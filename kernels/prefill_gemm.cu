// prefill_gemm.cu: INT4 x FP16 GEMM on tensor cores for the prefill, FP32 accumulation.
//   nq_prefill_gemm         Y[T,N] = fp16(X W^T [+ bias] [+ residual]); X fp16 [T, K]
//   nq_prefill_gemm_swiglu  same, X = act = fp16(silu(g) * u) formed per tile from gate_up fp16 [T, 2K]
//   nq_swiglu_act           act fp16 [T, I] = fp16(silu(g) * u) from gate_up [T, 2I] (the unfused
//                           alternative: one elementwise pass, then nq_prefill_gemm)
// Compile-time variants: NQ_PG_BM (token tile 64 / 128), NQ_PG_WARPS_M (8 warps as 2 x 4 or
// 4 x 2), NQ_PG_STAGES (ring depth). Split-K is a launch parameter (gridDim.z).
// nq-variants: NQ_PG_BM=64; NQ_PG_WARPS_M=4; NQ_PG_BM=64, NQ_PG_WARPS_M=4; NQ_PG_STAGES=3
//
// Shapes (runtime): X [T, K] row-major, any T >= 1; qweight uint32 [N, K/8] (ValueShuffle:
// nibble slot i, LSB first, holds w[[0,2,4,6,1,3,5,7][i]] of 8 consecutive k); scales fp16
// [N, K/128]; K a multiple of 128, any N >= 1. bias [N], residual [T, N] (may alias Y).
// Tuned for the 7B at T = 512 (N 3584..37888, K 3584 / 18944) on an H200.
//
// Why mma.sync and not wgmma: wgmma needs the sm_90a target, and the project's NVRTC path
// (cuda_build.ARCH) builds plain sm_90 so that one cubin serves every kernel; mma.sync
// m16n8k16 (f16 in, f32 accumulate) is plain sm_80+ PTX and runs on Hopper's tensor cores
// at a lower rate. Moving to wgmma is a later chapter's step.
//
// Tiling. A CTA computes a BM x 128 tile of Y (BM tokens) over k-tiles of 64, in a ring of
// NQ_PG_STAGES shared-memory stages filled by cp.async (16-byte cg for X and W; 4-byte ca
// for the scales). 8 warps as WARPS_M x WARPS_N: a warp owns WM = BM/WARPS_M tokens x
// WN = 128/WARPS_N features, i.e. MT = WM/16 m16 tiles x NT = WN/8 n8 tiles. Per HMMA a warp
// reads 4096/WN bytes of X from shared memory and spends 6.5/MT instructions dequantizing.
// Split-K (gridDim.z = S > 1): slice z takes k-tiles [z KT/S, (z+1) KT/S); each slice stores
// its FP32 tile to a workspace, and the CTA that arrives last at the tile's counter adds the
// slices in slice order (deterministic), runs the epilogue and resets the counter to 0.
//
// The k permutation (the trick that lets whole-word unpacks feed the tensor cores).
// mma computes sum_j A[row][j] B[j][col] over 16 slots j; the k behind slot j is ours to
// choose as long as A and B agree. Lane (g, t) = (lane/4, lane%4) holds slots 2t, 2t+1
// (b0/a0) and 2t+8, 2t+9 (b1/a2). Within a k-tile of 64, lane t owns the two ValueShuffle
// words 2t, 2t+1 of its weight row, i.e. k in [16t, 16t+16). Half h in {0,1} of the
// k-tile uses word 2t+h = k0 + [0, 8), k0 = 16t + 8h, unpacked into 4 half2 pairs
// (k0, k0+1) .. (k0+6, k0+7). Its two k16 steps s in {0,1} take
//     b0 = pair 2s = (k0+4s, k0+4s+1),  b1 = pair 2s+1 = (k0+4s+2, k0+4s+3)
// and A takes the same k: one 16-byte shared load of X[row][k0 .. k0+8) gives four pairs,
// a0 = word 2s, a2 = word 2s+1 (rows g; a1, a3 from row g+8). Over t and h every k of the
// tile is covered exactly once. No ldmatrix is needed: X rows are read 16 bytes per lane.
//
// Dequantization: a pair of codes becomes an exact fp16x2 by the magic-number trick (one
// LOP3 and one HSUB2), then one HMUL2 by the row's scale: the weight enters the tensor
// core as w16 = fp16(code * scale), one rounding (relative error <= 2^-11) of the exact
// code * scale of the numerics contract. Products and sums are FP32 from there on.
//
// Shared-memory banks: X rows are padded to 72 halves (144 B), so the 8 lanes of a
// quarter-warp (rows g, g+1, chunks 2t+h) hit 8 distinct 16-byte bank groups. W rows are
// 32 contiguous bytes and a lane reads its 8 bytes (words 2t, 2t+1) at once: the warp reads
// 256 contiguous bytes, conflict-free.
//
// What it degrades to: rows of X beyond T and rows of W beyond N are zero-filled by
// cp.async (src-size 0) and never stored; odd N stores element by element. The scale word
// of an odd-sized scales tensor's last element reaches 2 bytes past its end (inside the
// 128-byte-aligned allocation; the value is not used).
#include "hopper.cuh"   // common.cuh, smem_u32, the mma.sync wrapper

#ifndef NQ_PG_BM   // tokens per CTA tile: 128 (large grids) or 64 (small N)
#error "NQ_PG_BM: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PG_STAGES   // shared-memory ring depth
#error "NQ_PG_STAGES: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PG_WARPS_M   // warps along the tokens (the other 8 / WARPS_M along the features)
#error "NQ_PG_WARPS_M: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif

static_assert(NQ_LAYOUT_ID == 1, "this kernel reads layout 1 (INT4, ValueShuffle)");
static_assert(NQ_GROUP_SIZE == 128, "a k-tile of 64 lies inside one scale group");
static_assert(NQ_PG_BM == 64 || NQ_PG_BM == 128, "BM is 64 or 128 tokens");
static_assert(NQ_PG_STAGES >= 2 && NQ_PG_STAGES <= 6, "2..6 stages");
static_assert(NQ_PG_WARPS_M == 2 || NQ_PG_WARPS_M == 4, "8 warps as 2 x 4 or 4 x 2");

#ifndef NQ_PG_BN
#error "NQ_PG_BN: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PG_BK
#error "NQ_PG_BK: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PG_THREADS
#error "NQ_PG_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PG_X_PAD
#error "NQ_PG_X_PAD: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PG_ACT_THREADS
#error "NQ_PG_ACT_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PG_MIN_CTAS_BM64
#error "NQ_PG_MIN_CTAS_BM64: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PG_MIN_CTAS_BM128
#error "NQ_PG_MIN_CTAS_BM128: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif

namespace pg {

constexpr int BM = NQ_PG_BM;
constexpr int BN = NQ_PG_BN;
constexpr int BK = NQ_PG_BK;
constexpr int STAGES = NQ_PG_STAGES;
constexpr int THREADS = NQ_PG_THREADS;
constexpr int WARPS_M = NQ_PG_WARPS_M;
constexpr int WARPS_N = 8 / WARPS_M;
constexpr int WM = BM / WARPS_M;         // warp tile rows (tokens)
constexpr int WN = BN / WARPS_N;         // warp tile columns (features): 32 or 64
constexpr int MT = WM / 16;              // m16 tiles per warp: 1, 2 or 4
constexpr int NT = WN / 8;               // n8 tiles per warp: 4 or 8
constexpr int XS = BK + NQ_PG_X_PAD;     // padded X row, halves (144 bytes)
constexpr int WWORDS = BK / 8;           // packed words per W row per k-tile (8)
constexpr int X_CHUNKS = BM * BK / 8;    // 16-byte chunks of an X tile
// CTAs per SM the register cap aims at (launch bounds). BM = 64: 2 x 256 threads x <= 128
// registers. BM = 128 needs ~150 registers (64 accumulators, the loaders, split-K): one CTA
// of 8 warps per SM, where a cap of 128 would spill.
constexpr int MIN_CTAS = BM == 128 ? NQ_PG_MIN_CTAS_BM128 : NQ_PG_MIN_CTAS_BM64;
constexpr int MIN_CTAS_SWIGLU = MIN_CTAS;

// One stage of the ring. `u` exists only in the SwiGLU kernel (the launcher sizes the
// dynamic shared memory accordingly: stage_bytes(swiglu) below).
struct Stage {
  half x[BM * XS];                       // X tile (or gate g, then act in place) [BM][72]
  uint32_t w[BN * WWORDS];               // packed weights [128 rows][8 words]
  uint32_t s[BN];                        // the aligned 4-byte word holding each row's scale
};
constexpr int STAGE_BYTES = sizeof(Stage);
constexpr int W_OFF = BM * XS * 2;                 // byte offset of Stage::w (NVRTC has no offsetof)
constexpr int S_OFF = W_OFF + BN * WWORDS * 4;     // byte offset of Stage::s
static_assert(STAGE_BYTES == S_OFF + BN * 4, "Stage has no padding");
constexpr int U_BYTES = BM * XS * 2;     // SwiGLU: the up half u [BM][72], after the stages
static_assert(STAGE_BYTES % 16 == 0 && U_BYTES % 16 == 0, "16-byte aligned stage parts");
static_assert(X_CHUNKS % THREADS == 0, "every thread copies the same number of X chunks");

// ---- PTX wrappers -------------------------------------------------------------------------
using hopper::smem_u32;

using hopper::cp_async16;   // cp.async 16 / 4 bytes, zero-filled when !valid (hopper.cuh)
using hopper::cp_async4;
using hopper::cp_async_commit;
using hopper::cp_async_wait;

__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}
using nqptx::prmt;   // the PTX wrappers of common.cuh
using nqptx::hsub2;
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

using hopper::mma_16816;   // D += A.B, m16n8k16, fp16 in, fp32 accumulate (hopper.cuh)

// ---- dequantization -----------------------------------------------------------------------
// One ValueShuffle word (w0..w7 of 8 consecutive k) -> fp16x2 pairs (w0,w1) (w2,w3) (w4,w5)
// (w6,w7), each times the scale pair s2. The 16-bit halves hold w0 w2 w4 w6 (low) and w1 w3
// w5 w7 (high); a mask picks one nibble of both halves: a consecutive pair. With n the
// two's-complement nibble of code c, n ^ 8 = c + 8, so (w & 0x000F000F) ^ 0x64086408 is
// fp16x2(1032 + c) and subtracting 1032 gives c exactly; for the nibble at bit 4 the
// exponent makes it worth 1/16 of that: 0x5480 = fp16(72), 72 + c. prmt moves bytes 1, 3
// down to 0, 2 so the same masks reach (w4,w5), (w6,w7).
constexpr uint32_t kMagicLo = 0x64086408u;   // fp16x2(1032, 1032)
constexpr uint32_t kMagicHi = 0x54805480u;   // fp16x2(72, 72)

__device__ __forceinline__ void dequant_word(uint32_t w, uint32_t s2, uint32_t (&p)[4]) {
  const uint32_t w_hi = prmt(w, 0u, 0x3311u);
  p[0] = hmul2(hsub2((w & 0x000F000Fu) ^ kMagicLo, kMagicLo), s2);
  p[1] = hmul2(hsub2((w & 0x00F000F0u) ^ kMagicHi, kMagicHi), s2);
  p[2] = hmul2(hsub2((w_hi & 0x000F000Fu) ^ kMagicLo, kMagicLo), s2);
  p[3] = hmul2(hsub2((w_hi & 0x00F000F0u) ^ kMagicHi, kMagicHi), s2);
}

// act = fp16(silu(g) * u), FP32 inside; the GEMV's expression (expf, IEEE division).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

__device__ __forceinline__ uint32_t act_pair(uint32_t g2, uint32_t u2) {
  const float2 g = __half22float2(*reinterpret_cast<const half2*>(&g2));
  const float2 u = __half22float2(*reinterpret_cast<const half2*>(&u2));
  const half2 a = __floats2half2_rn(silu_mul(g.x, u.x), silu_mul(g.y, u.y));
  return *reinterpret_cast<const uint32_t*>(&a);
}

struct Problem {
  const half* x;              // [T, ldx]: X, or gate_up (g at column k, u at column K + k)
  const uint32_t* qw;         // [N, K/8]
  const half* scales;         // [N, K/128]
  const half* bias;           // [N] or null
  const half* residual;       // [T, N] or null (may alias y)
  half* y;                    // [T, N]
  int T, N, K, ldx;
};

// ---- producer side: one k-tile into one stage ----------------------------------------------
// Every thread issues X_CHUNKS/256 X chunks (and as many u chunks), one W chunk and, for
// threads < 128, one scale word. Chunk c = tid + 256 i of the X tile is row c/8 (= tid/8 +
// 32 i), 16-byte column c%8. The per-thread sources at k-tile 0 are computed once (Loader);
// a k-tile adds kt * 128 bytes (X), kt * 32 bytes (W), and the scale word moves every
// second k-tile.
struct Loader {
  uint32_t x;             // element offset in X of row tid/8 (clamped into the tensor), column (tid%8)*8
  uint32_t x_step;        // elements from chunk i to chunk i+1: 32 rows
  uint32_t w;             // word offset in qweight of row tid/2 (clamped), word (tid%2)*4
  uint32_t s;             // element offset in scales of row tid (clamped)
  uint32_t ok;            // bits 0..3: X row tid/8 + 32 i < T; bit 4: W row < N; bit 5: scale row < N
  uint32_t x_dst, w_dst, s_dst;   // byte offsets inside a stage
};

__device__ __forceinline__ Loader make_loader(const Problem& p, int m0, int n0) {
  const int tid = threadIdx.x, xr = tid >> 3, xc = (tid & 7) * 8, wr = tid >> 1;
  Loader L;
  L.ok = 0;
#pragma unroll
  for (int i = 0; i < X_CHUNKS / THREADS; ++i) L.ok |= (m0 + xr + 32 * i < p.T ? 1u : 0u) << i;
  L.ok |= (n0 + wr < p.N ? 1u : 0u) << 4;
  L.ok |= (tid < BN && n0 + tid < p.N ? 1u : 0u) << 5;
  L.x = (uint32_t)min(m0 + xr, p.T - 1) * p.ldx + xc;
  L.x_step = 32u * p.ldx;
  L.w = (uint32_t)min(n0 + wr, p.N - 1) * (p.K / 8) + (tid & 1) * 4;
  L.s = (uint32_t)min(n0 + tid, p.N - 1) * (p.K / NQ_GROUP_SIZE);
  L.x_dst = (xr * XS + xc) * 2;
  L.w_dst = W_OFF + (wr * WWORDS + (tid & 1) * 4) * 4;
  L.s_dst = S_OFF + tid * 4;
  return L;
}

// Invalid chunks are zero-filled; their (clamped) source address is never read. The u
// chunk of the SwiGLU kernel is K columns right of g; it lands at the same offset of the
// stage's u tile. Offsets fit 32 bits: T * ldx and N * K / 8 stay below 2^31 (launcher).
template <bool kSwiglu>
__device__ __forceinline__ void load_tile(const Problem& p, const Loader& L, uint32_t st, uint32_t u_sm, int kt) {
#pragma unroll
  for (int i = 0; i < X_CHUNKS / THREADS; ++i) {
    const half* src = p.x + (L.x + i * L.x_step + kt * BK);
    const bool ok = (L.ok >> i) & 1u;
    const uint32_t off = L.x_dst + i * 32 * XS * 2;
    cp_async16(st + off, src, ok);
    if constexpr (kSwiglu) cp_async16(u_sm + off, src + p.K, ok);
  }
  cp_async16(st + L.w_dst, p.qw + (L.w + kt * WWORDS), (L.ok >> 4) & 1u);
  if (threadIdx.x < BN) {
    const uint32_t e = L.s + (kt * BK) / NQ_GROUP_SIZE;          // this row's scale for tile kt
    cp_async4(st + L.s_dst, p.scales + (e & ~1u), (L.ok >> 5) & 1u);   // the aligned word holding it
  }
}

// SwiGLU: this thread turns the g chunks it copied into act, in place (its own cp.async
// copies are complete and visible to it after cp.async.wait_group; no barrier needed).
__device__ __forceinline__ void sts128(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void act_in_place(uint32_t st, uint32_t u_sm, uint32_t x_dst) {
#pragma unroll
  for (int i = 0; i < X_CHUNKS / THREADS; ++i) {
    const uint32_t off = x_dst + i * 32 * XS * 2;
    uint4 g = lds128(st + off);
    const uint4 u = lds128(u_sm + off);
    g.x = act_pair(g.x, u.x); g.y = act_pair(g.y, u.y);
    g.z = act_pair(g.z, u.z); g.w = act_pair(g.w, u.w);
    sts128(st + off, g);
  }
}

// ---- consumer side: one k-tile of MMAs ---------------------------------------------------
// Lane (g, t): weight rows warp_n*WN + 8j + g, token rows warp_m*WM + 16i + g (+8). One
// 8-byte load gives the lane both its words (2t, 2t+1) of a W row: the warp reads 8 rows x
// 32 contiguous bytes, conflict-free.
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
  return v;
}

__device__ __forceinline__ void mma_tile(const Problem& p, uint32_t st_addr, float (&acc)[MT][NT][4],
                                         int n0, int kt, int warp_m, int warp_n, int g, int t) {
  const int grp = (kt * BK) / NQ_GROUP_SIZE, G = p.K / NQ_GROUP_SIZE;
  const uint32_t s_addr = st_addr + S_OFF + (warp_n * WN + g) * 4;
  const uint32_t w_addr = st_addr + W_OFF + ((warp_n * WN + g) * WWORDS + 2 * t) * 4;
  const uint32_t x_addr = st_addr + ((warp_m * WM + g) * XS + 16 * t) * 2;
  // Scale element (row, grp) sits in the upper half of its aligned word when row * G + grp
  // is odd; rows 8 apart share that parity, so one selector serves all NT rows of the lane.
  const uint32_t sel = (((n0 + warp_n * WN + g) * G + grp) & 1) ? 0x3232u : 0x1010u;
  auto scale2 = [&](int j) { return prmt(lds32(s_addr + j * 8 * 4), 0u, sel); };   // (s, s) of n-tile j
  auto x_frag = [&](int i, int h, int r8) { return lds128(x_addr + ((i * 16 + r8) * XS + 8 * h) * 2); };
  if constexpr (NT <= 4) {
    // Few features per warp: hold the NT weight rows' words, dequantize all NT fragments of a
    // half, then stream the m-tiles through them.
    uint2 wv[NT];
    uint32_t s2[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      wv[j] = lds64(w_addr + j * 8 * WWORDS * 4);
      s2[j] = scale2(j);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t b[NT][4];                                     // pairs (k0+2i, k0+2i+1), k0 = 16t + 8h
#pragma unroll
      for (int j = 0; j < NT; ++j) dequant_word(h ? wv[j].y : wv[j].x, s2[j], b[j]);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const uint4 lo = x_frag(i, h, 0), hi = x_frag(i, h, 8);            // rows g, g+8
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          mma_16816(acc[i][j], lo.x, hi.x, lo.y, hi.y, b[j][0], b[j][1]);   // step s = 0
          mma_16816(acc[i][j], lo.z, hi.z, lo.w, hi.w, b[j][2], b[j][3]);   // step s = 1
        }
      }
    }
  } else {
    // Many features per warp: hold the x fragments of both halves, dequantize one n-tile
    // (both halves) at a time.
    uint4 lo[2][MT], hi[2][MT];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        lo[h][i] = x_frag(i, h, 0);
        hi[h][i] = x_frag(i, h, 8);
      }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint2 w = lds64(w_addr + j * 8 * WWORDS * 4);
      const uint32_t s = scale2(j);
      uint32_t b[2][4];
      dequant_word(w.x, s, b[0]);
      dequant_word(w.y, s, b[1]);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma_16816(acc[i][j], lo[h][i].x, hi[h][i].x, lo[h][i].y, hi[h][i].y, b[h][0], b[h][1]);
          mma_16816(acc[i][j], lo[h][i].z, hi[h][i].z, lo[h][i].w, hi[h][i].w, b[h][2], b[h][3]);
        }
    }
  }
}

// ---- epilogue: y = fp16(acc [+ bias] [+ residual]), FP32 adds, one rounding -------------------
__device__ __forceinline__ float2 epilogue_pair(const Problem& p, int row, int col, float v0, float v1, bool two) {
  if (p.bias) {
    v0 += __half2float(p.bias[col]);
    if (two) v1 += __half2float(p.bias[col + 1]);
  }
  if (p.residual) {
    const half* r = p.residual + (size_t)row * p.N + col;
    v0 += __half2float(r[0]);
    if (two) v1 += __half2float(r[1]);
  }
  return make_float2(v0, v1);
}

__device__ __forceinline__ void store_tile(const Problem& p, const float (&acc)[MT][NT][4], int m0, int n0,
                                           int warp_m, int warp_n, int g, int t) {
  const bool even_n = (p.N & 1) == 0;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = m0 + warp_m * WM + i * 16 + g + 8 * rr;
        const int col = n0 + warp_n * WN + j * 8 + 2 * t;
        if (row >= p.T || col >= p.N) continue;
        const bool two = col + 1 < p.N;
        const float2 v = epilogue_pair(p, row, col, acc[i][j][2 * rr], acc[i][j][2 * rr + 1], two);
        half* dst = p.y + (size_t)row * p.N + col;
        if (even_n) {
          *reinterpret_cast<half2*>(dst) = __floats2half2_rn(v.x, v.y);   // col even, N even: 4-byte aligned
        } else {
          dst[0] = __float2half_rn(v.x);
          if (two) dst[1] = __float2half_rn(v.y);
        }
      }
}

// ---- split-K: the last slice to finish a tile adds all slices ------------------------------
// Workspace layout [slice][tile][i*NT + j][thread] of float4 (one accumulator fragment each):
// every store and load instruction of a warp touches 512 contiguous bytes. Returns true in
// the CTA that holds the tile's sum (and must run the epilogue).
__device__ __forceinline__ bool reduce_split(float (&acc)[MT][NT][4], float* ws, int* counters) {
  __shared__ int is_last;
  const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
  const int S = gridDim.z, z = blockIdx.z;
  float4* part = reinterpret_cast<float4*>(ws);
  const size_t slice_stride = (size_t)tiles * MT * NT * THREADS;
  float4* mine = part + (size_t)tile * MT * NT * THREADS + threadIdx.x;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
      __stcg(mine + z * slice_stride + (i * NT + j) * THREADS,
             make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]));
  __threadfence();                                   // this thread's partials before the count
  __syncthreads();                                   // all 256 threads stored
  if (threadIdx.x == 0) is_last = atomicAdd(&counters[tile], 1) == S - 1;
  __syncthreads();                                   // all 256 threads read is_last
  if (!is_last) return false;
  __threadfence();                                   // the other slices' partials are visible
  // The sum reads every slice back, this CTA's own too (its own stores, visible to it), so
  // that acc is free while the loads are in flight.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float4* src = mine + (i * NT + j) * THREADS;
      float4 sum = __ldcg(src);
      for (int zz = 1; zz < S; ++zz) {               // slice order: the same bits every run
        const float4 v = __ldcg(src + zz * slice_stride);
        sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
      }
      acc[i][j][0] = sum.x; acc[i][j][1] = sum.y; acc[i][j][2] = sum.z; acc[i][j][3] = sum.w;
    }
  if (threadIdx.x == 0) counters[tile] = 0;          // ready for the next launch
  return true;
}

// ---- the GEMM ------------------------------------------------------------------------------
// Grid (ceil(T/BM), ceil(N/128), S): blockIdx.x is the token tile, so the CTAs that share a
// W tile run side by side and the second and later reads of it come from L2.
// Pipeline: one barrier per k-tile. At iteration kt the thread waits for its copies of
// tile kt (all but the newest STAGES-2 groups), the barrier makes every thread's copies
// visible and proves every warp is done with tile kt-1, whose stage is then refilled with
// tile kt+STAGES-1. A commit happens every iteration (possibly empty) so the group count
// stays in step.
template <bool kSwiglu>
__device__ __forceinline__ void gemm_body(const Problem& p, float* ws, int* counters) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t stage0 = smem_u32(smem_raw);                   // stage s at stage0 + s * STAGE_BYTES
  const uint32_t u0 = stage0 + STAGES * STAGE_BYTES;            // SwiGLU u tile s at u0 + s * U_BYTES

  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N, g = lane >> 2, t = lane & 3;
  const int KT = p.K / BK;
  const int kt0 = (blockIdx.z * KT) / gridDim.z, nkt = ((blockIdx.z + 1) * KT) / gridDim.z - kt0;
  const Loader L = make_loader(p, m0, n0);

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nkt) load_tile<kSwiglu>(p, L, stage0 + s * STAGE_BYTES, u0 + s * U_BYTES, kt0 + s);
    cp_async_commit();
  }
  for (int kk = 0; kk < nkt; ++kk) {
    const int cur = kk % STAGES, nxt_slot = (kk + STAGES - 1) % STAGES;   // AND for 4 stages
    cp_async_wait<STAGES - 2>();                                 // this thread's copies of tile kk landed
    if constexpr (kSwiglu) act_in_place(stage0 + cur * STAGE_BYTES, u0 + cur * U_BYTES, L.x_dst);
    __syncthreads();                                             // all 256 threads: tile kk visible, kk-1 done
    if (kk + STAGES - 1 < nkt)
      load_tile<kSwiglu>(p, L, stage0 + nxt_slot * STAGE_BYTES, u0 + nxt_slot * U_BYTES, kt0 + kk + STAGES - 1);
    cp_async_commit();
    mma_tile(p, stage0 + cur * STAGE_BYTES, acc, n0, kt0 + kk, warp_m, warp_n, g, t);
  }
  cp_async_wait<0>();
  if (gridDim.z > 1 && !reduce_split(acc, ws, counters)) return;
  store_tile(p, acc, m0, n0, warp_m, warp_n, g, t);
}

}  // namespace pg

// Dynamic shared memory: STAGES * sizeof(Stage) (+ STAGES * BM * 72 * 2 for the SwiGLU u
// tiles); ops_prefill.gemm_smem_bytes computes the same from the same constants.
// ws: fp32 [S * tiles * BM * 128] and counters int32 [tiles] (zero) when gridDim.z = S > 1,
// else unused (may be null).
extern "C" __global__ void __launch_bounds__(pg::THREADS, pg::MIN_CTAS)
nq_prefill_gemm(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
                const half* bias, const half* residual, half* y, int T, int N, int K, float* ws, int* counters) {
  pg::gemm_body<false>(pg::Problem{x, qw, scales, bias, residual, y, T, N, K, K}, ws, counters);
}

// gate_up fp16 [T, 2K]: gate in columns [0, K), up in [K, 2K); K = the down projection's input.
extern "C" __global__ void __launch_bounds__(pg::THREADS, pg::MIN_CTAS_SWIGLU)
nq_prefill_gemm_swiglu(const half* __restrict__ gate_up, const uint32_t* __restrict__ qw,
                       const half* __restrict__ scales, const half* bias, const half* residual, half* y,
                       int T, int N, int K, float* ws, int* counters) {
  pg::gemm_body<true>(pg::Problem{gate_up, qw, scales, bias, residual, y, T, N, K, 2 * K}, ws, counters);
}

// act [T, I] = fp16(silu(g) * u); gate_up [T, 2I]. One thread per 8 outputs (I % 8 == 0).
extern "C" __global__ void __launch_bounds__(NQ_PG_ACT_THREADS)
nq_swiglu_act(const half* __restrict__ gate_up, half* __restrict__ act, int T, int I) {
  const size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;   // chunk of 8 outputs
  const size_t per_row = I / 8;
  if (c >= (size_t)T * per_row) return;
  const size_t row = c / per_row, col = (c % per_row) * 8;
  const half* gp = gate_up + row * 2 * I + col;
  uint4 g = *reinterpret_cast<const uint4*>(gp);
  const uint4 u = *reinterpret_cast<const uint4*>(gp + I);
  g.x = pg::act_pair(g.x, u.x); g.y = pg::act_pair(g.y, u.y);
  g.z = pg::act_pair(g.z, u.z); g.w = pg::act_pair(g.w, u.w);
  *reinterpret_cast<uint4*>(act + row * I + col) = g;
}
