// hopper.cuh: the typed Hopper (sm_90) primitives every kernel file takes from one place:
//   mbarriers (init, arrive, arrive.expect_tx, try_wait.parity with and without a suspend
//   hint) and MbarRing, a ring of stages with its stage index and phase; 1-D bulk copies
//   (cp.async.bulk global -> shared on an mbarrier) and tensor-map copies
//   (cp.async.bulk.tensor.2d with a CUtensorMap); fence.proxy.async; the mma.sync m16n8k16
//   wrapper; wgmma fence / commit / wait and the shared-memory matrix descriptor;
//   setmaxnreg. Each wrapper says which threads may call it.
// The wgmma and setmaxnreg wrappers assemble only for the sm_90a target (a `// nq-arch:
// sm_90a` line in the kernel file); the others for sm_90.
#pragma once
#include "common.cuh"

namespace hopper {

// Shared-memory address of a generic pointer to shared memory (any thread).
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// ---- mbarriers ----------------------------------------------------------------------------
// [mbarrier]
// One thread per barrier (any one), before any other thread touches it; then
// fence_mbarrier_init and a CTA barrier (__syncthreads) publish it.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// The thread(s) that ran mbar_init, after them: makes the inits visible to the async proxy
// (the copy engine's complete_tx) and, with the __syncthreads that follows, to the other threads.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Any thread; one call is one of the `arrivals` the phase waits for (release: the caller's
// earlier writes are visible to the waiters of this phase).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}"
                 :: "r"(smem_u32(bar)) : "memory");
}
// Any thread, typically the one that then issues the copies: one arrival plus `bytes` of
// transactions the current phase must also see complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}"
                 :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Any number of threads, each for itself: spin until the phase with this parity has
// completed (acquire: its data is visible after).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}
// One try (no loop): true once the phase with this parity has completed (acquire, as mbar_wait);
// for a waiter that must also watch a clock or an error flag between tries.
__device__ __forceinline__ bool mbar_try(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return done != 0;
}
// As mbar_wait, with a suspend-time hint: a waiting thread may be suspended (up to `ns`
// nanoseconds) until the phase completes, instead of re-issuing try_wait, so a waiting warp
// leaves its issue slots to the others (on the bulk GEMV it changed nothing: PERFLOG v5).
__device__ __forceinline__ void mbar_wait_suspend(uint64_t* bar, uint32_t parity, uint32_t ns) {
    uint32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity), "r"(ns) : "memory");
    } while (!done);
}

// A ring of Stages stages, each with its own barriers: the position of one role (producer
// or consumer) in it. Stage s is used for the k-th time in round k, whose phase parity is
// k & 1; a producer waits for "empty" with parity ^ 1 (the first round passes at once),
// a consumer for "full" with parity. Each thread (or warp) keeps its own MbarRing.
template <int Stages>
struct MbarRing {
    static_assert(Stages >= 1, "a ring has at least one stage");
    int stage = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == Stages) { stage = 0; phase ^= 1u; }
    }
};

// ---- copies on the async proxy ------------------------------------------------------------
// One thread per copy: global -> shared bulk copy on the copy engine; completes `bytes`
// transactions on `bar` (dst, src and bytes multiples of 16).
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Each thread for its own accesses: orders this thread's generic-proxy shared accesses
// (plain loads and stores) before its later async-proxy ones (a bulk copy into the stage it
// just read, a wgmma reading what it just stored).
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// [mbarrier-end]

// [tensor-map-copy]
// A CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned, encoded on the host by
// cuTensorMapEncodeTiled (cuda-bindings) and passed as a `const __grid_constant__` kernel
// parameter, so that its address is a parameter-space address the copy engine can read.
struct alignas(64) TensorMap { unsigned long long opaque[16]; };
// One thread per copy: the box at (c0, c1) (innermost coordinate first, in elements) of the
// 2-D tensor `map` describes, into shared memory at dst (128-byte aligned); completes the
// box's bytes on `bar`.
__device__ __forceinline__ void tensor_copy_2d_g2s(void* dst, const TensorMap* map, int c0, int c1, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
// One thread, ahead of the first tensor_copy_2d_g2s: brings the descriptor into the cache.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(map) : "memory");
}
// [/tensor-map-copy]

// ---- tensor cores -------------------------------------------------------------------------
// [mma]
// All 32 lanes of a warp, converged (.sync.aligned). D += A.B, m16n8k16, fp16 inputs, fp32
// accumulators; lane (g, t) = (lane / 4, lane % 4) holds A rows g, g+8 at k-slots 2t, 2t+1
// (a0, a1) and 2t+8, 2t+9 (a2, a3), B column g at the same k-slots (b0, b1), and D rows g
// (c[0], c[1]) and g+8 (c[2], c[3]) at columns 2t, 2t+1.
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// [/mma]

// All 32 lanes, converged. D += A.B, m16n8k32, E4M3 inputs, fp32 accumulators (the fragment
// layout of m16n8k16 with four bytes per register; on sm_90 ptxas emulates it with FP16 HMMA).
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- cp.async (sm_80's per-thread async copies; the prefill kernels' loaders) -------------
// Each thread for its own copies: 16 (or 4) bytes global -> shared at the shared address
// dst, zero-filled when !valid (src-size 0: nothing is read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
               :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// Each thread: close its group of copies; wait until at most N of its groups are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// [wgmma]
// All 128 threads of a warpgroup, converged (sm_90a). wgmma_fence before the first wgmma
// of a group (orders earlier register and shared-memory writes before it), commit closes
// the group, wait<N> blocks until at most N groups are pending.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// Any thread: the 64-bit shared-memory matrix descriptor of a wgmma operand at `smem`
// (start address, leading- and stride-dimension byte offsets, each in 16-byte units, 14
// bits each; swizzle mode in bits 62-63, 0 = none).
__device__ __forceinline__ uint64_t smem_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                              uint32_t swizzle = 0) {
  const uint32_t addr = smem_u32(smem);
  return (uint64_t)((addr >> 4) & 0x3FFF) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | ((uint64_t)(swizzle & 3) << 62);
}
// [/wgmma]

// [setmaxnreg]
// All 128 threads of a warpgroup, converged (sm_90a): raise (inc) or lower (dec) this
// warpgroup's per-thread register budget to N (a multiple of 8 in 24..256); producers dec,
// consumers inc, out of the CTA's pool. The kernel needs __launch_bounds__(threads, min CTAs):
// without a register count known at entry ptxas drops setmaxnreg (info C7508).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
// [/setmaxnreg]

}  // namespace hopper
