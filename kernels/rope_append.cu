// rope_append.cu: RoPE on q and k of one decode token, and the append of its k and v into
// their page slot of the paged KV cache (one launch per layer).
//
// Variants: one (rope_append_kv). Tuned for: batch 1, head_dim 64 or 128 (NQ_HEAD_DIM).
//
// Input qkv fp16 [q_dim + 2 kv_dim] is the fused qkv GEMV output (bias already added):
// q heads, then k heads, then v heads. position and slot are read from device memory so
// a captured CUDA graph replays unchanged for every token; slot = block_table[pos / 16] * 16
// + pos % 16 (nanoqwen_lib.model.kvcache.PageTable.slot_mapping).
//
// RoPE, Hugging Face rotate_half convention (halves, not interleaved pairs), FP32 inside:
//   angle_i = fp32(pos) * inv_freq[i],  inv_freq[i] = 1 / theta^(2i/d)   (i < d/2)
//   out[i]       = x[i] cos - x[i+d/2] sin
//   out[i+d/2]   = x[i+d/2] cos + x[i] sin          rounded once to fp16
// inv_freq is a device table computed on the host by the reference's formula
// (ops_attention.rope_inv_freq), so GPU and reference share its bits; cos/sin come from
// sincosf (full range reduction; not __sinf/__cosf, which lose accuracy past |x| ~ pi and
// angles here reach ~32768 rad). The products are not fused into FMAs (__fmul_rn), so
// the kernel computes the reference's expression exactly given the same cos/sin.
//
// Grid: num_heads + num_kv_heads blocks; block b < num_heads rotates q head b, block
// num_heads + g rotates k head g and copies v head g into the cache. Block: d/2 threads,
// thread i owns the pair (i, i + d/2).
#include "common.cuh"

#ifndef NQ_HEAD_DIM
#error "rope_append.cu needs the model dims (cuda_defines(dims))"
#endif

constexpr int HALF_DIM = NQ_HEAD_DIM / 2;

// Rotate the pair (x[i], x[i + d/2]) of one head by angle pos * inv_freq[i].
__device__ __forceinline__ void rope_pair(const half* x, half* out, int i, float pos, const float* inv_freq) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    const float x1 = __half2float(x[i]);
    const float x2 = __half2float(x[i + HALF_DIM]);
    out[i] = __float2half_rn(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    out[i + HALF_DIM] = __float2half_rn(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

extern "C" __global__ void __launch_bounds__(HALF_DIM)
rope_append_kv(const half* __restrict__ qkv,        // [q_dim + 2 kv_dim]
               const int32_t* __restrict__ position,  // [1] position of this token
               const int32_t* __restrict__ slot,      // [1] its slot in the page pool
               const float* __restrict__ inv_freq,    // [d/2]
               half* __restrict__ q_out,              // [num_heads * d]
               half* __restrict__ k_cache,            // this layer's K: [num_pages, kv_heads, 16, d]
               half* __restrict__ v_cache) {          // this layer's V: same shape
    constexpr int Q_DIM = NQ_NUM_HEADS * NQ_HEAD_DIM;
    constexpr int KV_DIM = NQ_NUM_KV_HEADS * NQ_HEAD_DIM;
    const int i = threadIdx.x;
    const float pos = (float)__ldg(position);
    if (blockIdx.x < NQ_NUM_HEADS) {
        const int h = blockIdx.x;
        rope_pair(qkv + h * NQ_HEAD_DIM, q_out + h * NQ_HEAD_DIM, i, pos, inv_freq);
        return;
    }
    const int g = blockIdx.x - NQ_NUM_HEADS;               // KV head
    const int s = __ldg(slot);
    const int page = s / NQ_PAGE_TOKENS, offset = s % NQ_PAGE_TOKENS;
    // Element (page, g, offset, :) of [num_pages, kv_heads, 16, d]; 64-bit: pools pass 2^31 elements.
    const long long row = ((long long)(page * NQ_NUM_KV_HEADS + g) * NQ_PAGE_TOKENS + offset) * NQ_HEAD_DIM;
    rope_pair(qkv + Q_DIM + g * NQ_HEAD_DIM, k_cache + row, i, pos, inv_freq);
    const half* v = qkv + Q_DIM + KV_DIM + g * NQ_HEAD_DIM;
    v_cache[row + i] = v[i];
    v_cache[row + i + HALF_DIM] = v[i + HALF_DIM];
}
