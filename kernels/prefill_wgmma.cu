// prefill_wgmma.cu: the prefill GEMMs on Hopper's wgmma (sm_90a), warp-specialized and pipelined.
// nq-arch: sm_90a
//   nq_prefill_wgmma          Y[T,N] = fp16(X W^T [+ bias] [+ residual]); X fp16 [T, K], W INT4
//                             (ValueShuffle, as prefill_gemm.cu), FP32 accumulation
//   nq_prefill_wgmma_swiglu   act[T,I] = fp16(silu(fp16(g)) * fp16(u)), [g | u] = X W^T with W the
//                             gate_up weight [2I, K]: the gate_up GEMM and the SwiGLU in one pass
//   nq_prefill_wgmma_fp8      out[t,n] = fp16(ts[t] s[n] sum_k xq[t,k] c[n,k] [+ bias] [+ residual]),
//                             E4M3 operands (QGMMA), fp8.cu's contract (fp8.cuh store_scaled)
// nq-variants: NQ_PW_BN=112; NQ_PW_BN=144; NQ_PW_BN=256
//
// The same contract and rounding as nq_prefill_gemm (prefill_gemm.cu): w16 = fp16(code * scale)
// by the magic-number dequantization, products and sums FP32, bias / residual added in FP32,
// one rounding at the end. Same bits as prefill_gemm.cu? No: the tensor cores sum in another
// order; the float64 bound of tests/test_gpu_prefill.py holds for both.
//
// CTA: FP8, and INT4 at BN > NQ_PW_INT4_2P_MAX_BN (144, 256): 3 warpgroups (384 threads),
// warpgroup 0 the producer, 1 and 2 the consumers. INT4 at BN <= NQ_PW_INT4_2P_MAX_BN (112, 128):
// 4 warpgroups (512 threads), 0 and 1 the producers (twice the dequantization rate: INT4 is bound
// by it, PERFLOG "prefill" v4), 2 and 3 the consumers; no setmaxnreg there (512 threads cap
// ptxas at 128 registers a thread for the whole kernel, which BN / 2 = 64 accumulators fit; the
// m64n256 wgmma needs >= 154, hence 1 producer warpgroup at BN 256). Each consumer owns 64 of the
// BM = 128 tokens of the tile and all BN features (wgmma m64nBNk16, accumulators in registers:
// BN / 2 floats per thread). The k dimension goes through a ring of NQ_PW_STAGES shared-memory
// stages on mbarriers: `full` (producers -> consumers: the TMA thread's arrive.expect_tx for X
// (+ FP8's codes) and, INT4, one plain arrival per producer thread after its dequantized stores)
// and `empty` (consumers -> producers: one arrival per consumer warp after its wgmma group that
// read the stage has completed).
//
// Stage layout (1024-byte aligned): A = X (or xq), BM rows of 128 bytes of k, written by TMA
// with CU_TENSOR_MAP_SWIZZLE_128B (row r at 128 r, 16-byte chunk c at (c ^ r % 8) * 16;
// descriptor layout 128B, SBO 1024, k-step s at +32 s). B: FP8 codes, the same (TMA, 128B
// swizzle); INT4: the dequantized fp16 W in the non-swizzled core-matrix layout (lab/
// wgmma_fp8.cu's descriptor): element (r, byte b) at ((r / 8) * 8 + b / 16) * 128 + (r % 8) * 16
// + b % 16, LBO 128, SBO 1024, k-step s at +256 s; the 8 lanes of a quarter-warp store one core
// matrix, 128 contiguous bytes: conflict-free. R: v4's TMA area for the packed INT4 words, unused
// since v5 (kept so that the stage size, hence every build's ring depth, FP8's included, is v4's).
//
// Producers (registers lowered by setmaxnreg.dec in the 384-thread builds):
//   Thread 0 issues the TMA copies of each k-tile once its stage is empty (tensor maps in global
//   memory, nanoqwen_lib/gpu/tensor_map.py; rows past T or N are zero-filled). FP8: X and the
//   codes, that is all. INT4 (v5, v3's W path): X only; every producer thread holds its share of
//   the packed W words (16 or 32 bytes of a row per k-tile) and the row's scale, loaded by __ldg
//   PF k-tiles ahead into a register ring; once the stage is empty it dequantizes them straight
//   into the B tile (each word, 8 consecutive k, into one 16-byte core-matrix row), then
//   fence.proxy.async.shared::cta (the wgmma and the next TMA into the stage go through the
//   async proxy) and a plain arrive on `full`.
// Consumers (registers raised by setmaxnreg.inc in the 384-thread builds): wait `full`, 4
// wgmmas (one k-tile), commit;
// wait until one group is pending, i.e. the previous k-tile's group is done, and release its
// stage. FP8: the tensor core's accumulator keeps fewer bits than FP32 (lab/wgmma_fp8.cu), so every
// NQ_PW_FP8_PROMOTE k of a stage are summed into a fresh fragment, waited for, and added into the
// FP32 total (the interval: chapter 12 measures the error of each against float64).
//
// SwiGLU: the CTA's B tile takes BN/2 gate rows n0.. and the BN/2 up rows I + n0.., so thread
// column c < BN/2 holds g and column c + BN/2 holds u of the same feature n0 + c.
//
// Split-K (gridDim.z = S > 1): as prefill_gemm.cu (slice z takes k-tiles [z KT/S, (z+1) KT/S);
// FP32 partials to a workspace, the last CTA of the tile sums them in slice order); only the
// 256 consumer threads take part (named barrier 1).
// Launch: blockDim = INT4_THREADS (ops_prefill.wgmma_int4_threads(bn)) for the INT4 kernels,
// THREADS for the FP8 one.
#include "hopper.cuh"
#include "fp8.cuh"
#include "wgmma_ops.cuh"

#ifndef NQ_PW_BN   // features per CTA tile (the wgmma N): 112, 128, 144 or 256
#error "NQ_PW_BN: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PW_STAGES   // shared-memory ring depth
#error "NQ_PW_STAGES: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PW_PREFETCH   // W k-tiles the INT4 producer holds in registers ahead of use
#error "NQ_PW_PREFETCH: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PW_PRODUCER_REGS
#error "NQ_PW_PRODUCER_REGS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PW_CONSUMER_REGS
#error "NQ_PW_CONSUMER_REGS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PW_FP8_PROMOTE   // FP8: k values per promotion of the tensor core's sums into FP32
#error "NQ_PW_FP8_PROMOTE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PW_BM
#error "NQ_PW_BM: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PW_ROW_BYTES
#error "NQ_PW_ROW_BYTES: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PW_THREADS
#error "NQ_PW_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PW_INT4_2P_MAX_BN
#error "NQ_PW_INT4_2P_MAX_BN: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif

static_assert(NQ_LAYOUT_ID == 1, "the INT4 kernels read layout 1 (INT4, ValueShuffle)");
static_assert(NQ_GROUP_SIZE == 128, "a k-tile of 64 lies inside one scale group");

namespace pw {
constexpr int BM = NQ_PW_BM;                 // tokens per tile: 2 consumer warpgroups x 64
constexpr int BN = NQ_PW_BN;
constexpr int ROW = NQ_PW_ROW_BYTES;         // bytes of k per operand row per stage (128)
constexpr int BK16 = ROW / 2;                // k per stage, fp16 operands (64; E4M3: ROW = 128)
constexpr int STAGES = NQ_PW_STAGES;
constexpr int THREADS = NQ_PW_THREADS;       // FP8 (and INT4 at BN > NQ_PW_INT4_2P_MAX_BN): 1 producer + 2 consumer WGs
// INT4 / SwiGLU at BN <= NQ_PW_INT4_2P_MAX_BN: 2 producer warpgroups (twice the dequantization
// rate) + 2 consumers, 512 threads. 512 threads cap ptxas at 128 registers a thread for the whole
// kernel (setmaxnreg cannot raise the compile-time budget: m64n256 needs >= 154), so the wider
// tiles keep 1 producer warpgroup and 384 threads.
constexpr int INT4_PWGS = BN <= NQ_PW_INT4_2P_MAX_BN ? 2 : 1;
constexpr int INT4_THREADS = 128 * (INT4_PWGS + 2);
// FP8: k values summed in the tensor core's accumulator before each promotion into FP32 (32,
// 64 or 128: one, two or four k32 wgmmas a group).
constexpr int FP8_PROMOTE = NQ_PW_FP8_PROMOTE;
constexpr int FP8_STEPS = FP8_PROMOTE / 32;
static_assert(FP8_PROMOTE == 32 || FP8_PROMOTE == 64 || FP8_PROMOTE == 128, "NQ_PW_FP8_PROMOTE: 32, 64 or 128");
constexpr int PF = NQ_PW_PREFETCH;           // scale register ring depth (k-tiles ahead)
// A stage: A (X, BM rows of 128 bytes, 128B swizzle), B (BN operand rows of 128 bytes), R (INT4:
// the packed words of the BN weight rows, 32 bytes each, padded to 1 KiB; unused by FP8).
constexpr int A_BYTES = BM * ROW, B_BYTES = BN * ROW, R_BYTES = (BN * 32 + 1023) / 1024 * 1024;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES + R_BYTES;
constexpr uint32_t LBO = 128, SBO = 1024;
static_assert(BM == 128 && THREADS == 384, "FP8: 1 producer + 2 consumer warpgroups, 64 tokens each");
static_assert(NQ_PW_INT4_2P_MAX_BN <= 128, "512 threads: 128 registers a thread, BN / 2 accumulators");
static_assert(ROW == 128, "a stage row is 8 chunks of 16 bytes (the core-matrix layout above)");
static_assert(BN % 16 == 0 && BN >= 64 && BN <= 256, "BN: a multiple of 16 in 64..256 (wgmma N, SwiGLU halves)");
static_assert(STAGES >= 2 && STAGES <= 8, "2..8 stages");
static_assert(STAGE_BYTES % 1024 == 0 && A_BYTES % 1024 == 0, "stages and tiles keep 1024-byte alignment (128B swizzle)");
static_assert(BM <= 256 && BN <= 256, "a TMA box dimension holds at most 256 rows");
static_assert(NQ_PW_PRODUCER_REGS * 128 + NQ_PW_CONSUMER_REGS * 256 <= 65536, "register file: 64K");

enum Mode { kInt4 = 0, kSwiglu = 1, kFp8 = 2 };
template <int MODE> constexpr int kProducerWGs = MODE == kFp8 ? 1 : INT4_PWGS;

__device__ __forceinline__ uint32_t core_off(int r, int chunk) { return ((r >> 3) * 8 + chunk) * 128 + (r & 7) * 16; }
// The dequantized INT4 B tile: no swizzle, core matrices (LBO 128, SBO 1024); k-step s at +256 s.
__device__ __forceinline__ uint64_t desc(uint32_t saddr) {
  return (uint64_t)((saddr >> 4) & 0x3FFF) | ((uint64_t)(LBO >> 4) << 16) | ((uint64_t)(SBO >> 4) << 32);
}
// A tile written by TMA with CU_TENSOR_MAP_SWIZZLE_128B: row r at 128 r, its 16-byte chunk c at
// ((c ^ (r % 8)) * 16); descriptor layout 1 (128B swizzle) in bits 62-63, SBO = 1024 (8 rows),
// LBO unused (1); the tile base 1024-aligned; k-step s (32 bytes of k) starts at +32 s.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr) {
  return (uint64_t)((saddr >> 4) & 0x3FFF) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ void sts128(uint32_t a, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// Non-blocking: has the phase of `bar` with this parity completed?
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(ok) : "r"(hopper::smem_u32(bar)), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// ---- dequantization (prefill_gemm.cu's, see there) ----------------------------------------
constexpr uint32_t kMagicLo = 0x64086408u, kMagicHi = 0x54805480u;
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// One ValueShuffle word (8 consecutive k) times the scale pair s2 -> 16 bytes of fp16 in k order.
__device__ __forceinline__ void store_dequant(uint32_t dst, uint32_t w, uint32_t s2) {
  const uint32_t w_hi = nqptx::prmt(w, 0u, 0x3311u);
  sts128(dst, hmul2(nqptx::hsub2((w & 0x000F000Fu) ^ kMagicLo, kMagicLo), s2),
         hmul2(nqptx::hsub2((w & 0x00F000F0u) ^ kMagicHi, kMagicHi), s2),
         hmul2(nqptx::hsub2((w_hi & 0x000F000Fu) ^ kMagicLo, kMagicLo), s2),
         hmul2(nqptx::hsub2((w_hi & 0x00F000F0u) ^ kMagicHi, kMagicHi), s2));
}
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

struct Problem {
  const void* x;              // fp16 [T, K] or E4M3 [T, K]
  const void* w;              // uint32 [N, K/8] (INT4) or uint8 [N, K] (FP8)
  const void* scales;         // fp16 [N, K/128] (INT4) or fp32 [N] (FP8)
  const float* ts;            // FP8: fp32 [T]
  const half* bias;           // [N] or null
  const half* residual;       // [T, N] or null (may alias y)
  half* y;                    // [T, N]; SwiGLU: act [T, N/2]
  int T, N, K;                // N: rows of W (SwiGLU: 2 I)
  const hopper::TensorMap* xmap;   // X (or xq) [T, K]: box {BM rows, 128 bytes}, 128B swizzle
  const hopper::TensorMap* wmap;   // FP8 codes [N, K]: box {BN rows, 128 bytes}, 128B swizzle; INT4 words
                                   // uint32 [N, K/8]: box {BN (SwiGLU: BN/2) rows, 8 words}, no swizzle
};

// ---- producer ------------------------------------------------------------------------------
template <int MODE>
__device__ __forceinline__ void producer(const Problem& p, unsigned char* smem, uint64_t* full, uint64_t* empty,
                                         int pwg, int m0, int n0, int kt0, int nkt) {
  const int tid = threadIdx.x & 127;   // within the producer warpgroup pwg
  const uint32_t base = hopper::smem_u32(smem);
  hopper::MbarRing<STAGES> ring;
  // Thread 0 issues the TMA copies: X's box (BM rows from m0, 128 bytes of k), zero-filled past T.
  if (threadIdx.x == 0) {
    hopper::prefetch_tensor_map(p.xmap);
    if constexpr (MODE == kFp8) hopper::prefetch_tensor_map(p.wmap);
  }
  if constexpr (MODE == kFp8) {
    if (tid != 0) return;
    for (int kk = 0; kk < nkt; ++kk) {
      hopper::mbar_wait(&empty[ring.stage], ring.phase ^ 1u);
      unsigned char* st = smem + ring.stage * STAGE_BYTES;
      const int kc = (kt0 + kk) * ROW;   // E4M3: bytes = elements
      hopper::mbar_arrive_expect_tx(&full[ring.stage], A_BYTES + B_BYTES);
      hopper::tensor_copy_2d_g2s(st, p.xmap, kc, m0, &full[ring.stage]);
      hopper::tensor_copy_2d_g2s(st + A_BYTES, p.wmap, kc, n0, &full[ring.stage]);
      ring.advance();
    }
  } else {
    // INT4 (v5): INT4_PWGS producer warpgroups, NPT threads, q = 0..NPT-1. The B tile's BN weight
    // rows split into BN * INT4_PWGS units of WPU packed words (a k-tile's 8 words of the row, or
    // half of them with 2 producer warpgroups): unit u is row b = u % BN, part h = u / BN; thread
    // q takes units q + NPT i (i < UPT). Weight row b: W row n0 + b, or for SwiGLU (n0 = the
    // feature offset) gate row n0 + b (b < BN/2) and up row I + n0 + b - BN/2. Words and scales
    // by __ldg, PF k-tiles ahead, in registers (rows past the tensor: zeros); dequantized
    // straight into the stage's B tile once the stage is empty. A quarter-warp stores 8
    // consecutive rows of one chunk: one 128-byte core matrix, conflict-free.
    constexpr int NPT = 128 * INT4_PWGS;                    // producer threads
    constexpr int WPU = 8 / INT4_PWGS, VPU = WPU / 4;       // words / uint4 per unit
    constexpr int UPT = (BN * INT4_PWGS + NPT - 1) / NPT;   // units per producer thread
    // Register ring depth: 2 rows x 9 registers a k-tile at BN > 128 (1 producer warpgroup, 96
    // registers): 3 k-tiles (4 spill); ~1.7 us a k-tile at bn 256 covers the global latency.
    constexpr int PF = UPT * VPU >= 2 && NQ_PW_PREFETCH > 3 ? 3 : NQ_PW_PREFETCH;
    const int q = tid + 128 * pwg;
    const int I = p.N / 2, G = p.K / NQ_GROUP_SIZE, KW = p.K / 8;
    const uint4* wrow[UPT];
    const unsigned short* srow[UPT];
    bool wok[UPT];
    uint32_t dst0[UPT];
#pragma unroll
    for (int i = 0; i < UPT; ++i) {
      const int u = q + NPT * i, b = u % BN, h = u / BN;
      int n;
      if constexpr (MODE == kSwiglu) {
        const int f = n0 + (b % (BN / 2));
        wok[i] = u < BN * INT4_PWGS && f < I;
        n = (b < BN / 2 ? 0 : I) + f;
      } else {
        n = n0 + b;
        wok[i] = u < BN * INT4_PWGS && n < p.N;
      }
      n = wok[i] ? n : 0;
      wrow[i] = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(p.w) + (size_t)n * KW) + h * VPU;
      srow[i] = reinterpret_cast<const unsigned short*>(static_cast<const half*>(p.scales) + (size_t)n * G);
      dst0[i] = A_BYTES + core_off(b, h * WPU);
    }
    uint4 wv[PF][UPT][VPU];
    uint32_t sc[PF][UPT];
    auto load = [&](int d, int kt) {   // d: a compile-time constant at every call (unrolled)
#pragma unroll
      for (int i = 0; i < UPT; ++i) {
#pragma unroll
        for (int v = 0; v < VPU; ++v)   // 8 words (2 uint4) per row and k-tile
          wv[d][i][v] = wok[i] ? __ldg(wrow[i] + kt * 2 + v) : make_uint4(0u, 0u, 0u, 0u);
        sc[d][i] = wok[i] ? (uint32_t)__ldg(srow[i] + (kt * BK16) / NQ_GROUP_SIZE) * 0x10001u : 0u;
      }
    };
#pragma unroll
    for (int d = 0; d < PF; ++d)
      if (d < nkt) load(d, kt0 + d);
    for (int kb = 0; kb < nkt; kb += PF) {
#pragma unroll
      for (int d = 0; d < PF; ++d) {
        const int kk = kb + d;
        if (kk >= nkt) break;
        hopper::mbar_wait(&empty[ring.stage], ring.phase ^ 1u);
        unsigned char* stp = smem + ring.stage * STAGE_BYTES;
        if (q == 0) {   // X by TMA: one elected thread, expect_tx (full: 1 + NPT arrivals)
          hopper::mbar_arrive_expect_tx(&full[ring.stage], A_BYTES);
          hopper::tensor_copy_2d_g2s(stp, p.xmap, (kt0 + kk) * BK16, m0, &full[ring.stage]);
        }
        const uint32_t st = base + ring.stage * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
          if (q + NPT * i < BN * INT4_PWGS) {
            const uint32_t dst = st + dst0[i];
#pragma unroll
            for (int v = 0; v < VPU; ++v) {
              store_dequant(dst + (4 * v + 0) * 128, wv[d][i][v].x, sc[d][i]);
              store_dequant(dst + (4 * v + 1) * 128, wv[d][i][v].y, sc[d][i]);
              store_dequant(dst + (4 * v + 2) * 128, wv[d][i][v].z, sc[d][i]);
              store_dequant(dst + (4 * v + 3) * 128, wv[d][i][v].w, sc[d][i]);
            }
          }
        }
        hopper::fence_proxy_async_smem();
        hopper::mbar_arrive(&full[ring.stage]);
        if (kk + PF < nkt) load(d, kt0 + kk + PF);
        ring.advance();
      }
    }
  }
}

// ---- consumers -----------------------------------------------------------------------------
template <int MODE>
__device__ __forceinline__ void mainloop(float (&acc)[BN / 2], unsigned char* smem, uint64_t* full, uint64_t* empty,
                                         int wg, int nkt) {
  const uint32_t base = hopper::smem_u32(smem);
  const bool leader = (threadIdx.x & 31) == 0;
  hopper::MbarRing<STAGES> ring;
  int prev = -1;
  // [wgmma-consumer]
  for (int kk = 0; kk < nkt; ++kk) {
    hopper::mbar_wait(&full[ring.stage], ring.phase);
    const uint32_t a = base + ring.stage * STAGE_BYTES + wg * (64 * ROW);
    const uint32_t b = base + ring.stage * STAGE_BYTES + A_BYTES;
    if constexpr (MODE == kFp8) {
      // Promotion every FP8_PROMOTE k: each group of FP8_STEPS k32 wgmmas sums into a fresh
      // fragment (scale-d 0 on its first), which is waited for and added into the FP32 total.
      float part[BN / 2];
#pragma unroll
      for (int g = 0; g < ROW / FP8_PROMOTE; ++g) {
        hopper::wgmma_fence();
#pragma unroll
        for (int s = 0; s < FP8_STEPS; ++s) {
          const int ks = g * FP8_STEPS + s;
          wgmma::wgmma_e4m3<BN>(part, desc_sw128(a + 32 * ks), desc_sw128(b + 32 * ks), s);
        }
        hopper::wgmma_commit();
        hopper::wgmma_wait<0>();
        if (g == ROW / FP8_PROMOTE - 1 && leader) hopper::mbar_arrive(&empty[ring.stage]);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] += part[i];
      }
    } else {
      hopper::wgmma_fence();
#pragma unroll
      for (int s = 0; s < ROW / 32; ++s) wgmma::wgmma_f16<BN>(acc, desc_sw128(a + 32 * s), desc(b + 256 * s), 1);
      hopper::wgmma_commit();
      hopper::wgmma_wait<1>();   // the previous k-tile's group is done: its stage is free
      if (prev >= 0 && leader) hopper::mbar_arrive(&empty[prev]);
      prev = ring.stage;
    }
    ring.advance();
  }
  // [/wgmma-consumer]
  if constexpr (MODE != kFp8) {
    hopper::wgmma_wait<0>();
    if (prev >= 0 && leader) hopper::mbar_arrive(&empty[prev]);
  }
}

// Split-K: workspace [slice][tile][j = 0..BN/8)[256 consumer threads] of float4. True in the
// CTA that holds the tile's sum.
__device__ __forceinline__ bool reduce_split(float (&acc)[BN / 2], float* ws, int* counters, int ct) {
  __shared__ int is_last;
  const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
  const int S = gridDim.z, z = blockIdx.z;
  float4* part = reinterpret_cast<float4*>(ws);
  const size_t slice_stride = (size_t)tiles * (BN / 8) * 256;
  float4* mine = part + (size_t)tile * (BN / 8) * 256 + ct;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
    __stcg(mine + z * slice_stride + j * 256, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
  __threadfence();
  consumer_sync();
  if (ct == 0) is_last = atomicAdd(&counters[tile], 1) == S - 1;
  consumer_sync();
  if (!is_last) return false;
  __threadfence();
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const float4* src = mine + j * 256;
    float4 sum = __ldcg(src);
    for (int zz = 1; zz < S; ++zz) {   // slice order: the same bits every run
      const float4 v = __ldcg(src + zz * slice_stride);
      sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
    }
    acc[4 * j] = sum.x; acc[4 * j + 1] = sum.y; acc[4 * j + 2] = sum.z; acc[4 * j + 3] = sum.w;
  }
  if (ct == 0) counters[tile] = 0;   // ready for the next launch
  return true;
}

template <int MODE>
__device__ __forceinline__ void epilogue(const Problem& p, const float (&acc)[BN / 2], int m0, int n0, int wg) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row0 = m0 + 64 * wg + 16 * warp + (lane >> 2), col0 = 2 * (lane & 3);
  if constexpr (MODE == kSwiglu) {
    const int I = p.N / 2;
#pragma unroll
    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = row0 + 8 * rr, f = n0 + 8 * j + col0;
        if (row >= p.T || f >= I) continue;   // I % 8 == 0: f + 1 < I too
        const float g0 = __half2float(__float2half_rn(acc[4 * j + 2 * rr]));
        const float g1 = __half2float(__float2half_rn(acc[4 * j + 2 * rr + 1]));
        const float u0 = __half2float(__float2half_rn(acc[4 * (j + BN / 16) + 2 * rr]));
        const float u1 = __half2float(__float2half_rn(acc[4 * (j + BN / 16) + 2 * rr + 1]));
        *reinterpret_cast<half2*>(p.y + (size_t)row * I + f) = __floats2half2_rn(silu_mul(g0, u0), silu_mul(g1, u1));
      }
  } else {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = row0 + 8 * rr, col = n0 + 8 * j + col0;
        if (row >= p.T || col >= p.N) continue;   // N % 8 == 0: col + 1 < N too
        if constexpr (MODE == kFp8) {
          nqfp8::store_scaled(p.y, p.ts, static_cast<const float*>(p.scales), p.bias, p.residual, row, col, p.T, p.N,
                              acc[4 * j + 2 * rr]);
          nqfp8::store_scaled(p.y, p.ts, static_cast<const float*>(p.scales), p.bias, p.residual, row, col + 1, p.T,
                              p.N, acc[4 * j + 2 * rr + 1]);
        } else {
          float v0 = acc[4 * j + 2 * rr], v1 = acc[4 * j + 2 * rr + 1];
          if (p.bias) {
            v0 += __half2float(p.bias[col]);
            v1 += __half2float(p.bias[col + 1]);
          }
          half2* dst = reinterpret_cast<half2*>(p.y + (size_t)row * p.N + col);
          if (p.residual) {
            const float2 r = __half22float2(*reinterpret_cast<const half2*>(p.residual + (size_t)row * p.N + col));
            v0 += r.x;
            v1 += r.y;
          }
          *dst = __floats2half2_rn(v0, v1);
        }
      }
  }
}

// Dynamic shared memory: STAGES * STAGE_BYTES + 1024 (alignment) + 3 STAGES barriers (2 used since v5).
template <int MODE>
__device__ __forceinline__ void gemm_body(const Problem& p, float* ws, int* counters) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (hopper::smem_u32(smem_raw) & 1023u)) & 1023u);   // 1024-aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  constexpr int NPWG = kProducerWGs<MODE>;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      hopper::mbar_init(&full[s], MODE == kFp8 ? 1 : 1 + 128 * NPWG);   // TMA thread's expect_tx (+ 256 dequant arrivals)
      hopper::mbar_init(&empty[s], 8);   // one arrival per consumer warp
    }
    hopper::fence_mbarrier_init();
  }
  __syncthreads();
  const int m0 = blockIdx.x * BM;
  const int n0 = blockIdx.y * (MODE == kSwiglu ? BN / 2 : BN);
  const int KT = p.K / ROW * (MODE == kFp8 ? 1 : 2);   // stages of 128 bytes of k per row
  const int kt0 = (blockIdx.z * KT) / gridDim.z, nkt = ((blockIdx.z + 1) * KT) / gridDim.z - kt0;
  const int wg = threadIdx.x / 128;
  if (wg < NPWG) {
    if constexpr (NPWG == 1) hopper::setmaxnreg_dec<NQ_PW_PRODUCER_REGS>();   // 512 threads: 128 each, as compiled
    producer<MODE>(p, smem, full, empty, wg, m0, n0, kt0, nkt);
  } else {
    if constexpr (NPWG == 1) hopper::setmaxnreg_inc<NQ_PW_CONSUMER_REGS>();
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    mainloop<MODE>(acc, smem, full, empty, wg - NPWG, nkt);
    if (gridDim.z > 1 && !reduce_split(acc, ws, counters, threadIdx.x - 128 * NPWG)) return;
    epilogue<MODE>(p, acc, m0, n0, wg - NPWG);
  }
}
}  // namespace pw

// INT4: x fp16 [T, K]; qw uint32 [N, K/8]; scales fp16 [N, K/128]; N % 8 == 0, K % 128 == 0.
// ws fp32 / counters int32 (zero): split-K (gridDim.z > 1) only. Grid (ceil(T/128), ceil(N/BN), S).
// xmap: the device tensor map of X (ops_prefill.xmap: boxes of 128 rows x 64 halves, 128B swizzle).
// wmap: read by the FP8 kernel only (one Problem for all three); the INT4 launchers pass null.
extern "C" __global__ void __launch_bounds__(pw::INT4_THREADS, 1)
nq_prefill_wgmma(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
                 const half* bias, const half* residual, half* y, int T, int N, int K, float* ws, int* counters,
                 const hopper::TensorMap* xmap, const hopper::TensorMap* wmap) {
  pw::gemm_body<pw::kInt4>(pw::Problem{x, qw, scales, nullptr, bias, residual, y, T, N, K, xmap, wmap}, ws, counters);
}

// SwiGLU: qw / scales of gate_up [2I, K]; act fp16 [T, I]; I % 8 == 0. Grid (ceil(T/128), ceil(I/(BN/2)), S).
extern "C" __global__ void __launch_bounds__(pw::INT4_THREADS, 1)
nq_prefill_wgmma_swiglu(const half* __restrict__ x, const uint32_t* __restrict__ qw, const half* __restrict__ scales,
                        half* act, int T, int N2, int K, float* ws, int* counters, const hopper::TensorMap* xmap,
                        const hopper::TensorMap* wmap) {
  pw::gemm_body<pw::kSwiglu>(pw::Problem{x, qw, scales, nullptr, nullptr, nullptr, act, T, N2, K, xmap, wmap}, ws,
                             counters);
}

// FP8: xq uint8 [T, K], ts fp32 [T], codes uint8 [N, K], scales fp32 [N]; N % 8 == 0, K % 128 == 0.
extern "C" __global__ void __launch_bounds__(pw::THREADS, 1)
nq_prefill_wgmma_fp8(const unsigned char* __restrict__ xq, const float* __restrict__ ts,
                     const unsigned char* __restrict__ codes, const float* __restrict__ scales, const half* bias,
                     const half* residual, half* y, int T, int N, int K, float* ws, int* counters,
                     const hopper::TensorMap* xmap, const hopper::TensorMap* wmap) {
  pw::gemm_body<pw::kFp8>(pw::Problem{xq, codes, scales, ts, bias, residual, y, T, N, K, xmap, wmap}, ws, counters);
}
