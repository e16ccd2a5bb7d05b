"""Launchers of the lab's decode GEMVs (kernels/lab/gemv_*.cu), with the engine's contract
(ops_gemv.gemv_int4 / gemv_int4_swiglu): `impl` picks the version.

* "tiles"  the engine's kernel (ops_gemv), for side-by-side runs
* "v1"     kernels/lab/gemv_v1.cu: tiles with one branch per group
* "stream" kernels/lab/gemv_stream.cu: persistent stream-K (v3)
* "bulk"   kernels/lab/gemv_bulk.cu: persistent, weights via a cp.async.bulk ring (v5)
and the INT8-activation path (kernels/lab/gemv_dp4a.cu): quantize_act_int8, gemv_int4_dp4a;
and the layout-3 streaming GEMV (kernels/lab/gemv_stream3.cu): gemv_int4_s3, gemv_int4_s3_swiglu,
which take the weights as one uint8 buffer in layout 3 (nanoqwen_lib/format/stream_layout.py).
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu import ops_gemv
from nanoqwen_lib.format import stream_layout
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_no_alias, device_ptr

GROUP = ops_gemv.GROUP
IMPLS = ("tiles", "v1", "stream", "bulk")
STREAM_TUNING = dict(load().tuning["lab/gemv_stream"].defines)
BULK_TUNING = dict(load().tuning["lab/gemv_bulk"].defines)   # a CTA: one producer warp + the consumer warps
BULK_CTAS_PER_SM = 4            # at most; shared memory may allow fewer
BULK_MIN_BALANCE = 0.9          # split K until the items spread this evenly over the CTAs
SMEM_PER_SM = 233472            # H100 / H200: 228 KiB of shared memory per SM
SMEM_PER_CTA_RESERVED = 1024 + 512   # the driver's reservation + the kernel's static shared memory
STREAM_CTAS_PER_SM = 1
STREAM_MIN_WARP_UNITS = 2       # fewer CTAs for tiny GEMVs: every warp gets >= 2 units
STREAM_MAX_SMEM = 48 * 1024     # the stream kernels stage all of K per CTA; past this they fall back to tiles


def _check(fn, field, a, dtype, shape):
    check_device_buffer(f"lab.gemv.{fn}", field, a, dtype, shape)


def _check_out(fn, out, bias, residual, n):
    _check(fn, "out", out, np.float16, (n,))
    if bias is not None:
        _check(fn, "bias", bias, np.float16, (n,))
    if residual is not None:
        _check(fn, "residual", residual, np.float16, (n,))


def _tuning(tuning):
    return {**ops_gemv.GEMV_TUNING, **STREAM_TUNING, **BULK_TUNING, **(tuning or {})}


def _dispatch(fn, kernel, act_args, act_bytes, qweight, scales, out, bias, residual, n, k,
              ksplit, tuning, impl, ctas, module_tiles="gemv_int4"):
    impl = impl or "tiles"
    if impl not in IMPLS:
        raise NanoqwenError(f"lab.gemv.{fn}", "impl", f"one of {IMPLS}", repr(impl))
    groups = k // GROUP
    t = _tuning(tuning)
    if impl == "bulk":
        _launch_bulk(fn, kernel + "_bulk", act_args, qweight, scales, out, bias, residual, n, k, ksplit, t, ctas)
    elif impl == "stream" and t["NQ_GEMV_MTILES"] == 1 and groups * act_bytes <= STREAM_MAX_SMEM:
        _launch_stream(fn, kernel + "_stream", act_args, groups * act_bytes,
                       qweight, scales, out, bias, residual, n, k, t, ctas)
    else:
        module = {"v1": "lab/gemv_v1"}.get(impl, module_tiles)
        ops_gemv.launch_tiles(fn, kernel, act_args, act_bytes, qweight, scales, out, bias, residual,
                              n, k, ksplit, tuning, module)


def gemv_int4(x, qweight, scales, out, bias=None, residual=None, *, impl="tiles", ksplit=None, tuning=None,
              ctas=None):
    """ops_gemv.gemv_int4's contract, by version `impl`."""
    n, k = ops_gemv.check_weights("gemv_int4", qweight, scales)
    _check("gemv_int4", "x", x, np.float16, (k,))
    check_no_alias("lab.gemv.gemv_int4", "out", out, x, "x")
    _check_out("gemv_int4", out, bias, residual, n)
    _dispatch("gemv_int4", "nq_gemv_int4", (x,), ops_gemv.ACT_BYTES_PER_GROUP,
              qweight, scales, out, bias, residual, n, k, ksplit, tuning, impl, ctas)


def gemv_int4_swiglu(gate_up, qweight, scales, out, residual=None, *, bias=None, impl="tiles", ksplit=None,
                     tuning=None, ctas=None):
    """ops_gemv.gemv_int4_swiglu's contract, by version `impl`."""
    n, k = ops_gemv.check_weights("gemv_int4_swiglu", qweight, scales)
    _check("gemv_int4_swiglu", "gate_up", gate_up, np.float16, (2 * k,))
    check_no_alias("lab.gemv.gemv_int4_swiglu", "out", out, gate_up, "gate_up")
    _check_out("gemv_int4_swiglu", out, bias, residual, n)
    _dispatch("gemv_int4_swiglu", "nq_gemv_int4_swiglu", (gate_up,), ops_gemv.ACT_BYTES_PER_GROUP,
              qweight, scales, out, bias, residual, n, k, ksplit, tuning, impl, ctas)


def quantize_act_int8(x, xq, xscale, *, tuning=None):
    """x fp16 [K] -> xq int8 [K] (dp4a byte order within each 8) and xscale fp32 [K/128]."""
    k = getattr(x, "size", 0)
    if k < GROUP or k % GROUP:
        raise NanoqwenError("lab.gemv.quantize_act_int8", "x.size", f"a multiple of {GROUP}", k)
    _check("quantize_act_int8", "x", x, np.float16, (k,))
    _check("quantize_act_int8", "xq", xq, np.int8, (k,))
    _check("quantize_act_int8", "xscale", xscale, np.float32, (k // GROUP,))
    threads = 256                               # 16 groups per CTA, a half-warp each
    groups = k // GROUP
    ops_gemv.gemv_kernel("nq_quantize_act_int8", tuning, "lab/gemv_dp4a")(
        (-(-groups // (threads // 16)),), (threads,), (x, xq, xscale, np.int32(k)))


def gemv_int4_dp4a(xq, xscale, qweight, scales, out, bias=None, residual=None, *, impl="tiles", ksplit=None,
                   tuning=None, ctas=None):
    """out as gemv_int4, from INT8 activations (quantize_act_int8) and __dp4a; impl "tiles" or "stream"."""
    n, k = ops_gemv.check_weights("gemv_int4_dp4a", qweight, scales)
    _check("gemv_int4_dp4a", "xq", xq, np.int8, (k,))
    _check("gemv_int4_dp4a", "xscale", xscale, np.float32, (k // GROUP,))
    _check_out("gemv_int4_dp4a", out, bias, residual, n)
    if impl not in ("tiles", "stream"):
        raise NanoqwenError("lab.gemv.gemv_int4_dp4a", "impl", "'tiles' or 'stream'", repr(impl))
    if impl == "stream":
        _dispatch("gemv_int4_dp4a", "nq_gemv_int4_dp4a", (xq, xscale), GROUP, qweight, scales, out, bias,
                  residual, n, k, ksplit, tuning, impl, ctas)
    else:
        ops_gemv.launch_tiles("gemv_int4_dp4a", "nq_gemv_int4_dp4a", (xq, xscale), GROUP, qweight, scales, out,
                              bias, residual, n, k, ksplit, tuning, "lab/gemv_dp4a")


# ---- v5 bulk ------------------------------------------------------------------------------
def bulk_smem_bytes(k: int, t: dict) -> int:
    """Dynamic shared memory of a bulk CTA: the ring of stages (16 rows x GROUPS groups of
    64 B, rows padded to an odd multiple of 64 B), all of x (320 B per group), two items'
    scales."""
    g = t["NQ_BULK_GROUPS"]
    ring = t["NQ_BULK_STAGES"] * 16 * (g * 64 + (64 if g % 2 == 0 else 0))   # rows an odd multiple of 64 B apart
    return ring + (k // GROUP) * ops_gemv.ACT_BYTES_PER_GROUP + 2 * 16 * t["NQ_BULK_MAX_ITEM_GROUPS"] * 2


def plan_bulk(n: int, k: int, t: dict, sms: int, ksplit: int | None = None, ctas: int | None = None):
    """-> (ksplit, grid) of a bulk launch. Items are (16-row tile, K slice); a slice has at
    most NQ_BULK_MAX_ITEM_GROUPS groups (the scale buffer). Without an explicit ksplit, K is
    split further until the items spread over the SMs at BULK_MIN_BALANCE or better (the
    busiest SM's share is what the launch costs), keeping at least one stage per item."""
    tiles, groups = -(-n // 16), k // GROUP
    per_sm = min(BULK_CTAS_PER_SM, SMEM_PER_SM // (bulk_smem_bytes(k, t) + SMEM_PER_CTA_RESERVED))
    if per_sm < 1:
        raise LimitError("lab.gemv (bulk)", "shared memory of one CTA", f"<= {SMEM_PER_SM} B per SM",
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
        raise NanoqwenError("lab.gemv (bulk)", "ksplit", f"{least}..{groups} (at most "
                            f"{t['NQ_BULK_MAX_ITEM_GROUPS']} groups per slice)", ksplit)
    return ksplit, min(tiles * ksplit, cap)


def _launch_bulk(fn, kernel_name, act_args, qweight, scales, out, bias, residual, n, k, ksplit, t, ctas):
    """Persistent bulk-copy launch (v5): see kernels/lab/gemv_bulk.cu, [bulk-produce] / [bulk-consume]."""
    if t["NQ_GEMV_MTILES"] != 1:
        raise NanoqwenError(f"lab.gemv.{fn}", "tuning NQ_GEMV_MTILES", "1 for impl='bulk'", t["NQ_GEMV_MTILES"])
    s, grid = plan_bulk(n, k, t, ops_gemv.num_sms(), ksplit, ctas)
    ws = ops_gemv.split_workspace(fn, s, n, -(-n // 16))
    kern = ops_gemv.gemv_kernel(kernel_name, t, "lab/gemv_bulk")
    smem = bulk_smem_bytes(k, t)
    kern.max_dynamic_shared_size_bytes = smem
    kern((grid,), (32 * (1 + t["NQ_BULK_CONSUMER_WARPS"]),),
         act_args + (qweight, scales, out, device_ptr(bias), device_ptr(residual), ws.partial, ws.counters,
                     np.int32(n), np.int32(k), np.int32(s)),
         shared_mem=smem)


# ---- v3 stream ----------------------------------------------------------------------------
def _launch_stream(fn, kernel_name, act_args, smem, qweight, scales, out, bias, residual, n, k, t, ctas):
    """Persistent stream-K launch: units of 16 rows x 128 inputs split evenly over the warps."""
    warps = t["NQ_GEMV_STREAM_WARPS"]
    tiles, groups = -(-n // 16), k // GROUP
    units = tiles * groups
    grid = ctas or max(1, min(STREAM_CTAS_PER_SM * ops_gemv.num_sms(), -(-units // (warps * STREAM_MIN_WARP_UNITS))))
    nw = grid * warps
    cmax = (groups - 1) * nw // units + 2              # most warps that share one tile
    ws = ops_gemv.workspace()
    if tiles * cmax * 16 > ws.partial.size or tiles > ws.counters.size:
        raise LimitError(f"lab.gemv.{fn}", "stream-K workspace",
                         f"tiles*cmax*16 <= {ws.partial.size} and tiles <= {ws.counters.size}",
                         f"{tiles}*{cmax}*16, {tiles} tiles", "fewer CTAs (ctas=)")
    kern = ops_gemv.gemv_kernel(kernel_name, t, "lab/gemv_stream")
    kern((grid,), (32 * warps,),
         act_args + (qweight, scales, out, device_ptr(bias), device_ptr(residual), ws.partial, ws.counters,
                     np.int32(n), np.int32(k), np.int32(cmax)),
         shared_mem=smem)


# ---- layout 3: the streaming GEMV ---------------------------------------------------------
S3_TUNING = dict(load().tuning["lab/gemv_stream3"].defines)
S3_TARGET_WARPS_PER_SM = 16     # split K until the grid has this many warps per SM ...
S3_MIN_GROUPS_PER_WARP = 4      # ... but keep at least this many groups per warp's slice
S3_MAX_SMEM = 48 * 1024         # one CTA's x slice (320 B per group)


def plan_stream3(n: int, k: int, sms: int, ksplit: int | None = None) -> int:
    """ksplit of a layout-3 launch: one warp per (16-row tile, K slice); K is split until the
    grid holds S3_TARGET_WARPS_PER_SM warps per SM (bytes in flight scale with warps), while
    each slice keeps S3_MIN_GROUPS_PER_WARP groups and fits shared memory."""
    tiles, groups = -(-n // 16), k // GROUP
    least = -(-groups * ops_gemv.ACT_BYTES_PER_GROUP // S3_MAX_SMEM)
    if ksplit is None:
        want = -(-S3_TARGET_WARPS_PER_SM * sms // tiles)
        ksplit = max(least, min(want, max(1, groups // S3_MIN_GROUPS_PER_WARP)))
    if not max(1, least) <= ksplit <= groups:
        raise NanoqwenError("lab.gemv (stream3)", "ksplit", f"{max(1, least)}..{groups} (groups of K, "
                            f"a slice's x within {S3_MAX_SMEM} B)", ksplit)
    return ksplit


def _launch_s3(fn, kernel_name, act, w3, out, bias, residual, n, k, ksplit, tuning):
    _check(fn, "w3", w3, np.uint8, (stream_layout.stream_bytes(n, k),))
    _check_out(fn, out, bias, residual, n)
    t = {**ops_gemv.GEMV_TUNING, **S3_TUNING, **(tuning or {})}
    s = plan_stream3(n, k, ops_gemv.num_sms(), ksplit)
    warps = t["NQ_S3_WARPS"]
    ctas = -(-(-(-n // 16)) // warps)
    ws = ops_gemv.split_workspace(fn, s, n, ctas)
    smem = -(-(k // GROUP) // s) * ops_gemv.ACT_BYTES_PER_GROUP
    kern = ops_gemv.gemv_kernel(kernel_name, t, "lab/gemv_stream3")
    kern((ctas, s), (32 * warps,),
         (act, w3, out, device_ptr(bias), device_ptr(residual), ws.partial, ws.counters,
          np.int32(n), np.int32(k), np.int32(s)), shared_mem=smem)
    return s


def gemv_int4_s3(x, w3, out, bias=None, residual=None, *, ksplit=None, tuning=None):
    """out[N] = fp16([residual +] W.x [+ bias]) with W in layout 3 (w3 uint8
    [stream_layout.stream_bytes(N, K)]); N = out.size, K = x.size. residual may be `out`.
    Returns the ksplit it ran."""
    k, n = getattr(x, "size", 0), getattr(out, "size", 0)
    if k < GROUP or k % GROUP:
        raise NanoqwenError("lab.gemv.gemv_int4_s3", "x.size", f"a positive multiple of {GROUP}", k)
    _check("gemv_int4_s3", "x", x, np.float16, (k,))
    check_no_alias("lab.gemv.gemv_int4_s3", "out", out, x, "x")
    return _launch_s3("gemv_int4_s3", "nq_gemv_s3", x, w3, out, bias, residual, n, k, ksplit, tuning)


def gemv_int4_s3_swiglu(gate_up, w3, out, residual=None, *, bias=None, ksplit=None, tuning=None):
    """out[N] = fp16([residual +] W.act [+ bias]), act = fp16(silu(g) * u) from gate_up fp16
    [2K] (gate then up), W in layout 3; N = out.size, K = gate_up.size / 2."""
    k, n = getattr(gate_up, "size", 0) // 2, getattr(out, "size", 0)
    if k < GROUP or k % GROUP:
        raise NanoqwenError("lab.gemv.gemv_int4_s3_swiglu", "gate_up.size", f"2 x a positive multiple of {GROUP}",
                            2 * k)
    _check("gemv_int4_s3_swiglu", "gate_up", gate_up, np.float16, (2 * k,))
    check_no_alias("lab.gemv.gemv_int4_s3_swiglu", "out", out, gate_up, "gate_up")
    return _launch_s3("gemv_int4_s3_swiglu", "nq_gemv_s3_swiglu", gate_up, w3, out, bias, residual, n, k, ksplit,
                      tuning)
