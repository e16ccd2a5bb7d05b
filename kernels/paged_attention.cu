// paged_attention.cu: decode attention (one token, batch 1) over the paged KV cache.
//
// The warp-specialized split-KV kernel + exact LSE combine. kernels/lab/paged_attention_buggy.cu
// keeps the original runtime's tail-page hand-off (see "THE BUG" below).
// Lines `// [attn-...]` mark the pieces book/06-paged-attention.md includes (comments only).
//
// Tuned for: head_dim 128 or 64, GQA ratio <= 8 (7 on Qwen2.5), 16-token pages, 3 stages.
// Degrades to: nothing else compiles (static_asserts); contexts shorter than max_splits
// pages run one page per CTA and leave the other CTAs empty (they exit at once).
//
// Work split. grid = (num_kv_heads, max_splits); CTA (g, s) owns KV head g and pages
// [s * pps, min((s+1) * pps, n_pages)) with pps = ceil(n_pages / max_splits), all read from
// device memory (context_len, block_table) so one captured graph serves every length. The
// gqa query heads of KV head g live in one CTA, so each K/V page is read from HBM once.
// Roles in a CTA of 5 warps:
//   warp 0      producer: lane 0 issues cp.async.bulk copies of the page's K and V slices
//               (one KV head, 16 x d fp16 = 4 KiB on the 7B) into a ring of NQ_ATTN_STAGES
//               stages; stage `full` barriers carry the byte counts (expect_tx).
//   warps 1..4  consumers: consumer warp w owns tokens 4w .. 4w+3 of every page and all gqa
//               heads: S = q.K^T (FP32), online softmax (log2 domain), O += P V (FP32).
//               At the end the 4 warps merge, and the CTA writes (m, l, acc) per head.
// A second kernel (paged_attention_combine) merges the splits exactly:
//   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s.
//
// Ring protocol, stage = i % STAGES, round = i / STAGES, parity = round & 1:
//   producer: wait empty[stage] (parity ^ 1: the first round passes at once), then
//             arrive.expect_tx(full[stage], 2 * rows * row_bytes) and the two bulk copies.
//   consumer: wait full[stage] (parity); compute; fence.proxy.async; arrive empty[stage].
// The tail page (context_len % 16 != 0) is copied like any other page, only its `rows`
// valid rows: expect_tx counts exactly those bytes. Stage rows at or past context_len hold
// stale data (maybe NaN bits): their scores are masked to -inf and their V rows skipped.
//
// THE BUG (kernels/lab/paged_attention_buggy.cu). The original runtime copied the tail page with ordinary
// loads by the producer's 32 lanes, arrived on full[stage] first ("no bytes in flight for
// this one") and then called __syncthreads() inside `if (warp == 0)` to "publish" the rows.
// A block-wide barrier reached by one warp of five is undefined behaviour on sm_70+: the
// consumer warps never reach bar 0, so it neither holds them back nor orders the stores
// before their loads. In practice the consumers, already released by the early arrive,
// read the tail stage while the producer's loads are still in flight (stale rows), and the
// producer warp sits in bar.sync until the consumer warps have exited. Length 49 (3 full
// pages + 1 token) shows it; multiples of 16 never take the path. Seen on an H200
// (tools/sanitize_attention.py): wrong in 16 of 16 fresh runs when the tail page is alone
// in its CTA (64 splits; max error 0.83), right in 16 of 16 with 1 or 2 splits, where the
// consumers reach the tail late enough that the stores have landed (the race hides); no
// hang. compute-sanitizer racecheck reports it (2 errors, 1024 hazards each: consumer
// reads vs the producer's tail stores); synccheck reports nothing on sm_90.
#include "hopper.cuh"   // common.cuh, and the mbarrier / bulk-copy wrappers
using namespace hopper;

#ifndef NQ_HEAD_DIM
#error "paged_attention.cu needs the model dims (cuda_defines(dims))"
#endif
#ifndef NQ_ATTN_CONSUMER_WARPS
#error "NQ_ATTN_CONSUMER_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_ATTN_MAX_SPLITS_COMBINE
#error "NQ_ATTN_MAX_SPLITS_COMBINE: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif

constexpr int HEAD_DIM = NQ_HEAD_DIM;
constexpr int GQA = NQ_NUM_HEADS / NQ_NUM_KV_HEADS;   // query heads per KV head (7)
constexpr int GQA_SLOTS = 8;                          // padded to 8 for the lane transpose
constexpr int STAGES = NQ_ATTN_STAGES;
constexpr int CONSUMER_WARPS = NQ_ATTN_CONSUMER_WARPS;
constexpr int CONSUMER_THREADS = 32 * CONSUMER_WARPS;
constexpr int THREADS = 32 + CONSUMER_THREADS;
constexpr int TOKENS_PER_WARP = NQ_PAGE_TOKENS / CONSUMER_WARPS;
constexpr int DPL = HEAD_DIM / 32;                    // dims per lane (4 or 2)
constexpr int ROW_BYTES = HEAD_DIM * 2;               // one token's K (or V) row, fp16
constexpr int TILE_ELEMS = NQ_PAGE_TOKENS * HEAD_DIM; // one stage's K (or V) tile
constexpr float LOG2E = 1.4426950408889634f;
constexpr float SCORE_SCALE = (HEAD_DIM == 128 ? 0.08838834764831845f : 0.125f) * LOG2E;  // log2(e)/sqrt(d)

static_assert(GQA >= 1 && GQA <= GQA_SLOTS, "one CTA holds at most 8 query heads per KV head");
static_assert(TOKENS_PER_WARP * GQA_SLOTS == 32, "the transpose-reduce gives each lane one (token, head)");
static_assert(HEAD_DIM % 32 == 0 && (DPL == 2 || DPL == 4), "a lane owns 2 or 4 dims");
static_assert(TILE_ELEMS * 2 == NQ_HEAD_SLICE_BYTES, "a stage tile is one KV head slice of a page");
static_assert(ROW_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");
static_assert(STAGES >= 2, "a ring needs two stages to overlap copy and compute");

// Every shared buffer of the CTA, by name. 39 KiB at d = 128 (20 KiB at 64): static shared memory.
// [attn-shared-storage]
struct __align__(128) SharedStorage {
    half k[STAGES][TILE_ELEMS];                     // stage ring: K tile [16 tokens][d]
    half v[STAGES][TILE_ELEMS];                     // stage ring: V tile [16 tokens][d]
    float part_acc[CONSUMER_WARPS][GQA][HEAD_DIM];  // per consumer warp: unnormalised O
    float part_m[CONSUMER_WARPS][GQA_SLOTS];        // per consumer warp: running max (log2 units)
    float part_l[CONSUMER_WARPS][GQA_SLOTS];        // per consumer warp: running sum of p
    float p[CONSUMER_WARPS][32];                    // per warp scratch: p of (token t, head h) at 8t + h
    float alpha[CONSUMER_WARPS][GQA_SLOTS];         // per warp scratch: rescale factor per head
    uint64_t full[STAGES];                          // producer -> consumers: stage holds its page
    uint64_t empty[STAGES];                         // consumers -> producer: stage may be refilled
};
// [attn-shared-storage-end]

// ---------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// Named barrier 1: the 128 consumer threads only (the producer never reaches it).
__device__ __forceinline__ void consumer_barrier() {
    asm volatile("bar.sync 1, %0;" :: "n"(CONSUMER_THREADS) : "memory");
}

// ---------------------------------------------------------------- small math
// DPL consecutive fp16 of a row -> float.
__device__ __forceinline__ void load_row(const half* p, float (&f)[DPL]) {
    if constexpr (DPL == 4) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        const float2 a = __half22float2(*reinterpret_cast<const half2*>(&raw.x));
        const float2 b = __half22float2(*reinterpret_cast<const half2*>(&raw.y));
        f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
    } else {
        const float2 a = __half22float2(*reinterpret_cast<const half2*>(p));
        f[0] = a.x; f[1] = a.y;
    }
}

// One butterfly step of the transpose-reduce: lanes l and l^O exchange halves of v so
// each keeps O values summed over the pair (the upper lane keeps indices j + O).
template <int O>
__device__ __forceinline__ void reduce_step(float (&v)[32], int lane) {
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int j = 0; j < O; ++j) {
        const float send = upper ? v[j] : v[j + O];
        const float keep = upper ? v[j + O] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}
// 32 partial sums per lane -> lane l returns the warp-wide sum of index l (31 shuffles).
__device__ __forceinline__ float transpose_reduce(float (&v)[32], int lane) {
    reduce_step<16>(v, lane); reduce_step<8>(v, lane); reduce_step<4>(v, lane);
    reduce_step<2>(v, lane); reduce_step<1>(v, lane);
    return v[0];
}

// ---------------------------------------------------------------- roles
// [attn-produce]
// Producer warp (all 32 lanes loop; lane 0 issues). Stage i % STAGES gets page first + i.
__device__ __forceinline__ void produce(SharedStorage& sm, const half* k_cache, const half* v_cache,
                                       const int32_t* block_table, int g, int first, int count,
                                       int ctx, int lane) {
    for (int i = 0; i < count; ++i) {
        const int stage = i % STAGES;
        const uint32_t parity = (i / STAGES) & 1;
        mbar_wait(&sm.empty[stage], parity ^ 1);          // the 4 consumer warps released it
        const int page = first + i;
        const int rows = min(NQ_PAGE_TOKENS, ctx - page * NQ_PAGE_TOKENS);
        // Slice (physical page, g) of [num_pages, kv_heads, 16, d]; 64-bit offsets.
        const long long src = ((long long)__ldg(block_table + page) * NQ_NUM_KV_HEADS + g) * TILE_ELEMS;
        if (lane == 0) {
            const uint32_t bytes = rows * ROW_BYTES;          // 16 rows, or the tail's valid rows
            mbar_arrive_expect_tx(&sm.full[stage], 2 * bytes); // K + V land on this phase
            bulk_copy_g2s(sm.k[stage], k_cache + src, bytes, &sm.full[stage]);
            bulk_copy_g2s(sm.v[stage], v_cache + src, bytes, &sm.full[stage]);
        }
    }
}
// [attn-produce-end]

// [attn-consume]
// Consumer warp cw (0..3): tokens 4cw .. 4cw+3 of each page, all GQA heads.
// Lane layout: lane owns dims [lane*DPL, lane*DPL + DPL) of q, K and V rows, and, after the
// transpose-reduce, the score of (token t = lane >> 3, head h = lane & 7).
__device__ __forceinline__ void consume(SharedStorage& sm, const half* q, int g, int first, int count,
                                        int ctx, int cw, int lane) {
    float qf[GQA][DPL];                                      // q pre-scaled by log2(e)/sqrt(d)
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
        load_row(q + (g * GQA + h) * HEAD_DIM + lane * DPL, qf[h]);
#pragma unroll
        for (int j = 0; j < DPL; ++j) qf[h][j] *= SCORE_SCALE;
    }
    float acc[GQA][DPL];
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
    float m_run = neg_inf(), l_run = 0.f;                    // of head lane & 7, this warp's tokens
    const int my_t = lane >> 3, my_h = lane & 7;

    for (int i = 0; i < count; ++i) {
        const int stage = i % STAGES;
        mbar_wait(&sm.full[stage], (i / STAGES) & 1);        // K and V of page first + i landed
        const int valid = min(NQ_PAGE_TOKENS, ctx - (first + i) * NQ_PAGE_TOKENS);
        const half* kt = sm.k[stage];
        const half* vt = sm.v[stage];

        // S = q . K^T for (t, h), partial over this lane's dims, at index 8t + h.
        float sv[32];
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; ++t) {
            float kf[DPL];
            load_row(kt + (cw * TOKENS_PER_WARP + t) * HEAD_DIM + lane * DPL, kf);
#pragma unroll
            for (int h = 0; h < GQA_SLOTS; ++h) {
                float s = 0.f;
                if (h < GQA) {
#pragma unroll
                    for (int j = 0; j < DPL; ++j) s = fmaf(qf[h < GQA ? h : 0][j], kf[j], s);
                }
                sv[t * GQA_SLOTS + h] = s;
            }
        }
        float s = transpose_reduce(sv, lane);                // score of (my_t, my_h), log2 units
        const bool live = my_h < GQA && cw * TOKENS_PER_WARP + my_t < valid;
        s = live ? s : neg_inf();                            // rows past the context: masked

        // [attn-consume-softmax]
        // Online softmax over this warp's tokens; lanes h, h+8, h+16, h+24 share head h.
        float m_tile = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, 8));
        m_tile = fmaxf(m_tile, __shfl_xor_sync(0xffffffffu, m_tile, 16));
        const float m_new = fmaxf(m_run, m_tile);
        const float m_use = m_new == neg_inf() ? 0.f : m_new; // nothing live yet: keep p = alpha = 0
        const float p = exp2f(s - m_use);
        const float alpha = exp2f(m_run - m_use);
        float p_sum = p + __shfl_xor_sync(0xffffffffu, p, 8);
        p_sum += __shfl_xor_sync(0xffffffffu, p_sum, 16);
        l_run = l_run * alpha + p_sum;
        m_run = m_new;
        sm.p[cw][lane] = p;
        if (lane < GQA_SLOTS) sm.alpha[cw][lane] = alpha;
        __syncwarp();                                        // this warp's 32 lanes: p, alpha written

        // [attn-consume-pv]
        // O = alpha O + P V over the live rows (stale rows may hold NaN: never multiplied).
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
            const float a = sm.alpha[cw][h];
#pragma unroll
            for (int j = 0; j < DPL; ++j) acc[h][j] *= a;
        }
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; ++t) {
            const int row = cw * TOKENS_PER_WARP + t;
            if (row < valid) {                               // warp-uniform
                float vf[DPL];
                load_row(vt + row * HEAD_DIM + lane * DPL, vf);
#pragma unroll
                for (int h = 0; h < GQA; ++h) {
                    const float ph = sm.p[cw][t * GQA_SLOTS + h];
#pragma unroll
                    for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(ph, vf[j], acc[h][j]);
                }
            }
        }
        fence_proxy_async_smem();                            // our reads of the stage precede its refill
        __syncwarp();                                        // this warp's 32 lanes: done with stage, p, alpha
        if (lane == 0) mbar_arrive(&sm.empty[stage]);        // one of the 4 arrivals empty[stage] expects
    }

    // This warp's partial -> shared memory, for the merge of the 4 consumer warps.
    if (lane < GQA) { sm.part_m[cw][lane] = m_run; sm.part_l[cw][lane] = l_run; }  // lane = (t 0, h lane)
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) sm.part_acc[cw][h][lane * DPL + j] = acc[h][j];
}
// [attn-consume-end]

// [attn-merge]
// The 128 consumer threads merge the 4 warps' (m, l, acc) into the CTA's partial for split s.
// M is finite: consumer warp 0 owns row 0 of every page, and row 0 of a page always holds a token.
__device__ __forceinline__ void merge_and_store(const SharedStorage& sm, int g, int split, int ct,
                                                float* ws_m, float* ws_l, float* ws_acc) {
    for (int idx = ct; idx < GQA * HEAD_DIM; idx += CONSUMER_THREADS) {
        const int h = idx / HEAD_DIM, j = idx % HEAD_DIM;
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) M = fmaxf(M, sm.part_m[w][h]);
        float a = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) {
            const float scale = exp2f(sm.part_m[w][h] - M);  // 0 for a warp that saw no token
            a = fmaf(scale, sm.part_acc[w][h][j], a);
            l = fmaf(scale, sm.part_l[w][h], l);
        }
        const int head = g * GQA + h;
        const long long row = (long long)split * NQ_NUM_HEADS + head;
        ws_acc[row * HEAD_DIM + j] = a;
        if (j == 0) { ws_m[row] = M; ws_l[row] = l; }
    }
}
// [attn-merge-end]

// [attn-split-kernel]
// Pages per split, and how many splits hold pages: the one rule both kernels use.
__device__ __forceinline__ int pages_per_split(int n_pages, int max_splits) {
    return (n_pages + max_splits - 1) / max_splits;
}

extern "C" __global__ void __launch_bounds__(THREADS)
paged_attention_split(const half* __restrict__ q,             // [num_heads * d], RoPE applied
                      const half* __restrict__ k_cache,       // layer K [num_pages, kv_heads, 16, d]
                      const half* __restrict__ v_cache,       // layer V, same shape
                      const int32_t* __restrict__ block_table,  // [max_pages] logical -> physical
                      const int32_t* __restrict__ context_len,  // [1] tokens to attend to (>= 1)
                      float* __restrict__ ws_m,               // [max_splits, num_heads]
                      float* __restrict__ ws_l,               // [max_splits, num_heads]
                      float* __restrict__ ws_acc,             // [max_splits, num_heads, d]
                      int max_splits) {
    __shared__ SharedStorage sm;
    const int g = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ctx = __ldg(context_len);
    const int n_pages = ctx > 0 ? (ctx + NQ_PAGE_TOKENS - 1) / NQ_PAGE_TOKENS : 0;
    const int pps = pages_per_split(n_pages, max_splits);
    const int first = split * pps;
    const int count = min(pps, n_pages - first);
    if (count <= 0) return;                                  // whole CTA: no pages, no barrier touched

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.full[s], 1);                       // the producer's arrive(.expect_tx)
            mbar_init(&sm.empty[s], CONSUMER_WARPS);         // lane 0 of each consumer warp
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // all 160 threads, before the role split: barriers initialised

    if (warp == 0) {
        produce(sm, k_cache, v_cache, block_table, g, first, count, ctx, lane);
    } else {
        consume(sm, q, g, first, count, ctx, warp - 1, lane);
        consumer_barrier();                                  // the 128 consumer threads: partials written
        merge_and_store(sm, g, split, threadIdx.x - 32, ws_m, ws_l, ws_acc);
    }
}
// [attn-split-kernel-end]

// [attn-combine]
// Combine: block per query head, thread per dim. Version 1 walked the splits serially in
// every thread (two dependent L2 loads per split: ~0.2 us each, 10+ us at 64 splits); here
// the threads stage m_s and 2^(m_s - M) in shared memory in parallel, and each thread's
// accumulator loads are independent (unrolled) so several are in flight.
constexpr int COMBINE_WARPS = HEAD_DIM / 32;
constexpr int MAX_SPLITS_COMBINE = NQ_ATTN_MAX_SPLITS_COMBINE;   // ops_attention.AttentionWorkspace checks

// Reduce v over the block (max or sum); every thread gets the result. `red` is this
// reduction's own buffer, so two reductions need no barrier between them.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();  // all HEAD_DIM threads of the combine block: red[] (and earlier smem writes) visible
    float r = red[0];
#pragma unroll
    for (int w = 1; w < COMBINE_WARPS; ++w) r = MAX ? fmaxf(r, red[w]) : r + red[w];
    return r;
}

extern "C" __global__ void __launch_bounds__(HEAD_DIM)
paged_attention_combine(const float* __restrict__ ws_m, const float* __restrict__ ws_l,
                        const float* __restrict__ ws_acc, const int32_t* __restrict__ context_len,
                        half* __restrict__ out,               // [num_heads * d]
                        int max_splits) {
    __shared__ float scale[MAX_SPLITS_COMBINE];           // m_s, then 2^(m_s - M)
    __shared__ float red_max[COMBINE_WARPS], red_sum[COMBINE_WARPS];
    const int head = blockIdx.x, j = threadIdx.x;
    const int ctx = __ldg(context_len);
    const int n_pages = ctx > 0 ? (ctx + NQ_PAGE_TOKENS - 1) / NQ_PAGE_TOKENS : 0;
    if (n_pages == 0) { out[head * HEAD_DIM + j] = __float2half_rn(0.f); return; }  // whole block
    const int pps = pages_per_split(n_pages, max_splits);
    const int used = (n_pages + pps - 1) / pps;              // splits s < used hold pages; the rest exited
    float M = neg_inf();
    for (int s = j; s < used; s += HEAD_DIM) {               // thread j stages splits j, j + d, ...
        const float m = ws_m[s * NQ_NUM_HEADS + head];
        scale[s] = m;
        M = fmaxf(M, m);
    }
    M = block_reduce<true>(M, red_max);
    float L = 0.f;
    for (int s = j; s < used; s += HEAD_DIM) {               // same s as above: this thread's own entries
        const float sc = exp2f(scale[s] - M);
        scale[s] = sc;
        L = fmaf(sc, ws_l[s * NQ_NUM_HEADS + head], L);
    }
    L = block_reduce<false>(L, red_sum);                     // its barrier also publishes scale[]
    float a = 0.f;
#pragma unroll 8
    for (int s = 0; s < used; ++s)
        a = fmaf(scale[s], ws_acc[((long long)s * NQ_NUM_HEADS + head) * HEAD_DIM + j], a);
    out[head * HEAD_DIM + j] = __float2half_rn(a / L);
}
// [attn-combine-end]
