"""The kernel lab (kernels/lab/) on the GPU: every earlier or experimental version keeps a
correctness test against the same references as the engine's kernels (the helpers are those
of test_gpu_gemv.py, test_gpu_attention.py and test_gpu_fp8.py).

* GEMV v1 (guarded batches), v3 stream-K, v5 bulk-copy ring, the dp4a path: fresh random
  inputs, every element against the float64 reference (run_gemv's bound).
* The paged attention's original tail-page hand-off (paged_attention_buggy.cu): right
  without a tail page (48), wrong on the tail page (49), run in a subprocess with a timeout
  in case it hangs; compute-sanitizer flags it and finds the fixed kernel clean (memcheck,
  racecheck, synccheck) when it is on PATH. Seen on an H200: wrong in every run with 64
  splits, in none with 1 split (the race hides); no hang; racecheck flags it, synccheck
  does not (sm_90).
* The FP8 GEMM on wgmma: tests/test_gpu_fp8.py::test_gemm_fp8[...-wgmma] (one contract,
  one test, both kernels).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from nanoqwen_lib.gpu.lab import gemv as lab_gemv  # noqa: E402
from nanoqwen_lib.model.kvcache import attention_tolerance  # noqa: E402
from .gpu_cases import SHAPES_7B, rand_int4, swiglu_input  # noqa: E402
from .test_gpu_attention import ROOT, TOOL, flagged, gpu, needs_gpu, run_attention, sanitizer_path  # noqa: E402
from .test_gpu_gemv import ODD, check_close, dev, poisoned, ref_matvec, run_gemv  # noqa: E402

LAB_IMPLS = ["v1", "stream", "bulk"]


# ---------------------------------------------------------------- the GEMV versions
@pytest.mark.parametrize("impl", LAB_IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES_7B))
def test_lab_gemv_7b(rng, shape, impl):
    n, k = SHAPES_7B[shape]
    run_gemv(rng, n, k, bias=shape == "qkv", residual=shape in ("o_proj", "down"), impl=impl)


# stream: automatic grid, one CTA (every warp streams several tiles), 7 CTAs (many warps
# share each tile, some own nothing); bulk: split automatic, off, one group per slice, grids.
@pytest.mark.parametrize("n,k", ODD)
@pytest.mark.parametrize("impl,ksplit,ctas", [("v1", None, None), ("v1", "max", None),
                                              ("stream", None, None), ("stream", None, 1), ("stream", None, 7),
                                              ("bulk", None, None), ("bulk", 1, None), ("bulk", "max", None),
                                              ("bulk", None, 1), ("bulk", None, 7)])
def test_lab_gemv_odd(rng, n, k, impl, ksplit, ctas):
    s = k // 128 if ksplit == "max" else ksplit
    run_gemv(rng, n, k, bias=(n + k) % 2 == 0, residual=n % 2 == 1, ksplit=s, impl=impl, ctas=ctas)


@pytest.mark.parametrize("impl,tuning", [("v1", {}), ("v1", {"NQ_GEMV_FOLD": 1}),
                                         ("stream", {"NQ_GEMV_STREAM_WARPS": 8, "NQ_GEMV_STREAM_RING": 8}),
                                         ("stream", {"NQ_GEMV_STREAM_RING": 8}),
                                         ("stream", {"NQ_GEMV_FOLD": 1}),
                                         ("stream", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_STREAM_WARPS": 8,
                                                     "NQ_GEMV_STREAM_RING": 8}),
                                         ("bulk", {"NQ_GEMV_FOLD": 1}),
                                         ("bulk", {"NQ_BULK_STAGES": 2, "NQ_BULK_GROUPS": 16}),
                                         ("bulk", {"NQ_BULK_STAGES": 8, "NQ_BULK_GROUPS": 4}),
                                         ("bulk", {"NQ_BULK_STAGES": 3, "NQ_BULK_GROUPS": 5, "NQ_GEMV_FOLD": 1}),
                                         ("bulk", {"NQ_BULK_CONSUMER_WARPS": 8, "NQ_GEMV_FOLD": 1}),
                                         ("bulk", {"NQ_BULK_CONSUMER_WARPS": 8, "NQ_BULK_GROUPS": 5}),
                                         ("bulk", {"NQ_BULK_WAIT_NS": 10_000_000, "NQ_GEMV_FOLD": 1})])
@pytest.mark.parametrize("n,k,ksplit", [(3584, 3584, None), (130, 1152, 3), (1000, 18944, None)])
def test_lab_gemv_tuning_variants(rng, impl, tuning, n, k, ksplit):
    run_gemv(rng, n, k, bias=True, residual=True, ksplit=ksplit, tuning=tuning, impl=impl)


@pytest.mark.parametrize("impl,ksplit", [("v1", None), ("stream", None), ("bulk", None), ("bulk", 1)])
def test_lab_gemv_residual_in_place(rng, impl, ksplit):
    n = k = 3584
    words, scales = rand_int4(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    res = rng.standard_normal(n).astype(np.float16)
    io = dev(res)
    lab_gemv.gemv_int4(dev(x), dev(words), dev(scales), io, residual=io, ksplit=ksplit, impl=impl)
    dot, absdot = ref_matvec(words, scales, x.astype(np.float64))
    check_close(f"{impl} in-place residual", io.get(), dot + res.astype(np.float64), absdot, 2.0 ** -18)


@pytest.mark.parametrize("impl", LAB_IMPLS)
@pytest.mark.parametrize("n,k,ksplit", [(3584, 18944, None), (130, 384, 1), (7, 1152, 3), (1000, 1152, None)])
def test_lab_gemv_swiglu(rng, n, k, ksplit, impl):
    run_gemv(rng, n, k, bias=False, residual=True, ksplit=ksplit, launcher="swiglu", impl=impl)


@pytest.mark.parametrize("impl,tuning", [("stream", {"NQ_GEMV_FOLD": 1}), ("bulk", {"NQ_GEMV_FOLD": 1}),
                                         ("bulk", {"NQ_GEMV_FOLD": 1, "NQ_BULK_CONSUMER_WARPS": 8})])
@pytest.mark.parametrize("n,k,ksplit", [(3584, 18944, 5), (130, 1152, 1)])
def test_lab_gemv_swiglu_tuning_variants(rng, impl, tuning, n, k, ksplit):
    run_gemv(rng, n, k, bias=True, residual=True, ksplit=ksplit, launcher="swiglu", tuning=tuning, impl=impl)


def test_lab_gemv_refuses_an_unknown_version(rng):
    from nanoqwen_lib.errors import NanoqwenError
    words, scales = rand_int4(rng, 16, 128)
    with pytest.raises(NanoqwenError, match="impl"):
        lab_gemv.gemv_int4(dev(np.zeros(128, np.float16)), dev(words), dev(scales), poisoned(16), impl="v9")


# ---------------------------------------------------------------- the dp4a path
def ref_quantize(x):
    """x fp16 [K] -> (int8 [K] natural order, fp32 scales [K/128]), the kernel's rules."""
    xg = x.astype(np.float32).reshape(-1, 128)
    s = (np.abs(xg).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1))
    q = np.where(s[:, None] > 0, np.rint(xg / safe[:, None]), 0).astype(np.int8)
    return q.reshape(-1), s


DP4A_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])   # stored byte j of each run of 8 holds q[order[j]]


@pytest.mark.parametrize("impl", ["tiles", "stream"])   # no bulk dp4a kernel
@pytest.mark.parametrize("n,k", [SHAPES_7B[s] for s in SHAPES_7B] + [(7, 128), (130, 384), (1000, 1152)])
def test_gemv_int4_dp4a(rng, n, k, impl):
    words, scales = rand_int4(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    x[:128] = 0 if k > 128 else x[:128]                  # an all-zero group: scale 0
    x[-100] = np.float16(60000)                          # one large value in a group
    b, res = rng.standard_normal(n).astype(np.float16), rng.standard_normal(n).astype(np.float16)
    xq, xs = cp.zeros(k, cp.int8), cp.full(k // 128, np.nan, cp.float32)
    lab_gemv.quantize_act_int8(dev(x), xq, xs)
    q_ref, s_ref = ref_quantize(x)
    np.testing.assert_array_equal(xs.get(), s_ref)
    np.testing.assert_array_equal(xq.get().reshape(-1, 8), q_ref.reshape(-1, 8)[:, DP4A_ORDER])
    out = poisoned(n)
    lab_gemv.gemv_int4_dp4a(xq, xs, dev(words), dev(scales), out, bias=dev(b), residual=dev(res), impl=impl)
    xdq = (q_ref.astype(np.float64).reshape(-1, 128) * s_ref.astype(np.float64)[:, None]).reshape(-1)
    dot, absdot = ref_matvec(words, scales, xdq)        # its own exact reference: int8 activations
    ref = res.astype(np.float64) + (dot + b.astype(np.float64))
    check_close(f"dp4a N={n} K={k}", out.get(), ref, absdot, 2.0 ** -18)


# ---------------------------------------------------------------- the bug of the original runtime
@gpu
@needs_gpu
def test_buggy_variant_is_right_without_a_tail_page():
    """48 tokens = 3 whole pages: the buggy tail path is never taken."""
    got, ref = run_attention("7b", 48, 64, seed=48, buggy=True)
    assert (np.abs(got - ref) <= attention_tolerance(ref)).all()


def run_tool(variant, runs, splits, timeout):
    cmd = [sys.executable, str(TOOL), "--variant", variant, "--ctx", "49", "--runs", str(runs),
           "--max-splits", splits, "--json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None                                           # hang
    assert r.returncode == 0, r.stderr[-3000:]
    return {row["max_splits"]: row for row in map(json.loads, re.findall(r"^\{.*\}$", r.stdout, re.M))}


@gpu
@needs_gpu
def test_buggy_variant_is_wrong_on_the_tail_page():
    """Length 49, fresh inputs each run. With 64 splits the tail page is alone in its CTA and
    its consumers read the stage before the producer's stores land; with 1 split the tail
    page is the ring's first reuse of stage 0 (reported, not asserted: a race may hide)."""
    fixed = run_tool("fixed", 4, "64,1", timeout=60)
    buggy = run_tool("buggy", 8, "64,1", timeout=60)
    print("fixed:", fixed, "\nbuggy:", buggy if buggy is not None else "HANG (timeout)")
    assert fixed is not None and all(r["wrong_runs"] == 0 for r in fixed.values()), fixed
    if buggy is None:
        return                                                # a hang is the bug showing, too
    assert buggy[64]["wrong_runs"] >= 1, f"the buggy variant matched the reference in all runs: {buggy}"


@gpu
@needs_gpu
def test_compute_sanitizer_flags_the_bug_and_passes_the_fix(tmp_path):
    cs = sanitizer_path()
    if cs is None:
        pytest.skip("compute-sanitizer is not on PATH")
    runs = [("fixed", "memcheck"), ("fixed", "racecheck"), ("fixed", "synccheck"),
            ("buggy", "racecheck"), ("buggy", "synccheck")]
    procs = {key: subprocess.Popen([cs, "--tool", key[1], "--error-exitcode", "3", sys.executable, str(TOOL),
                                    "--variant", key[0], "--max-splits", "64"], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for key in runs}
    results = {}
    for key, p in procs.items():
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n<timeout>"
        results[key] = (out, p.returncode)
    log_dir = Path(os.environ.get("NQ_SANITIZER_LOGS", tmp_path))
    with open(log_dir / "sanitizer.log", "w") as f:
        for (variant, tool), (out, rc) in results.items():
            f.write(f"===== {variant} {tool} rc={rc} flagged={flagged(out, rc)}\n{out}\n")
    for tool in ("memcheck", "racecheck", "synccheck"):
        out, rc = results[("fixed", tool)]
        assert rc == 0 and not flagged(out, rc) and "SUMMARY: 0" in out, f"fixed, {tool}:\n{out[-3000:]}"
    assert any(flagged(*results[("buggy", t)]) for t in ("racecheck", "synccheck")), \
        "neither racecheck nor synccheck flagged the buggy variant"


# ---------------------------------------------------------------- layout 3: the streaming GEMV
# kernels/lab/gemv_stream3.cu over format/stream_layout.py's layout, with run_gemv's checks:
# fresh random inputs, NaN-poisoned output, every element against the float64 reference of the
# layout-1 weights it was repacked from, the same bound (plus the FOLD allowance where folded).
from nanoqwen_lib.format import stream_layout  # noqa: E402
from nanoqwen_lib.format.layout import decode_gemv_shapes  # noqa: E402
from nanoqwen_lib.config import load as load_config  # noqa: E402
from .test_gpu_gemv import FOLD_ACC, fold_magnitude  # noqa: E402

SHAPES_TINY = decode_gemv_shapes(load_config().model("tiny"))
S3_EPILOGUE = {"qkv": dict(bias=True), "o_proj": dict(residual=True, in_place=True), "gate_up": {},
               "down": dict(residual=True, launcher="swiglu")}
S3_TUNINGS = [{}, {"NQ_S3_FOLD": 1}]


def run_s3(rng, n, k, bias=False, residual=False, in_place=False, ksplit=None, tuning=None, launcher="plain"):
    words, scales = rand_int4(rng, n, k)
    w3 = dev(stream_layout.to_stream(words, scales))
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    res = rng.standard_normal(n).astype(np.float16) if residual else None
    out = dev(res) if in_place else poisoned(n)
    res_d = out if in_place else (None if res is None else dev(res))
    b_d = None if b is None else dev(b)
    extra = 0.0
    if launcher == "swiglu":
        gu, act, alt = swiglu_input(rng, k)
        x64 = act.astype(np.float64)
        s = lab_gemv.gemv_int4_s3_swiglu(dev(gu), w3, out, residual=res_d, bias=b_d, ksplit=ksplit, tuning=tuning)
        extra = ref_matvec(words, scales, alt)[1] if alt.any() else 0.0
    else:
        x = rng.standard_normal(k).astype(np.float16)
        x64 = x.astype(np.float64)
        s = lab_gemv.gemv_int4_s3(dev(x), w3, out, bias=b_d, residual=res_d, ksplit=ksplit, tuning=tuning)
    dot, absdot = ref_matvec(words, scales, x64)
    if (tuning or {}).get("NQ_S3_FOLD"):
        extra = extra + FOLD_ACC * fold_magnitude(scales, x64)
    ref = dot + (0 if b is None else b.astype(np.float64))
    ref = ref + (0 if res is None else res.astype(np.float64))
    return check_close(f"s3 {launcher} N={n} K={k} ksplit={s} {tuning or ''} in_place={in_place}", out.get(), ref,
                       absdot, 2.0 ** -18, extra)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tuning", S3_TUNINGS, ids=["exact", "fold"])
@pytest.mark.parametrize("model,shape", [("7b", s) for s in SHAPES_7B] + [("tiny", s) for s in SHAPES_TINY])
def test_s3_model_shapes(rng, model, shape, tuning):
    """Every 7B and tiny decode GEMV with its engine epilogue: qkv + bias, o_proj + residual in
    place, gate_up, down from the fused SwiGLU + residual (and down plain, + bias + residual)."""
    n, k = (SHAPES_7B if model == "7b" else SHAPES_TINY)[shape]
    run_s3(rng, n, k, tuning=tuning, **S3_EPILOGUE[shape])
    if shape == "down":
        run_s3(rng, n, k, bias=True, residual=True, tuning=tuning)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,k", ODD)
@pytest.mark.parametrize("ksplit", [None, 1, "max"])
def test_s3_odd(rng, n, k, ksplit):
    s = k // 128 if ksplit == "max" else ksplit
    run_s3(rng, n, k, bias=(n + k) % 2 == 0, residual=n % 2 == 1, ksplit=s)
    run_s3(rng, n, k, bias=True, residual=True, ksplit=s, launcher="swiglu")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tuning", [{"NQ_S3_WARPS": 8, "NQ_S3_MIN_CTAS": 3},
                                    {"NQ_S3_WARPS": 8, "NQ_S3_MIN_CTAS": 3, "NQ_S3_FOLD": 1},
                                    {"NQ_S3_RING": 2}, {"NQ_S3_RING": 8, "NQ_S3_MIN_CTAS": 2},
                                    {"NQ_S3_RING": 8, "NQ_S3_MIN_CTAS": 2, "NQ_S3_FOLD": 1}, {"NQ_S3_MIN_CTAS": 6}])
@pytest.mark.parametrize("n,k,ksplit", [(3584, 18944, None), (130, 1152, 3), (1000, 18944, 1)])
def test_s3_tuning_variants(rng, tuning, n, k, ksplit):
    run_s3(rng, n, k, bias=True, residual=True, ksplit=ksplit, tuning=tuning)
    run_s3(rng, n, k, residual=True, in_place=True, ksplit=ksplit, tuning=tuning, launcher="swiglu")


@pytest.mark.timeout(120)
def test_s3_refuses_bad_buffers():
    from nanoqwen_lib.errors import NanoqwenError
    x, out = cp.zeros(256, cp.float16), cp.zeros(20, cp.float16)
    good = cp.zeros(stream_layout.stream_bytes(20, 256), cp.uint8)
    with pytest.raises(NanoqwenError, match=r"w3.shape: expected \(4224,\)"):
        lab_gemv.gemv_int4_s3(x, good[:4096], out)
    with pytest.raises(NanoqwenError, match="w3.dtype"):
        lab_gemv.gemv_int4_s3(x, good.view(cp.int8), out)
    with pytest.raises(NanoqwenError, match="x.size"):
        lab_gemv.gemv_int4_s3(cp.zeros(200, cp.float16), good, out)
    with pytest.raises(NanoqwenError, match="ksplit"):
        lab_gemv.gemv_int4_s3(x, good, out, ksplit=3)
    with pytest.raises(NanoqwenError, match="out"):
        lab_gemv.gemv_int4_s3(x, good, x)
