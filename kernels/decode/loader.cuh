// loader.cuh: [pd-loader], the loader warp (lab): every GEMV block of the launch into per-warp
// rings of shared-memory pages, across instruction boundaries; the consumers' side.
#pragma once
#include "decode/units.cuh"

namespace pd {

// [pd-loader] (NQ_PD_LOADER = R pages a consumer warp, NQ_PD_LOADER_PAGE = P blocks a page; lab)
// Every weight byte a CTA reads in a launch is known before the launch starts: its unit of each
// GEMV and, within it, each warp's range of blocks. With the loader, one more warp walks that
// whole schedule, layer after layer: its lane w copies consumer warp w's blocks, in the order
// warp w multiplies them, into warp w's ring of R pages (cp.async.bulk completing on the page's
// `full` mbarrier; blocks adjacent in memory, as a warp's are within a tile, in one copy).
// A page holds P blocks of one instruction (its last page may hold fewer). The loader waits
// for nothing but a free page (the page's `empty` mbarrier, which the consumer warp's lane 0
// arrives on once its lanes hold the page's last block in registers): never for an activation,
// a counter or another CTA. So while the consumers wait on a counter, stage their input or run
// the attention (no weights), their next GEMV's blocks keep arriving, across instruction and
// layer boundaries, up to R x P a warp. The consumers multiply the same blocks in the same
// order as from their register ring: the same bits.
// Each lane keeps its own place in the schedule (Cursor) and its own count of pages issued
// (the same as its consumer's `ld_n`: use n of a ring is page n % R, phase (n / R) & 1); in each
// turn of the warp's loop every lane whose next page is free issues it, so no consumer waits
// for another's. Never hangs: NQ_PD_TIMEOUT_MS without a free page sets the error and the
// loader stops; the consumers' waits for pages then give up at once (pd-wait's timed_out).
constexpr int kPageBlocks = kCfg.loader_page;
constexpr int kPageBytes = kPageBlocks * nqs3::kBlockBytes;
__device__ __forceinline__ bool ring_wait(const Ctx& c, uint64_t* bar, unsigned parity) {
  if (hopper::mbar_try(bar, parity)) return true;
  const unsigned long long t0 = now_ns();
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  for (int spin = 0; !hopper::mbar_try(bar, parity); ++spin)
    if ((spin & 63) == 63 && timed_out(err, t0)) return false;
  return true;
}
struct Cursor {              // a loader lane's place in its consumer warp's schedule
  int k;                     // instruction: 4 (layer - first_layer) + GEMV (qkv, o_proj, gate_up, down)
  int left;                  // blocks left of instruction k's range
  const unsigned char* lp;   // the next block
  int lg, ng, skip;          // its group within the tile, the unit's groups a tile, bytes to the next tile's
  unsigned n;                // pages issued
};
// Cursor at the start of warp wl's range of GEMV <N, K, TG, KS> (matrix w); false: no blocks.
template <int N, int K, int TG, int KS>
__device__ __forceinline__ bool range_start(Cursor& q, const unsigned char* w, int wl) {
  constexpr int G = K / NQ_GROUP_SIZE;
  const Unit u = unit_of<N, K, TG, KS>(blockIdx.x);
  const int b0 = wl * u.nb / kWarps, b1 = (wl + 1) * u.nb / kWarps;   // the consumer's range (gemv)
  q.ng = max(u.ng, 1);
  q.lp = block_at<G>(w, u, q.ng, b0);
  q.lg = b0 % q.ng;
  q.skip = (G - q.ng) * nqs3::kBlockBytes;
  q.left = b1 - b0;
  return q.left > 0;
}
// Move q to the first instruction from q.k on with blocks for warp wl (q.k = kEnd: none left).
__device__ __forceinline__ void seek(Cursor& q, const long long* tab, int first_layer, int k_end, int wl) {
  for (; q.k < k_end; ++q.k) {
    const long long* lt = tab + kLayerBase + kLayerStride * (first_layer + q.k / 4);
    const int m = q.k % 4;
    if (m == 0 && !skipped(K_QKV) && loader_serves(K_QKV) &&
        range_start<kQkv.N, kQkv.K, kQkv.TG, kQkv.KS>(q, ptr<const unsigned char>(lt, L_QKV), wl)) return;
    if (m == 1 && !skipped(K_O) && loader_serves(K_O) && range_start<kO.N, kO.K, kO.TG, kO.KS>(q, ptr<const unsigned char>(lt, L_O), wl)) return;
    if (m == 2 && !skipped(K_GATE_UP) && loader_serves(K_GATE_UP) &&
        range_start<kGateUp.N, kGateUp.K, kGateUp.TG, kGateUp.KS>(q, ptr<const unsigned char>(lt, L_GATE_UP), wl)) return;
    if (m == 3 && !skipped(K_DOWN) && loader_serves(K_DOWN) &&
        range_start<kDown.N, kDown.K, kDown.TG, kDown.KS>(q, ptr<const unsigned char>(lt, L_DOWN), wl)) return;
  }
}
// Page q.n of warp wl's ring (the rings' pages and their full barriers): its next min(P, left)
// blocks, runs of adjacent blocks one copy each.
__device__ __forceinline__ void issue_page(Cursor& q, unsigned char* ring, uint64_t* full, int wl) {
  const int nb = min(kPageBlocks, q.left);
  const unsigned s = wl * kLoaderSlots + q.n % kLoaderSlots;
  unsigned char* dst = ring + (size_t)s * kPageBytes;
  hopper::mbar_arrive_expect_tx(full + s, nb * nqs3::kBlockBytes);
  const unsigned char* run = q.lp;
  int run_blocks = 0;
  for (int i = 0; i < nb; ++i) {
    if (run_blocks > 0 && q.lp != run + run_blocks * nqs3::kBlockBytes) {   // not adjacent: the run so far
      hopper::bulk_copy_g2s(dst, run, run_blocks * nqs3::kBlockBytes, full + s);
      dst += run_blocks * nqs3::kBlockBytes;
      run = q.lp;
      run_blocks = 0;
    }
    ++run_blocks;
    q.lp += nqs3::kBlockBytes;
    if (++q.lg == q.ng) { q.lg = 0; q.lp += q.skip; }
  }
  hopper::bulk_copy_g2s(dst, run, run_blocks * nqs3::kBlockBytes, full + s);
  q.left -= nb;
  ++q.n;
}
// [pd-loader-walk]
// The loader warp's whole launch: the GEMV instructions of layers [first_layer, last_layer) in
// the consumers' order (a skipped instruction, [pd-skip], has no blocks); lane w < kWarps
// serves consumer warp w.
__device__ void loader(const Ctx& c, int first_layer, int last_layer) {
  const int lane = threadIdx.x & 31, k_end = 4 * (last_layer - first_layer);
  Cursor q;
  q.k = lane < kWarps ? 0 : k_end;
  q.n = 0;
  seek(q, c.tab, first_layer, k_end, lane);
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  unsigned long long t0 = now_ns();
  for (int idle = 0; __any_sync(0xffffffffu, q.k < k_end);) {
    bool issued = false;
    if (q.k < k_end) {
      const unsigned s = lane * kLoaderSlots + q.n % kLoaderSlots;
      if (hopper::mbar_try(c.ld_empty + s, ((q.n / kLoaderSlots) & 1u) ^ 1u)) {   // use 0 of a page: free at once
        issue_page(q, c.ld_ring, c.ld_full, lane);
        if (q.left == 0) { ++q.k; seek(q, c.tab, first_layer, k_end, lane); }
        issued = true;
      }
    }
    if (__any_sync(0xffffffffu, issued)) { idle = 0; t0 = now_ns(); }
    else if ((++idle & 63) == 63 && __any_sync(0xffffffffu, timed_out(err, t0))) return;   // (warp-uniform)
  }
}
// [/pd-loader-walk]
// [pd-loader-self]
// NQ_PD_LOADER_SELF (lab): the loader warp's walk without the loader warp. A 17th warp has no
// registers of its own (16 consumer warps at 128 registers are the whole register file), and the
// loader can only ever issue into a page its consumer has just given back. So the consumer
// warp's lane 0, as it gives a page back, issues the next page of its own schedule into that
// page itself (the loader's Cursor, kept in shared memory, crossing instruction and layer
// boundaries as the loader's does), and at the launch's start it issues its ring's first R
// pages. The same pages, in the same order, into the same slots as the loader warp's: the same
// bits. No empty barriers: the warp that frees a page is the one that fills it.
// A call, not inlined, made by lane 0 alone: the walk's registers are not added to the GEMV
// loop's (inlined, the loop spills), and the caller's Ctx stays in registers (only what the walk
// reads is passed).
__device__ __noinline__ void self_issue_page(const long long* tab, unsigned char* ring, uint64_t* full,
                                             Cursor* cur, int first_layer, int k_end, bool after_reads) {
  const int warp = threadIdx.x >> 5;
  Cursor q = cur[warp];
  if (q.k >= k_end) return;                            // the launch's schedule is all issued
  if (after_reads) hopper::fence_proxy_async_smem();   // the lanes' reads of the page before the copy overwrites it
  issue_page(q, ring, full, warp);
  if (q.left == 0) { ++q.k; seek(q, tab, first_layer, k_end, warp); }
  cur[warp] = q;
}
__device__ __forceinline__ void self_issue(const Ctx& c, bool after_reads) {
  self_issue_page(c.tab, c.ld_ring, c.ld_full, c.ld_cur, c.first_layer, c.ld_k_end, after_reads);
}
// Lane 0 of consumer warp `warp`, at the launch's start: its place, then its ring's first pages.
__device__ __forceinline__ void self_start(Ctx& c, int warp) {
  Cursor q;
  q.k = 0;
  q.n = 0;
  seek(q, c.tab, c.first_layer, c.ld_k_end, warp);
  c.ld_cur[warp] = q;
  for (int i = 0; i < kLoaderSlots; ++i) self_issue(c, false);
}
// [/pd-loader-self]
// A consumer warp, all lanes: block j of its range (b - b0) from its ring into registers. At a
// page's first block, wait for the page; after its last (or the range's last), give it back
// (lane 0 arrives once every lane has read it; [pd-loader-self]: lane 0 refills it).
__device__ __forceinline__ void ring_take(Ctx& c, nqs3::Slot& r, int warp, int lane, int j, bool last) {
  const int i = j % kPageBlocks;
  const unsigned s = warp * kLoaderSlots + c.ld_n % kLoaderSlots;
  if (i == 0) ring_wait(c, c.ld_full + s, (c.ld_n / kLoaderSlots) & 1u);   // (a timeout: the error is set, go on)
  nqs3::read_slot(r, c.ld_ring + (size_t)s * kPageBytes + i * nqs3::kBlockBytes, lane);
  if (i == kPageBlocks - 1 || last) {
    __syncwarp();                                                // every lane has read the page
    if (lane == 0) {
      if constexpr (kLoaderSelf) self_issue(c, true);
      else hopper::mbar_arrive(c.ld_empty + s);
    }
    ++c.ld_n;
  }
}
// [/pd-loader]

}  // namespace pd
