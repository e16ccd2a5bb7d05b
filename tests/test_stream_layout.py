"""Layout 3 (INT4 lane-fragment, nanoqwen_lib/format/stream_layout.py) on the CPU: the
repacker against a byte-by-byte statement of the layout, exact round trips at random, tiny
and 7B shapes, and errors that name the field, the expectation and what was found."""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.format import stream_layout as sl
from nanoqwen_lib.format.layout import decode_gemv_shapes

SHAPES = {f"7b-{k}": v for k, v in decode_gemv_shapes(load().model("7b")).items()}
SHAPES.update({f"tiny-{k}": v for k, v in decode_gemv_shapes(load().model("tiny")).items()})


def rand_layout1(rng, n, k):
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    return words, scales


def naive_to_stream(words, scales):
    """The module docstring's layout, one chunk and one scale at a time."""
    n, kw = words.shape
    t, g = -(-n // 16), kw // 16
    out = np.zeros(t * g * 1056, np.uint8)
    for i in range(t):
        for j in range(g):
            base = (i * g + j) * 1056
            for c in range(64):
                h, r, q = c // 32, (c % 32) // 4, c % 4
                row = 16 * i + 8 * h + r
                if row < n:
                    chunk = words[row, 16 * j + 4 * q: 16 * j + 4 * q + 4].astype("<u4").tobytes()
                    out[base + 16 * c: base + 16 * c + 16] = np.frombuffer(chunk, np.uint8)
            for r in range(8):
                for h in range(2):
                    row = 16 * i + 8 * h + r
                    if row < n:
                        b = np.array([scales[row, j]], "<f2").tobytes()
                        out[base + 1024 + 4 * r + 2 * h: base + 1024 + 4 * r + 2 * h + 2] = np.frombuffer(b, np.uint8)
    return out


def test_constants():
    assert sl.LAYOUT_ID == 3 and sl.BLOCK_BYTES == 1056 and sl.BLOCK_BYTES % 32 == 0
    assert load().format.layout_id == 1, "layout 1 stays the file's default"


@pytest.mark.parametrize("n,k", [(1, 128), (7, 384), (16, 128), (17, 256), (33, 1152), (130, 896)])
def test_matches_the_written_layout(rng, n, k):
    words, scales = rand_layout1(rng, n, k)
    np.testing.assert_array_equal(sl.to_stream(words, scales), naive_to_stream(words, scales))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_model_shapes(rng, shape):
    n, k = SHAPES[shape]
    words, scales = rand_layout1(rng, n, k)
    s = sl.to_stream(words, scales)
    assert s.dtype == np.uint8 and s.size == sl.stream_bytes(n, k) == -(-n // 16) * (k // 128) * 1056
    w2, s2 = sl.from_stream(s, n, k)
    assert w2.dtype == np.uint32 and s2.dtype == np.float16
    np.testing.assert_array_equal(w2, words)
    np.testing.assert_array_equal(s2.view(np.uint16), scales.view(np.uint16))


def test_round_trip_random_shapes(rng):
    for _ in range(40):
        n, k = int(rng.integers(1, 300)), 128 * int(rng.integers(1, 12))
        words, scales = rand_layout1(rng, n, k)
        scales[rng.random(scales.shape) < 0.05] = np.float16(-0.0)   # signs and odd bit patterns survive
        w2, s2 = sl.from_stream(sl.to_stream(words, scales), n, k)
        np.testing.assert_array_equal(w2, words)
        np.testing.assert_array_equal(s2.view(np.uint16), scales.view(np.uint16))


def test_a_warp_load_is_512_contiguous_bytes_of_its_rows(rng):
    """Lane L of load h reads bytes 512 h + 16 L of the block: rows (L/4) + 8h, k 32 (L%4).."""
    n, k = 16, 256
    words, scales = rand_layout1(rng, n, k)
    blk = sl.to_stream(words, scales)[1056:2112]             # tile 0, group 1
    for h in range(2):
        for lane in range(32):
            got = blk[512 * h + 16 * lane: 512 * h + 16 * lane + 16].view("<u4")
            np.testing.assert_array_equal(got, words[lane // 4 + 8 * h, 16 + 4 * (lane % 4): 16 + 4 * (lane % 4) + 4])
        sc = blk[1024:].view("<f2").reshape(8, 2)
        np.testing.assert_array_equal(sc[:, 0], scales[0:8, 1])
        np.testing.assert_array_equal(sc[:, 1], scales[8:16, 1])


@pytest.mark.parametrize("args,field,expected,found", [
    ((np.zeros((4, 16), np.int32), np.zeros((4, 1), np.float16)), "qweight.dtype", "uint32", "int32"),
    ((np.zeros((4, 16), np.uint32), np.zeros((4, 1), np.float32)), "scales.dtype", "float16", "float32"),
    ((np.zeros(16, np.uint32), np.zeros((1, 1), np.float16)), "qweight.shape", "2-D", "(16,)"),
    ((np.zeros((4, 15), np.uint32), np.zeros((4, 1), np.float16)), "K (inputs)", "multiple of 128", "120"),
    ((np.zeros((0, 16), np.uint32), np.zeros((0, 1), np.float16)), "N (output rows)", ">= 1", "0"),
    ((np.zeros((4, 32), np.uint32), np.zeros((4, 1), np.float16)), "scales.shape", "(4, 2)", "(4, 1)"),
])
def test_to_stream_refuses_bad_inputs(args, field, expected, found):
    with pytest.raises(NanoqwenError) as e:
        sl.to_stream(*args)
    assert e.value.field == field and expected in str(e.value.expected) and found in str(e.value.found), str(e.value)


def test_from_stream_refuses_bad_inputs(rng):
    words, scales = rand_layout1(rng, 20, 256)
    s = sl.to_stream(words, scales)
    with pytest.raises(NanoqwenError, match=r"stream.shape: expected \(4224,\) for N=20, K=256, found \(4223,\)"):
        sl.from_stream(s[:-1], 20, 256)
    with pytest.raises(NanoqwenError, match="stream.dtype: expected uint8, found int8"):
        sl.from_stream(s.view(np.int8), 20, 256)
    with pytest.raises(NanoqwenError, match="K \\(inputs\\)"):
        sl.from_stream(s, 20, 200)
    bad = s.copy()
    bad[1056 * 2 + 16 * 31] = 1                               # tile 1, chunk 31: row 16 + 7 = 23 >= 20, padding
    with pytest.raises(NanoqwenError, match="padding rows 20..31: expected zero codes and scales"):
        sl.from_stream(bad, 20, 256)
