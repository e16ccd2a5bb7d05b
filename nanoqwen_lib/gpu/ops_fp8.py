"""Launchers for the FP8 E4M3 kernels (kernels/fp8.cu), file layout 2.

    gemv_fp8(x, codes, scales, out, bias=None, residual=None)   decode: out = s * (codes . x) [+ b] [+ r]
    quantize_rows_fp8(x, xq, ts)                                 prefill: xq = E4M3(x / ts), per row
    gemm_fp8(xq, ts, codes, scales, out, bias=None, residual=None)
                                                                 prefill: out = ts s (xq codes^T) [+ b] [+ r]

gemm_fp8 runs fp8.cu's mma.sync kernel (sm_90: ptxas emulates the E4M3 MMA with FP16 HMMA).
The lab's wgmma kernel (kernels/lab/wgmma_fp8.cu, nanoqwen_lib.gpu.lab.fp8) has the same
contract and meets the same FP32-sum bound, and is no faster (book chapter 11).

codes uint8 [N, K] (E4M3, K contiguous) and scales fp32 [N] are a projection as the file
stores it (quant.quantize_fp8_rowwise). Every argument is checked before a kernel sees it.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_no_alias, check_prefill_gemm, device_ptr

# Kernel geometry: nanoqwen.yaml `geometry: fp8` (kernels/fp8.cu gets the same values as -D).
_G = load().geometry["fp8"]
GEMV_THREADS = _G["NQ_FP8_GEMV_THREADS"]
GEMV_ROWS_PER_CTA = GEMV_THREADS // 32          # one output row per warp at a time
QUANT_THREADS = _G["NQ_FP8_QUANT_THREADS"]
GEMM_BM, GEMM_BN, GEMM_BK, GEMM_THREADS = (_G["NQ_FP8_GEMM_BM"], _G["NQ_FP8_GEMM_BN"], _G["NQ_FP8_GEMM_BK"],
                                           _G["NQ_FP8_GEMM_THREADS"])
SMEM_LIMIT = 48 * 1024             # the GEMV keeps x (fp16) in shared memory: K <= 24576


@functools.lru_cache(maxsize=None)
def _kernel(name: str, module: str = "fp8"):
    return cuda_build.load_module(module, None).get_function(name)


def _check(fn, field, a, dtype, shape):
    check_device_buffer(f"ops_fp8.{fn}", field, a, dtype, shape)


def check_weights(fn: str, codes, scales, k_multiple: int) -> tuple[int, int]:
    """(N, K) of an FP8 projection, checked."""
    if getattr(codes, "ndim", 0) != 2:
        raise NanoqwenError(f"ops_fp8.{fn}", "codes.shape", "(N, K)", getattr(codes, "shape", None))
    n, k = codes.shape
    if n < 1 or k < k_multiple or k % k_multiple:
        raise NanoqwenError(f"ops_fp8.{fn}", "codes.shape", f"N >= 1 and K a multiple of {k_multiple}", (n, k))
    _check(fn, "codes", codes, np.uint8, (n, k))
    _check(fn, "scales", scales, np.float32, (n,))
    return n, k


def gemv_fp8(x, codes, scales, out, bias=None, residual=None) -> None:
    """out fp16 [N] = fp16(scales * (decode(codes) . x) [+ bias] [+ residual]), FP32 sums;
    x fp16 [K]; residual may be `out` (in place), x may not."""
    n, k = check_weights("gemv_fp8", codes, scales, 16)
    if 2 * k > SMEM_LIMIT:
        raise LimitError("ops_fp8.gemv_fp8", "K", f"<= {SMEM_LIMIT // 2} (x in 48 KiB of shared memory)", k)
    _check("gemv_fp8", "x", x, np.float16, (k,))
    _check("gemv_fp8", "out", out, np.float16, (n,))
    for field, a in (("bias", bias), ("residual", residual)):
        if a is not None:
            _check("gemv_fp8", field, a, np.float16, (n,))
    check_no_alias("ops_fp8.gemv_fp8", "out", out, x, "x")
    _kernel("nq_gemv_fp8")((-(-n // GEMV_ROWS_PER_CTA),), (GEMV_THREADS,),
                           (x, codes, scales, device_ptr(bias), device_ptr(residual), out, np.int32(n), np.int32(k)),
                           shared_mem=2 * k)


def quantize_rows_fp8(x, xq, ts) -> None:
    """xq uint8 [T, K] = E4M3(x / ts) per row (round to nearest even, saturating), ts fp32
    [T] = row absmax / 448 (0 for a zero row, whose codes are 0); x fp16 [T, K]."""
    if getattr(x, "ndim", 0) != 2 or x.shape[0] < 1 or x.shape[1] < 8 or x.shape[1] % 8:
        raise NanoqwenError("ops_fp8.quantize_rows_fp8", "x.shape", "(T, K), T >= 1, K a multiple of 8",
                            getattr(x, "shape", None))
    t, k = x.shape
    _check("quantize_rows_fp8", "x", x, np.float16, (t, k))
    _check("quantize_rows_fp8", "xq", xq, np.uint8, (t, k))
    _check("quantize_rows_fp8", "ts", ts, np.float32, (t,))
    _kernel("nq_quantize_rows_fp8")((t,), (QUANT_THREADS,), (x, xq, ts, np.int32(k)))


def check_gemm(fn: str, xq, ts, codes, scales, out, bias, residual, k_multiple: int) -> tuple[int, int, int]:
    """(T, N, K) of a prefill FP8 GEMM's arguments, every buffer checked: the prefill GEMMs'
    launch_checks.check_prefill_gemm (xq uint8 [T, K], out, bias, residual, T * K, T * N and
    N * K below 2^31; no alias check of xq and out, as before), then ts fp32 [T]."""
    n, k = check_weights(fn, codes, scales, k_multiple)
    t = check_prefill_gemm(f"ops_fp8.{fn}", xq, out, n, k, bias, residual, weight_elems=n * k, x_field="xq",
                           x_dtype=np.uint8, alias=False)
    _check(fn, "ts", ts, np.float32, (t,))
    return t, n, k


GEMM_KERNELS = ("mma", "wgmma")
WGMMA_FP8_BN_CHOICES = (112, 128)   # builds of prefill_wgmma.cu whose FP8 consumer fits its registers
# k values the wgmma kernel sums in the tensor core before each promotion into FP32; gemm_fp8(promote=None)
# reads WGMMA_FP8_PROMOTE at each call (tools/fp8_promotion.py measures each interval)
WGMMA_FP8_PROMOTE = load().tuning["prefill_wgmma"].defines["NQ_PW_FP8_PROMOTE"]
WGMMA_FP8_PROMOTES = (32, 64, 128)


def gemm_fp8(xq, ts, codes, scales, out, bias=None, residual=None, *, kernel="mma", bn=None, split=None,
             stages=None, promote=None) -> None:
    """out fp16 [T, N] = fp16(ts[t] scales[n] (xq codes^T)[t, n] [+ bias] [+ residual]) with
    E4M3 operands and FP32 accumulation; xq uint8 [T, K], ts fp32 [T] (quantize_rows_fp8);
    residual may be `out` (in place). kernel "mma": fp8.cu (K a multiple of GEMM_BK);
    "wgmma": prefill_wgmma.cu's nq_prefill_wgmma_fp8 (QGMMA, sums promoted into FP32 every 128 k;
    K a multiple of 128, N of 8); bn / split / stages override ops_prefill_wgmma.plan_wgmma, promote
    (wgmma: k values per promotion into FP32, one of WGMMA_FP8_PROMOTES) WGMMA_FP8_PROMOTE."""
    if kernel not in GEMM_KERNELS:
        raise NanoqwenError("ops_fp8.gemm_fp8", "kernel", f"one of {GEMM_KERNELS}", kernel)
    if kernel == "wgmma":
        from nanoqwen_lib.gpu import ops_prefill_mma, tensor_map
        from nanoqwen_lib.gpu import ops_prefill_wgmma as op
        where = "ops_fp8.gemm_fp8"
        t, n, k = check_gemm("gemm_fp8", xq, ts, codes, scales, out, bias, residual, op.WGMMA_ROW_BYTES)
        if n % 8:
            raise NanoqwenError(where, "codes.shape[0]", "N a multiple of 8 (kernel='wgmma')", n)
        if bn is None or split is None:
            pbn, psplit = op.plan_wgmma(t, n, k, stage_k=op.WGMMA_ROW_BYTES, bns=WGMMA_FP8_BN_CHOICES,
                                        int4=False)
            bn, split = bn or pbn, split or psplit
        if bn not in WGMMA_FP8_BN_CHOICES:
            raise NanoqwenError(where, "bn", f"one of {WGMMA_FP8_BN_CHOICES}", bn)
        promote = WGMMA_FP8_PROMOTE if promote is None else promote
        if promote not in WGMMA_FP8_PROMOTES:
            raise NanoqwenError(where, "promote", f"one of {WGMMA_FP8_PROMOTES}", promote)
        bn, split, stages, grid = op._wgmma_grid(where, t, n, k, bn, split, stages, op.WGMMA_ROW_BYTES, n)
        ws, counters = ops_prefill_mma.workspace() if split > 1 else (None, None)   # the prefill GEMMs' one
        op._wgmma_kernel("nq_prefill_wgmma_fp8", bn, stages, promote)(
            grid, (op.WGMMA_THREADS,),
            (xq, ts, codes, scales, device_ptr(bias), device_ptr(residual), out, np.int32(t), np.int32(n),
             np.int32(k), device_ptr(ws), device_ptr(counters), op.xmap(xq, op.WGMMA_ROW_BYTES),
             tensor_map.device_map(codes, (bn, op.WGMMA_ROW_BYTES), swizzle="128B")),
            shared_mem=op.wgmma_smem_bytes(bn, stages))
        return
    if bn is not None or split is not None or stages is not None or promote is not None:
        raise NanoqwenError("ops_fp8.gemm_fp8", "bn/split/stages/promote", "None with kernel='mma'",
                            (bn, split, stages, promote))
    t, n, k = check_gemm("gemm_fp8", xq, ts, codes, scales, out, bias, residual, GEMM_BK)
    args = (xq, ts, codes, scales, device_ptr(bias), device_ptr(residual), out, np.int32(t), np.int32(n), np.int32(k))
    _kernel("nq_gemm_fp8")((-(-t // GEMM_BM), -(-n // GEMM_BN)), (GEMM_THREADS,), args)
