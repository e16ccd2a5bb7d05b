"""The lab's RS-form INT4 GEMM (kernels/prefill_rs.cu) timed against the engine's wgmma
plan (prefill_wgmma.cu) and cuBLAS FP16 on the 7B's four shapes, in one process (needs a GPU).

    python3 tools/bench_prefill_rs.py [--tokens 512 ...] [--shapes qkv ...] [--builds NAME ...] [--reps 20] [--json OUT]

Each shape: its GEMM checked once against the engine's wgmma output (the same w16 = fp16(code *
scale) contract; the two sum in other orders, so within a few fp16 ulps, not bit-equal), then
each build timed with CUDA events, median of --reps after warm-up; TFLOP/s = 2 T N K / time.
The builds: BUILDS below (default: the default build and the variants tests/test_gpu_prefill_rs.py
checks); "probe" builds time a part of the kernel (kernels/prefill_rs.cu, NQ_RS_PROBE) and
their values are not checked.
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
from nanoqwen_lib.format.layout import decode_gemv_shapes  # noqa: E402

BUILDS = {"rs": {}, "rs 3 consumers": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}, "rs kg2": {"NQ_RS_KG": 2},
          "rs 3c kg2": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6, "NQ_RS_KG": 2},
          "rs 3c st4": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 4}, "rs 3c st8": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 8},
          "rs 3c bm64": {"NQ_RS_CWG": 3, "NQ_RS_BM": 64, "NQ_RS_STAGES": 8}, "rs bm64": {"NQ_RS_BM": 64},
          # W by LDG into registers (the first build measured; PERFLOG says why it waits)
          "rs global": {"NQ_RS_WSMEM": 0}, "rs global 3c": {"NQ_RS_WSMEM": 0, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6},
          "rs global overlap": {"NQ_RS_WSMEM": 0, "NQ_RS_OVERLAP": 1},
          # [rs-overlap]: a group a k16 step, two fragment sets, conversion under the own wgmmas
          "rs overlap": {"NQ_RS_OVERLAP": 2}, "rs 3c overlap": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6, "NQ_RS_OVERLAP": 2},
          "probe wgmma only": {"NQ_RS_PROBE": 1}, "probe convert only": {"NQ_RS_PROBE": 2},
          "probe 3c wgmma only": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6, "NQ_RS_PROBE": 1},
          "probe 3c convert only": {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6, "NQ_RS_PROBE": 2},
          "probe global wgmma only": {"NQ_RS_WSMEM": 0, "NQ_RS_PROBE": 1}}
DEFAULT_BUILDS = ("rs", "rs 3 consumers", "rs kg2", "rs global", "rs global 3c")


def main() -> None:
    import cupy as cp

    from nanoqwen_lib.gpu import ops_prefill
    from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--shapes", nargs="+", default=["qkv", "o_proj", "gate_up", "down"])
    ap.add_argument("--builds", nargs="+", default=list(DEFAULT_BUILDS), choices=list(BUILDS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = decode_gemv_shapes(config.load().model("7b"))
    out_json = {"reps": a.reps, "builds": {b: BUILDS[b] for b in a.builds}, "runs": {}}
    for t in a.tokens:
        print(f"T = {t}, median us (TFLOP/s) of {a.reps}")
        for name in a.shapes:
            out_json["runs"][f"{name} T={t}"] = one_shape(cp, ops_prefill, prefill_rs, rng, name, *shapes[name], t, a)
    if a.json:
        a.json.write_text(json.dumps(out_json, indent=1))


def one_shape(cp, ops_prefill, prefill_rs, rng, name, n, k, t, a) -> dict:
    """One shape at T tokens: cuBLAS FP16, the engine's wgmma plan and each build (median us)."""
    words = cp.asarray(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32))
    scales = cp.asarray(rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16))
    w_rs, s_rs = prefill_rs.rs_order(words), prefill_rs.rs_scales(scales)   # on the GPU
    x = cp.asarray(rng.standard_normal((t, k)).astype(np.float16))
    ref, out = cp.empty((t, n), cp.float16), cp.empty((t, n), cp.float16)
    ops_prefill.gemm_int4(x, words, scales, ref, kernel="wgmma")
    flop = 2.0 * t * n * k
    res = {"n": n, "k": k}
    res["wgmma plan"] = median_us(lambda: ops_prefill.gemm_int4(x, words, scales, ref, kernel="wgmma"), 5, a.reps)
    w16 = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
    res["cublas fp16"] = median_us(lambda: cp.matmul(x, w16.T, out=out), 5, a.reps)
    for b in a.builds:
        change = BUILDS[b]
        out.fill(np.nan)
        prefill_rs.gemm_int4_rs(x, w_rs, scales, out, scales_rs=s_rs, **change)
        if not b.startswith("probe"):
            d = cp.abs(out.astype(cp.float32) - ref.astype(cp.float32))
            tol = 4 * cp.maximum(cp.abs(ref.astype(cp.float32)) * 2.0**-10, 2.0**-14)
            res[b + " mismatches"] = int(cp.count_nonzero(~(d <= tol)))
        res[b] = median_us(lambda: prefill_rs.gemm_int4_rs(x, w_rs, scales, out, scales_rs=s_rs, **change), 5, a.reps)
    swiglu = []
    if name == "gate_up":   # the MLP's first GEMM with its SwiGLU: the engine's fused wgmma, and the RS epilogue
        i = n // 2
        act = cp.empty((t, i), cp.float16)
        res["wgmma plan swiglu"] = median_us(lambda: ops_prefill.gemm_int4_gate_up_swiglu(x, words, scales, act),
                                             5, a.reps)
        sw, ss = prefill_rs.swiglu_rows(words, scales)
        sw_rs, ss_rs = prefill_rs.rs_order(sw), prefill_rs.rs_scales(ss)
        swiglu = ["wgmma plan swiglu"]
        for b in a.builds:
            change = BUILDS[b]
            if b.startswith("probe") or not change.get("NQ_RS_WSMEM", 1):
                continue
            res[b + " swiglu"] = median_us(lambda: prefill_rs.gemm_int4_rs_swiglu(x, sw_rs, ss_rs, act, **change),
                                           5, a.reps)
            swiglu.append(b + " swiglu")
    line = f"{name:<8} N {n:>6} K {k:>6}: " + ", ".join(
        f"{key} {res[key]:.1f} ({flop / res[key] / 1e6:.0f})" + (f" [{res[key + ' mismatches']} off]"
                                                               if key + " mismatches" in res else "")
        for key in ("cublas fp16", "wgmma plan", *a.builds, *swiglu))
    print(line, flush=True)
    return res


if __name__ == "__main__":
    main()
