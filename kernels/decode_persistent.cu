// decode_persistent.cu: one decode token (batch 1) as one kernel. One CTA per SM stays
// resident for the whole token and walks the same list of instructions as every other CTA;
// an instruction's inputs are ready when a counter in device memory says so.
//
//   nq_decode_persistent   bookkeeping + embed, num_layers x [qkv, attention, o_proj,
//                          gate_up, down], lm_head + argmax + bookkeeping
//
// [pd-schedule]
// Instructions, in order (kind: what one CTA does for it):
//   begin    CTA 0: slot, context length, page pop (engine_step.cu's nq_step_begin); x = embed[token]
//   qkv      rmsnorm(x) of the CTA's own (every CTA normalizes the 7 KB x itself), its share
//            of the qkv GEMV; the last CTA of a tile set adds the split-K slices and the bias
//   attention  q heads of one KV head roped (rope_append.cu's arithmetic), one split of the
//            context (the last split also ropes this token's k and appends k, v to its page),
//            online softmax; once all of a KV head's splits are stored, each merges a slice
//            of the head's outputs (NQ_PD_ATTN_MERGE=0: the last split to finish merges all)
//   o_proj   its share of attn -> x (+ residual, in place)
//   gate_up  rmsnorm(x), its share of the gate/up GEMV
//   down     SwiGLU of its K slice of gate_up, its share of the down GEMV (+ residual)
//   lm_head  rmsnorm(x), its 1/grid of the FP16 vocabulary rows -> logits; argmax merged by
//            the last CTA (argmax.cuh), which also writes generated[position] and moves position
// Each instruction waits for the whole previous one: counter sync[i] counts the CTAs done
// with instruction i (release by thread 0 after a CTA barrier, acquire by thread 0, then a
// CTA barrier: [pd-fence]); activations written
// inside the kernel are read with ld.global.cg (L2: never a stale L1 line).
// [/pd-schedule]
//
// [pd-prefetch]
// Weights never depend on the token, so a CTA asks for its next weights *before* it waits:
// each warp of a GEMV instruction loads its first NQ_PD_RING blocks into registers and only
// then spins on the counter. The instructions that would leave DRAM idle ask for later ones:
// attention (which reads a megabyte of K and V, no weights) issues its K/V reads and then
// cp.async.bulk.prefetch.L2 of its CTA's o_proj blocks (and NQ_PD_EARLY_BLOCKS of gate_up's);
// down prefetches the next layer's qkv share; lm_head the first NQ_PD_PREFETCH_KB of its rows.
// While the slowest CTA finishes the previous instruction, DRAM keeps streaming.
// [/pd-prefetch]
//
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
//
// Never hangs: a wait that exceeds NQ_PD_TIMEOUT_MS sets scalars[error] = 3 (kErrTimeout) and gives up
// (every later wait of the launch then returns at once); the engine raises on it.
// NQ_PD_TIMELINE=1 (diagnostic build): each CTA records (code, t_begin, t_ready, t_end) of
// every instruction in %globaltimer ns; code = layer * 16 + kind
// (nanoqwen_lib/measure/timeline.py KINDS).
// nq-variants: NQ_PD_TIMELINE=1; NQ_PD_FOLD=0; NQ_PD_RING=2; NQ_PD_PROBE=3; NQ_PD_SMEM_RING=1,NQ_PD_RING=8; NQ_PD_FENCE=0; NQ_PD_FENCE=1; NQ_PD_SMEM_PAD_KB=128; NQ_PD_ATTN_PRE=6,NQ_PD_ATTN_SPLITS=8; NQ_PD_ATTN_MERGE=0,NQ_PD_ATTN_LANES=0,NQ_PD_NORM_1PASS=0,NQ_PD_ATTN_SPLITS=16,NQ_PD_ATTN_MIN_TOKENS=32; NQ_PD_SELF_PREFETCH=16; NQ_PD_ATTN_LANES=0; NQ_PD_ATTN_LANES=2; NQ_PD_ATTN_LANES=3; NQ_PD_DOWN_DEFER=1; NQ_PD_QKV_PREFETCH=3,NQ_PD_LATE_RING=32; NQ_PD_QKV_LL=1; NQ_PD_SKIP=14; NQ_PD_HEAD_BLOCKS=4
#include "stream3.cuh"   // layout 3; gemv_int4.cuh (silu_mul); hopper.cuh; common.cuh
#include "argmax.cuh"
#include "rowops.cuh"   // sumsq8, rmsnorm8, dot8: the kernel-per-op kernels' arithmetic
#include "decode_contract.cuh"   // the pointer table (enum Tab, LayerTab), Kind, Flags, S_*, kErr*:
                                 // generated from nanoqwen_lib/gpu/decode_contract.py

#ifndef NQ_HEAD_DIM
#error "decode_persistent.cu needs the model dims (cuda_defines(dims))"
#endif
#ifndef NQ_PD_PROBE
#error "NQ_PD_PROBE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_WARPS
#error "NQ_PD_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_RING
#error "NQ_PD_RING: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_SMEM_RING
#error "NQ_PD_SMEM_RING: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_FENCE
#error "NQ_PD_FENCE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_SMEM_PAD_KB
#error "NQ_PD_SMEM_PAD_KB: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_ATTN_PRE
#error "NQ_PD_ATTN_PRE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_ATTN_MERGE
#error "NQ_PD_ATTN_MERGE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_ATTN_LANES
#error "NQ_PD_ATTN_LANES: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_NORM_1PASS
#error "NQ_PD_NORM_1PASS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_QKV_PREFETCH
#error "NQ_PD_QKV_PREFETCH: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_LATE_RING
#error "NQ_PD_LATE_RING: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_QKV_LL
#error "NQ_PD_QKV_LL: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_HEAD_BLOCKS
#error "NQ_PD_HEAD_BLOCKS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_SKIP
#error "NQ_PD_SKIP: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_DOWN_DEFER
#error "NQ_PD_DOWN_DEFER: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_SELF_PREFETCH
#error "NQ_PD_SELF_PREFETCH: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_ATTN_PREFETCH
#error "NQ_PD_ATTN_PREFETCH: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_EARLY_BLOCKS
#error "NQ_PD_EARLY_BLOCKS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_LOADER
#error "NQ_PD_LOADER: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_LOADER_PAGE
#error "NQ_PD_LOADER_PAGE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_FOLD
#error "NQ_PD_FOLD: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_KMAX
#error "NQ_PD_KMAX: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_PREFETCH_KB
#error "NQ_PD_PREFETCH_KB: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_ATTN_SPLITS
#error "NQ_PD_ATTN_SPLITS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_ATTN_MIN_TOKENS
#error "NQ_PD_ATTN_MIN_TOKENS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_TIMELINE
#error "NQ_PD_TIMELINE: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_TIMEOUT_MS
#error "NQ_PD_TIMEOUT_MS: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
#ifndef NQ_PD_QKV_TG
#error "NQ_PD_<M>_{TG,KS}: set by nanoqwen_lib.gpu.persistent.plan (the grid's split of each GEMV)"
#endif

namespace pd {
constexpr int kWarps = NQ_PD_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kRing = NQ_PD_RING;
constexpr bool kSmemRing = NQ_PD_SMEM_RING != 0;   // the ring in shared memory (cp.async), else registers
constexpr int kHead = NQ_PD_HEAD_BLOCKS;            // [pd-head]: gate_up's and down's last blocks a warp, copied early
static_assert(kHead >= 0 && kHead <= 32, "NQ_PD_HEAD_BLOCKS: 0..32 (a lane issues one block's copy)");
static_assert(!(kHead > 0 && kSmemRing), "NQ_PD_HEAD_BLOCKS and NQ_PD_SMEM_RING: one shared-memory use of the blocks at a time");
// [pd-loader] (NQ_PD_LOADER = R, lab; 0: off): one more warp a CTA, the loader, and a ring of
// R pages of NQ_PD_LOADER_PAGE layout-3 blocks for each consumer warp (the kWarps that compute).
constexpr int kLoaderSlots = NQ_PD_LOADER;
constexpr bool kLoader = kLoaderSlots > 0;
constexpr int kBlockThreads = kThreads + (kLoader ? 32 : 0);   // the launch's block
static_assert(!kLoader || kRing >= 2, "[pd-loader]: the consumer takes a block ahead into a second register slot");
static_assert(kLoaderSlots >= 0 && kLoaderSlots <= 32, "NQ_PD_LOADER: 0..32 ring pages a consumer warp");
static_assert(!kLoader || (!kSmemRing && kHead == 0),
              "NQ_PD_LOADER replaces the register ring's loads: not with NQ_PD_SMEM_RING or NQ_PD_HEAD_BLOCKS");
constexpr bool kFold = NQ_PD_FOLD != 0;
constexpr int kKmax = NQ_PD_KMAX;
// A unit's rows: one thread each in the epilogue (config.persistent_plan keeps 16 x tiles <= threads).
constexpr int H = NQ_HIDDEN, I = NQ_INTERMEDIATE, V = NQ_VOCAB;
constexpr int D = NQ_HEAD_DIM, NH = NQ_NUM_HEADS, KVH = NQ_NUM_KV_HEADS, GQA = NH / KVH;
constexpr int Q_DIM = NH * D, KV_DIM = KVH * D, QKV_DIM = Q_DIM + 2 * KV_DIM;
constexpr int kAttnSplits = NQ_PD_ATTN_SPLITS;
constexpr int kAttnMinTokens = NQ_PD_ATTN_MIN_TOKENS;
constexpr bool kAttnMergeAll = NQ_PD_ATTN_MERGE != 0;   // every split merges a slice, else the last split all
// attention: a split of at most 32 tokens as a warp per query head and a lane per token
// ([pd-attn-lanes]; longer splits take the warp-per-token path)
constexpr bool kAttnLanes = NQ_PD_ATTN_LANES != 0;
// ... its arithmetic (lab, 2 and 3): 2, the P.V loop unrolled over all 32 lanes (a lane past the
// split's tokens has p = 0 and reads the last token's row: fma(0, v, acc) = acc, the same bits
// as 1); 3, also each score in 4 interleaved chains instead of one (other bits)
constexpr bool kLanePvUnroll = NQ_PD_ATTN_LANES >= 2;
constexpr int kLaneChains = NQ_PD_ATTN_LANES >= 3 ? 4 : 1;
static_assert(NQ_PD_ATTN_LANES >= 0 && NQ_PD_ATTN_LANES <= 3, "NQ_PD_ATTN_LANES: 0, 1, 2 or 3");
static_assert(kLaneChains == 1 || kLaneChains == 4, "one score chain or four (added pairwise)");
static_assert(!kAttnLanes || kAttnMergeAll, "[pd-attn-lanes] stores each head's part for the slice merge");
static_assert(!kAttnLanes || 2 * 32 * D * 2 <= kWarps * GQA * (D + 2) * 4, "[pd-attn-lanes]: K and V rows fit the partials buffer");
// ST_NORM in one pass over x (a chunk a thread: x of at most kThreads chunks), else two
constexpr bool kNormOnePass = NQ_PD_NORM_1PASS != 0 && H / 8 <= kThreads;
static_assert(NQ_PD_SELF_PREFETCH >= 0 && NQ_PD_SELF_PREFETCH <= 32, "0..32 blocks a warp (a lane each)");
constexpr int kLmRows = 2, kLmUnroll = 4;
static_assert(kWarps >= 4 && kWarps <= 32, "4..32 warps per CTA");
static_assert(kRing >= 1 && kRing <= 8, "1..8 blocks in flight per warp");
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
constexpr bool kDownDefer = NQ_PD_DOWN_DEFER != 0 && kDown.KS > 1 && kNormOnePass;
// [pd-qkv-ll] (NQ_PD_QKV_LL, lab): the attention does not wait on qkv's counter and then load
// q, k, v (two trips); it polls them. qkv's epilogue stores each output as one 32-bit word,
// (tag << 16) | fp16 bits, tag = layer + 1 (NCCL's "LL" protocol: value and flag in one
// single-copy-atomic word, so a word with the layer's tag holds that layer's value), and the
// attention's threads spin on 16-byte chunks of those words until all four carry the tag. The
// last CTA out zeroes the words, so a launch never sees an earlier launch's tags.
constexpr bool kQkvLL = NQ_PD_QKV_LL != 0;
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int max2(int a, int b) { return a > b ? a : b; }
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
constexpr int kXBytes = max2(max2(x_bytes(kQkv), x_bytes(kO)), max2(x_bytes(kGateUp), x_bytes(kDown)));   // largest GEMV staging
constexpr int kStageBytes = ceil_div(max2(kXBytes, max2(kAttnSmem, H * 4)), 16) * 16;
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
constexpr int kLoaderBytes = kWarps * kLoaderSlots * NQ_PD_LOADER_PAGE * nqs3::kBlockBytes;
constexpr int kSmemBytes = kLoaderOffset + kLoaderBytes + NQ_PD_SMEM_PAD_KB * 1024;

// The consumers' CTA barrier: every thread (__syncthreads), or with the loader, which never
// takes part, named barrier 1 over the kThreads consumer threads.
__device__ __forceinline__ void cta_sync() {
  if constexpr (kLoader) asm volatile("bar.sync 1, %0;" :: "n"(kThreads) : "memory");
  else __syncthreads();
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// [pd-fence]
// The counters' memory ordering, one thread (thread 0) after a CTA barrier, in three builds
// (NQ_PD_FENCE): 0, __threadfence (fence.sc.gpu: SASS MEMBAR.SC.GPU) before a relaxed atomic,
// and the waiter's ld.acquire; 1, fence.acq_rel.gpu (MEMBAR.ALL.GPU) before a relaxed atomic,
// the waiter polling relaxed and fencing once it sees the count (a release and an acquire
// pattern of the PTX memory model); 2, the release and acquire on the operations themselves
// (red.release, atom.acq_rel, ld.acquire).
__device__ __forceinline__ void fence_gpu() {
  if (NQ_PD_FENCE == 0) __threadfence();
  else asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
// Poll (relaxed in build 1: the fence comes once, in acquired()).
__device__ __forceinline__ unsigned ld_poll(const unsigned* p) {
  unsigned v;
  if (NQ_PD_FENCE == 1) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void acquired() {
  if (NQ_PD_FENCE == 1) fence_gpu();
}
// *p += v, after this CTA's writes (release).
__device__ __forceinline__ void release_add(unsigned* p, unsigned v) {
  if (NQ_PD_FENCE == 2) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
  } else {
    fence_gpu();
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
  }
}
// *p += 1 after this CTA's writes; true in the arrival that completes `count` (which then
// sees every arrival's writes: acquire).
__device__ __forceinline__ bool arrive_last(unsigned* p, unsigned count) {
  unsigned old;
  if (NQ_PD_FENCE == 2) {
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
    return old == count - 1;
  }
  fence_gpu();
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  if (old != count - 1) return false;
  fence_gpu();
  return true;
}
// [/pd-fence]
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
template <class T> __device__ __forceinline__ T* ptr(const long long* tab, int i) {
  return reinterpret_cast<T*>(tab[i]);
}

struct Ctx {
  const long long* tab;
  int* scalars;
  unsigned* sync;
  int grid;
  float eps;                // rmsnorm epsilon
  int n_ctx;                // attention: the context length, once read (-1: not yet)
  int first_layer;          // the launch's first layer (its attention reads the pages)
  int* s_pages;             // attention: this CTA's split's pages, once read (shared memory)
  const long long* lt;      // this layer's table row
  const long long* lt_next; // the next layer's (null after the last layer run)
  bool x_pending;           // [pd-down-defer]: the last down's K slices are in WS_DOWN, not yet in x
  int prev;                 // counter the next instruction waits on (-1: none)
  unsigned prev_target;
  long long* tl;            // this CTA's timeline rows (diagnostic build) or null
  int tl_n;
  unsigned long long t_begin, t_ready;
  uint64_t* head_bar;       // [pd-head]: one mbarrier a warp (shared memory)
  unsigned head_uses;       // ... and how many of its phases this warp has waited for
  unsigned char* ld_ring;   // [pd-loader]: the rings, their slots' full and empty mbarriers,
  uint64_t* ld_full;        // and how many blocks this warp has taken from its ring
  uint64_t* ld_empty;
  unsigned ld_n;
};

// ---- dependencies ----------------------------------------------------------------------
// [pd-wait]
// All threads. Thread 0 spins until sync[prev] >= target (acquire), then the CTA barrier
// passes the ordering on to every thread.
// A spinning loop's way out (checked every 64th turn): true after an earlier timeout
// (*err != 0), or once NQ_PD_TIMEOUT_MS have passed since t0 (which sets *err).
__device__ __forceinline__ bool timed_out(volatile int* err, unsigned long long t0) {
  if (*err != 0) return true;                          // an earlier timeout: give up at once
  if (now_ns() - t0 > (unsigned long long)NQ_PD_TIMEOUT_MS * 1000000ull) { atomicExch((int*)err, kErrTimeout); return true; }
  return false;
}
// One thread: spin until *p >= target (acquire), or give up after NQ_PD_TIMEOUT_MS (error 3)
// or at once after an earlier timeout.
__device__ __forceinline__ void spin_until(const Ctx& c, const unsigned* p, unsigned target) {
  const unsigned long long t0 = now_ns();
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  for (int spin = 0; ld_poll(p) < target; ++spin)
    if ((spin & 63) == 63 && timed_out(err, t0)) break;
  acquired();
}
__device__ __forceinline__ void wait_inputs(Ctx& c) {
  if (threadIdx.x == 0 && c.prev >= 0) spin_until(c, c.sync + c.prev, c.prev_target);
  cta_sync();   // all threads: the inputs of this instruction are complete
  if (NQ_PD_TIMELINE && threadIdx.x == 0) c.t_ready = now_ns();
}
// All threads, after the CTA's last write of instruction `idx`: publish it (arrive = false:
// a CTA that took no part, as every CTA but 0 in `begin`, only records and moves on). The
// next instruction waits for sync[idx] >= target.
__device__ __forceinline__ void signal_done(Ctx& c, int idx, int layer, int kind, unsigned target,
                                            bool arrive = true) {
  cta_sync();   // all threads: this CTA's writes of the instruction are issued
  if (threadIdx.x == 0) {
    if (arrive) release_add(c.sync + idx, 1u);         // ... and visible before the counter moves
#if NQ_PD_TIMELINE
    long long* row = c.tl + 4 * c.tl_n;
    row[0] = layer * 16 + kind; row[1] = (long long)c.t_begin; row[2] = (long long)c.t_ready;
    row[3] = (long long)now_ns();
#endif
  }
  c.tl_n++;
  c.prev = idx;
  c.prev_target = target;
}
// [/pd-wait]
// NQ_PD_PROBE > 0 (lab build, tools/bench_persistent.py --probe): thread 0 of every CTA
// stamps %globaltimer at numbered points of layer NQ_PD_PROBE's qkv and attention into
// probe[blockIdx.x][point].
__device__ __forceinline__ void probe(const Ctx& c, int layer, int point) {
  if (NQ_PD_PROBE > 0 && layer == NQ_PD_PROBE && threadIdx.x == 0)
    ptr<long long>(c.tab, T_PROBE)[blockIdx.x * 16 + point] = (long long)now_ns();
}
__device__ __forceinline__ void begin_instruction(Ctx& c) {
  if (NQ_PD_TIMELINE && threadIdx.x == 0) { c.t_begin = now_ns(); c.t_ready = c.t_begin; }
}

// CTA sum; every thread gets the total (same order in every thread). Uses red[kWarps].
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  cta_sync();   // all threads: red[] complete
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  cta_sync();   // all threads: red[] read before it is reused
  return s;
}

// 1 / rms of the fp16 vector x [H] (written in this kernel: read through L2), decode_ops.cu's
// nq_rmsnorm arithmetic.
// From each thread's partial sum of squares (all threads):
__device__ __forceinline__ float rms_inv_of(float ss, float* red, float eps) {
  return 1.0f / sqrtf(block_sum(ss, red) / (float)H + eps);
}
__device__ __forceinline__ float rms_inv(const half* x, float* red, float eps) {
  float ss = 0.f;
  for (int c = threadIdx.x; c < H / 8; c += kThreads) ss = nq::sumsq8(__ldcg(reinterpret_cast<const uint4*>(x) + c), ss);
  return rms_inv_of(ss, red, eps);
}
// y = fp16(x * r * w) for the 8 halves of chunk c.
__device__ __forceinline__ uint4 norm_chunk(const half* x, const half* w, float r, int c) {
  return nq::rmsnorm8(__ldcg(reinterpret_cast<const uint4*>(x) + c), __ldg(reinterpret_cast<const uint4*>(w) + c), r);
}

// [pd-down-defer] x's chunk c (8 rows) with down's slices added: fp16(x + (ws[0] + ws[1] + ...)),
// the fold's arithmetic (gemv's epilogue below), row by row.
__device__ __forceinline__ uint4 fold_chunk(uint4 xv, const float* ws, int c) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = 0.f;
#pragma unroll
  for (int s = 0; s < kDown.KS; ++s) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(ws + (size_t)s * H + 8 * c));
    const float4 b = __ldcg(reinterpret_cast<const float4*>(ws + (size_t)s * H + 8 * c + 4));
    v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w; v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
  }
  half* xh = reinterpret_cast<half*>(&xv);
#pragma unroll
  for (int i = 0; i < 8; ++i) xh[i] = __float2half_rn(__half2float(xh[i]) + v[i]);
  return xv;
}
// ... and one row's (o_proj's residual): x[row] with the slices added, as a float
__device__ __forceinline__ float fold_row(float x, const float* ws, int row) {
  float v = 0.f;
#pragma unroll
  for (int s = 0; s < kDown.KS; ++s) v += __ldcg(ws + (size_t)s * H + row);
  return __half2float(__float2half_rn(x + v));
}

// [pd-qkv-ll] store: fp16 h of qkv row `row` with the layer's tag
__device__ __forceinline__ void store_tagged(const Ctx& c, int row, half h, int layer) {
  unsigned* p = ptr<unsigned>(c.tab, T_QKV_TAG) + row;
  const unsigned w = ((unsigned)(layer + 1) << 16) | __half_as_ushort(h);
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(w) : "memory");
}
// ... poll: the 4 words at p (16-byte aligned) once all carry `tag`, or whatever they hold after
// NQ_PD_TIMEOUT_MS (error 3) or at once after an earlier timeout ([pd-wait]'s rule)
__device__ __forceinline__ uint4 poll_tagged4(const Ctx& c, const unsigned* p, unsigned tag) {
  const unsigned long long t0 = now_ns();
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  uint4 w;
  for (int spin = 0;; ++spin) {
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
    if ((w.x >> 16) == tag && (w.y >> 16) == tag && (w.z >> 16) == tag && (w.w >> 16) == tag) break;
    if ((spin & 63) == 63 && timed_out(err, t0)) break;
  }
  return w;
}

// [pd-skip] (NQ_PD_SKIP, diagnostic; bits 1 << kind): those layer instructions keep their place
// in the schedule (begin, wait, signal) and do nothing else: no weights, no inputs, no outputs.
// The token's values are then meaningless; its time says what the remaining instructions cost
// on their own (tools/bench_persistent.py --variants bounds).
static_assert((NQ_PD_SKIP & ~((1 << K_QKV) | (1 << K_ATTN) | (1 << K_O) | (1 << K_GATE_UP) | (1 << K_DOWN))) == 0,
              "NQ_PD_SKIP: bits 1 << kind of the layer instructions");
__device__ __forceinline__ constexpr bool skipped(int kind) { return (NQ_PD_SKIP >> kind) & 1; }
__device__ __forceinline__ void skip_instruction(Ctx& c, int idx, int layer, int kind) {
  begin_instruction(c);
  wait_inputs(c);
  signal_done(c, idx, layer, kind, c.grid);
}

// ---- GEMV instructions ------------------------------------------------------------------
enum Stage { ST_NORM, ST_X, ST_SWIGLU };
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
  if (!NQ_PD_ATTN_PREFETCH || kLoader) return;          // (a variant: attention's loads alone on the bus;
                                                         // [pd-loader]: the loader is already at it)
  prefetch_warp<kO.N, kO.K, kO.TG, kO.KS>(ptr<const unsigned char>(c.lt, L_O), 0, 32);
  if (NQ_PD_EARLY_BLOCKS > 0)
    prefetch_warp<kGateUp.N, kGateUp.K, kGateUp.TG, kGateUp.KS>(ptr<const unsigned char>(c.lt, L_GATE_UP), 0,
                                                                NQ_PD_EARLY_BLOCKS);
}
__device__ __forceinline__ void prefetch_next_qkv(Ctx& c) {
  if (!kLoader && c.lt_next) prefetch_warp<kQkv.N, kQkv.K, kQkv.TG, kQkv.KS>(ptr<const unsigned char>(c.lt_next, L_QKV), 0, 32);
}

// ---- the loader ---------------------------------------------------------------------------
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
constexpr int kPageBlocks = NQ_PD_LOADER_PAGE;
constexpr int kPageBytes = kPageBlocks * nqs3::kBlockBytes;
static_assert(kPageBlocks >= 1 && kPageBlocks <= 16, "NQ_PD_LOADER_PAGE: 1..16 blocks a page");
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
__device__ __forceinline__ void seek(Cursor& q, const Ctx& c, int first_layer, int k_end, int wl) {
  for (; q.k < k_end; ++q.k) {
    const long long* lt = c.tab + kLayerBase + kLayerStride * (first_layer + q.k / 4);
    const int m = q.k % 4;
    if (m == 0 && !skipped(K_QKV) &&
        range_start<kQkv.N, kQkv.K, kQkv.TG, kQkv.KS>(q, ptr<const unsigned char>(lt, L_QKV), wl)) return;
    if (m == 1 && !skipped(K_O) && range_start<kO.N, kO.K, kO.TG, kO.KS>(q, ptr<const unsigned char>(lt, L_O), wl)) return;
    if (m == 2 && !skipped(K_GATE_UP) &&
        range_start<kGateUp.N, kGateUp.K, kGateUp.TG, kGateUp.KS>(q, ptr<const unsigned char>(lt, L_GATE_UP), wl)) return;
    if (m == 3 && !skipped(K_DOWN) &&
        range_start<kDown.N, kDown.K, kDown.TG, kDown.KS>(q, ptr<const unsigned char>(lt, L_DOWN), wl)) return;
  }
}
// Page q.n of warp wl's ring: its next min(P, left) blocks, runs of adjacent blocks one copy each.
__device__ __forceinline__ void issue_page(Cursor& q, const Ctx& c, int wl) {
  const int nb = min(kPageBlocks, q.left);
  const unsigned s = wl * kLoaderSlots + q.n % kLoaderSlots;
  unsigned char* dst = c.ld_ring + (size_t)s * kPageBytes;
  hopper::mbar_arrive_expect_tx(c.ld_full + s, nb * nqs3::kBlockBytes);
  const unsigned char* run = q.lp;
  int run_blocks = 0;
  for (int i = 0; i < nb; ++i) {
    if (run_blocks > 0 && q.lp != run + run_blocks * nqs3::kBlockBytes) {   // not adjacent: the run so far
      hopper::bulk_copy_g2s(dst, run, run_blocks * nqs3::kBlockBytes, c.ld_full + s);
      dst += run_blocks * nqs3::kBlockBytes;
      run = q.lp;
      run_blocks = 0;
    }
    ++run_blocks;
    q.lp += nqs3::kBlockBytes;
    if (++q.lg == q.ng) { q.lg = 0; q.lp += q.skip; }
  }
  hopper::bulk_copy_g2s(dst, run, run_blocks * nqs3::kBlockBytes, c.ld_full + s);
  q.left -= nb;
  ++q.n;
}
// The loader warp's whole launch: the GEMV instructions of layers [first_layer, last_layer) in
// the consumers' order (a skipped instruction, [pd-skip], has no blocks); lane w < kWarps
// serves consumer warp w.
__device__ void loader(const Ctx& c, int first_layer, int last_layer) {
  const int lane = threadIdx.x & 31, k_end = 4 * (last_layer - first_layer);
  Cursor q;
  q.k = lane < kWarps ? 0 : k_end;
  q.n = 0;
  seek(q, c, first_layer, k_end, lane);
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  unsigned long long t0 = now_ns();
  for (int idle = 0; __any_sync(0xffffffffu, q.k < k_end);) {
    bool issued = false;
    if (q.k < k_end) {
      const unsigned s = lane * kLoaderSlots + q.n % kLoaderSlots;
      if (hopper::mbar_try(c.ld_empty + s, ((q.n / kLoaderSlots) & 1u) ^ 1u)) {   // use 0 of a page: free at once
        issue_page(q, c, lane);
        if (q.left == 0) { ++q.k; seek(q, c, first_layer, k_end, lane); }
        issued = true;
      }
    }
    if (__any_sync(0xffffffffu, issued)) { idle = 0; t0 = now_ns(); }
    else if ((++idle & 63) == 63 && __any_sync(0xffffffffu, timed_out(err, t0))) return;   // (warp-uniform)
  }
}
// A consumer warp, all lanes: block j of its range (b - b0) from its ring into registers. At a
// page's first block, wait for the page; after its last (or the range's last), give it back
// (lane 0 arrives once every lane has read it).
__device__ __forceinline__ void ring_take(Ctx& c, nqs3::Slot& r, int warp, int lane, int j, bool last) {
  const int i = j % kPageBlocks;
  const unsigned s = warp * kLoaderSlots + c.ld_n % kLoaderSlots;
  if (i == 0) ring_wait(c, c.ld_full + s, (c.ld_n / kLoaderSlots) & 1u);   // (a timeout: the error is set, go on)
  nqs3::read_slot(r, c.ld_ring + (size_t)s * kPageBytes + i * nqs3::kBlockBytes, lane);
  if (i == kPageBlocks - 1 || last) {
    __syncwarp();                                                // every lane has read the page
    if (lane == 0) hopper::mbar_arrive(c.ld_empty + s);
    ++c.ld_n;
  }
}
// [/pd-loader]

// When down asks for the next layer's qkv share (NQ_PD_QKV_PREFETCH; lab): 1, at its start,
// before its own ring and its wait (while gate_up's last CTAs still stream); 2, right after its
// wait; 3, after its own stream, while its fold and the counters run; 0, never.
static_assert(NQ_PD_QKV_PREFETCH >= 0 && NQ_PD_QKV_PREFETCH <= 3, "NQ_PD_QKV_PREFETCH: 0..3");
// Kinds whose first kRing blocks a warp are asked for only after the wait (bit 1 << kind;
// NQ_PD_LATE_RING, lab; 0: every GEMV's before, [pd-prefetch]): is the next instruction's early
// request what keeps the last CTAs of the one before from finishing?
static_assert((NQ_PD_LATE_RING & ~((1 << K_QKV) | (1 << K_O) | (1 << K_GATE_UP) | (1 << K_DOWN))) == 0,
              "NQ_PD_LATE_RING: bits 1 << kind of the GEMV kinds");
template <int N, int K, int TG, int KS, int kStage, int kEpi, bool kPrefetchNextQkv = false>
__device__ void gemv(Ctx& c, int idx, int layer, int kind, const unsigned char* w, const half* act,
                     const half* norm_w, const half* bias, half* out, unsigned char* xs, float* red,
                     float (*part)[kKmax][16]) {
  constexpr int G = K / NQ_GROUP_SIZE;
  begin_instruction(c);
  const Unit u = unit_of<N, K, TG, KS>(blockIdx.x);
  if (kPrefetchNextQkv && NQ_PD_QKV_PREFETCH == 1) prefetch_next_qkv(c);   // a later instruction's weights ([pd-prefetch])
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
  const bool late_ring = (NQ_PD_LATE_RING >> kind) & 1;
  if (!late_ring && !kLoader) issue_ring();
  // gate_up's and down's next NQ_PD_SELF_PREFETCH blocks a warp, past the ring, into L2
  // ([pd-prefetch]; qkv's and o_proj's were prefetched by the instruction before them).
  if (NQ_PD_SELF_PREFETCH > 0 && !kLoader && (kind == K_GATE_UP || kind == K_DOWN))
    prefetch_warp<N, K, TG, KS>(w, kRing, NQ_PD_SELF_PREFETCH);
  if (kind == K_QKV) probe(c, layer, 0);
  wait_inputs(c);
  if (late_ring && !kLoader) issue_ring();
  if (kPrefetchNextQkv && NQ_PD_QKV_PREFETCH == 2) prefetch_next_qkv(c);
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
    if constexpr (kLoader) {                            // [pd-loader]: the blocks come from the warp's ring,
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
  if (kPrefetchNextQkv && NQ_PD_QKV_PREFETCH == 3) prefetch_next_qkv(c);
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
  signal_done(c, idx, layer, kind, c.grid);
  if (kind == K_QKV) probe(c, layer, 4);
}

// ---- attention ----------------------------------------------------------------------------
// Rotate the pair (x[i], x[i + D/2]) by angle pos * inv_freq[i] (rope_append.cu's arithmetic).
// x in global memory (written in this kernel: through L2), or (kShared) in shared memory, where
// out may be x itself (the pair is read before it is written).
template <bool kShared = false>
__device__ __forceinline__ void rope_pair(const half* x, half* out, int i, float pos, const float* inv_freq) {
  float s, co;
  sincosf(pos * inv_freq[i], &s, &co);
  const float x1 = __half2float(kShared ? x[i] : __ldcg(x + i));
  const float x2 = __half2float(kShared ? x[i + D / 2] : __ldcg(x + i + D / 2));
  out[i] = __float2half_rn(__fsub_rn(__fmul_rn(x1, co), __fmul_rn(x2, s)));
  out[i + D / 2] = __float2half_rn(__fadd_rn(__fmul_rn(x2, co), __fmul_rn(x1, s)));
}

// [pd-attention]
// Unit (g, s) of KVH x splits: KV head g, tokens [j0, j1) of the context; warp w takes tokens
// j0 + w, j0 + w + kWarps, ... The K and V rows of its first kAttnPre tokens are loaded
// *before* the wait (the cache's older rows do not depend on this token; the page table and
// context length were written by `begin`, which this CTA has already seen complete); the
// current token's row (n - 1) is roped and appended by the last split after the wait.
constexpr int kAttnPre = NQ_PD_ATTN_PRE;   // rows a warp loads before the wait
static_assert(kAttnPre >= 1 && kAttnPre <= 8, "1..8 K/V rows a warp before the wait");
static_assert(NQ_PD_ATTN_SPLITS * GQA * (D + 2) % 4 == 0, "a KV head's split partials start 16-byte aligned");
constexpr int kPagesCached = 64;   // a split's pages kept in shared memory from the first layer on
struct KvRow { float k[D / 32], v[D / 32]; };
// The lane's dims of one K and V row: from the cache (through L2), or (kShared) from this
// CTA's shared memory.
template <bool kShared = false>
__device__ __forceinline__ void load_kv(KvRow& r, const half* kc, const half* vc, long long off) {
  constexpr int E = D / 32;
  if (E == 4) {
    const uint2 kv = kShared ? *reinterpret_cast<const uint2*>(kc + off) : __ldcg(reinterpret_cast<const uint2*>(kc + off));
    const uint2 vv = kShared ? *reinterpret_cast<const uint2*>(vc + off) : __ldcg(reinterpret_cast<const uint2*>(vc + off));
    const float2 k01 = __half22float2(*reinterpret_cast<const half2*>(&kv.x));
    const float2 k23 = __half22float2(*reinterpret_cast<const half2*>(&kv.y));
    const float2 v01 = __half22float2(*reinterpret_cast<const half2*>(&vv.x));
    const float2 v23 = __half22float2(*reinterpret_cast<const half2*>(&vv.y));
    r.k[0] = k01.x; r.k[1] = k01.y; r.k[E - 2] = k23.x; r.k[E - 1] = k23.y;
    r.v[0] = v01.x; r.v[1] = v01.y; r.v[E - 2] = v23.x; r.v[E - 1] = v23.y;
  } else {
    const unsigned kv = kShared ? *reinterpret_cast<const unsigned*>(kc + off) : __ldcg(reinterpret_cast<const unsigned*>(kc + off));
    const unsigned vv = kShared ? *reinterpret_cast<const unsigned*>(vc + off) : __ldcg(reinterpret_cast<const unsigned*>(vc + off));
    const float2 k01 = __half22float2(*reinterpret_cast<const half2*>(&kv));
    const float2 v01 = __half22float2(*reinterpret_cast<const half2*>(&vv));
    r.k[0] = k01.x; r.k[E - 1] = k01.y;
    r.v[0] = v01.x; r.v[E - 1] = v01.y;
  }
}

// The exact merge of `parts` (<= 32) partial softmaxes of one head h, each (acc[D], m, l) at
// p + (i * GQA + h) * (D + 2) (the warps of a CTA, or the splits of a KV head). One warp per
// head, lane i for part i: the max and the sum are two 5-step shuffle trees (a fixed order),
// not a chain over the parts. Writes each part's weight e^(m_i - M) (0 for an empty part) to
// wt[i][h] and the merged l to lsum[h]; returns M in every lane. merged_acc then gives one
// output element.
static_assert(kMergeParts <= 32 && GQA <= kWarps, "merge_weights: a lane per part, a warp per head");
// Part i's m and l at ml[i * stride] and ml[i * stride + 1].
__device__ __forceinline__ float merge_weights_ml(const float* ml, int stride, int parts, int h, float (*wt)[GQA],
                                                  float* lsum) {
  const int i = threadIdx.x & 31;
  const float m = i < parts ? ml[i * stride] : NQ_NEG_INF;
  float M = m;
  for (int o = 16; o >= 1; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  const float e = i < parts && m != NQ_NEG_INF ? __expf(m - M) : 0.f;
  float L = i < parts ? ml[i * stride + 1] * e : 0.f;
  for (int o = 16; o >= 1; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  if (i < parts) wt[i][h] = e;
  if (i == 0) lsum[h] = L;
  return M;
}
__device__ __forceinline__ float merge_weights(const float* p, int parts, int h, float (*wt)[GQA], float* lsum) {
  return merge_weights_ml(p + h * (D + 2) + D, GQA * (D + 2), parts, h, wt, lsum);
}
// One output element of head h: part i's accumulator at a[i * stride], in part order.
__device__ __forceinline__ float merged_acc_s(const float* a, int stride, int parts, int h, const float (*wt)[GQA]) {
  float v = 0.f;
  for (int i = 0; i < parts; ++i) v = fmaf(a[i * stride], wt[i][h], v);
  return v;
}
__device__ __forceinline__ float merged_acc(const float* p, int parts, int h, int d, const float (*wt)[GQA]) {
  return merged_acc_s(p + h * (D + 2) + d, GQA * (D + 2), parts, h, wt);
}

__device__ void attention(Ctx& c, int idx, int layer, const long long* lt, unsigned char* smem) {
  constexpr int E = D / 32;                            // dims per lane
  begin_instruction(c);
  // The context length and the split's pages do not change from layer to layer: read once per
  // launch (the first attention), kept in Ctx and shared memory for the rest.
  if (c.n_ctx < 0) c.n_ctx = __ldcg(c.scalars + S_CONTEXT * NQ_SCALAR_STRIDE);   // context incl. this token
  const int n = c.n_ctx;
  // At most NQ_PD_ATTN_SPLITS, at least NQ_PD_ATTN_MIN_TOKENS tokens each, and every split of
  // every KV head a CTA of this grid (the launcher keeps grid >= KVH).
  const int splits = min(min(kAttnSplits, c.grid / KVH), max(1, ceil_div(n, kAttnMinTokens)));
  const int u = blockIdx.x;
  const bool live = u < KVH * splits;
  const int g = live ? u / splits : 0, s = live ? u % splits : 0;
  const int j0 = (int)((long long)s * n / splits), j1 = live ? (int)((long long)(s + 1) * n / splits) : 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int* block_table = ptr<const int>(c.tab, T_BLOCK_TABLE);
  const int p0 = j0 / NQ_PAGE_TOKENS;
  if (layer == c.first_layer) {
    for (int i = threadIdx.x; i < kPagesCached && p0 + i <= (j1 - 1) / NQ_PAGE_TOKENS; i += kThreads)
      c.s_pages[i] = __ldcg(block_table + p0 + i);
    cta_sync();   // all threads: the split's pages are known
  }
  half* kc = ptr<half>(lt, L_K);
  half* vc = ptr<half>(lt, L_V);
  auto row_of = [&](int j) {
    const int pi = j / NQ_PAGE_TOKENS - p0;
    const int page = pi < kPagesCached ? c.s_pages[pi] : __ldcg(block_table + j / NQ_PAGE_TOKENS);
    return ((long long)(page * KVH + g) * NQ_PAGE_TOKENS + j % NQ_PAGE_TOKENS) * D + lane * E;
  };
  // [pd-attn-lanes] (NQ_PD_ATTN_LANES, a split of <= 32 tokens): the split's older K and V rows
  // go to shared memory by cp.async before the wait (no register held across it).
  const bool lanes = kAttnLanes && live && j1 - j0 <= 32;                  // CTA-uniform
  half* ks = reinterpret_cast<half*>(smem);                                // [32][D] K rows, then
  half* vs = ks + 32 * D;                                                  // [32][D] V rows
  if (lanes) {
    constexpr int kChunks = D * 2 / 16;                                    // 16-byte chunks a row
    for (int i = threadIdx.x; i < (j1 - j0) * kChunks; i += kThreads) {
      const int t = i / kChunks, ch = i % kChunks, j = j0 + t;
      if (j < n - 1) {
        const long long off = row_of(j) - lane * E + ch * 8;
        hopper::cp_async16(hopper::smem_u32(ks + t * D + ch * 8), kc + off, true);
        hopper::cp_async16(hopper::smem_u32(vs + t * D + ch * 8), vc + off, true);
      }
    }
    hopper::cp_async_commit();
  }
  // [/pd-attn-lanes]
  KvRow pre[kAttnPre];
#pragma unroll
  for (int i = 0; i < kAttnPre; ++i) {
    const int j = j0 + warp + i * kWarps;
    if (!lanes && j < j1 && j < n - 1) load_kv(pre[i], kc, vc, row_of(j));
  }
  prefetch_during_attention(c);   // no weights here: o_proj's and gate_up's, queued behind the K/V reads
  probe(c, layer, 5);
  if (kQkvLL) c.prev = -1;        // [pd-qkv-ll]: no counter to wait on; q, k, v are polled below
  wait_inputs(c);
  probe(c, layer, 6);
  float* wpart = reinterpret_cast<float*>(smem);                    // [kAttnParts][GQA][D + 2]
  half* qh = reinterpret_cast<half*>(wpart + kAttnParts * GQA * (D + 2)); // [GQA][D] roped q, fp16
  half* kh = qh + GQA * D;                                          // [D] this token's roped k (last split)
  half* vh = kh + D;                                                // [D] and v
  __shared__ float wt[kMergeParts][GQA];   // merge weights (merge_weights): of the warps or of the splits
  __shared__ float lsum[GQA];
  if (live) {
    const half* qkv = ptr<const half>(c.tab, T_QKV);
    const float* inv_freq = ptr<const float>(c.tab, T_INV_FREQ);
    const float pos = (float)(n - 1);
    if (kQkvLL) {
      // [pd-qkv-ll] q of the head's GQA query heads (and, in the last split, k and v) polled
      // into qh (kh, vh) as they are, then roped there.
      const unsigned* tagged = ptr<const unsigned>(c.tab, T_QKV_TAG);
      constexpr int QC = GQA * D / 4, KC = D / 4;        // 16-byte chunks: 4 tagged values each
      const int nc = s == splits - 1 ? QC + 2 * KC : QC;
      for (int ch = threadIdx.x; ch < nc; ch += kThreads) {
        const int src = ch < QC ? g * GQA * D + 4 * ch : ch < QC + KC ? Q_DIM + g * D + 4 * (ch - QC)
                                                       : Q_DIM + KV_DIM + g * D + 4 * (ch - QC - KC);
        half* dst = ch < QC ? qh + 4 * ch : ch < QC + KC ? kh + 4 * (ch - QC) : vh + 4 * (ch - QC - KC);
        const uint4 w = poll_tagged4(c, tagged + src, (unsigned)layer + 1u);
        dst[0] = __ushort_as_half((unsigned short)w.x); dst[1] = __ushort_as_half((unsigned short)w.y);
        dst[2] = __ushort_as_half((unsigned short)w.z); dst[3] = __ushort_as_half((unsigned short)w.w);
      }
      cta_sync();   // all threads: q (k, v) in shared memory
      if (NQ_PD_TIMELINE && threadIdx.x == 0) c.t_ready = now_ns();
    }
    for (int i = threadIdx.x; i < GQA * D / 2; i += kThreads) {
      const int h = i / (D / 2), e = i % (D / 2);
      if (kQkvLL) rope_pair<true>(qh + h * D, qh + h * D, e, pos, inv_freq);
      else rope_pair(qkv + (g * GQA + h) * D, qh + h * D, e, pos, inv_freq);
    }
    if (s == splits - 1 && threadIdx.x < D / 2) {     // this token's k (roped) and v -> shared memory and its page slot
      const int slot = __ldcg(c.scalars + S_SLOT * NQ_SCALAR_STRIDE);
      const int page = slot / NQ_PAGE_TOKENS, off = slot % NQ_PAGE_TOKENS;
      const long long row = ((long long)(page * KVH + g) * NQ_PAGE_TOKENS + off) * D;
      const int i = threadIdx.x, i2 = threadIdx.x + D / 2;
      if (kQkvLL) {
        rope_pair<true>(kh, kh, i, pos, inv_freq);   // (v is in vh already)
      } else {
        rope_pair(qkv + Q_DIM + g * D, kh, i, pos, inv_freq);
        const half* v = qkv + Q_DIM + KV_DIM + g * D;
        vh[i] = __ldcg(v + i);
        vh[i2] = __ldcg(v + i2);
      }
      kc[row + i] = kh[i]; kc[row + i2] = kh[i2];     // (this thread's own shared-memory writes)
      vc[row + i] = vh[i]; vc[row + i2] = vh[i2];
    }
  }
  if (lanes) hopper::cp_async_wait<0>();   // this thread's K/V rows have landed
  cta_sync();   // all threads: q roped; this token's k, v in shared memory (and stored to the cache)
  probe(c, layer, 7);
  if (lanes && warp < GQA) {
    // [pd-attn-lanes] Warp h: query head h over the split's tokens, lane t: token j0 + t. The
    // score is the lane's own dot product (half2 pairs read in a rotated order: the 32 lanes'
    // rows fall in 32 different banks), the softmax two shuffle trees, and each output dim a
    // sum over the tokens' p (broadcast by shuffle) times their V row. (acc, m, l) of head h go
    // straight to the split's partials: no merge over warps.
    const int h = warp, ntok = j1 - j0, j = j0 + lane;
    const bool mine = lane < ntok;
    float sc = NQ_NEG_INF;
    if (mine) {
      const half2* q2 = reinterpret_cast<const half2*>(qh + h * D);
      const half2* k2 = reinterpret_cast<const half2*>(j == n - 1 ? kh : ks + lane * D);
      float d[kLaneChains];
#pragma unroll
      for (int ci = 0; ci < kLaneChains; ++ci) d[ci] = 0.f;
#pragma unroll 8 / kLaneChains
      for (int i0 = 0; i0 < D / 2; i0 += kLaneChains) {
#pragma unroll
        for (int ci = 0; ci < kLaneChains; ++ci) {   // pair i0 + ci into chain ci
          const int c2 = (i0 + ci + lane) & (D / 2 - 1);
          const float2 qf = __half22float2(q2[c2]), kf = __half22float2(k2[c2]);
          d[ci] = fmaf(qf.x, kf.x, d[ci]);
          d[ci] = fmaf(qf.y, kf.y, d[ci]);
        }
      }
      float dsum = d[0];
      if constexpr (kLaneChains == 4) dsum = (d[0] + d[1]) + (d[2] + d[3]);
      sc = dsum * rsqrtf((float)D);
    }
    float m = sc;
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float p = mine ? __expf(sc - m) : 0.f;
    float l = p;
    for (int o = 16; o >= 1; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
    if (kLanePvUnroll) {
#pragma unroll
      for (int t = 0; t < 32; ++t) {                   // no loop-carried branch: shuffles and loads run ahead
        const float pt = __shfl_sync(0xffffffffu, p, t);
        const int tt = min(t, ntok - 1);               // past the tokens: p = 0 times a real row
        const half* vr = (j0 + tt == n - 1 ? vh : vs + tt * D) + lane * E;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(pt, __half2float(vr[e]), acc[e]);
      }
    } else {
      for (int t = 0; t < ntok; ++t) {
        const float pt = __shfl_sync(0xffffffffu, p, t);
        const half* vr = (j0 + t == n - 1 ? vh : vs + t * D) + lane * E;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(pt, __half2float(vr[e]), acc[e]);
      }
    }
    if (splits == 1) {
      half* out = ptr<half>(c.tab, T_ATTN) + (g * GQA + h) * D + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) out[e] = __float2half_rn(acc[e] / l);
    } else {
      float* part = ptr<float>(c.tab, T_ATTN_WS) + ((size_t)(g * kAttnSplits + s) * GQA + h) * (D + 2);
#pragma unroll
      for (int e = 0; e < E; ++e) __stcg(part + lane * E + e, acc[e]);
      if (lane == 0) { __stcg(part + D, m); __stcg(part + D + 1, l); }
    }
    // [/pd-attn-lanes]
  }
  if (live && !lanes) {
    float q[GQA][E];
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
      for (int e = 0; e < E; ++e) q[h][e] = __half2float(qh[h * D + lane * E + e]);
    float m[GQA], l[GQA], acc[GQA][E];
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
      m[h] = NQ_NEG_INF; l[h] = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
    }
    const float scale = rsqrtf((float)D);
    auto consume = [&](const KvRow& r) {
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d = fmaf(q[h][e], r.k[e], d);
        for (int o = 16; o >= 1; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        const float sc = d * scale;
        const float mn = fmaxf(m[h], sc);
        const float alpha = __expf(m[h] - mn), p = __expf(sc - mn);
        l[h] = fmaf(l[h], alpha, p);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = fmaf(acc[h][e], alpha, p * r.v[e]);
        m[h] = mn;
      }
    };
#pragma unroll
    for (int i = 0; i < kAttnPre; ++i) {              // the rows loaded before the wait
      const int j = j0 + warp + i * kWarps;
      if (j < j1) {
        if (j == n - 1) load_kv<true>(pre[i], kh, vh, lane * E);   // this token's, roped above
        consume(pre[i]);
      }
    }
    for (int j = j0 + warp + kAttnPre * kWarps; j < j1; j += kWarps) {
      KvRow r;
      if (j == n - 1) load_kv<true>(r, kh, vh, lane * E);
      else load_kv(r, kc, vc, row_of(j));
      consume(r);
    }
    // The CTA's warps merge: (m, l, acc) per warp to shared memory; one weight per (warp, head).
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
      float* wp = wpart + (warp * GQA + h) * (D + 2);
#pragma unroll
      for (int e = 0; e < E; ++e) wp[lane * E + e] = acc[h][e];
      if (lane == 0) { wp[D] = m[h]; wp[D + 1] = l[h]; }
    }
  }
  if (!lanes) cta_sync();   // all threads: every warp's part is in shared memory
  probe(c, layer, 8);
  if (live && !lanes && warp < GQA) {                  // warp h: head h's weights over the warps
    const float M = merge_weights(wpart, kWarps, warp, wt, lsum);
    if (lane == 0) wpart[warp * (D + 2) + D] = M;        // warp 0's m slot <- the CTA's M (all lanes have read)
  }
  if (!lanes) cta_sync();   // all threads: weights known
  float* aws = ptr<float>(c.tab, T_ATTN_WS) + (size_t)(g * kAttnSplits + s) * GQA * (D + 2);
  half* attn = ptr<half>(c.tab, T_ATTN);
  if (live && !lanes) {
    for (int i = threadIdx.x; i < GQA * D; i += kThreads) {
      const int h = i / D, d = i % D;
      const float v = merged_acc(wpart, kWarps, h, d, wt);
      if (splits == 1) attn[(g * GQA + h) * D + d] = __float2half_rn(v / lsum[h]);
      else __stcg(aws + h * (D + 2) + d, v);
    }
    if (splits > 1 && threadIdx.x < GQA) {
      __stcg(aws + threadIdx.x * (D + 2) + D, wpart[threadIdx.x * (D + 2) + D]);
      __stcg(aws + threadIdx.x * (D + 2) + D + 1, lsum[threadIdx.x]);
    }
  }
  if (live && splits > 1 && kAttnMergeAll) {
    // [pd-merge-all] Every split of KV head g merges one slice of the head's GQA x D outputs
    // once all of the head's splits are stored: no split waits on a single merging one.
    unsigned* cnt = ptr<unsigned>(c.tab, T_ATTN_CNT) + layer * KVH + g;   // (zeroed at the launch's end)
    cta_sync();   // all threads: this split's (m, l, acc) are stored
    if (threadIdx.x == 0) { release_add(cnt, 1u); spin_until(c, cnt, (unsigned)splits); }
    cta_sync();   // all threads: every split of head g is stored and visible
    probe(c, layer, 9);
    const int o0 = s * (GQA * D) / splits, o1 = (s + 1) * (GQA * D) / splits, no = o1 - o0;   // this split's outputs
    const int h0 = o0 / D, nh = (o1 - 1) / D - h0 + 1;                                      // ... and their heads
    const float* base = ptr<const float>(c.tab, T_ATTN_WS) + (size_t)g * kAttnSplits * GQA * (D + 2);
    // Into shared memory, packed (independent loads: one L2 round trip): sml[split][head][m, l]
    // of the slice's heads, sacc[split][output] of its outputs.
    float* sml = wpart;
    float* sacc = wpart + kAttnSplits * GQA * 2;
    for (int i = threadIdx.x; i < splits * nh * 2; i += kThreads)
      sml[i] = __ldcg(base + ((i / (nh * 2)) * GQA + h0 + (i % (nh * 2)) / 2) * (D + 2) + D + (i & 1));
    for (int i = threadIdx.x; i < splits * no; i += kThreads) {
      const int o = o0 + i % no;
      sacc[i] = __ldcg(base + ((i / no) * GQA + o / D) * (D + 2) + o % D);
    }
    cta_sync();   // all threads: the slice of every split is staged
    if (warp < nh) merge_weights_ml(sml + warp * 2, nh * 2, splits, h0 + warp, wt, lsum);   // warp w: head h0 + w
    cta_sync();   // all threads: weights known
    for (int o = o0 + threadIdx.x; o < o1; o += kThreads)
      attn[(g * GQA + o / D) * D + o % D] = __float2half_rn(merged_acc_s(sacc + (o - o0), no, splits, o / D, wt) / lsum[o / D]);
    probe(c, layer, 10);
    // [/pd-merge-all]
  } else if (live && splits > 1) {
    __shared__ int last;
    cta_sync();   // all threads: this split's (m, l, acc) are stored
    if (threadIdx.x == 0) last = arrive_last(ptr<unsigned>(c.tab, T_ATTN_CNT) + g, splits);
    cta_sync();   // all threads: last known (and, in the last, the other splits visible)
    probe(c, layer, 9);
    if (last) {
      // Every split's (acc, m, l) into shared memory at once (independent coalesced loads: one
      // L2 round trip, not one per split), then the merge from there.
      const float* base = ptr<const float>(c.tab, T_ATTN_WS) + (size_t)g * kAttnSplits * GQA * (D + 2);
      cta_sync();   // the last CTA's threads: done with wpart above
      {   // 16-byte cp.async straight into shared memory (L2 only, no registers), then one wait
        const int total = splits * GQA * (D + 2), n4 = total / 4;
        for (int i = threadIdx.x; i < n4; i += kThreads)
          hopper::cp_async16(hopper::smem_u32(wpart + 4 * i), base + 4 * i, true);
        hopper::cp_async_commit();
        for (int i = 4 * n4 + threadIdx.x; i < total; i += kThreads) wpart[i] = __ldcg(base + i);
        hopper::cp_async_wait<0>();
      }
      cta_sync();   // the last CTA's threads: the splits are staged
      if (warp < GQA) merge_weights(wpart, splits, warp, wt, lsum);   // warp h: head h's weights over the splits
      cta_sync();   // the last CTA's threads: weights known
      for (int i = threadIdx.x; i < GQA * D; i += kThreads) {
        const int h = i / D, d = i % D;
        attn[(g * GQA + h) * D + d] = __float2half_rn(merged_acc(wpart, splits, h, d, wt) / lsum[h]);
      }
      if (threadIdx.x == 0) ptr<int>(c.tab, T_ATTN_CNT)[g] = 0;
      probe(c, layer, 10);
    }
  }
  signal_done(c, idx, layer, K_ATTN, c.grid);
  probe(c, layer, 11);
}
// [/pd-attention]

// ---- head: final norm, lm_head, argmax, bookkeeping ---------------------------------------
__device__ void head(Ctx& c, int idx, int num_layers, unsigned char* smem, float* red) {
  begin_instruction(c);
  const half* W = ptr<const half>(c.tab, T_LM_HEAD);
  const int r_begin = (int)((long long)blockIdx.x * V / c.grid), r_end = (int)((long long)(blockIdx.x + 1) * V / c.grid);
  if (threadIdx.x < 32) {
    const unsigned total = (unsigned)(r_end - r_begin) * H * 2u, cap = NQ_PD_PREFETCH_KB * 1024u;
    for (unsigned off = threadIdx.x * 16384u; off < min(total, cap); off += 32 * 16384u)
      prefetch_l2(reinterpret_cast<const unsigned char*>(W + (size_t)r_begin * H) + off, min(16384u, min(total, cap) - off) & ~15u);
  }
  wait_inputs(c);
  float* xs = reinterpret_cast<float*>(smem);
  const half* x = ptr<const half>(c.tab, T_X);
  const half* nw = ptr<const half>(c.tab, T_NORM);
  const float rinv = rms_inv(x, red, c.eps);
  for (int ch = threadIdx.x; ch < H / 8; ch += kThreads) {     // y = fp16(norm), staged as fp32
    const uint4 y = norm_chunk(x, nw, rinv, ch);
    const half* yh = reinterpret_cast<const half*>(&y);
#pragma unroll
    for (int i = 0; i < 8; ++i) xs[8 * ch + i] = __half2float(yh[i]);
  }
  cta_sync();   // all threads: xs complete
  const float4* xs4 = reinterpret_cast<const float4*>(xs);
  float* logits = ptr<float>(c.tab, T_LOGITS);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int chunks = H / 8;
  nq::ArgBest best{NQ_NEG_INF, V};
  for (int r0 = r_begin + warp * kLmRows; r0 < r_end; r0 += kWarps * kLmRows) {
    const uint4* rows[kLmRows];
#pragma unroll
    for (int r = 0; r < kLmRows; ++r) rows[r] = reinterpret_cast<const uint4*>(W + (size_t)min(r0 + r, r_end - 1) * H);
    float acc[kLmRows];
#pragma unroll
    for (int r = 0; r < kLmRows; ++r) acc[r] = 0.f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * kLmUnroll) {
      uint4 wv[kLmUnroll][kLmRows];
#pragma unroll
      for (int k = 0; k < kLmUnroll; ++k)
#pragma unroll
        for (int r = 0; r < kLmRows; ++r)
          if (c0 + 32 * k < chunks) wv[k][r] = nq::ldg_stream(rows[r] + c0 + 32 * k);
#pragma unroll
      for (int k = 0; k < kLmUnroll; ++k) {
        const int ch = c0 + 32 * k;
        if (ch < chunks) {
          const float4 xa = xs4[2 * ch], xb = xs4[2 * ch + 1];
#pragma unroll
          for (int r = 0; r < kLmRows; ++r) acc[r] = nq::dot8(acc[r], wv[k][r], xa, xb);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kLmRows; ++r) {
      for (int o = 16; o >= 1; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
      if (r0 + r < r_end) {
        if (lane == 0) logits[r0 + r] = acc[r];
        best.take(acc[r], r0 + r);
      }
    }
  }
  int* token = c.scalars + S_TOKEN * NQ_SCALAR_STRIDE;
  const bool wrote = nq::argmax_finish<kThreads, kLoader ? 1 : 0>(best, ptr<float>(c.tab, T_ARG_VAL), ptr<int>(c.tab, T_ARG_IDX),
                                                 ptr<unsigned>(c.tab, T_ARG_CNT), token);
  if (wrote && threadIdx.x == 0) {                 // engine_step.cu's nq_step_end
    int* s = c.scalars;
    const int p = s[S_POSITION * NQ_SCALAR_STRIDE];
    ptr<int>(c.tab, T_GENERATED)[p] = *token;
    s[S_POSITION * NQ_SCALAR_STRIDE] = p + 1;
  }
  signal_done(c, idx, num_layers, K_LM_HEAD, c.grid);
}
}  // namespace pd

// [pd-entry]
// tab: int64 [32 + 16 * num_layers] (persistent.py); layers [first_layer, last_layer) run;
// flags: F_BEGIN (bookkeeping + embed first), F_HEAD (lm_head + argmax + bookkeeping last);
// new_page: this position starts a page (pop one from the free list, as nq_step_begin);
// eps: the rmsnorm epsilon.
// grid: one CTA per SM (all resident: 1 CTA of kBlockThreads fits an SM by registers and shared
// memory, checked by the launcher); block kBlockThreads (kThreads, and the loader warp with
// NQ_PD_LOADER); dynamic shared memory pd::kSmemBytes.
extern "C" __global__ void __launch_bounds__(pd::kBlockThreads, 1)
nq_decode_persistent(const long long* __restrict__ tab, int first_layer, int last_layer, int num_layers,
                     int flags, int new_page, float eps) {
  using namespace pd;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red[kWarps];
  __shared__ float part[kWarps][kKmax][16];
  Ctx c;
  c.tab = tab;
  c.scalars = ptr<int>(tab, T_SCALARS);
  c.sync = ptr<unsigned>(tab, T_SYNC);
  c.grid = gridDim.x;
  c.eps = eps;
  c.lt = c.lt_next = nullptr;
  __shared__ int s_pages[pd::kPagesCached];
  c.n_ctx = -1;
  c.first_layer = first_layer;
  c.s_pages = s_pages;
  c.prev = -1;
  c.prev_target = 0;
  c.x_pending = false;
  c.tl = NQ_PD_TIMELINE ? ptr<long long>(tab, T_TIMELINE) + (size_t)blockIdx.x * (5 * num_layers + 3) * 4 : nullptr;
  c.tl_n = 0;
  c.t_begin = c.t_ready = 0;
  __shared__ __align__(8) uint64_t head_bar[kHead > 0 ? kWarps : 1];
  c.head_bar = head_bar;
  c.head_uses = 0;
  if constexpr (kHead > 0) {           // [pd-head]: one barrier a warp, one arrival (its lane 0) a phase
    if (threadIdx.x < kWarps) hopper::mbar_init(head_bar + threadIdx.x, 1);
    hopper::fence_mbarrier_init();
    cta_sync();   // all threads: the barriers are initialised
  }
  // [pd-loader]: a page's full barrier, one arrival (the loader lane's expect_tx) and the bytes
  // a phase; its empty barrier, one arrival (the consumer warp's lane 0)
  __shared__ __align__(8) uint64_t ld_full[kLoader ? kWarps * kLoaderSlots : 1];
  __shared__ __align__(8) uint64_t ld_empty[kLoader ? kWarps * kLoaderSlots : 1];
  c.ld_ring = smem + kLoaderOffset;
  c.ld_full = ld_full;
  c.ld_empty = ld_empty;
  c.ld_n = 0;
  if constexpr (kLoader) {
    for (int i = threadIdx.x; i < kWarps * kLoaderSlots; i += kBlockThreads) {
      hopper::mbar_init(ld_full + i, 1);
      hopper::mbar_init(ld_empty + i, 1);
    }
    hopper::fence_mbarrier_init();
    __syncthreads();   // every thread, the loader's too: the barriers are initialised
  }
  unsigned dyn;
  asm("mov.u32 %0, %dynamic_smem_size;" : "=r"(dyn));
  // Launched with too little shared memory, or with another grid than the one the plan and
  // the per-CTA buffers (argmax parts, timeline) were sized for (tab[T_GRID]): refuse, loudly.
  if (dyn < (unsigned)kSmemBytes || (long long)gridDim.x != tab[T_GRID]) {
    if (threadIdx.x == 0) atomicExch(c.scalars + S_ERROR * NQ_SCALAR_STRIDE, kErrLaunch);
    return;
  }
  const int kDone = 2 + 5 * num_layers;
  if (kLoader && threadIdx.x >= kThreads) {   // [pd-loader]: the loader warp walks the weights, and is done
    loader(c, first_layer, last_layer);
    return;
  }

  if (flags & F_BEGIN) {
    begin_instruction(c);
    if (blockIdx.x == 0) {
      __shared__ int tok;
      if (threadIdx.x == 0) {                         // engine_step.cu's nq_step_begin
        int* s = c.scalars;
        const int p = s[S_POSITION * NQ_SCALAR_STRIDE];
        const int page = p / NQ_PAGE_TOKENS;
        int* bt = ptr<int>(tab, T_BLOCK_TABLE);
        if (page >= (int)tab[T_MAX_PAGES]) {
          s[S_ERROR * NQ_SCALAR_STRIDE] = kErrMaxPages;
        } else {
          bool ok = true;
          if (new_page) {
            const int top = s[S_FREE_TOP * NQ_SCALAR_STRIDE] - 1;
            if (top < 0) { s[S_ERROR * NQ_SCALAR_STRIDE] = kErrNoPage; ok = false; }
            else { bt[page] = ptr<const int>(tab, T_FREE_PAGES)[top]; s[S_FREE_TOP * NQ_SCALAR_STRIDE] = top; }
          }
          if (ok) {
            s[S_SLOT * NQ_SCALAR_STRIDE] = bt[page] * NQ_PAGE_TOKENS + p % NQ_PAGE_TOKENS;
            s[S_CONTEXT * NQ_SCALAR_STRIDE] = p + 1;
          }
        }
        tok = s[S_TOKEN * NQ_SCALAR_STRIDE];
      }
      cta_sync();   // CTA 0: tok known
      const bool ok = tok >= 0 && tok < V;           // decode_ops.cu's nq_embed: a bad id -> NaN row
      const uint4* src = reinterpret_cast<const uint4*>(ptr<const half>(tab, T_EMBED) + (size_t)(ok ? tok : 0) * H);
      const uint4 nan4 = make_uint4(0x7E007E00u, 0x7E007E00u, 0x7E007E00u, 0x7E007E00u);
      for (int ch = threadIdx.x; ch < H / 8; ch += kThreads)
        reinterpret_cast<uint4*>(ptr<half>(tab, T_X))[ch] = ok ? __ldg(src + ch) : nan4;
    }
    signal_done(c, 0, 0, K_BEGIN, 1, blockIdx.x == 0);   // only CTA 0 did it: the target is 1
  }
  for (int l = first_layer; l < last_layer; ++l) {
    const long long* lt = tab + kLayerBase + kLayerStride * l;
    c.lt = lt;
    c.lt_next = l + 1 < last_layer ? lt + kLayerStride : nullptr;
    const int i0 = 1 + 5 * l;
    if (skipped(K_QKV)) skip_instruction(c, i0, l, K_QKV);
    else gemv<kQkv.N, kQkv.K, kQkv.TG, kQkv.KS, ST_NORM, EP_BIAS>(
        c, i0, l, K_QKV, ptr<const unsigned char>(lt, L_QKV), ptr<const half>(tab, T_X), ptr<const half>(lt, L_LN1),
        ptr<const half>(lt, L_QKV_BIAS), ptr<half>(tab, T_QKV), smem, red, part);
    if (skipped(K_ATTN)) skip_instruction(c, i0 + 1, l, K_ATTN);
    else attention(c, i0 + 1, l, lt, smem);
    if (skipped(K_O)) skip_instruction(c, i0 + 2, l, K_O);
    else gemv<kO.N, kO.K, kO.TG, kO.KS, ST_X, EP_RESIDUAL>(
        c, i0 + 2, l, K_O, ptr<const unsigned char>(lt, L_O), ptr<const half>(tab, T_ATTN), nullptr, nullptr,
        ptr<half>(tab, T_X), smem, red, part);
    if (skipped(K_GATE_UP)) skip_instruction(c, i0 + 3, l, K_GATE_UP);
    else gemv<kGateUp.N, kGateUp.K, kGateUp.TG, kGateUp.KS, ST_NORM, EP_PLAIN>(
        c, i0 + 3, l, K_GATE_UP, ptr<const unsigned char>(lt, L_GATE_UP), ptr<const half>(tab, T_X),
        ptr<const half>(lt, L_LN2), nullptr, ptr<half>(tab, T_GATE_UP), smem, red, part);
    if (skipped(K_DOWN)) skip_instruction(c, i0 + 4, l, K_DOWN);
    else gemv<kDown.N, kDown.K, kDown.TG, kDown.KS, ST_SWIGLU, EP_RESIDUAL, true>(
        c, i0 + 4, l, K_DOWN, ptr<const unsigned char>(lt, L_DOWN), ptr<const half>(tab, T_GATE_UP), nullptr,
        nullptr, ptr<half>(tab, T_X), smem, red, part);
  }
  if (flags & F_HEAD) head(c, 1 + 5 * num_layers, num_layers, smem, red);

  // The last CTA out resets every counter for the next launch: all CTAs have passed all
  // their waits once they arrive here.
  begin_instruction(c);
  cta_sync();   // all threads: this CTA is done
  __shared__ int last_out;   // ([pd-qkv-ll]: the last CTA's threads zero the tagged words)
  if (threadIdx.x == 0) {
    const bool last = arrive_last(c.sync + kDone, (unsigned)c.grid);
    if (kQkvLL) last_out = last;
    if (last) {
      for (int i = 0; i <= kDone; ++i) c.sync[i] = 0u;   // (the next launch sees them: kernel boundary)
      if (kAttnMergeAll)
        for (int i = 0; i < num_layers * KVH; ++i) ptr<unsigned>(tab, T_ATTN_CNT)[i] = 0u;
    }
#if NQ_PD_TIMELINE
    long long* row = c.tl + 4 * c.tl_n;
    row[0] = num_layers * 16 + K_END; row[1] = (long long)c.t_begin; row[2] = (long long)c.t_begin;
    row[3] = (long long)now_ns();
#endif
  }
  if constexpr (kQkvLL) {
    cta_sync();   // all threads: last_out known
    if (last_out)
      for (int i = threadIdx.x; i < QKV_DIM; i += kThreads) ptr<unsigned>(tab, T_QKV_TAG)[i] = 0u;
  }
}
// [/pd-entry]
