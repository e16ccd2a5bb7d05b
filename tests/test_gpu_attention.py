"""RoPE + append and paged attention on the GPU, against NumPy references.

* rope_append_kv vs reference.rope_tables / apply_rope: q, k rotated, k and v in their slot,
  every other slot of the NaN-poisoned pool untouched.
* paged attention vs a float64 softmax(q.k/sqrt(d)) v with GQA, K/V at randomly permuted
  physical pages of a NaN-poisoned pool, output and split workspace poisoned before the
  launch, every element checked; contexts 1 .. 8300 on the 7B heads (28/4, d 128) and on
  head_dim 64 (14/2), several grid sizes (the ring wraps many times with max_splits = 1).
(The lab's buggy variant, kernels/lab/paged_attention_buggy.cu, is tested in test_gpu_lab.py.)
The first three tests check the test's own helpers on the CPU.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.model import kvcache, reference
from nanoqwen_lib.config import load
from nanoqwen_lib.gpu.ops_attention import rope_inv_freq
from nanoqwen_lib.model.kvcache import attention_ref_f64, attention_tolerance, random_paged_case

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "sanitize_attention.py"   # test_gpu_lab.py runs it on the lab's buggy variant
CONFIGS = ("7b", "tiny-hd64")
CONTEXTS = (1, 15, 16, 17, 49, 512, 2000, 8300)
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not cuda_build.have_gpu(), reason="needs a CUDA GPU")


def report_mismatches(got, ref, tol, what, limit=5) -> str:
    bad = np.flatnonzero(~(np.abs(got - ref) <= tol))
    lines = [f"{what}: {bad.size} of {got.size} elements off"]
    lines += [f"  [{i}] got {got.flat[i]!r} expected {ref.flat[i]!r} (tol {np.broadcast_to(tol, ref.shape).flat[i]:.3g})"
              for i in bad[:limit]]
    return "\n".join(lines)


# ---------------------------------------------------------------- the helpers, on the CPU
def test_inv_freq_table_gives_the_references_angles():
    for name in CONFIGS:
        d = load().model(name)
        pos = np.array([0, 1, 17, 4095, 32767])
        cos, sin = reference.rope_tables(pos, d.head_dim, d.rope_theta)
        angle = pos.astype(np.float32)[:, None] * rope_inv_freq(d.head_dim, d.rope_theta)[None, :]
        # the angle in fp32 as the kernels form it; its cos and sin in float64, rounded once
        # (the reference's: the same bits whatever NumPy's SIMD path)
        a64 = angle.astype(np.float64)
        assert np.array_equal(np.cos(a64).astype(np.float32), cos) and np.array_equal(np.sin(a64).astype(np.float32), sin)


def test_f64_reference_agrees_with_the_model_reference():
    d = load().model("tiny-hd64")
    rng = np.random.default_rng(3)
    q, k, v, _, _ = random_paged_case(d, 37, rng, max_pages=3)
    ours = attention_ref_f64(q, k, v, d)
    theirs = reference.attention_decode(q.astype(np.float32).reshape(d.num_heads, d.head_dim),
                                        k.astype(np.float32), v.astype(np.float32), rnd=reference.keep_fp32)
    np.testing.assert_allclose(ours, theirs.reshape(-1), rtol=1e-5, atol=1e-6)


def test_random_paged_case_holds_the_tokens():
    d = load().model("7b")
    q, k, v, pool, table = random_paged_case(d, 49, np.random.default_rng(1), max_pages=8)
    kk, vv = kvcache.gather_kv(pool, 0, table.block_table, 49)
    assert np.array_equal(kk, k) and np.array_equal(vv, v)
    assert table.block_table[4:].tolist() == [-1] * 4 and np.isnan(pool).any()


# ---------------------------------------------------------------- RoPE + append
@gpu
@needs_gpu
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("position", [0, 1, 15, 16, 49, 4095, 32767])
def test_rope_append_matches_reference(name, position):
    import cupy as cp
    from nanoqwen_lib.gpu.ops_attention import kernels
    d = load().model(name)
    rng = np.random.default_rng(position)
    qkv = rng.standard_normal(d.qkv_dim).astype(np.float16)
    num_pages = 6
    pool = cp.full((1, 2, num_pages, d.num_kv_heads, 16, d.head_dim), np.nan, dtype=cp.float16)
    slot = int(rng.integers(0, num_pages * 16))
    q_out = cp.full(d.q_dim, np.nan, dtype=cp.float16)
    kernels(d).rope_append_kv(cp.asarray(qkv), cp.asarray([position], cp.int32), cp.asarray([slot], cp.int32),
                              pool[0, 0], pool[0, 1], q_out)
    cos, sin = reference.rope_tables(np.array([position]), d.head_dim, d.rope_theta)
    f32 = qkv.astype(np.float32)
    q = f32[:d.q_dim].reshape(1, d.num_heads, d.head_dim)
    k = f32[d.q_dim:d.q_dim + d.kv_dim].reshape(1, d.num_kv_heads, d.head_dim)
    q_ref = reference.apply_rope(q, cos, sin).astype(np.float16).astype(np.float32)[0]
    k_ref = reference.apply_rope(k, cos, sin).astype(np.float16).astype(np.float32)[0]
    host = cp.asnumpy(pool)
    got_q = cp.asnumpy(q_out).astype(np.float32).reshape(q_ref.shape)
    got_k = host[0, 0, slot // 16, :, slot % 16].astype(np.float32)
    got_v = host[0, 1, slot // 16, :, slot % 16]
    for got, ref, what in ((got_q, q_ref, "q"), (got_k, k_ref, "k")):
        tol = 2.0 ** -14 + np.abs(ref) * 2.0 ** -10          # one fp16 ulp: sincosf vs NumPy's cos/sin
        assert (np.abs(got - ref) <= tol).all(), report_mismatches(got, ref, tol, what)
        assert np.mean(got == ref) >= 0.98, f"{what}: only {np.mean(got == ref):.3f} bit-exact"
    assert np.array_equal(got_v.view(np.uint16), qkv[d.q_dim + d.kv_dim:].reshape(got_v.shape).view(np.uint16))
    assert np.isnan(host).sum() == host.size - 2 * d.kv_dim, "a slot other than `slot` was written"


# ---------------------------------------------------------------- paged attention
def run_attention(name, ctx, max_splits, seed, buggy=False):
    """One fresh case through the split + combine kernels -> (out float64, ref float64)."""
    import cupy as cp
    from nanoqwen_lib.gpu.ops_attention import AttentionWorkspace, kernels
    d = load().model(name)
    ws = AttentionWorkspace(d, max_context=ctx + 40, max_splits=max_splits)   # unmapped table tail: -1
    q, k, v, pool, table = random_paged_case(d, ctx, np.random.default_rng(seed), ws.max_pages)
    pool_d = cp.asarray(pool)
    out = cp.full(d.q_dim, np.nan, dtype=cp.float16)
    ws.poison()
    kernels(d, buggy).paged_attention(cp.asarray(q), pool_d[0, 0], pool_d[0, 1], cp.asarray(table.block_table),
                                      cp.asarray([ctx], cp.int32), out, ws)
    cp.cuda.runtime.deviceSynchronize()
    return cp.asnumpy(out).astype(np.float64), attention_ref_f64(q, k, v, d)


CASES = [(n, c, 64) for n in CONFIGS for c in CONTEXTS] + \
        [("7b", 49, 1), ("7b", 2000, 1), ("7b", 8300, 7), ("7b", 33, 3), ("tiny-hd64", 17, 2),
         ("tiny-hd64", 8300, 1), ("7b", 8300, 96), ("7b", 2000, 128), ("7b", 20000, 1024)]


@gpu
@needs_gpu
@pytest.mark.parametrize("name,ctx,max_splits", CASES)
def test_paged_attention_matches_f64_reference(name, ctx, max_splits):
    got, ref = run_attention(name, ctx, max_splits, seed=ctx * 131 + max_splits)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} outputs not written or NaN"
    tol = attention_tolerance(ref)
    assert (np.abs(got - ref) <= tol).all(), report_mismatches(got, ref, tol, f"{name} ctx {ctx}")


@gpu
@needs_gpu
def test_launcher_refuses_bad_buffers():
    import cupy as cp
    from nanoqwen_lib.gpu.ops_attention import AttentionWorkspace, kernels
    d = load().model("7b")
    ws = AttentionWorkspace(d, max_context=64, max_splits=4)
    pool = cp.zeros((1, 2, 4, d.num_kv_heads, 16, d.head_dim), cp.float16)
    ok = dict(q=cp.zeros(d.q_dim, cp.float16), k_cache=pool[0, 0], v_cache=pool[0, 1],
              block_table=cp.zeros(ws.max_pages, cp.int32), context_len=cp.ones(1, cp.int32),
              out=cp.zeros(d.q_dim, cp.float16))
    bad = {"q": cp.zeros(d.q_dim, cp.float32), "out": cp.zeros(d.q_dim + 1, cp.float16)[1:],
           "block_table": cp.zeros(ws.max_pages + 1, cp.int32), "k_cache": pool[0, 0, :, :, ::2]}
    for key, value in bad.items():
        with pytest.raises(AssertionError, match=key.split("_")[0]):
            kernels(d).paged_attention(**{**ok, key: value}, ws=ws)


# ---------------------------------------------------------------- compute-sanitizer (test_gpu_lab.py, chapter 6)
def sanitizer_path():
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


def flagged(out: str, rc: int) -> bool:
    return rc == 3 or bool(re.search(r"(ERROR|RACECHECK) SUMMARY: [1-9]", out)) or "Barrier error" in out
