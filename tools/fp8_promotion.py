"""How often the FP8 wgmma GEMM must promote the tensor core's sums into FP32 (issue 29, item 3;
needs a GPU). Hopper's FP8 MMA keeps fewer bits of its running sum than FP32, so
kernels/prefill_wgmma.cu sums NQ_PW_FP8_PROMOTE k values (32, 64 or 128) in a fresh fragment
and adds each into an FP32 total. This measures, per interval:

1. the error of the GEMM against float64 on the 7B's four shapes at T tokens, with operands as
   the engine makes them (activations ~N(0, 1) with a few outlier channels, quantized per token
   by ops_fp8.quantize_rows_fp8; weights ~N(0, 0.02) quantized per row): max and mean of
   |out - ref| / rms(ref) over every element, the mma.sync kernel (FP32 sums) beside it, and
   the time (CUDA events, median of --reps after warm-up);
2. the FP8 engine's greedy tokens against the reference on the synthetic `tiny` FP8 file
   (tests/test_gpu_engine_fp8.py's prompts: 3, 16 and 33 tokens, 32 new tokens each), the
   prefill on wgmma with that interval, and on mma.sync.

    python3 tools/fp8_promotion.py [--tokens 512] [--reps 20] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prefill import median_us  # noqa: E402
from nanoqwen_lib import config  # noqa: E402
from nanoqwen_lib.format import quant  # noqa: E402
from nanoqwen_lib.format.layout import decode_gemv_shapes  # noqa: E402

INTERVALS = (32, 64, 128)


def activations(rng, t: int, k: int) -> np.ndarray:
    """fp16 [T, K]: N(0, 1) with 1% of channels 20x larger (the outlier channels real
    activations have, which set each token's E4M3 scale)."""
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, rng.choice(k, max(1, k // 100), replace=False)] *= 20
    return x.astype(np.float16)


def gemm_errors(cp, ops_fp8, rng, name: str, n: int, k: int, t: int, reps: int) -> dict:
    x = cp.asarray(activations(rng, t, k))
    codes_h, scales_h = quant.quantize_fp8_rowwise(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
    codes, scales = cp.asarray(codes_h), cp.asarray(scales_h)
    xq, ts = cp.empty((t, k), cp.uint8), cp.empty(t, cp.float32)
    ops_fp8.quantize_rows_fp8(x, xq, ts)
    values = cp.asarray(quant.E4M3_VALUES.astype(np.float64))
    a = values[xq] * ts.astype(cp.float64)[:, None]
    ref = cp.empty((t, n))
    for r in range(0, n, 4096):
        ref[:, r:r + 4096] = a @ (values[codes[r:r + 4096]] * scales[r:r + 4096].astype(cp.float64)[:, None]).T
    rms = float(cp.sqrt(cp.mean(ref * ref)))
    out = cp.empty((t, n), cp.float16)
    res = {}
    runs = [("mma", dict(kernel="mma"))] + [(f"wgmma promote {p}", dict(kernel="wgmma", promote=p)) for p in INTERVALS]
    for label, kw in runs:
        out.fill(np.nan)
        ops_fp8.gemm_fp8(xq, ts, codes, scales, out, **kw)
        cp.cuda.Device().synchronize()
        err = cp.abs(out.astype(cp.float64) - ref) / rms
        if not bool(cp.isfinite(err).all()):
            raise SystemExit(f"{name} {label}: non-finite outputs (a kernel left the poison)")
        us = median_us(lambda: ops_fp8.gemm_fp8(xq, ts, codes, scales, out, **kw), 5, reps)
        res[label] = {"max_err_rms": float(err.max()), "mean_err_rms": float(err.mean()), "us": us,
                      "tflops": 2 * t * n * k / us / 1e6}
        print(f"  {name:8s} {label:18s} max {res[label]['max_err_rms']:.2e}  mean {res[label]['mean_err_rms']:.2e}"
              f"  {us:8.1f} us ({res[label]['tflops']:.0f} TFLOP/s)", flush=True)
    return res


def greedy(cp, ops_fp8) -> dict:
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.measure.validate import greedy_agreement
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.synthetic.packed import packed_synthetic

    f = NanoqwenFile.open(packed_synthetic("tiny", weights="fp8"))
    ref = ReferenceModel(f.dims, f.model_tensors(), xp=cp)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 151643, n).tolist() for n in (3, 16, 33)]
    refs = [ref.greedy(p, 32) for p in prompts]
    out, default = {}, ops_fp8.WGMMA_FP8_PROMOTE
    for label, gemm, p in [("mma", "mma", default)] + [(f"wgmma promote {p}", "wgmma", p) for p in INTERVALS]:
        ops_fp8.WGMMA_FP8_PROMOTE = p            # the launcher's default interval, read at each call
        try:
            a = greedy_agreement(GpuBackend(f, max_tokens=256, prefill_gemm=gemm), ref, prompts, 32, refs=refs)
        finally:
            ops_fp8.WGMMA_FP8_PROMOTE = default
        out[label] = {"identical": a.identical, "tokens": a.tokens, "divergences": a.divergences,
                      "near_tie_divergences": a.near_tie_divergences, "summary": a.summary()}
        print(f"  greedy {label:18s} {a.summary()}", flush=True)
    return out


def main() -> None:
    import cupy as cp

    from nanoqwen_lib.gpu import ops_fp8

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = decode_gemv_shapes(config.load().model("7b"))
    result = {"tokens": a.tokens, "reps": a.reps, "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "gemm": {}, "greedy": {}}
    print(f"FP8 GEMM error against float64 (|out - ref| / rms(ref)), T = {a.tokens}")
    for name in ("qkv", "o_proj", "gate_up", "down"):
        result["gemm"][name] = gemm_errors(cp, ops_fp8, rng, name, *shapes[name], a.tokens, a.reps)
    print("FP8 engine, greedy tokens against the reference (tiny FP8 file)")
    result["greedy"] = greedy(cp, ops_fp8)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
