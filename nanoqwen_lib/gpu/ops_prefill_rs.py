"""The INT4 prefill GEMM in wgmma's RS form (kernels/prefill_rs.cu, sm_90a): the weight
is wgmma's A operand from registers, converted there from packed INT4, X the B operand by TMA.
The engine runs it with prefill_gemm="rs" (gpu.projection.Int4RsProjections, INT4's default); PERFLOG
("Issue 29 ...") says which builds ran and how fast.

    rs_order(words)                      ValueShuffle words [N, K/8] -> the kernel's order (uint32)
    rs_scales(scales)                    scales fp16 [N, K/128] -> [ceil(N/64), K/128, 64] (the
                                         shared-memory path's: one 128-byte copy a block and group)
    gemm_int4_rs(x, w_rs, scales, out, bias=None, residual=None, scales_rs=None, **build)
                                         Y = fp16(X W^T [+ bias] [+ residual]), ops_prefill's contract
    plan_rs(t, n, sms)                   the build for a shape (2 or 3 consumer warpgroups, a wave model)
    swiglu_rows(words, scales)           gate_up's rows [2I, ...] -> the SwiGLU row order (gate and up
                                         of a feature in one thread's two rows), rows padded to 64 ceil(I/32)
    gemm_int4_rs_swiglu(x, w_rs, scales_rs, act, **build)
                                         act [T, I] = fp16(silu(fp16(g)) * fp16(u)) from gate_up in the
                                         SwiGLU row order: the bits of gemm_int4_rs + ops_prefill.swiglu_act

The RS order is a one-off reorder of the packed words (the same codes and nibble encoding: one
16-byte load per thread and k-tile is four words, each the A fragment of one k16 step), so a
file keeps its layout and the engine reorders at upload (on the GPU: the reorders take NumPy or CuPy).
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.format import quant
from nanoqwen_lib.format.stream_layout import array_module
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_prefill_gemm, device_ptr

# The kernel's build, from its nq-build line (kernels/prefill_rs.cu says what each name is).
RS_BUILD = cuda_build.kernel_build("prefill_rs")
RS_K_ALIGN = 128          # K: whole scale groups (and k-tiles of 64)
ROWS = 64                 # weight rows a consumer warpgroup takes (wgmma M)


def rs_order(words, xp=None) -> np.ndarray:
    """ValueShuffle words uint32 [N, K/8] -> the RS order, uint32 [ceil(N/64), K/64, 4, 32, 4]
    (feature block, k-tile, warp, lane, k16 step); rows past N hold code 0. In the words' array
    module (NumPy, or CuPy: the reorder at upload runs on the GPU), or `xp`."""
    xp = array_module(words, xp)
    words = xp.asarray(words)
    if words.dtype != np.uint32 or words.ndim != 2:
        raise NanoqwenError("ops_prefill_rs.rs_order", "words", "uint32 [N, K/8]", f"{words.dtype} {words.shape}")
    n_rows, k = words.shape[0], words.shape[1] * 8
    if k % RS_K_ALIGN:
        raise NanoqwenError("ops_prefill_rs.rs_order", "K", f"a multiple of {RS_K_ALIGN}", k)
    nb = -(-n_rows // ROWS)
    codes = xp.zeros((nb * ROWS, k), np.int8)
    codes[:n_rows] = quant.unpack_int4_value_shuffle(words, xp)
    # row = 64 nb + 16 w + 8 h + g, col = 64 kt + 16 s + 8 c8 + 2 t + c1
    c = codes.reshape(nb, 4, 2, 8, k // 64, 4, 2, 4, 2)        # nb, w, h, g, kt, s, c8, t, c1
    c = c.transpose(0, 4, 1, 3, 7, 5, 6, 2, 8)                 # nb, kt, w, g, t, s, c8, h, c1
    vec = xp.ascontiguousarray(c).reshape(-1, 8)               # value i = 4 c8 + 2 h + c1
    return quant.pack_int4_value_shuffle(vec, xp).reshape(nb, k // 64, 4, 32, 4)


def rs_scales(scales, xp=None) -> np.ndarray:
    """Scales fp16 [N, K/128] -> [ceil(N/64), K/128, 64]: a feature block's 64 scales of one group
    contiguous (rows past N hold 0; their outputs are not stored); NumPy or CuPy, as rs_order."""
    xp = array_module(scales, xp)
    scales = xp.asarray(scales)
    if scales.dtype != np.float16 or scales.ndim != 2:
        raise NanoqwenError("ops_prefill_rs.rs_scales", "scales", "fp16 [N, K/128]", f"{scales.dtype} {scales.shape}")
    n_rows, groups = scales.shape
    nb = -(-n_rows // ROWS)
    out = xp.zeros((nb * ROWS, groups), np.float16)
    out[:n_rows] = scales
    return xp.ascontiguousarray(out.reshape(nb, ROWS, groups).transpose(0, 2, 1))


def swiglu_rows(words, scales) -> tuple[np.ndarray, np.ndarray]:
    """gate_up words uint32 [2I, K/8] and scales fp16 [2I, K/128] (gate rows, then up rows) ->
    the same rows in the SwiGLU order, [64 ceil(I/32), ...]: in each block b of 64 rows, row
    16 w + g is gate row f = 32 b + 8 w + g and row 16 w + g + 8 its up row I + f (w 0..3, g 0..7),
    so that the thread that holds rows r and r + 8 of a warp's 16 holds g and u of one feature;
    rows of features f >= I are zero (code 0, scale 0). NumPy or CuPy, as rs_order."""
    xp = array_module(words)
    words, scales = xp.asarray(words), xp.asarray(scales)
    if words.dtype != np.uint32 or words.ndim != 2 or words.shape[0] % 2:
        raise NanoqwenError("ops_prefill_rs.swiglu_rows", "words", "uint32 [2I, K/8]", f"{words.dtype} {words.shape}")
    if scales.dtype != np.float16 or scales.shape != (words.shape[0], words.shape[1] * 8 // quant.GROUP_SIZE):
        raise NanoqwenError("ops_prefill_rs.swiglu_rows", "scales", f"fp16 [{words.shape[0]}, K/128]",
                            f"{scales.dtype} {scales.shape}")
    i = words.shape[0] // 2
    f = xp.arange(i)
    gate_at = ROWS * (f // 32) + 16 * ((f % 32) // 8) + f % 8     # the new row of gate row f; up: + 8
    rows = ROWS * -(-i // 32)
    w_out, s_out = xp.zeros((rows, words.shape[1]), np.uint32), xp.zeros((rows, scales.shape[1]), np.float16)
    w_out[gate_at], w_out[gate_at + 8] = words[:i], words[i:]
    s_out[gate_at], s_out[gate_at + 8] = scales[:i], scales[i:]
    return w_out, s_out


def plan_rs(t: int, n: int, sms: int) -> dict:
    """The build for a GEMM of T tokens and N output rows (gate_up with SwiGLU: N = 2I) on `sms`
    SMs: 2 or 3 consumer warpgroups, by a wave model in which a CTA's time grows with its
    features plus one warpgroup's worth of fixed cost, waves(tiles) x (64 CWG + 64); fit to the
    first H200 run at T = 512 (PERFLOG, "the RS form on the H200"), whose fastest build per shape
    it picks: qkv 3, o_proj 2, gate_up 3, down 2."""
    def cost(cwg: int) -> int:
        tiles = -(-n // (ROWS * cwg)) * -(-t // RS_BUILD["NQ_RS_BM"])
        return -(-tiles // sms) * (ROWS * cwg + ROWS)
    return {} if cost(2) <= cost(3) else {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}


def smem_bytes(build: dict) -> int:
    """Dynamic shared memory of nq_prefill_rs: the X ring (and with NQ_RS_WSMEM each stage's packed W,
    2048 bytes, and scales, 128 bytes, per consumer warpgroup), 1024 bytes of alignment slack, the
    barriers (kernels/prefill_rs.cu: RING_BYTES)."""
    w_stage = build["NQ_RS_CWG"] * (2048 + 128) if build["NQ_RS_WSMEM"] else 0
    return build["NQ_RS_STAGES"] * (build["NQ_RS_BM"] * 128 + w_stage) + 1024 + 2 * 8 * build["NQ_RS_STAGES"]


@functools.lru_cache(maxsize=None)
def _kernel(build_items: tuple):
    build = dict(build_items)
    kern = cuda_build.load_module("prefill_rs", None, build).get_function("nq_prefill_rs")
    kern.max_dynamic_shared_size_bytes = smem_bytes(build)
    return kern


def _build(where: str, build: dict, **fixed) -> dict:
    """RS_BUILD with the caller's overrides (names of RS_BUILD, NQ_RS_SWIGLU excepted: the launcher's)
    and the launcher's `fixed` names."""
    if set(build) - set(RS_BUILD) or "NQ_RS_SWIGLU" in build:
        raise NanoqwenError(where, "build", f"names of {sorted(set(RS_BUILD) - {'NQ_RS_SWIGLU'})}", sorted(build))
    return {**RS_BUILD, **build, **fixed}


def _k(where: str, x) -> int:
    """K of x [T, K], whole scale groups."""
    if getattr(x, "ndim", 0) != 2:
        raise NanoqwenError(where, "x.shape", "(T, K)", getattr(x, "shape", None))
    if x.shape[1] % RS_K_ALIGN:
        raise NanoqwenError(where, "x.shape[1]", f"K a multiple of {RS_K_ALIGN}", x.shape[1])
    return x.shape[1]


def gemm_int4_rs_swiglu(x, w_rs, scales_rs, act, **build) -> None:
    """act[T, I] = fp16(silu(fp16(g)) * fp16(u)), [g | u] = x gate_up^T, on the GPU; x fp16 [T, K],
    w_rs = rs_order of swiglu_rows' words, scales_rs = rs_scales of its scales (on the device)."""
    where = "ops_prefill_rs.gemm_int4_rs_swiglu"
    b = _build(where, build, NQ_RS_SWIGLU=1)
    if not b["NQ_RS_WSMEM"]:
        raise NanoqwenError(where, "NQ_RS_WSMEM", "1 (SwiGLU reads its scales in the RS order)", b["NQ_RS_WSMEM"])
    k = _k(where, x)
    if getattr(act, "ndim", 0) != 2:
        raise NanoqwenError(where, "act.shape", "(T, I)", getattr(act, "shape", None))
    i = act.shape[1]
    nb = -(-i // 32)
    t = check_prefill_gemm(where, x, act, 2 * i, k, weight_elems=2 * i * k // 8, out_field="act", out_cols=i)
    check_device_buffer(where, "w_rs", w_rs, np.uint32, (nb, k // 64, 4, 32, 4))      # rs_order(swiglu_rows)
    check_device_buffer(where, "scales_rs", scales_rs, np.float16, (nb, k // quant.GROUP_SIZE, ROWS))
    _launch(x, w_rs, None, scales_rs, None, None, act, t, 2 * i, k, b)


def gemm_int4_rs(x, w_rs, scales, out, bias=None, residual=None, scales_rs=None, **build) -> None:
    """out[T, N] = fp16(x W^T [+ bias] [+ residual]) on the GPU; x fp16 [T, K], w_rs the RS order
    of W (rs_order, on the device), scales fp16 [N, K/128], scales_rs their RS order (rs_scales, on
    the device; the shared-memory path, NQ_RS_WSMEM=1, needs it); build: RS_BUILD's names to override;
    residual may be `out` (in place). The arguments: launch_checks.check_prefill_gemm's, as every
    prefill GEMM's."""
    where = "ops_prefill_rs.gemm_int4_rs"
    b = _build(where, build, NQ_RS_SWIGLU=0)
    k = _k(where, x)
    if getattr(scales, "ndim", 0) != 2:
        raise NanoqwenError(where, "scales.shape", "(N, K/128)", getattr(scales, "shape", None))
    n = scales.shape[0]
    t = check_prefill_gemm(where, x, out, n, k, bias, residual, weight_elems=n * k // 8)
    check_device_buffer(where, "scales", scales, np.float16, (n, k // quant.GROUP_SIZE))
    check_device_buffer(where, "w_rs", w_rs, np.uint32, (-(-n // ROWS), k // 64, 4, 32, 4))   # rs_order
    if b["NQ_RS_WSMEM"]:
        if scales_rs is None:
            raise NanoqwenError(where, "scales_rs", "the scales in the RS order (rs_scales) for NQ_RS_WSMEM=1", None)
        check_device_buffer(where, "scales_rs", scales_rs, np.float16, (-(-n // ROWS), k // quant.GROUP_SIZE, ROWS))
    _launch(x, w_rs, scales, scales_rs, bias, residual, out, t, n, k, b)


def _launch(x, w_rs, scales, scales_rs, bias, residual, out, t: int, n: int, k: int, b: dict) -> None:
    """nq_prefill_rs on checked arguments: grid, block, shared memory, X's tensor map."""
    from nanoqwen_lib.gpu import tensor_map

    xmap = tensor_map.device_map(x, (b["NQ_RS_BM"], 64), swizzle="128B")
    grid = (-(-n // (ROWS * b["NQ_RS_CWG"])), -(-t // b["NQ_RS_BM"]))
    _kernel(tuple(sorted(b.items())))(
        grid, (128 * (1 + b["NQ_RS_CWG"]),),
        (x, w_rs, device_ptr(scales), device_ptr(scales_rs), device_ptr(bias), device_ptr(residual), out,
         np.int32(t), np.int32(n), np.int32(k), xmap),
        shared_mem=smem_bytes(b))
