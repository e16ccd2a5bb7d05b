"""Launchers for kernels/prefill_wgmma.cu (sm_90a, warp-specialized wgmma): the INT4 prefill GEMM
(ops_prefill.gemm_int4 with kernel="wgmma" launches it through _launch_wgmma), its fused gate_up
SwiGLU, and the plan, grid and kernel builds that ops_fp8.gemm_fp8(kernel="wgmma") uses for the
file's FP8 kernel too.

    gemm_int4_gate_up_swiglu(x, qweight, scales, act)    act [T, I] = fp16(silu(g) * u), [g | u] = fp16(x W^T)
    plan_wgmma(t, n, k, *, stage_k, bns, int4) -> (bn, split)   the build (BN) and split-K (wave model)
    wgmma_stage_bytes(bn), wgmma_stages(bn), wgmma_smem_bytes(bn, stages)   a build's ring in shared memory
    wgmma_int4_threads(bn), wgmma_int4_ktile_bn(bn)      an INT4 build's block size, its k-tile cost in the plan
    xmap(x, box_k)                                       the device tensor map of the activation

Split-K partials go to ops_prefill_mma.workspace() (one workspace for both GEMMs, called through
that module). Arguments go through launch_checks.check_prefill_gemm; errors name the public
launcher (ops_prefill.<fn>), whose module re-exports these names.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu import cuda_build, ops_prefill_mma
from nanoqwen_lib.gpu.launch_checks import check_int4_weights, check_prefill_gemm, device_ptr
from nanoqwen_lib.gpu.ops_gemv import num_sms
from nanoqwen_lib.gpu.ops_prefill_mma import SPLIT_MIN_KTILES, WS_COUNTERS, WS_FLOATS

# nanoqwen.yaml `geometry: prefill_wgmma` and `tuning: prefill_wgmma`; NQ_PW_BN is a build
# variant, plan_wgmma picks one of WGMMA_BN_CHOICES.
_PW = load().geometry["prefill_wgmma"]
_PWT = load().tuning["prefill_wgmma"].defines
WGMMA_BM, WGMMA_ROW_BYTES, WGMMA_THREADS = _PW["NQ_PW_BM"], _PW["NQ_PW_ROW_BYTES"], _PW["NQ_PW_THREADS"]
WGMMA_INT4_2P_MAX_BN = _PW["NQ_PW_INT4_2P_MAX_BN"]   # INT4 / SwiGLU builds with bn <= this: 2 producer warpgroups


def wgmma_int4_threads(bn: int) -> int:
    """Block size of nq_prefill_wgmma[_swiglu] built with NQ_PW_BN = bn (the kernel's INT4_THREADS):
    512 (2 dequantizing producer warpgroups + 2 consumers) for bn <= NQ_PW_INT4_2P_MAX_BN, else
    WGMMA_THREADS (384: 1 + 2). The FP8 kernel is always WGMMA_THREADS."""
    return 512 if bn <= WGMMA_INT4_2P_MAX_BN else WGMMA_THREADS


WGMMA_BK = WGMMA_ROW_BYTES // 2      # k per stage (fp16 operands)
WGMMA_STAGES = _PWT["NQ_PW_STAGES"]
WGMMA_BN = _PWT["NQ_PW_BN"]
WGMMA_BN_CHOICES = (112, 128, 144, 256)   # the builds (the file's nq-variants line + the default)
WGMMA_FILL_KTILES = 4                # prologue + epilogue of a CTA in k-tile times (plan_wgmma's wave model)
# split-K slices the plan considers (measured up to 4; the model ignores the reduction)
WGMMA_SPLIT_MAX = 4
# INT4: each extra split-K slice costs the CTA this many k-tiles (v3: qkv bn 256 s3 112 us vs s1 98)
WGMMA_SPLIT_KTILES = 4
WGMMA_KTILE_OVERHEAD = 128           # a k-tile costs bn + this (the v3 H200 fit: bn 256 / bn 128 = 1.32x)
SMEM_OPTIN = load().hardware["smem_optin"]   # sm_90's per-block opt-in maximum (227 KiB): the ring is
# sized for it at build time, on a CPU too; gpu.hardware checks a device against sm_90 first


def wgmma_stage_bytes(bn: int, row_bytes: int = WGMMA_ROW_BYTES) -> int:
    """One ring stage of nq_prefill_wgmma*: the A tile (WGMMA_BM rows), the B tile (bn rows)
    of row_bytes each, and the INT4 packed words of the bn weight rows (32 bytes each, padded
    to 1 KiB; the FP8 kernel leaves it unused)."""
    return (WGMMA_BM + bn) * row_bytes + -(-bn * 32 // 1024) * 1024


def wgmma_stages(bn: int, row_bytes: int = WGMMA_ROW_BYTES) -> int:
    """The ring depth for a BN build: as many stages as fit SMEM_OPTIN (2 KiB kept for the
    alignment slack, barriers and static shared memory), at most 8: with TMA there is no
    per-thread cost to a deeper ring, and the loads need ~2 us of cover (bn 256: 4, bn 128: 6)."""
    return max(2, min(8, (SMEM_OPTIN - 2048) // wgmma_stage_bytes(bn, row_bytes)))


def xmap(x, box_k: int):
    """The device tensor map of the activation x [T, K] (fp16: box_k 64; E4M3: 128): boxes of
    WGMMA_BM rows x 128 bytes, 128B swizzle (prefill_wgmma.cu's A tile); cached per pointer+shape."""
    from nanoqwen_lib.gpu import tensor_map
    return tensor_map.device_map(x, (WGMMA_BM, box_k), swizzle="128B")


def wgmma_smem_bytes(bn: int, stages: int | None = None) -> int:
    """Dynamic shared memory of nq_prefill_wgmma*: stages * wgmma_stage_bytes, 1024 bytes of
    alignment slack, the 3 * stages barriers (full, empty, raw)."""
    stages = stages or wgmma_stages(bn)
    return stages * wgmma_stage_bytes(bn) + 1024 + 3 * stages * 8


def wgmma_int4_ktile_bn(bn: int) -> int:
    """What an INT4 k-tile costs in plan_wgmma's units (the k-tile then costs this +
    WGMMA_KTILE_OVERHEAD), fit to the v5 H200 run at T = 512 (PERFLOG, prefill v5; per-k-tile
    times of one-wave grids): the 512-thread builds (2 producer warpgroups, bn <= 128) bn + 12;
    the 384-thread builds' single producer makes bn 144 cost 234 and bn 256 cost 352 (qkv
    bn 144 s1 87.5 us, bn 256 s1 115.9, bn 112 s1 120.3; o_proj bn 112 s1 100.4)."""
    return {144: 234, 256: 352}.get(bn, bn + 12) if wgmma_int4_threads(bn) != 512 else bn + 12


def plan_wgmma(t: int, n: int, k: int, *, stage_k: int = WGMMA_BK, bns=WGMMA_BN_CHOICES,
               int4: bool = True) -> tuple[int, int]:
    """(bn, split) for a [t, k] x [n, k]^T GEMM on the wgmma kernel (n: output features; for
    the fused gate_up SwiGLU the 2 I weight rows). Wave model: a CTA's k-tile costs time in
    proportion to bn + WGMMA_KTILE_OVERHEAD (tensor-core time plus a per-k-tile cost, fit to
    the H200: nanoqwen.yaml lists the picks at T = 512); rounds of ceil(ctas / SMs) waves
    times (k-tiles per slice + WGMMA_FILL_KTILES); split-K only where a slice keeps
    SPLIT_MIN_KTILES k-tiles and the partials fit the workspace. Ties go to the larger bn
    (fewer re-reads of X), then to no split. int4 (the INT4 kernels): a k-tile costs
    wgmma_int4_ktile_bn(bn) + WGMMA_KTILE_OVERHEAD and a CTA of split s adds (s - 1) *
    WGMMA_SPLIT_KTILES k-tiles (the reduction); FP8 (int4=False): bn + that, no reduction term
    (v4's plan, unchanged)."""
    sms, ktiles = num_sms(), k // stage_k
    best = None
    for bn in bns:
        tiles = -(-t // WGMMA_BM) * -(-n // bn)
        for s in range(1, WGMMA_SPLIT_MAX + 1):
            if s > 1 and (ktiles // s < SPLIT_MIN_KTILES or s * tiles * WGMMA_BM * bn > WS_FLOATS
                          or tiles > WS_COUNTERS):
                continue
            kbn = wgmma_int4_ktile_bn(bn) if int4 else bn
            red = (s - 1) * WGMMA_SPLIT_KTILES if int4 else 0
            cost = -(-tiles * s // sms) * (-(-ktiles // s) + WGMMA_FILL_KTILES + red) * (kbn + WGMMA_KTILE_OVERHEAD)
            key = (cost, -bn, s)
            if best is None or key < best[0]:
                best = (key, bn, s)
    return best[1], best[2]


@functools.lru_cache(maxsize=None)
def _wgmma_kernel(name: str, bn: int, stages: int, promote: int | None = None):
    """A build of prefill_wgmma.cu (promote: FP8's NQ_PW_FP8_PROMOTE, None the tuning's)."""
    extra = {"NQ_PW_BN": bn, "NQ_PW_STAGES": stages, **({"NQ_PW_FP8_PROMOTE": promote} if promote else {})}
    kern = cuda_build.load_module("prefill_wgmma", None, extra).get_function(name)
    kern.max_dynamic_shared_size_bytes = wgmma_smem_bytes(bn, stages)
    return kern


def _wgmma_grid(where: str, t: int, n_tiles_of: int, k: int, bn, split, stages, stage_k: int, plan_n: int):
    """Checks the wgmma options; returns (bn, split, stages, grid)."""
    if bn is None or split is None:
        pbn, psplit = plan_wgmma(t, plan_n, k, stage_k=stage_k)
        bn, split = bn or pbn, split or psplit
    if bn not in WGMMA_BN_CHOICES:
        raise NanoqwenError(where, "bn", f"one of {WGMMA_BN_CHOICES}", bn)
    stages = stages or wgmma_stages(bn)
    if not 2 <= stages <= 8 or wgmma_smem_bytes(bn, stages) > SMEM_OPTIN:
        raise NanoqwenError(where, "stages", f"2 .. {wgmma_stages(bn)} (shared memory) for bn {bn}", stages)
    if not 1 <= split <= k // stage_k:
        raise NanoqwenError(where, "split", f"1 .. {k // stage_k} (k-tiles of {stage_k})", split)
    tiles = -(-t // WGMMA_BM) * -(-n_tiles_of // bn)
    if split > 1 and (split * tiles * WGMMA_BM * bn > WS_FLOATS or tiles > WS_COUNTERS):
        raise LimitError(where, "split-K workspace", f"split * tiles * {WGMMA_BM * bn} <= {WS_FLOATS} and "
                         f"tiles <= {WS_COUNTERS}", f"split {split}, tiles {tiles}", "a smaller split")
    return bn, split, stages, (-(-t // WGMMA_BM), -(-n_tiles_of // bn), split)


def _launch_wgmma(fn: str, kernel: str, x, qweight, scales, out, bias, residual, n: int, k: int,
                  bn, split, stages) -> None:
    """Checks N (a multiple of 8), x, out, bias, residual (launch_checks.check_prefill_gemm) and
    the wgmma options, then launches `kernel` (N x K: qweight's)."""
    where = f"ops_prefill.{fn}"
    if n % 8:
        raise NanoqwenError(where, "qweight.shape[0]", "N a multiple of 8 (kernel='wgmma'; 'mma' takes any N)", n)
    t = check_prefill_gemm(where, x, out, n, k, bias, residual, weight_elems=n * k // 8)
    bn, split, stages, grid = _wgmma_grid(where, t, n, k, bn, split, stages, WGMMA_BK, n)
    ws, counters = ops_prefill_mma.workspace() if split > 1 else (None, None)
    _wgmma_kernel(kernel, bn, stages)(
        grid, (wgmma_int4_threads(bn),),
        (x, qweight, scales, device_ptr(bias), device_ptr(residual), out, np.int32(t), np.int32(n), np.int32(k),
         device_ptr(ws), device_ptr(counters), xmap(x, WGMMA_BK), device_ptr(None)),   # wmap: FP8's only
        shared_mem=wgmma_smem_bytes(bn, stages))


def gemm_int4_gate_up_swiglu(x, qweight, scales, act, *, bn=None, split=None, stages=None) -> None:
    """act[T, I] = fp16(silu(g) * u) with [g | u] = fp16(x W^T), W the gate_up weight [2I, K]
    (gate rows, then up rows): the gate_up GEMM and swiglu_act in one wgmma kernel, the same bits
    as gemm_int4 into gate_up [T, 2I] then swiglu_act. x fp16 [T, K]; I a multiple of 8."""
    where = "ops_prefill.gemm_int4_gate_up_swiglu"
    n2, k = check_int4_weights(where, qweight, scales)
    if n2 % 16:
        raise NanoqwenError(where, "qweight.shape[0]", "2 I with I a multiple of 8", n2)
    inter = n2 // 2
    t = check_prefill_gemm(where, x, act, n2, k, weight_elems=n2 * k // 8, out_field="act", out_cols=inter,
                           out_offsets=False)     # the kernel writes act with 64-bit offsets
    # The CTA's bn weight rows are bn/2 features: plan and grid over the features.
    if bn is None or split is None:
        pbn, psplit = plan_wgmma(t, n2, k)
        bn, split = bn or pbn, split or psplit
    bn, split, stages, grid = _wgmma_grid(where, t, inter * 2, k, bn, split, stages, WGMMA_BK, n2)
    grid = (grid[0], -(-inter // (bn // 2)), split)
    if split > 1 and (split * grid[0] * grid[1] * WGMMA_BM * bn > WS_FLOATS or grid[0] * grid[1] > WS_COUNTERS):
        raise LimitError(where, "split-K workspace", "fits", f"split {split}", "a smaller split")
    ws, counters = ops_prefill_mma.workspace() if split > 1 else (None, None)
    _wgmma_kernel("nq_prefill_wgmma_swiglu", bn, stages)(
        grid, (wgmma_int4_threads(bn),),
        (x, qweight, scales, act, np.int32(t), np.int32(n2), np.int32(k), device_ptr(ws), device_ptr(counters),
         xmap(x, WGMMA_BK), device_ptr(None)),                # wmap: FP8's only
        shared_mem=wgmma_smem_bytes(bn, stages))
