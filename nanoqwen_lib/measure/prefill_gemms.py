"""The prefill's GEMMs one by one: each projection of a layer at T tokens on each of our
kernels and on cuBLAS, in one process (needs a GPU).

    rates(dims, tokens) -> rows {"matrix", "kernel", "ms", "tflops"} for
      rs           ops_prefill_rs.gemm_int4_rs on the RS copies (the engine's default: the build
                   plan_rs picks for the shape and this GPU's SMs), the layer's epilogue as below;
                   gate_up with SwiGLU fused (gemm_int4_rs_swiglu on the SwiGLU row order)
      wgmma        ops_prefill.gemm_int4(kernel="wgmma") with the layer's epilogue (qkv + bias,
                   o_proj and down + residual in place); gate_up with SwiGLU fused (act out)
      mma          the same on mma.sync (gate_up without SwiGLU: that kernel writes gate_up)
      cublas fp16  cupy.matmul of fp16 X by dense fp16 weights (the same shape, no epilogue):
                   the library a reader would otherwise call, weights 4x larger
      fp8 wgmma / fp8 mma   ops_fp8.gemm_fp8 on E4M3 operands (activation quantization not
                   included: it is its own launch, timed by the breakdown)

Timing: timing.time_cuda (warm-up, then CUDA events around each of `iters` eager launches,
median; graph=True: around replays of a CUDA graph of `inner` launches, the GPU's own time
without the host's launch cost). Inputs are random; the weights are random codes and scales, since speed does not
depend on their values.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import ModelDims
from nanoqwen_lib.format.layout import decode_gemv_shapes
from nanoqwen_lib.measure.timing import time_cuda

KERNELS = ("rs", "wgmma", "mma", "cublas fp16", "fp8 wgmma", "fp8 mma")


def _random_operands(rng, t: int, n: int, k: int):
    import cupy as cp
    x = cp.asarray(rng.standard_normal((t, k), dtype=np.float32).astype(np.float16))
    words = cp.asarray(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32))
    scales = cp.asarray(rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16))
    return x, words, scales


def rates(dims: ModelDims, tokens: int, kernels=KERNELS, warmup: int = 3, iters: int = 20, seed: int = 0,
          progress=None, graph: bool = False, inner: int = 10) -> list[dict]:
    import cupy as cp

    from nanoqwen_lib.gpu import ops_fp8, ops_prefill, ops_prefill_rs as prefill_rs
    from nanoqwen_lib.gpu.hardware import hardware
    sms = hardware().sms
    rng = np.random.default_rng(seed)
    rows = []
    for matrix, (n, k) in decode_gemv_shapes(dims).items():
        if progress:
            progress(f"{matrix} ({n} x {k}, T = {tokens})")
        x, words, scales = _random_operands(rng, tokens, n, k)
        out = cp.zeros((tokens, n), cp.float16)
        bias = cp.asarray(rng.standard_normal(n, dtype=np.float32).astype(np.float16)) if matrix == "qkv" else None
        res = out if matrix in ("o_proj", "down") else None
        flops = 2.0 * tokens * n * k
        launches = {}
        for kern in ("wgmma", "mma"):
            if matrix == "gate_up" and kern == "wgmma":
                act = cp.empty((tokens, n // 2), cp.float16)
                launches[kern] = lambda act=act: ops_prefill.gemm_int4_gate_up_swiglu(x, words, scales, act)
            else:
                launches[kern] = lambda kern=kern: ops_prefill.gemm_int4(x, words, scales, out, bias=bias,
                                                                         residual=res, kernel=kern)
        if "rs" in kernels:
            build = prefill_rs.plan_rs(tokens, n, sms)          # planned once, outside the timed launch
            if matrix == "gate_up":
                w_rs, s_rs = prefill_rs.swiglu_rows(words, scales)
                w_rs, s_rs = prefill_rs.rs_order(w_rs), prefill_rs.rs_scales(s_rs)
                act_rs = cp.empty((tokens, n // 2), cp.float16)
                launches["rs"] = lambda: prefill_rs.gemm_int4_rs_swiglu(x, w_rs, s_rs, act_rs, **build)
            else:
                w_rs, s_rs = prefill_rs.rs_order(words), prefill_rs.rs_scales(scales)
                launches["rs"] = lambda: prefill_rs.gemm_int4_rs(x, w_rs, scales, out, bias=bias, residual=res,
                                                                scales_rs=s_rs, **build)
        w16 = cp.asarray(rng.standard_normal((k, n), dtype=np.float32).astype(np.float16))   # dense W^T
        launches["cublas fp16"] = lambda: cp.matmul(x, w16, out=out)
        codes = cp.asarray(rng.integers(0, 256, size=(n, k), dtype=np.uint8) & 0xF7)   # finite E4M3 codes
        s8 = cp.asarray(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        xq, ts = cp.empty((tokens, k), cp.uint8), cp.empty(tokens, cp.float32)
        ops_fp8.quantize_rows_fp8(x, xq, ts)
        for kern in ("wgmma", "mma"):
            launches[f"fp8 {kern}"] = lambda kern=kern: ops_fp8.gemm_fp8(xq, ts, codes, s8, out, bias=bias,
                                                                         residual=res, kernel=kern)
        for kern in kernels:
            ms = time_cuda(launches[kern], warmup=warmup, iters=iters, graph=graph,
                           inner=inner if graph else 1)["median"]
            rows.append({"matrix": matrix, "n": n, "k": k, "kernel": kern, "ms": ms,
                         "tflops": flops / (ms * 1e-3) / 1e12})
        del w16, codes, x, words, scales, out
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def per_layer(rows: list[dict]) -> dict[str, float]:
    """kernel -> ms for one layer's four GEMMs."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["kernel"]] = out.get(r["kernel"], 0.0) + r["ms"]
    return out


def format_rates(rows: list[dict], num_layers: int) -> str:
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    table = {(r["matrix"], r["kernel"]): r for r in rows}
    lines = [f"{'matrix':<9}" + "".join(f"{k:>13}" for k in kernels) + "   (TFLOP/s)"]
    for matrix in dict.fromkeys(r["matrix"] for r in rows):
        lines.append(f"{matrix:<9}" + "".join(f"{table[matrix, k]['tflops']:>13.0f}" for k in kernels))
    layer = per_layer(rows)
    lines.append(f"{'layer ms':<9}" + "".join(f"{layer[k]:>13.3f}" for k in kernels))
    lines.append(f"{'x' + str(num_layers):<9}" + "".join(f"{layer[k] * num_layers:>13.2f}" for k in kernels))
    return "\n".join(lines)
