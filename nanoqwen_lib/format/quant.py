"""Weight encodings of the seven projections: INT4 (the default) and FP8 E4M3.

INT4: symmetric group-wise quantization and the ValueShuffle nibble order.

A projection W [out, in] is cut into groups of `group_size` along `in`. Each (row, group)
gets one FP16 scale = absmax / 7; codes are round(w / scale) in [-7, 7], zero point 0.
Eight codes w0..w7 (consecutive along `in`) share one uint32; nibble slot i (LSB first)
holds w[VALUE_SHUFFLE[i]] = [w0, w2, w4, w6, w1, w3, w5, w7]. With that order the word's
low nibble of each 16-bit half is a consecutive pair (w0, w1); shifting by 4, 8, 12 gives
(w2, w3), (w4, w5), (w6, w7): two values per operation in the GEMV's unpack.

FP8 E4M3 (the `e4m3fn` variant Hopper's tensor cores read): 1 sign, 4 exponent bits
(bias 7), 3 mantissa bits, no infinities, S.1111.111 is NaN, largest finite 448, smallest
normal 2^-6, subnormals m * 2^-9. A projection gets one FP32 scale per output row,
absmax / 448, and codes = E4M3(w / scale), rounded to nearest even. W = decode(code) *
scale; the scale factors out of every dot product of its row, so a kernel applies it once
per output, after the sum.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load

_FMT = load().format
GROUP_SIZE = _FMT.group_size
QMAX = _FMT.int4_qmax
FP8_MAX = _FMT.fp8_max
VALUE_SHUFFLE = np.array(_FMT.value_shuffle, dtype=np.int64)


def quantize_int4_groupwise(w: np.ndarray, group_size: int = GROUP_SIZE):
    """W [out, in] (any float) -> (codes int8 [out, in] in [-7, 7], scales fp16 [out, in/group]).

    The codes are computed against the FP16-rounded scale, so `codes * scale` is exactly
    what every consumer of the file (reference and kernels) reconstructs.
    """
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of group_size {group_size}")
    wg = np.asarray(w, dtype=np.float32).reshape(out_f, in_f // group_size, group_size)
    absmax = np.abs(wg).max(axis=2)
    scales = (absmax / QMAX).astype(np.float16)
    s32 = scales.astype(np.float32)[:, :, None]
    safe = np.where(s32 == 0, 1.0, s32)
    codes = np.clip(np.rint(wg / safe), -QMAX, QMAX).astype(np.int8)
    codes[np.broadcast_to(s32 == 0, codes.shape)] = 0
    return codes.reshape(out_f, in_f), scales


def pack_int4_value_shuffle(codes: np.ndarray, xp=np) -> np.ndarray:
    """codes int8 [out, in] in [-8, 7] -> uint32 [out, in/8], ValueShuffle nibble order, for
    any array module (NumPy, or CuPy on the GPU)."""
    out_f, in_f = codes.shape
    assert in_f % 8 == 0, in_f
    nib = (codes.astype(xp.int64) & 0xF).reshape(out_f, in_f // 8, 8)
    words = xp.zeros((out_f, in_f // 8), dtype=xp.uint64)
    for slot, value in enumerate(VALUE_SHUFFLE.tolist()):
        words |= nib[:, :, value].astype(xp.uint64) << xp.uint64(4 * slot)
    return words.astype(xp.uint32)


def unpack_int4_value_shuffle(words, xp=np):
    """Inverse of pack_int4_value_shuffle: uint32 [out, in/8] -> int8 codes [out, in], for
    any array module (NumPy, or CuPy on the GPU)."""
    out_f, n_words = words.shape
    w64 = words.astype(xp.int64)
    codes = xp.empty((out_f, n_words, 8), dtype=xp.int8)
    for slot, value in enumerate(VALUE_SHUFFLE.tolist()):
        nib = (w64 >> (4 * slot)) & 0xF
        codes[:, :, value] = xp.where(nib >= 8, nib - 16, nib).astype(xp.int8)
    return codes.reshape(out_f, n_words * 8)


def dequantize_int4(words: np.ndarray, scales: np.ndarray, group_size: int = GROUP_SIZE,
                    xp=np) -> np.ndarray:
    """(packed words, fp16 scales) -> float32 W [out, in], exactly codes * scale."""
    codes = unpack_int4_value_shuffle(xp.asarray(words), xp)
    out_f, in_f = codes.shape
    s = xp.asarray(scales).astype(xp.float32)
    w = codes.astype(xp.float32).reshape(out_f, in_f // group_size, group_size) * s[:, :, None]
    return w.reshape(out_f, in_f)


# ---- FP8 E4M3 --------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    """The 256 E4M3 code points as float32 (NaN for S.1111.111)."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(code & 0x7F) == 0x7F] = np.nan
    return out


E4M3_VALUES = _e4m3_table()
assert float(np.nanmax(E4M3_VALUES)) == FP8_MAX, "fp8_max in nanoqwen.yaml is E4M3's largest finite value"


def fp8_e4m3_encode(x, xp=np):
    """float -> uint8 E4M3 codes, round to nearest even, saturating at +-448 (finite input;
    any array module)."""
    x = xp.asarray(x, dtype=xp.float64)
    if not bool(xp.isfinite(x).all()):
        raise ValueError("fp8_e4m3_encode: NaN or Inf in the input")
    mag = xp.minimum(xp.abs(x), FP8_MAX)
    _, e = xp.frexp(mag)                                   # mag = m * 2^e, m in [0.5, 1)
    quantum = xp.exp2(xp.maximum(e - 1, -6) - 3.0)         # 3 mantissa bits; subnormal below 2^-6
    r = xp.minimum(xp.rint(mag / quantum) * quantum, FP8_MAX)   # rint: ties to even
    m2, e2 = xp.frexp(r)
    normal = r >= 2.0 ** -6
    exp_field = xp.where(normal, e2 - 1 + 7, 0)
    man_field = xp.where(normal, xp.rint((m2 * 2 - 1) * 8), xp.rint(r / 2.0 ** -9))
    code = (exp_field.astype(xp.int64) << 3) | man_field.astype(xp.int64)
    return (code | xp.where(xp.signbit(x), 0x80, 0)).astype(xp.uint8)


def fp8_e4m3_decode(codes, xp=np):
    """uint8 E4M3 codes -> float32 values (exact)."""
    return xp.asarray(E4M3_VALUES)[xp.asarray(codes)]


def fp8_rows(x, xp=np):
    """The FP8 prefill's activation rounding, per row: x [T, K] float32 -> float32
    decode(E4M3(x / ts)) * ts with ts = row absmax / 448 (FP32), what
    kernels/fp8.cu:nq_quantize_rows_fp8 and then nq_gemm_fp8 see. A zero row stays zero."""
    x = xp.asarray(x, dtype=xp.float32)
    ts = (xp.abs(x).max(axis=-1) / xp.float32(FP8_MAX)).astype(xp.float32)
    safe = xp.where(ts == 0, xp.float32(1), ts)
    q = fp8_e4m3_decode(fp8_e4m3_encode((x / safe[..., None]).astype(xp.float32), xp), xp)
    return (q * ts[..., None]).astype(xp.float32)


def quantize_fp8_rowwise(w: np.ndarray):
    """W [out, in] (any float) -> (codes uint8 [out, in] E4M3, scales float32 [out]):
    scale = row absmax / 448 in FP32, codes = E4M3(w / scale); a zero row gets scale 0 and
    codes 0."""
    w = np.asarray(w, dtype=np.float32)
    scales = (np.abs(w).max(axis=1) / np.float32(FP8_MAX)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    codes = fp8_e4m3_encode(w / safe[:, None])
    codes[scales == 0] = 0
    return codes, scales


def dequantize_fp8(codes, scales, xp=np):
    """(E4M3 codes uint8 [out, in], FP32 scales [out]) -> float32 W = decode(code) * scale."""
    return fp8_e4m3_decode(codes, xp) * xp.asarray(scales).astype(xp.float32)[:, None]


def dequantize_projection(qweight, scales, xp=np):
    """A packed projection of either encoding -> float32 W [out, in]: uint32 words are INT4
    (dequantize_int4), uint8 codes are FP8 E4M3 (dequantize_fp8)."""
    if np.dtype(qweight.dtype) == np.uint8:
        return dequantize_fp8(qweight, scales, xp)
    return dequantize_int4(qweight, scales, xp=xp)
