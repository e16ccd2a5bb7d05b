"""measure.prefill_gemms on the CPU: what rates() launches for each kernel name (its
launchers and CuPy replaced by recorders over NumPy), the TFLOP/s it derives, per_layer's
sums and format_rates' table, each against a reference computed here on fresh random rows.
The timings themselves are the chapter's and the benchmark's, on the GPU."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from nanoqwen_lib import config
from nanoqwen_lib.format.layout import decode_gemv_shapes
from nanoqwen_lib.measure import prefill_gemms as pg


def _fake_cupy():
    cp = types.ModuleType("cupy")
    for name in ("zeros", "empty", "asarray", "matmul", "float16", "float32", "uint8"):
        setattr(cp, name, getattr(np, name))
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return cp


@pytest.fixture
def recorded(monkeypatch):
    """rates() on tiny's shapes with every launcher recording its call, and time_cuda
    answering a distinct time per launch: -> (rows, calls in order)."""
    ops_fp8 = pytest.importorskip("nanoqwen_lib.gpu.ops_fp8")
    ops_prefill = pytest.importorskip("nanoqwen_lib.gpu.ops_prefill")
    prefill_rs = pytest.importorskip("nanoqwen_lib.gpu.ops_prefill_rs")
    calls = []

    def recorder(fn):
        def launch(*args, **kw):
            calls.append((fn, args, kw))
        return launch
    for mod, fn in ((ops_prefill, "gemm_int4"), (ops_prefill, "gemm_int4_gate_up_swiglu"),
                    (ops_fp8, "gemm_fp8"), (ops_fp8, "quantize_rows_fp8"),
                    (prefill_rs, "gemm_int4_rs"), (prefill_rs, "gemm_int4_rs_swiglu")):
        monkeypatch.setattr(mod, fn, recorder(fn))
    cp = _fake_cupy()
    real_matmul = cp.matmul
    cp.matmul = lambda *a, **kw: (calls.append(("cublas", a, kw)), real_matmul(*a, **kw))[1]
    monkeypatch.setitem(sys.modules, "cupy", cp)
    timed = []

    def time_cuda(launch, warmup, iters, graph=False, inner=1):
        assert not graph and inner == 1, "rates() times eager launches unless asked for graphs"
        before = len(calls)
        launch()
        timed.append(calls[before:])
        return {"median": 0.01 * len(timed)}       # ms, distinct per launch
    monkeypatch.setattr(pg, "time_cuda", time_cuda)
    dims = config.load().model("tiny")          # the 7B's layer structure at small shapes
    rows = pg.rates(dims, 16, warmup=1, iters=1)
    return dims, rows, timed


def test_rates_launches_each_kernel_with_the_layers_epilogue(recorded):
    dims, rows, timed = recorded
    shapes = decode_gemv_shapes(dims)
    assert [(r["matrix"], r["kernel"]) for r in rows] == [(m, k) for m in shapes for k in pg.KERNELS]
    assert len(timed) == len(rows)
    rs_args, int4_args = {}, {}
    for r, launched in zip(rows, timed):
        assert len(launched) == 1, (r["matrix"], r["kernel"], launched)
        fn, args, kw = launched[0]
        m, kern = r["matrix"], r["kernel"]
        n, k = shapes[m]
        assert (r["n"], r["k"]) == (n, k)
        if kern == "cublas fp16":
            assert fn == "cublas" and args[0].shape == (16, k) and args[1].shape == (k, n)
            continue
        if kern == "mma":
            int4_args[m] = args
        if kern == "rs":                    # the RS copies, plan_rs's build for the shape at 132 SMs
            from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs
            rs_args[m] = args, kw
            build = prefill_rs.plan_rs(16, n, 132)
            assert {b: kw[b] for b in build} == build, (m, kw)
            x = args[0]
            assert x.shape == (16, k)
            if m == "gate_up":                                      # SwiGLU row order, act out
                assert fn == "gemm_int4_rs_swiglu" and args[3].shape == (16, n // 2)
                assert args[1].shape == (-(-(n // 2) // 32), k // 64, 4, 32, 4), args[1].shape
                assert args[2].shape == (-(-(n // 2) // 32), k // 128, 64), args[2].shape
            else:
                assert fn == "gemm_int4_rs" and args[3].shape == (16, n)
                assert args[1].shape == (-(-n // 64), k // 64, 4, 32, 4) and args[2].shape == (n, k // 128)
                assert kw["scales_rs"].shape == (-(-n // 64), k // 128, 64)
                assert (kw["bias"] is not None) == (m == "qkv"), (m, kern)
                assert (kw["residual"] is args[3]) if m in ("o_proj", "down") else kw["residual"] is None
            continue
        if kern == "wgmma" and m == "gate_up":                       # SwiGLU fused: act out
            assert fn == "gemm_int4_gate_up_swiglu" and args[3].shape == (16, n // 2)
            continue
        want_fn, want_kernel = ("gemm_fp8", kern[4:]) if kern.startswith("fp8 ") else ("gemm_int4", kern)
        assert fn == want_fn and kw["kernel"] == want_kernel, (m, kern, fn, kw)
        out = args[4] if fn == "gemm_fp8" else args[3]
        assert out.shape == (16, n)
        assert (kw["bias"] is not None) == (m == "qkv"), (m, kern)
        assert (kw["residual"] is out) if m in ("o_proj", "down") else kw["residual"] is None, (m, kern)
    for m, (args, kw) in rs_args.items():      # the RS copies hold the same weights as the others' words
        from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs
        x, words, scales = int4_args[m][:3]
        assert args[0] is x
        if m == "gate_up":
            words, scales = prefill_rs.swiglu_rows(words, scales)
            assert (args[1] == prefill_rs.rs_order(words)).all() and (args[2] == prefill_rs.rs_scales(scales)).all()
        else:
            assert args[2] is scales and (args[1] == prefill_rs.rs_order(words)).all()
            assert (kw["scales_rs"] == prefill_rs.rs_scales(scales)).all()
    for r, i in zip(rows, range(1, len(rows) + 1)):                 # TFLOP/s from the time answered
        assert r["ms"] == pytest.approx(0.01 * i)
        assert r["tflops"] == pytest.approx(2.0 * 16 * r["n"] * r["k"] / (r["ms"] * 1e-3) / 1e12, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_layer_and_table_against_the_rows(seed):
    rng = np.random.default_rng(seed)
    matrices, kernels = ["qkv", "o_proj", "gate_up", "down"], list(pg.KERNELS)
    rows = [{"matrix": m, "n": 8, "k": 128, "kernel": k, "ms": float(rng.uniform(0.01, 2.0)),
             "tflops": float(rng.uniform(1.0, 900.0))} for m in matrices for k in kernels]
    layer = pg.per_layer(rows)
    assert set(layer) == set(kernels)
    for k in kernels:
        assert layer[k] == pytest.approx(sum(r["ms"] for r in rows if r["kernel"] == k), rel=1e-12)
    lines = pg.format_rates(rows, 28).splitlines()
    assert len(lines) == 1 + len(matrices) + 2
    assert lines[0] == "matrix   " + "".join(f"{k:>13}" for k in kernels) + "   (TFLOP/s)"
    for line, m in zip(lines[1:], matrices):
        cells = line[9:]
        got = [float(cells[13 * j:13 * (j + 1)]) for j in range(len(kernels))]
        want = [round(next(r["tflops"] for r in rows if (r["matrix"], r["kernel"]) == (m, k))) for k in kernels]
        assert line[:9].strip() == m and got == want, (line, want)
    for line, scale, digits in ((lines[-2], 1, 3), (lines[-1], 28, 2)):
        got = [float(line[9 + 13 * j:9 + 13 * (j + 1)]) for j in range(len(kernels))]
        assert got == [round(layer[k] * scale, digits) for k in kernels], (line, layer)
