"""The RS-form INT4 GEMM (kernels/prefill_rs.cu) against float64 (needs a Hopper GPU).

test_gpu_prefill_wgmma.py's INT4 bound and reference (one fp16 ulp of the float64 x . w16
result, w16 = fp16(code * scale), plus (K/16 + 8) 2^-24 sum |x w| for the FP32 sums), fresh
random inputs, outputs poisoned with NaN, every element checked; T from one token to 2048,
the 7B's shapes, tails in N and T, bias and an in-place residual, both builds."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

from nanoqwen_lib.gpu import cuda_build  # noqa: E402

if not cuda_build.have_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs  # noqa: E402
from .test_gpu_prefill_wgmma import check_int4, int4_ref, rand16, rand_int4  # noqa: E402


_WEIGHTS = {}


def weights(rng, n, k):
    """Random packed weights for a shape, reordered once per session on the GPU (the same code as
    on the host: test_rs_reorder_on_the_gpu_is_the_hosts); every case draws a fresh X."""
    if (n, k) not in _WEIGHTS:
        words, scales = rand_int4(rng, n, k)
        _WEIGHTS[(n, k)] = (words, scales, prefill_rs.rs_order(words), prefill_rs.rs_scales(scales))   # on the GPU
    return _WEIGHTS[(n, k)]


def run_rs(rng, t, n, k, *, bias, residual, **build):
    words, scales, w_rs, s_rs = weights(rng, n, k)
    x = rand16(rng, (t, k))
    ref, absdot = int4_ref(x, words, scales)
    b = rand16(rng, (n,)) if bias else None
    res = rand16(rng, (t, n)) if residual else None
    out = cp.empty((t, n), cp.float16)
    out.fill(np.nan)
    if residual:                     # in place: out holds the residual
        out[...] = res
    prefill_rs.gemm_int4_rs(x, w_rs, scales, out, bias=b, residual=out if residual else None, scales_rs=s_rs,
                            **build)
    cp.cuda.Device().synchronize()
    return check_int4(f"rs T={t} N={n} K={k} {build}", out, ref, absdot, k, bias=b, residual=res)


@pytest.mark.parametrize("t", [1, 17, 64, 100, 512, 2048])
@pytest.mark.parametrize("n, k", [(4608, 3584), (3584, 3584), (3584, 18944), (37888, 3584)])
def test_rs_gemm_7b_shapes(rng, t, n, k):
    run_rs(rng, t, n, k, bias=n == 4608, residual=n == 3584)


@pytest.mark.parametrize("n, k", [(8, 128), (72, 256), (200, 384), (1000, 1152)])
@pytest.mark.parametrize("t", [1, 130])
def test_rs_gemm_odd_shapes(rng, t, n, k):
    run_rs(rng, t, n, k, bias=True, residual=True)


@pytest.mark.parametrize("build", [{"NQ_RS_OVERLAP": 1, "NQ_RS_WSMEM": 0}, {"NQ_RS_BM": 64}, {"NQ_RS_CWG": 1},
                                   {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}, {"NQ_RS_KG": 2}, {"NQ_RS_WSMEM": 0},
                                   {"NQ_RS_WSMEM": 0, "NQ_RS_CWG": 1, "NQ_RS_PF": 2},
                                   {"NQ_RS_WSMEM": 0, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6},
                                   {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6, "NQ_RS_KG": 2},
                                   {"NQ_RS_OVERLAP": 2}, {"NQ_RS_OVERLAP": 2, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6},
                                   {"NQ_RS_OVERLAP": 2, "NQ_RS_STAGES": 3}])
def test_rs_gemm_builds(rng, build):
    run_rs(rng, 512, 3584, 3584, bias=False, residual=True, **build)


@pytest.mark.parametrize("t, i, k, build", [(512, 18944, 3584, {}), (17, 18944, 3584, {}),
                                             (130, 40, 256, {}), (512, 2432, 896, {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}),
                                             (512, 18944, 3584, {"NQ_RS_OVERLAP": 2, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6})])
def test_rs_swiglu_is_the_plain_gemm_then_the_act(rng, t, i, k, build):
    """The SwiGLU epilogue (gate_up in the SwiGLU row order) gives the bits of the plain RS GEMM
    into [g | u] followed by ops_prefill.swiglu_act: every element, act poisoned first; the plain
    GEMM itself is checked against float64 on the way."""
    from nanoqwen_lib.gpu import ops_prefill

    words, scales = rand_int4(rng, 2 * i, k)
    x = rand16(rng, (t, k))
    ref, absdot = int4_ref(x, words, scales)
    gate_up = cp.empty((t, 2 * i), cp.float16)
    gate_up.fill(np.nan)
    prefill_rs.gemm_int4_rs(x, cp.asarray(prefill_rs.rs_order(cp.asnumpy(words))), scales, gate_up,
                            scales_rs=cp.asarray(prefill_rs.rs_scales(cp.asnumpy(scales))), **build)
    cp.cuda.Device().synchronize()
    check_int4(f"rs gate_up T={t} I={i} K={k}", gate_up, ref, absdot, k)
    want = cp.empty((t, i), cp.float16)
    ops_prefill.swiglu_act(gate_up, want)
    sw, ss = prefill_rs.swiglu_rows(cp.asnumpy(words), cp.asnumpy(scales))
    act = cp.empty((t, i), cp.float16)
    act.fill(np.nan)
    prefill_rs.gemm_int4_rs_swiglu(x, cp.asarray(prefill_rs.rs_order(sw)), cp.asarray(prefill_rs.rs_scales(ss)), act,
                                   **build)
    cp.cuda.Device().synchronize()
    bad = int(cp.count_nonzero(act.view(cp.uint16) != want.view(cp.uint16)))
    assert bad == 0, f"SwiGLU epilogue T={t} I={i}: {bad} of {act.size} outputs differ from GEMM + swiglu_act"


@pytest.mark.parametrize("n, k", [(200, 384), (37888, 3584)])
def test_rs_reorder_on_the_gpu_is_the_hosts(rng, n, k):
    """rs_order, rs_scales and swiglu_rows on CuPy arrays give the host's (NumPy) arrays, bit for bit."""
    words, scales = rand_int4(rng, n, k)
    hw, hs = cp.asnumpy(words), cp.asnumpy(scales)
    assert (cp.asnumpy(prefill_rs.rs_order(words)) == prefill_rs.rs_order(hw)).all()
    assert (cp.asnumpy(prefill_rs.rs_scales(scales)).view(np.uint16) == prefill_rs.rs_scales(hs).view(np.uint16)).all()
    gw, gs = prefill_rs.swiglu_rows(words, scales)
    cw, cs = prefill_rs.swiglu_rows(hw, hs)
    assert (cp.asnumpy(gw) == cw).all() and (cp.asnumpy(gs).view(np.uint16) == cs.view(np.uint16)).all()


# ---- in the engine (prefill_gemm="rs", INT4's default) -------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "tiny-hd64"])
def test_engine_rs_prefill_matches_reference(model):
    """The engine's prefill on the RS form (RS copies made on the GPU at upload, SwiGLU in the
    gate_up epilogue), three chunks, against ReferenceModel.prefill (gpu_cases.check_prefill:
    pages shuffled, pool and buffers poisoned); then greedy tokens against the reference."""
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from .gpu_cases import check_prefill, greedy_agreement_of, prompt_ids

    f = NanoqwenFile.open(packed_synthetic(model, seed=0))
    refm = ReferenceModel(f.dims, f.model_tensors(), xp=cp)
    check_prefill(f, refm, 1100, seed=11, layers=(0, 1), max_tokens=1200, prefill_gemm="rs")
    rng = np.random.default_rng(3)
    a = greedy_agreement_of(f, [prompt_ids(rng, n) for n in (1, 17, 130)], 16, "graph", max_tokens=512,
                            prefill_gemm="rs")
    print(f"{model} rs:", a.summary())
    assert a.passes(), a.summary()
