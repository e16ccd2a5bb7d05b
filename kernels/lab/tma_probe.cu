// lab/tma_probe.cu: one tensor-map box copied to shared memory by TMA and written back raw, to check a map's layout on the GPU
// nq-arch: sm_90a
//   nq_tma_probe   one CTA: thread 0 copies the box at (c0, c1) (innermost first) of the tensor
//                  `map` (a 64-byte-aligned device copy, nanoqwen_lib/gpu/tensor_map.py) into
//                  1024-byte-aligned shared memory on an mbarrier (expect_tx `bytes`), then the
//                  CTA copies those `bytes` to `out` as they lie (the 128B swizzle included).
// tests/test_gpu_prefill_wgmma.py checks the layouts prefill_wgmma.cu relies on: X boxes with
// CU_TENSOR_MAP_SWIZZLE_128B (16-byte chunk c of row r at 128 r + (c ^ r % 8) * 16), rows past
// the tensor zero-filled, and the packed INT4 boxes without swizzle (row r at 32 r).
#include "hopper.cuh"

extern "C" __global__ void __launch_bounds__(128, 1)
nq_tma_probe(const hopper::TensorMap* map, int c0, int c1, int bytes, uint4* out) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bar;
  unsigned char* tile = smem_raw + ((1024u - (hopper::smem_u32(smem_raw) & 1023u)) & 1023u);
  if (threadIdx.x == 0) {
    hopper::mbar_init(&bar, 1);
    hopper::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    hopper::prefetch_tensor_map(map);
    hopper::mbar_arrive_expect_tx(&bar, (uint32_t)bytes);
    hopper::tensor_copy_2d_g2s(tile, map, c0, c1, &bar);
  }
  hopper::mbar_wait(&bar, 0);
  for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) out[i] = reinterpret_cast<const uint4*>(tile)[i];
}
