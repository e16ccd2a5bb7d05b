"""Launchers of the lab's FP8 GEMM on wgmma (kernels/lab/wgmma_fp8.cu, sm_90a), with the
engine's contract (ops_fp8.gemm_fp8): `impl` "mma_sync" runs the engine's kernel, "wgmma" the
lab's. Both meet the same FP32-sum bound on the H200 (9542ec2): wgmma v1a.1 promotes each
wgmma's sum into FP32 registers (NQ_WGMMA_PROMOTE_K), since the FP8 wgmma accumulator keeps
fewer bits than FP32 (v1a, without it, missed the bound on ~0.1% of outputs). The engine
keeps "mma_sync": wgmma v1a.1 (one warpgroup per 64 x 64 tile, no pipeline) is no faster at
qkv and 1.27-1.38x slower at the other 7B shapes, T = 512 (book/data/prefill-fp8.json).
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.gpu import cuda_build, ops_fp8
from nanoqwen_lib.gpu.launch_checks import device_ptr

_G = load().geometry["lab/wgmma_fp8"]   # kernels/lab/wgmma_fp8.cu gets the same values as -D
WGMMA_BM, WGMMA_BN, WGMMA_BK, WGMMA_THREADS = (_G["NQ_WGMMA_BM"], _G["NQ_WGMMA_BN"], _G["NQ_WGMMA_BK"],
                                               _G["NQ_WGMMA_THREADS"])
GEMM_IMPLS = ("mma_sync", "wgmma")


@functools.lru_cache(maxsize=None)
def _wgmma_kernel():
    return cuda_build.load_module("lab/wgmma_fp8", None).get_function("nq_gemm_fp8_wgmma")


def gemm_fp8(xq, ts, codes, scales, out, bias=None, residual=None, impl: str = "wgmma") -> None:
    """ops_fp8.gemm_fp8's contract; impl "mma_sync" (K a multiple of 64) or "wgmma" (128)."""
    if impl not in GEMM_IMPLS:
        raise NanoqwenError("lab.fp8.gemm_fp8", "impl", f"one of {GEMM_IMPLS}", repr(impl))
    if impl == "mma_sync":
        ops_fp8.gemm_fp8(xq, ts, codes, scales, out, bias, residual)
        return
    t, n, k = ops_fp8.check_gemm("gemm_fp8", xq, ts, codes, scales, out, bias, residual, WGMMA_BK)
    args = (xq, ts, codes, scales, device_ptr(bias), device_ptr(residual), out, np.int32(t), np.int32(n), np.int32(k))
    _wgmma_kernel()((-(-t // WGMMA_BM), -(-n // WGMMA_BN)), (WGMMA_THREADS,), args)
