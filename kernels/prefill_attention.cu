// prefill_attention.cu: RoPE + KV-cache write, and causal flash attention, for a prompt.
//   nq_prefill_rope_write_kv  qkv fp16 [T, qkv_dim] -> q_rot fp16 [T, heads, d]; rope(k), v into their
//                             page slots of the paged cache (positions start_pos .. start_pos+T-1)
//   nq_prefill_attention      out fp16 [T, heads*d] = softmax(q k^T / sqrt(d) + causal mask) v, K and V
//                             read from the paged cache (GQA: head h reads KV head h / (heads/kv_heads))
// (no extra-define variants: d = 64 / 128 come from the model dims)
//
// Tuned for the 7B at T = 512 (28 heads, 4 KV heads, d = 128) on an H200; d = 64 builds too.
//
// RoPE (the numerics contract, item 3; the same arithmetic as rope_append.cu so prefill and
// decode write identical cache bits): angle = fp32(pos) * inv_freq[i], inv_freq the host
// table of ops_attention.rope_inv_freq; sincosf (full range reduction); products and the sum
// rounded separately (__fmul_rn, __fsub_rn: no FMA contraction), then once to fp16.
//
// Attention (FlashAttention-2 style, mma.sync m16n8k16, FP32 softmax). A CTA owns one query
// head and a tile of 64 queries; 4 warps own 16 query rows each. The CTA walks
// the KV tiles of 64 keys that its queries can see (causal: keys <= the query's position),
// double-buffered in shared memory by cp.async. Per tile, per warp:
//   S = Q K^T                        (fp32 accumulators, 16 x 64)
//   m_new = max(m, rowmax(S) * c)    c = log2(e) / sqrt(d): softmax in base 2, FP32
//   P = exp2(S * c - m_new)          rounded to fp16 only as the tensor-core operand
//   l = l * exp2(m - m_new) + rowsum(P);  O = O * exp2(m - m_new) + P V
// and at the end out = fp16(O / l). The fp16 P adds a relative error <= 2^-11 per weight to
// the output, i.e. at most 2^-11 * sum_j p_j |v_j| / l (the test's bound).
// Shared-memory rows are d halves; 16-byte chunk c of row r is stored at chunk c ^ (r & 7),
// so the 8 row addresses of every ldmatrix hit 8 different bank groups.
//
// What it degrades to: queries beyond T are computed and not stored; keys beyond the context
// are zero-filled (never read from the cache: a page's unused rows may hold anything) and
// masked to -inf.
#include "hopper.cuh"   // common.cuh, smem_u32, the mma.sync wrapper

#ifndef NQ_HEAD_DIM
#error "prefill_attention.cu needs the model dims (cuda_defines(dims))"
#endif

#ifndef NQ_PA_BQ
#error "NQ_PA_BQ: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PA_WARPS
#error "NQ_PA_WARPS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_PA_ROPE_THREADS
#error "NQ_PA_ROPE_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif

namespace pa {

constexpr int D = NQ_HEAD_DIM;
constexpr int HALF_D = D / 2;
constexpr int BQ = NQ_PA_BQ;                   // queries per CTA
constexpr int BKV = 64;                        // keys per tile
constexpr int WARPS = NQ_PA_WARPS;             // 16 query rows each
constexpr int THREADS = 32 * WARPS;
constexpr int CHUNKS = D / 8;                  // 16-byte chunks per row
constexpr int TILE = BKV * D;                  // halves in one K (or V) tile
constexpr int PAGE = NQ_PAGE_TOKENS;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float SCORE_SCALE = (D == 128 ? 0.08838834764831845f : 0.125f) * LOG2E;   // log2(e) / sqrt(d)
static_assert(CHUNKS >= 8, "the XOR swizzle needs at least 8 chunks per row");
static_assert(BKV % PAGE == 0, "a KV tile is whole pages");
static_assert((BQ * CHUNKS) % THREADS == 0, "every thread copies the same number of chunks");

// Every shared buffer of the CTA (dynamic shared memory, 80 KiB at d = 128).
struct Shared {
  half q[BQ * D];            // Q tile [64 queries][d], swizzled
  half k[2][TILE];           // K tiles [64 keys][d], double buffer, swizzled
  half v[2][TILE];           // V tiles, same
};

using hopper::smem_u32;
// Halves offset of chunk c of row r (swizzled).
__device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

// 16 bytes global -> shared at a shared pointer, zero-filled when !valid (hopper.cuh's cp.async).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  hopper::cp_async16(smem_u32(dst), src, valid);
}
using hopper::cp_async_commit;
using hopper::cp_async_wait;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}
using hopper::mma_16816;   // D += A.B, m16n8k16, fp16 in, fp32 accumulate (hopper.cuh)
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

struct Args {
  const half* q;             // [T, heads, d]
  const half* k_pool;        // this layer's K [num_pages, kv_heads, 16, d]
  const half* v_pool;        // this layer's V, same
  const int32_t* block_table;// [>= ceil(ctx/16)] logical page -> physical page
  half* out;                 // [T, heads * d]
  int T, start_pos, heads, kv_heads;
};

// Q tile rows q0 .. q0+63 of head h (rows >= T zero-filled).
__device__ __forceinline__ void load_q(const Args& a, Shared& sm, int q0, int h) {
#pragma unroll
  for (int i = 0; i < BQ * CHUNKS / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS, r = c / CHUNKS, ch = c % CHUNKS;
    const bool ok = q0 + r < a.T;
    const half* src = a.q + ((size_t)(ok ? q0 + r : 0) * a.heads + h) * D + ch * 8;
    cp_async16(&sm.q[swz(r, ch)], src, ok);
  }
}

// K and V rows of keys j0 .. j0+63 from their pages (keys >= ctx zero-filled, never read).
__device__ __forceinline__ void load_kv(const Args& a, Shared& sm, int buf, int j0, int kvh, int ctx) {
#pragma unroll
  for (int i = 0; i < BKV * CHUNKS / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS, r = c / CHUNKS, ch = c % CHUNKS;
    const int key = j0 + r;
    const bool ok = key < ctx;
    const int page = ok ? __ldg(&a.block_table[key / PAGE]) : 0;
    const size_t row = (((size_t)page * a.kv_heads + kvh) * PAGE + (ok ? key % PAGE : 0)) * D + ch * 8;
    cp_async16(&sm.k[buf][swz(r, ch)], a.k_pool + row, ok);
    cp_async16(&sm.v[buf][swz(r, ch)], a.v_pool + row, ok);
  }
}

// Sum (or max) over the 4 lanes of a quad (the lanes that share an accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Grid (ceil(T/64), heads): blockIdx.x = 0 takes the LAST query tile (the longest row of
// work) so the long CTAs start first. Block: 128 threads.
__device__ __forceinline__ void attention_body(const Args& a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Shared& sm = *reinterpret_cast<Shared*>(smem_raw);
  const int nq_tiles = (a.T + BQ - 1) / BQ;
  const int q0 = (nq_tiles - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, kvh = h / (a.heads / a.kv_heads);
  const int ctx = a.start_pos + a.T;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Keys this tile's queries may see: 0 .. start_pos + min(q0 + 63, T - 1).
  const int last_key = a.start_pos + min(q0 + BQ, a.T) - 1;
  const int n_tiles = last_key / BKV + 1;
  const float c = SCORE_SCALE;

  load_q(a, sm, q0, h);
  cp_async_commit();
  load_kv(a, sm, 0, 0, kvh, ctx);
  cp_async_commit();
  cp_async_wait<1>();                          // Q landed (this thread's part)
  __syncthreads();                             // all 128 threads: the whole Q tile landed

  // Q fragments of this warp's 16 rows, all d/16 k-steps: a0 rows 0-7 / a1 rows 8-15 of
  // chunk 2ks, a2 / a3 of chunk 2ks+1 (ldmatrix matrix i <- lanes 8i..8i+7).
  uint32_t qf[D / 16][4];
  {
    const int mi = lane >> 3, r = warp * 16 + (mi & 1) * 8 + (lane & 7);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(qf[ks], &sm.q[swz(r, 2 * ks + (mi >> 1))]);
  }

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};   // rows g, g+8 (log2 units)
  const int qpos0 = a.start_pos + q0 + warp * 16 + g;                  // position of row g

  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_tiles) load_kv(a, sm, buf ^ 1, (j + 1) * BKV, kvh, ctx);
    cp_async_commit();
    cp_async_wait<1>();                        // tile j landed (this thread's part)
    __syncthreads();                           // all 128 threads: tile j visible

    // S = Q K^T: 8 n-tiles of 8 keys. ldmatrix matrices: keys 16p + (mi>>1)*8 .., chunk 2ks + (mi&1)
    // -> b0, b1 of n-tile 2p and b0, b1 of n-tile 2p+1.
    float s[BKV / 8][4];
#pragma unroll
    for (int n = 0; n < BKV / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    {
      const int mi = lane >> 3;
#pragma unroll
      for (int p = 0; p < BKV / 16; ++p) {
        const int r = 16 * p + (mi >> 1) * 8 + (lane & 7);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t b[4];
          ldmatrix_x4(b, &sm.k[buf][swz(r, 2 * ks + (mi & 1))]);
          mma_16816(s[2 * p], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b[0], b[1]);
          mma_16816(s[2 * p + 1], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b[2], b[3]);
        }
      }
    }

    // Scale to log2 units; mask keys after the query's position (and beyond the context).
    const int j0 = j * BKV;
    const bool needs_mask = j0 + BKV - 1 > a.start_pos + q0 || j0 + BKV > ctx;
#pragma unroll
    for (int n = 0; n < BKV / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + n * 8 + 2 * t + (e & 1), qpos = qpos0 + (e >> 1) * 8;
        s[n][e] = (needs_mask && (key > qpos || key >= ctx)) ? neg_inf() : s[n][e] * c;
      }

    // Online softmax, rows g (e = 0, 1) and g+8 (e = 2, 3).
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = m_run[rr];
#pragma unroll
      for (int n = 0; n < BKV / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * rr], s[n][2 * rr + 1]));
      mx = quad_max(mx);
      const float base = mx == neg_inf() ? 0.f : mx;      // a row with nothing visible yet stays at 0
      alpha[rr] = exp2f(m_run[rr] - base);
      m_run[rr] = mx;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BKV / 8; ++n) {
        s[n][2 * rr] = exp2f(s[n][2 * rr] - base);
        s[n][2 * rr + 1] = exp2f(s[n][2 * rr + 1] - base);
        sum += s[n][2 * rr] + s[n][2 * rr + 1];
      }
      l_run[rr] = l_run[rr] * alpha[rr] + sum;          // this lane's partial row sum
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
      o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }

    // O += P V. The S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of
    // k-step kk (keys 16kk .. 16kk+15). V fragments by ldmatrix.trans: matrices keys
    // 16kk + (mi&1)*8 .., chunk 2p + (mi>>1) -> b0, b1 of d n-tile 2p, then of 2p+1.
    {
      const int mi = lane >> 3;
#pragma unroll
      for (int kk = 0; kk < BKV / 16; ++kk) {
        const uint32_t a0 = pack_half2(s[2 * kk][0], s[2 * kk][1]);
        const uint32_t a1 = pack_half2(s[2 * kk][2], s[2 * kk][3]);
        const uint32_t a2 = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        const uint32_t a3 = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        const int r = 16 * kk + (mi & 1) * 8 + (lane & 7);
#pragma unroll
        for (int p = 0; p < D / 16; ++p) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, &sm.v[buf][swz(r, 2 * p + (mi >> 1))]);
          mma_16816(o[2 * p], a0, a1, a2, a3, b[0], b[1]);
          mma_16816(o[2 * p + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
    __syncthreads();                           // all 128 threads done with buffer buf before it is refilled
  }

  // out = fp16(O / l); l summed over the quad first.
  float inv_l[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) inv_l[rr] = 1.0f / quad_sum(l_run[rr]);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = q0 + warp * 16 + g + 8 * rr;
    if (row >= a.T) continue;
    half* dst = a.out + ((size_t)row * a.heads + h) * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(dst + n * 8) =
          pack_half2(o[n][2 * rr] * inv_l[rr], o[n][2 * rr + 1] * inv_l[rr]);
  }
}

}  // namespace pa

// Dynamic shared memory: sizeof(pa::Shared) = 5 * 64 * d * 2 bytes (80 KiB at d = 128).
extern "C" __global__ void __launch_bounds__(pa::THREADS, 2)
nq_prefill_attention(const half* __restrict__ q, const half* __restrict__ k_pool, const half* __restrict__ v_pool,
                     const int32_t* __restrict__ block_table, half* __restrict__ out,
                     int T, int start_pos, int heads, int kv_heads) {
  pa::attention_body(pa::Args{q, k_pool, v_pool, block_table, out, T, start_pos, heads, kv_heads});
}

// ---- RoPE and the cache write -------------------------------------------------------------
// Grid: T blocks (one token each), 256 threads. The token's cos/sin (d/2 each) are computed
// once into shared memory; then thread i rotates pairs i, i + 256, ... of the (heads +
// kv_heads) x d/2 pairs (q heads first, then k heads: q to q_out, k to its page slot) and
// copies v's 16-byte chunks to its page slot.
extern "C" __global__ void __launch_bounds__(NQ_PA_ROPE_THREADS)
nq_prefill_rope_write_kv(const half* __restrict__ qkv,         // [T, (heads + 2 kv_heads) * d]
                         const float* __restrict__ inv_freq,   // [d/2]
                         const int32_t* __restrict__ block_table,
                         half* __restrict__ q_out,             // [T, heads, d]
                         half* __restrict__ k_pool,            // this layer's K [pages, kv_heads, 16, d]
                         half* __restrict__ v_pool,            // this layer's V
                         int T, int start_pos, int heads, int kv_heads) {
  __shared__ float cos_s[pa::HALF_D], sin_s[pa::HALF_D];
  constexpr int D = pa::D;
  const int tok = blockIdx.x, pos = start_pos + tok;
  const int qkv_dim = (heads + 2 * kv_heads) * D;
  for (int i = threadIdx.x; i < pa::HALF_D; i += blockDim.x) sincosf((float)pos * inv_freq[i], &sin_s[i], &cos_s[i]);
  __syncthreads();                             // all 256 threads: the token's cos/sin are ready
  const int page = block_table[pos / pa::PAGE], prow = pos % pa::PAGE;
  const half* src = qkv + (size_t)tok * qkv_dim;
  for (int idx = threadIdx.x; idx < (heads + kv_heads) * pa::HALF_D; idx += blockDim.x) {
    const int head = idx / pa::HALF_D, i = idx % pa::HALF_D;
    const half* x = src + head * D;            // k heads follow the q heads in qkv
    half* dst = head < heads ? q_out + ((size_t)tok * heads + head) * D
                             : k_pool + (((size_t)page * kv_heads + (head - heads)) * pa::PAGE + prow) * D;
    const float x1 = __half2float(x[i]), x2 = __half2float(x[i + pa::HALF_D]);
    const float cs = cos_s[i], sn = sin_s[i];
    dst[i] = __float2half_rn(__fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)));
    dst[i + pa::HALF_D] = __float2half_rn(__fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn)));
  }
  const half* v = src + (heads + kv_heads) * D;
  for (int idx = threadIdx.x; idx < kv_heads * pa::CHUNKS; idx += blockDim.x) {
    const int kvh = idx / pa::CHUNKS, ch = idx % pa::CHUNKS;
    *reinterpret_cast<uint4*>(v_pool + (((size_t)page * kv_heads + kvh) * pa::PAGE + prow) * D + ch * 8) =
        *reinterpret_cast<const uint4*>(v + kvh * D + ch * 8);
  }
}
