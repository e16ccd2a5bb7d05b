// units.cuh: a GEMV's unit (a CTA's tiles x groups), where its blocks lie in layout 3, and the
// L2 prefetches of a later instruction's blocks ([pd-prefetch]).
#pragma once
#include "decode/sched.cuh"

namespace pd {

// [pd-prefetch]
// Weights never depend on the token, so a CTA asks for its next weights *before* it waits:
// each warp of a GEMV instruction loads its first NQ_PD_RING blocks into registers and only
// then spins on the counter. The instructions that would leave DRAM idle ask for later ones:
// attention (which reads a megabyte of K and V, no weights) issues its K/V reads and then
// cp.async.bulk.prefetch.L2 of its CTA's o_proj blocks (and NQ_PD_EARLY_BLOCKS of gate_up's);
// down prefetches the next layer's qkv share; lm_head the first NQ_PD_PREFETCH_KB of its rows.
// While the slowest CTA finishes the previous instruction, DRAM keeps streaming.
// [/pd-prefetch]

enum Stage { ST_NORM, ST_X, ST_SWIGLU, ST_MERGE };   // (ST_MERGE: o_proj's, [pd-o-merge])
enum Epi { EP_BIAS, EP_RESIDUAL, EP_PLAIN };

struct Unit {                 // this CTA's share of a GEMV
  bool live;
  int tg, ks, t0, nt, g0, ng, nb;
};
template <int N, int K, int TG, int KS>
__device__ __forceinline__ Unit unit_of(int u) {
  constexpr int T = ceil_div(N, 16), G = K / NQ_GROUP_SIZE;
  Unit w;
  w.live = u < TG * KS;
  w.tg = w.live ? u / KS : 0;
  w.ks = w.live ? u % KS : 0;
  w.t0 = (int)((long long)w.tg * T / TG);
  w.nt = (int)((long long)(w.tg + 1) * T / TG) - w.t0;
  w.g0 = (int)((long long)w.ks * G / KS);
  w.ng = (int)((long long)(w.ks + 1) * G / KS) - w.g0;
  w.nb = w.live ? w.nt * w.ng : 0;
  return w;
}
// Block b of unit u (counted tile by tile, ng groups a tile) in a layout-3 matrix of G groups a row.
template <int G>
__device__ __forceinline__ const unsigned char* block_at(const unsigned char* w, const Unit& u, int ng, int b) {
  return w + ((size_t)(u.t0 + b / ng) * G + u.g0 + b % ng) * nqs3::kBlockBytes;
}

// The warp's blocks [from, from + count) of its range in the CTA's unit of matrix M (lanes
// 0 .. count - 1, one 1056-byte block each): cp.async.bulk.prefetch.L2, no registers held.
__device__ __forceinline__ int warp_first_block(int nb, int warp) { return (int)((long long)warp * nb / kWarps); }
template <int N, int K, int TG, int KS>
__device__ __forceinline__ void prefetch_warp(const unsigned char* w, int from, int count) {
  constexpr int G = K / NQ_GROUP_SIZE;
  const Unit u = unit_of<N, K, TG, KS>(blockIdx.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = warp_first_block(u.nb, warp) + from + lane, b1 = warp_first_block(u.nb, warp + 1);
  if (!u.live || lane >= count || b >= b1) return;
  prefetch_l2(block_at<G>(w, u, u.ng, b), nqs3::kBlockBytes);
}
// Early prefetches ([pd-prefetch]): o_proj's share and the first NQ_PD_EARLY_BLOCKS of
// gate_up's while attention runs (no weights of its own); the next layer's qkv share while
// down runs.
__device__ __forceinline__ void prefetch_during_attention(Ctx& c) {
  if (!kCfg.attn_prefetch) return;                     // (a variant: attention's loads alone on the bus)
  if (l2_ahead(K_O))                                   // ([pd-loader]: the loader is at it, unless NQ_PD_LOADER_L2)
    prefetch_warp<kO.N, kO.K, kO.TG, kO.KS>(ptr<const unsigned char>(c.lt, L_O), 0, 32);
  if (kCfg.early_blocks > 0 && l2_ahead(K_GATE_UP))
    prefetch_warp<kGateUp.N, kGateUp.K, kGateUp.TG, kGateUp.KS>(ptr<const unsigned char>(c.lt, L_GATE_UP), 0,
                                                                kCfg.early_blocks);
}
__device__ __forceinline__ void prefetch_next_qkv(Ctx& c) {
  if (l2_ahead(K_QKV) && c.lt_next) prefetch_warp<kQkv.N, kQkv.K, kQkv.TG, kQkv.KS>(ptr<const unsigned char>(c.lt_next, L_QKV), 0, 32);
}

}  // namespace pd
