"""Symmetric group-wise INT4 quantization and the ValueShuffle nibble order.

A projection W [out, in] is cut into groups of `group_size` along `in`. Each (row, group)
gets one FP16 scale = absmax / 7; codes are round(w / scale) in [-7, 7], zero point 0.
Eight codes w0..w7 (consecutive along `in`) share one uint32; nibble slot i (LSB first)
holds w[VALUE_SHUFFLE[i]] = [w0, w2, w4, w6, w1, w3, w5, w7]. With that order the word's
low nibble of each 16-bit half is a consecutive pair (w0, w1); shifting by 4, 8, 12 gives
(w2, w3), (w4, w5), (w6, w7): two values per operation in the GEMV's unpack.
"""
from __future__ import annotations

import numpy as np

from .config import load

_FMT = load().format
GROUP_SIZE = _FMT.group_size
QMAX = _FMT.int4_qmax
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


def pack_int4_value_shuffle(codes: np.ndarray) -> np.ndarray:
    """codes int8 [out, in] in [-8, 7] -> uint32 [out, in/8], ValueShuffle nibble order."""
    out_f, in_f = codes.shape
    assert in_f % 8 == 0, in_f
    nib = (codes.astype(np.int64) & 0xF).reshape(out_f, in_f // 8, 8)
    words = np.zeros((out_f, in_f // 8), dtype=np.uint64)
    for slot, value in enumerate(VALUE_SHUFFLE):
        words |= nib[:, :, value].astype(np.uint64) << np.uint64(4 * slot)
    return words.astype(np.uint32)


def unpack_int4_value_shuffle(words: np.ndarray) -> np.ndarray:
    """Inverse of pack_int4_value_shuffle: uint32 [out, in/8] -> int8 codes [out, in]."""
    out_f, n_words = words.shape
    w64 = words.astype(np.int64)
    codes = np.empty((out_f, n_words, 8), dtype=np.int8)
    for slot, value in enumerate(VALUE_SHUFFLE):
        nib = (w64 >> (4 * slot)) & 0xF
        codes[:, :, value] = np.where(nib >= 8, nib - 16, nib)
    return codes.reshape(out_f, n_words * 8)


def dequantize_int4(words: np.ndarray, scales: np.ndarray, group_size: int = GROUP_SIZE,
                    xp=np) -> np.ndarray:
    """(packed words, fp16 scales) -> float32 W [out, in], exactly codes * scale."""
    codes = xp.asarray(unpack_int4_value_shuffle(np.asarray(words))) if xp is np else \
        _unpack_xp(words, xp)
    out_f, in_f = codes.shape
    s = xp.asarray(scales).astype(xp.float32)
    w = codes.astype(xp.float32).reshape(out_f, in_f // group_size, group_size) * s[:, :, None]
    return w.reshape(out_f, in_f)


def _unpack_xp(words, xp):
    """unpack_int4_value_shuffle for any array module (CuPy on the GPU)."""
    out_f, n_words = words.shape
    w64 = words.astype(xp.int64)
    codes = xp.empty((out_f, n_words, 8), dtype=xp.int8)
    for slot, value in enumerate(VALUE_SHUFFLE.tolist()):
        nib = (w64 >> (4 * slot)) & 0xF
        codes[:, :, value] = xp.where(nib >= 8, nib - 16, nib).astype(xp.int8)
    return codes.reshape(out_f, n_words * 8)
