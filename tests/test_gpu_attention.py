"""RoPE + append and paged attention on the GPU, against NumPy references; the buggy variant.

* rope_append_kv vs reference.rope_tables / apply_rope: q, k rotated, k and v in their slot,
  every other slot of the NaN-poisoned pool untouched.
* paged attention vs a float64 softmax(q.k/sqrt(d)) v with GQA, K/V at randomly permuted
  physical pages of a NaN-poisoned pool, output and split workspace poisoned before the
  launch, every element checked; contexts 1 .. 8300 on the 7B heads (28/4, d 128) and on
  head_dim 64 (14/2), several grid sizes (the ring wraps many times with max_splits = 1).
* kernels/lab/paged_attention_buggy.cu: right without a tail page (48), wrong on the tail page (49), run in
  a subprocess with a timeout in case it hangs; compute-sanitizer flags it and finds the
  fixed kernel clean (memcheck, racecheck, synccheck) when it is on PATH. Seen on an H200:
  wrong in every run with 64 splits, in none with 1 split (the race hides); no hang;
  racecheck flags it, synccheck does not (sm_90).
The first three tests check the test's own helpers on the CPU.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.model import kvcache, reference
from nanoqwen_lib.config import load
from nanoqwen_lib.gpu.ops_attention import rope_inv_freq
from nanoqwen_lib.model.kvcache import attention_ref_f64, attention_tolerance, random_paged_case

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "sanitize_attention.py"
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
        assert np.array_equal(np.cos(angle), cos) and np.array_equal(np.sin(angle), sin)


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


def sanitizer_path():
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


def flagged(out: str, rc: int) -> bool:
    return rc == 3 or bool(re.search(r"(ERROR|RACECHECK) SUMMARY: [1-9]", out)) or "Barrier error" in out


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
