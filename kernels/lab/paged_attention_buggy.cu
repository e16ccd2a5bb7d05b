// lab/paged_attention_buggy.cu: the paged attention with the original runtime's tail-page
// hand-off, a deliberate bug kept for book/06-paged-attention.md and tools/sanitize_attention.py.
//   paged_attention_split_buggy  the split kernel; its producer copies a tail page (context_len
//                                % 16 != 0) with plain loads, arrives on full[stage] first and
//                                then calls __syncthreads() inside `if (warp == 0)`: undefined
//                                behaviour on sm_70+ (see THE BUG in paged_attention.cu)
// The combine and the other roles are the engine's (included below).
#include "paged_attention.cu"

// The engine's producer (paged_attention.cu [attn-produce]) with the original tail-page path.
__device__ __forceinline__ void produce_buggy(SharedStorage& sm, const half* k_cache, const half* v_cache,
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
        // [attn-buggy-tail]
        if (rows < NQ_PAGE_TOKENS) {                        // the original tail-page path
            if (lane == 0) mbar_arrive(&sm.full[stage]);    // phase completes now: no bytes expected
            const int4* ks = reinterpret_cast<const int4*>(k_cache + src);
            const int4* vs = reinterpret_cast<const int4*>(v_cache + src);
            int4* kd = reinterpret_cast<int4*>(sm.k[stage]);
            int4* vd = reinterpret_cast<int4*>(sm.v[stage]);
            for (int j = lane; j < rows * ROW_BYTES / 16; j += 32) { kd[j] = ks[j]; vd[j] = vs[j]; }
            __syncthreads();  // BUG: reached by warp 0 only; meant to publish the rows. Wrong on sm_70+.
            continue;
        }
        // [attn-buggy-tail-end]
        if (lane == 0) {
            const uint32_t bytes = rows * ROW_BYTES;          // 16 rows, or the tail's valid rows
            mbar_arrive_expect_tx(&sm.full[stage], 2 * bytes); // K + V land on this phase
            bulk_copy_g2s(sm.k[stage], k_cache + src, bytes, &sm.full[stage]);
            bulk_copy_g2s(sm.v[stage], v_cache + src, bytes, &sm.full[stage]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
paged_attention_split_buggy(const half* __restrict__ q,             // [num_heads * d], RoPE applied
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
        produce_buggy(sm, k_cache, v_cache, block_table, g, first, count, ctx, lane);
    } else {
        consume(sm, q, g, first, count, ctx, warp - 1, lane);
        consumer_barrier();                                  // the 128 consumer threads: partials written
        merge_and_store(sm, g, split, threadIdx.x - 32, ws_m, ws_l, ws_acc);
    }
}
