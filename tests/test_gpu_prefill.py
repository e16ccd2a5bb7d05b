"""The prefill kernels against float64 references (needs a GPU).

Every case draws fresh random inputs (the seed is printed on failure), poisons the output
with NaN before the launch and checks every element.

GEMM (kernels/prefill_gemm.cu). The kernel feeds the tensor cores w16 = fp16(code * scale)
(one rounding of the exact code * scale, documented in the kernel), so the tight check is
against that:  |out - ref16| <= 2^-10 |ref16| + acc(K) * sum_k |x_k w16_k| + 2^-24,  where
ref16 = x . w16 [+ bias] [+ residual] in float64; 2^-10 |ref| is one fp16 ulp (the kernel
rounds once: half an ulp, plus room for the FP32 sum landing across a rounding midpoint) and
acc(K) = (K/16 + 8) * 2^-24 covers the FP32 accumulation (a chain of K/16 tensor-core steps,
each rounding once, plus the epilogue adds). A wrong element or index costs ~sum|x w| / K,
well above acc(K) for K = 384 and 3584. Against the exact contract (ref = x . (code * scale),
reference.linear's arithmetic) the extra error is at most 2^-11 sum |x_k w_k| (each weight off
by at most half an fp16 ulp); that bound is checked too.

Rounding, not only magnitude (issue 31): those bounds admit an epilogue that rounds toward
zero. test_gemm_grid_exact runs inputs on which every FP32 sum is exact in any order, split-K
and tensor-core alignment included (tests/emulate.py grid_int4), so every output must be
fp16_rn of the integer result, bit for bit; every random case also checks the mean signed
error in ulps (emulate.check_rounding_bias: ~0 for round-to-nearest, -0.5 for toward-zero;
tests/test_emulate.py shows both on a model of a truncating tensor core).

Attention: |out - ref| <= 2^-10 |ref| + 2^-10 * sum_j p_j |v_j| + 2^-25 * ctx * max|v| + 2^-24:
one output ulp; P enters the tensor cores as fp16 (relative 2^-11, doubled for exp2 and the
FP32 rescaling); p below the fp16 normal range is off by at most 2^-25 absolute.
RoPE: one fp16 ulp plus 2^-20 (|x1| + |x2|) for cos/sin (sincosf vs NumPy, a few fp32 ulp).
"""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib import config
from nanoqwen_lib.model import kvcache
from nanoqwen_lib.format import quant
from nanoqwen_lib.model import reference as ref

from . import emulate as em

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from nanoqwen_lib.gpu import cuda_build  # noqa: E402

if not cuda_build.have_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from nanoqwen_lib.gpu import ops_prefill  # noqa: E402
from .gpu_cases import SHAPES_7B, TINY16, U16
from .gpu_cases import rand_int4 as rand_int4_host

DIMS_7B = config.load().model("7b")


def rand_int4(rng, n, k):
    """Random packed weights (every nibble, -8 too) and fp16 scales, on the device."""
    return tuple(cp.asarray(a) for a in rand_int4_host(rng, n, k))


def rand16(rng, shape, scale=1.0):
    return cp.asarray((scale * rng.standard_normal(shape)).astype(np.float16))


def check_close(name, got, refv, bound):
    """Every element within bound; NaN (an unwritten element) fails. Returns max err/bound."""
    got = got.astype(cp.float64)
    err = cp.abs(got - refv)
    bad = cp.flatnonzero(~(err <= bound))
    if bad.size:
        idx = cp.asnumpy(bad[:8])
        g, r, e, b = (cp.asnumpy(a.ravel()[bad[:8]]) for a in (got, refv, err, bound))
        rows = "\n".join(f"  [{np.unravel_index(i, got.shape)}] got {g[j]!r} ref {r[j]!r} err {e[j]:.3g} "
                         f"bound {b[j]:.3g}" for j, i in enumerate(idx))
        pytest.fail(f"{name}: {bad.size} of {got.size} elements out of bounds\n{rows}")
    return float((err / bound).max())


# ---------------------------------------------------------------- GEMM
def gemm_refs(x64, words, scales, bias, residual, dx=None, rows=4096):
    """-> (ref16, ref_exact, absdot, dxdot) float64 [T, N]: x . w16 and x . (code*scale)
    (+ bias, + residual), |x| . |w| and |dx| . |w| (0 without dx), W dequantized
    (quant.dequantize_int4) a block of rows at a time."""
    n, t = words.shape[0], x64.shape[0]
    out16, exact, absdot, dxdot = (cp.zeros((t, n)) for _ in range(4))
    for r in range(0, n, rows):
        w = quant.dequantize_int4(words[r:r + rows], scales[r:r + rows], xp=cp).astype(cp.float64)
        w16 = w.astype(cp.float16).astype(cp.float64)
        out16[:, r:r + rows], exact[:, r:r + rows] = x64 @ w16.T, x64 @ w.T
        absdot[:, r:r + rows] = cp.abs(x64) @ cp.abs(w).T
        if dx is not None:
            dxdot[:, r:r + rows] = dx @ cp.abs(w).T
    for extra in (bias, residual):
        if extra is not None:
            out16 += extra.astype(cp.float64)
            exact += extra.astype(cp.float64)
    return out16, exact, absdot, dxdot


def fits_workspace(t, n, cfg):
    """A forced split-K config whose partial tiles fit ops_prefill's workspace (else the
    launcher raises LimitError, tested in test_gemm_rejects_bad_buffers)."""
    bm, split = cfg.get("bm", 64), cfg.get("split", 1)
    return split == 1 or split * -(-t // bm) * -(-n // ops_prefill.GEMM_BN) * bm * ops_prefill.GEMM_BN \
        <= ops_prefill.WS_FLOATS


def run_gemm(rng, t, n, k, *, bias=False, residual=False, swiglu=False, configs=({},), weights=None):
    """One random problem, one float64 reference, checked for each launch config (bm, split,
    warps_m; {} = the launcher's plan). The output is re-poisoned (and the in-place residual
    restored) before every launch."""
    words, scales = weights if weights is not None else rand_int4(rng, n, k)
    dx = None
    if swiglu:
        gate_up = rand16(rng, (t, 2 * k), 2.0)
        x64 = ref.swiglu(gate_up.astype(cp.float32)).astype(cp.float64)    # fp16(silu(g) * u)
        # The kernel's act (expf, IEEE division) may differ from CuPy's in the last fp16 bit
        # of a few elements: |dx| . |w| is added to the bounds (0 when they agree).
        act = cp.empty((t, k), cp.float16)
        ops_prefill.swiglu_act(gate_up, act)
        dx = cp.abs(act.astype(cp.float64) - x64)
        assert float(dx.max()) <= 2.0 ** -10 * float(cp.abs(x64).max()), "act differs by more than an ulp"
    else:
        x = rand16(rng, (t, k))
        x64 = x.astype(cp.float64)
    b = rand16(rng, (n,)) if bias else None
    res = rand16(rng, (t, n)) if residual else None
    ref16, exact, absdot, dxdot = gemm_refs(x64, words, scales, b, res, dx)
    acc = (k / 16 + 8) * TINY16
    tight_bound = U16 * cp.abs(ref16) + acc * absdot + dxdot + TINY16
    exact_bound = U16 * cp.abs(exact) + (2.0 ** -11 + acc) * absdot + dxdot + TINY16
    out = cp.empty((t, n), dtype=cp.float16)
    worst = 0.0
    for cfg in [c for c in configs if fits_workspace(t, n, c)]:
        out.fill(np.nan)
        if residual:                                # in place: the residual is the output buffer
            out[...] = res
        if swiglu:
            ops_prefill.gemm_int4_swiglu(gate_up, words, scales, out, residual=out if residual else None, **cfg)
        else:
            ops_prefill.gemm_int4(x, words, scales, out, bias=b, residual=out if residual else None, **cfg)
        cp.cuda.Device().synchronize()
        name = f"gemm T={t} N={n} K={k} bias={bias} residual={residual} swiglu={swiglu} {cfg or 'planned'}"
        worst = max(worst, check_close(name, out, ref16, tight_bound))
        check_close(name + " (exact weights)", out, exact, exact_bound)
        em.check_rounding_bias(name, out, ref16)
    return worst


PROJ_VARIANT = {"qkv": dict(bias=True), "o_proj": dict(residual=True), "gate_up": {},
                "down": dict(swiglu=True, residual=True)}
# Every build and a few split-K factors on the 7B shapes (the plan's choice among them).
CONFIGS_7B = ({}, dict(bm=64, split=1), dict(bm=128, split=1), dict(bm=64, split=3, warps_m=4),
              dict(bm=128, split=2, warps_m=4))
CONFIGS_ODD = [dict(bm=bm, split=s, warps_m=w) for bm in (64, 128) for w in (2, 4) for s in (1, 2)] + \
              [dict(bm=64, split=3), {}]


@pytest.fixture(scope="module")
def weights_7b():
    """One random 7B weight set per projection for the module (fresh every run)."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**63))
    return {p: rand_int4(rng, n, k) for p, (n, k) in SHAPES_7B.items()}


@pytest.mark.parametrize("t", [1, 17, 512])
@pytest.mark.parametrize("proj", list(SHAPES_7B))
def test_gemm_7b(rng, weights_7b, proj, t):
    n, k = SHAPES_7B[proj]
    run_gemm(rng, t, n, k, weights=weights_7b[proj], configs=CONFIGS_7B, **PROJ_VARIANT[proj])


@pytest.mark.parametrize("t,n,k", [(5, 136, 384), (130, 136, 384), (3, 7, 128), (200, 250, 256)])
@pytest.mark.parametrize("variant", [{}, dict(bias=True), dict(residual=True), dict(bias=True, residual=True),
                                     dict(swiglu=True), dict(swiglu=True, residual=True)],
                         ids=["plain", "bias", "residual", "bias+residual", "swiglu", "swiglu+residual"])
def test_gemm_odd(rng, t, n, k, variant):
    configs = [c for c in CONFIGS_ODD if c.get("split", 1) <= k // 64]
    run_gemm(rng, t, n, k, configs=configs, **variant)


# ---- exact grid cases: every FP32 sum exact, so every output is fp16_rn of the integer result
def run_grid(rng, t, n, k, *, kernel, configs, bias=False, residual=False, swiglu=False, act_buffer=False):
    """One grid case (emulate.grid_int4), each launch config checked bit for bit."""
    case = em.grid_int4(rng, t, n, k, bias=bias, residual=residual, swiglu=swiglu)
    words, scales = cp.asarray(case["words"]), cp.asarray(case["scales"])
    b = None if case["bias"] is None else cp.asarray(case["bias"])
    out = cp.empty((t, n), dtype=cp.float16)
    for cfg in configs:
        out.fill(np.nan)
        if residual:
            out[...] = cp.asarray(case["residual"])
        res = out if residual else None
        if swiglu:
            act = cp.empty((t, k), cp.float16) if act_buffer else None
            ops_prefill.gemm_int4_swiglu(cp.asarray(case["gate_up"]), words, scales, out, residual=res, bias=b,
                                         act=act, kernel=kernel, **cfg)
        else:
            ops_prefill.gemm_int4(cp.asarray(case["x"]), words, scales, out, bias=b, residual=res, kernel=kernel,
                                  **cfg)
        cp.cuda.Device().synchronize()
        em.check_grid(f"{kernel} grid T={t} N={n} K={k} bias={bias} residual={residual} swiglu={swiglu} "
                      f"{cfg or 'planned'}", cp.asnumpy(out), case)
    return case


GRID_MMA = [({}, 17, "qkv"), ({}, 17, "o_proj"), ({}, 130, "down"), (dict(bm=64, split=3, warps_m=4), 17, "down"),
            (dict(bm=128, split=2, warps_m=4), 130, "qkv")]


@pytest.mark.parametrize("cfg,t,proj", GRID_MMA, ids=[f"{p}-{t}-{'-'.join(f'{a}{b}' for a, b in c.items()) or 'planned'}"
                                                      for c, t, p in GRID_MMA])
def test_gemm_grid_exact(rng, cfg, t, proj):
    """mma.sync GEMM on the 7B shapes (the plan, two split-K configs), with the engine's bias,
    residual and, for down, SwiGLU (fused in the tile and through the act buffer): bit for bit."""
    n, k = SHAPES_7B[proj]
    run_grid(rng, t, n, k, kernel="mma", configs=[cfg], **PROJ_VARIANT[proj])
    if proj == "down":
        run_grid(rng, t, n, k, kernel="mma", configs=[{}], swiglu=True, residual=True, act_buffer=True)


@pytest.mark.parametrize("t,n,k", [(5, 136, 384), (130, 7, 128), (200, 250, 256)])
def test_gemm_grid_exact_odd(rng, t, n, k):
    configs = [c for c in CONFIGS_ODD if c.get("split", 1) <= k // 64 and fits_workspace(t, n, c)]
    for variant in ({}, dict(bias=True, residual=True), dict(swiglu=True, residual=True)):
        run_grid(rng, t, n, k, kernel="mma", configs=configs, **variant)


def test_split_k_is_deterministic_and_leaves_counters_clean(rng):
    """Two launches with split-K give the same bits; the tile counters are back at zero."""
    t, n, k = 70, 384, 2048
    words, scales = rand_int4(rng, n, k)
    x = rand16(rng, (t, k))
    a, b = (cp.full((t, n), np.nan, dtype=cp.float16) for _ in range(2))
    ops_prefill.gemm_int4(x, words, scales, a, bm=64, split=5)
    ops_prefill.gemm_int4(x, words, scales, b, bm=64, split=5)
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
    assert int(cp.count_nonzero(ops_prefill.workspace()[1])) == 0


def test_swiglu_fused_equals_unfused(rng):
    """gemm_int4_swiglu == swiglu_act then gemm_int4, bit for bit (same act, same GEMM)."""
    t, n, k = 77, 384, 1024
    words, scales = rand_int4(rng, n, k)
    gate_up = rand16(rng, (t, 2 * k), 2.0)
    act = cp.full((t, k), np.nan, dtype=cp.float16)
    fused, unfused = (cp.full((t, n), np.nan, dtype=cp.float16) for _ in range(2))
    ops_prefill.gemm_int4_swiglu(gate_up, words, scales, fused, bm=64)
    ops_prefill.swiglu_act(gate_up, act)
    ops_prefill.gemm_int4(act, words, scales, unfused, bm=64)
    want = ref.swiglu(gate_up.astype(cp.float32)).astype(cp.float16)
    assert int((act.view(cp.uint16) != want.view(cp.uint16)).sum()) <= t * k // 1000, "act differs from the reference"
    assert cp.array_equal(fused.view(cp.uint16), unfused.view(cp.uint16))
    via_buffer = cp.full((t, n), np.nan, dtype=cp.float16)          # gemm_int4_swiglu(act=...): the same two launches
    act.fill(np.nan)
    ops_prefill.gemm_int4_swiglu(gate_up, words, scales, via_buffer, bm=64, act=act)
    assert cp.array_equal(via_buffer.view(cp.uint16), unfused.view(cp.uint16))


def test_gemm_rejects_bad_buffers(rng):
    words, scales = rand_int4(rng, 128, 256)
    x = rand16(rng, (4, 256))
    out = cp.empty((4, 128), cp.float16)
    with pytest.raises(Exception, match="x.dtype"):
        ops_prefill.gemm_int4(x.astype(cp.float32), words, scales, out)
    with pytest.raises(Exception, match="out.shape"):
        ops_prefill.gemm_int4(x, words, scales, cp.empty((4, 127), cp.float16))
    with pytest.raises(Exception, match="data.ptr"):
        ops_prefill.gemm_int4(x, words, scales, cp.empty(4 * 128 + 8, cp.float16)[8:].reshape(4, 128))
    words, scales = rand_int4(rng, 128, 4096)                       # 64 k-tiles, 64 token tiles
    big = rand16(rng, (4096, 4096))
    with pytest.raises(Exception, match="split-K workspace"):      # 64 slices x 64 tiles x 8192 floats
        ops_prefill.gemm_int4(big, words, scales, cp.empty((4096, 128), cp.float16), bm=64, split=64)


# ---------------------------------------------------------------- RoPE + KV write, attention
def paged_pool(dims, ctx, rng, extra_pages=3):
    """A NaN-poisoned one-layer pool [1, 2, P, kv_heads, 16, d] and a PageTable of ctx tokens
    on shuffled physical pages."""
    num_pages = kvcache.pages_for(ctx) + extra_pages
    table = kvcache.PageTable(kvcache.PageAllocator(num_pages, order=rng.permutation(num_pages)),
                              kvcache.pages_for(ctx) + 2)
    table.append_tokens(ctx)
    pool = cp.full((1, 2) + kvcache.pool_shape(dims, num_pages)[2:], np.nan, dtype=cp.float16)
    return pool, table


DIMS = {"7b": DIMS_7B, "tiny-hd64": config.load().model("tiny-hd64")}


@pytest.mark.parametrize("dims_name,t,start", [("7b", 17, 0), ("7b", 512, 0), ("7b", 17, 40), ("tiny-hd64", 100, 0)])
def test_prefill_rope_write_kv(rng, dims_name, t, start):
    dims = DIMS[dims_name]
    ctx = start + t
    pool, table = paged_pool(dims, ctx, rng)
    qkv = rand16(rng, (t, dims.qkv_dim), 2.0)
    q_out = cp.full((t, dims.num_heads, dims.head_dim), np.nan, dtype=cp.float16)
    bt = cp.asarray(table.block_table)
    ops_prefill.prefill_rope_write_kv(qkv, pool[0, 0], pool[0, 1], bt, q_out, dims, start_pos=start)

    q32 = qkv.astype(cp.float32)
    qd, kd = dims.q_dim, dims.kv_dim
    q = q32[:, :qd].reshape(t, dims.num_heads, dims.head_dim)
    k = q32[:, qd:qd + kd].reshape(t, dims.num_kv_heads, dims.head_dim)
    v = qkv[:, qd + kd:].reshape(t, dims.num_kv_heads, dims.head_dim)
    # Tables on the host (NumPy), as the reference model computes them: inv_freq then has the
    # bits of the kernel's table (ops_attention.rope_inv_freq), and the angles agree exactly.
    cos, sin = (cp.asarray(a) for a in ref.rope_tables(np.arange(start, ctx), dims.head_dim, dims.rope_theta))

    def bound(x, r):
        half = dims.head_dim // 2
        mag = cp.abs(x[..., :half]) + cp.abs(x[..., half:])
        return U16 * cp.abs(r) + 2.0 ** -20 * cp.concatenate([mag, mag], axis=-1) + TINY16

    q_ref = ref.round_fp16(ref.apply_rope(q, cos, sin)).astype(cp.float64)
    check_close("q_rot", q_out, q_ref, bound(q, q_ref))
    k_cache, v_cache = kvcache.gather_kv(pool, 0, bt, ctx)           # [ctx, kv_heads, d]
    k_ref = ref.round_fp16(ref.apply_rope(k, cos, sin)).astype(cp.float64)
    check_close("k in pages", k_cache[start:], k_ref, bound(k, k_ref))
    assert cp.array_equal(v_cache[start:].view(cp.uint16), v.view(cp.uint16)), "v copied bit for bit"
    written = cp.zeros(pool.shape[2:5], dtype=bool)                 # [pages, kv_heads, 16]
    slots = cp.asarray(table.slot_mapping(np.arange(start, ctx)))
    written[slots // 16, :, slots % 16] = True
    for kv in (0, 1):
        assert bool(cp.isnan(pool[0, kv][~written]).all()), "nothing outside the T slots is written"


def attention_case(rng, dims, t, start):
    """q [T, heads, d] fp16; K, V [ctx, kv_heads, d] fp16 written into shuffled pages."""
    ctx = start + t
    pool, table = paged_pool(dims, ctx, rng)
    q = rand16(rng, (t, dims.num_heads, dims.head_dim), 1.5)
    k = rand16(rng, (ctx, dims.num_kv_heads, dims.head_dim))
    v = rand16(rng, (ctx, dims.num_kv_heads, dims.head_dim))
    kvcache.write_kv(pool, 0, cp.asarray(table.slot_mapping(np.arange(ctx))), k, v)
    return q, k, v, pool, cp.asarray(table.block_table)


@pytest.mark.parametrize("dims_name,t,start", [("7b", 1, 0), ("7b", 17, 0), ("7b", 512, 0), ("7b", 130, 0),
                                               ("7b", 17, 40), ("7b", 100, 300), ("tiny-hd64", 100, 0)])
def test_prefill_attention(rng, dims_name, t, start):
    dims = DIMS[dims_name]
    q, k, v, pool, bt = attention_case(rng, dims, t, start)
    out = cp.full((t, dims.q_dim), np.nan, dtype=cp.float16)
    ops_prefill.prefill_attention(q, pool[0, 0], pool[0, 1], bt, out, dims, start_pos=start)
    q64, k64, v64 = (a.astype(cp.float64) for a in (q, k, v))
    want = ref.attention_prefill(q64, k64, v64, ref.keep_fp32).reshape(t, dims.q_dim)
    abs_pv = ref.attention_prefill(q64, k64, cp.abs(v64), ref.keep_fp32).reshape(t, dims.q_dim)
    bound = U16 * cp.abs(want) + U16 * abs_pv + 2.0 ** -25 * (start + t) * float(cp.abs(v64).max()) + TINY16
    check_close(f"attention {dims_name} T={t} start={start}", out, want, bound)
