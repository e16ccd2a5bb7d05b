// lab/hopper_probe.cu: every wrapper of hopper.cuh in one kernel, so that the CPU build test
// assembles each one's PTX for sm_90a (nothing launches it; the tensor-map copy and
// setmaxnreg are compile-tested only).
//   nq_hopper_probe   a producer warpgroup (setmaxnreg.dec, tensor-map and bulk copies on an
//                     MbarRing) and a consumer warpgroup (setmaxnreg.inc, mma.sync, wgmma)
// nq-arch: sm_90a
#include "hopper.cuh"

using namespace hopper;

constexpr int kStages = 2;

// setmaxnreg needs a register count ptxas can determine at entry: launch bounds with a
// minimum of CTAs per SM (without one it drops the instruction, C7508).
extern "C" __global__ void __launch_bounds__(256, 1)
nq_hopper_probe(const __grid_constant__ TensorMap map, const uint4* __restrict__ src, float* out, int rounds) {
  __shared__ __align__(128) unsigned char tile[kStages][4096];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 4); }
    fence_mbarrier_init();
  }
  __syncthreads();   // all 256 threads: barriers initialised
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp < 4) {                                   // warpgroup 0: producer
    setmaxnreg_dec<40>();
    MbarRing<kStages> ring;
    if (warp == 0 && lane == 0) prefetch_tensor_map(&map);
    for (int r = 0; r < rounds; ++r, ring.advance()) {
      if (warp == 0 && lane == 0) {
        mbar_wait(&empty[ring.stage], ring.phase ^ 1);
        mbar_arrive_expect_tx(&full[ring.stage], 2 * 2048);
        tensor_copy_2d_g2s(tile[ring.stage], &map, 0, r, &full[ring.stage]);
        bulk_copy_g2s(tile[ring.stage] + 2048, src + r * 128, 2048, &full[ring.stage]);
      }
    }
    return;
  }
  setmaxnreg_inc<232>();                            // warpgroup 1: consumer
  MbarRing<kStages> ring;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  for (int r = 0; r < rounds; ++r, ring.advance()) {
    mbar_wait_suspend(&full[ring.stage], ring.phase, 1000);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(tile[ring.stage]) + lane;
    mma_16816(c, w[0], w[32], w[64], w[96], w[128], w[160]);
    wgmma_fence();
    const uint64_t da = smem_desc(tile[ring.stage], 128, 1024);
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(da + 2), "r"(r));
    wgmma_commit();
    wgmma_wait<0>();
    fence_proxy_async_smem();
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[ring.stage]);
  }
  float s = c[0] + c[2];
  for (int i = 0; i < 32; ++i) s += d[i];
  out[threadIdx.x] = s;
}
