"""NumPy models of the kernels' rounding: what the GPU tests compare against (bit for bit, or
interval by interval), and what tests/test_emulate.py runs on the CPU, so that each check is
shown to fail on the fault it is for before a GPU ever runs it.

Three kinds of check, by what the kernel's arithmetic allows:

exact     The kernel's FP32 arithmetic is a fixed sequence of IEEE operations (the FP8 GEMV:
          each lane's FMA chain in k order, then a butterfly of adds, then the epilogue's
          FMUL and FADDs, read from its SASS): `gemv_fp8` repeats it in float32 and rounds
          to fp16 as the kernel does, so every output must match bit for bit.
grid      The tensor-core kernels sum in an order (and with internal truncation) that NumPy
          cannot repeat. On inputs whose every product and partial sum is a multiple of one
          power of two and stays below 2^22 of it (`grid_int4`), every FP32 sum is exact in
          any order and with any alignment the tensor core may use (24 significant bits
          hold every such value with room to spare), so the FP32 result is the exact integer
          result, and the only rounding left is the epilogue's fp16 one: the output must be
          exactly fp16_rn(exact), computed here from integers. A round-toward-zero epilogue,
          a zeroed row or a dropped K slice each changes many outputs.
interval  Where a value's FP32 error can only be bounded (|v32 - v64| <= w), the fp16 output
          RN(v32) lies in [RN(v64 - w), RN(v64 + w)] (RN is monotone): `interval16`. That is
          half an ulp plus w, not a whole ulp: with w well below an ulp most outputs are
          pinned to one fp16 value.

`rounding_bias` is the statistic for random inputs: the mean signed error in ulps (toward
the magnitude and toward +inf). A correct round-to-nearest epilogue gives ~0 even where the
tensor core truncates its partial sums (modelled by `mma_dot`, measured in test_emulate.py);
round-toward-zero gives about -0.5.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.format import quant

HALF_ULP = 2.0 ** -11        # RN to fp16: |fp16(v) - v| <= 2^-11 |v| in the normal range ...
SUB_HALF = 2.0 ** -25        # ... and <= 2^-25 (half the subnormal spacing) below it
MIN_NORMAL16 = 2.0 ** -14
U32 = 2.0 ** -24             # FP32 unit roundoff (round to nearest)
BIAS_LIMIT = 0.1             # |rounding_bias| allowed, in ulps (test_emulate.py: RN ~0.02, RZ ~ -0.5)
# The GEMV's FOLD builds (NQ_GEMV_FOLD=1: the MMA sums offset codes, (1032 + s) x, ~1000x the
# value, and subtracts the fold after) carry a bias of their own: measured on the H200, 0.107
# to 0.117 ulp toward -inf at 3584 x 3584 and 1000 x 18944 (the tensor core's FP32 sums of the
# large offset terms do not round to nearest). Allowed up to this, which still fails RZ (0.5).
FOLD_BIAS_LIMIT = 0.2
# The mean error toward +inf is not a mean of independent errors: every output of a GEMV shares
# its x, and the tensor core's truncated FP32 sums carry a part that depends on x alone. Over the
# GPU suite on the H200 (NANOQWEN_SMS=114), correct kernels gave |direction| up to 0.234 ulp
# with a standard error of 0.006 to 0.037, while |magnitude| stayed inside its limits. So the
# direction has its own, coarse limit: it still fails an epilogue that rounds down or up (0.5).
DIRECTION_LIMIT = 0.4
RN_SPREAD = 12.0 ** -0.5    # the standard deviation of round-to-nearest's error, in ulps (uniform over one ulp)


# ---------------------------------------------------------------- fp16 rounding
def rn16(v) -> np.ndarray:
    """float64 -> float16, round to nearest even (NumPy converts directly from the double:
    test_emulate.py checks it against an integer model, ties included)."""
    return np.asarray(v, dtype=np.float64).astype(np.float16)


def rz16(v) -> np.ndarray:
    """float64 -> float16 rounded toward zero (the fault a GPU test must catch)."""
    v = np.asarray(v, dtype=np.float64)
    r = rn16(v)
    over = np.abs(r.astype(np.float64)) > np.abs(v)
    return np.where(over, np.nextafter(r, np.float16(0)), r)


def array_module(a):
    """numpy, or cupy for a CuPy array (imported only when one is seen)."""
    if type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def ulp16(v):
    """The fp16 spacing of the binade of |v| (2^-24 below the normal range); NumPy or CuPy."""
    xp = array_module(v)
    a = xp.abs(xp.asarray(v, dtype=xp.float64))
    e = xp.floor(xp.log2(xp.maximum(a, MIN_NORMAL16)))
    return xp.exp2(e - 10)


def interval16(v64, w):
    """(lo, hi) float16: every RN16(v32) with |v32 - v64| <= w lies in [lo, hi]."""
    v64 = np.asarray(v64, dtype=np.float64)
    return rn16(v64 - w), rn16(v64 + w)


def interval_misses(got, v64, w) -> np.ndarray:
    """Indices (flat) of the elements of got (fp16 values) outside interval16(v64, w); NaN misses."""
    lo, hi = interval16(v64, w)
    g = np.asarray(got, dtype=np.float64)
    ok = (g >= lo.astype(np.float64)) & (g <= hi.astype(np.float64))
    return np.flatnonzero(~ok.ravel())


def describe_misses(name, got, v64, w, idx, limit=8) -> str:
    lo, hi = interval16(v64, w)
    g, v, wa = (np.broadcast_to(np.asarray(a, dtype=np.float64), np.shape(v64)).ravel()
                for a in (got, v64, w))
    lo, hi = lo.ravel(), hi.ravel()
    rows = "\n".join(f"  [{i}] got {g[i]!r} want [{float(lo[i])!r}, {float(hi[i])!r}] (v64 {v[i]!r}, w {wa[i]:.3g})"
                     for i in idx[:limit])
    return f"{name}: {idx.size} of {g.size} elements outside [RN(v - w), RN(v + w)]\n{rows}"


def rounding_bias(got, ref64) -> dict:
    """Mean signed error in fp16 ulps of ref over the finite, normal-range outputs, each error
    clipped to [-1, 1] ulp (outputs whose FP32 sum cancelled carry errors of several of their
    own ulps, symmetric for a correct kernel; clipping keeps their sign and bounds their
    noise): 'magnitude' = mean(sign(ref) e) (round toward zero: ~ -0.5, away: ~ +0.5),
    'direction' = mean(e) (round down / up: ~ -0.5 / +0.5); 'n' elements and 'noise', the
    standard error of either mean. NumPy or CuPy arrays (both of one kind)."""
    xp = array_module(ref64)
    g = xp.asarray(got).astype(xp.float64).ravel()
    r = xp.asarray(ref64).astype(xp.float64).ravel()
    keep = xp.isfinite(g) & xp.isfinite(r) & (xp.abs(r) >= MIN_NORMAL16)
    g, r = g[keep], r[keep]
    e = xp.clip((g - r) / ulp16(r), -1.0, 1.0)
    n = int(e.size)
    if n < 2:
        return {"magnitude": 0.0, "direction": 0.0, "n": n, "noise": float("inf")}
    # The standard error from the sample's own spread, but never below round-to-nearest's own
    # (uniform over one ulp: 1/sqrt(12)): a few outputs can sit close together by chance (seen
    # on the H200: 7 outputs of a lab GEMV all 0.18-0.34 ulp low, sample noise 0.030), and their
    # spread then promises a precision the mean of so few cannot have.
    return {"magnitude": float(xp.mean(xp.sign(r) * e)), "direction": float(xp.mean(e)), "n": n,
            "noise": max(float(xp.std(e)), RN_SPREAD) / float(np.sqrt(n))}


def bias_limit(noise: float, floor: float = BIAS_LIMIT) -> float:
    """What |rounding_bias| a correct kernel stays under: `floor` (BIAS_LIMIT: the truncating
    tensor-core model's own bias is ~0.02, test_emulate.py), or 6 standard errors of the mean
    where there are few outputs; None where even that could not tell RZ (-0.5) apart."""
    limit = max(floor, 6.0 * noise)
    return limit if limit <= 0.25 else None


def check_rounding_bias(name, got, ref64, floor: float = BIAS_LIMIT) -> dict:
    """Assert |magnitude| < bias_limit and |direction| < DIRECTION_LIMIT (or 10 standard
    errors where there are few outputs); each is skipped, and said so in the result (limit
    None), where the outputs are too few to tell rounding toward zero, or down, apart."""
    b = rounding_bias(got, ref64)
    b["limit"] = bias_limit(b["noise"], floor)
    d = max(DIRECTION_LIMIT, 10.0 * b["noise"])
    b["direction_limit"] = d if d <= 0.45 else None
    msg = (f"{name}: rounding bias {b['magnitude']:+.3f} ulp toward the magnitude (limit {b['limit']}), "
           f"{b['direction']:+.3f} toward +inf (limit {b['direction_limit']}) over {b['n']} outputs (noise "
           f"{b['noise']:.3f}); a round-to-nearest epilogue gives ~0, round-toward-zero -0.5 toward the "
           f"magnitude, round-down -0.5 toward +inf (tests/emulate.py)")
    if b["limit"] is not None:
        assert abs(b["magnitude"]) < b["limit"], msg
    if b["direction_limit"] is not None:
        assert abs(b["direction"]) < b["direction_limit"], msg
    return b


# ---------------------------------------------------------------- a tensor core that truncates
def rz32(v) -> np.ndarray:
    """float64 -> float32 rounded toward zero."""
    v = np.asarray(v, dtype=np.float64)
    r = v.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(v)
    return np.where(over, np.nextafter(r, np.float32(0)), r)


def mma_dot(a, w, k_step=16, guard_bits=0):
    """A pessimistic model of an FP32-accumulating tensor core (Fasi, Higham, Mikaitis and
    Pranesh 2021, V100..A100): per step of k_step products, the exact products and the
    accumulator are aligned to the largest exponent among them and truncated (toward zero)
    to 24 + guard_bits bits, added exactly, and the sum truncated to FP32. a [T, K], w [N, K]
    (values exact in fp16) -> float32 [T, N]."""
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    t, k = a.shape
    n = w.shape[0]
    acc = np.zeros((t, n))
    for k0 in range(0, k, k_step):
        p = a[:, None, k0:k0 + k_step] * w[None, :, k0:k0 + k_step]            # [T, N, k_step], exact
        terms = np.concatenate([acc[:, :, None], p], axis=2)
        big = np.max(np.abs(terms), axis=2, keepdims=True)
        e = np.floor(np.log2(np.where(big > 0, big, 1.0)))
        lsb = np.exp2(e - 23 - guard_bits)
        acc = rz32(np.sum(np.trunc(terms / lsb) * lsb, axis=2)).astype(np.float64)
    return acc.astype(np.float32)


# ---------------------------------------------------------------- grid problems (exact FP32 sums)
GRID_X_EXP = 3                 # x = i / 8
GRID_SCALE_EXP = 10            # scale = m / 1024, m in [8, 15]
GRID_EXP = GRID_X_EXP + GRID_SCALE_EXP   # every product code * scale * x is a multiple of 2^-13
GRID_SUM_LIMIT = 2 ** 22       # sum of |terms| of every output, in grid units (FP32 holds 2^24)
SWIGLU_GATE = 16.0             # silu(16) * u rounds to 16 u in fp16 (e^-16 ~ 1.1e-7 << 2^-11)


def grid_imax(k: int) -> int:
    """Largest |i| of x = i / 8 for a K: the expected sum of |terms| (K * 4 * 11.5 * E|i|)
    stays below GRID_SUM_LIMIT / 2 (K <= 8192: |i| <= 8; up to 18944: 4)."""
    for imax in (8, 4, 2, 1):
        if k * 4 * 11.5 * imax * (imax + 1) / (2 * imax + 1) <= GRID_SUM_LIMIT / 2:
            return imax
    raise ValueError(f"K = {k}: too long for an exact grid case")


def grid_fp16(rng, shape, lo=0.125, hi=2.0) -> np.ndarray:
    """fp16 values of random sign with |v| in [lo, hi) or 0 (a tenth): multiples of 2^-13."""
    v = rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)
    v = np.where(rng.random(shape) < 0.1, 0.0, v)
    return rn16(v)


def grid_int4(rng, t, n, k, *, bias=False, residual=False, swiglu=False, imax=None) -> dict:
    """An INT4 GEMM / GEMV problem whose FP32 sums are exact (module docstring): codes over
    every nibble, scales m / 1024 (m in [8, 15]), x = i / 8 (|i| <= grid_imax(K)), bias and
    residual fp16 multiples of 2^-13. swiglu: the kernel's input is gate_up [T, 2K] with
    gate 16 or 0 and up = i / 128, so act = fp16(silu(g) * u) = i / 8 or 0 exactly.
    -> dict(words uint32 [N, K/8], scales fp16 [N, K/128], x fp16 [T, K] (the activation),
    gate_up fp16 [T, 2K] (swiglu), bias fp16 [N] | None, residual fp16 [T, N] | None,
    exact float64 [T, N], want fp16 [T, N] = RN16(exact), units int64 sum |terms| [T, N])."""
    imax = imax or grid_imax(k)
    codes = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    m = rng.integers(8, 16, size=(n, k // quant.GROUP_SIZE)).astype(np.float32)
    scales = (m / 2.0 ** GRID_SCALE_EXP).astype(np.float16)
    i = rng.integers(-imax, imax + 1, size=(t, k)).astype(np.float32)
    out = {"words": quant.pack_int4_value_shuffle(codes), "scales": scales, "bias": None, "residual": None}
    if swiglu:
        live = rng.random((t, k)) < 0.8
        gate = np.where(live, SWIGLU_GATE, 0.0)
        i = np.where(live, i, 0).astype(np.float32)
        out["gate_up"] = np.concatenate([gate, i / 2.0 ** (GRID_X_EXP + 4)], axis=1).astype(np.float16)
    out["x"] = (i / 2.0 ** GRID_X_EXP).astype(np.float16)
    wq = (codes.reshape(n, k // quant.GROUP_SIZE, quant.GROUP_SIZE) * m[:, :, None]).reshape(n, k)   # code * m, float32
    # float32 BLAS on integers: every partial sum stays below 2^22 < 2^24, so exact in any order
    units = (i @ wq.T).astype(np.int64)                                 # [T, N] in 2^-13 units
    absunits = (np.abs(i) @ np.abs(wq).T).astype(np.int64)
    if bias:
        out["bias"] = grid_fp16(rng, n)
        units = units + (out["bias"].astype(np.float64) * 2 ** GRID_EXP).astype(np.int64)[None, :]
    if residual:
        out["residual"] = grid_fp16(rng, (t, n))
        units = units + (out["residual"].astype(np.float64) * 2 ** GRID_EXP).astype(np.int64)
    biggest = int(absunits.max()) + 2 * 2 ** (GRID_EXP + 1)
    assert biggest < GRID_SUM_LIMIT, f"grid case T={t} N={n} K={k}: sum |terms| {biggest} >= {GRID_SUM_LIMIT} units"
    out["exact"] = units.astype(np.float64) / 2.0 ** GRID_EXP            # exact: |units| < 2^53
    out["want"] = rn16(out["exact"])
    out["units"] = absunits
    return out


def grid_misses(got, want) -> np.ndarray:
    """Flat indices where got (fp16) != want (fp16) as values (+0 == -0; NaN differs)."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    return np.flatnonzero(~(g == w))


def describe_grid_misses(name, got, want, exact, idx, limit=8) -> str:
    g, w, e = (np.asarray(a, np.float64).ravel() for a in (got, want, exact))
    shape = np.shape(want)
    rows = "\n".join(f"  [{np.unravel_index(i, shape)}] got {g[i]!r} want {w[i]!r} (exact {e[i]!r}, "
                     f"{(g[i] - e[i]) / float(ulp16(e[i])):+.2f} ulp)" for i in idx[:limit])
    return (f"{name}: {idx.size} of {g.size} outputs differ from fp16_rn of the exact result (every FP32 sum "
            f"is exact on this grid, so only the epilogue rounds; tests/emulate.py)\n{rows}")


def check_grid(name, got, case, row=None) -> None:
    """Assert got == case's want bit for bit (as values); row: the case's token row of a GEMV."""
    want, exact = (case["want"], case["exact"]) if row is None else (case["want"][row], case["exact"][row])
    bad = grid_misses(got, want)
    assert bad.size == 0, describe_grid_misses(name, got, want, exact, bad)


FP8_GRID_SUM_LIMIT = 2 ** 12   # sum |c x| of an output, in units: exact even in an accumulator of 13 bits


def grid_fp8(rng, t, n, k, *, bias=True, residual=True) -> dict:
    """An FP8 GEMM problem whose every sum is exact even in Hopper's FP8 MMA, which keeps
    about 13 bits of its running sum (test_gpu_prefill_wgmma.py): activation codes of -2..2,
    weight codes of -1..1 (sparse enough that sum |c x| < 2^12 on every output), ts = 2^-4
    and s = 2^-6 (ts s exact), bias and residual fp16 multiples of 2^-13, so the epilogue's
    FP32 acc * (ts s) + bias + residual is exact too and the only rounding is the fp16 store.
    -> dict(xq uint8 [T, K], ts fp32 [T], codes uint8 [N, K], scales fp32 [N], bias, residual,
    exact float64 [T, N], want fp16 [T, N])."""
    density = min(1.0, FP8_GRID_SUM_LIMIT / 4 / (k * 1.2 * 2 / 3))
    xi = rng.integers(-2, 3, size=(t, k))
    wi = rng.integers(-1, 2, size=(n, k)) * (rng.random((n, k)) < density)
    enc = lambda v: quant.fp8_e4m3_encode(v.astype(np.float32))  # noqa: E731
    out = {"xq": enc(xi), "codes": enc(wi), "ts": np.full(t, 2.0 ** -4, np.float32),
           "scales": np.full(n, 2.0 ** -6, np.float32), "bias": None, "residual": None}
    assert np.array_equal(quant.E4M3_VALUES[out["xq"]], xi) and np.array_equal(quant.E4M3_VALUES[out["codes"]], wi)
    absdot = np.abs(xi).astype(np.float64) @ np.abs(wi).T.astype(np.float64)
    assert absdot.max() < FP8_GRID_SUM_LIMIT, f"grid_fp8 T={t} N={n} K={k}: sum |c x| {absdot.max()}"
    exact = (xi.astype(np.float64) @ wi.T.astype(np.float64)) * 2.0 ** -10
    if bias:
        out["bias"] = grid_fp16(rng, n)
        exact = exact + out["bias"].astype(np.float64)[None, :]
    if residual:
        out["residual"] = grid_fp16(rng, (t, n))
        exact = exact + out["residual"].astype(np.float64)
    out["exact"], out["want"] = exact, rn16(exact)
    return out


# ---------------------------------------------------------------- the FP8 GEMV, operation by operation
LANES = 32
FP8_CHUNK = 16


def gemv_fp8(x, codes, scales, bias=None, residual=None, drop_last=False, fp32=False) -> np.ndarray:
    """kernels/fp8.cu nq_gemv_fp8 in float32, in its order: lane l of a row's warp takes the
    16-code chunks l, l + 32, ... and runs acc = fma(c_k, x_k, acc) over their k in order
    (c_k x_k is exact in FP32: 4 x 11 significant bits, so fma = one rounded add); the lanes
    meet in a butterfly (shfl_xor 16, 8, 4, 2, 1: a + b, commutative, the same bits in every
    lane); lane 0 stores fp16(((acc * s) + bias) + residual), FMUL then FADDs (its SASS).
    drop_last: the fault "the last code of the row is never added". -> float16 [N] (fp32:
    the float32 value before the fp16 store)."""
    c32 = quant.E4M3_VALUES[np.asarray(codes)].astype(np.float32)
    n, k = c32.shape
    p = c32 * np.asarray(x, np.float16).astype(np.float32)[None, :]             # exact products
    if drop_last:
        p[:, -1] = 0.0
    chunks = k // FP8_CHUNK
    rounds = -(-chunks // LANES)
    pad = np.zeros((n, rounds * LANES * FP8_CHUNK), np.float32)
    pad[:, :k] = p                                                             # absent chunks add +0: no change
    pc = pad.reshape(n, rounds, LANES, FP8_CHUNK)
    acc = np.zeros((n, LANES), np.float32)
    for r in range(rounds):
        for j in range(FP8_CHUNK):
            acc = acc + pc[:, r, :, j]
    lanes = np.arange(LANES)
    for o in (16, 8, 4, 2, 1):
        acc = acc + acc[:, lanes ^ o]
    y = acc[:, 0] * np.asarray(scales, np.float32)
    if bias is not None:
        y = y + np.asarray(bias, np.float16).astype(np.float32)
    if residual is not None:
        y = y + np.asarray(residual, np.float16).astype(np.float32)
    return y if fp32 else y.astype(np.float16)


def fp8_gemv_roundings(k: int) -> int:
    """FP32 roundings any term of nq_gemv_fp8 goes through before the fp16 store: its lane's
    chain of ceil(K/16/32) * 16 FMAs (the first, into 0, is exact), the 5 butterfly adds, the
    scale FMUL and the two epilogue FADDs."""
    return -(-(k // FP8_CHUNK) // LANES) * FP8_CHUNK - 1 + 5 + 3


def fp8_gemv_window(k: int, absdot_scaled, bias=None, residual=None):
    """The FP32 error bound w of nq_gemv_fp8 before its fp16 rounding: gamma_n (s sum |c x| +
    |bias| + |residual|), n = fp8_gemv_roundings(K), gamma_n = n u / (1 - n u) (Higham,
    Accuracy and Stability, 3.1: a sum whose every term passes through at most n roundings).
    The output then lies in interval16(ref, w); as a distance, |out - ref| <= 2^-11 (|ref| + w)
    + w + 2^-25."""
    nr = fp8_gemv_roundings(k)
    gamma = nr * U32 / (1 - nr * U32)
    mag = np.asarray(absdot_scaled, np.float64)
    for extra in (bias, residual):
        if extra is not None:
            mag = mag + np.abs(np.asarray(extra, np.float64))
    return gamma * mag


def fp8_gemv_refs(x, codes, scales, bias=None, residual=None):
    """(ref float64 [N], s sum |c x| float64 [N]) of the GEMV's exact contract."""
    c = quant.E4M3_VALUES[np.asarray(codes)].astype(np.float64)
    prod = c * np.asarray(x, np.float16).astype(np.float64)[None, :]
    s = np.asarray(scales, np.float64)
    ref = s * prod.sum(1)
    for extra in (bias, residual):
        if extra is not None:
            ref = ref + np.asarray(extra, np.float64)
    return ref, s * np.abs(prod).sum(1)


# ---------------------------------------------------------------- one decoder layer, op by op
GEMV_ACC = 2.0 ** -17          # FP32 window of an INT4 GEMV, per sum |w x| (twice test_gpu_gemv.py's 2^-18)
FOLD_ACC = 2.0 ** -22          # ... plus this much of the folded magnitude (NQ_*_FOLD; test_gpu_gemv.py's)
NORM_REL = 2.0 ** -18          # rmsnorm's FP32 window, relative (sum of squares, 1 / sqrtf, two FMULs)
SILU_REL = 2.0 ** -20          # fp32 silu(g) * u: expf / __fdividef, a few FP32 ulps (tests/gpu_cases.py)
ROPE_ABS = 2.0 ** -20          # rope: sincosf against NumPy's cos / sin, per |x1| + |x2| (test_gpu_prefill.py)
ATTN_REL = 2.0 ** -16          # attention's FP32 window per sum_j p_j |v_j| (__expf, the softmax, P.V)


def fold_magnitude(scales, x_abs):
    """Per row, sum_g scale_g (1032 sum_lo |x| + 72 sum_hi |x|): what the folded MMA of
    gemv_int4.cuh [fold] / stream3.cuh [s3-group] sums (k % 4 < 2 are a group's lo slots)."""
    s = np.asarray(scales, np.float64)
    ax = np.abs(np.asarray(x_abs, np.float64)).reshape(s.shape[1], -1, 4)
    return s @ (1032.0 * ax[:, :, :2].sum(axis=(1, 2)) + 72.0 * ax[:, :, 2:].sum(axis=(1, 2)))


def spread16(v64, w):
    """How far from RN16(v64) the fp16 value of a v32 within w of v64 can be: max over the
    two ends of interval16 (0 for most elements when w << ulp)."""
    lo, hi = interval16(v64, w)
    c = rn16(v64).astype(np.float64)
    return np.maximum(hi.astype(np.float64) - c, c - lo.astype(np.float64))


def silu_mul64(g, u):
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    return g / (1.0 + np.exp(-g)) * u


def rmsnorm64(x, w, eps):
    x = np.asarray(x, np.float64)
    r = 1.0 / np.sqrt(np.mean(x * x) + eps)
    return x * r * np.asarray(w, np.float64), r


def rope64(x, pos, dims):
    """x [heads, d] (fp16 values) at position pos, in float64 from the kernels' FP32 angle
    (fp32(pos) * inv_freq, the table of reference.rope_inv_freq)."""
    from nanoqwen_lib.model import reference as ref
    inv = ref.rope_inv_freq(dims.head_dim, dims.rope_theta)
    ang = (np.float32(pos) * inv).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    x = np.asarray(x, np.float64)
    h = dims.head_dim // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    mag = np.abs(x1) + np.abs(x2)
    return out, ROPE_ABS * np.concatenate([mag, mag], axis=-1)


def attention64(q16, dq, k, v, dims):
    """One query (q16 [heads, d], each element known to within dq) over k, v [ctx, kv_heads, d]
    -> (out [heads, d], window [heads, d]): softmax(q.k / sqrt(d)) . v in float64, and the
    FP32 window: each score off by at most ds_j = ((d + 2) u sum |q k| + sum |k| dq) / sqrt(d)
    (+ 2^-21 |s| for rsqrtf), each p by exp(2 max ds) - 1 + 2^-18 (__expf / exp2f) relative,
    so out by twice that of sum p |v|, plus ATTN_REL sum p |v| for the FP32 sums and merges."""
    d, gqa = dims.head_dim, dims.gqa_ratio
    q = np.asarray(q16, np.float64).reshape(dims.num_kv_heads, gqa, d)
    dq = np.asarray(dq, np.float64).reshape(dims.num_kv_heads, gqa, d)
    kf, vf = np.asarray(k, np.float64), np.asarray(v, np.float64)
    s = np.einsum("cgd,tcd->cgt", q, kf) / np.sqrt(d)
    ds = ((d + 2) * U32 * np.einsum("cgd,tcd->cgt", np.abs(q), np.abs(kf))
          + np.einsum("cgd,tcd->cgt", dq, np.abs(kf))) / np.sqrt(d) + 2.0 ** -21 * np.abs(s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("cgt,tcd->cgd", p, vf)
    abs_pv = np.einsum("cgt,tcd->cgd", p, np.abs(vf))
    eps_p = np.expm1(2 * ds.max(axis=-1, keepdims=True)) + 2.0 ** -18
    win = (2 * eps_p + ATTN_REL) * abs_pv
    return out.reshape(-1, d), win.reshape(-1, d)


def layer_scales(tensors, layer) -> dict:
    """matrix -> the fp16 scales [N, K/128] of the engine's stacked INT4 projection (qkv and
    gate_up concatenate theirs in row order), for the fold term of the GEMV window."""
    p = f"model.layers.{layer}."
    parts = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    return {m: np.concatenate([np.asarray(tensors[p + n + ".scales"]) for n in names]) for m, names in parts.items()}


class LayerMiss(AssertionError):
    pass


class Matvec:
    """W v and |W| v in float64 for the four projections of one layer (reference.LayerWeights,
    float32 values of exact codes * scale), on NumPy or (xp=cupy) on the GPU, results on the
    host."""
    NAMES = {"qkv": "w_qkv", "o_proj": "w_o", "gate_up": "w_gate_up", "down": "w_down"}

    def __init__(self, weights, xp=np):
        self.xp = xp
        self.w = {m: xp.asarray(getattr(weights, a)).astype(xp.float64) for m, a in self.NAMES.items()}
        self.absw = {m: xp.abs(w) for m, w in self.w.items()}

    def dot(self, m, v):
        return host64(self.w[m] @ self.xp.asarray(np.asarray(v, np.float64)))

    def absdot(self, m, v):
        return host64(self.absw[m] @ self.xp.asarray(np.abs(np.asarray(v, np.float64))))


def host64(a) -> np.ndarray:
    """float64 NumPy copy of a NumPy or CuPy array."""
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def fp8_gemv_acc(k: int) -> float:
    """The FP32 window of nq_gemv_fp8 per s sum |c x| (fp8_gemv_window), plus 2^-23 for the
    reference's float32 weights (E4M3 value * FP32 scale, rounded once)."""
    nr = fp8_gemv_roundings(k)
    return nr * U32 / (1 - nr * U32) + 2.0 ** -23


def layer_ops_check(dims, weights, x_in, k_past, v_past, got, matvec=None, scales=None,
                    encoding="int4") -> dict:
    """One decode step of one decoder layer, checked op by op against float64 given the
    engine's own inputs to each op where it kept them (teacher forcing), each output in
    interval16(v64, w) with w the op's FP32 window plus what its unseen inputs may carry:

      y1 = rmsnorm(x_in)                 not kept: RN16 of float64, spread by NORM_REL
      qkv = W_qkv y1 + b                 got["qkv"]       GEMV window (+ |W| dy1)
      k_new = rope(k of got qkv)         got["k"]         ROPE_ABS (|x1| + |x2|)
      v_new = v of got qkv               got["v"]         bit for bit
      attn(rope(q of got qkv), [k_past, k_new], [v_past, v_new])   got["attn"]   attention64
      x_mid = x_in + W_o attn            not kept (down overwrites it): spread by its window
      y2 = rmsnorm(x_mid)                not kept
      gate_up = W_gu y2                  got["gate_up"]
      act = silu(g) u of got gate_up     not kept: spread by SILU_REL
      x_out = x_mid + W_down act         got["x"]         GEMV window (+ |W| dact) + the x_mid spread

    weights: reference.LayerWeights; matvec: a Matvec of them (default: NumPy); scales:
    matrix -> fp16 scales [N, K/128] for the fold term (None: no fold term); encoding "fp8":
    the GEMVs' window is fp8_gemv_acc(K) sum |w x| instead (nq_gemv_fp8's bound). Raises
    LayerMiss naming every op whose outputs leave their intervals; returns op -> (misses,
    elements, max |err| / (2^-11 |v| + w + 2^-25), share of outputs pinned to one fp16 value)."""
    mvc = matvec or Matvec(weights)
    sc = scales or {}
    f = lambda a: host64(a).ravel()  # noqa: E731

    def gw(m, x16, dx=None):
        """The GEMV window of projection m on input x16 (known to within dx)."""
        acc = fp8_gemv_acc(x16.size) if encoding == "fp8" else GEMV_ACC
        out = acc * mvc.absdot(m, x16)
        if m in sc:
            out = out + FOLD_ACC * fold_magnitude(sc[m], x16)
        if dx is not None and np.any(dx):
            out = out + mvc.absdot(m, dx)
        return out

    x = f(x_in)
    res, failures = {}, []

    def check(op, got_v, v64, w):
        got_v = f(got_v)
        idx = interval_misses(got_v, v64, w)
        lo, hi = interval16(v64, w)
        err = np.abs(got_v - v64) / (HALF_ULP * np.abs(v64) + w + SUB_HALF)
        res[op] = (int(idx.size), int(got_v.size), float(np.max(err)) if err.size else 0.0, float(np.mean(lo == hi)))
        if idx.size:
            failures.append(describe_misses(op, got_v, v64, w, idx))

    # attention block
    y1, _ = rmsnorm64(x, f(weights.input_norm), dims.rms_eps)
    dy1 = spread16(y1, NORM_REL * np.abs(y1))
    y1_16 = rn16(y1).astype(np.float64)
    v = mvc.dot("qkv", y1_16) + f(weights.b_qkv)
    check("qkv", got["qkv"], v, gw("qkv", y1_16, dy1) + 2 * U32 * np.abs(v))
    qkv = f(got["qkv"])
    qd, kd = dims.q_dim, dims.kv_dim
    pos = k_past.shape[0]
    k_rot, k_win = rope64(qkv[qd:qd + kd].reshape(dims.num_kv_heads, -1), pos, dims)
    check("k", got["k"], k_rot.ravel(), k_win.ravel())
    vn = f(got["v"])
    res["v"] = (int(np.sum(~(vn == qkv[qd + kd:]))), vn.size, 0.0, 1.0)
    if res["v"][0]:
        failures.append(f"v: {res['v'][0]} of {vn.size} elements differ from the v part of qkv (a copy)")
    q_rot, q_win = rope64(qkv[:qd].reshape(dims.num_heads, -1), pos, dims)
    dq = spread16(q_rot, q_win)
    kk = np.concatenate([host64(k_past), f(got["k"]).reshape(1, dims.num_kv_heads, -1)])
    vv = np.concatenate([host64(v_past), vn.reshape(1, dims.num_kv_heads, -1)])
    a64, a_win = attention64(rn16(q_rot), dq, kk, vv, dims)
    check("attn", got["attn"], a64.ravel(), a_win.ravel())
    # o_proj (+ residual): x_mid is not kept
    attn = f(got["attn"])
    xm = x + mvc.dot("o_proj", attn)
    dxm = spread16(xm, gw("o_proj", attn) + 2 * U32 * np.abs(xm))
    xm16 = rn16(xm).astype(np.float64)
    # MLP block
    y2, r2 = rmsnorm64(xm16, f(weights.post_norm), dims.rms_eps)
    ln2 = np.abs(f(weights.post_norm))
    w_y2 = (NORM_REL * np.abs(y2) + (1 + 2.0 ** -10) * r2 * ln2 * dxm
            + np.abs(y2) * (np.abs(xm16) @ dxm) / (xm16 @ xm16))
    dy2 = spread16(y2, w_y2)
    y2_16 = rn16(y2).astype(np.float64)
    v = mvc.dot("gate_up", y2_16)
    check("gate_up", got["gate_up"], v, gw("gate_up", y2_16, dy2) + U32 * np.abs(v))
    gu = f(got["gate_up"])
    act64 = silu_mul64(gu[:dims.intermediate], gu[dims.intermediate:])
    dact = spread16(act64, SILU_REL * np.abs(act64))
    act16 = rn16(act64).astype(np.float64)
    v = xm16 + mvc.dot("down", act16)
    check("x", got["x"], v, gw("down", act16, dact) + dxm + 2 * U32 * np.abs(v))
    if failures:
        raise LayerMiss("\n".join(failures))
    return res
