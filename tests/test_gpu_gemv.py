"""The decode GEMVs and small decode kernels against CPU references (needs a GPU).

Every case draws fresh random inputs (the seed is printed on failure), poisons the output
with NaN before the launch, and checks every element against

    |out - ref| <= acc * sum_k |w_k x_k| + 2^-10 * |ref| + 2^-24

with ref in float64 from quant.dequantize_int4 (exact codes * fp16 scale). The last two
terms are one fp16 ulp of the output (the kernel rounds its fp32 result once: half an ulp,
plus room for the fp32 sum landing on the other side of a rounding midpoint) and the
subnormal spacing. `acc` bounds the FP32 accumulation: a chain of about n adds loses at
most n * 2^-24 of sum |w_k x_k|; 2^-18 allows 64 such steps (tensor-core groups, then the
per-warp, per-CTA and split-K sums), 2^-16 the lm_head's ~120 sequential FMAs per lane.
A single wrong element or index costs about sum|w x| / K, far above both; a zeroed output row
costs |ref| (test_gemv_int4_7b, test_gemv_int4_grid_exact).

Rounding, not only magnitude (issue 31). That bound admits an epilogue that rounds toward zero
(an error of up to one ulp). Two checks close it (tests/emulate.py, shown on the CPU by
tests/test_emulate.py):
  grid    test_gemv_int4_grid_exact: inputs on which every FP32 sum is exact in any order
          (emulate.grid_int4), so the output must be fp16_rn of the integer result, bit for
          bit: RZ changes most outputs, a zeroed row or a dropped K slice its own;
  bias    every random case: the mean signed error in ulps toward the magnitude within
          emulate.bias_limit (0.1 over a few thousand outputs: ~0 for RN even with a truncating
          tensor core, -0.5 for RZ), and toward +inf within the coarser DIRECTION_LIMIT (the
          outputs share x, so that mean is not one of independent errors; -0.5 for round-down).

NQ_GEMV_FOLD=1 (gemv_int4.cu, [fold]) lets the tensor core sum (1032 + s) x and (72 + s) x
and subtracts 1032 sum_lo x + 72 sum_hi x per group afterwards: its fp32 partial sums are
larger, and so is their rounding. Its cases add FOLD_ACC * sum_g scale_g * (1032 sum_lo |x|
+ 72 sum_hi |x|) (the folded magnitude, about 260 sum|w x|): a few fp32 ulps of it, far below
what a lo/hi slot mix-up or a wrong correction costs (~ 1000 sum|x| * scale per group).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from nanoqwen_lib.format import quant

from . import emulate as em

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from nanoqwen_lib.gpu import ops_decode, ops_gemv  # noqa: E402
from nanoqwen_lib.gpu.lab import gemv as lab_gemv  # run_gemv: the lab's versions (tests/test_gpu_lab.py)
from .gpu_cases import SHAPES_7B, TINY16, U16, rand_int4, swiglu_input

ODD = [(n, k) for n in (1, 7, 130, 1000) for k in (128, 384, 1152)]
FOLD_ACC = 2.0 ** -22


def fold_magnitude(scales, x64):
    """Per row, sum_g scale_g * (1032 sum_lo |x| + 72 sum_hi |x|): k % 4 < 2 are the lo
    slots of a group (the halves 0,1,4,5 of every 8), the rest hi."""
    ax = np.abs(x64).reshape(-1, 32, 4)
    f = 1032.0 * ax[:, :, :2].sum(axis=(1, 2)) + 72.0 * ax[:, :, 2:].sum(axis=(1, 2))
    return scales.astype(np.float64) @ f


def dev(a):
    return cp.asarray(np.ascontiguousarray(a))


def poisoned(n, dtype=np.float16):
    return cp.full(n if isinstance(n, tuple) else (n,), np.nan, dtype=dtype)


def blocks_in_threads(n, rows, fn):
    """fn(r0, r1) for row blocks of `rows`, in a thread pool (NumPy releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda r: fn(r, min(n, r + rows)), range(0, n, rows)))


def ref_matvec(words, scales, x64, rows=2048):
    """(W.x, |W|.|x|) in float64, W dequantized on the CPU a block of rows at a time."""
    n = words.shape[0]
    dot, absdot = np.empty(n), np.empty(n)

    def block(r0, r1):
        w = quant.dequantize_int4(words[r0:r1], scales[r0:r1]).astype(np.float64)
        dot[r0:r1], absdot[r0:r1] = w @ x64, np.abs(w) @ np.abs(x64)
    blocks_in_threads(n, rows, block)
    return dot, absdot


def check_close(name, got, ref, absdot, acc, extra=0.0, rtol=U16):
    """Every element within acc * absdot + rtol * |ref| + 2^-24 (+ extra); NaN fails."""
    got = np.asarray(got, dtype=np.float64)
    bound = acc * absdot + rtol * np.abs(ref) + TINY16 + extra
    err = np.abs(got - ref)
    bad = np.flatnonzero(~(err <= bound))
    if bad.size:
        rows = "\n".join(f"  [{i}] got {got[i]!r} ref {ref[i]!r} err {err[i]:.3g} bound {bound[i]:.3g}"
                         for i in bad[:8])
        pytest.fail(f"{name}: {bad.size} of {got.size} elements out of bounds\n{rows}")
    return float(np.max(err / bound)) if err.size else 0.0


def run_gemv(rng, n, k, bias, residual, ksplit=None, tuning=None, launcher="plain", impl=None, ctas=None):
    words, scales = rand_int4(rng, n, k)
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    res = rng.standard_normal(n).astype(np.float16) if residual else None
    out = poisoned(n)
    extra = 0.0
    # The engine's launcher (ops_gemv) for its own kernel; the lab's for the other versions.
    lab_kw = {} if impl in (None, "tiles") and ctas is None else {"impl": impl, "ctas": ctas}
    launch = lab_gemv if lab_kw else ops_gemv
    if launcher == "swiglu":
        gu, act, alt = swiglu_input(rng, k)
        x64 = act.astype(np.float64)
        launch.gemv_int4_swiglu(dev(gu), dev(words), dev(scales), out,
                                residual=None if res is None else dev(res), bias=None if b is None else dev(b),
                                ksplit=ksplit, tuning=tuning, **lab_kw)
        extra = ref_matvec(words, scales, alt)[1] if alt.any() else 0.0
    else:
        x = rng.standard_normal(k).astype(np.float16)
        x64 = x.astype(np.float64)
        launch.gemv_int4(dev(x), dev(words), dev(scales), out, bias=None if b is None else dev(b),
                         residual=None if res is None else dev(res), ksplit=ksplit, tuning=tuning, **lab_kw)
    dot, absdot = ref_matvec(words, scales, x64)
    # the build that ran: the arguments, else the measured table's entry for the shape
    built = tuning if lab_kw else ops_gemv.gemv_config(
        "gemv_int4_swiglu" if launcher == "swiglu" else "gemv_int4", n, k, tuning, ksplit)[0]
    fold = bool((built or {}).get("NQ_GEMV_FOLD"))
    if fold:
        extra = extra + FOLD_ACC * fold_magnitude(scales, x64)
    ref = dot + (0 if b is None else b.astype(np.float64))
    ref = ref + (0 if res is None else res.astype(np.float64))
    name = f"{launcher} {impl} N={n} K={k} ksplit={ksplit} ctas={ctas} {tuning or ''}"
    got = out.get()
    worst = check_close(name, got, ref, absdot, 2.0 ** -18, extra)
    em.check_rounding_bias(name, got, ref, em.FOLD_BIAS_LIMIT if fold else em.BIAS_LIMIT)
    return worst


@pytest.mark.parametrize("shape", list(SHAPES_7B))
def test_gemv_int4_7b(rng, shape):
    n, k = SHAPES_7B[shape]
    run_gemv(rng, n, k, bias=shape == "qkv", residual=shape in ("o_proj", "down"))


# split-K off, automatic, one group per slice.
@pytest.mark.parametrize("n,k", ODD)
@pytest.mark.parametrize("ksplit", [None, 1, "max"])
def test_gemv_int4_odd(rng, n, k, ksplit):
    s = k // 128 if ksplit == "max" else ksplit
    run_gemv(rng, n, k, bias=(n + k) % 2 == 0, residual=n % 2 == 1, ksplit=s)


# The tiles kernel at the tuning knobs the 7B table and the fallback use, and neighbours.
TILES_TUNINGS = [{"NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_WARPS": 8},
                 {"NQ_GEMV_WARPS": 2}, {"NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_FOLD": 1},
                 {"NQ_GEMV_FOLD": 1, "NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_FOLD": 1, "NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2},
                 {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 2}]


@pytest.mark.parametrize("tuning", TILES_TUNINGS)
@pytest.mark.parametrize("n,k,ksplit", [(3584, 3584, None), (130, 1152, 3), (1000, 18944, None)])
def test_gemv_int4_tuning_variants(rng, tuning, n, k, ksplit):
    run_gemv(rng, n, k, bias=True, residual=True, ksplit=ksplit, tuning=tuning)


# ---- exact grid cases: every FP32 sum exact, so the output is fp16_rn of the integer result
def run_grid(rng, n, k, *, launcher="plain", bias=False, residual=False, ksplit=None, tuning=None):
    case = em.grid_int4(rng, 1, n, k, bias=bias, residual=residual, swiglu=launcher == "swiglu")
    out = poisoned(n)
    b = None if case["bias"] is None else dev(case["bias"])
    res = None
    if residual:                                     # in place: the residual is the output buffer
        out[...] = dev(case["residual"][0])
        res = out
    if launcher == "swiglu":
        ops_gemv.gemv_int4_swiglu(dev(case["gate_up"][0]), dev(case["words"]), dev(case["scales"]), out,
                                  residual=res, bias=b, ksplit=ksplit, tuning=tuning)
    else:
        ops_gemv.gemv_int4(dev(case["x"][0]), dev(case["words"]), dev(case["scales"]), out, bias=b, residual=res,
                           ksplit=ksplit, tuning=tuning)
    em.check_grid(f"{launcher} N={n} K={k} ksplit={ksplit} {tuning or 'planned'}", out.get(), case, row=0)
    return case


GRID_CASES = [("qkv", "plain", None, None), ("o_proj", "plain", None, None), ("gate_up", "plain", None, None),
              ("down", "plain", None, None), ("down", "swiglu", None, None), ("down", "swiglu", 5, {"NQ_GEMV_FOLD": 0}),
              ("o_proj", "plain", 1, {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}),
              ("qkv", "plain", 3, {"NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2})]


@pytest.mark.parametrize("shape,launcher,ksplit,tuning", GRID_CASES,
                         ids=[f"{s}-{l}-{k}-{'+'.join(f'{a[8:]}{b}' for a, b in (t or {}).items()) or 'table'}"
                              for s, l, k, t in GRID_CASES])
def test_gemv_int4_grid_exact(rng, shape, launcher, ksplit, tuning):
    """The 7B shapes (the measured table's tuning and split, and other builds), bias and
    residual as the engine has them: every output bit for bit fp16_rn(exact)."""
    n, k = SHAPES_7B[shape]
    run_grid(rng, n, k, launcher=launcher, bias=shape == "qkv", residual=shape in ("o_proj", "down"),
             ksplit=ksplit, tuning=tuning)


@pytest.mark.parametrize("n,k,ksplit", [(7, 128, None), (130, 1152, 3), (1000, 384, 1)])
def test_gemv_int4_grid_exact_odd(rng, n, k, ksplit):
    for launcher in ("plain", "swiglu"):
        run_grid(rng, n, k, launcher=launcher, bias=True, residual=True, ksplit=ksplit)


@pytest.mark.parametrize("ksplit", [None, 1])
def test_gemv_int4_residual_in_place(rng, ksplit):
    n = k = 3584
    words, scales = rand_int4(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    res = rng.standard_normal(n).astype(np.float16)
    io = dev(res)
    ops_gemv.gemv_int4(dev(x), dev(words), dev(scales), io, residual=io, ksplit=ksplit)
    dot, absdot = ref_matvec(words, scales, x.astype(np.float64))
    check_close("in-place residual", io.get(), dot + res.astype(np.float64), absdot, 2.0 ** -18)
    em.check_rounding_bias("in-place residual", io.get(), dot + res.astype(np.float64))


@pytest.mark.parametrize("n,k,ksplit", [(3584, 18944, None), (130, 384, 1), (7, 1152, 3), (1000, 1152, None)])
def test_gemv_int4_swiglu(rng, n, k, ksplit):
    run_gemv(rng, n, k, bias=False, residual=True, ksplit=ksplit, launcher="swiglu")


SWIGLU_TUNINGS = [{"NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_WARPS": 2}, {"NQ_GEMV_FOLD": 1},
                  {"NQ_GEMV_FOLD": 1, "NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2},
                  {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}, {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 2}]


@pytest.mark.parametrize("tuning", SWIGLU_TUNINGS)
@pytest.mark.parametrize("n,k,ksplit", [(3584, 18944, 5), (130, 1152, 1)])
def test_gemv_int4_swiglu_tuning_variants(rng, tuning, n, k, ksplit):
    run_gemv(rng, n, k, bias=True, residual=True, ksplit=ksplit, launcher="swiglu", tuning=tuning)


def test_launcher_refuses_bad_buffers():
    x, words, scales = cp.zeros(256, cp.float16), cp.zeros((16, 32), cp.uint32), cp.zeros((16, 2), cp.float16)
    out = cp.zeros(16, cp.float16)
    with pytest.raises(Exception, match="x.dtype"):
        ops_gemv.gemv_int4(x.astype(cp.float32), words, scales, out)
    with pytest.raises(Exception, match="scales.shape"):
        ops_gemv.gemv_int4(x, words, scales[:, :1], out)
    with pytest.raises(Exception, match="data.ptr"):
        ops_gemv.gemv_int4(cp.zeros(264, cp.float16)[8:], words, scales, out)


# ---- the dp4a path --------------------------------------------------------------------------
# ---- rmsnorm, embed, lm_head, argmax ---------------------------------------------------------
def check_norm_interval(name, got, ref):
    """rmsnorm's fp16 output in [RN16(ref - w), RN16(ref + w)], w = emulate.NORM_REL |ref| (its
    FP32 sum of squares, 1 / sqrtf and two FMULs stay within ~2^-20 relative): half an ulp plus
    w, where check_close allows a whole ulp; and no rounding bias."""
    miss = em.interval_misses(got, ref, em.NORM_REL * np.abs(ref))
    assert miss.size == 0, em.describe_misses(name, got, ref, em.NORM_REL * np.abs(ref), miss)
    em.check_rounding_bias(name, got, ref)



@pytest.mark.parametrize("h", [3584, 896, 128])
def test_rmsnorm(rng, h):
    x, w = rng.standard_normal(h).astype(np.float16), rng.uniform(0.5, 2, h).astype(np.float16)
    out = poisoned(h)
    ops_decode.rmsnorm(dev(x), dev(w), out, 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2) + 1e-6) * w.astype(np.float64)
    check_close(f"rmsnorm H={h}", out.get(), ref, 0.0, 0.0)
    check_norm_interval(f"rmsnorm H={h}", out.get(), ref)


@pytest.mark.parametrize("rows", [2, 37, 512])
def test_rmsnorm_rows(rng, rows):
    """The prefill form: one CTA per row; every row against its own float64 reference."""
    h = 3584
    x = (rng.standard_normal((rows, h)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float16)
    w = rng.uniform(0.5, 2, h).astype(np.float16)
    out = poisoned((rows, h))
    ops_decode.rmsnorm(dev(x), dev(w), out, 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True) + 1e-6) * w.astype(np.float64)
    check_close(f"rmsnorm rows={rows}", out.get().ravel(), ref.ravel(), 0.0, 0.0)
    check_norm_interval(f"rmsnorm rows={rows}", out.get(), ref)


def test_embed_rows(rng):
    v, h, rows = 4096, 3584, 300
    table = rng.standard_normal((v, h)).astype(np.float16)
    ids = rng.integers(0, v, rows).astype(np.int32)
    ids[[0, 7]] = (-1, v)                                # two bad ids: NaN rows, the rest exact
    out = poisoned((rows, h))
    ops_decode.embed(cp.asarray(ids), dev(table), out)
    got = out.get()
    assert np.isnan(got[[0, 7]]).all()
    good = np.setdiff1d(np.arange(rows), [0, 7])
    np.testing.assert_array_equal(got[good], table[ids[good]])


def test_embed(rng):
    v, h = 4096, 3584
    table = rng.standard_normal((v, h)).astype(np.float16)
    t_dev, out = cp.zeros(1, cp.int32), poisoned(h)
    tab = dev(table)
    for tok in (int(rng.integers(0, v)), 0, v - 1):
        t_dev[0] = tok
        out.fill(np.nan)
        ops_decode.embed(t_dev, tab, out)
        np.testing.assert_array_equal(out.get(), table[tok])
    for bad in (-1, v):
        t_dev[0] = bad
        ops_decode.embed(t_dev, tab, out)
        assert np.isnan(out.get()).all(), f"token {bad} out of range must give NaN"


@pytest.mark.parametrize("v,h", [(152064, 3584), (1, 128), (7, 896), (1000, 3584), (4099, 128)])
def test_lm_head(rng, v, h):
    w_dev = (cp.random.standard_normal((v, h), dtype=cp.float32) * 0.05).astype(cp.float16)
    x = rng.standard_normal(h).astype(np.float16)
    logits, tok = poisoned(v, np.float32), cp.full(1, -7, cp.int32)
    ops_decode.lm_head(dev(x), w_dev, logits, tok)
    w, x64 = w_dev.get(), x.astype(np.float64)
    ref, absdot = np.empty(v), np.empty(v)

    def block(r0, r1):
        wc = w[r0:r1].astype(np.float64)
        ref[r0:r1], absdot[r0:r1] = wc @ x64, np.abs(wc) @ np.abs(x64)
    blocks_in_threads(v, 4096, block)
    got = logits.get()
    check_close(f"lm_head V={v} H={h}", got, ref, absdot, 2.0 ** -16, rtol=0.0)
    assert int(tok.get()[0]) == int(np.argmax(got)), "fused argmax != argmax of the logits"
    logits2 = poisoned(v, np.float32)
    ops_decode.lm_head(dev(x), w_dev, logits2)            # unfused: same logits, bit for bit
    np.testing.assert_array_equal(logits2.get(), got)


@pytest.mark.parametrize("v", [152064, 1, 5, 1000, 152067])
@pytest.mark.parametrize("ctas", [None, 1])
def test_argmax_ties_lowest(rng, v, ctas):
    tok = cp.full(1, -7, cp.int32)
    cases = [rng.standard_normal(v).astype(np.float32), np.full(v, 3.25, np.float32)]
    tied = rng.standard_normal(v).astype(np.float32)
    picks = np.sort(rng.choice(v, size=min(v, 4), replace=False))
    tied[picks] = 9.0                                   # several maxima: the lowest wins
    last = rng.standard_normal(v).astype(np.float32)
    last[-1] = 50.0
    for logits in cases + [tied, last]:                 # repeated launches: the counter resets
        ops_decode.argmax(dev(logits), tok, ctas=ctas)
        assert int(tok.get()[0]) == int(np.argmax(logits)), (v, ctas)
