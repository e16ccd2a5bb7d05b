"""Launchers for kernels/prefill_gemm.cu: the mma.sync INT4 prefill GEMM (ops_prefill.gemm_int4 with
kernel="mma" launches it through _launch_gemm), its SwiGLU variants, and the split-K workspace that
the wgmma GEMM (ops_prefill_wgmma) shares.

    gemm_int4_swiglu(gate_up, qweight, scales, out, residual=None, *, act=None, ...)
                                          out [T, N] = fp16(act W^T [+ residual]), act = silu(g) * u of gate_up
    swiglu_act(gate_up, act)              act [T, I] = fp16(silu(g) * u) of gate_up [T, 2I]
    plan_gemm(t, n, k) -> (bm, split)     BM (64 or 128) and split-K slices for a shape (wave model)
    gemm_smem_bytes(bm, swiglu, stages)   dynamic shared memory of a build
    workspace()                           split-K partials fp32 [WS_FLOATS] and tile counters [WS_COUNTERS]

Arguments go through launch_checks.check_prefill_gemm; errors name the public launcher
(ops_prefill.<fn>), whose module re-exports these names.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu.launch_checks import (check_device_buffer, check_int4_weights, check_no_alias,
                                            check_prefill_gemm, check_tokens, device_ptr)
from nanoqwen_lib.gpu.ops_gemv import num_sms

# Kernel geometry: nanoqwen.yaml `geometry:` (the kernels get the same values as -D);
# tuning: nanoqwen.yaml `tuning: prefill_gemm` (NQ_PG_BM is chosen per shape by plan_gemm).
_PG = load().geometry["prefill_gemm"]
GEMM_BN, GEMM_BK, GEMM_THREADS = _PG["NQ_PG_BN"], _PG["NQ_PG_BK"], _PG["NQ_PG_THREADS"]
GEMM_XS = GEMM_BK + _PG["NQ_PG_X_PAD"]     # padded X row, halves
ACT_THREADS = _PG["NQ_PG_ACT_THREADS"]     # nq_swiglu_act's block
GEMM_STAGES = load().tuning["prefill_gemm"].defines["NQ_PG_STAGES"]
GEMM_BM_CHOICES = (64, 128)
# 8 warps as 2 (tokens) x 4 (features); 4 x 2 is the other build
GEMM_WARPS_M = load().tuning["prefill_gemm"].defines["NQ_PG_WARPS_M"]
# resident CTAs per SM (the launch bounds)
GEMM_CTAS_PER_SM = {64: _PG["NQ_PG_MIN_CTAS_BM64"], 128: _PG["NQ_PG_MIN_CTAS_BM128"]}
GEMM_BM128_MIN_WAVES = 2         # BM = 128 once its grid fills the resident slots this many times
SPLIT_MAX = 8                    # split-K slices at most ...
SPLIT_MIN_KTILES = 4             # ... each with at least this many k-tiles of 64
SPLIT_FILL_KTILES = 3            # pipeline fill + epilogue of a CTA, in k-tile times (the wave model)
WS_FLOATS = 1 << 24              # split-K workspace: fp32 partial tiles (64 MiB), allocated once
WS_COUNTERS = 1 << 16            # one counter per output tile


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
    current device, allocated on first use: call it once before capturing a CUDA graph. The
    wgmma GEMMs (INT4 and FP8) call it through this module too: one workspace, one owner."""
    import cupy as cp
    return _workspace(cp.cuda.Device().id)


def _launch_gemm(fn: str, kernel: str, x, qweight, scales, out, bias, residual, n: int, k: int, ldx: int,
                 bm: int | None, split: int | None, warps_m: int | None, stages: int, x_field: str = "x") -> None:
    """Checks x [T, ldx] (x_field), out, bias, residual (launch_checks.check_prefill_gemm) and
    the mma options against the plan_gemm defaults, then launches `kernel` (N x K: qweight's)."""
    where = f"ops_prefill.{fn}"
    t = check_prefill_gemm(where, x, out, n, k, bias, residual, weight_elems=n * k // 8, x_field=x_field,
                           x_cols=ldx, out_offsets=False)     # the epilogue indexes out and residual in 64 bits
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
        (x, qweight, scales, device_ptr(bias), device_ptr(residual), out, np.int32(t), np.int32(n), np.int32(k),
         device_ptr(ws), device_ptr(counters)),
        shared_mem=gemm_smem_bytes(bm, kernel.endswith("swiglu"), stages))


def gemm_int4_swiglu(gate_up, qweight, scales, out, residual=None, *, bias=None, act=None, bm=None, split=None,
                     warps_m=None, stages=None, kernel=None, bn=None) -> None:
    """out[T, N] = fp16(act W^T [+ residual]), act = fp16(silu(g) * u) of gate_up fp16 [T, 2K]
    (gate columns, then up columns), K = qweight.shape[1] * 8. Without `act` the kernel forms
    act tile by tile (nothing in memory); with an `act` buffer fp16 [T, K] it runs swiglu_act
    into it and then gemm_int4: the same bits, and faster at T = 512 (PERFLOG.md, prefill:
    the fused kernel recomputes act once per 128 output columns). The act-in-tile form exists
    only for kernel='mma' (the default without `act`); with `act`, `kernel` picks gemm_int4's."""
    where = "ops_prefill.gemm_int4_swiglu"
    n, k = check_int4_weights(where, qweight, scales)
    if act is not None:      # gemm_int4 checks out, bias and residual (and its kernel's offsets)
        t = check_tokens(where, "gate_up", gate_up)
        check_device_buffer(where, "gate_up", gate_up, np.float16, (t, 2 * k))
        check_no_alias(where, "out", out, gate_up, "gate_up")
        swiglu_act(gate_up, act)
        from nanoqwen_lib.gpu import ops_prefill     # the kernel dispatcher (it imports this module)
        ops_prefill.gemm_int4(act, qweight, scales, out, bias=bias, residual=residual, bm=bm, split=split,
                              warps_m=warps_m, stages=stages, kernel=kernel, bn=bn)
        return
    if kernel not in (None, "mma") or bn is not None:
        raise NanoqwenError(where, "kernel", "'mma' (act formed per tile) unless `act` is given",
                            kernel if bn is None else f"bn={bn}")
    _launch_gemm("gemm_int4_swiglu", "nq_prefill_gemm_swiglu", gate_up, qweight, scales, out, bias, residual,
                 n, k, 2 * k, bm, split, warps_m, stages or GEMM_STAGES, x_field="gate_up")


def swiglu_act(gate_up, act) -> None:
    """act[T, I] = fp16(silu(g) * u) from gate_up fp16 [T, 2I]: the unfused alternative to
    gemm_int4_swiglu (then gemm_int4(act, ...)); same arithmetic, so the same bits."""
    where = "ops_prefill.swiglu_act"
    t = check_tokens(where, "gate_up", gate_up)
    inter = gate_up.shape[1] // 2
    if inter < 8 or inter % 8:
        raise NanoqwenError(where, "gate_up.shape[1]", "2 I with I a multiple of 8", gate_up.shape[1])
    check_device_buffer(where, "gate_up", gate_up, np.float16, (t, 2 * inter))
    check_device_buffer(where, "act", act, np.float16, (t, inter))
    chunks = t * inter // 8
    _gemm_kernel("nq_swiglu_act", 128, GEMM_WARPS_M, GEMM_STAGES)((-(-chunks // ACT_THREADS),), (ACT_THREADS,),
                                                                  (gate_up, act, np.int32(t), np.int32(inter)))
