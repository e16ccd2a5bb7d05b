"""The ITL breakdown: where the time of one decode token goes, region by region.

A region is a named part of the step: gpu.layer's description, which the engine launches
from (GpuBackend.step_launches) and which gives each region's floor
(gpu.layer.decode_region_bytes).

    region time   every launch of the region in one token (28 of each per-layer kernel, in
                  step order, so each reads another layer's weights, as the step does),
                  captured as one CUDA graph and replayed (timing.time_cuda); the median.
    step ITL      whole steps at the same position, events between them: replayed from the
                  engine's graphs, and enqueued eagerly (the host launches every kernel).
    kernel_gap    step ITL - sum of the region times: the time the GPU spends waiting between
                  kernels, on the host (eager) or on launch latency (graphs).

A region replayed alone runs its kernels back to back, so its time includes the launch
latency between its own kernels as they sit in a graph; the graph kernel_gap is what the
whole step adds on top. The regions run on the engine's live state at the measured
position (the scalars, the residual stream and the pages are saved and restored around
each), so the sequence must be reset afterwards: `itl_breakdown` runs its own prefill.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.format.layout import decode_gemv_shapes
from nanoqwen_lib.measure.timing import events_between, intervals_ms, time_cuda



def step_times(engine, steps: int, graphs: bool) -> list[float]:
    """ms per decode step for `steps` steps from the engine's position, CUDA events between
    steps, no host sync in the loop (eager: the host's launches pace the GPU)."""
    saved = engine.use_graphs
    engine.use_graphs = graphs
    try:
        events = events_between(engine.launch_step, steps, engine.stream)
        engine.stream.synchronize()
    finally:
        engine.use_graphs = saved
    engine.token_at(engine.position - 1)                 # raises if the device flagged an error
    return intervals_ms(events)


def region_times(engine, launches=None, iters: int = 20, warmup: int = 3,
                 restore=("s.scalars", "a.x", "s.block_table")) -> dict[str, float]:
    """region -> median ms of all its launches, captured as one graph per region and replayed.
    launches: (region, launch) pairs, default the decode step's (mid-page variant); the
    arena buffers in `restore` are saved first and put back after each region."""
    from nanoqwen_lib.measure.timing import time_cuda
    a, s = engine.arena, engine.stream
    launches = engine.step_launches(new_page=False) if launches is None else launches
    saved = {name: a[name].copy() for name in restore}
    out = {}
    for region in dict.fromkeys(name for name, _ in launches):
        mine = [launch for name, launch in launches if name == region]

        def run(mine=mine):
            for launch in mine:
                launch()

        with s:                              # warm-up calls on the engine's stream, then graph replays
            out[region] = time_cuda(run, warmup=warmup, iters=iters, graph=True)["median"]
            for name, copy in saved.items():  # undo what the calls moved
                a[name][...] = copy
    s.synchronize()
    return out


def itl_breakdown(engine, prompt: list[int], steps: int = 32, iters: int = 20) -> dict:
    """Prefill `prompt`, then: graph ITL and eager ITL over `steps` steps each, and every
    region alone at the position reached. Needs graphs (GpuBackend(graphs=True)) and room
    for len(prompt) + 2 * steps + iters + 3 tokens in the pool."""
    if engine.graphs is None:
        raise ValueError("itl_breakdown needs an engine with CUDA graphs (graphs=True)")
    engine.prefill_enqueue(prompt)
    engine.stream.synchronize()
    graph = step_times(engine, steps, graphs=True)
    eager = step_times(engine, steps, graphs=False)
    context = engine.position
    regions = region_times(engine, iters=iters)
    total = sum(regions.values())
    result = {"context_tokens": context, "steps": steps, "region_iters": iters, "regions_ms": regions,
              "regions_sum_ms": total}
    for name, ms in (("graph", graph), ("eager", eager)):
        med = float(np.median(ms))
        result[name] = {"itl_ms": med, "p10": float(np.percentile(ms, 10)), "p90": float(np.percentile(ms, 90)),
                        "kernel_gap_ms": med - total}
    engine.reset()
    return result


def prefill_region_times(engine, prompt: list[int], iters: int = 10) -> dict[str, float]:
    """The tensor-core prefill of `prompt` (one chunk, len(prompt) <= engine.chunk), region
    by region (GpuBackend.prefill_launches): region -> median ms over all layers."""
    if len(prompt) > engine.chunk:
        raise ValueError(f"one chunk: at most {engine.chunk} tokens, got {len(prompt)}")
    engine.prefill_enqueue(prompt)
    engine.stream.synchronize()
    out = region_times(engine, engine.prefill_launches(0, len(prompt)), iters=iters,
                       restore=("p.x", "s.scalars"))
    engine.reset()
    return out


def measure_cublas_fp16(t: int, n: int, k: int, iters: int = 10) -> float:
    """Median ms of cuBLAS (cupy.matmul) computing X W^T for random fp16 X [t, k] and W [n, k],
    FP32 accumulation: the dense FP16 product a quantized GEMM of that shape is compared with."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    x = rng.standard_normal((t, k), dtype=cp.float32).astype(cp.float16)
    w = rng.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
    y = cp.empty((t, n), cp.float16)

    def run():
        cp.matmul(x, w.T, out=y)

    ms = time_cuda(run, warmup=3, iters=iters)["median"]
    del x, w, y
    return ms


def prefill_breakdown(engine, prompt: list[int], iters: int = 10, tensor_tflops: float | None = None,
                      cublas: bool = False) -> dict:
    """The prefill of `prompt` (one chunk) region by region against each region's FLOP floor:
    its FLOPs (gpu.layer.prefill_region_flops) over the dense FP16 tensor-core rate measured
    now (timing.measure_tensor_ceiling, cuBLAS), unless given. Regions without FLOPs (norms,
    RoPE, embed) get no floor. cublas=True: each GEMM region also gets `cublas_ms`, cuBLAS's
    time for the same products on dense FP16 weights (nothing fused), measured now."""
    from nanoqwen_lib.gpu.layer import prefill_region_flops, prefill_regions
    from nanoqwen_lib.measure.timing import measure_tensor_ceiling
    ms = prefill_region_times(engine, prompt, iters=iters)
    flops = prefill_region_flops(engine.dims, len(prompt))
    rate = tensor_tflops or measure_tensor_ceiling()["tflops"]
    dense = {}
    if cublas:
        shapes = decode_gemv_shapes(engine.dims)
        for r in prefill_regions(engine.dims):
            if r.matrix is not None:
                if r.prefill not in dense:
                    dense[r.prefill] = [measure_cublas_fp16(len(prompt), *shapes[r.matrix]), 0]
                dense[r.prefill][1] += 1
    rows = {}
    for region, t in ms.items():
        f = flops.get(region, 0)
        rows[region] = {"ms": t, "flops": f, "tflops": f / (t * 1e-3) / 1e12 if f else None,
                        "floor_ms": f / (rate * 1e12) * 1e3 if f else None}
        if region in dense:
            rows[region]["cublas_ms"] = dense[region][0] * dense[region][1]
    total = sum(ms.values())
    floor = sum(flops.values()) / (rate * 1e12) * 1e3
    return {"tokens": len(prompt), "iters": iters, "tensor_ceiling_tflops": rate, "regions": rows,
            "regions_sum_ms": total, "floor_ms": floor, "kind": engine.prefill_kind}


def format_prefill_breakdown(b: dict) -> str:
    with_dense = any("cublas_ms" in r for r in b["regions"].values())
    lines = [f"prefill breakdown, {b['tokens']} tokens ({b['kind']}; medians, regions replayed alone; "
             f"floors at {b['tensor_ceiling_tflops']:.0f} TFLOP/s, cuBLAS FP16 measured now"
             + ("; cuBLAS ms: the same products on dense FP16 weights)" if with_dense else ")"),
             f"{'region':<20}{'ms':>9}{'floor ms':>10}{'TFLOP/s':>9}{'of ceiling':>12}"
             + (f"{'cuBLAS ms':>11}{'x cuBLAS':>10}" if with_dense else "")]
    for region, r in b["regions"].items():
        if r["flops"]:
            line = (f"{region:<20}{r['ms']:>9.3f}{r['floor_ms']:>10.3f}{r['tflops']:>9.0f}"
                    f"{r['floor_ms'] / r['ms']:>12.1%}")
            if "cublas_ms" in r:
                line += f"{r['cublas_ms']:>11.3f}{r['ms'] / r['cublas_ms']:>9.2f}x"
            lines.append(line)
        else:
            lines.append(f"{region:<20}{r['ms']:>9.3f}{'-':>10}{'-':>9}{'-':>12}")
    lines.append(f"{'sum of regions':<20}{b['regions_sum_ms']:>9.3f}{b['floor_ms']:>10.3f}{'':>9}"
                 f"{b['floor_ms'] / b['regions_sum_ms']:>12.1%}")
    return "\n".join(lines)


def format_breakdown(b: dict) -> str:
    lines = [f"ITL breakdown at a context of {b['context_tokens']} tokens (medians; regions replayed alone)",
             f"{'region':<20}{'ms/token':>10}{'of graph ITL':>14}"]
    g = b["graph"]["itl_ms"]
    for region, ms in b["regions_ms"].items():
        lines.append(f"{region:<20}{ms:>10.4f}{ms / g:>14.1%}")
    lines.append(f"{'sum of regions':<20}{b['regions_sum_ms']:>10.4f}{b['regions_sum_ms'] / g:>14.1%}")
    for name in ("graph", "eager"):
        r = b[name]
        lines.append(f"{name:<6} ITL {r['itl_ms']:.4f} ms (p10 {r['p10']:.4f}, p90 {r['p90']:.4f}); "
                     f"kernel_gap {r['kernel_gap_ms']:.4f} ms ({r['kernel_gap_ms'] / r['itl_ms']:.1%})")
    lines.append(f"eager / graph ITL: {b['eager']['itl_ms'] / g:.2f}x")
    return "\n".join(lines)
