"""Timing on the GPU: CUDA events, warm-up, medians, and the read ceiling they are judged by.

`time_cuda(fn)` times `inner` back-to-back calls of fn between two events, `iters` times,
after `warmup` untimed calls, and returns the per-call median / p10 / p90 in ms. Kernels of
a few microseconds need `inner` > 1 (one event pair resolves about half a microsecond) and
`graph=True` (replayed from a CUDA graph, so the host's launch cost is out of the number).

`read_ceiling_tbps()` measures the device's read bandwidth in the same process: a kernel
that reads several GB once (16-byte loads, a grid-stride loop, a few loads in flight per
thread) and writes one word per CTA. Bytes read over the median time is the ceiling every
GEMV's fraction is quoted against.
"""
from __future__ import annotations

import functools

import numpy as np

# A measurement tool, not part of the runtime: kept inline so it never enters the model's
# kernels/ build. Sums 32-bit words so nothing can be optimized away.
_READ_KERNEL = r"""
extern "C" __global__ void nq_read_bw(const uint4* __restrict__ src, unsigned long long n16,
                                      unsigned int* __restrict__ sink) {
  unsigned int acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride);
    uint4 c = __ldcs(src + i + 2 * stride), d = __ldcs(src + i + 3 * stride);
    acc += a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += stride) { uint4 a = __ldcs(src + i); acc += a.x ^ a.y ^ a.z ^ a.w; }
  atomicAdd(sink + blockIdx.x % 32, acc);
}
"""


def time_cuda(fn, warmup: int = 10, iters: int = 30, inner: int = 1, graph: bool = False) -> dict:
    """Per-call time of fn(): {'median','p10','p90'} in ms over `iters` samples of `inner` calls.

    graph=False times eager launches on the current stream: for kernels shorter than the
    host's launch cost (~20 us through CuPy) that is the host's time, not the GPU's.
    graph=True captures the `inner` calls into one CUDA graph on a side stream and times
    its replays, which is how the decode step runs them.
    """
    import cupy as cp

    for _ in range(warmup):
        fn()                              # modules load and workspaces allocate here, not below
    if graph:                             # the side stream does not wait for the warm-up's kernels:
        cp.cuda.get_current_stream().synchronize()   # they must be done before a replay shares their buffers
    stream = cp.cuda.Stream(non_blocking=True) if graph else cp.cuda.get_current_stream()
    with stream:
        if graph:
            stream.begin_capture()
            for _ in range(inner):
                fn()
            g = stream.end_capture()
            g.upload(stream)
            run = lambda: g.launch(stream)  # noqa: E731
            for _ in range(2):
                run()
        else:
            def run():
                for _ in range(inner):
                    fn()
        pairs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
        for start, end in pairs:
            start.record(stream)
            run()
            end.record(stream)
        pairs[-1][1].synchronize()
    ms = np.array([cp.cuda.get_elapsed_time(s, e) / inner for s, e in pairs])
    return {"median": float(np.median(ms)), "p10": float(np.percentile(ms, 10)),
            "p90": float(np.percentile(ms, 90)), "iters": iters, "inner": inner, "graph": graph}


def events_between(launch, n: int, stream) -> list:
    """An event on `stream`, then `n` calls of launch() each followed by an event: n + 1
    events, no host sync (the caller synchronizes and reads the n intervals)."""
    import cupy as cp
    events = [cp.cuda.Event() for _ in range(n + 1)]
    events[0].record(stream)
    for ev in events[1:]:
        launch()
        ev.record(stream)
    return events


def intervals_ms(events) -> list[float]:
    """ms between consecutive events (recorded and completed)."""
    import cupy as cp
    return [cp.cuda.get_elapsed_time(a, b) for a, b in zip(events, events[1:])]


@functools.lru_cache(maxsize=None)
def _read_kernel():
    import cupy as cp
    return cp.RawKernel(_READ_KERNEL, "nq_read_bw")


def measure_read_ceiling(nbytes: int = 4 << 30, iters: int = 10) -> dict:
    """Read bandwidth of the current device over nbytes: {'tbps', 'bytes', 'median', ...}."""
    import cupy as cp

    n16 = nbytes // 16
    buf = cp.arange(n16 * 4, dtype=cp.uint32)          # not zeros: real data, every line touched
    sink = cp.zeros(32, dtype=cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    kern = _read_kernel()
    grid, block = sms * 8, 512

    def run():
        kern((grid,), (block,), (buf, np.uint64(n16), sink))

    t = time_cuda(run, warmup=2, iters=iters)
    del buf
    return {"tbps": n16 * 16 / (t["median"] * 1e-3) / 1e12, "bytes": n16 * 16, **t}


def read_ceiling_tbps(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Measured read bandwidth of the current device, TB/s (1e12 bytes/s)."""
    return measure_read_ceiling(nbytes, iters)["tbps"]


def measure_tensor_ceiling(n: int = 8192, iters: int = 10) -> dict:
    """Dense FP16 tensor-core rate of the current device: cuBLAS (cupy.matmul) on an n x n x n
    product of random fp16 matrices, FP32 accumulation: {'tflops', 'n', 'median', ...}. The
    prefill's counterpart of the read ceiling (random data: zeros run faster)."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    c = cp.empty((n, n), cp.float16)

    def run():
        cp.matmul(a, b, out=c)

    t = time_cuda(run, warmup=3, iters=iters)
    del a, b, c
    return {"tflops": 2 * n ** 3 / (t["median"] * 1e-3) / 1e12, "n": n, **t}
