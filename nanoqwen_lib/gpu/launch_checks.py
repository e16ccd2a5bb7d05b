"""What every launcher asserts about a device buffer before a kernel sees it.

    check_device_buffer(where, field, a, dtype, shape)   a CuPy array: dtype, shape, C-contiguous, 128-byte aligned
    check_no_alias(where, field, a, b, other)            a and b are not one buffer
    device_ptr(a)                                        an optional buffer's kernel argument (0 for None)
    check_int4_weights(where, qweight, scales)           (N, K) of a packed INT4 projection
    check_tokens(where, field, a)                        T of a [T, features] activation
    check_prefill_gemm(where, x, out, n, k, ...)         T of a prefill GEMM's x, out, bias, residual

`where` is the public launcher an error names (e.g. "ops_prefill.gemm_int4").
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError

ALIGN = load().format.alignment


def check_device_buffer(where: str, field: str, a, dtype, shape: tuple) -> None:
    """A CuPy array of this dtype and shape, C-contiguous, 128-byte aligned; else an error
    naming the launcher (`where`), the argument, the expected and the found value."""
    import cupy as cp
    if not isinstance(a, cp.ndarray):
        raise NanoqwenError(where, field, "a cupy.ndarray", type(a).__name__)
    if a.dtype != np.dtype(dtype):
        raise NanoqwenError(where, field + ".dtype", np.dtype(dtype).name, a.dtype.name)
    if tuple(a.shape) != tuple(shape):
        raise NanoqwenError(where, field + ".shape", tuple(shape), tuple(a.shape))
    if not a.flags.c_contiguous:
        raise NanoqwenError(where, field, "a C-contiguous array", f"strides {a.strides}")
    if a.data.ptr % ALIGN:
        raise NanoqwenError(where, field + ".data.ptr", f"a multiple of {ALIGN}",
                            f"{a.data.ptr:#x} (offset {a.data.ptr % ALIGN})")


def check_no_alias(where: str, field: str, a, b, other: str) -> None:
    """`a` and `b` (either may be None) are not the same buffer."""
    if a is not None and b is not None and a.data.ptr == b.data.ptr:
        raise NanoqwenError(where, field, f"a buffer other than {other}", "the same buffer")


def device_ptr(a) -> np.uint64:
    """A kernel argument for an optional buffer: its address, or 0 for None."""
    return np.uint64(0 if a is None else a.data.ptr)


def check_int4_weights(where: str, qweight, scales) -> tuple[int, int]:
    """(N, K) of a packed INT4 projection (uint32 codes [N, K/8], fp16 scales [N, K/group]),
    checked as a device buffer each; K at least one group and a multiple of it."""
    group = load().format.group_size
    if getattr(qweight, "ndim", 0) != 2:
        raise NanoqwenError(where, "qweight.shape", "(N, K/8)", getattr(qweight, "shape", None))
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if n < 1 or k < group or k % group:
        raise NanoqwenError(where, "qweight.shape", f"N >= 1 and K a multiple of {group}", (n, k))
    check_device_buffer(where, "qweight", qweight, np.uint32, (n, k // 8))
    check_device_buffer(where, "scales", scales, np.float16, (n, k // group))
    return n, k


def check_tokens(where: str, field: str, a) -> int:
    """T of an activation [T, features] (T >= 1), read before its buffer is checked."""
    if getattr(a, "ndim", 0) != 2 or a.shape[0] < 1:
        raise NanoqwenError(where, field + ".shape", "(T, features), T >= 1", getattr(a, "shape", None))
    return a.shape[0]


def check_prefill_gemm(where: str, x, out, n: int, k: int, bias=None, residual=None, *, weight_elems: int,
                       x_field: str = "x", x_dtype=np.float16, x_cols: int | None = None, out_field: str = "out",
                       out_cols: int | None = None, out_offsets: bool = True, alias: bool = True) -> int:
    """T of a prefill GEMM out = x W^T [+ bias] [+ residual] (W: N x K, already checked), its
    arguments checked in this order: x [T, x_cols] of x_dtype (fp16; x_cols = K unless given),
    out fp16 [T, out_cols] (N unless given), bias fp16 [N] and residual fp16 [T, N] when given
    (residual may be `out`: in place), out not the buffer x (unless alias=False), then the
    32-bit offsets: T * x_cols, weight_elems (the weight array's elements) and, with
    out_offsets, T * out_cols below 2^31 (else a LimitError)."""
    t = check_tokens(where, x_field, x)
    x_cols = k if x_cols is None else x_cols
    out_cols = n if out_cols is None else out_cols
    check_device_buffer(where, x_field, x, x_dtype, (t, x_cols))
    check_device_buffer(where, out_field, out, np.float16, (t, out_cols))
    if bias is not None:
        check_device_buffer(where, "bias", bias, np.float16, (n,))
    if residual is not None:
        check_device_buffer(where, "residual", residual, np.float16, (t, n))
    if alias:
        check_no_alias(where, out_field, out, x, x_field)
    if t * x_cols >= 2**31 or weight_elems >= 2**31 or (out_offsets and t * out_cols >= 2**31):
        raise LimitError(where, "T * row length", "< 2^31 elements (32-bit offsets)",
                         f"T={t}, row {x_cols}, N={n}, K={k}")
    return t
