"""What every launcher asserts about a device buffer before a kernel sees it."""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import NanoqwenError

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
