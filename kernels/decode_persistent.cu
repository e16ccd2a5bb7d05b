// decode_persistent.cu: one decode token (batch 1) as one kernel. One CTA per SM stays
// resident for the whole token and walks the same list of instructions as every other CTA;
// an instruction's inputs are ready when a counter in device memory says so.
//
//   nq_decode_persistent   bookkeeping + embed, num_layers x [qkv, attention, o_proj,
//                          gate_up, down], lm_head + argmax + bookkeeping
//
// This file is the interpreter: the entry below walks the schedule and calls one function per
// instruction. Each piece lives in kernels/decode/, a header each: config.cuh (the knobs as the
// typed constant pd::kCfg, generated from nanoqwen_lib/gpu/decode_knobs.py), layout.cuh (shapes,
// splits, shared memory), sched.cuh (wait and signal, the timeline), rows.cuh (norms, folds),
// units.cuh (a GEMV's units, prefetches), loader.cuh ([pd-loader], lab), and one per
// instruction: gemv.cuh, attention.cuh, lm_head.cuh. The host <-> device contract (pointer
// table, kinds, flags, scalars, error codes) is decode_contract.cuh, generated too.
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
//            ([pd-down-slices], lab: waiting only for the gate_up units that wrote its slice)
//   lm_head  rmsnorm(x), its 1/grid of the FP16 vocabulary rows -> logits; argmax merged by
//            the last CTA (argmax.cuh), which also writes generated[position] and moves position
// Each instruction waits for the whole previous one: counter sync[i] counts the CTAs done
// with instruction i (release by thread 0 after a CTA barrier, acquire by thread 0, then a
// CTA barrier: [pd-fence]); activations written
// inside the kernel are read with ld.global.cg (L2: never a stale L1 line).
// [/pd-schedule]
//
// Never hangs: a wait that exceeds NQ_PD_TIMEOUT_MS sets scalars[error] = 3 (kErrTimeout) and gives up
// (every later wait of the launch then returns at once); the engine raises on it.
// NQ_PD_TIMELINE=1 (diagnostic build): each CTA records (code, t_begin, t_ready, t_end) of
// every instruction in %globaltimer ns; code = layer * 16 + kind
// (nanoqwen_lib/measure/timeline.py KINDS).
// nq-variants: NQ_PD_TIMELINE=1; NQ_PD_FOLD=0; NQ_PD_RING=2; NQ_PD_PROBE=3; NQ_PD_SMEM_RING=1,NQ_PD_RING=8; NQ_PD_FENCE=0; NQ_PD_FENCE=1; NQ_PD_SMEM_PAD_KB=128; NQ_PD_ATTN_PRE=6,NQ_PD_ATTN_SPLITS=8; NQ_PD_ATTN_MERGE=0,NQ_PD_ATTN_LANES=0,NQ_PD_NORM_1PASS=0,NQ_PD_ATTN_SPLITS=16,NQ_PD_ATTN_MIN_TOKENS=32; NQ_PD_SELF_PREFETCH=16; NQ_PD_ATTN_LANES=0; NQ_PD_ATTN_LANES=2; NQ_PD_ATTN_LANES=3; NQ_PD_DOWN_DEFER=1; NQ_PD_DOWN_SLICES=1; NQ_PD_DOWN_SLICES=1,NQ_PD_WARPS=15,NQ_PD_LOADER=5,NQ_PD_LOADER_PAGE=2; NQ_PD_QKV_PREFETCH=3,NQ_PD_LATE_RING=32; NQ_PD_QKV_LL=1; NQ_PD_SKIP=14; NQ_PD_HEAD_BLOCKS=4; NQ_PD_WARPS=15,NQ_PD_LOADER=5,NQ_PD_LOADER_PAGE=2,NQ_PD_LOADER_L2=1; NQ_PD_LOADER=4,NQ_PD_LOADER_PAGE=2,NQ_PD_LOADER_SELF=1; NQ_PD_O_MERGE=1; NQ_PD_O_MERGE=1,NQ_PD_DOWN_DEFER=1,NQ_PD_WARPS=15,NQ_PD_LOADER=5,NQ_PD_LOADER_PAGE=2; NQ_PD_WARPS=15,NQ_PD_LOADER=5,NQ_PD_LOADER_PAGE=2,NQ_PD_LOADER_OWN=10; NQ_PD_LOADER=4,NQ_PD_LOADER_PAGE=2,NQ_PD_LOADER_SELF=1,NQ_PD_LOADER_OWN=10
#ifndef NQ_HEAD_DIM
#error "decode_persistent.cu needs the model dims (cuda_defines(dims))"
#endif
#include "stream3.cuh"   // layout 3; gemv_int4.cuh (silu_mul); hopper.cuh; common.cuh
#include "argmax.cuh"
#include "rowops.cuh"   // sumsq8, rmsnorm8, dot8: the kernel-per-op kernels' arithmetic
#include "decode_contract.cuh"   // the pointer table (enum Tab, LayerTab), Kind, Flags, S_*, kErr*:
                                 // generated from nanoqwen_lib/gpu/decode_contract.py
// The step's pieces, in kernels/decode/ (each header includes what it builds on):
#include "decode/config.cuh"      // pd::kCfg, the knobs (generated from gpu/decode_knobs.py)
#include "decode/layout.cuh"      // shapes, splits, shared memory
#include "decode/sched.cuh"       // barriers, counters, timeline: wait_inputs / signal_done
#include "decode/rows.cuh"        // block_sum, rmsnorm, folds
#include "decode/units.cuh"       // a GEMV's units and blocks, L2 prefetches
#include "decode/loader.cuh"      // [pd-loader] (lab)
#include "decode/gemv.cuh"        // the GEMV instruction
#include "decode/attention.cuh"   // the attention instruction
#include "decode/lm_head.cuh"     // the head instruction

// What the host must launch this build with, as the build computes it: the dynamic shared
// memory and the block. Read from the CUBIN on the CPU (cuda_build.elf_constant), where a test
// holds gpu.persistent's smem_bytes and threads to them for every build it compiles.
extern "C" __device__ const int nq_pd_smem_bytes = pd::kSmemBytes;
extern "C" __device__ const int nq_pd_block_threads = pd::kBlockThreads;
// [pd-down-slices]: how many gate_up units write each K slice of down (a CPU test counts them too).
extern "C" __device__ const pd::SliceTargets nq_pd_slice_targets = pd::slice_targets();

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
  c.tl = kCfg.timeline ? ptr<long long>(tab, T_TIMELINE) + (size_t)blockIdx.x * (5 * num_layers + 3) * 4 : nullptr;
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
  __shared__ __align__(8) uint64_t ld_empty[kLoaderWarp ? kWarps * kLoaderSlots : 1];
  c.ld_ring = smem + kLoaderOffset;
  c.ld_full = ld_full;
  c.ld_empty = ld_empty;
  c.ld_n = 0;
  __shared__ Cursor ld_cur[kLoaderSelf ? kWarps : 1];   // [pd-loader-self]: each consumer warp's place
  c.ld_cur = ld_cur;
  c.ld_k_end = 4 * (last_layer - first_layer);
  if constexpr (kLoader) {
    for (int i = threadIdx.x; i < kWarps * kLoaderSlots; i += kBlockThreads) {
      hopper::mbar_init(ld_full + i, 1);
      if (kLoaderWarp) hopper::mbar_init(ld_empty + i, 1);
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
  if (kLoaderWarp && threadIdx.x >= kThreads) {   // [pd-loader]: the loader warp walks the weights, and is done
    loader(c, first_layer, last_layer);
    return;
  }
  if (kLoaderSelf && (threadIdx.x & 31) == 0) self_start(c, threadIdx.x >> 5);   // [pd-loader-self]

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
    else gemv<kO.N, kO.K, kO.TG, kO.KS, kOMerge ? ST_MERGE : ST_X, EP_RESIDUAL>(
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
      if (kAttnMergeAll || kOMerge)
        for (int i = 0; i < num_layers * KVH; ++i) ptr<unsigned>(tab, T_ATTN_CNT)[i] = 0u;
      if (kDownSlices)                                   // [pd-down-slices]
        for (int i = 0; i < num_layers * kDown.KS; ++i) ptr<unsigned>(tab, T_SLICE_CNT)[i] = 0u;
    }
    if constexpr (kCfg.timeline) {
      long long* row = c.tl + 4 * c.tl_n;
      row[0] = num_layers * 16 + K_END; row[1] = (long long)c.t_begin; row[2] = (long long)c.t_begin;
      row[3] = (long long)now_ns();
    }
  }
  if constexpr (kQkvLL) {
    cta_sync();   // all threads: last_out known
    if (last_out)
      for (int i = threadIdx.x; i < QKV_DIM; i += kThreads) ptr<unsigned>(tab, T_QKV_TAG)[i] = 0u;
  }
}
// [/pd-entry]
