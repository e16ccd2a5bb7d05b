"""CUtensorMap encoding for the bulk tensor copies (cp.async.bulk.tensor, hopper.cuh
tensor_copy_2d_g2s), with no new dependency: the driver's cuTensorMapEncodeTiled is called
through ctypes on libcuda.so.1 (the GPU machine's driver, which CuPy has loaded already).

    args = tiled_args(ptr, shape, dtype, box, swizzle="128B")   # pure Python: checks every field
    raw = encode(args)                                          # 128 bytes (needs the driver)
    dev = device_map(array, box, swizzle="128B")                # cupy uint8 [128], cached

A map describes a row-major tensor of `shape` (outermost first, as NumPy) at a device
address; the copy engine moves one `box` (outermost first too) per instruction. The driver
takes dimensions innermost first and strides in bytes for dimensions 1.. only; tiled_args
does that conversion and validates what the driver would reject (CUDA driver API,
cuTensorMapEncodeTiled), raising NanoqwenError naming the field, what was expected and what
was found, before any driver call. The kernel gets the map either as a
`const __grid_constant__ hopper::TensorMap` parameter (needs a launcher that passes a
128-byte struct by value) or, as here, by pointer to a 64-byte-aligned device copy
(`device_map`): cp.async.bulk.tensor reads a map in global memory too.

Used by prefill_wgmma.cu (ops_prefill / ops_fp8 wgmma launchers): X (fp16 or E4M3) and FP8's
codes reach shared memory by TMA in 128-byte-swizzled boxes. The device copies are cached per
(device, pointer, shape, dtype, box, swizzle) and never freed: a launch captured into a CUDA
graph keeps pointing at a live map. Encode (launch once) before capturing: the first encode
copies host -> device, which a capturing stream refuses.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from nanoqwen_lib.errors import NanoqwenError

WHERE = "tensor_map"

# CUtensorMapDataType (cuda.h)
DATA_TYPES = {np.dtype(np.uint8): 0, np.dtype(np.uint16): 1, np.dtype(np.uint32): 2, np.dtype(np.int32): 3,
              np.dtype(np.uint64): 4, np.dtype(np.int64): 5, np.dtype(np.float16): 6, np.dtype(np.float32): 7,
              np.dtype(np.float64): 8}
SWIZZLES = {"none": 0, "32B": 1, "64B": 2, "128B": 3}          # CUtensorMapSwizzle
SWIZZLE_SPAN = {"none": None, "32B": 32, "64B": 64, "128B": 128}
L2_PROMOTION = {"none": 0, "64B": 1, "128B": 2, "256B": 3}      # CUtensorMapL2promotion
INTERLEAVE_NONE = 0
OOB_FILL_ZERO = 0                                               # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros
MAP_BYTES = 128


@dataclass(frozen=True)
class TiledArgs:
    """cuTensorMapEncodeTiled's arguments, innermost dimension first (the driver's order)."""
    data_type: int
    rank: int
    address: int
    dims: tuple[int, ...]           # elements, innermost first
    strides: tuple[int, ...]        # bytes, dimensions 1 .. rank-1
    box: tuple[int, ...]            # elements, innermost first
    elem_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def _fail(field, expected, found):
    raise NanoqwenError(WHERE, field, expected, found)


def tiled_args(address: int, shape, dtype, box, *, strides=None, swizzle: str = "128B",
               l2_promotion: str = "128B") -> TiledArgs:
    """Checked arguments for a map of the row-major tensor `shape` (outermost first) of
    `dtype` at `address`, copied in boxes of `box` (outermost first). strides: bytes per
    step of each dimension, outermost first (default: the contiguous tensor's)."""
    dt = np.dtype(dtype)
    if dt not in DATA_TYPES:
        _fail("dtype", f"one of {sorted(str(d) for d in DATA_TYPES)}", str(dt))
    shape, box = tuple(int(s) for s in shape), tuple(int(b) for b in box)
    rank = len(shape)
    if not 1 <= rank <= 5:
        _fail("shape", "rank 1 .. 5", shape)
    if len(box) != rank:
        _fail("box", f"{rank} entries (one per dimension of shape {shape})", box)
    if address % 16:
        _fail("address", "a multiple of 16 bytes", hex(address))
    for i, s in enumerate(shape):
        if not 1 <= s <= 2**32:
            _fail(f"shape[{i}]", "1 .. 2^32", s)
    if strides is None:
        strides = [dt.itemsize] * rank
        for i in range(rank - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    strides = tuple(int(s) for s in strides)
    if len(strides) != rank:
        _fail("strides", f"{rank} entries", strides)
    if strides[-1] != dt.itemsize:
        _fail("strides[-1]", f"{dt.itemsize} (the innermost dimension is contiguous)", strides[-1])
    for i, s in enumerate(strides[:-1]):
        if s % 16 or not 0 < s < 2**40:
            _fail(f"strides[{i}]", "a multiple of 16 bytes below 2^40", s)
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            _fail(f"box[{i}]", "1 .. 256 elements", b)
    inner_bytes = box[-1] * dt.itemsize
    if inner_bytes % 16:
        _fail("box[-1]", "a multiple of 16 bytes along the innermost dimension", f"{inner_bytes} bytes")
    span = SWIZZLE_SPAN.get(swizzle, 0)
    if swizzle not in SWIZZLES:
        _fail("swizzle", f"one of {list(SWIZZLES)}", swizzle)
    if span is not None and inner_bytes > span:
        _fail("box[-1]", f"at most {span} bytes with the {swizzle} swizzle", f"{inner_bytes} bytes")
    if l2_promotion not in L2_PROMOTION:
        _fail("l2_promotion", f"one of {list(L2_PROMOTION)}", l2_promotion)
    return TiledArgs(DATA_TYPES[dt], rank, int(address), shape[::-1], strides[-2::-1] if rank > 1 else (),
                     box[::-1], (1,) * rank, INTERLEAVE_NONE, SWIZZLES[swizzle], L2_PROMOTION[l2_promotion],
                     OOB_FILL_ZERO)


@functools.lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode(args: TiledArgs) -> bytes:
    """The 128-byte CUtensorMap the driver encodes for `args` (needs libcuda.so.1)."""
    buf = (ctypes.c_uint64 * (MAP_BYTES // 8))()
    u64 = ctypes.c_uint64 * args.rank
    u32 = ctypes.c_uint32 * args.rank
    strides = (ctypes.c_uint64 * max(1, args.rank - 1))(*args.strides) if args.rank > 1 else None
    rc = _driver()(ctypes.addressof(buf), args.data_type, args.rank, ctypes.c_void_p(args.address),
                   u64(*args.dims), strides, u32(*args.box), u32(*args.elem_strides),
                   args.interleave, args.swizzle, args.l2_promotion, args.oob_fill)
    if rc != 0:
        raise NanoqwenError(WHERE, "cuTensorMapEncodeTiled", "CUDA_SUCCESS (0)", f"CUresult {rc} for {args}")
    return bytes(buf)


@functools.lru_cache(maxsize=None)   # never evicted: captured graphs hold these pointers
def _device_map(device: int, address: int, shape: tuple, dtype: str, box: tuple, swizzle: str):
    import cupy as cp
    raw = encode(tiled_args(address, shape, dtype, box, swizzle=swizzle))
    return cp.asarray(np.frombuffer(raw, np.uint8))          # cupy allocations are 256-byte aligned


def device_map(array, box, *, swizzle: str = "128B"):
    """A device copy (cupy uint8 [128]) of the map of the C-contiguous cupy `array`, cached per
    (device, pointer, shape, dtype, box, swizzle): a launcher passes its pointer."""
    import cupy as cp
    if not getattr(array, "flags", None) or not array.flags.c_contiguous:
        _fail("array", "a C-contiguous cupy array", type(array).__name__)
    return _device_map(cp.cuda.Device().id, int(array.data.ptr), tuple(array.shape), str(array.dtype),
                       tuple(int(b) for b in box), swizzle)
