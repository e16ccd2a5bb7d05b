// layout.cuh: the persistent decode step's constants: the model's shapes (-D from the model's
// dims), each GEMV's split over the grid (the planner's), what shared memory holds.
#pragma once
#include "decode/config.cuh"
#include "stream3.cuh"
#include "decode_contract.cuh"

namespace pd {

constexpr int kWarps = kCfg.warps;
constexpr int kThreads = 32 * kWarps;
constexpr int kRing = kCfg.ring;
constexpr bool kSmemRing = kCfg.smem_ring;   // the ring in shared memory (cp.async), else registers
constexpr int kHead = kCfg.head_blocks;            // [pd-head]: gate_up's and down's last blocks a warp, copied early
static_assert(!(kHead > 0 && kSmemRing), "NQ_PD_HEAD_BLOCKS and NQ_PD_SMEM_RING: one shared-memory use of the blocks at a time");
// [pd-loader] (NQ_PD_LOADER = R, lab; 0: off): one more warp a CTA, the loader, and a ring of
// R pages of NQ_PD_LOADER_PAGE layout-3 blocks for each consumer warp (the kWarps that compute).
constexpr int kLoaderSlots = kCfg.loader;
constexpr bool kLoader = kLoaderSlots > 0;
// [pd-loader-self] (NQ_PD_LOADER_SELF, lab): the same rings, and no loader warp: each consumer
// warp's lane 0 walks its own share of the schedule and issues its ring's next page itself.
constexpr bool kLoaderSelf = kCfg.loader_self;
static_assert(!kLoaderSelf || kLoader, "NQ_PD_LOADER_SELF: the loader's rings, without its warp (needs NQ_PD_LOADER)");
constexpr bool kLoaderWarp = kLoader && !kLoaderSelf;            // one more warp a CTA, the loader
constexpr int kBlockThreads = kThreads + (kLoaderWarp ? 32 : 0);   // the launch's block
static_assert(!kCfg.loader_l2 || kLoader, "NQ_PD_LOADER_L2 keeps the loader's L2 prefetches: only with NQ_PD_LOADER");
// [pd-loader-own] (NQ_PD_LOADER_OWN, lab; bits 1 << kind): with the loader, the GEMVs whose
// warps still load their own blocks (the register ring, and the L2 prefetches a layer ahead of
// [pd-prefetch]), as the build without the loader does; the loader's rings carry only the rest.
// The chain's GEMVs (qkv, o_proj) then no longer wait in the rings behind the stream before them.
__host__ __device__ constexpr bool loader_serves(int kind) { return kLoader && !((kCfg.loader_own >> kind) & 1); }
static_assert(kCfg.loader_own == 0 || kLoader, "NQ_PD_LOADER_OWN: which GEMVs the loader leaves out (needs NQ_PD_LOADER)");
// [pd-prefetch]'s L2 prefetches a layer ahead of GEMV `kind`: when the loader does not carry it,
// or with NQ_PD_LOADER_L2
__host__ __device__ constexpr bool l2_ahead(int kind) { return !loader_serves(kind) || kCfg.loader_l2; }
static_assert(!kLoader || kRing >= 2, "[pd-loader]: the consumer takes a block ahead into a second register slot");
static_assert(!kLoader || (!kSmemRing && kHead == 0),
              "NQ_PD_LOADER replaces the register ring's loads: not with NQ_PD_SMEM_RING or NQ_PD_HEAD_BLOCKS");
constexpr bool kFold = kCfg.fold;
constexpr int kKmax = kCfg.kmax;
// A unit's rows: one thread each in the epilogue (config.persistent_plan keeps 16 x tiles <= threads).
constexpr int H = NQ_HIDDEN, I = NQ_INTERMEDIATE, V = NQ_VOCAB;
constexpr int D = NQ_HEAD_DIM, NH = NQ_NUM_HEADS, KVH = NQ_NUM_KV_HEADS, GQA = NH / KVH;
constexpr int Q_DIM = NH * D, KV_DIM = KVH * D, QKV_DIM = Q_DIM + 2 * KV_DIM;
constexpr int kAttnSplits = kCfg.attn_splits;
constexpr int kAttnMinTokens = kCfg.attn_min_tokens;
constexpr bool kAttnMergeAll = kCfg.attn_merge;   // every split merges a slice, else the last split all
// attention: a split of at most 32 tokens as a warp per query head and a lane per token
// ([pd-attn-lanes]; longer splits take the warp-per-token path)
constexpr bool kAttnLanes = kCfg.attn_lanes != 0;
// ... its arithmetic (lab, 2 and 3): 2, the P.V loop unrolled over all 32 lanes (a lane past the
// split's tokens has p = 0 and reads the last token's row: fma(0, v, acc) = acc, the same bits
// as 1); 3, also each score in 4 interleaved chains instead of one (other bits)
constexpr bool kLanePvUnroll = kCfg.attn_lanes >= 2;
constexpr int kLaneChains = kCfg.attn_lanes >= 3 ? 4 : 1;
static_assert(kLaneChains == 1 || kLaneChains == 4, "one score chain or four (added pairwise)");
static_assert(!kAttnLanes || kAttnMergeAll, "[pd-attn-lanes] stores each head's part for the slice merge");
static_assert(!kAttnLanes || 2 * 32 * D * 2 <= kWarps * GQA * (D + 2) * 4, "[pd-attn-lanes]: K and V rows fit the partials buffer");
// ST_NORM in one pass over x (a chunk a thread: x of at most kThreads chunks), else two
constexpr bool kNormOnePass = kCfg.norm_1pass && H / 8 <= kThreads;
constexpr int kLmRows = 2, kLmUnroll = 4;
static_assert(GQA <= 8, "at most 8 query heads per KV head (registers of the attention)");
static_assert(D % 64 == 0 && D / 32 <= 4, "head_dim 64 or 128: 2 or 4 dims per lane");
static_assert(H % 8 == 0, "rows of 16-byte chunks");

// The pointer table tab[] (enum Tab; layer l's enum LayerTab at kLayerBase + kLayerStride * l),
// the instruction kinds, the flags, the scalar slots and the error codes: decode_contract.cuh,
// the one contract with nanoqwen_lib/gpu/persistent.py (both from gpu/decode_contract.py).

struct Gemv { int N, K, TG, KS; };
constexpr Gemv kQkv{QKV_DIM, H, NQ_PD_QKV_TG, NQ_PD_QKV_KS};
constexpr Gemv kO{H, Q_DIM, NQ_PD_O_TG, NQ_PD_O_KS};
constexpr Gemv kGateUp{2 * I, H, NQ_PD_GU_TG, NQ_PD_GU_KS};
constexpr Gemv kDown{H, I, NQ_PD_DOWN_TG, NQ_PD_DOWN_KS};
// [pd-down-defer]
// down split over K (KS > 1) ends in a fold: each unit stores its slice, the last of a tile set
// to arrive adds them to x. That is two more L2 round trips (the arrival, the slices) on the
// chain between down and the next qkv. Deferred (NQ_PD_DOWN_DEFER, when another layer follows in
// the launch): down's units store their slices to WS_DOWN and signal; the next qkv's norm staging
// adds them to x (every CTA, its chunk a thread, in the loads it already makes) and o_proj's
// epilogue adds them to its rows' residual, where it writes x. Same sums in the same order: the
// same bits. x is complete at the end of every launch (its last layer folds as before).
constexpr bool kDownDefer = kCfg.down_defer && kDown.KS > 1 && kNormOnePass;
// [pd-qkv-ll] (NQ_PD_QKV_LL, lab): the attention does not wait on qkv's counter and then load
// q, k, v (two trips); it polls them. qkv's epilogue stores each output as one 32-bit word,
// (tag << 16) | fp16 bits, tag = layer + 1 (NCCL's "LL" protocol: value and flag in one
// single-copy-atomic word, so a word with the layer's tag holds that layer's value), and the
// attention's threads spin on 16-byte chunks of those words until all four carry the tag. The
// last CTA out zeroes the words, so a launch never sees an earlier launch's tags.
constexpr bool kQkvLL = kCfg.qkv_ll;
// [pd-o-merge] (NQ_PD_O_MERGE, lab): the attention's splits store their partials (acc, m, l) and
// each adds one to its KV head's counter (per layer); nobody merges them there. o_proj, cut by
// the plan into one K slice per KV head, merges them itself: a unit waits only for the KV heads
// its slice reads, stages their splits' (m, l), weighs them (merge_weights) and writes the
// merged, normalized fp16 attention output straight into its staging. The same merge in the
// same order as [pd-merge-all]'s: the bits of the build with the same o_proj split. It saves
// the merge's own trip (partials stored, seen, merged, stored again) and the grid-wide wait
// between the attention and o_proj. The attention's fp16 output (T_ATTN) is then never written:
// the layer check of the engine (its attention output) is for the default build. (With the
// attention skipped, [pd-skip], there is nothing to merge: o_proj then stages x as before.)
constexpr bool kOMerge = kCfg.o_merge && !((kCfg.skip >> K_ATTN) & 1);
static_assert(!(kOMerge && kQkvLL), "NQ_PD_O_MERGE: o_proj writes x once its KV heads' splits are stored; with "
              "NQ_PD_QKV_LL a split does not know that every qkv CTA has read x");
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int max2(int a, int b) { return a > b ? a : b; }
// The attention's splits a KV head for a context of n tokens on a grid of `grid` CTAs: at most
// NQ_PD_ATTN_SPLITS, at least NQ_PD_ATTN_MIN_TOKENS tokens each, every split of every KV head a
// CTA (the launcher keeps grid >= KVH). The attention and, with [pd-o-merge], o_proj count alike.
__host__ __device__ constexpr int min2(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int attn_split_count(int grid, int n) {
  return min2(min2(kAttnSplits, grid / KVH), max2(1, ceil_div(n, kAttnMinTokens)));
}
// [pd-down-slices]
// down's unit (tile set, K slice s) reads slice s of gate_up's output alone: gate rows [k0, k1)
// and up rows I + [k0, k1) (its SwiGLU staging). With NQ_PD_DOWN_SLICES (lab), each gate_up CTA
// adds one, after its rows are written, to a counter (per layer and slice) of every slice its
// rows meet, and a down unit waits for its slice's count instead of for all of gate_up. But
// every gate_up CTA reads all of x (its norm) and down writes x: so down's CTAs still wait for
// all of gate_up before they publish or write x (thread 0, once their stream is done, when
// it is long complete); "down is done" keeps meaning "gate_up is done" for everything after.
constexpr bool kDownSlices = kCfg.down_slices;
static_assert(!kDownSlices || kGateUp.KS == 1,
              "NQ_PD_DOWN_SLICES: gate_up's units write their own rows (NQ_PD_GU_KS = 1)");
__host__ __device__ constexpr int down_k0(int s) {   // first row of slice s (down's groups, KS-split as unit_of)
  return (int)((long long)s * (kDown.K / NQ_GROUP_SIZE) / kDown.KS) * NQ_GROUP_SIZE;
}
__host__ __device__ constexpr int gate_up_row0(int u) {   // first row of gate_up's unit u (KS = 1: tile set u)
  return (int)((long long)u * ceil_div(kGateUp.N, 16) / kGateUp.TG) * 16;
}
// gate_up rows [r0, r1) meet down's slice s
__host__ __device__ constexpr bool rows_meet_slice(int r0, int r1, int s) {
  return (r0 < down_k0(s + 1) && down_k0(s) < r1) || (r0 < I + down_k0(s + 1) && I + down_k0(s) < r1);
}
__host__ __device__ constexpr unsigned slice_writers(int s) {   // gate_up units whose rows meet slice s
  unsigned n = 0;
  for (int u = 0; u < kGateUp.TG; ++u)
    n += rows_meet_slice(gate_up_row0(u), gate_up_row0(u + 1) < kGateUp.N ? gate_up_row0(u + 1) : kGateUp.N, s);
  return n;
}
struct SliceTargets { unsigned n[kDown.KS]; };   // (exported by the kernel: nq_pd_slice_targets)
__host__ __device__ constexpr SliceTargets slice_targets() {
  SliceTargets t{};
  for (int s = 0; s < kDown.KS; ++s) t.n[s] = slice_writers(s);
  return t;
}
// ... for a slice known only at run time, each a constant folded at compile time
template <int S = 0> __device__ __forceinline__ unsigned slice_target(int s) {
  if constexpr (S + 1 >= kDown.KS) return slice_writers(S);
  else return s == S ? slice_writers(S) : slice_target<S + 1>(s);
}
// [/pd-down-slices]
__host__ __device__ constexpr int x_bytes(Gemv m) { return ceil_div(m.K / NQ_GROUP_SIZE, m.KS) * nqs3::kXGroupBytes; }
// Dynamic shared memory: the largest of what the instructions stage (persistent.py's smem_bytes
// computes the same; the kernel checks %dynamic_smem_size at entry).
// attention: the warps' (or, in the last split, the splits') partials, then the roped q
constexpr int kMergeParts = kWarps > kAttnSplits ? kWarps : kAttnSplits;   // parts merge_weights weighs at most
// (with NQ_PD_ATTN_MERGE the splits' partials are never staged whole: a slice, packed)
constexpr int kAttnParts = kAttnMergeAll || kWarps > kAttnSplits ? kWarps : kAttnSplits;
static_assert(!kAttnMergeAll || kAttnSplits * GQA * 2 + GQA * D + kAttnSplits <= kAttnParts * GQA * (D + 2),
              "[pd-merge-all]: a split's packed slice fits the partials buffer");
constexpr int kAttnSmem = kAttnParts * GQA * (D + 2) * 4 + (GQA + 2) * D * 2;   // ... + q, k, v fp16
// [pd-o-merge]: the query heads one o_proj unit's K slice meets at most, and its scratch (the
// splits' m and l packed, their weights, the heads' sums), past the unit's x staging
constexpr int kOHeads = ceil_div(ceil_div(kO.K / NQ_GROUP_SIZE, kO.KS) * NQ_GROUP_SIZE, D) + 1;
constexpr int kOMergeOffset = ceil_div(ceil_div(kO.K / NQ_GROUP_SIZE, kO.KS) * nqs3::kXGroupBytes, 16) * 16;
constexpr int kOMergeBytes = (kAttnSplits * kOHeads * 3 + kOHeads) * 4;
constexpr int kXBytes = max2(max2(x_bytes(kQkv), x_bytes(kO)), max2(x_bytes(kGateUp), x_bytes(kDown)));   // largest GEMV staging
constexpr int kStageBytes = ceil_div(max2(kXBytes, max2(kAttnSmem, H * 4)), 16) * 16;
static_assert(!kOMerge || kOMergeOffset + kOMergeBytes <= kStageBytes, "[pd-o-merge]: the scratch fits the staging area");
// ... then, with NQ_PD_SMEM_RING, each warp's ring of kRing blocks behind it.
constexpr int kRingBytes = kSmemRing ? kRing * kWarps * nqs3::kBlockBytes : 0;
// ... and NQ_PD_SMEM_PAD_KB reserved, unused (a lab variant: what the shared memory it takes
// from L1 costs the kernel, with no ring in it).
// [pd-head]: each warp's kHead blocks, past the largest GEMV staging (so an instruction's own
// staging never meets them), over what the attention and the lm_head use in their turns.
constexpr int kHeadOffset = ceil_div(kXBytes, 128) * 128;
constexpr int kHeadEnd = kHead > 0 ? kHeadOffset + kWarps * kHead * nqs3::kBlockBytes : 0;
// [pd-loader]: the consumer warps' rings (warp w's page s at kLoaderOffset + (w R + s) P 1056),
// past everything an instruction stages, so no instruction's own use of shared memory meets them.
constexpr int kLoaderOffset = max2(kStageBytes, kHeadEnd) + kRingBytes;
constexpr int kLoaderBytes = kWarps * kLoaderSlots * kCfg.loader_page * nqs3::kBlockBytes;
constexpr int kSmemBytes = kLoaderOffset + kLoaderBytes + kCfg.smem_pad_kb * 1024;

}  // namespace pd
