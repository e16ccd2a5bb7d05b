// stream3.cuh: the pieces of an INT4 GEMV over layout 3 ("INT4 lane-fragment",
// nanoqwen_lib/format/stream_layout.py), shared by the lab kernel (kernels/lab/gemv_stream3.cu)
// and the persistent decode step (kernels/decode_persistent.cu).
//
// [s3-layout]
// Layout 3: the rows in tiles of 16, K in groups of 128; block (tile i, group j) is 1056 bytes
// at (i * G + j) * 1056: 64 chunks of 16 bytes, chunk 32h + lane = the layout-1 words of row
// 8h + lane/4, k 32 (lane%4) .. +31 of the group (ValueShuffle, as gemv_int4.cuh's unpack
// expects), then the 16 fp16 scales, (row r, row r+8) as one half2 at byte 1024 + 4r. So lane
// (g, t) = (lane/4, lane%4) issues, per group: LDG.128 of chunk lane, LDG.128 of chunk 32 +
// lane (each instruction of the warp reads 512 contiguous bytes), and a 4-byte load of its
// two scales. Those registers are exactly the A fragments of the mma.sync m16n8k16 it
// multiplies (gemv_int4.cuh [prmt-group]): no shuffle, no shared memory for weights.
// [/s3-layout]
//
// x of a group sits in shared memory padded as gemv_int4.cuh stages it (320 bytes a group:
// lane run t at 80 t, conflict-free LDS.128), with {fold, magic lo, magic hi, 0} in the 16
// bytes of padding behind each run (stage_fold).
#pragma once
#include "gemv_int4.cuh"   // unpack_int4x8_offset, word_of, mma_16816, ldg_stream, kFoldLo/Hi, kMagicLo/Hi

static_assert(NQ_STREAM_LAYOUT_ID == 3, "these pieces read layout 3 (INT4 lane-fragment)");
static_assert(NQ_GROUP_SIZE == 128, "a block is 16 rows x 128 k: 64 chunks, two per lane");
static_assert(NQ_GEMV_X_GROUP_HALVES == 160, "x staged as gemv_int4.cuh: 32-half lane runs + 8 halves of padding");

namespace nqs3 {
constexpr int kBlockBytes = 1056;                 // 1024 code bytes + 16 fp16 scales
constexpr int kScaleOffset = 1024;
constexpr int kXGroupBytes = 2 * NQ_GEMV_X_GROUP_HALVES;   // 320
constexpr int kXLaneBytes = 80;                   // 32 halves + 8 of padding

struct Slot {          // one group of one warp, in a lane's registers
  uint4 lo, hi;        // rows g and g+8: 32 codes each (4 ValueShuffle words)
  uint32_t s;          // half2 (scale of row g, scale of row g+8)
};

// [s3-load]
__device__ __forceinline__ uint32_t ldg_stream_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void load_slot(Slot& r, const unsigned char* blk, int lane) {
  r.lo = nq::ldg_stream(reinterpret_cast<const uint4*>(blk) + lane);
  r.hi = nq::ldg_stream(reinterpret_cast<const uint4*>(blk + 512) + lane);
  r.s = ldg_stream_u32(blk + kScaleOffset + 4 * (lane >> 2));
}
// [/s3-load]

// [s3-copy]
// The same block through a ring in shared memory instead of registers (the persistent
// kernel's NQ_PD_SMEM_RING): the warp's 32 lanes copy its 1056 bytes with 16-byte cp.async
// (L2 only, no register held while it flies; lanes 0 and 1 also take the 32 bytes of
// scales), and after cp.async.wait_group and a __syncwarp every lane reads back exactly what
// load_slot would have put in its registers.
__device__ __forceinline__ void copy_slot(unsigned char* slot, const unsigned char* blk, int lane) {
  hopper::cp_async16(hopper::smem_u32(slot + 16 * lane), blk + 16 * lane, true);
  hopper::cp_async16(hopper::smem_u32(slot + 512 + 16 * lane), blk + 512 + 16 * lane, true);
  if (lane < 2) hopper::cp_async16(hopper::smem_u32(slot + kScaleOffset + 16 * lane), blk + kScaleOffset + 16 * lane, true);
}
__device__ __forceinline__ void read_slot(Slot& r, const unsigned char* slot, int lane) {
  r.lo = reinterpret_cast<const uint4*>(slot)[lane];
  r.hi = reinterpret_cast<const uint4*>(slot + 512)[lane];
  r.s = *reinterpret_cast<const uint32_t*>(slot + kScaleOffset + 4 * (lane >> 2));
}
// [/s3-copy]

// [s3-group]
// One group: the lane's 4 words of each of its 2 rows -> 8 mma.sync (two per word pair), in two independent
// accumulator chains (even and odd words), then W = code * scale: one FFMA per row.
// The magic words arrive in registers the compiler cannot trace to a literal (read from
// shared memory), so each pair is one LOP3 with the mask as its immediate (gemv_int4.cuh
// [fold] says why: given literals, ptxas rematerializes one before every LOP3).
// kFold = false: exact codes (LOP3 + HSUB2 per pair). kFold = true: the MMA reads 1032 + s /
// 72 + s and the group's fold (1032 sum_lo x + 72 sum_hi x, staged in the padding behind the
// lane's x run with the magic words) is subtracted once per row.
template <bool kFold>
__device__ __forceinline__ void group(float& acc0, float& acc1, const Slot& r, const unsigned char* xs) {
  uint4 xv[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) xv[j] = reinterpret_cast<const uint4*>(xs)[j];
  const uint4 fv = reinterpret_cast<const uint4*>(xs)[4];   // {fold, magic lo, magic hi, 0}
  const uint32_t mlo = fv.y, mhi = fv.z;
  float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int j = 0; j < 4; ++j) {                   // word j: k = 32t + 8j .. +7 of the group
    uint32_t pa[4], pb[4];
    nq::unpack_int4x8_offset(nq::word_of(r.lo, j), mlo, mhi, pa);
    nq::unpack_int4x8_offset(nq::word_of(r.hi, j), mlo, mhi, pb);
    if (!kFold) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pa[i] = nq::hsub2(pa[i], (i & 1) ? mhi : mlo);
        pb[i] = nq::hsub2(pb[i], (i & 1) ? mhi : mlo);
      }
    }
    nq::mma_16816(c[j & 1], pa[0], pb[0], pa[1], pb[1], xv[j].x, xv[j].y);   // k = 8j + 0..3
    nq::mma_16816(c[j & 1], pa[2], pb[2], pa[3], pb[3], xv[j].z, xv[j].w);   // k = 8j + 4..7
  }
  const float2 s = __half22float2(*reinterpret_cast<const half2*>(&r.s));
  const float fold = kFold ? __uint_as_float(fv.x) : 0.f;
  acc0 = fmaf((c[0][0] + c[1][0]) - fold, s.x, acc0);     // row g
  acc1 = fmaf((c[0][2] + c[1][2]) - fold, s.y, acc1);     // row g + 8
}
// [/s3-group]

// Byte offset of chunk c (8 halves) of the staged x: c -> c + c/4 in 16-byte units.
__device__ __forceinline__ int x_chunk_offset(int c) { return 16 * (c + c / 4); }

// [s3-fold]
// After the staging: per group and lane run (32 halves; thread c = 4 group + run), the run's
// sums over the lo slots (halves 0,1,4,5 of each 8) and hi slots (2,3,6,7), added over the
// group's four runs by two xor shuffles (every lane of the quad ends with the same bits), and
// {fold, magic lo, magic hi, 0} written to the 16 bytes of padding behind the run. With
// kFold = false the fold is 0 and only the magic words matter. Passes are warp-uniform;
// reached by threads tid = 0 .. nthreads - 1 (whole warps).
template <bool kFold>
__device__ __forceinline__ void stage_fold(unsigned char* xs, int ng, int tid, int nthreads) {
  for (int c0 = tid & ~31; c0 < 4 * ng; c0 += nthreads) {
    const int c = c0 + (tid & 31);
    const bool live = c < 4 * ng;
    unsigned char* run = xs + (c >> 2) * kXGroupBytes + (c & 3) * kXLaneBytes;
    float lo = 0.f, hi = 0.f;
    if (kFold) {
      if (live) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 v = reinterpret_cast<const uint4*>(run)[j];
          const half2* h = reinterpret_cast<const half2*>(&v);
          lo += (__low2float(h[0]) + __high2float(h[0])) + (__low2float(h[2]) + __high2float(h[2]));
          hi += (__low2float(h[1]) + __high2float(h[1])) + (__low2float(h[3]) + __high2float(h[3]));
        }
      }
      lo += __shfl_xor_sync(0xffffffffu, lo, 1);
      hi += __shfl_xor_sync(0xffffffffu, hi, 1);
      lo += __shfl_xor_sync(0xffffffffu, lo, 2);
      hi += __shfl_xor_sync(0xffffffffu, hi, 2);
    }
    const float fold = kFold ? fmaf(nq::kFoldLo, lo, nq::kFoldHi * hi) : 0.f;
    if (live)
      reinterpret_cast<uint4*>(run)[4] = make_uint4(__float_as_uint(fold), nq::kMagicLo, nq::kMagicHi, 0u);
  }
}
// [/s3-fold]
}  // namespace nqs3
