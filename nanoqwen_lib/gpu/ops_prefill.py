"""Launchers for the prefill kernels (kernels/prefill_gemm.cu, kernels/prefill_wgmma.cu,
kernels/prefill_attention.cu).

GEMM kernels: gemm_int4(..., kernel="wgmma" | "mma"): prefill_wgmma.cu (sm_90a, warp-specialized
wgmma, plan_wgmma picks BN and split-K) or prefill_gemm.cu (mma.sync, plan_gemm); None takes
DEFAULT_GEMM_KERNEL ("mma" wherever an mma-only option is given or N % 8 != 0). The engine
names the kernel itself (nanoqwen.yaml engine.prefill_gemm: wgmma for INT4).
gemm_int4_gate_up_swiglu(x, gate_up.qweight, gate_up.scales, act) (wgmma only) writes act [T, I]
= fp16(silu(g) * u) straight from the gate_up GEMM: the bits of gemm_int4 + swiglu_act.

Per layer, for a prompt of T tokens at positions start_pos .. start_pos+T-1 (the engine calls,
INT4 on wgmma; gpu.projection chooses the GEMMs):
    gemm_int4(x, qkv.qweight, qkv.scales, qkv_out, bias=qkv.bias)         qkv [T, qkv_dim]
    prefill_rope_write_kv(qkv_out, k_pool, v_pool, block_table, q, dims)  q [T, heads, d]; K, V -> pages
    prefill_attention(q, k_pool, v_pool, block_table, attn, dims)         attn [T, heads*d]
    gemm_int4(attn, o.qweight, o.scales, x, residual=x)                   x += W_o attn (in place)
    gemm_int4_gate_up_swiglu(y, gate_up.qweight, gate_up.scales, act)     act [T, I] = silu(g) * u
    gemm_int4(act, down.qweight, down.scales, x, residual=x)              x += W_down act
(on mma.sync the MLP is gemm_int4 into gate_up [T, 2I], then gemm_int4_swiglu with act as scratch)

Attention reads K and V from the paged cache, the same place decode reads them: the RoPE
kernel writes them there, so no contiguous K/V copy exists (k_pool / v_pool are one layer's
pool[layer, 0] / pool[layer, 1], [num_pages, kv_heads, 16, d]; block_table int32 maps the
sequence's logical pages, device resident). start_pos > 0 (a prompt after cached context)
works too: the queries see the earlier keys in the pages.

Every launcher checks each buffer (cupy array, dtype, shape, C-contiguous, 128-byte
aligned) and raises a NanoqwenError naming it; nothing is allocated per call (the RoPE
inv_freq table is made once per dims). Launches go to the current CuPy stream.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_int4_weights, check_no_alias, device_ptr
from nanoqwen_lib.gpu.ops_gemv import num_sms

GROUP = load().format.group_size
PAGE_TOKENS = load().kv_cache.page_tokens

# Kernel geometry: nanoqwen.yaml `geometry:` (the kernels get the same values as -D);
# tuning: nanoqwen.yaml `tuning: prefill_gemm` (NQ_PG_BM is chosen per shape by plan_gemm).
_PG = load().geometry["prefill_gemm"]
GEMM_BN, GEMM_BK, GEMM_THREADS = _PG["NQ_PG_BN"], _PG["NQ_PG_BK"], _PG["NQ_PG_THREADS"]
GEMM_XS = GEMM_BK + _PG["NQ_PG_X_PAD"]     # padded X row, halves
ACT_THREADS = _PG["NQ_PG_ACT_THREADS"]     # nq_swiglu_act's block
GEMM_STAGES = load().tuning["prefill_gemm"].defines["NQ_PG_STAGES"]
GEMM_BM_CHOICES = (64, 128)
GEMM_WARPS_M = load().tuning["prefill_gemm"].defines["NQ_PG_WARPS_M"]   # 8 warps as 2 (tokens) x 4 (features); 4 x 2 is the other build
GEMM_CTAS_PER_SM = {64: _PG["NQ_PG_MIN_CTAS_BM64"], 128: _PG["NQ_PG_MIN_CTAS_BM128"]}   # resident CTAs per SM (the launch bounds)
GEMM_BM128_MIN_WAVES = 2         # BM = 128 once its grid fills the resident slots this many times
SPLIT_MAX = 8                    # split-K slices at most ...
SPLIT_MIN_KTILES = 4             # ... each with at least this many k-tiles of 64
SPLIT_FILL_KTILES = 3            # pipeline fill + epilogue of a CTA, in k-tile times (the wave model)
WS_FLOATS = 1 << 24              # split-K workspace: fp32 partial tiles (64 MiB), allocated once
WS_COUNTERS = 1 << 16            # one counter per output tile
# The wgmma GEMM (kernels/prefill_wgmma.cu, sm_90a): nanoqwen.yaml `geometry: prefill_wgmma` and
# `tuning: prefill_wgmma`; NQ_PW_BN is a build variant, plan_wgmma picks one of WGMMA_BN_CHOICES.
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
WGMMA_SPLIT_MAX = 4                  # split-K slices the plan considers (measured up to 4; the model ignores the reduction)
WGMMA_SPLIT_KTILES = 4               # INT4: each extra split-K slice costs the CTA this many k-tiles (v3: qkv bn 256 s3 112 us vs s1 98)
WGMMA_KTILE_OVERHEAD = 128           # a k-tile costs bn + this (the v3 H200 fit: bn 256 / bn 128 = 1.32x)
GEMM_KERNELS = ("wgmma", "mma")
# gemm_int4's kernel when a caller names none: the launcher's own default, which the kernel
# tests rely on. The engine always names one: nanoqwen.yaml engine.prefill_gemm (gpu.projection).
DEFAULT_GEMM_KERNEL = "mma"
_PA = load().geometry["prefill_attention"]
ATTN_BQ, ATTN_THREADS, ROPE_THREADS = _PA["NQ_PA_BQ"], 32 * _PA["NQ_PA_WARPS"], _PA["NQ_PA_ROPE_THREADS"]


# ---- argument checks ----------------------------------------------------------------------
def _check(fn: str, field: str, a, dtype, shape: tuple) -> None:
    check_device_buffer(f"ops_prefill.{fn}", field, a, dtype, shape)


def _no_alias(fn: str, field: str, a, b, other: str) -> None:
    check_no_alias(f"ops_prefill.{fn}", field, a, b, other)


_ptr = device_ptr


def _weights(fn: str, qweight, scales) -> tuple[int, int]:
    """(N, K) of a packed INT4 projection, checked (launch_checks.check_int4_weights)."""
    return check_int4_weights(f"ops_prefill.{fn}", qweight, scales)


def _tokens(fn: str, field: str, a) -> int:
    if getattr(a, "ndim", 0) != 2 or a.shape[0] < 1:
        raise NanoqwenError(f"ops_prefill.{fn}", field + ".shape", "(T, features), T >= 1", getattr(a, "shape", None))
    return a.shape[0]


# ---- the GEMM -----------------------------------------------------------------------------
def gemm_smem_bytes(bm: int, swiglu: bool, stages: int = GEMM_STAGES) -> int:
    """Dynamic shared memory of nq_prefill_gemm[_swiglu]: per stage the X tile [bm][GEMM_XS]
    fp16, the W tile [GEMM_BN][GEMM_BK/8] uint32 and GEMM_BN scale words (the kernel's Stage,
    whose static_assert pins this layout: no padding); SwiGLU adds a u tile [bm][GEMM_XS] per stage."""
    stage = bm * GEMM_XS * 2 + GEMM_BN * (GEMM_BK // 8) * 4 + GEMM_BN * 4
    return stages * (stage + (bm * GEMM_XS * 2 if swiglu else 0))


def _waves_cost(tiles: int, ktiles: int, split: int, slots: int) -> int:
    """Wave model of a launch in k-tile times: rounds of resident CTAs x each CTA's k-tiles."""
    return -(-tiles * split // slots) * (-(-ktiles // split) + SPLIT_FILL_KTILES)


def plan_gemm(t: int, n: int, k: int) -> tuple[int, int]:
    """(bm, split) for a [t, k] x [n, k]^T GEMM. BM = 128 (half the dequantization per MMA)
    when t > 64 and its grid fills the resident slots GEMM_BM128_MIN_WAVES times, else 64; split-K
    slices by the wave model (a short last wave and idle SMs cost as much as a full wave),
    capped by the workspace."""
    sms, ktiles = num_sms(), k // GEMM_BK
    tiles = {bm: -(-t // bm) * -(-n // GEMM_BN) for bm in GEMM_BM_CHOICES}
    bm = 128 if t > 64 and tiles[128] >= GEMM_BM128_MIN_WAVES * GEMM_CTAS_PER_SM[128] * sms else 64
    slots = GEMM_CTAS_PER_SM[bm] * sms
    splits = [s for s in range(1, SPLIT_MAX + 1)
              if s == 1 or (ktiles // s >= SPLIT_MIN_KTILES and s * tiles[bm] * bm * GEMM_BN <= WS_FLOATS)]
    return bm, min(splits, key=lambda s: (_waves_cost(tiles[bm], ktiles, s, slots), s))


@functools.lru_cache(maxsize=None)
def _gemm_kernel(name: str, bm: int, warps_m: int, stages: int):
    extra = {"NQ_PG_BM": bm, "NQ_PG_WARPS_M": warps_m, "NQ_PG_STAGES": stages}
    kern = cuda_build.load_module("prefill_gemm", None, extra).get_function(name)
    kern.max_dynamic_shared_size_bytes = gemm_smem_bytes(bm, name.endswith("swiglu"), stages)
    return kern


@functools.lru_cache(maxsize=None)
def _workspace(device_id: int):
    import cupy as cp
    return cp.zeros(WS_FLOATS, cp.float32), cp.zeros(WS_COUNTERS, cp.int32)


def workspace():
    """(partials fp32 [WS_FLOATS], counters int32 [WS_COUNTERS], zero between launches) of the
    current device, allocated on first use: call it once before capturing a CUDA graph."""
    import cupy as cp
    return _workspace(cp.cuda.Device().id)


def _launch_gemm(fn: str, kernel: str, act, qweight, scales, out, bias, residual,
                 t: int, n: int, k: int, ldx: int, bm: int | None, split: int | None,
                 warps_m: int | None, stages: int) -> None:
    where = f"ops_prefill.{fn}"
    _check(fn, "out", out, np.float16, (t, n))
    if bias is not None:
        _check(fn, "bias", bias, np.float16, (n,))
    if residual is not None:
        _check(fn, "residual", residual, np.float16, (t, n))      # may be `out` itself (in place)
    if t * ldx >= 2**31 or n * k // 8 >= 2**31:
        raise LimitError(where, "T * row length", "< 2^31 elements (32-bit offsets)", f"T={t}, row {ldx}, N={n}, K={k}")
    plan_bm, plan_split = plan_gemm(t, n, k) if bm is None or split is None else (bm, split)
    bm, split, warps_m = bm or plan_bm, split or plan_split, warps_m or GEMM_WARPS_M
    if bm not in GEMM_BM_CHOICES:
        raise NanoqwenError(where, "bm", f"one of {GEMM_BM_CHOICES}", bm)
    if warps_m not in (2, 4):
        raise NanoqwenError(where, "warps_m", "2 or 4", warps_m)
    tiles = -(-t // bm) * -(-n // GEMM_BN)
    if not 1 <= split <= k // GEMM_BK:
        raise NanoqwenError(where, "split", f"1 .. {k // GEMM_BK} (k-tiles of {GEMM_BK})", split)
    ws, counters = workspace() if split > 1 else (None, None)
    if split > 1 and (split * tiles * bm * GEMM_BN > WS_FLOATS or tiles > WS_COUNTERS):
        raise LimitError(where, "split-K workspace", f"split * tiles * {bm * GEMM_BN} <= {WS_FLOATS} and "
                         f"tiles <= {WS_COUNTERS}", f"split {split}, tiles {tiles}", "a smaller split")
    grid = (-(-t // bm), -(-n // GEMM_BN), split)
    _gemm_kernel(kernel, bm, warps_m, stages)(
        grid, (GEMM_THREADS,),
        (act, qweight, scales, _ptr(bias), _ptr(residual), out, np.int32(t), np.int32(n), np.int32(k),
         _ptr(ws), _ptr(counters)),
        shared_mem=gemm_smem_bytes(bm, kernel.endswith("swiglu"), stages))


def gemm_int4(x, qweight, scales, out, bias=None, residual=None, *, kernel=None, bm=None, split=None,
              warps_m=None, stages=None, bn=None) -> None:
    """out[T, N] = fp16(x W^T [+ bias] [+ residual]), FP32 accumulation. x fp16 [T, K];
    qweight uint32 [N, K/8]; scales fp16 [N, K/128]; residual may be `out` (in place), x may not.
    kernel: "wgmma" (kernels/prefill_wgmma.cu, N a multiple of 8) or "mma" (prefill_gemm.cu's
    mma.sync); None = DEFAULT_GEMM_KERNEL. bm / warps_m (mma), bn (wgmma), split, stages override
    the plans (plan_gemm, plan_wgmma; tests, benchmark)."""
    n, k = _weights("gemm_int4", qweight, scales)
    t = _tokens("gemm_int4", "x", x)
    _check("gemm_int4", "x", x, np.float16, (t, k))
    _no_alias("gemm_int4", "out", out, x, "x")
    kernel = _kernel_choice("gemm_int4", kernel, n, bm=bm, warps_m=warps_m, bn=bn)
    if kernel == "wgmma":
        _launch_wgmma("gemm_int4", "nq_prefill_wgmma", x, qweight, scales, out, bias, residual, t, n, k, bn, split,
                      stages)
        return
    _launch_gemm("gemm_int4", "nq_prefill_gemm", x, qweight, scales, out, bias, residual, t, n, k, k,
                 bm, split, warps_m, stages or GEMM_STAGES)


def _kernel_choice(fn: str, kernel, n: int, *, bm=None, warps_m=None, bn=None) -> str:
    """The GEMM kernel: `kernel` when named; else "mma" where only it applies (an mma option
    given, or N not a multiple of 8), else DEFAULT_GEMM_KERNEL."""
    if kernel is None:
        kernel = "mma" if (bm is not None or warps_m is not None or n % 8) else DEFAULT_GEMM_KERNEL
    where = f"ops_prefill.{fn}"
    if kernel not in GEMM_KERNELS:
        raise NanoqwenError(where, "kernel", f"one of {GEMM_KERNELS}", kernel)
    if kernel == "wgmma" and (bm is not None or warps_m is not None):
        raise NanoqwenError(where, "bm" if bm is not None else "warps_m", "None with kernel='wgmma' (an mma option)",
                            bm if bm is not None else warps_m)
    if kernel == "mma" and bn is not None:
        raise NanoqwenError(where, "bn", "None with kernel='mma' (a wgmma option)", bn)
    return kernel


# ---- the wgmma GEMM -----------------------------------------------------------------------
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
def _wgmma_kernel(name: str, bn: int, stages: int):
    extra = {"NQ_PW_BN": bn, "NQ_PW_STAGES": stages}
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


def _launch_wgmma(fn: str, kernel: str, x, qweight, scales, out, bias, residual, t: int, n: int, k: int,
                  bn, split, stages) -> None:
    where = f"ops_prefill.{fn}"
    if n % 8:
        raise NanoqwenError(where, "qweight.shape[0]", "N a multiple of 8 (kernel='wgmma'; 'mma' takes any N)", n)
    _check(fn, "out", out, np.float16, (t, n))
    if bias is not None:
        _check(fn, "bias", bias, np.float16, (n,))
    if residual is not None:
        _check(fn, "residual", residual, np.float16, (t, n))      # may be `out` itself (in place)
    if t * k >= 2**31 or n * k // 8 >= 2**31 or t * n >= 2**31:
        raise LimitError(where, "T * row length", "< 2^31 elements (32-bit offsets)", f"T={t}, N={n}, K={k}")
    bn, split, stages, grid = _wgmma_grid(where, t, n, k, bn, split, stages, WGMMA_BK, n)
    ws, counters = workspace() if split > 1 else (None, None)
    _wgmma_kernel(kernel, bn, stages)(
        grid, (wgmma_int4_threads(bn),),
        (x, qweight, scales, _ptr(bias), _ptr(residual), out, np.int32(t), np.int32(n), np.int32(k),
         _ptr(ws), _ptr(counters), xmap(x, WGMMA_BK), _ptr(None)),   # wmap: FP8's only
        shared_mem=wgmma_smem_bytes(bn, stages))


def gemm_int4_gate_up_swiglu(x, qweight, scales, act, *, bn=None, split=None, stages=None) -> None:
    """act[T, I] = fp16(silu(g) * u) with [g | u] = fp16(x W^T), W the gate_up weight [2I, K]
    (gate rows, then up rows): the gate_up GEMM and swiglu_act in one wgmma kernel, the same bits
    as gemm_int4 into gate_up [T, 2I] then swiglu_act. x fp16 [T, K]; I a multiple of 8."""
    fn, where = "gemm_int4_gate_up_swiglu", "ops_prefill.gemm_int4_gate_up_swiglu"
    n2, k = _weights(fn, qweight, scales)
    t = _tokens(fn, "x", x)
    _check(fn, "x", x, np.float16, (t, k))
    if n2 % 16:
        raise NanoqwenError(where, "qweight.shape[0]", "2 I with I a multiple of 8", n2)
    inter = n2 // 2
    _check(fn, "act", act, np.float16, (t, inter))
    _no_alias(fn, "act", act, x, "x")
    if t * k >= 2**31 or n2 * k // 8 >= 2**31:
        raise LimitError(where, "T * row length", "< 2^31 elements (32-bit offsets)", f"T={t}, N={n2}, K={k}")
    # The CTA's bn weight rows are bn/2 features: plan and grid over the features.
    if bn is None or split is None:
        pbn, psplit = plan_wgmma(t, n2, k)
        bn, split = bn or pbn, split or psplit
    bn, split, stages, grid = _wgmma_grid(where, t, inter * 2, k, bn, split, stages, WGMMA_BK, n2)
    grid = (grid[0], -(-inter // (bn // 2)), split)
    if split > 1 and (split * grid[0] * grid[1] * WGMMA_BM * bn > WS_FLOATS or grid[0] * grid[1] > WS_COUNTERS):
        raise LimitError(where, "split-K workspace", "fits", f"split {split}", "a smaller split")
    ws, counters = workspace() if split > 1 else (None, None)
    _wgmma_kernel("nq_prefill_wgmma_swiglu", bn, stages)(
        grid, (wgmma_int4_threads(bn),),
        (x, qweight, scales, act, np.int32(t), np.int32(n2), np.int32(k), _ptr(ws), _ptr(counters),
         xmap(x, WGMMA_BK), _ptr(None)),                      # wmap: FP8's only
        shared_mem=wgmma_smem_bytes(bn, stages))


def gemm_int4_swiglu(gate_up, qweight, scales, out, residual=None, *, bias=None, act=None, bm=None, split=None,
                     warps_m=None, stages=None, kernel=None, bn=None) -> None:
    """out[T, N] = fp16(act W^T [+ residual]), act = fp16(silu(g) * u) of gate_up fp16 [T, 2K]
    (gate columns, then up columns), K = qweight.shape[1] * 8. Without `act` the kernel forms
    act tile by tile (nothing in memory); with an `act` buffer fp16 [T, K] it runs swiglu_act
    into it and then gemm_int4: the same bits, and faster at T = 512 (PERFLOG.md, prefill:
    the fused kernel recomputes act once per 128 output columns). The act-in-tile form exists
    only for kernel='mma' (the default without `act`); with `act`, `kernel` picks gemm_int4's."""
    n, k = _weights("gemm_int4_swiglu", qweight, scales)
    t = _tokens("gemm_int4_swiglu", "gate_up", gate_up)
    _check("gemm_int4_swiglu", "gate_up", gate_up, np.float16, (t, 2 * k))
    _no_alias("gemm_int4_swiglu", "out", out, gate_up, "gate_up")
    if act is not None:
        swiglu_act(gate_up, act)
        gemm_int4(act, qweight, scales, out, bias=bias, residual=residual, bm=bm, split=split, warps_m=warps_m,
                  stages=stages, kernel=kernel, bn=bn)
        return
    if kernel not in (None, "mma") or bn is not None:
        raise NanoqwenError("ops_prefill.gemm_int4_swiglu", "kernel", "'mma' (act formed per tile) unless `act` is "
                            "given", kernel if bn is None else f"bn={bn}")
    stages = stages or GEMM_STAGES
    _launch_gemm("gemm_int4_swiglu", "nq_prefill_gemm_swiglu", gate_up, qweight, scales, out, bias, residual,
                 t, n, k, 2 * k, bm, split, warps_m, stages)


def swiglu_act(gate_up, act) -> None:
    """act[T, I] = fp16(silu(g) * u) from gate_up fp16 [T, 2I]: the unfused alternative to
    gemm_int4_swiglu (then gemm_int4(act, ...)); same arithmetic, so the same bits."""
    t = _tokens("swiglu_act", "gate_up", gate_up)
    inter = gate_up.shape[1] // 2
    if inter < 8 or inter % 8:
        raise NanoqwenError("ops_prefill.swiglu_act", "gate_up.shape[1]", "2 I with I a multiple of 8", gate_up.shape[1])
    _check("swiglu_act", "gate_up", gate_up, np.float16, (t, 2 * inter))
    _check("swiglu_act", "act", act, np.float16, (t, inter))
    chunks = t * inter // 8
    _gemm_kernel("nq_swiglu_act", 128, GEMM_WARPS_M, GEMM_STAGES)((-(-chunks // ACT_THREADS),), (ACT_THREADS,),
                                                    (gate_up, act, np.int32(t), np.int32(inter)))


# ---- RoPE + cache write, attention ----------------------------------------------------------
class PrefillAttentionKernels:
    """The compiled attention module for one model's dims and its RoPE inv_freq table
    (ops_attention.rope_inv_freq: the decode kernel's bits, so both write the same K)."""

    def __init__(self, dims: ModelDims):
        import cupy as cp
        from nanoqwen_lib.gpu.ops_attention import rope_inv_freq
        mod = cuda_build.load_module("prefill_attention", dims)
        self.dims = dims
        self.attn = mod.get_function("nq_prefill_attention")
        self.smem = 5 * ATTN_BQ * dims.head_dim * 2          # Q tile + 2 x (K tile, V tile)
        self.attn.max_dynamic_shared_size_bytes = self.smem
        self.rope = mod.get_function("nq_prefill_rope_write_kv")
        self.inv_freq = cp.asarray(rope_inv_freq(dims.head_dim, dims.rope_theta))   # [d/2]


@functools.lru_cache(maxsize=None)
def attention_kernels(dims: ModelDims) -> PrefillAttentionKernels:
    return PrefillAttentionKernels(dims)


def _check_pages(fn: str, dims: ModelDims, k_pool, v_pool, block_table, context: int) -> None:
    shape = (getattr(k_pool, "shape", (0,))[0], dims.num_kv_heads, PAGE_TOKENS, dims.head_dim)
    _check(fn, "k_pool", k_pool, np.float16, shape)
    _check(fn, "v_pool", v_pool, np.float16, shape)
    pages = -(-context // PAGE_TOKENS)
    if getattr(block_table, "ndim", 0) != 1 or block_table.shape[0] < pages:
        raise NanoqwenError(f"ops_prefill.{fn}", "block_table.shape", f"({pages} or more,) for {context} tokens",
                            getattr(block_table, "shape", None))
    _check(fn, "block_table", block_table, np.int32, block_table.shape)


def prefill_rope_write_kv(qkv, k_pool, v_pool, block_table, q_out, dims: ModelDims, start_pos: int = 0) -> None:
    """qkv fp16 [T, qkv_dim] (bias added) -> q_out fp16 [T, heads, d] = rope(q); rope(k) and v
    to the page slots of positions start_pos .. start_pos+T-1 (block_table int32, device)."""
    t = _tokens("prefill_rope_write_kv", "qkv", qkv)
    _check("prefill_rope_write_kv", "qkv", qkv, np.float16, (t, dims.qkv_dim))
    _check("prefill_rope_write_kv", "q_out", q_out, np.float16, (t, dims.num_heads, dims.head_dim))
    _check_pages("prefill_rope_write_kv", dims, k_pool, v_pool, block_table, start_pos + t)
    ks = attention_kernels(dims)
    ks.rope((t,), (ROPE_THREADS,), (qkv, ks.inv_freq, block_table, q_out, k_pool, v_pool, np.int32(t),
                           np.int32(start_pos), np.int32(dims.num_heads), np.int32(dims.num_kv_heads)))


def prefill_attention(q, k_pool, v_pool, block_table, out, dims: ModelDims, start_pos: int = 0) -> None:
    """out fp16 [T, heads * d] = causal softmax(q K^T / sqrt(d)) V, FP32 softmax; q fp16
    [T, heads, d] at positions start_pos ..; K, V of positions 0 .. start_pos+T-1 in the pages."""
    t = _tokens("prefill_attention", "out", out)
    _check("prefill_attention", "q", q, np.float16, (t, dims.num_heads, dims.head_dim))
    _check("prefill_attention", "out", out, np.float16, (t, dims.q_dim))
    _check_pages("prefill_attention", dims, k_pool, v_pool, block_table, start_pos + t)
    ks = attention_kernels(dims)
    grid = (-(-t // ATTN_BQ), dims.num_heads)
    ks.attn(grid, (ATTN_THREADS,), (q, k_pool, v_pool, block_table, out, np.int32(t), np.int32(start_pos),
                                    np.int32(dims.num_heads), np.int32(dims.num_kv_heads)),
            shared_mem=ks.smem)
