"""The lab's INT4 prefill GEMM in wgmma's RS form (kernels/lab/prefill_rs.cu, sm_90a): the weight
is wgmma's A operand from registers, converted there from packed INT4, X the B operand by TMA.
Issue 29's first step; not yet run on a GPU (PERFLOG, "Issue 29 ... RS form").

    rs_order(words)                      ValueShuffle words [N, K/8] -> the kernel's order (uint32)
    gemm_int4_rs(x, w_rs, scales, out, bias=None, residual=None, **build)
                                         Y = fp16(X W^T [+ bias] [+ residual]), ops_prefill's contract

The RS order is a one-off reorder of the packed words (the same codes and nibble encoding: one
16-byte load per thread and k-tile is four words, each the A fragment of one k16 step), so a
file keeps its layout and the engine would reorder at upload if this form is adopted.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.format import quant
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, device_ptr

# The kernel's build, from its nq-build line (kernels/lab/prefill_rs.cu says what each name is).
RS_BUILD = cuda_build.kernel_build("lab/prefill_rs")
RS_K_ALIGN = 128          # K: whole scale groups (and k-tiles of 64)
ROWS = 64                 # weight rows a consumer warpgroup takes (wgmma M)


def rs_order(words) -> np.ndarray:
    """ValueShuffle words uint32 [N, K/8] -> the RS order, uint32 [ceil(N/64), K/64, 4, 32, 4]
    (feature block, k-tile, warp, lane, k16 step); rows past N hold code 0."""
    words = np.asarray(words)
    if words.dtype != np.uint32 or words.ndim != 2:
        raise NanoqwenError("lab.prefill_rs.rs_order", "words", "uint32 [N, K/8]", f"{words.dtype} {words.shape}")
    n_rows, k = words.shape[0], words.shape[1] * 8
    if k % RS_K_ALIGN:
        raise NanoqwenError("lab.prefill_rs.rs_order", "K", f"a multiple of {RS_K_ALIGN}", k)
    nb = -(-n_rows // ROWS)
    codes = np.zeros((nb * ROWS, k), np.int8)
    codes[:n_rows] = quant.unpack_int4_value_shuffle(words)
    # row = 64 nb + 16 w + 8 h + g, col = 64 kt + 16 s + 8 c8 + 2 t + c1
    c = codes.reshape(nb, 4, 2, 8, k // 64, 4, 2, 4, 2)        # nb, w, h, g, kt, s, c8, t, c1
    c = c.transpose(0, 4, 1, 3, 7, 5, 6, 2, 8)                 # nb, kt, w, g, t, s, c8, h, c1
    vec = np.ascontiguousarray(c).reshape(-1, 8)               # value i = 4 c8 + 2 h + c1
    return quant.pack_int4_value_shuffle(vec).reshape(nb, k // 64, 4, 32, 4)


def smem_bytes(build: dict) -> int:
    """Dynamic shared memory of nq_prefill_rs: the X ring, 1024 bytes of alignment slack, the barriers."""
    return build["NQ_RS_STAGES"] * build["NQ_RS_BM"] * 128 + 1024 + 2 * 8 * build["NQ_RS_STAGES"]


@functools.lru_cache(maxsize=None)
def _kernel(build_items: tuple):
    build = dict(build_items)
    kern = cuda_build.load_module("lab/prefill_rs", None, build).get_function("nq_prefill_rs")
    kern.max_dynamic_shared_size_bytes = smem_bytes(build)
    return kern


def gemm_int4_rs(x, w_rs, scales, out, bias=None, residual=None, **build) -> None:
    """out[T, N] = fp16(x W^T [+ bias] [+ residual]) on the GPU; x fp16 [T, K], w_rs the RS order
    of W (rs_order, on the device), scales fp16 [N, K/128]; build: RS_BUILD's names to override."""
    from nanoqwen_lib.gpu import tensor_map

    where = "lab.prefill_rs.gemm_int4_rs"
    unknown = set(build) - set(RS_BUILD)
    if unknown:
        raise NanoqwenError(where, "build", f"names of {sorted(RS_BUILD)}", sorted(unknown))
    b = {**RS_BUILD, **build}
    if getattr(x, "ndim", 0) != 2 or getattr(scales, "ndim", 0) != 2:
        raise NanoqwenError(where, "x / scales", "fp16 [T, K] / fp16 [N, K/128]",
                            f"{getattr(x, 'shape', None)} / {getattr(scales, 'shape', None)}")
    (t, k), n = x.shape, scales.shape[0]
    if k % RS_K_ALIGN:
        raise NanoqwenError(where, "x.shape[1]", f"K a multiple of {RS_K_ALIGN}", k)
    check_device_buffer(where, "x", x, np.float16, (t, k))
    check_device_buffer(where, "scales", scales, np.float16, (n, k // quant.GROUP_SIZE))
    check_device_buffer(where, "w_rs", w_rs, np.uint32, (-(-n // ROWS), k // 64, 4, 32, 4))   # rs_order
    check_device_buffer(where, "out", out, np.float16, (t, n))
    if bias is not None:
        check_device_buffer(where, "bias", bias, np.float16, (n,))
    if residual is not None:
        check_device_buffer(where, "residual", residual, np.float16, (t, n))   # may be `out` (in place)
    if t * k >= 2**31 or t * n >= 2**31:
        raise NanoqwenError(where, "T * row length", "< 2^31 elements (32-bit offsets)", f"T={t}, N={n}, K={k}")
    xmap = tensor_map.device_map(x, (b["NQ_RS_BM"], 64), swizzle="128B")
    grid = (-(-n // (ROWS * b["NQ_RS_CWG"])), -(-t // b["NQ_RS_BM"]))
    _kernel(tuple(sorted(b.items())))(
        grid, (128 * (1 + b["NQ_RS_CWG"]),),
        (x, w_rs, scales, device_ptr(bias), device_ptr(residual), out, np.int32(t), np.int32(n), np.int32(k), xmap),
        shared_mem=smem_bytes(b))
