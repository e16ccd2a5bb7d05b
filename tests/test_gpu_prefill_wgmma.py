"""The wgmma prefill GEMMs (kernels/prefill_wgmma.cu) against float64 references (needs a GPU).

Fresh random inputs every case (seed printed on failure), outputs poisoned with NaN before
every launch, every element checked. INT4: test_gpu_prefill.py's tight bound (one fp16 ulp
of the float64 x . w16 reference, plus (K/16 + 8) 2^-24 sum |x w| for the FP32 accumulation);
the gate_up SwiGLU kernel is checked bit for bit against the plain wgmma GEMM into gate_up
followed by swiglu_act (whose GEMM is checked against the reference in the same case).
FP8: test_gpu_fp8.py's bound for the tensor-core sums (K 2^-24 + 2^-12 of sum |c x|), plus
2^-12 of the accumulator's magnitude at each of its K steps (32 FP8 products a wgmma): Hopper's
FP8 MMA keeps about 13 bits of the running sum, so where the sum cancels after large partial
sums (random E4M3 codes reach +-448) the error follows the partial sums, not the result.
"""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib import config
from nanoqwen_lib.format import quant

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

from nanoqwen_lib.gpu import cuda_build  # noqa: E402

if not cuda_build.have_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from nanoqwen_lib.format.layout import decode_gemv_shapes  # noqa: E402
from nanoqwen_lib.gpu import ops_fp8, ops_prefill  # noqa: E402
from .gpu_cases import SHAPES_7B, TINY16, U16  # noqa: E402
from .gpu_cases import rand_int4 as rand_int4_host  # noqa: E402
from .test_gpu_prefill import check_close, run_grid  # noqa: E402
from . import emulate as em  # noqa: E402

SHAPES_TINY = decode_gemv_shapes(config.load().model("tiny"))
TOKENS = (1, 17, 64, 100, 512, 2048)


def rand_int4(rng, n, k):
    return tuple(cp.asarray(a) for a in rand_int4_host(rng, n, k))


def rand16(rng, shape, scale=1.0):
    return cp.asarray((scale * rng.standard_normal(shape)).astype(np.float16))


def int4_ref(x, words, scales, rows=4096):
    """(x . w16^T, |x| . |w16|^T) in float64 [T, N], w16 = fp16(code * scale)."""
    n, t = words.shape[0], x.shape[0]
    x64 = x.astype(cp.float64)
    ref, absdot = cp.empty((t, n)), cp.empty((t, n))
    for r in range(0, n, rows):
        w16 = quant.dequantize_int4(words[r:r + rows], scales[r:r + rows], xp=cp).astype(cp.float16).astype(cp.float64)
        ref[:, r:r + rows] = x64 @ w16.T
        absdot[:, r:r + rows] = cp.abs(x64) @ cp.abs(w16).T
    return ref, absdot


def check_int4(name, out, ref, absdot, k, bias=None, residual=None):
    want = ref.copy()
    for extra in (bias, residual):
        if extra is not None:
            want += extra.astype(cp.float64)
    bound = U16 * cp.abs(want) + (k / 16 + 8) * TINY16 * absdot + TINY16
    worst = check_close(name, out, want, bound)
    em.check_rounding_bias(name, out, want)
    return worst


def run_int4(rng, t, n, k, *, bias, residual, configs, weights=None):
    words, scales = weights if weights is not None else rand_int4(rng, n, k)
    x = rand16(rng, (t, k))
    ref, absdot = int4_ref(x, words, scales)
    b = rand16(rng, (n,)) if bias else None
    res = rand16(rng, (t, n)) if residual else None
    out = cp.empty((t, n), cp.float16)
    for cfg in configs:
        out.fill(np.nan)
        if residual:
            out[...] = res                 # in place: the residual is the output buffer
        ops_prefill.gemm_int4(x, words, scales, out, bias=b, residual=out if residual else None, kernel="wgmma", **cfg)
        cp.cuda.Device().synchronize()
        check_int4(f"wgmma T={t} N={n} K={k} bias={bias} residual={residual} {cfg or 'planned'}", out, ref, absdot, k,
                   b, res)
    return x, words, scales, ref, absdot


def check_swiglu(rng, x, words, scales, configs):
    """The fused gate_up SwiGLU == gemm_int4(wgmma) into gate_up, then swiglu_act: bit for bit."""
    t, n2 = x.shape[0], words.shape[0]
    gate_up = cp.empty((t, n2), cp.float16)
    want, act = (cp.empty((t, n2 // 2), cp.float16) for _ in range(2))
    for cfg in configs:
        gate_up.fill(np.nan)
        want.fill(np.nan)
        act.fill(np.nan)
        ops_prefill.gemm_int4(x, words, scales, gate_up, kernel="wgmma", **cfg)
        ops_prefill.swiglu_act(gate_up, want)
        ops_prefill.gemm_int4_gate_up_swiglu(x, words, scales, act, **cfg)
        cp.cuda.Device().synchronize()
        assert not bool(cp.isnan(act).any()), f"swiglu T={t} {cfg}: unwritten elements"
        diff = int((act.view(cp.uint16) != want.view(cp.uint16)).sum())
        assert diff == 0, f"gate_up swiglu T={t} N2={n2} {cfg}: {diff} of {act.size} elements differ"


VARIANT = {"qkv": dict(bias=True, residual=False), "o_proj": dict(bias=False, residual=True),
           "gate_up": dict(bias=False, residual=False), "down": dict(bias=True, residual=True)}


def configs_for(t, n, k):
    """The plan, every BN build, a split-K factor."""
    out = [{}] + [dict(bn=bn, split=1) for bn in ops_prefill.WGMMA_BN_CHOICES]
    if k // ops_prefill.WGMMA_BK >= 6 and -(-t // 128) * -(-n // 128) * 3 * 128 * 128 <= ops_prefill.WS_FLOATS:
        out.append(dict(bn=128, split=3))
    return out


@pytest.fixture(scope="module")
def weights_7b():
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**63))
    return {p: rand_int4(rng, n, k) for p, (n, k) in SHAPES_7B.items()}


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("proj", list(SHAPES_7B))
def test_wgmma_int4_7b(rng, weights_7b, proj, t):
    n, k = SHAPES_7B[proj]
    configs = configs_for(t, n, k) if t <= 512 else [{}]
    x, words, scales, *_ = run_int4(rng, t, n, k, weights=weights_7b[proj], configs=configs, **VARIANT[proj])
    if proj == "gate_up":
        check_swiglu(rng, x, words, scales, [{}, dict(bn=128, split=1), dict(bn=256, split=1)] if t <= 512 else [{}])


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("proj", list(SHAPES_TINY))
def test_wgmma_int4_tiny(rng, proj, t):
    n, k = SHAPES_TINY[proj]
    x, words, scales, *_ = run_int4(rng, t, n, k, configs=configs_for(t, n, k), **VARIANT[proj])
    if proj == "gate_up":
        # split 2 of bn 144 at T = 2048 would need 2 x 544 tiles of partials: over the workspace
        check_swiglu(rng, x, words, scales, [{}, dict(bn=112, split=1), dict(bn=144, split=2 if t <= 512 else 1)])


@pytest.mark.parametrize("t,n,k", [(3, 8, 128), (130, 136, 384), (257, 264, 256)])
def test_wgmma_int4_odd(rng, t, n, k):
    for v in VARIANT.values():
        run_int4(rng, t, n, k, configs=[{}, dict(bn=112, split=1), dict(bn=256, split=2)], **v)


GRID_WGMMA = [(17, "qkv"), (130, "o_proj"), (17, "gate_up"), (64, "down")]


@pytest.mark.parametrize("t,proj", GRID_WGMMA, ids=[f"{p}-{t}" for t, p in GRID_WGMMA])
def test_wgmma_int4_grid_exact(rng, t, proj):
    """The 7B shapes with the engine's bias / residual, through the plan, every BN build and a
    split-K factor: bit for bit fp16_rn of the exact result (emulate.grid_int4)."""
    n, k = SHAPES_7B[proj]
    v = VARIANT[proj]
    run_grid(rng, t, n, k, kernel="wgmma", configs=configs_for(t, n, k), bias=v["bias"], residual=v["residual"])


def test_wgmma_int4_grid_exact_odd(rng):
    for t, n, k in [(3, 8, 128), (257, 264, 256)]:
        for v in VARIANT.values():
            run_grid(rng, t, n, k, kernel="wgmma", configs=[{}, dict(bn=112, split=1), dict(bn=256, split=2)], **v)


def test_wgmma_split_is_deterministic(rng):
    t, n, k = 70, 384, 2048
    words, scales = rand_int4(rng, n, k)
    x = rand16(rng, (t, k))
    a, b = (cp.full((t, n), np.nan, dtype=cp.float16) for _ in range(2))
    ops_prefill.gemm_int4(x, words, scales, a, kernel="wgmma", bn=128, split=5)
    ops_prefill.gemm_int4(x, words, scales, b, kernel="wgmma", bn=128, split=5)
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
    assert int(cp.count_nonzero(ops_prefill.workspace()[1])) == 0


def test_wgmma_launch_checks(rng):
    from nanoqwen_lib.errors import NanoqwenError
    words, scales = rand_int4(rng, 132, 256)
    x, out = rand16(rng, (4, 256)), cp.empty((4, 132), cp.float16)
    with pytest.raises(NanoqwenError, match="qweight.shape"):
        ops_prefill.gemm_int4(x, words, scales, out, kernel="wgmma")
    words, scales = rand_int4(rng, 128, 256)
    out = cp.empty((4, 128), cp.float16)
    with pytest.raises(NanoqwenError, match="bn"):
        ops_prefill.gemm_int4(x, words, scales, out, kernel="wgmma", bn=96)
    with pytest.raises(NanoqwenError, match="bm"):
        ops_prefill.gemm_int4(x, words, scales, out, kernel="wgmma", bm=64)
    with pytest.raises(NanoqwenError, match="kernel"):
        ops_prefill.gemm_int4(x, words, scales, out, kernel="cutlass")
    with pytest.raises(NanoqwenError, match="act"):
        ops_prefill.gemm_int4_gate_up_swiglu(x, words, scales, cp.empty((4, 128), cp.float16))   # act is [T, I = 64]


# ---- FP8 -------------------------------------------------------------------------------------
FINITE_CODES = np.flatnonzero(np.isfinite(quant.E4M3_VALUES)).astype(np.uint8)


def rand_codes(rng, n, k):
    return cp.asarray(FINITE_CODES[rng.integers(0, FINITE_CODES.size, size=(n, k))])


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("proj", list(SHAPES_7B) + ["tiny_qkv"])
def test_wgmma_fp8(rng, proj, t):
    n, k = SHAPES_7B[proj] if proj in SHAPES_7B else SHAPES_TINY["qkv"]
    if t == 2048 and n * k > 20e6:
        pytest.skip("float64 reference time: T = 2048 is covered at qkv / o_proj")
    values = cp.asarray(quant.E4M3_VALUES.astype(np.float64))
    xq, codes = rand_codes(rng, t, k), rand_codes(rng, n, k)
    ts = cp.asarray(rng.uniform(1e-3, 1e-1, t).astype(np.float32))
    scales = cp.asarray(rng.uniform(1e-4, 1e-2, n).astype(np.float32))
    bias, res = rand16(rng, (n,)), rand16(rng, (t, n))
    s = ts.astype(cp.float64)[:, None] * scales.astype(cp.float64)[None, :]
    a = values[xq]
    ref, absdot, partial = cp.empty((t, n)), cp.empty((t, n)), cp.zeros((t, n))
    for r in range(0, n, 4096):
        w = values[codes[r:r + 4096]]
        run = cp.zeros((t, w.shape[0]))
        for k0 in range(0, k, 32):                    # the running sum after each wgmma K step
            run += a[:, k0:k0 + 32] @ w[:, k0:k0 + 32].T
            partial[:, r:r + 4096] += cp.abs(run)
        ref[:, r:r + 4096] = run
        absdot[:, r:r + 4096] = cp.abs(a) @ cp.abs(w).T
    ref, absdot, partial = s * ref, s * absdot, s * partial
    want = ref + bias.astype(cp.float64) + res.astype(cp.float64)
    acc = (k * 2.0 ** -24 + 2.0 ** -12) * absdot + 2.0 ** -12 * partial
    bound = acc + U16 * cp.abs(want) + TINY16
    out = cp.empty((t, n), cp.float16)
    for cfg in [{}, dict(bn=128, split=1), dict(bn=112, split=1)] + ([dict(bn=128, split=2)] if t <= 100 else []):
        out[...] = res                       # in place
        ops_fp8.gemm_fp8(xq, ts, codes, scales, out, bias=bias, residual=out, kernel="wgmma", **cfg)
        cp.cuda.Device().synchronize()
        w = check_close(f"fp8 wgmma T={t} {n}x{k} {cfg or 'planned'}", out, want, bound)
        print(f"fp8 wgmma T={t} {n}x{k} {cfg}: max err/bound {w:.3f}")
        out.fill(np.nan)
        ops_fp8.gemm_fp8(xq, ts, codes, scales, out, kernel="wgmma", **cfg)
        cp.cuda.Device().synchronize()
        check_close(f"fp8 wgmma T={t} {n}x{k} {cfg or 'planned'} (no bias/residual)", out, ref,
                    acc + U16 * cp.abs(ref) + TINY16)


# ---- the TMA layouts the kernels rely on (kernels/lab/tma_probe.cu) --------------------------
def tma_box(arr, box, c0, c1, swizzle):
    """The bytes of the box at (c0, c1) (innermost first) of arr's map, as TMA leaves them in
    shared memory (the probe copies them back raw)."""
    from nanoqwen_lib.gpu import tensor_map
    kern = cuda_build.load_module("lab/tma_probe", None).get_function("nq_tma_probe")
    nbytes = box[0] * box[1] * arr.dtype.itemsize
    kern.max_dynamic_shared_size_bytes = nbytes + 1024
    out = cp.full(nbytes, 0xAB, cp.uint8)
    kern((1,), (128,), (tensor_map.device_map(arr, box, swizzle=swizzle), np.int32(c0), np.int32(c1),
                        np.int32(nbytes), out), shared_mem=nbytes + 1024)
    cp.cuda.Device().synchronize()
    return cp.asnumpy(out)


def test_tma_x_box_is_128b_swizzled_and_zero_filled(rng):
    t, k = 70, 256                              # fewer rows than the 128-row box
    x = rand16(rng, (t, k))
    got = tma_box(x, (128, 64), 64, 0, "128B").reshape(128, 8, 16)       # [row][chunk slot][16 bytes]
    want = np.zeros((128, 64), np.float16)
    want[:t] = cp.asnumpy(x)[:, 64:128]
    want_bytes = want.view(np.uint8).reshape(128, 8, 16)
    for r in range(128):
        for c in range(8):
            assert (got[r, c ^ (r % 8)] == want_bytes[r, c]).all(), (r, c)


def test_tma_int4_box_is_plain_rows(rng):
    n, k = 100, 512                             # rows past N come back zero
    words, _ = rand_int4(rng, n, k)
    got = tma_box(words, (112, 8), 16, 0, "none").view(np.uint32).reshape(112, 8)
    want = np.zeros((112, 8), np.uint32)
    want[:n] = cp.asnumpy(words)[:, 16:24]
    assert (got == want).all()
