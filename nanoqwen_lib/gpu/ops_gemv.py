"""Launchers for the decode INT4 GEMVs (kernels/gemv_int4.cu): what the engines run (the
earlier GEMV versions are nanoqwen_lib.gpu.lab.gemv; the small decode kernels and the
lm_head are nanoqwen_lib.gpu.ops_decode, which shares this module's workspace).

Every launcher takes CuPy arrays, checks dtype, shape, contiguity and 128-byte alignment
of every buffer (a NanoqwenError naming the argument), and launches on the current
stream. Nothing is allocated per call: the split-K and argmax workspaces are allocated
once per device, on first use (call `workspace()` before capturing a CUDA graph), and are
left clean by every launch (counters back at zero). One stream at a time may use them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_int4_weights, check_no_alias, device_ptr

GROUP = load().format.group_size

# Tuning knobs: nanoqwen.yaml `tuning:` (config.cuda_defines passes the defaults as -D to every
# build; a launch overrides them per shape from the table there).
_TUNING = load().tuning
GEMV_TUNING = dict(_TUNING["gemv_int4"].defines)
GEMV_FALLBACK = dict(_TUNING["gemv_int4"].fallback)    # shapes the table does not name
# Split-K: measured on the H200 (PERFLOG.md, v2), every extra slice costs more than it
# gains, so K is split only as far as one CTA's range must fit its shared memory.
SPLIT_TARGET_CTAS_PER_SM = 0    # split K until the grid has this many CTAs per SM (0: off) ...
SPLIT_MAX_CTA_GROUPS = 64       # ... and so that one CTA's K range fits its shared memory
SPLIT_MIN_WARP_GROUPS = 2       # ... but never below this many groups per warp
ACT_BYTES_PER_GROUP = 2 * load().geometry["gemv_int4"]["NQ_GEMV_X_GROUP_HALVES"]   # staged fp16 x of one group, padded

# Workspace capacity (allocated once, ~4.3 MB).
WS_PARTIAL_FLOATS = 1 << 20     # ksplit * N fp32 partial sums
WS_TILE_COUNTERS = 1 << 16      # one counter per 16-row tile
WS_ARGMAX_PARTS = 1 << 14       # one (value, index) per CTA of lm_head / argmax


# ---- modules ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _kernel(module: str, name: str, extra: tuple):
    return cuda_build.load_module(module, None, dict(extra)).get_function(name)


def gemv_kernel(name: str, tuning: dict | None, module: str = "gemv_int4"):
    """Entry `name` of kernels/<module>.cu built with GEMV_TUNING overridden by `tuning`."""
    return _kernel(module, name, tuple(sorted({**GEMV_TUNING, **(tuning or {})}.items())))


def num_sms() -> int:
    """The SMs this machine plans for (gpu.hardware: the device's, or $NANOQWEN_SMS)."""
    from nanoqwen_lib.gpu.hardware import hardware
    return hardware().sms


@dataclass
class Workspace:
    partial: object          # fp32 [WS_PARTIAL_FLOATS]
    counters: object         # int32 [WS_TILE_COUNTERS], zero between launches
    part_val: object         # fp32 [WS_ARGMAX_PARTS]
    part_idx: object         # int32 [WS_ARGMAX_PARTS]
    argmax_counter: object   # uint32 [32] (one 128-byte line), [0] zero between launches


@functools.lru_cache(maxsize=None)
def _workspace(device_id: int) -> Workspace:
    import cupy as cp
    return Workspace(cp.zeros(WS_PARTIAL_FLOATS, cp.float32), cp.zeros(WS_TILE_COUNTERS, cp.int32),
                     cp.zeros(WS_ARGMAX_PARTS, cp.float32), cp.zeros(WS_ARGMAX_PARTS, cp.int32),
                     cp.zeros(32, cp.uint32))


def workspace() -> Workspace:
    """The current device's workspace (allocated on the first call; call it before capture)."""
    import cupy as cp
    return _workspace(cp.cuda.Device().id)


# ---- argument checks ----------------------------------------------------------------------
def _check(fn: str, field: str, a, dtype, shape: tuple) -> None:
    check_device_buffer(f"ops_gemv.{fn}", field, a, dtype, shape)


def _no_alias(fn: str, field: str, a, b, other: str) -> None:
    check_no_alias(f"ops_gemv.{fn}", field, a, b, other)


_ptr = device_ptr


def check_weights(fn: str, qweight, scales) -> tuple[int, int]:
    """(N, K) of a packed INT4 projection, checked (launch_checks.check_int4_weights)."""
    return check_int4_weights(f"ops_gemv.{fn}", qweight, scales)


# ---- split-K plan -------------------------------------------------------------------------
def plan_split(n: int, k: int, tuning: dict | None = None) -> int:
    """Split-K slices for an N x K GEMV: enough CTAs to fill the SMs, each range small
    enough for shared memory, each warp still with a few groups."""
    t = {**GEMV_TUNING, **(tuning or {})}
    rows = 16 * t["NQ_GEMV_MTILES"]
    tiles, groups = -(-n // rows), k // GROUP
    s = max(1, -(-groups // SPLIT_MAX_CTA_GROUPS))
    target = SPLIT_TARGET_CTAS_PER_SM * num_sms() if SPLIT_TARGET_CTAS_PER_SM else 0
    while tiles * s < target and groups // (s + 1) >= t["NQ_GEMV_WARPS"] * SPLIT_MIN_WARP_GROUPS:
        s += 1
    return s


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    """(launcher, N, K) -> (tuning, ksplit) for the 7B decode GEMVs: the fastest variant of
    each shape measured on the H200 (nanoqwen.yaml `tuning: gemv_int4: shapes`, PERFLOG.md)."""
    d = load().model("7b")
    return {(s.launcher, *s.size(d)): (dict(s.defines), s.ksplit) for s in _TUNING["gemv_int4"].shapes}


def gemv_config(fn: str, n: int, k: int, tuning: dict | None = None, ksplit: int | None = None):
    """(tuning, ksplit) of a tiles launch: the arguments when given, else the measured
    table for the 7B shapes, else GEMV_FALLBACK with the shared-memory split."""
    if tuning is None and ksplit is None and (fn, n, k) in tuned_table():
        t, s = tuned_table()[(fn, n, k)]
        return {**GEMV_TUNING, **t}, s
    t = {**GEMV_TUNING, **(GEMV_FALLBACK if tuning is None else tuning)}
    return t, ksplit or plan_split(n, k, t)


def launch_tiles(fn: str, kernel_name: str, act_args: tuple, act_bytes_per_group: int,
                 qweight, scales, out, bias, residual, n: int, k: int,
                 ksplit: int | None, tuning: dict | None, module: str = "gemv_int4") -> None:
    """One tiles launch (grid (tiles, ksplit), 32 * WARPS threads) of `kernel_name` in
    kernels/<module>.cu, after checking out, bias, residual, ksplit and shared memory."""
    check_device_buffer(f"ops_gemv.{fn}", "out", out, np.float16, (n,))
    if bias is not None:
        check_device_buffer(f"ops_gemv.{fn}", "bias", bias, np.float16, (n,))
    if residual is not None:   # may be `out` itself (in place)
        check_device_buffer(f"ops_gemv.{fn}", "residual", residual, np.float16, (n,))
    groups = k // GROUP
    t, s = gemv_config(fn, n, k, tuning, ksplit)
    if not 1 <= s <= groups:
        raise NanoqwenError(f"ops_gemv.{fn}", "ksplit", f"1..{groups} (groups of K)", s)
    rows = 16 * t["NQ_GEMV_MTILES"]
    tiles = -(-n // rows)
    smem = -(-groups // s) * act_bytes_per_group
    if smem > 48 * 1024:
        raise LimitError(f"ops_gemv.{fn}", "shared memory of one CTA's K range",
                         "<= 48 KiB", f"{smem} B (K={k}, ksplit={s})", "raise ksplit")
    ws = split_workspace(fn, s, n, tiles)
    kern = gemv_kernel(kernel_name, t, module)
    kern((tiles, s), (32 * t["NQ_GEMV_WARPS"],),
         act_args + (qweight, scales, out, device_ptr(bias), device_ptr(residual), ws.partial, ws.counters,
                     np.int32(n), np.int32(k), np.int32(s)),
         shared_mem=smem)


def split_workspace(fn: str, s: int, n: int, tiles: int) -> Workspace:
    """The workspace, after checking that a ksplit-way split of N rows in `tiles` tiles fits it."""
    ws = workspace()
    if s > 1 and (s * n > ws.partial.size or tiles > ws.counters.size):
        raise LimitError(f"ops_gemv.{fn}", "split-K workspace",
                         f"ksplit*N <= {ws.partial.size} and tiles <= {ws.counters.size}",
                         f"ksplit*N = {s * n}, tiles = {tiles}")
    return ws


# ---- the GEMVs ----------------------------------------------------------------------------
def gemv_int4(x, qweight, scales, out, bias=None, residual=None, *, ksplit=None, tuning=None):
    """out[N] = fp16([residual +] W.x [+ bias]); x fp16 [K], qweight uint32 [N, K/8],
    scales fp16 [N, K/128]. residual may be `out` (in place); x may not."""
    n, k = check_weights("gemv_int4", qweight, scales)
    _check("gemv_int4", "x", x, np.float16, (k,))
    _no_alias("gemv_int4", "out", out, x, "x")
    launch_tiles("gemv_int4", "nq_gemv_int4", (x,), ACT_BYTES_PER_GROUP,
                 qweight, scales, out, bias, residual, n, k, ksplit, tuning)


def gemv_int4_swiglu(gate_up, qweight, scales, out, residual=None, *, bias=None, ksplit=None, tuning=None):
    """out[N] = fp16([residual +] W.act); act = fp16(silu(g) * u) from gate_up fp16 [2K]
    (gate then up), K = qweight.shape[1] * 8."""
    n, k = check_weights("gemv_int4_swiglu", qweight, scales)
    _check("gemv_int4_swiglu", "gate_up", gate_up, np.float16, (2 * k,))
    _no_alias("gemv_int4_swiglu", "out", out, gate_up, "gate_up")
    launch_tiles("gemv_int4_swiglu", "nq_gemv_int4_swiglu", (gate_up,), ACT_BYTES_PER_GROUP,
                 qweight, scales, out, bias, residual, n, k, ksplit, tuning)
