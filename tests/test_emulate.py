"""The rounding checks of the GPU tests, run on the CPU against NumPy models of the kernels
(tests/emulate.py): each check passes a model of a correct kernel and fails the fault it is
for, before a GPU ever runs it (issue 31: "rounding checked, not only magnitude").

  fp16      NumPy's float64 -> float16 is round-to-nearest-even (an integer model, ties too)
  bias      the rounding-bias statistic: ~0 for round-to-nearest even where a tensor core
            truncates its partial sums (a pessimistic model), ~-0.5 ulp for round-toward-zero
  grid      on grid_int4's inputs every FP32 sum is exact in any order, blocking, split-K or
            truncating alignment, so the output is RN16 of the integer result; RZ, a zeroed
            row and a dropped K slice each change many outputs
  fp8 gemv  the operation-by-operation model of nq_gemv_fp8 lies inside its derived interval
            (gamma_n, n = its roundings); a dropped last code leaves it, the old K 2^-24 bound
            misses it at K = 3584
  layer     layer_ops_check passes a float32 engine and a truncating-tensor-core engine on
            tiny, and fails one whose down drops a K slice; at the 7B's down (K = 18944 in
            NQ_PD_DOWN_KS slices) the dropped slice is ~30 windows out on almost every row
  logits    a dropped down slice moves tiny's logits ~300x the reference's own one-ulp
            sensitivity, the yardstick of test_gpu_persistent.py's logits check
"""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.format import quant
from nanoqwen_lib.model import reference as ref

from . import emulate as em
from .gpu_cases import rand_int4

FINITE = np.flatnonzero(np.isfinite(quant.E4M3_VALUES)).astype(np.uint8)


# ---------------------------------------------------------------- fp16 rounding
def rn16_model(v: np.ndarray) -> np.ndarray:
    """Round to nearest even by integers: v (normal fp16 range) = m 2^(e-10), m in [1024, 2048)."""
    a = np.abs(v)
    e = np.floor(np.log2(a))
    scaled = a / np.exp2(e - 10)                       # exact in float64: a power-of-two scaling
    lo = np.floor(scaled)
    frac = scaled - lo
    up = (frac > 0.5) | ((frac == 0.5) & (lo % 2 == 1))
    return np.sign(v) * (lo + up) * np.exp2(e - 10)


def test_rn16_is_round_to_nearest_even(rng):
    a = rng.uniform(-8, 8, 200_000) * np.exp2(rng.integers(-10, 10, 200_000))
    a = a[np.abs(a) >= 2.0 ** -13]
    ties = (rng.integers(1024, 2048, 20_000) + 0.5) * np.exp2(rng.integers(-20, 0, 20_000))   # exact midpoints
    near = ties * (1 + rng.choice([-1, 1], ties.size) * 2.0 ** -40)                         # just off them
    for v in (a, ties, near):
        got = em.rn16(v).astype(np.float64)
        np.testing.assert_array_equal(got, rn16_model(v))


def test_rz16_and_ulp16(rng):
    v = rng.standard_normal(100_000) * 3
    rz, rn = em.rz16(v).astype(np.float64), em.rn16(v).astype(np.float64)
    assert (np.abs(rz) <= np.abs(v)).all() and (np.abs(v) - np.abs(rz) < em.ulp16(v)).all()
    assert 0.4 < np.mean(rz != rn) < 0.6                           # RZ changes about half the outputs
    assert em.ulp16(1.0) == 2.0 ** -10 and em.ulp16(1.999) == 2.0 ** -10 and em.ulp16(-2.0) == 2.0 ** -9
    assert em.ulp16(1e-9) == 2.0 ** -24


# ---------------------------------------------------------------- the bias statistic
def _tc_problem(rng, t, n, k):
    words, scales = rand_int4(rng, n, k)
    w = quant.dequantize_int4(words, scales).astype(np.float64)
    x = rng.standard_normal((t, k)).astype(np.float16).astype(np.float64)
    return x, w, x @ w.T


@pytest.mark.parametrize("k,k_step", [(3584, 16), (3584, 8), (18944, 16)])
def test_bias_statistic_separates_rn_from_rz(rng, k, k_step):
    """The truncating tensor-core model (mma_dot, no guard bits: the worst of the published
    behaviours) then an RN epilogue: |bias| well under BIAS_LIMIT; RZ: ~-0.5 ulp toward the
    magnitude, far past it; round-down: ~-0.5 toward -inf."""
    t, n = (48, 64) if k == 3584 else (12, 64)
    x, w, exact = _tc_problem(rng, t, n, k)
    acc = em.mma_dot(x, w, k_step=k_step).astype(np.float64)
    rn = em.rounding_bias(em.rn16(acc), exact)
    rz = em.rounding_bias(em.rz16(acc), exact)
    down = em.rounding_bias(np.floor(acc / em.ulp16(acc)) * em.ulp16(acc), exact)
    print(f"K={k} k_step={k_step}: RN {rn}, RZ {rz}, round-down {down}")
    limit = em.bias_limit(rn["noise"])
    assert limit is not None and rn["noise"] < 0.025
    assert abs(rn["magnitude"]) < limit / 2 and abs(rn["direction"]) < limit / 2
    assert rz["magnitude"] < -0.4 and rz["magnitude"] < -2 * limit
    assert down["direction"] < -0.4
    em.check_rounding_bias("RN", em.rn16(acc), exact)
    with pytest.raises(AssertionError, match="rounding bias"):
        em.check_rounding_bias("RZ", em.rz16(acc), exact)
    with pytest.raises(AssertionError, match="rounding bias"):
        em.check_rounding_bias("round-down", np.floor(acc / em.ulp16(acc)) * em.ulp16(acc), exact)


def test_direction_limit_allows_an_error_shared_by_every_output(rng):
    """A correct kernel's outputs can share an error of a fifth of an ulp through x (measured on
    the H200): the direction check allows it; the magnitude check is untouched by it."""
    n = 4096
    exact = rng.standard_normal(n) * 4.0
    shared = 0.23 * em.ulp16(exact)                        # every output pushed up a bit
    b = em.check_rounding_bias("shared", em.rn16(exact + shared), exact)
    assert 0.15 < b["direction"] < em.DIRECTION_LIMIT and abs(b["magnitude"]) < em.BIAS_LIMIT


def test_few_outputs_close_together_promise_no_precision(rng):
    """Seven outputs that happen to sit a quarter ulp low, close together: their own spread
    would make a limit of 0.18 ulp; the noise never falls below round-to-nearest's own spread,
    so seven outputs are too few to tell (both checks skipped, said so), while 400 outputs
    rounded toward zero still fail."""
    ref = rng.standard_normal(7) * 3.0
    b = em.check_rounding_bias("seven", ref - (0.26 + 0.02 * rng.standard_normal(7)) * em.ulp16(ref) * np.sign(ref), ref)
    assert b["noise"] >= em.RN_SPREAD / np.sqrt(7) and b["limit"] is None and b["direction_limit"] is None
    ref = rng.standard_normal(400) * 3.0
    with pytest.raises(AssertionError, match="rounding bias"):
        em.check_rounding_bias("RZ, 400", em.rz16(ref), ref)


def test_bias_statistic_of_the_fold_unpack(rng):
    """NQ_GEMV_FOLD: the tensor core sums (1032 + s) x and (72 + s) x, then the fold is
    subtracted in FP32: larger partial sums, truncated, but no bias toward the magnitude."""
    t, n, k = 24, 64, 3584
    words, scales = rand_int4(rng, n, k)
    codes = quant.unpack_int4_value_shuffle(words).astype(np.float64)
    off = np.where(np.arange(k) % 4 < 2, 1032.0, 72.0)                 # lo / hi slots (gemv_int4.cuh [fold])
    x = rng.standard_normal((t, k)).astype(np.float16).astype(np.float64)
    s = scales.astype(np.float64)
    g = k // 128
    out = np.zeros((t, n))
    for j in range(g):                                                  # per group: folded MMA, - fold, * scale
        sl = slice(128 * j, 128 * (j + 1))
        c = em.mma_dot(x[:, sl], codes[:, sl] + off[None, sl]).astype(np.float64)
        fold = (x[:, sl] * off[sl]).sum(axis=1, keepdims=True).astype(np.float32).astype(np.float64)
        out = (out + ((c - fold).astype(np.float32) * s[None, :, j]).astype(np.float32)).astype(np.float32)
    exact = x @ (codes.reshape(n, g, 128) * s[:, :, None]).reshape(n, k).T
    b = em.check_rounding_bias("fold", em.rn16(out.astype(np.float64)), exact)
    print("fold", b)
    assert abs(b["magnitude"]) < em.BIAS_LIMIT / 2


# ---------------------------------------------------------------- grid cases
def _sum_in_order(a, w, rng, split=1):
    """x . w^T in float32, k in a random order, in `split` slices added in slice order."""
    t, k = a.shape
    perm = rng.permutation(k)
    total = np.zeros((t, w.shape[0]), np.float32)
    for s in range(split):
        part = np.zeros_like(total)
        for j in perm[s * k // split:(s + 1) * k // split]:
            part = part + (a[:, j:j + 1] * w[None, :, j]).astype(np.float32)
        total = total + part
    return total


@pytest.mark.parametrize("k", [384, 3584, 18944])
def test_grid_sums_are_exact_in_any_order(rng, k):
    t, n = (3, 16) if k == 18944 else (4, 24)
    case = em.grid_int4(rng, t, n, k, bias=True, residual=True)
    w16 = quant.dequantize_int4(case["words"], case["scales"]).astype(np.float64)   # = fp16(code * scale), exact
    assert np.array_equal(w16.astype(np.float16).astype(np.float64), w16)
    x = case["x"].astype(np.float64)
    extra = case["bias"].astype(np.float64)[None, :] + case["residual"].astype(np.float64)
    sums = [em.mma_dot(x, w16, k_step=16), em.mma_dot(x, w16, k_step=8), _sum_in_order(x, w16, rng),
            _sum_in_order(x, w16, rng, split=5)]
    for acc in sums:
        v = (acc.astype(np.float32) + extra.astype(np.float32)).astype(np.float64)   # epilogue adds, FP32
        np.testing.assert_array_equal(v, case["exact"])
        assert em.grid_misses(em.rn16(v), case["want"]).size == 0
    pinned = em.rn16(case["exact"]).astype(np.float64) != case["exact"]
    print(f"K={k}: {pinned.mean():.2f} of the outputs need rounding; imax {em.grid_imax(k)}; "
          f"largest sum |terms| {case['units'].max()} of {em.GRID_SUM_LIMIT} units")
    assert pinned.mean() > 0.5


def test_grid_catches_rz_zeroed_row_and_dropped_slice(rng):
    t, n, k = 17, 136, 3584
    case = em.grid_int4(rng, t, n, k, bias=True)
    w16 = quant.dequantize_int4(case["words"], case["scales"]).astype(np.float64)
    x = case["x"].astype(np.float64)
    rz = em.rz16(case["exact"])
    assert em.grid_misses(rz, case["want"]).size > 0.3 * t * n
    zeroed = case["want"].copy()
    zeroed[:, 5] = 0
    assert em.grid_misses(zeroed, case["want"]).size >= t - 1
    kept = slice(0, 3 * k // 4)                                          # the last of 4 K slices dropped
    acc = x[:, kept] @ w16[:, kept].T + case["bias"].astype(np.float64)
    assert em.grid_misses(em.rn16(acc), case["want"]).size > 0.9 * t * n


def test_grid_swiglu_act_is_exact(rng):
    """gate 16 or 0, up i / 128: fp16(silu(g) * u) in FP32 (both kernels' expressions) is i / 8
    or 0 exactly."""
    t, k = 5, 3584
    case = em.grid_int4(rng, t, 16, k, swiglu=True)
    gu = case["gate_up"].astype(np.float32)
    g, u = gu[:, :k], gu[:, k:]
    for act in (g / (np.float32(1) + np.exp(-g)) * u, g / (np.float32(1) + np.exp(np.minimum(-g, 88))) * u):
        np.testing.assert_array_equal(act.astype(np.float16), case["x"])


def test_grid_imax_keeps_the_sums_small():
    for k in (128, 3584, 8192, 18944):
        imax = em.grid_imax(k)
        assert k * 8 * 15 * imax < 2 ** 24 * 4                # even the worst case is within 4x of FP32's 2^24
        assert k * 4 * 11.5 * imax * (imax + 1) / (2 * imax + 1) <= em.GRID_SUM_LIMIT / 2


def test_grid_fp8_is_exact_in_a_13_bit_accumulator(rng):
    """grid_fp8: sum |c x| < 2^12 on every output, so even an accumulator that keeps 13 bits
    of its running sum (aligned to the largest addend, truncated) adds exactly; the epilogue
    (acc * (ts s), + bias, + residual in FP32) is exact too; RZ changes many outputs."""
    t, n, k = 9, 64, 3584
    case = em.grid_fp8(rng, t, n, k)
    a = quant.E4M3_VALUES[case["xq"]].astype(np.float64)
    w = quant.E4M3_VALUES[case["codes"]].astype(np.float64)
    acc = np.zeros((t, n))
    for k0 in range(0, k, 32):                                 # 13 bits kept, relative to the largest term
        terms = np.concatenate([acc[:, :, None], a[:, None, k0:k0 + 32] * w[None, :, k0:k0 + 32]], axis=2)
        big = np.max(np.abs(terms), axis=2, keepdims=True)
        lsb = np.exp2(np.floor(np.log2(np.where(big > 0, big, 1.0))) - 12)
        acc = np.sum(np.trunc(terms / lsb) * lsb, axis=2)
    np.testing.assert_array_equal(acc, a @ w.T)
    s = np.float32(case["ts"][0]) * np.float32(case["scales"][0])
    y = (acc.astype(np.float32) * s + case["bias"].astype(np.float32)) + case["residual"].astype(np.float32)
    np.testing.assert_array_equal(y.astype(np.float64), case["exact"])
    assert em.grid_misses(y.astype(np.float16), case["want"]).size == 0
    assert em.grid_misses(em.rz16(case["exact"]), case["want"]).size > 0.1 * t * n


# ---------------------------------------------------------------- the FP8 GEMV
def _fp8_case(rng, n, k):
    codes = FINITE[rng.integers(0, FINITE.size, size=(n, k))]
    scales = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
    x = rng.standard_normal(k)
    x[-1] = np.copysign(1.0 + abs(x[-1]), x[-1])   # the last code's x is shared by every row: a draw near 0
    x = x.astype(np.float16)                         # would hide a dropped last code on all of them
    bias = rng.standard_normal(n).astype(np.float16)
    res = rng.standard_normal(n).astype(np.float16)
    return x, codes, scales, bias, res


@pytest.mark.parametrize("n,k", [(3584, 18944), (3584, 3584), (130, 2432), (7, 128)])
def test_fp8_gemv_interval_holds_and_catches_a_dropped_code(rng, n, k):
    """The float32 model of nq_gemv_fp8 lies in interval16(ref, fp8_gemv_window) on every row;
    the same model with the last code dropped leaves it on many rows (the GPU test fails if
    one does), and is never bit-equal to the correct one on all rows; the old bound
    K 2^-24 sum |c x| + 2^-10 |ref| + 2^-24 lets it through on most."""
    x, codes, scales, bias, res = _fp8_case(rng, n, k)
    out = em.gemv_fp8(x, codes, scales, bias, res)
    dropped = em.gemv_fp8(x, codes, scales, bias, res, drop_last=True)
    refv, absd = em.fp8_gemv_refs(x, codes, scales, bias, res)
    w = em.fp8_gemv_window(k, absd, bias, res)
    assert em.interval_misses(out, refv, w).size == 0
    caught = em.interval_misses(dropped, refv, w).size
    old = k * 2.0 ** -24 * absd + 2.0 ** -10 * np.abs(refv) + 2.0 ** -24
    old_caught = int(np.sum(np.abs(dropped.astype(np.float64) - refv) > old))
    differ = int(np.sum(dropped != out))
    print(f"{n}x{k}: {em.fp8_gemv_roundings(k)} roundings; dropped last code: outside the interval on {caught} "
          f"rows, outside the old bound on {old_caught}, bits differ on {differ} of {n}")
    assert caught >= max(1, n // 20) and differ >= caught
    if n >= 1000:
        assert caught > old_caught
    in_place = em.gemv_fp8(x, codes, scales, residual=res)
    r2, a2 = em.fp8_gemv_refs(x, codes, scales, residual=res)
    assert em.interval_misses(in_place, r2, em.fp8_gemv_window(k, a2, residual=res)).size == 0


def test_fp8_gemv_model_is_its_order(rng):
    """The model's FP32 values differ from a plain sequential FP32 sum's: the GPU test compares
    against the kernel's order, not any order."""
    x, codes, scales, bias, res = _fp8_case(rng, 512, 3584)
    out = em.gemv_fp8(x, codes, scales, bias, res, fp32=True)
    seq = (quant.E4M3_VALUES[codes].astype(np.float32) * x.astype(np.float32)).astype(np.float32)
    acc = np.zeros(512, np.float32)
    for j in range(3584):
        acc = acc + seq[:, j]
    alt = (acc * scales + bias.astype(np.float32)) + res.astype(np.float32)
    flips = np.sum(alt.astype(np.float16) != out.astype(np.float16))
    print(f"{np.sum(alt != out)} of 512 FP32 results differ, {flips} fp16 outputs")
    assert np.sum(alt != out) > 100


def test_rmsnorm_interval(rng):
    """rmsnorm in FP32 as the kernels compute it (sum of squares by FMAs in two orders, 1 /
    sqrtf, x * r * w) lies in interval16(ref, NORM_REL |ref|) of the float64 result; RZ does not."""
    rows, h = 64, 3584
    x = (rng.standard_normal((rows, h)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float16).astype(np.float32)
    w = rng.uniform(0.5, 2, h).astype(np.float16).astype(np.float32)
    x64 = x.astype(np.float64)
    ref64 = x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True) + 1e-6) * w
    for chunks in (np.arange(h // 8), rng.permutation(h // 8)):
        ss = np.zeros(rows, np.float32)
        for c in chunks:                                           # chunks of 8, as sumsq8 (8 FMAs a chunk)
            for j in range(8 * c, 8 * c + 8):
                ss = (ss.astype(np.float64) + x64[:, j] ** 2).astype(np.float32)    # an FMA: one rounding
        r = (np.float32(1) / np.sqrt(ss / np.float32(h) + np.float32(1e-6)))[:, None]
        y = (x * r * w).astype(np.float16)
        assert em.interval_misses(y, ref64, em.NORM_REL * np.abs(ref64)).size == 0
    assert em.interval_misses(em.rz16(ref64), ref64, em.NORM_REL * np.abs(ref64)).size > 0.3 * rows * h


# ---------------------------------------------------------------- decode attention's tolerance
def test_attention_tolerance_with_abs_pv_catches_rz(rng):
    """kvcache.attention_tolerance(ref, abs_pv): fp16 RN of the float64 attention (plus an
    FP32-sized perturbation) passes it; RZ fails it on a sixth of the outputs, where the old
    1e-5 + 2^-10 |ref| lets RZ through everywhere."""
    from nanoqwen_lib.model import kvcache
    d = load().model("7b")
    q, k, v, _, _ = kvcache.random_paged_case(d, 49, rng, max_pages=8)
    r = kvcache.attention_ref_f64(q, k, v, d)
    pv = kvcache.attention_abs_pv(q, k, v, d)
    assert (pv >= np.abs(r)).all()
    tol = kvcache.attention_tolerance(r, pv)
    near = r * (1 + rng.uniform(-1, 1, r.size) * 2.0 ** -20)          # an FP32 result, a few ulps off
    assert (np.abs(em.rn16(near).astype(np.float64) - r) <= tol).all()
    rz = em.rz16(r).astype(np.float64)
    caught = int(np.sum(np.abs(rz - r) > tol))
    old = int(np.sum(np.abs(rz - r) > kvcache.attention_tolerance(r)))
    print(f"RZ outside the abs_pv tolerance on {caught} of {r.size} outputs, outside the old one on {old}")
    assert caught > 0.1 * r.size and old == 0


# ---------------------------------------------------------------- one decoder layer
def _tiny_layer():
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0))
    tensors = f.model_tensors()
    refm = ref.ReferenceModel(f.dims, tensors)
    prompt = np.random.default_rng(3).integers(0, 151643, 37).tolist()
    _, cache = refm.prefill(prompt)
    x0 = refm.embed[1234].astype(np.float32)
    kp, vp = cache.past(0)
    x1, _, _ = ref.decoder_layer_decode(x0, refm.layers[0], kp, vp, f.dims)
    kp, vp = cache.past(1)
    return f.dims, refm.layers[1], x1, kp, vp, em.layer_scales(tensors, 1)


def engine_layer(dims, w, x_in, k_past, v_past, gemv="f32", drop=None):
    """A stand-in engine: the layer in float32 with fp16 roundings at the contract's points
    (reference.py's blocks), its GEMVs as float32 BLAS or the truncating tensor-core model
    (mma_dot); drop=(s, KS): down's K slice s of KS never added."""
    r16 = ref.round_fp16

    def lin(x, wm, b=None, res=None, dropk=None):
        if dropk:
            s, ks = dropk
            k = wm.shape[1]
            wm = wm.copy()
            wm[:, s * k // ks:(s + 1) * k // ks] = 0
        y = em.mma_dot(x[None].astype(np.float64), wm.astype(np.float64))[0] if gemv == "mma" else wm @ x
        y = y.astype(np.float32)
        if b is not None:
            y = y + b
        if res is not None:
            y = res + y
        return r16(y)
    x = x_in.astype(np.float32)
    qkv = lin(ref.rmsnorm(x, w.input_norm, dims.rms_eps), w.w_qkv, w.b_qkv)
    qd, kd, d, p = dims.q_dim, dims.kv_dim, dims.head_dim, k_past.shape[0]
    cos, sin = ref.rope_tables(np.arange(p, p + 1), d, dims.rope_theta)
    q = r16(ref.apply_rope(qkv[:qd].reshape(1, dims.num_heads, d), cos, sin))
    k = r16(ref.apply_rope(qkv[qd:qd + kd].reshape(1, dims.num_kv_heads, d), cos, sin))
    v = qkv[qd + kd:].reshape(1, dims.num_kv_heads, d)
    a = ref.attention_prefill(q, np.concatenate([k_past, k]), np.concatenate([v_past, v])).reshape(-1)
    xm = lin(a, w.w_o, res=x)
    gu = lin(ref.rmsnorm(xm, w.post_norm, dims.rms_eps), w.w_gate_up)
    xo = lin(ref.swiglu(gu), w.w_down, res=xm, dropk=drop)
    return {"qkv": qkv, "k": k[0], "v": v[0], "attn": a, "gate_up": gu, "x": xo}


@pytest.fixture(scope="module")
def tiny_layer():
    return _tiny_layer()


@pytest.mark.parametrize("gemv", ["f32", "mma"])
def test_layer_check_passes_engines_and_fails_a_dropped_down_slice(tiny_layer, gemv):
    dims, w, x, kp, vp, scales = tiny_layer
    mvc = em.Matvec(w)
    res = em.layer_ops_check(dims, w, x, kp, vp, engine_layer(dims, w, x, kp, vp, gemv), mvc, scales)
    print(gemv, {op: r[:3] for op, r in res.items()})
    assert all(r[0] == 0 for r in res.values())
    for drop in ((1, 2), (3, 4)):
        with pytest.raises(em.LayerMiss, match=r"^x: (\d+) of 896") as e:
            em.layer_ops_check(dims, w, x, kp, vp, engine_layer(dims, w, x, kp, vp, gemv, drop), mvc, scales)
        assert int(str(e.value).split()[1]) > 0.9 * dims.hidden
    got = engine_layer(dims, w, x, kp, vp, gemv)
    gu = got["gate_up"] = got["gate_up"].copy()
    big = np.argsort(-np.abs(gu.astype(np.float64)))[:8]
    gu[big] = 0                                              # rows of gate_up zeroed (of the larger outputs:
    with pytest.raises(em.LayerMiss, match="gate_up: 8 of"):  # its window is a few % as y2 is not kept)
        em.layer_ops_check(dims, w, x, kp, vp, got, mvc, scales)


def test_layer_check_of_an_fp8_model():
    """The FP8 encoding: the GEMVs' window is nq_gemv_fp8's gamma_n (emulate.fp8_gemv_acc);
    a float32 engine passes, a dropped down slice fails."""
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0, weights="fp8"))
    refm = ref.ReferenceModel(f.dims, f.model_tensors())
    _, cache = refm.prefill(np.random.default_rng(4).integers(0, 151643, 21).tolist())
    kp, vp = cache.past(0)
    x = refm.embed[777].astype(np.float32)
    w = refm.layers[0]
    mvc = em.Matvec(w)
    res = em.layer_ops_check(f.dims, w, x, kp, vp, engine_layer(f.dims, w, x, kp, vp), mvc, encoding="fp8")
    print({op: r[:3] for op, r in res.items()})
    with pytest.raises(em.LayerMiss, match="^x: "):
        em.layer_ops_check(f.dims, w, x, kp, vp, engine_layer(f.dims, w, x, kp, vp, drop=(1, 2)), mvc, encoding="fp8")


def test_dropped_down_slice_at_7b_dims(rng):
    """The 7B's down (K = 18944, NQ_PD_DOWN_KS slices on an H200's 132 SMs), recipe weights
    (synthetic/checkpoint.py), a random SwiGLU input and residual: dropping any one slice puts
    almost every row outside its interval, most by more than 10 times (half ulp + window)."""
    from nanoqwen_lib.gpu.persistent import persistent_plan
    d = load().model("7b")
    ks = persistent_plan(d, 132)["NQ_PD_DOWN_KS"]
    n, k = 256, d.intermediate
    wf = (rng.standard_normal((n, k)) / np.sqrt(2 * d.num_layers * k) / 0.6).astype(np.float32)
    codes, scales = quant.quantize_int4_groupwise(wf)
    wd = (codes.reshape(n, -1, 128).astype(np.float64) * scales.astype(np.float64)[:, :, None]).reshape(n, k)
    g, u = (rng.standard_normal(k).astype(np.float16).astype(np.float64) for _ in range(2))
    act64 = em.silu_mul64(g, u)
    dact = em.spread16(act64, em.SILU_REL * np.abs(act64))
    act = em.rn16(act64).astype(np.float64)
    xm = em.rn16(rng.standard_normal(n)).astype(np.float64)
    v = xm + wd @ act
    w = (em.GEMV_ACC * (np.abs(wd) @ np.abs(act)) + em.FOLD_ACC * em.fold_magnitude(scales, act)
         + np.abs(wd) @ dact + em.ulp16(xm) + 2 * em.U32 * np.abs(v))     # x_mid taken as one ulp off everywhere
    assert em.interval_misses(em.rn16(v), v, w).size == 0
    for s in range(ks):
        sl = slice(s * k // ks, (s + 1) * k // ks)
        dropped = wd[:, sl] @ act[sl]
        ratio = np.abs(dropped) / (em.HALF_ULP * np.abs(v) + w + em.SUB_HALF)
        caught = em.interval_misses(em.rn16(v - dropped), v, w).size
        print(f"KS={ks} slice {s}: error rms {np.sqrt(np.mean(dropped ** 2)):.3g}, window median "
              f"{np.median(w / em.ulp16(v)):.2f} ulp, error / (half ulp + window) median {np.median(ratio):.1f}; "
              f"outside the interval: {caught} of {n} rows")
        assert caught > 0.9 * n and np.median(ratio) > 10


def test_dropped_down_slice_moves_logits_far_past_the_sensitivity():
    """tiny (two layers): the last of KS K slices of every down dropped (zero codes) moves the
    last logits by ~0.3 relative; the reference's own one-ulp sensitivity is ~1e-3, and the
    logits check of test_gpu_persistent.py allows LOGIT_SENSITIVITY_FACTOR times it."""
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from .sensitivity import one_ulp_sensitivity
    from .gpu_cases import LOGIT_SENSITIVITY_FACTOR
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0))
    tensors = dict(f.model_tensors())
    prompt = np.random.default_rng(3).integers(0, 151643, 24).tolist()
    base, _ = ref.ReferenceModel(f.dims, tensors).prefill(prompt)
    _, sens = one_ulp_sensitivity(ref.ReferenceModel, f.dims, tensors, prompt, (), np)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    for ks in (2, 4):
        t2 = dict(tensors)
        for layer in range(f.dims.num_layers):
            name = f"model.layers.{layer}.mlp.down_proj.qweight"
            wq = np.array(tensors[name])
            wq[:, (ks - 1) * wq.shape[1] // ks:] = 0        # zero words: codes 0
            t2[name] = wq
        moved, _ = ref.ReferenceModel(f.dims, t2).prefill(prompt)
        r = rel(moved[-1], base[-1])
        print(f"KS={ks}: dropped slice moves the logits {r:.3g}; sensitivity {sens:.3g}")
        assert r > 10 * LOGIT_SENSITIVITY_FACTOR * sens
