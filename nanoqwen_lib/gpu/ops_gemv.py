"""Launchers for the decode GEMVs and the small decode kernels (kernels/gemv_int4.cu,
decode_ops.cu, lm_head.cu).

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
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_no_alias, device_ptr

GROUP = load().format.group_size

# Tuning knobs, passed as -D defines (the kernels' own #ifndef defaults mirror these).
GEMV_TUNING = {"NQ_GEMV_WARPS": 4, "NQ_GEMV_UNROLL": 4, "NQ_GEMV_MTILES": 1,
               "NQ_GEMV_STREAM_WARPS": 16, "NQ_GEMV_STREAM_RING": 4}
GEMV_IMPL = "tiles"             # "tiles": CTA per 16-row tile (+ split-K); "stream": persistent stream-K;
GEMV_IMPLS = ("tiles", "stream", "bulk")   # "bulk": persistent, weights via cp.async.bulk (v5: slower, PERFLOG)
BULK_TUNING = {"NQ_BULK_STAGES": 4, "NQ_BULK_GROUPS": 8, "NQ_BULK_MAX_ITEM_GROUPS": 40,
               "NQ_BULK_CONSUMER_WARPS": 4}   # a CTA: one producer warp + these consumer warps
BULK_CTAS_PER_SM = 4            # at most; shared memory may allow fewer
BULK_MIN_BALANCE = 0.9          # split K until the items spread this evenly over the CTAs
SMEM_PER_SM = 233472            # H100 / H200: 228 KiB of shared memory per SM
SMEM_PER_CTA_RESERVED = 1024 + 512   # the driver's reservation + the kernel's static shared memory
STREAM_CTAS_PER_SM = 1
STREAM_MIN_WARP_UNITS = 2       # fewer CTAs for tiny GEMVs: every warp gets >= 2 units
LMHEAD_TUNING = {"NQ_LMHEAD_WARPS": 8, "NQ_LMHEAD_ROWS_PER_WARP": 4, "NQ_LMHEAD_UNROLL": 4}
DECODE_TUNING = {"NQ_DECODE_THREADS": 512}
LMHEAD_CTAS_PER_SM = 4          # persistent grid of the lm_head
ARGMAX_CTAS_PER_SM = 1
# Split-K: measured on the H200 (PERFLOG.md, v2), every extra slice costs more than it
# gains, so K is split only as far as one CTA's range must fit its shared memory.
SPLIT_TARGET_CTAS_PER_SM = 0    # split K until the grid has this many CTAs per SM (0: off) ...
SPLIT_MAX_CTA_GROUPS = 64       # ... and so that one CTA's K range fits its shared memory
SPLIT_MIN_WARP_GROUPS = 2       # ... but never below this many groups per warp
GEMV_FALLBACK = {"NQ_GEMV_UNROLL": 2}   # shapes the table below does not name

# Workspace capacity (allocated once, ~4.3 MB).
WS_PARTIAL_FLOATS = 1 << 20     # ksplit * N fp32 partial sums
WS_TILE_COUNTERS = 1 << 16      # one counter per 16-row tile
WS_ARGMAX_PARTS = 1 << 14       # one (value, index) per CTA of lm_head / argmax


# ---- modules ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _kernel(module: str, name: str, extra: tuple):
    return cuda_build.load_module(module, None, dict(extra)).get_function(name)


def _gemv_kernel(name: str, tuning: dict | None):
    return _kernel("gemv_int4", name, tuple(sorted({**GEMV_TUNING, **(tuning or {})}.items())))


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    import cupy as cp
    return cp.cuda.Device().attributes["MultiProcessorCount"]


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


def _weights(fn: str, qweight, scales) -> tuple[int, int]:
    """(N, K) of a packed INT4 projection, checked."""
    if getattr(qweight, "ndim", 0) != 2:
        raise NanoqwenError(f"ops_gemv.{fn}", "qweight.shape", "(N, K/8)", getattr(qweight, "shape", None))
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if n < 1 or k % GROUP:
        raise NanoqwenError(f"ops_gemv.{fn}", "qweight.shape", f"N >= 1 and K a multiple of {GROUP}", (n, k))
    _check(fn, "qweight", qweight, np.uint32, (n, k // 8))
    _check(fn, "scales", scales, np.float16, (n, k // GROUP))
    return n, k


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
    each shape measured on the H200 (PERFLOG.md, run 4: the FOLD unpack; graph replay)."""
    d = load().model("7b")
    fold_mt2u2 = {"NQ_GEMV_FOLD": 1, "NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2}
    return {
        ("gemv_int4", d.qkv_dim, d.hidden): ({}, 1),                                     # 8.07 us (FOLD: no gain)
        ("gemv_int4", d.hidden, d.q_dim): ({"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}, 1),  # 5.85 us
        ("gemv_int4", 2 * d.intermediate, d.hidden): (fold_mt2u2, 1),                    # 26.56 us
        ("gemv_int4", d.hidden, d.intermediate): (fold_mt2u2, 3),                        # 18.01 us
        ("gemv_int4_swiglu", d.hidden, d.intermediate): (fold_mt2u2, 3),                 # 19.15 us
    }


def gemv_config(fn: str, n: int, k: int, tuning: dict | None = None, ksplit: int | None = None):
    """(tuning, ksplit) of a tiles launch: the arguments when given, else the measured
    table for the 7B shapes, else GEMV_FALLBACK with the shared-memory split."""
    if tuning is None and ksplit is None and (fn, n, k) in tuned_table():
        t, s = tuned_table()[(fn, n, k)]
        return {**GEMV_TUNING, **t}, s
    t = {**GEMV_TUNING, **(GEMV_FALLBACK if tuning is None else tuning)}
    return t, ksplit or plan_split(n, k, t)


def _launch_gemv(fn: str, kernel_name: str, act_args: tuple, act_bytes_per_group: int,
                 qweight, scales, out, bias, residual, n: int, k: int,
                 ksplit: int | None, tuning: dict | None, impl: str | None = None, ctas: int | None = None) -> None:
    _check(fn, "out", out, np.float16, (n,))
    if bias is not None:
        _check(fn, "bias", bias, np.float16, (n,))
    if residual is not None:
        _check(fn, "residual", residual, np.float16, (n,))   # may be `out` itself (in place)
    impl = impl or GEMV_IMPL
    if impl not in GEMV_IMPLS:
        raise NanoqwenError(f"ops_gemv.{fn}", "impl", f"one of {GEMV_IMPLS}", repr(impl))
    groups = k // GROUP
    if impl == "bulk":
        _launch_bulk(fn, kernel_name + "_bulk", act_args, qweight, scales, out, bias, residual, n, k,
                     ksplit, tuning, ctas)
        return
    # The stream kernels stage all of K per CTA; past 48 KiB they fall back to tiles.
    ts = {**GEMV_TUNING, **(tuning or {})}
    if impl == "stream" and ts["NQ_GEMV_MTILES"] == 1 and groups * act_bytes_per_group <= 48 * 1024:
        _launch_stream(fn, kernel_name + "_stream", act_args, groups * act_bytes_per_group,
                       qweight, scales, out, bias, residual, n, k, ts, ctas)
        return
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
    kern = _gemv_kernel(kernel_name, t)
    kern((tiles, s), (32 * t["NQ_GEMV_WARPS"],),
         act_args + (qweight, scales, out, _ptr(bias), _ptr(residual), ws.partial, ws.counters,
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


def bulk_smem_bytes(k: int, t: dict) -> int:
    """Dynamic shared memory of a bulk CTA: the ring of stages (16 rows x GROUPS groups of
    64 B, rows padded to an odd multiple of 64 B), all of x (320 B per group), two items'
    scales."""
    g = t["NQ_BULK_GROUPS"]
    ring = t["NQ_BULK_STAGES"] * 16 * (g * 64 + (64 if g % 2 == 0 else 0))   # rows an odd multiple of 64 B apart
    return ring + (k // GROUP) * 2 * (GROUP + GROUP // 4) + 2 * 16 * t["NQ_BULK_MAX_ITEM_GROUPS"] * 2


def plan_bulk(n: int, k: int, t: dict, sms: int, ksplit: int | None = None, ctas: int | None = None):
    """-> (ksplit, grid) of a bulk launch. Items are (16-row tile, K slice); a slice has at
    most NQ_BULK_MAX_ITEM_GROUPS groups (the scale buffer). Without an explicit ksplit, K is
    split further until the items spread over the SMs at BULK_MIN_BALANCE or better (the
    busiest SM's share is what the launch costs), keeping at least one stage per item."""
    tiles, groups = -(-n // 16), k // GROUP
    per_sm = min(BULK_CTAS_PER_SM, SMEM_PER_SM // (bulk_smem_bytes(k, t) + SMEM_PER_CTA_RESERVED))
    if per_sm < 1:
        raise LimitError("ops_gemv.gemv (bulk)", "shared memory of one CTA", f"<= {SMEM_PER_SM} B per SM",
                         f"{bulk_smem_bytes(k, t)} B (K={k})", "fewer NQ_BULK_STAGES or NQ_BULK_GROUPS")
    cap = ctas or per_sm * sms
    least = -(-groups // t["NQ_BULK_MAX_ITEM_GROUPS"])

    def balance(s):               # mean items per SM over the busiest SM's
        per = tiles * s / sms
        return per / -(-per // 1)

    if ksplit is None:
        ksplit = least
        for s in range(least, groups + 1):
            if groups / s < t["NQ_BULK_GROUPS"] and s > least:
                break
            if balance(s) > balance(ksplit) + 1e-9:
                ksplit = s
            if balance(s) >= BULK_MIN_BALANCE:
                ksplit = s
                break
    if not least <= ksplit <= groups:
        raise NanoqwenError("ops_gemv.gemv (bulk)", "ksplit", f"{least}..{groups} (at most "
                            f"{t['NQ_BULK_MAX_ITEM_GROUPS']} groups per slice)", ksplit)
    return ksplit, min(tiles * ksplit, cap)


def _launch_bulk(fn, kernel_name, act_args, qweight, scales, out, bias, residual, n, k, ksplit, tuning, ctas):
    """Persistent bulk-copy launch (v5): see kernels/gemv_int4.cu, [bulk-produce] / [bulk-consume]."""
    t = {**GEMV_TUNING, **BULK_TUNING, **(tuning or {})}
    if t["NQ_GEMV_MTILES"] != 1:
        raise NanoqwenError(f"ops_gemv.{fn}", "tuning NQ_GEMV_MTILES", "1 for impl='bulk'", t["NQ_GEMV_MTILES"])
    s, grid = plan_bulk(n, k, t, num_sms(), ksplit, ctas)
    tiles = -(-n // 16)
    ws = split_workspace(fn, s, n, tiles)
    kern = _gemv_kernel(kernel_name, t)
    smem = bulk_smem_bytes(k, t)
    kern.max_dynamic_shared_size_bytes = smem
    kern((grid,), (32 * (1 + t["NQ_BULK_CONSUMER_WARPS"]),),
         act_args + (qweight, scales, out, _ptr(bias), _ptr(residual), ws.partial, ws.counters,
                     np.int32(n), np.int32(k), np.int32(s)),
         shared_mem=smem)


def _launch_stream(fn, kernel_name, act_args, smem, qweight, scales, out, bias, residual, n, k, t, ctas):
    """Persistent stream-K launch: units of 16 rows x 128 inputs split evenly over the warps."""
    warps = t["NQ_GEMV_STREAM_WARPS"]
    tiles, groups = -(-n // 16), k // GROUP
    units = tiles * groups
    grid = ctas or max(1, min(STREAM_CTAS_PER_SM * num_sms(), -(-units // (warps * STREAM_MIN_WARP_UNITS))))
    nw = grid * warps
    cmax = (groups - 1) * nw // units + 2              # most warps that share one tile
    ws = workspace()
    if tiles * cmax * 16 > ws.partial.size or tiles > ws.counters.size:
        raise LimitError(f"ops_gemv.{fn}", "stream-K workspace",
                         f"tiles*cmax*16 <= {ws.partial.size} and tiles <= {ws.counters.size}",
                         f"{tiles}*{cmax}*16, {tiles} tiles", "fewer CTAs (ctas=)")
    kern = _gemv_kernel(kernel_name, t)
    kern((grid,), (32 * warps,),
         act_args + (qweight, scales, out, _ptr(bias), _ptr(residual), ws.partial, ws.counters,
                     np.int32(n), np.int32(k), np.int32(cmax)),
         shared_mem=smem)


# ---- the GEMVs ----------------------------------------------------------------------------
def gemv_int4(x, qweight, scales, out, bias=None, residual=None, *, ksplit=None, tuning=None, impl=None,
              ctas=None):
    """out[N] = fp16([residual +] W.x [+ bias]); x fp16 [K], qweight uint32 [N, K/8],
    scales fp16 [N, K/128]. residual may be `out` (in place); x may not."""
    n, k = _weights("gemv_int4", qweight, scales)
    _check("gemv_int4", "x", x, np.float16, (k,))
    _no_alias("gemv_int4", "out", out, x, "x")
    _launch_gemv("gemv_int4", "nq_gemv_int4", (x,), 2 * (GROUP + GROUP // 4),
                 qweight, scales, out, bias, residual, n, k, ksplit, tuning, impl, ctas)


def gemv_int4_swiglu(gate_up, qweight, scales, out, residual=None, *, bias=None, ksplit=None, tuning=None,
                     impl=None, ctas=None):
    """out[N] = fp16([residual +] W.act); act = fp16(silu(g) * u) from gate_up fp16 [2K]
    (gate then up), K = qweight.shape[1] * 8."""
    n, k = _weights("gemv_int4_swiglu", qweight, scales)
    _check("gemv_int4_swiglu", "gate_up", gate_up, np.float16, (2 * k,))
    _no_alias("gemv_int4_swiglu", "out", out, gate_up, "gate_up")
    _launch_gemv("gemv_int4_swiglu", "nq_gemv_int4_swiglu", (gate_up,), 2 * (GROUP + GROUP // 4),
                 qweight, scales, out, bias, residual, n, k, ksplit, tuning, impl, ctas)


def quantize_act_int8(x, xq, xscale, *, tuning=None):
    """x fp16 [K] -> xq int8 [K] (dp4a byte order within each 8) and xscale fp32 [K/128]."""
    k = getattr(x, "size", 0)
    if k < GROUP or k % GROUP:
        raise NanoqwenError("ops_gemv.quantize_act_int8", "x.size", f"a multiple of {GROUP}", k)
    _check("quantize_act_int8", "x", x, np.float16, (k,))
    _check("quantize_act_int8", "xq", xq, np.int8, (k,))
    _check("quantize_act_int8", "xscale", xscale, np.float32, (k // GROUP,))
    threads = 256                               # 16 groups per CTA, a half-warp each
    groups = k // GROUP
    _gemv_kernel("nq_quantize_act_int8", tuning)((-(-groups // (threads // 16)),), (threads,),
                                                 (x, xq, xscale, np.int32(k)))


def gemv_int4_dp4a(xq, xscale, qweight, scales, out, bias=None, residual=None, *, ksplit=None, tuning=None,
                   impl=None, ctas=None):
    """out as gemv_int4, from INT8 activations (quantize_act_int8) and __dp4a."""
    n, k = _weights("gemv_int4_dp4a", qweight, scales)
    _check("gemv_int4_dp4a", "xq", xq, np.int8, (k,))
    _check("gemv_int4_dp4a", "xscale", xscale, np.float32, (k // GROUP,))
    _launch_gemv("gemv_int4_dp4a", "nq_gemv_int4_dp4a", (xq, xscale), GROUP,
                 qweight, scales, out, bias, residual, n, k, ksplit, tuning, impl, ctas)


# ---- the small decode kernels -------------------------------------------------------------
def _decode_kernel(name: str):
    return _kernel("decode_ops", name, tuple(sorted(DECODE_TUNING.items())))


def rmsnorm(x, w, out, eps: float) -> None:
    """out = fp16(fp32(x) * rsqrt(mean(fp32(x)^2) + eps) * fp32(w)) per row; x, out fp16 [H]
    (decode) or [rows, H] (prefill: one CTA per row), w fp16 [H]."""
    h = getattr(x, "shape", (0,))[-1] if getattr(x, "ndim", 0) in (1, 2) else 0
    if h < 8 or h % 8:
        raise NanoqwenError("ops_gemv.rmsnorm", "x.shape", "(H,) or (rows, H), H a multiple of 8",
                            getattr(x, "shape", None))
    rows = x.shape[0] if x.ndim == 2 else 1
    for f, a in (("x", x), ("out", out)):
        _check("rmsnorm", f, a, np.float16, x.shape)
    _check("rmsnorm", "w", w, np.float16, (h,))
    _no_alias("rmsnorm", "out", out, x, "x")
    _decode_kernel("nq_rmsnorm")((rows,), (DECODE_TUNING["NQ_DECODE_THREADS"],),
                                 (x, w, out, np.int32(h), np.float32(eps)))


def embed(token_dev, table, out) -> None:
    """out[r] = table[token_dev[r]] (ids read on the device); a row is NaN if its id is out of
    range. token_dev int32 [1] with out [H] (decode), or [rows] with out [rows, H] (prefill)."""
    if getattr(table, "ndim", 0) != 2 or table.shape[1] % 8:
        raise NanoqwenError("ops_gemv.embed", "table.shape", "(V, H), H a multiple of 8",
                            getattr(table, "shape", None))
    v, h = table.shape
    rows = getattr(token_dev, "size", 0)
    _check("embed", "token_dev", token_dev, np.int32, (max(rows, 1),))
    _check("embed", "table", table, np.float16, (v, h))
    _check("embed", "out", out, np.float16, (h,) if getattr(out, "ndim", 0) == 1 and rows == 1 else (rows, h))
    _decode_kernel("nq_embed")((1, rows), (DECODE_TUNING["NQ_DECODE_THREADS"],),
                               (token_dev, table, out, np.int32(h), np.int32(v)))


def argmax(logits, token_out, *, ctas=None) -> None:
    """token_out[0] = argmax(logits) (fp32 [V]), ties -> lowest index."""
    v = getattr(logits, "size", 0)
    _check("argmax", "logits", logits, np.float32, (max(v, 1),))
    _check("argmax", "token_out", token_out, np.int32, (1,))
    ws = workspace()
    threads = DECODE_TUNING["NQ_DECODE_THREADS"]
    grid = ctas or max(1, min(ARGMAX_CTAS_PER_SM * num_sms(), -(-v // (4 * threads))))
    _decode_kernel("nq_argmax")((grid,), (threads,),
                                (logits, np.int32(v), ws.part_val, ws.part_idx, ws.argmax_counter, token_out))


def lm_head(x, weight, logits, token_out=None, *, ctas=None, tuning=None) -> None:
    """logits fp32 [V] = W.x (W fp16 [V, H], x fp16 [H]); with token_out also the argmax."""
    if getattr(weight, "ndim", 0) != 2 or weight.shape[1] % 8:
        raise NanoqwenError("ops_gemv.lm_head", "weight.shape", "(V, H), H a multiple of 8",
                            getattr(weight, "shape", None))
    v, h = weight.shape
    _check("lm_head", "x", x, np.float16, (h,))
    _check("lm_head", "weight", weight, np.float16, (v, h))
    _check("lm_head", "logits", logits, np.float32, (v,))
    if token_out is not None:
        _check("lm_head", "token_out", token_out, np.int32, (1,))
    if 4 * h > 48 * 1024:
        raise LimitError("ops_gemv.lm_head", "hidden size", "<= 12288 (fp32 x in 48 KiB)", h)
    t = tuning or LMHEAD_TUNING
    rows_per_cta = t["NQ_LMHEAD_WARPS"] * t["NQ_LMHEAD_ROWS_PER_WARP"]
    grid = ctas or min(LMHEAD_CTAS_PER_SM * num_sms(), -(-v // rows_per_cta))
    ws = workspace()
    if grid > ws.part_val.size:
        raise LimitError("ops_gemv.lm_head", "ctas", f"<= {ws.part_val.size}", grid)
    kern = _kernel("lm_head", "nq_lm_head", tuple(sorted(t.items())))
    kern((grid,), (32 * t["NQ_LMHEAD_WARPS"],),
         (x, weight, logits, np.int32(v), np.int32(h), ws.part_val, ws.part_idx, ws.argmax_counter,
          _ptr(token_out)), shared_mem=4 * h)
