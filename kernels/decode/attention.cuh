// attention.cuh: the attention instruction: a KV head's split of the context, online softmax,
// the splits' exact merge ([pd-attention], [pd-merge-all], [pd-attn-lanes]).
#pragma once
#include "decode/rows.cuh"
#include "decode/units.cuh"   // prefetch_during_attention
#include "argmax.cuh"         // NQ_NEG_INF

namespace pd {

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
constexpr int kAttnPre = kCfg.attn_pre;   // rows a warp loads before the wait
static_assert(kCfg.attn_splits * GQA * (D + 2) % 4 == 0, "a KV head's split partials start 16-byte aligned");
constexpr int kPagesCached = 64;   // a split's pages kept in shared memory from the first layer on
// The splits' partials (T_ATTN_WS): split s of KV head g, its query head h (of GQA), at this
// float offset: acc[D], then m and l. Written by the splits, read by the merge (or [pd-o-merge]).
__device__ __forceinline__ size_t attn_part(int g, int s, int h) {
  return ((size_t)(g * kAttnSplits + s) * GQA + h) * (D + 2);
}
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
// Part i's m and l at ml[i * stride] and ml[i * stride + 1]; wt's rows hold NC heads (a KV
// head's GQA, or the heads an o_proj unit meets, [pd-o-merge]).
template <int NC = GQA>
__device__ __forceinline__ float merge_weights_ml(const float* ml, int stride, int parts, int h, float (*wt)[NC],
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
template <int NC = GQA>
__device__ __forceinline__ float merged_acc_s(const float* a, int stride, int parts, int h, const float (*wt)[NC]) {
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
  const int splits = attn_split_count(c.grid, n);
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
      if (kCfg.timeline && threadIdx.x == 0) c.t_ready = now_ns();
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
    if (splits == 1 && !kOMerge) {
      half* out = ptr<half>(c.tab, T_ATTN) + (g * GQA + h) * D + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) out[e] = __float2half_rn(acc[e] / l);
    } else {
      float* part = ptr<float>(c.tab, T_ATTN_WS) + attn_part(g, s, h);
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
  float* aws = ptr<float>(c.tab, T_ATTN_WS) + (size_t)(g * kAttnSplits + s) * GQA * (D + 2);   // attn_part(g, s, 0)
  half* attn = ptr<half>(c.tab, T_ATTN);
  if (live && !lanes) {
    for (int i = threadIdx.x; i < GQA * D; i += kThreads) {
      const int h = i / D, d = i % D;
      const float v = merged_acc(wpart, kWarps, h, d, wt);
      if (splits == 1 && !kOMerge) attn[(g * GQA + h) * D + d] = __float2half_rn(v / lsum[h]);
      else __stcg(aws + h * (D + 2) + d, v);
    }
    if ((splits > 1 || kOMerge) && threadIdx.x < GQA) {
      __stcg(aws + threadIdx.x * (D + 2) + D, wpart[threadIdx.x * (D + 2) + D]);
      __stcg(aws + threadIdx.x * (D + 2) + D + 1, lsum[threadIdx.x]);
    }
  }
  if (live && kOMerge) {
    // [pd-o-merge] The split's partials are stored: count them for o_proj, which merges.
    cta_sync();   // all threads: this split's (m, l, acc) are stored
    if (threadIdx.x == 0) release_add(ptr<unsigned>(c.tab, T_ATTN_CNT) + layer * KVH + g, 1u);
  } else if (live && splits > 1 && kAttnMergeAll) {
    // [pd-merge-all] Every split of KV head g merges one slice of the head's GQA x D outputs
    // once all of the head's splits are stored: no split waits on a single merging one.
    unsigned* cnt = ptr<unsigned>(c.tab, T_ATTN_CNT) + layer * KVH + g;   // (zeroed at the launch's end)
    cta_sync();   // all threads: this split's (m, l, acc) are stored
    if (threadIdx.x == 0) { release_add(cnt, 1u); spin_until(c, cnt, (unsigned)splits); }
    cta_sync();   // all threads: every split of head g is stored and visible
    probe(c, layer, 9);
    const int o0 = s * (GQA * D) / splits, o1 = (s + 1) * (GQA * D) / splits, no = o1 - o0;   // this split's outputs
    const int h0 = o0 / D, nh = (o1 - 1) / D - h0 + 1;                                      // ... and their heads
    const float* base = ptr<const float>(c.tab, T_ATTN_WS) + (size_t)g * kAttnSplits * GQA * (D + 2);   // attn_part(g, 0, 0)
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
      const float* base = ptr<const float>(c.tab, T_ATTN_WS) + (size_t)g * kAttnSplits * GQA * (D + 2);   // attn_part(g, 0, 0)
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

// [pd-o-merge] o_proj's wait: thread 0 until every KV head that the attention outputs k0 ..
// k0 + nk - 1 meet (query head k / D) has all its splits stored (a counter per layer and KV
// head); a CTA without a unit (live = false) waits for nothing. All threads.
__device__ __forceinline__ void wait_heads(Ctx& c, int layer, int k0, int nk, bool live) {
  if (threadIdx.x == 0 && live) {
    const int splits = attn_split_count(c.grid, c.n_ctx);
    for (int kv = k0 / D / GQA; kv <= (k0 + nk - 1) / D / GQA; ++kv)
      spin_until(c, ptr<const unsigned>(c.tab, T_ATTN_CNT) + layer * KVH + kv, (unsigned)splits);
  }
  inputs_ready(c);   // all threads: the partials this unit reads are stored and visible
}
// ... and its staging: those outputs, each the exact merge of its head's splits, fp16, into xs
// as ST_X stages them. All threads. A thread's first two outputs are loaded from the first
// NQ_PD_O_MERGE_PRE splits at once, while the splits' (m, l) are staged and weighed (a warp per
// head, the merge's own order), so those loads share the (m, l)'s L2 trip; the rest follow.
constexpr int kOMergePre = kCfg.o_merge_pre < kAttnSplits ? kCfg.o_merge_pre : kAttnSplits;
constexpr int kOMergePreN = kOMergePre > 0 ? kOMergePre : 1;
__device__ __forceinline__ void stage_merged(const Ctx& c, int k0, int nk, unsigned char* xs) {
  const int splits = attn_split_count(c.grid, c.n_ctx);
  const int h0 = k0 / D, nh = (k0 + nk - 1) / D - h0 + 1;   // the query heads the range meets
  if (nh > kOHeads) {                                  // (kOHeads bounds it: a plan error, never a stray write)
    if (threadIdx.x == 0) atomicExch(c.scalars + S_ERROR * NQ_SCALAR_STRIDE, kErrPlan);
    return;
  }
  const float* ws = ptr<const float>(c.tab, T_ATTN_WS);
  auto part_of = [&](int q, int s) { return ws + attn_part(q / GQA, s, q % GQA); };   // split s of query head q
  float* sml = reinterpret_cast<float*>(xs + kOMergeOffset);   // [split][head][m, l] of the range's heads
  float (*wt)[kOHeads] = reinterpret_cast<float (*)[kOHeads]>(sml + kAttnSplits * kOHeads * 2);
  float* lsum = sml + kAttnSplits * kOHeads * 3;
  const int pairs = nk / 2;
  float2 a[kOMergePreN];                                // the first pair's partial sums, from the first splits
  const int p1 = threadIdx.x, q1 = (k0 + 2 * p1) / D, d1 = (k0 + 2 * p1) % D;
  if (p1 < pairs) {
#pragma unroll
    for (int s = 0; s < kOMergePre; ++s)
      if (s < splits) a[s] = __ldcg(reinterpret_cast<const float2*>(part_of(q1, s) + d1));
  }
  for (int i = threadIdx.x; i < splits * nh * 2; i += kThreads)
    sml[i] = __ldcg(part_of(h0 + (i % (nh * 2)) / 2, i / (nh * 2)) + D + (i & 1));
  cta_sync();   // all threads: the splits' (m, l) staged
  for (int hl = threadIdx.x >> 5; hl < nh; hl += kWarps)
    merge_weights_ml<kOHeads>(sml + hl * 2, nh * 2, splits, hl, wt, lsum);
  cta_sync();   // all threads: weights known
  auto store = [&](int p, float2 v, int hl) {          // local output 2p, 2p + 1 into the staging (x_chunk_offset)
    const int kl = 2 * p;
    *reinterpret_cast<half2*>(xs + nqs3::x_chunk_offset(kl / 8) + (kl % 8) * 2) =
        __floats2half2_rn(v.x / lsum[hl], v.y / lsum[hl]);
  };
  // Pair p's merged outputs, v holding the sum over splits [0, s0) already (split order).
  auto merge_pair = [&](int p, float2 v, int s0) {
    const int q = (k0 + 2 * p) / D, d = (k0 + 2 * p) % D, hl = q - h0;
#pragma unroll 8
    for (int s = s0; s < splits; ++s) {
      const float2 x = __ldcg(reinterpret_cast<const float2*>(part_of(q, s) + d));
      v.x = fmaf(x.x, wt[s][hl], v.x); v.y = fmaf(x.y, wt[s][hl], v.y);
    }
    store(p, v, hl);
  };
  if (p1 < pairs) {
    const int hl = q1 - h0;
    float2 v = make_float2(0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kOMergePre; ++s)
      if (s < splits) { v.x = fmaf(a[s].x, wt[s][hl], v.x); v.y = fmaf(a[s].y, wt[s][hl], v.y); }
    merge_pair(p1, v, kOMergePre);
  }
  for (int p = p1 + kThreads; p < pairs; p += kThreads) merge_pair(p, make_float2(0.f, 0.f), 0);   // (a range wider than 2 outputs a thread)
}
// [/pd-o-merge]

}  // namespace pd
