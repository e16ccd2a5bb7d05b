// gemv.cuh: the GEMV instruction ([pd-gemv]): stage the input (norm, x or SwiGLU), multiply the
// unit's blocks from the ring, add the warps' and the K slices' sums, run the epilogue.
#pragma once
#include "decode/rows.cuh"
#include "decode/loader.cuh"
#include "decode/attention.cuh"   // [pd-o-merge]: o_proj's wait and staging

namespace pd {

// [pd-gemv]
// A GEMV instruction over layout 3 (stream3.cuh): the matrix's T = N/16 tiles are cut into
// TG tile sets and its G = K/128 groups into KS slices (NQ_PD_<M>_{TG,KS}, chosen by
// nanoqwen_lib/gpu/persistent.py so the TG x KS units cover the grid evenly); CTA u takes
// unit (u / KS, u % KS). Its blocks (tiles x groups, tile-major) are cut evenly among its
// warps; a warp's blocks are contiguous bytes of one or two (at most NQ_PD_KMAX) tiles, read
// front to back with NQ_PD_RING blocks in flight. Row sums meet in shared memory in warp
// order; with KS > 1 each unit stores its slice to an FP32 workspace and the last unit of the
// tile set to arrive adds the slices in slice order (deterministic) and runs the epilogue.
// [/pd-gemv]

// When down asks for the next layer's qkv share (NQ_PD_QKV_PREFETCH; lab): 1, at its start,
// before its own ring and its wait (while gate_up's last CTAs still stream); 2, right after its
// wait; 3, after its own stream, while its fold and the counters run; 0, never.
// Kinds whose first kRing blocks a warp are asked for only after the wait (bit 1 << kind;
// NQ_PD_LATE_RING, lab; 0: every GEMV's before, [pd-prefetch]): is the next instruction's early
// request what keeps the last CTAs of the one before from finishing?
template <int N, int K, int TG, int KS, int kStage, int kEpi, bool kPrefetchNextQkv = false>
__device__ void gemv(Ctx& c, int idx, int layer, int kind, const unsigned char* w, const half* act,
                     const half* norm_w, const half* bias, half* out, unsigned char* xs, float* red,
                     float (*part)[kKmax][16]) {
  constexpr int G = K / NQ_GROUP_SIZE;
  // The instruction's kind from its stage and epilogue (each GEMV has its own pair), and whether
  // its blocks come from the loader's rings ([pd-loader], [pd-loader-own]).
  constexpr int kKind = kEpi == EP_BIAS ? K_QKV : kEpi == EP_PLAIN ? K_GATE_UP : kStage == ST_SWIGLU ? K_DOWN : K_O;
  constexpr bool kFromRing = loader_serves(kKind);
  begin_instruction(c);
  const Unit u = unit_of<N, K, TG, KS>(blockIdx.x);
  if (kPrefetchNextQkv && kCfg.qkv_prefetch == 1) prefetch_next_qkv(c);   // a later instruction's weights ([pd-prefetch])
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int b0 = warp * u.nb / kWarps, b1 = (warp + 1) * u.nb / kWarps;   // nb * kWarps < 2^31
  const int ng = max(u.ng, 1);
  // [pd-head] gate_up's and down's warps each take their last nh blocks from shared memory:
  // bulk copies issued now, before the ring and the wait, land while the inputs are awaited and
  // staged (the register ring alone keeps 2 blocks a warp in flight there); the loop reads them
  // after its last register block. The same blocks in the same order: the same sums.
  constexpr bool kHeadStart = kHead > 0 && (kEpi == EP_PLAIN || kStage == ST_SWIGLU);   // gate_up, down
  const int nh = kHeadStart && b1 - b0 >= kHead + 2 * kRing ? kHead : 0;           // warp-uniform
  const int b1r = b1 - nh;                             // the register ring's blocks: [b0, b1r)
  unsigned char* head = xs + kHeadOffset + warp * kHead * nqs3::kBlockBytes;
  if (kHeadStart) {
    hopper::fence_proxy_async_smem();   // every thread: its earlier accesses to the region (the attention, the
    cta_sync();                    // last GEMV's reads) before the copies overwrite it
    if (nh > 0) {
      if (lane == 0) hopper::mbar_arrive_expect_tx(c.head_bar + warp, nh * nqs3::kBlockBytes);
      __syncwarp();
      if (lane < nh) {
        hopper::bulk_copy_g2s(head + lane * nqs3::kBlockBytes, block_at<G>(w, u, ng, b1r + lane),
                              nqs3::kBlockBytes, c.head_bar + warp);
      }
    }
  }
  __shared__ int wrange[kWarps][2];                      // each warp's first and last tile (local)
  if (lane == 0) { wrange[warp][0] = b0 < b1 ? b0 / ng : 1 << 30; wrange[warp][1] = b0 < b1 ? (b1 - 1) / ng : -1; }
  // The epilogue's own inputs, early: the bias (never changes) before the wait, the residual
  // (final before this instruction starts) right after it. Thread i owns unit row i.
  auto row_live = [&](int& row) {
    row = u.t0 * 16 + (int)threadIdx.x;
    return u.live && (int)threadIdx.x < u.nt * 16 && row < N;
  };
  int my_row;
  if (u.live && u.nt * 16 > kThreads && threadIdx.x == 0) atomicExch(c.scalars + S_ERROR * NQ_SCALAR_STRIDE, kErrPlan);
  __shared__ float sepi[kThreads];   // bias or residual of row i (shared memory: no register through the loop)
  if (kEpi == EP_BIAS && row_live(my_row)) sepi[threadIdx.x] = __half2float(__ldg(bias + my_row));
  // The warp's first kRing blocks fly before the wait. The load cursor: lp (bytes) and lg, its
  // group within the tile (KS > 1: a tile's slice ends before the matrix's row of groups does).
  // The ring: kRing register slots, or (kSmemRing) kRing slots of the warp's shared-memory
  // ring filled by cp.async and one register slot they are read into. Every pass commits one
  // cp.async group (empty when nothing is left to load), so "block b has landed" is always
  // cp.async.wait_group kRing - 1.
  nqs3::Slot r[kSmemRing ? 1 : kRing];
  unsigned char* ring = xs + kStageBytes + warp * kRing * nqs3::kBlockBytes;
  const unsigned char* lp = block_at<G>(w, u, ng, b0);
  int lg = b0 % ng;
  auto next_load = [&]() {
    lp += nqs3::kBlockBytes;
    if (++lg == ng) { lg = 0; lp += (size_t)(G - ng) * nqs3::kBlockBytes; }
  };
  auto issue_ring = [&]() {
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      if (b0 + i < b1r) {
        if (kSmemRing) nqs3::copy_slot(ring + i * nqs3::kBlockBytes, lp, lane);
        else nqs3::load_slot(r[i], lp, lane);
        next_load();
      }
      if (kSmemRing) hopper::cp_async_commit();
    }
  };
  const bool late_ring = (kCfg.late_ring >> kind) & 1;
  if (!late_ring && !kFromRing) issue_ring();
  // gate_up's and down's next NQ_PD_SELF_PREFETCH blocks a warp, past the ring, into L2
  // ([pd-prefetch]; qkv's and o_proj's were prefetched by the instruction before them).
  if (kCfg.self_prefetch > 0 && !kFromRing && (kind == K_GATE_UP || kind == K_DOWN))
    prefetch_warp<N, K, TG, KS>(w, kRing, kCfg.self_prefetch);
  if (kind == K_QKV) probe(c, layer, 0);
  constexpr bool kSliceWait = kDownSlices && kStage == ST_SWIGLU;   // down ([pd-down-slices])
  if (kSliceWait) wait_slice(c, layer, u.ks, u.live);
  else if (kStage == ST_MERGE) wait_heads(c, layer, u.g0 * NQ_GROUP_SIZE, u.ng * NQ_GROUP_SIZE, u.live);
  else wait_inputs(c);
  if (late_ring && !kFromRing) issue_ring();
  if (kPrefetchNextQkv && kCfg.qkv_prefetch == 2) prefetch_next_qkv(c);
  if (kind == K_QKV) probe(c, layer, 1);
  // [pd-down-defer]: this down leaves its slices in WS_DOWN (another layer follows in the launch);
  // this qkv or o_proj adds the last down's
  const bool defer = kDownDefer && kind == K_DOWN && c.lt_next != nullptr;
  const bool add_down = kDownDefer && c.x_pending && (kind == K_QKV || kind == K_O);
  const float* ws_down = kDownDefer ? ptr<const float>(c.tab, T_WS_DOWN) : nullptr;
  float resid = 0.f;                                   // in flight with the staging's loads
  const bool resid_live = kEpi == EP_RESIDUAL && !defer && row_live(my_row);
  if (resid_live) {
    resid = __half2float(__ldcg(out + my_row));
    if (add_down) resid = fold_row(resid, ws_down, my_row);
  }

  // Stage the unit's groups of the input into shared memory (padded), then the folds.
  if (u.live) {
    if (kStage == ST_NORM && kNormOnePass) {
      // One pass: a thread's chunk of x and of the norm weight in registers (one L2 round trip,
      // not two), the same sums in the same order as rms_inv and norm_chunk.
      const int ch = threadIdx.x, lc = ch - u.g0 * (NQ_GROUP_SIZE / 8);
      uint4 xv = make_uint4(0u, 0u, 0u, 0u), wv = xv;
      if (ch < H / 8) {
        xv = __ldcg(reinterpret_cast<const uint4*>(act) + ch);
        wv = __ldg(reinterpret_cast<const uint4*>(norm_w) + ch);
        if (add_down) xv = fold_chunk(xv, ws_down, ch);   // [pd-down-defer]
      }
      const float rinv = rms_inv_of(ch < H / 8 ? nq::sumsq8(xv, 0.f) : 0.f, red, c.eps);
      if (ch < H / 8 && lc >= 0 && lc < u.ng * (NQ_GROUP_SIZE / 8))
        *reinterpret_cast<uint4*>(xs + nqs3::x_chunk_offset(lc)) = nq::rmsnorm8(xv, wv, rinv);
    } else if (kStage == ST_NORM) {
      const float rinv = rms_inv(act, red, c.eps);
      for (int ch = threadIdx.x; ch < u.ng * (NQ_GROUP_SIZE / 8); ch += kThreads)
        *reinterpret_cast<uint4*>(xs + nqs3::x_chunk_offset(ch)) =
            norm_chunk(act, norm_w, rinv, u.g0 * (NQ_GROUP_SIZE / 8) + ch);
    } else if (kStage == ST_MERGE) {
      stage_merged(c, u.g0 * NQ_GROUP_SIZE, u.ng * NQ_GROUP_SIZE, xs);
    } else if (kStage == ST_X) {
      for (int ch = threadIdx.x; ch < u.ng * (NQ_GROUP_SIZE / 8); ch += kThreads)
        *reinterpret_cast<uint4*>(xs + nqs3::x_chunk_offset(ch)) =
            __ldcg(reinterpret_cast<const uint4*>(act) + u.g0 * (NQ_GROUP_SIZE / 8) + ch);
    } else {   // SwiGLU: act = gate_up [2K]: fp16(silu(g) * u) (gemv_int4.cuh [swiglu])
      for (int ch = threadIdx.x; ch < u.ng * (NQ_GROUP_SIZE / 8); ch += kThreads) {
        const int k8 = u.g0 * (NQ_GROUP_SIZE / 8) + ch;
        *reinterpret_cast<uint4*>(xs + nqs3::x_chunk_offset(ch)) =
            nq::swiglu8(__ldcg(reinterpret_cast<const uint4*>(act) + k8), __ldcg(reinterpret_cast<const uint4*>(act + K) + k8));
      }
    }
  }
  if (resid_live) sepi[threadIdx.x] = resid;
  cta_sync();   // all threads: the staged input is complete
  nqs3::stage_fold<kFold>(xs, u.ng, threadIdx.x, kThreads);
  cta_sync();   // all threads: folds and magic words complete
  if (kind == K_QKV) probe(c, layer, 2);

  // [pd-gemv-loop]
  if (b0 < b1) {
    int ct = b0 / ng, cg = b0 % ng;                     // block being multiplied: tile, group (local)
    const int ft = ct;                                  // the warp's first tile
    float acc0 = 0.f, acc1 = 0.f;
    const unsigned char* xl = xs + t * nqs3::kXLaneBytes + cg * nqs3::kXGroupBytes;
    const unsigned char* x0 = xs + t * nqs3::kXLaneBytes;
    // One block: multiply slot i, refill it (when `load`), and at a tile's end store the rows'
    // sums (every lane of a row's quad holds the same sum and stores it: no divergence).
    auto step = [&](int i, bool load) {
      if (kSmemRing) {                                   // slot i has landed: into registers
        hopper::cp_async_wait<kRing - 1>();
        __syncwarp();                                    // the other lanes' copies too (scales)
        nqs3::read_slot(r[0], ring + i * nqs3::kBlockBytes, lane);
        nqs3::group<kFold>(acc0, acc1, r[0], xl);
        __syncwarp();                                    // every lane has read slot i
        if (load) { nqs3::copy_slot(ring + i * nqs3::kBlockBytes, lp, lane); next_load(); }
        hopper::cp_async_commit();
      } else {   // (r[0] where this branch is dead code: r has one slot in the shared-memory build)
        nqs3::group<kFold>(acc0, acc1, r[kSmemRing ? 0 : i], xl);
        if (load) { nqs3::load_slot(r[kSmemRing ? 0 : i], lp, lane); next_load(); }
      }
      xl += nqs3::kXGroupBytes;
      if (++cg == ng) {                                  // warp-uniform
        const int s = min(ct - ft, kKmax - 1);           // (the plan keeps ct - ft < kKmax)
        part[warp][s][g] = acc0;
        part[warp][s][g + 8] = acc1;
        acc0 = 0.f; acc1 = 0.f; cg = 0; ++ct; xl = x0;
      }
    };
    if constexpr (kFromRing) {                          // [pd-loader]: the blocks come from the warp's ring,
      ring_take(c, r[0], warp, lane, 0, b0 + 1 == b1);  // one taken ahead of the one multiplied
#pragma unroll 1
      for (int b = b0; b < b1; b += 2) {
        if (b + 1 < b1) ring_take(c, r[1], warp, lane, b + 1 - b0, b + 2 == b1);
        step(0, false);
        if (b + 1 < b1) {
          if (b + 2 < b1) ring_take(c, r[0], warp, lane, b + 2 - b0, b + 3 == b1);
          step(1, false);
        }
      }
    } else {
      int b = b0;
#pragma unroll 1
      for (; b + 2 * kRing <= b1r; b += kRing) {        // steady state: every slot refilled
#pragma unroll
        for (int i = 0; i < kRing; ++i) step(i, true);
      }
#pragma unroll 1
      for (; b < b1r; b += kRing) {                     // the last blocks: refill what remains
#pragma unroll
        for (int i = 0; i < kRing; ++i)
          if (b + i < b1r) step(i, b + i + kRing < b1r);
      }
    }
    if (kHeadStart && nh > 0) {                         // [pd-head]: the warp's last nh blocks, landed long ago
      hopper::mbar_wait(c.head_bar + warp, c.head_uses & 1u);
      ++c.head_uses;
#pragma unroll 1
      for (int h = 0; h < nh; ++h) {
        nqs3::read_slot(r[0], head + h * nqs3::kBlockBytes, lane);
        step(0, false);
      }
    }
    if (cg != 0) {
      const int s = min(ct - ft, kKmax - 1);
      part[warp][s][g] = acc0;
      part[warp][s][g + 8] = acc1;
    }
    if (ct - ft - (cg == 0) >= kKmax && lane == 0) atomicExch(c.scalars + S_ERROR * NQ_SCALAR_STRIDE, kErrPlan);
  }
  // [/pd-gemv-loop]
  if (kPrefetchNextQkv && kCfg.qkv_prefetch == 3) prefetch_next_qkv(c);
  if (kSliceWait) wait_prev_thread0(c);   // [pd-down-slices]: all of gate_up read x before down writes it
  cta_sync();   // all threads: every warp's row sums are in part[]
  if (kind == K_QKV) probe(c, layer, 3);

  // Rows of the unit: add the warps' sums in warp order (thread i: row i of the unit).
  __shared__ int is_last;
  const bool my_live = row_live(my_row);
  if (my_live) {
    const int tl = threadIdx.x >> 4;
    float v = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < kWarps; ++w2)
      if (tl >= wrange[w2][0] && tl <= wrange[w2][1]) v += part[w2][tl - wrange[w2][0]][threadIdx.x & 15];
    if (KS == 1) {
      if (kEpi == EP_BIAS) v += sepi[threadIdx.x];
      if (kEpi == EP_RESIDUAL) v = sepi[threadIdx.x] + v;
      const half hv = __float2half_rn(v);
      if (kQkvLL && kind == K_QKV) store_tagged(c, my_row, hv, layer);   // [pd-qkv-ll]: its only reader polls these
      else out[my_row] = hv;
    } else {
      __stcg(ptr<float>(c.tab, defer ? T_WS_DOWN : T_WS) + (size_t)u.ks * N + my_row, v);
    }
  }
  if (KS > 1 && !defer) {
    cta_sync();   // all threads: the slice is stored
    if (threadIdx.x == 0) {
      is_last = 0;
      if (u.live) is_last = arrive_last(ptr<unsigned>(c.tab, T_TILE_CNT) + u.tg, KS);   // the slice is visible first
    }
    cta_sync();   // all threads: is_last known (and, in the last, the other slices visible)
    if (is_last) {
      const float* ws = ptr<float>(c.tab, T_WS);
      if (my_live) {
        float v = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) v += __ldcg(ws + (size_t)s * N + my_row);   // slice order
        if (kEpi == EP_BIAS) v += sepi[threadIdx.x];
        if (kEpi == EP_RESIDUAL) v = sepi[threadIdx.x] + v;
        const half hv = __float2half_rn(v);
        if (kQkvLL && kind == K_QKV) store_tagged(c, my_row, hv, layer);   // [pd-qkv-ll]
        else out[my_row] = hv;
      }
      if (threadIdx.x == 0) ptr<int>(c.tab, T_TILE_CNT)[u.tg] = 0;   // ready for the next use
    }
  }
  if (kind == K_O) c.x_pending = false;             // x is whole again (o_proj wrote it)
  if (kind == K_DOWN) c.x_pending = defer;
  constexpr bool kSliceSignal = kDownSlices && kEpi == EP_PLAIN;    // gate_up ([pd-down-slices])
  if (kSliceSignal && u.live) signal_done(c, idx, layer, kind, c.grid, true, u.t0 * 16, min((u.t0 + u.nt) * 16, N));
  else signal_done(c, idx, layer, kind, c.grid);
  if (kind == K_QKV) probe(c, layer, 4);
}

}  // namespace pd
