"""Layout 3, "INT4 lane-fragment": layout 1's codes and scales re-tiled into one byte stream
that the streaming GEMV (kernels/lab/gemv_stream3.cu) reads straight into registers.

Layout 1 (the file's): qweight uint32 [N, K/8] (ValueShuffle nibbles, 8 codes a word) and
scales fp16 [N, K/128] in a second tensor. Layout 3 keeps every word and every scale as
they are and only moves them:

* The rows are cut into tiles of 16 (T = ceil(N / 16); rows past N are padding: zero codes,
  zero scales), K into groups of 128 (G = K / 128). Block (i, j) = tile i x group j is
  BLOCK_BYTES = 1056 bytes at offset (i * G + j) * 1056: a tile's G blocks are one
  contiguous run, tiles follow each other.
* Bytes [0, 1024) of a block: 64 chunks of 16 bytes. Chunk c = 32 h + 4 r + t (h in 0..1,
  r in 0..7, t in 0..3) holds layout-1 words qweight[16 i + 8 h + r, 16 j + 4 t .. + 3]:
  the 32 codes k = 128 j + 32 t .. + 31 of row 8 h + r of the tile. Lane (r, t) = (lane / 4,
  lane % 4) of a warp loads chunk lane (h = 0) and chunk 32 + lane (h = 1): its rows r and
  r + 8, exactly the mma.sync m16n8k16 A fragments it multiplies, and each of the two
  load instructions of the warp reads 512 contiguous bytes.
* Bytes [1024, 1056): the block's 16 scales, fp16, half r * 2 + h = scales[16 i + 8 h + r, j]:
  lane (r, t) loads the 4 bytes at 4 r, the scales of its rows r and r + 8 as one half2.

So one stream carries codes and scales; a block is 33 DRAM sectors (1056 = 33 x 32).
to_stream (layout 1 -> 3) and from_stream (3 -> 1) are exact inverses, on NumPy arrays or,
the same code, on CuPy arrays (the array module is the argument's, or `xp`; cupy is
imported only when a CuPy array is passed). A projection whose N is a multiple of 16 has
no padding rows, so the streams of row-stacked projections (q, k, v -> qkv) are the
concatenation of their streams.

A .nanoqwen file with header layout_id 3 stores each projection as one uint8 tensor
`<proj>.stream` [stream_bytes(N, K)] (format/layout.py); NanoqwenFile.model_tensors()
turns it back into layout 1 with from_stream, NanoqwenFile.stream_tensors() hands out the
bytes as stored.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import NanoqwenError

LAYOUT_ID = load().format.stream_layout_id
GROUP = load().format.group_size
TILE_ROWS = 16
CODE_BYTES = TILE_ROWS * GROUP // 2        # 1024: 16 rows x 128 codes x 4 bits
SCALE_BYTES = TILE_ROWS * 2                # 32: 16 fp16 scales
BLOCK_BYTES = CODE_BYTES + SCALE_BYTES     # 1056
WORDS_PER_GROUP = GROUP // 8               # 16 uint32 per row per group

_U32 = np.dtype("<u4")
_F16 = np.dtype("<f2")


def stream_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] projection in layout 3 (padding rows included)."""
    return -(-n // TILE_ROWS) * (k // GROUP) * BLOCK_BYTES


def array_module(a, xp=None):
    """`xp` if given, else CuPy for a CuPy array (imported only then), else NumPy."""
    if xp is not None:
        return xp
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def _check_shape(fn: str, n: int, k: int) -> None:
    if n < 1:
        raise NanoqwenError(f"stream_layout.{fn}", "N (output rows)", ">= 1", n)
    if k < GROUP or k % GROUP:
        raise NanoqwenError(f"stream_layout.{fn}", "K (inputs)", f"a positive multiple of {GROUP}", k)


def to_stream(qweight, scales, xp=None):
    """Layout 1 (qweight uint32 [N, K/8], scales fp16 [N, K/128]) -> layout 3, uint8
    [stream_bytes(N, K)], in the arrays' module (NumPy or CuPy; `xp` to say which)."""
    fn = "to_stream"
    xp = array_module(qweight, xp)
    qweight, scales = xp.asarray(qweight), xp.asarray(scales)
    if qweight.dtype != _U32 and qweight.dtype != np.uint32:
        raise NanoqwenError(f"stream_layout.{fn}", "qweight.dtype", "uint32", qweight.dtype)
    if scales.dtype != _F16 and scales.dtype != np.float16:
        raise NanoqwenError(f"stream_layout.{fn}", "scales.dtype", "float16", scales.dtype)
    if qweight.ndim != 2:
        raise NanoqwenError(f"stream_layout.{fn}", "qweight.shape", "2-D [N, K/8]", qweight.shape)
    n, kw = qweight.shape
    k = kw * 8
    _check_shape(fn, n, k)
    g = k // GROUP
    if scales.shape != (n, g):
        raise NanoqwenError(f"stream_layout.{fn}", "scales.shape", f"({n}, {g}) for qweight {qweight.shape}",
                            scales.shape)
    t = -(-n // TILE_ROWS)
    if t * TILE_ROWS == n:      # no padding rows: no copy
        qw, sc = qweight, scales
    else:
        qw = xp.zeros((t * TILE_ROWS, kw), _U32)
        qw[:n] = qweight
        sc = xp.zeros((t * TILE_ROWS, g), _F16)
        sc[:n] = scales
    # rows (tile, h, r), words (group, t, word) -> (tile, group, h, r, t, word)
    codes = qw.reshape(t, 2, 8, g, 4, 4).transpose(0, 3, 1, 2, 4, 5)
    codes = xp.ascontiguousarray(codes).view(np.uint8).reshape(t, g, CODE_BYTES)
    # rows (tile, h, r), group -> (tile, group, r, h)
    sv = xp.ascontiguousarray(sc.reshape(t, 2, 8, g).transpose(0, 3, 2, 1)).view(np.uint8).reshape(t, g, SCALE_BYTES)
    return xp.concatenate([codes, sv], axis=2).reshape(-1)


def from_stream(stream, n: int, k: int, xp=None):
    """Layout 3 bytes of an [n, k] projection -> layout 1 (qweight uint32 [n, k/8], scales
    fp16 [n, k/128]), in the stream's module (NumPy or CuPy; `xp` to say which). The
    padding rows must be zero (codes and scales)."""
    fn = "from_stream"
    _check_shape(fn, n, k)
    xp = array_module(stream, xp)
    stream = xp.asarray(stream)
    if stream.dtype != np.uint8:
        raise NanoqwenError(f"stream_layout.{fn}", "stream.dtype", "uint8", stream.dtype)
    if stream.ndim != 1 or stream.size != stream_bytes(n, k):
        raise NanoqwenError(f"stream_layout.{fn}", "stream.shape", f"({stream_bytes(n, k)},) for N={n}, K={k}",
                            stream.shape)
    t, g = -(-n // TILE_ROWS), k // GROUP
    blocks = stream.reshape(t, g, BLOCK_BYTES)
    codes = xp.ascontiguousarray(blocks[:, :, :CODE_BYTES]).view(_U32).reshape(t, g, 2, 8, 4, 4)
    qw = codes.transpose(0, 2, 3, 1, 4, 5).reshape(t * TILE_ROWS, k // 8)
    sv = xp.ascontiguousarray(blocks[:, :, CODE_BYTES:]).view(_F16).reshape(t, g, 8, 2)
    sc = sv.transpose(0, 3, 2, 1).reshape(t * TILE_ROWS, g)
    if t * TILE_ROWS > n and (bool(qw[n:].any()) or bool(sc[n:].view(np.uint16).any())):
        raise NanoqwenError(f"stream_layout.{fn}", f"padding rows {n}..{t * TILE_ROWS - 1}",
                            "zero codes and scales", "nonzero bytes")
    return xp.ascontiguousarray(qw[:n]).astype(np.uint32), xp.ascontiguousarray(sc[:n]).astype(np.float16)
