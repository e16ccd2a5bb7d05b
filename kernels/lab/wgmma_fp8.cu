// lab/wgmma_fp8.cu: an experiment (no engine runs it): the FP8 prefill GEMM on Hopper's FP8 tensor cores (wgmma, sm_90a).
// nq-arch: sm_90a
//
//   nq_gemm_fp8_wgmma   out[t,n] = fp16(ts[t] s[n] sum_k xq[t,k] c[n,k] [+ bias[n]]
//                       [+ residual[t,n]]), the same contract as fp8.cu:nq_gemm_fp8
//
// Why a second kernel: on sm_90, ptxas emulates mma.sync with E4M3 operands (an FP16 unpack
// of every code, then HMMA; PERFLOG.md, "SASS"). Hopper's FP8 tensor cores are reached only
// through wgmma (QGMMA in SASS), which needs the sm_90a target (the `nq-arch` line above;
// cuda_build builds this file for it).
//
// v1a, the layout probe: one warpgroup (128 threads) per 64 x 64 output tile, K in chunks
// of 128 bytes staged through shared memory by plain 16-byte loads, one wgmma group in
// flight, no pipeline. Correctness first: it pins down the descriptor and fragment layouts
// that a pipelined v1b (cp.async.bulk producer, mbarrier ring) will reuse.
//
// Shared-memory layout (no swizzle, both operands K-major, as FP8 wgmma requires): a core
// matrix is 8 rows x 16 bytes, stored as 128 contiguous bytes. Tile element (r, k) of a
// 64 x 128-byte chunk lives in core matrix (r / 8, k / 16) at byte
//     ((r / 8) * 8 + k / 16) * 128 + (r % 8) * 16 + k % 16,
// so the core matrix next along K is 128 bytes away (the descriptor's leading-dimension
// byte offset, LBO) and the next 8-row group is 1024 bytes away (stride byte offset, SBO).
// One wgmma (k32) reads two core matrices along K: the k-step s starts at byte 256 s.
//
// Promotion (v1a.1). On the H200 (5bcd157) v1a's layout was right, but ~0.1% of outputs
// missed the FP32-sum bound by up to ~1%: the FP8 wgmma accumulator keeps fewer bits than
// FP32 (about 14, by DeepSeek-V3's report). So the tensor core accumulates only
// NQ_WGMMA_PROMOTE_K bytes of k into a fresh fragment, which FP32 FADDs then add into the
// running sum. 32 (every wgmma; the most accurate, one wait per wgmma) or 128 (every chunk,
// DeepSeek's interval). Not yet run on a GPU.
// nq-variants: NQ_WGMMA_PROMOTE_K=128
#include "fp8.cuh"
#include "hopper.cuh"   // wgmma fence / commit / wait, the matrix descriptor, fence.proxy.async

#ifndef NQ_WGMMA_PROMOTE_K
#error "NQ_WGMMA_PROMOTE_K: set by nanoqwen_lib.config (nanoqwen.yaml tuning)"
#endif
static_assert(NQ_WGMMA_PROMOTE_K == 32 || NQ_WGMMA_PROMOTE_K == 128, "promote every wgmma or every chunk");

#ifndef NQ_WGMMA_BM
#error "NQ_WGMMA_BM: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_WGMMA_BN
#error "NQ_WGMMA_BN: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_WGMMA_BK
#error "NQ_WGMMA_BK: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif
#ifndef NQ_WGMMA_THREADS
#error "NQ_WGMMA_THREADS: set by nanoqwen_lib.config (nanoqwen.yaml geometry)"
#endif

namespace nqw {
constexpr int kBM = NQ_WGMMA_BM, kBN = NQ_WGMMA_BN, kBK = NQ_WGMMA_BK;   // tile: tokens x features x bytes of k
constexpr int kThreads = NQ_WGMMA_THREADS;                  // one warpgroup
constexpr int kTileBytes = kBM * kBK;          // 8 KB per operand chunk
constexpr uint32_t kLBO = 128, kSBO = 1024;

__device__ __forceinline__ int core_offset(int r, int k) {
  return ((r >> 3) * 8 + (k >> 4)) * 128 + (r & 7) * 16 + (k & 15);
}

// Matrix descriptor: LBO and SBO of the no-swizzle core-matrix layout above (hopper.cuh).
__device__ __forceinline__ uint64_t desc(const void* smem) { return hopper::smem_desc(smem, kLBO, kSBO); }

// D[64 x 64] (+)= A[64 x 32] . B[64 x 32]^T, E4M3 in, FP32 accumulators: thread (warp w,
// lane l) holds, for n8 block j, d[4j], d[4j+1] at row 16w + l/4, cols 8j + 2(l%4) + {0,1},
// and d[4j+2], d[4j+3] at row 16w + l/4 + 8.
__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate));
}
}  // namespace nqw

// [gemm-fp8-wgmma]
// xq uint8 [T, K], ts fp32 [T]; codes uint8 [N, K], scales fp32 [N]; bias fp16 [N] or null;
// residual fp16 [T, N] or null (may be out); out fp16 [T, N]. K a multiple of 128;
// grid (ceil(T / 64), ceil(N / 64)), block 128 (one warpgroup).
extern "C" __global__ void __launch_bounds__(nqw::kThreads)
nq_gemm_fp8_wgmma(const unsigned char* __restrict__ xq, const float* __restrict__ ts,
                  const unsigned char* __restrict__ codes, const float* __restrict__ scales,
                  const half* bias, const half* residual, half* out, int T, int N, int K) {
  using namespace nqw;
  __shared__ __align__(128) unsigned char as[kTileBytes];
  __shared__ __align__(128) unsigned char bs[kTileBytes];
  const int t0 = blockIdx.x * kBM, n0 = blockIdx.y * kBN;
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;

  for (int k0 = 0; k0 < K; k0 += kBK) {
    // 64 rows x 128 bytes per operand = 512 uint4: four per thread each; zeros past T or N.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx >> 3, c = (idx & 7) * 16;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      const uint4 av = t0 + r < T ? *reinterpret_cast<const uint4*>(xq + (size_t)(t0 + r) * K + k0 + c) : zero;
      const uint4 bv = n0 + r < N ? __ldcs(reinterpret_cast<const uint4*>(codes + (size_t)(n0 + r) * K + k0 + c)) : zero;
      *reinterpret_cast<uint4*>(as + core_offset(r, c)) = av;   // c % 16 == 0: one whole core-matrix row
      *reinterpret_cast<uint4*>(bs + core_offset(r, c)) = bv;
    }
    // The generic-proxy stores above must be visible to wgmma's async proxy.
    hopper::fence_proxy_async_smem();
    __syncthreads();   // all 128 threads: both chunks are in shared memory
    // [promote]
    constexpr int kSteps = NQ_WGMMA_PROMOTE_K / 32;          // wgmma k-steps per promotion
#pragma unroll
    for (int s0 = 0; s0 < kBK / 32; s0 += kSteps) {
      float part[32];                                        // the tensor core's short sum
      hopper::wgmma_fence();
#pragma unroll
      for (int s = s0; s < s0 + kSteps; ++s)
        wgmma_m64n64k32(part, desc(as + 256 * s), desc(bs + 256 * s), s > s0 ? 1 : 0);
      hopper::wgmma_commit();
      hopper::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 32; ++i) d[i] += part[i];         // FP32, in registers
    }
    // [/promote]
    __syncthreads();   // all 128 threads: the wgmma groups have read the chunks before they are overwritten
  }
  // Epilogue: D fragment of m64n64 (see wgmma_m64n64k32).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = t0 + 16 * warp + (lane >> 2) + (r >= 2 ? 8 : 0);
      const int n = n0 + 8 * j + 2 * (lane & 3) + (r & 1);
      nqfp8::store_scaled(out, ts, scales, bias, residual, t, n, T, N, d[4 * j + r]);
    }
}
// [/gemm-fp8-wgmma]
