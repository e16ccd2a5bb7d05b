// sched.cuh: the scheduler: the consumers' CTA barrier, the counters an instruction waits on and
// signals ([pd-wait], [pd-fence]), the timeline and probe stamps, [pd-qkv-ll]'s tagged words,
// [pd-skip]; and Ctx, what a CTA carries from instruction to instruction.
#pragma once
#include "decode/layout.cuh"

namespace pd {

// The consumers' CTA barrier: every thread (__syncthreads), or with the loader warp, which never
// takes part, named barrier 1 over the kThreads consumer threads.
__device__ __forceinline__ void cta_sync() {
  if constexpr (kLoaderWarp) asm volatile("bar.sync 1, %0;" :: "n"(kThreads) : "memory");
  else __syncthreads();
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// [pd-fence]
// The counters' memory ordering, one thread (thread 0) after a CTA barrier, in three builds
// (NQ_PD_FENCE): 0, __threadfence (fence.sc.gpu: SASS MEMBAR.SC.GPU) before a relaxed atomic,
// and the waiter's ld.acquire; 1, fence.acq_rel.gpu (MEMBAR.ALL.GPU) before a relaxed atomic,
// the waiter polling relaxed and fencing once it sees the count (a release and an acquire
// pattern of the PTX memory model); 2, the release and acquire on the operations themselves
// (red.release, atom.acq_rel, ld.acquire).
__device__ __forceinline__ void fence_gpu() {
  if (kCfg.fence == 0) __threadfence();
  else asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
// Poll (relaxed in build 1: the fence comes once, in acquired()).
__device__ __forceinline__ unsigned ld_poll(const unsigned* p) {
  unsigned v;
  if (kCfg.fence == 1) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void acquired() {
  if (kCfg.fence == 1) fence_gpu();
}
// *p += v, after this CTA's writes (release).
__device__ __forceinline__ void release_add(unsigned* p, unsigned v) {
  if (kCfg.fence == 2) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
  } else {
    fence_gpu();
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
  }
}
// *p += 1 after this CTA's writes; true in the arrival that completes `count` (which then
// sees every arrival's writes: acquire).
__device__ __forceinline__ bool arrive_last(unsigned* p, unsigned count) {
  unsigned old;
  if (kCfg.fence == 2) {
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
    return old == count - 1;
  }
  fence_gpu();
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  if (old != count - 1) return false;
  fence_gpu();
  return true;
}
// [/pd-fence]
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
template <class T> __device__ __forceinline__ T* ptr(const long long* tab, int i) {
  return reinterpret_cast<T*>(tab[i]);
}

struct Cursor;   // [pd-loader]'s place in a warp's schedule (loader.cuh)
struct Ctx {
  const long long* tab;
  int* scalars;
  unsigned* sync;
  int grid;
  float eps;                // rmsnorm epsilon
  int n_ctx;                // attention: the context length, once read (-1: not yet)
  int first_layer;          // the launch's first layer (its attention reads the pages)
  int* s_pages;             // attention: this CTA's split's pages, once read (shared memory)
  const long long* lt;      // this layer's table row
  const long long* lt_next; // the next layer's (null after the last layer run)
  bool x_pending;           // [pd-down-defer]: the last down's K slices are in WS_DOWN, not yet in x
  int prev;                 // counter the next instruction waits on (-1: none)
  unsigned prev_target;
  long long* tl;            // this CTA's timeline rows (diagnostic build) or null
  int tl_n;
  unsigned long long t_begin, t_ready;
  uint64_t* head_bar;       // [pd-head]: one mbarrier a warp (shared memory)
  unsigned head_uses;       // ... and how many of its phases this warp has waited for
  unsigned char* ld_ring;   // [pd-loader]: the rings, their slots' full and empty mbarriers,
  uint64_t* ld_full;        // and how many blocks this warp has taken from its ring
  uint64_t* ld_empty;
  unsigned ld_n;
  struct Cursor* ld_cur;    // [pd-loader-self]: each warp's place in its schedule (shared memory)
  int ld_k_end;             // ... and where the launch's schedule ends
};

// ---- dependencies ----------------------------------------------------------------------
// [pd-wait]
// All threads. Thread 0 spins until sync[prev] >= target (acquire), then the CTA barrier
// passes the ordering on to every thread.
// A spinning loop's way out (checked every 64th turn): true after an earlier timeout
// (*err != 0), or once NQ_PD_TIMEOUT_MS have passed since t0 (which sets *err).
__device__ __forceinline__ bool timed_out(volatile int* err, unsigned long long t0) {
  if (*err != 0) return true;                          // an earlier timeout: give up at once
  if (now_ns() - t0 > (unsigned long long)kCfg.timeout_ms * 1000000ull) { atomicExch((int*)err, kErrTimeout); return true; }
  return false;
}
// One thread: spin until *p >= target (acquire), or give up after NQ_PD_TIMEOUT_MS (error 3)
// or at once after an earlier timeout.
__device__ __forceinline__ void spin_until(const Ctx& c, const unsigned* p, unsigned target) {
  const unsigned long long t0 = now_ns();
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  for (int spin = 0; ld_poll(p) < target; ++spin)
    if ((spin & 63) == 63 && timed_out(err, t0)) break;
  acquired();
}
// Thread 0: the whole previous instruction done (the caller's next CTA barrier passes it on).
__device__ __forceinline__ void wait_prev_thread0(const Ctx& c) {
  if (threadIdx.x == 0 && c.prev >= 0) spin_until(c, c.sync + c.prev, c.prev_target);
}
// All threads, after thread 0's wait: the inputs are complete (and, in the timeline, when).
__device__ __forceinline__ void inputs_ready(Ctx& c) {
  cta_sync();   // all threads: the inputs of this instruction are complete
  if (kCfg.timeline && threadIdx.x == 0) c.t_ready = now_ns();
}
__device__ __forceinline__ void wait_inputs(Ctx& c) {
  wait_prev_thread0(c);
  inputs_ready(c);
}
// All threads, after the CTA's last write of instruction `idx`: publish it (arrive = false:
// a CTA that took no part, as every CTA but 0 in `begin`, only records and moves on). The
// next instruction waits for sync[idx] >= target.
// rows [r0, r1) (r0 < r1: gate_up with [pd-down-slices]): also the counter of every K slice of
// down those rows meet.
__device__ __forceinline__ void signal_done(Ctx& c, int idx, int layer, int kind, unsigned target,
                                            bool arrive = true, int r0 = 0, int r1 = 0) {
  cta_sync();   // all threads: this CTA's writes of the instruction are issued
  if (threadIdx.x == 0) {
    if (arrive) release_add(c.sync + idx, 1u);         // ... and visible before the counter moves
    if (kDownSlices && r0 < r1) {
      unsigned* cnt = ptr<unsigned>(c.tab, T_SLICE_CNT) + layer * kDown.KS;
#pragma unroll
      for (int s = 0; s < kDown.KS; ++s)
        if (rows_meet_slice(r0, r1, s)) release_add(cnt + s, 1u);
    }
    if constexpr (kCfg.timeline) {
      long long* row = c.tl + 4 * c.tl_n;
      row[0] = layer * 16 + kind; row[1] = (long long)c.t_begin; row[2] = (long long)c.t_ready;
      row[3] = (long long)now_ns();
    }
  }
  c.tl_n++;
  c.prev = idx;
  c.prev_target = target;
}
// [pd-down-slices]: wait for slice s of layer's gate_up (a CTA with no unit, live = false: for nothing);
// c.prev stays gate_up's counter, which down waits for before it publishes (wait_prev_thread0).
__device__ __forceinline__ void wait_slice(Ctx& c, int layer, int s, bool live) {
  if (threadIdx.x == 0 && live)
    spin_until(c, ptr<unsigned>(c.tab, T_SLICE_CNT) + layer * kDown.KS + s, slice_target(s));
  inputs_ready(c);   // all threads: this unit's slice of the input is complete
}
// [/pd-wait]
// NQ_PD_PROBE > 0 (lab build, tools/bench_persistent.py --probe): thread 0 of every CTA
// stamps %globaltimer at numbered points of layer NQ_PD_PROBE's qkv and attention into
// probe[blockIdx.x][point].
__device__ __forceinline__ void probe(const Ctx& c, int layer, int point) {
  if (kCfg.probe > 0 && layer == kCfg.probe && threadIdx.x == 0)
    ptr<long long>(c.tab, T_PROBE)[blockIdx.x * 16 + point] = (long long)now_ns();
}
__device__ __forceinline__ void begin_instruction(Ctx& c) {
  if (kCfg.timeline && threadIdx.x == 0) { c.t_begin = now_ns(); c.t_ready = c.t_begin; }
}

// [pd-qkv-ll] store: fp16 h of qkv row `row` with the layer's tag
__device__ __forceinline__ void store_tagged(const Ctx& c, int row, half h, int layer) {
  unsigned* p = ptr<unsigned>(c.tab, T_QKV_TAG) + row;
  const unsigned w = ((unsigned)(layer + 1) << 16) | __half_as_ushort(h);
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(w) : "memory");
}
// ... poll: the 4 words at p (16-byte aligned) once all carry `tag`, or whatever they hold after
// NQ_PD_TIMEOUT_MS (error 3) or at once after an earlier timeout ([pd-wait]'s rule)
__device__ __forceinline__ uint4 poll_tagged4(const Ctx& c, const unsigned* p, unsigned tag) {
  const unsigned long long t0 = now_ns();
  volatile int* err = c.scalars + S_ERROR * NQ_SCALAR_STRIDE;
  uint4 w;
  for (int spin = 0;; ++spin) {
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
    if ((w.x >> 16) == tag && (w.y >> 16) == tag && (w.z >> 16) == tag && (w.w >> 16) == tag) break;
    if ((spin & 63) == 63 && timed_out(err, t0)) break;
  }
  return w;
}

// [pd-skip] (NQ_PD_SKIP, diagnostic; bits 1 << kind): those layer instructions keep their place
// in the schedule (begin, wait, signal) and do nothing else: no weights, no inputs, no outputs.
// The token's values are then meaningless; its time says what the remaining instructions cost
// on their own (tools/bench_persistent.py --variants bounds).
__device__ __forceinline__ constexpr bool skipped(int kind) { return (kCfg.skip >> kind) & 1; }
static_assert(!kDownSlices || skipped(K_GATE_UP) == skipped(K_DOWN),
              "NQ_PD_DOWN_SLICES: down waits on counters only gate_up moves: skip both or neither");
__device__ __forceinline__ void skip_instruction(Ctx& c, int idx, int layer, int kind) {
  begin_instruction(c);
  wait_inputs(c);
  signal_done(c, idx, layer, kind, c.grid);
}

}  // namespace pd
