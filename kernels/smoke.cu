// smoke.cu: the smallest kernel that includes common.cuh; proves the build path.
#include "common.cuh"
extern "C" __global__ void nq_smoke(half* out) { out[threadIdx.x] = __float2half(NQ_PAGE_TOKENS); }
