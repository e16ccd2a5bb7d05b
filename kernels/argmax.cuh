// argmax.cuh: the (value, index) reduction shared by nq_argmax (decode_ops.cu) and the fused
// argmax of nq_lm_head (lm_head.cu). Ties go to the lowest index; NaN never wins (every
// comparison with NaN is false), so an all-NaN input yields the index V (out of range).
#pragma once

namespace nq {

// -inf without <math.h> (NVRTC): the bit pattern of fp32 -infinity.
#define NQ_NEG_INF __int_as_float(0xff800000)

struct ArgBest {
  float v;
  int i;
  __device__ __forceinline__ void take(float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
};

__device__ __forceinline__ ArgBest warp_argmax(ArgBest b) {
  for (int o = 16; o >= 1; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, b.i, o);
    b.take(ov, oi);
  }
  return b;
}

// The CTA barrier of THREADS threads: barrier 0 (__syncthreads, every thread of the CTA), or
// named barrier BAR (bar.sync BAR, THREADS) when the CTA has warps that never reach it (the
// persistent decode step's loader warp, [pd-loader]).
template <int BAR, int THREADS>
__device__ __forceinline__ void cta_barrier() {
  if constexpr (BAR == 0) __syncthreads();
  else asm volatile("bar.sync %0, %1;" :: "n"(BAR), "n"(THREADS) : "memory");
}

// Reached by all THREADS threads of every CTA (threads 0 .. THREADS - 1; BAR: cta_barrier).
// Each CTA's best goes to part_*[blockIdx.x];
// the last CTA to bump *counter merges them, writes *token_out and resets *counter to 0.
// With one CTA the parts and the counter are not touched. Returns true (in every thread) in
// the CTA that wrote *token_out (its thread 0 did).
template <int THREADS, int BAR = 0>
__device__ __forceinline__ bool argmax_finish(ArgBest b, float* part_val, int* part_idx,
                                              unsigned* counter, int* token_out) {
  __shared__ float sv[THREADS / 32];
  __shared__ int si[THREADS / 32];
  __shared__ bool is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  b = warp_argmax(b);
  if (lane == 0) { sv[warp] = b.v; si[warp] = b.i; }
  cta_barrier<BAR, THREADS>();   // all threads: sv/si complete
  if (threadIdx.x == 0) {
    for (int w = 1; w < THREADS / 32; ++w) b.take(sv[w], si[w]);
    if (gridDim.x == 1) {
      *token_out = b.i;
    } else {
      part_val[blockIdx.x] = b.v;
      part_idx[blockIdx.x] = b.i;
      __threadfence();   // the part is visible before the counter moves
      is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
  }
  if (gridDim.x == 1) return true;
  cta_barrier<BAR, THREADS>();   // all threads: is_last known
  if (!is_last) return false;
  __threadfence();
  ArgBest m{NQ_NEG_INF, 0x7fffffff};
  for (int p = threadIdx.x; p < (int)gridDim.x; p += THREADS)
    m.take(__ldcg(&part_val[p]), __ldcg(&part_idx[p]));
  m = warp_argmax(m);
  cta_barrier<BAR, THREADS>();   // all threads: done reading sv/si above before they are reused
  if (lane == 0) { sv[warp] = m.v; si[warp] = m.i; }
  cta_barrier<BAR, THREADS>();   // all threads: sv/si complete
  if (threadIdx.x == 0) {
    for (int w = 1; w < THREADS / 32; ++w) m.take(sv[w], si[w]);
    *token_out = m.i;
    *counter = 0u;
  }
  return true;
}

}  // namespace nq
