// prefill_rs.cu: the INT4 prefill GEMM in wgmma's RS form (issue 29; the engine runs it with prefill_gemm="rs"; PERFLOG says what ran).
// nq-arch: sm_90a
//   nq_prefill_rs   Y[T,N] = fp16(X W^T [+ bias] [+ residual]); X fp16 [T, K], W INT4 in the RS
//                   order below, scales fp16 [N, K/128] (and in the RS order, [N/64][K/128][64],
//                   for the shared-memory path); FP32 accumulation, one rounding at the end
//
// The producer form (prefill_wgmma.cu) dequantizes every weight tile into shared memory before the
// tensor cores read it, and its producers run out of issue slots (PERFLOG: 93% of the MMA cycles
// at bn 128). Here the weight is wgmma's A operand *from registers* and X its B operand: the CTA
// computes C^T = W X^T, 64 features a consumer warpgroup (wgmma M) by BM tokens (wgmma N). Each
// consumer thread reads its own packed words (one 16-byte load a k-tile: NQ_RS_WSMEM 1 from the
// stage in shared memory that the producer's bulk copies filled, 0 from global memory, PF k-tiles
// ahead in registers), converts them in registers into A fragments with the magic-number
// dequantization of prefill_gemm.cu (w16 = fp16(code * scale): the same contract, the same
// bits for W), and issues the wgmma. The dequantized W never goes through shared memory; the
// producer warpgroup's one thread only moves bytes: X by TMA (and, with NQ_RS_WSMEM, the packed
// W and its scales by bulk copies) into a ring of NQ_RS_STAGES stages on mbarriers (`full`: its
// arrive.expect_tx; `empty`: one arrival per consumer warp once the wgmma group that read the
// stage is done).
//
// Why the shared-memory path (PERFLOG, "the RS form on the H200"): in the global path ptxas gives
// every LDG one scoreboard, so the wait for the scale loaded just before a conversion also waits
// for the W words prefetched for later k-tiles; each k-tile then waits for a global load issued
// one k-tile before. Loads from shared memory return in tens of cycles.
//
// The RS order (nanoqwen_lib/gpu/ops_prefill_rs.py: rs_order, from the ValueShuffle words):
// uint4 index ((n64 * KT + kt) * 4 + w) * 32 + l for feature block n64 (64 rows), k-tile kt (64 k),
// warp w of the consumer warpgroup, lane l (g = l/4, t = l%4). Its word s (k16 step s of the k-tile)
// is the ValueShuffle word of the 8 codes (row, k), c = 64 kt + 16 s + 2t, r = 64 n64 + 16 w + g:
//   (r, c), (r, c+1), (r+8, c), (r+8, c+1), (r, c+8), (r, c+9), (r+8, c+8), (r+8, c+9)
// so that its four converted half2 are a[0..3] of wgmma_rs_ops.cuh's fragment, in order. A warp
// reads 512 contiguous bytes a k-tile. Rows past N hold code 0 (their outputs are not stored).
#include "hopper.cuh"
#include "wgmma_rs_ops.cuh"

// nq-build: NQ_RS_BM=128 NQ_RS_CWG=2 NQ_RS_STAGES=4 NQ_RS_PF=4 NQ_RS_OVERLAP=0 NQ_RS_KG=1 NQ_RS_WSMEM=1 NQ_RS_PROBE=0 NQ_RS_SWIGLU=0
// The build above reaches this file as -D (cuda_build.kernel_build); the launcher reads the same
// line (nanoqwen_lib/gpu/ops_prefill_rs.py: RS_BUILD) and may override each name:
//   NQ_RS_BM tokens per CTA (the wgmma N: 64, 128), NQ_RS_CWG consumer warpgroups (64 features each),
//   NQ_RS_STAGES the X ring's depth, NQ_RS_PF k-tiles of W in registers ahead of use (the k loop is
//   unrolled by it), NQ_RS_OVERLAP 1 (with NQ_RS_WSMEM 0): convert k-tile kt+1 while kt's wgmmas
//   run in the same warpgroup, one group a k-tile (ptxas then serializes the wgmmas, C7513);
//   2 (with NQ_RS_WSMEM 1, lab): a group per k16 step and two fragment sets, step s of kt+1
//   converted right after step s of kt is issued (below, [rs-overlap]); 0: each warpgroup waits
//   for its own group, and the other consumer warpgroup's wgmmas keep the tensor cores busy meanwhile.
//   NQ_RS_KG k-tiles a wgmma group (not overlapped): 2 converts two k-tiles, then issues their 8
//   wgmmas as one group and waits once (half the waits, twice the fragment registers).
//   NQ_RS_WSMEM 1: W and its scales by bulk copies into each stage (the consumers read them with
//   LDS), 0: each consumer thread loads its W with LDG, PF k-tiles ahead (PF unused with 1).
//   NQ_RS_PROBE (timing probes, wrong values): 1 no conversion (the raw words are the fragments:
//   loads, ring and wgmmas only), 2 no wgmma (loads, ring and conversion; the fragments folded
//   into one accumulator so that they stay live).
//   NQ_RS_SWIGLU 1 (gate_up only, with NQ_RS_WSMEM): W is gate_up in the SwiGLU row order (below) and
//   the kernel stores act[T, I] = fp16(silu(fp16(g)) * fp16(u)) instead of [g | u]: the bits of the
//   plain GEMM followed by nq_swiglu_act, without the [T, 2I] round trip through global memory.
//
// The SwiGLU row order (prefill_rs.py: swiglu_rows) interleaves gate and up so that one thread's two
// rows are the gate and the up row of one feature: in feature block b (64 rows), row 16 w + g is
// gate row f = 32 b + 8 w + g and row 16 w + g + 8 is up row I + f (rows of f >= I: code 0).
#if !defined(NQ_RS_BM) || !defined(NQ_RS_CWG) || !defined(NQ_RS_STAGES) || !defined(NQ_RS_PF) || !defined(NQ_RS_OVERLAP) \
    || !defined(NQ_RS_KG) || !defined(NQ_RS_WSMEM) || !defined(NQ_RS_PROBE) || !defined(NQ_RS_SWIGLU)
#error "NQ_RS_*: the nq-build line above, through nanoqwen_lib.gpu.cuda_build"
#endif

namespace rs {
constexpr int BM = NQ_RS_BM, CWG = NQ_RS_CWG, STAGES = NQ_RS_STAGES, PF = NQ_RS_PF, KG = NQ_RS_KG;
constexpr int BK = 64;                          // k per stage and k-tile (128 bytes of fp16 X)
constexpr int BNF = 64 * CWG;                   // features per CTA
constexpr int THREADS = 128 * (1 + CWG);
constexpr int STAGE_BYTES = BM * 2 * BK;        // X tile: BM rows of 128 bytes, 128B swizzle
constexpr int W_CHUNK = 64 * BK / 2;            // one warpgroup's packed W of a k-tile: 2048 bytes
constexpr int S_CHUNK = 64 * 2;                 // its 64 rows' scales of the k-tile's group: 128 bytes
constexpr int W_STAGE = NQ_RS_WSMEM ? CWG * (W_CHUNK + S_CHUNK) : 0;   // a stage's W and scales
constexpr int RING_BYTES = STAGES * (STAGE_BYTES + W_STAGE);          // X ring, then W ring
static_assert(BM == 64 || BM == 128, "BM: a wgmma N with an RS wrapper (64, 128)");
static_assert(CWG >= 1 && CWG <= 3, "1..3 consumer warpgroups");
static_assert((KG == 1 || KG == 2) && PF % KG == 0 && (KG == 1 || !NQ_RS_OVERLAP) && STAGES > KG,
              "KG: 1 or 2 k-tiles a group, dividing PF, not overlapped, fewer than the stages");
static_assert(NQ_RS_PROBE == 0 || NQ_RS_PROBE == 1 || (NQ_RS_PROBE == 2 && !NQ_RS_OVERLAP), "probes: 1, 2 (not overlapped)");
static_assert(NQ_RS_OVERLAP >= 0 && NQ_RS_OVERLAP <= 2, "NQ_RS_OVERLAP: 0, 1 or 2");
static_assert(NQ_RS_OVERLAP != 1 || !NQ_RS_WSMEM, "NQ_RS_OVERLAP 1 reads W from global memory (NQ_RS_WSMEM 0)");
static_assert(NQ_RS_OVERLAP != 2 || (NQ_RS_WSMEM && NQ_RS_PROBE == 0 && STAGES >= 3),
              "NQ_RS_OVERLAP 2: W from the stage, no probe, 3 stages at least (two held, one awaited)");
static_assert(!NQ_RS_SWIGLU || NQ_RS_WSMEM, "SwiGLU: the shared-memory path (its scales come in the RS order)");
static_assert(PF == 2 || PF == 4, "PF: 2 or 4 (the k loop is unrolled by it; fragments alternate)");
static_assert(STAGES >= 2 && STAGES <= 8 && STAGE_BYTES % 1024 == 0, "2..8 stages, 1024-aligned");
constexpr uint32_t kMagicLo = 0x64086408u, kMagicHi = 0x54805480u;   // prefill_gemm.cu's

struct Problem {
  const half* x;             // [T, K]
  const uint4* w;            // RS order, [ceil(N/64)][K/64][4][32] uint4
  const half* scales;        // [N, K/128]
  const half* scales_rs;     // [ceil(N/64)][K/128][64] (NQ_RS_WSMEM), rows past N 0
  const half* bias;          // [N] or null
  const half* residual;      // [T, N] or null (may alias y)
  half* y;                   // [T, N] (NQ_RS_SWIGLU: act [T, N / 2])
  int T, N, K;               // NQ_RS_SWIGLU: N = 2 I, the rows of gate_up
  const hopper::TensorMap* xmap;   // X: boxes of BM rows x 64 halves, 128B swizzle
};

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// B = X's stage (BM token rows x 128 bytes of k), written by TMA with the 128B swizzle; k16 step s
// at +32 s (prefill_wgmma.cu's desc_sw128).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr) {
  return (uint64_t)((saddr >> 4) & 0x3FFF) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
// One RS word -> a[0..3]: (nibbles 0, 4) row r, (1, 5) row r+8, (2, 6) row r, (3, 7) row r+8;
// s_r, s_r8: the two rows' scales as half2 pairs.
// [rs-convert]
__device__ __forceinline__ void convert(uint32_t (&a)[4], uint32_t w, uint32_t s_r, uint32_t s_r8) {
  const uint32_t w_hi = nqptx::prmt(w, 0u, 0x3311u);
  a[0] = hmul2(nqptx::hsub2((w & 0x000F000Fu) ^ kMagicLo, kMagicLo), s_r);
  a[1] = hmul2(nqptx::hsub2((w & 0x00F000F0u) ^ kMagicHi, kMagicHi), s_r8);
  a[2] = hmul2(nqptx::hsub2((w_hi & 0x000F000Fu) ^ kMagicLo, kMagicLo), s_r);
  a[3] = hmul2(nqptx::hsub2((w_hi & 0x00F000F0u) ^ kMagicHi, kMagicHi), s_r8);
}
// [/rs-convert]

__device__ __forceinline__ void producer(const Problem& p, unsigned char* smem, uint64_t* full, uint64_t* empty,
                                         int m0, int n0, int KT) {
  if (threadIdx.x != 0) return;
  hopper::prefetch_tensor_map(p.xmap);
  hopper::MbarRing<STAGES> ring;
  [[maybe_unused]] const int nb = (p.N + 63) / 64, G = p.K / NQ_GROUP_SIZE;
  for (int kt = 0; kt < KT; ++kt) {
    hopper::mbar_wait(&empty[ring.stage], ring.phase ^ 1u);
    hopper::mbar_arrive_expect_tx(&full[ring.stage], STAGE_BYTES + W_STAGE);
    hopper::tensor_copy_2d_g2s(smem + ring.stage * STAGE_BYTES, p.xmap, kt * BK, m0, &full[ring.stage]);
#if NQ_RS_WSMEM
    unsigned char* wst = smem + STAGES * STAGE_BYTES + ring.stage * W_STAGE;
#pragma unroll
    for (int c = 0; c < CWG; ++c) {   // a warpgroup past N copies the last block (it stores nothing)
      const int blk = min(n0 / 64 + c, nb - 1);
      hopper::bulk_copy_g2s(wst + c * W_CHUNK, p.w + (size_t)(blk * KT + kt) * (W_CHUNK / 16), W_CHUNK, &full[ring.stage]);
      hopper::bulk_copy_g2s(wst + CWG * W_CHUNK + c * S_CHUNK, p.scales_rs + ((size_t)blk * G + (kt * BK) / NQ_GROUP_SIZE) * 64,
                            S_CHUNK, &full[ring.stage]);
    }
#endif
    ring.advance();
  }
}

// A k-tile's four words -> its four k16 steps' A fragments (NQ_RS_PROBE 1: the raw words).
__device__ __forceinline__ void fragments(uint32_t (&a)[4][4], const uint4& wq, uint32_t sr, uint32_t sr8) {
#if NQ_RS_PROBE == 1
  const uint32_t raw[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int q = 0; q < 4; ++q) a[s][q] = raw[(s + q) & 3];
#else
  convert(a[0], wq.x, sr, sr8);
  convert(a[1], wq.y, sr, sr8);
  convert(a[2], wq.z, sr, sr8);
  convert(a[3], wq.w, sr, sr8);
#endif
}

// The wgmma group of k-tiles 0..j of a group (their fragments converted, their stages full):
// issued, waited for, and their stages released (one arrival per warp).
__device__ __forceinline__ void issue_group(float (&acc)[BM / 2], const uint32_t (&frag)[KG][4][4],
                                            const uint32_t (&group_b)[KG], const uint32_t (&group_stage)[KG], int j,
                                            uint64_t* empty, bool leader) {
  hopper::wgmma_fence();
#pragma unroll
  for (int q = 0; q < KG; ++q)
    if (q <= j) {
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma::wgmma_f16_rs<BM>(acc, frag[q][s], desc_sw128(group_b[q] + 32 * s), 1);
    }
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();   // the group is done: its stages and fragments are free
#pragma unroll
  for (int q = 0; q < KG; ++q)
    if (q <= j && leader) hopper::mbar_arrive(&empty[group_stage[q]]);
}

// This thread's 16 bytes of W and its two rows' scales (as half2 pairs) in stage `stage`.
__device__ __forceinline__ void stage_words(const unsigned char* smem, int stage, int cw, int warp, int lane, int g,
                                            uint4& wq, uint32_t& sr, uint32_t& sr8) {
  const unsigned char* wst = smem + STAGES * STAGE_BYTES + stage * W_STAGE;
  wq = reinterpret_cast<const uint4*>(wst + cw * W_CHUNK)[warp * 32 + lane];
  const unsigned short* srow = reinterpret_cast<const unsigned short*>(wst + CWG * W_CHUNK + cw * S_CHUNK);
  sr = (uint32_t)srow[16 * warp + g] * 0x10001u;
  sr8 = (uint32_t)srow[16 * warp + g + 8] * 0x10001u;
}
// The shared-memory path (NQ_RS_WSMEM 1): per k-tile, wait for the stage, read this thread's 16
// bytes of W and its two rows' scales from it, convert, and issue (KG k-tiles a group).
// [rs-consumer]
__device__ __forceinline__ void consumer_smem(unsigned char* smem, uint64_t* full, uint64_t* empty, int cw, int KT,
                                              float (&acc)[BM / 2]) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2;
  const uint32_t base = hopper::smem_u32(smem);
  const bool leader = lane == 0;
  uint32_t frag[KG][4][4], group_b[KG], group_stage[KG];
  hopper::MbarRing<STAGES> ring;
  for (int kb = 0; kb < KT; kb += KG) {
#pragma unroll
    for (int j = 0; j < KG; ++j) {
      const int kt = kb + j;
      if (kt >= KT) break;
      hopper::mbar_wait(&full[ring.stage], ring.phase);
      uint4 wq;
      uint32_t sr, sr8;
      stage_words(smem, ring.stage, cw, warp, lane, g, wq, sr, sr8);
      fragments(frag[j], wq, sr, sr8);
      group_b[j] = base + ring.stage * STAGE_BYTES;
      group_stage[j] = ring.stage;
      ring.advance();
#if NQ_RS_PROBE == 2
      uint32_t fold = 0;
#pragma unroll
      for (int s = 0; s < 4; ++s) fold ^= frag[j][s][0] ^ frag[j][s][1] ^ frag[j][s][2] ^ frag[j][s][3];
      acc[j] += __uint_as_float(fold & 0x3FFFFFFFu);
      __syncwarp();
      if (leader) hopper::mbar_arrive(&empty[group_stage[j]]);
      continue;
#endif
      if (j == KG - 1 || kt == KT - 1) issue_group(acc, frag, group_b, group_stage, j, empty, leader);
    }
  }
}
// [/rs-consumer]

// [rs-overlap] (NQ_RS_OVERLAP 2, lab): the conversion under the warpgroup's own wgmmas. Each
// k16 step is its own wgmma group, and the fragments alternate between two register sets by
// k-tile parity: right after step s of k-tile kt is issued, step s of kt + 1 is converted into
// the other set, whose last reader (step s of kt - 1) has four newer groups behind it, so
// `wgmma.wait_group 4` (almost always already true) is all the conversion waits for. The stage of
// kt - 1 is released once kt's last step is issued (all of kt - 1's groups are then done). A
// register is never written while a wgmma that reads it may be in flight, which is what lets
// ptxas keep the wgmmas asynchronous (no C7513).
__device__ __forceinline__ void consumer_smem_overlap(unsigned char* smem, uint64_t* full, uint64_t* empty, int cw,
                                                      int KT, float (&acc)[BM / 2]) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2;
  const uint32_t base = hopper::smem_u32(smem);
  const bool leader = lane == 0;
  uint32_t frag[2][4][4];
  int held[2] = {-1, -1};            // the stage each fragment set's k-tile read, until it is released
  hopper::MbarRing<STAGES> ring;
  uint4 wq;
  uint32_t sr, sr8;
  hopper::mbar_wait(&full[ring.stage], ring.phase);
  stage_words(smem, ring.stage, cw, warp, lane, g, wq, sr, sr8);
  fragments(frag[0], wq, sr, sr8);
  int cur = ring.stage;
  ring.advance();
  for (int kb = 0; kb < KT; kb += 2) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {   // p: kt's parity, a constant once unrolled
      const int kt = kb + p;
      if (kt >= KT) break;
      const bool more = kt + 1 < KT;
      int next = -1;
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      if (more) {                    // kt + 1's stage: its X for the wgmmas, its W and scales now
        hopper::mbar_wait(&full[ring.stage], ring.phase);
        stage_words(smem, ring.stage, cw, warp, lane, g, wq, sr, sr8);
        w[0] = wq.x, w[1] = wq.y, w[2] = wq.z, w[3] = wq.w;
        next = ring.stage;
        ring.advance();
      }
      const uint32_t b = base + cur * STAGE_BYTES;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        hopper::wgmma_fence();
        wgmma::wgmma_f16_rs<BM>(acc, frag[p][s], desc_sw128(b + 32 * s), 1);
        hopper::wgmma_commit();
        if (more) {
          hopper::wgmma_wait<4>();   // step s of kt - 1 is done: frag[p ^ 1][s] is free
          convert(frag[p ^ 1][s], w[s], sr, sr8);
        }
      }
      if (more) {                    // all of kt - 1's groups are done (four newer: kt's)
        if (held[p ^ 1] >= 0 && leader) hopper::mbar_arrive(&empty[held[p ^ 1]]);
        held[p ^ 1] = -1;
      }
      held[p] = cur;
      cur = next;
    }
  }
  hopper::wgmma_wait<0>();
#pragma unroll
  for (int p = 0; p < 2; ++p)
    if (held[p] >= 0 && leader) hopper::mbar_arrive(&empty[held[p]]);
}
// [/rs-overlap]

// One consumer warpgroup cw: features n0 + 64 cw .. + 63, every token of the tile.
__device__ __forceinline__ void consumer(const Problem& p, unsigned char* smem, uint64_t* full, uint64_t* empty,
                                         int m0, int n0, int cw, int KT) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int r0 = n0 + 64 * cw + 16 * warp + g;            // rows r0 and r0 + 8 of W
  float acc[BM / 2];
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) acc[i] = 0.f;
#if NQ_RS_WSMEM && NQ_RS_OVERLAP == 2
  consumer_smem_overlap(smem, full, empty, cw, KT, acc);
#elif NQ_RS_WSMEM
  consumer_smem(smem, full, empty, cw, KT, acc);
#else
  const int G = p.K / NQ_GROUP_SIZE;
  const unsigned short* s0 = reinterpret_cast<const unsigned short*>(p.scales) + (size_t)min(r0, p.N - 1) * G;
  const unsigned short* s8 = reinterpret_cast<const unsigned short*>(p.scales) + (size_t)min(r0 + 8, p.N - 1) * G;
  // a warpgroup past N (the last CTA, N not a multiple of 64 CWG) reads the last block and stores nothing
  const int blk = min(n0 / 64 + cw, (p.N + 63) / 64 - 1);
  const uint4* wp = p.w + ((size_t)(blk * KT) * 4 + warp) * 32 + lane;   // + 128 kt
  const uint32_t base = hopper::smem_u32(smem);
  const bool leader = lane == 0;
  uint4 wv[PF];
#pragma unroll
  for (int d = 0; d < PF; ++d) wv[d] = d < KT ? __ldg(wp + (size_t)128 * d) : make_uint4(0u, 0u, 0u, 0u);
  uint32_t frag[NQ_RS_OVERLAP ? 2 : KG][4][4];   // overlapping: kt's converted while kt - 1's wgmmas run
  hopper::MbarRing<STAGES> ring;
#if NQ_RS_OVERLAP
  int prev = -1;
#else
  uint32_t group_b[KG], group_stage[KG];   // the stages of the k-tiles converted for the next group
#endif
  for (int kb = 0; kb < KT; kb += PF) {
#pragma unroll
    for (int d = 0; d < PF; ++d) {
      const int kt = kb + d;
      if (kt >= KT) break;
      // the scales of kt's group (two k-tiles a group of 128), as half2 pairs
      const uint32_t sr = (uint32_t)__ldg(s0 + (kt * BK) / NQ_GROUP_SIZE) * 0x10001u;
      const uint32_t sr8 = (uint32_t)__ldg(s8 + (kt * BK) / NQ_GROUP_SIZE) * 0x10001u;
      uint32_t (&a)[4][4] = frag[NQ_RS_OVERLAP ? d & 1 : d % KG];   // free: their group was waited for
      fragments(a, wv[d], sr, sr8);
      if (kt + PF < KT) wv[d] = __ldg(wp + (size_t)128 * (kt + PF));
      hopper::mbar_wait(&full[ring.stage], ring.phase);
      const uint32_t b = base + ring.stage * STAGE_BYTES;
#if NQ_RS_PROBE == 2
      uint32_t fold = 0;
#pragma unroll
      for (int s = 0; s < 4; ++s) fold ^= a[s][0] ^ a[s][1] ^ a[s][2] ^ a[s][3];
      acc[d] += __uint_as_float(fold & 0x3FFFFFFFu) + (float)(b & 1u);
      __syncwarp();
      if (leader) hopper::mbar_arrive(&empty[ring.stage]);
      ring.advance();
      continue;
#endif
#if NQ_RS_OVERLAP
      hopper::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma::wgmma_f16_rs<BM>(acc, a[s], desc_sw128(b + 32 * s), 1);
      hopper::wgmma_commit();
      hopper::wgmma_wait<1>();   // kt - 1's group is done: its stage and its fragments are free
      if (prev >= 0 && leader) hopper::mbar_arrive(&empty[prev]);
      prev = ring.stage;
      ring.advance();
#else
      const int j = d % KG;      // a constant once the d loop is unrolled
      group_b[j] = b;
      group_stage[j] = ring.stage;
      ring.advance();
      if (j == KG - 1 || kt == KT - 1) issue_group(acc, frag, group_b, group_stage, j, empty, leader);
#endif
    }
  }
  hopper::wgmma_wait<0>();
#endif
  // acc[4j + r]: feature row 16 warp + g + 8 (r / 2) of this warpgroup's 64, token 8j + 2t + r % 2
#if NQ_RS_SWIGLU
  // rows r0 and r0 + 8 are the gate and the up row of act feature f (the SwiGLU row order)
  const int I = p.N / 2, f = 32 * (n0 / 64 + cw) + 8 * warp + g;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = m0 + 8 * j + 2 * t + r;
      if (f < I && tok < p.T) {
        const float gh = __half2float(__float2half_rn(acc[4 * j + r]));
        const float uh = __half2float(__float2half_rn(acc[4 * j + 2 + r]));
        p.y[(size_t)tok * I + f] = __float2half_rn(gh / (1.0f + expf(-gh)) * uh);   // prefill_gemm.cu's silu_mul
      }
    }
  }
  return;
#endif
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int f = r0 + 8 * (r >> 1), tok = m0 + 8 * j + 2 * t + (r & 1);
      if (f < p.N && tok < p.T) {
        float v = acc[4 * j + r];
        if (p.bias) v += __half2float(p.bias[f]);
        const size_t o = (size_t)tok * p.N + f;
        if (p.residual) v += __half2float(p.residual[o]);
        p.y[o] = __float2half_rn(v);
      }
    }
  }
}
}  // namespace rs

// Grid (ceil(N / (64 NQ_RS_CWG)), ceil(T / NQ_RS_BM)); block rs::THREADS; dynamic shared memory
// rs::RING_BYTES + 1024 (alignment) + the barriers. K % 128 == 0.
extern "C" __global__ void __launch_bounds__(rs::THREADS, 1)
nq_prefill_rs(const half* x, const uint4* w, const half* scales, const half* scales_rs, const half* bias,
              const half* residual, half* y,
              int T, int N, int K, const hopper::TensorMap* xmap) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (hopper::smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + rs::RING_BYTES);
  uint64_t* empty = full + rs::STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < rs::STAGES; ++s) {
      hopper::mbar_init(&full[s], 1);              // the copying thread's expect_tx
      hopper::mbar_init(&empty[s], 4 * rs::CWG);   // one arrival per consumer warp
    }
    hopper::fence_mbarrier_init();
  }
  __syncthreads();
  const rs::Problem p{x, w, scales, scales_rs, bias, residual, y, T, N, K, xmap};
  const int n0 = blockIdx.x * rs::BNF, m0 = blockIdx.y * rs::BM, KT = K / rs::BK;
  const int wg = threadIdx.x / 128;
  if (wg == 0) rs::producer(p, smem, full, empty, m0, n0, KT);
  else rs::consumer(p, smem, full, empty, m0, n0, wg - 1, KT);
}
