"""Shared by the GPU kernel tests: fp16 error units, the 7B GEMV shapes, random INT4 weights."""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.layout import decode_gemv_shapes

U16 = 2.0 ** -10        # one fp16 ulp at 1.0
TINY16 = 2.0 ** -24     # the smallest fp16 subnormal
SHAPES_7B = decode_gemv_shapes(load().model("7b"))


def rand_int4(rng, n, k):
    """Random packed weights (every nibble, -8 too) and fp16 scales, on the host."""
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    return words, scales
