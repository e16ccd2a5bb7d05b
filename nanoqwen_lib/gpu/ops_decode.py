"""Launchers for the small decode kernels and the lm_head (kernels/decode_ops.cu, lm_head.cu):
rmsnorm, embed, argmax, and the FP16 lm_head with the argmax fused into its last CTA.

As in ops_gemv, every buffer is checked before a launch, nothing is allocated per call, and
the argmax's partials live in the per-device workspace that ops_gemv allocates once
(ops_gemv.workspace(), called before a CUDA graph is captured).
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_no_alias, device_ptr
from nanoqwen_lib.gpu.ops_gemv import num_sms, workspace

_TUNING = load().tuning
LMHEAD_TUNING = dict(_TUNING["lm_head"].defines)
DECODE_TUNING = dict(_TUNING["decode_ops"].defines)
LMHEAD_CTAS_PER_SM = 4          # persistent grid of the lm_head
ARGMAX_CTAS_PER_SM = 1


@functools.lru_cache(maxsize=None)
def _kernel(module: str, name: str, extra: tuple):
    return cuda_build.load_module(module, None, dict(extra)).get_function(name)


def _check(fn: str, field: str, a, dtype, shape: tuple) -> None:
    check_device_buffer(f"ops_decode.{fn}", field, a, dtype, shape)


def _no_alias(fn: str, field: str, a, b, other: str) -> None:
    check_no_alias(f"ops_decode.{fn}", field, a, b, other)


_ptr = device_ptr


def _decode_kernel(name: str):
    return _kernel("decode_ops", name, tuple(sorted(DECODE_TUNING.items())))


def rmsnorm(x, w, out, eps: float) -> None:
    """out = fp16(fp32(x) * rsqrt(mean(fp32(x)^2) + eps) * fp32(w)) per row; x, out fp16 [H]
    (decode) or [rows, H] (prefill: one CTA per row), w fp16 [H]."""
    h = getattr(x, "shape", (0,))[-1] if getattr(x, "ndim", 0) in (1, 2) else 0
    if h < 8 or h % 8:
        raise NanoqwenError("ops_decode.rmsnorm", "x.shape", "(H,) or (rows, H), H a multiple of 8",
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
        raise NanoqwenError("ops_decode.embed", "table.shape", "(V, H), H a multiple of 8",
                            getattr(table, "shape", None))
    v, h = table.shape
    rows = getattr(token_dev, "size", 0)
    _check("embed", "token_dev", token_dev, np.int32, (max(rows, 1),))
    _check("embed", "table", table, np.float16, (v, h))
    _check("embed", "out", out, np.float16, (h,) if getattr(out, "ndim", 0) == 1 and rows == 1 else (rows, h))
    _decode_kernel("nq_embed")((1, rows), (DECODE_TUNING["NQ_DECODE_THREADS"],),
                               (token_dev, table, out, np.int32(h), np.int32(v)))


def argmax_grid(v: int) -> int:
    """CTAs of nq_argmax over v logits: ARGMAX_CTAS_PER_SM a SM this machine plans for, at most
    one per 4 x threads logits."""
    return max(1, min(ARGMAX_CTAS_PER_SM * num_sms(), -(-v // (4 * DECODE_TUNING["NQ_DECODE_THREADS"]))))


def lm_head_grid(v: int, tuning: dict) -> int:
    """CTAs of nq_lm_head over v rows: LMHEAD_CTAS_PER_SM a SM this machine plans for, at most
    one per CTA's rows."""
    return min(LMHEAD_CTAS_PER_SM * num_sms(), -(-v // (tuning["NQ_LMHEAD_WARPS"] * tuning["NQ_LMHEAD_ROWS_PER_WARP"])))


def argmax(logits, token_out, *, ctas=None) -> None:
    """token_out[0] = argmax(logits) (fp32 [V]), ties -> lowest index."""
    v = getattr(logits, "size", 0)
    _check("argmax", "logits", logits, np.float32, (max(v, 1),))
    _check("argmax", "token_out", token_out, np.int32, (1,))
    ws = workspace()
    threads = DECODE_TUNING["NQ_DECODE_THREADS"]
    grid = ctas or argmax_grid(v)
    _decode_kernel("nq_argmax")((grid,), (threads,),
                                (logits, np.int32(v), ws.part_val, ws.part_idx, ws.argmax_counter, token_out))


def lm_head(x, weight, logits, token_out=None, *, ctas=None, tuning=None) -> None:
    """logits fp32 [V] = W.x (W fp16 [V, H], x fp16 [H]); with token_out also the argmax."""
    if getattr(weight, "ndim", 0) != 2 or weight.shape[1] % 8:
        raise NanoqwenError("ops_decode.lm_head", "weight.shape", "(V, H), H a multiple of 8",
                            getattr(weight, "shape", None))
    v, h = weight.shape
    _check("lm_head", "x", x, np.float16, (h,))
    _check("lm_head", "weight", weight, np.float16, (v, h))
    _check("lm_head", "logits", logits, np.float32, (v,))
    if token_out is not None:
        _check("lm_head", "token_out", token_out, np.int32, (1,))
    if 4 * h > 48 * 1024:
        raise LimitError("ops_decode.lm_head", "hidden size", "<= 12288 (fp32 x in 48 KiB)", h)
    t = tuning or LMHEAD_TUNING
    grid = ctas or lm_head_grid(v, t)
    ws = workspace()
    if grid > ws.part_val.size:
        raise LimitError("ops_decode.lm_head", "ctas", f"<= {ws.part_val.size}", grid)
    kern = _kernel("lm_head", "nq_lm_head", tuple(sorted(t.items())))
    kern((grid,), (32 * t["NQ_LMHEAD_WARPS"],),
         (x, weight, logits, np.int32(v), np.int32(h), ws.part_val, ws.part_idx, ws.argmax_counter,
          _ptr(token_out)), shared_mem=4 * h)
