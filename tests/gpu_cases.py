"""Shared by the GPU kernel tests: fp16 error units, the 7B GEMV shapes, random INT4 weights."""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.format.layout import decode_gemv_shapes

U16 = 2.0 ** -10        # one fp16 ulp at 1.0
# A decode step's logits may differ from the reference's by this many times what the
# reference itself does when its embedding rows move by one fp16 ulp (tests/sensitivity.py):
# the engine rounds at the same points but sums in other orders, so its activations differ by
# an ulp here and there at every op of every layer, not once at the input.
LOGIT_SENSITIVITY_FACTOR = 16
TINY16 = 2.0 ** -24     # the smallest fp16 subnormal
SHAPES_7B = decode_gemv_shapes(load().model("7b"))


def rand_int4(rng, n, k):
    """Random packed weights (every nibble, -8 too) and fp16 scales, on the host."""
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    return words, scales


def swiglu_input(rng, k):
    """A SwiGLU GEMV's input gate_up fp16 [2k], its act = fp16(silu(g) * u) (the kernels'
    FP32 expression) and, per element, how far the other fp16 neighbour of act may be: the
    kernel's expf may differ from NumPy's by an ulp or two of FP32, which can flip act's fp16
    rounding. -> (gate_up, act, alt)."""
    gu = (rng.standard_normal(2 * k) * 2).astype(np.float16)
    g32, u32 = gu[:k].astype(np.float32), gu[k:].astype(np.float32)
    a32 = g32 / (np.float32(1) + np.exp(-g32)) * u32
    act = a32.astype(np.float16)
    alt = np.maximum(np.abs((a32 * np.float32(1 - 2**-20)).astype(np.float16).astype(np.float64) - act),
                     np.abs((a32 * np.float32(1 + 2**-20)).astype(np.float16).astype(np.float64) - act))
    return gu, act, alt


def check_decode_layer(eng, nq_file, layer: int, token: int) -> dict:
    """One decode step of the engine (after a prefill) run up to `layer`, then `layer` alone
    with every activation buffer it writes poisoned, checked op by op against float64 given
    the same x, the same cached K/V (read back from the pages) and, for each op, the engine's
    own outputs of the ops before it where the engine keeps them (qkv, attn, gate_up, x,
    this token's K and V): tests/emulate.py layer_ops_check. Every element must lie in
    [RN16(v - w), RN16(v + w)], w the op's FP32 window (the GEMV's FP32 sums and fold, the
    norm, rope, softmax and SwiGLU arithmetic) plus what the inputs the engine does not keep
    (the norms' outputs, x after o_proj, act) may carry: half an fp16 ulp plus w, ~1-3 ulps
    on the 7B, where a dropped K slice of down is ~30 windows out (tests/test_emulate.py).
    Returns op -> (misses, elements, max |err| / (half ulp + w), share pinned to one value)."""
    import cupy as cp
    from nanoqwen_lib.model import reference as ref
    from .emulate import Matvec, layer_ops_check, layer_scales
    with eng.stream:
        eng.write_token(token)
        eng.begin_step(new_page=eng.position % 16 == 0)
        eng.embed_step()
        for l in range(layer):
            eng.layer_step(l)
    eng.stream.synchronize()
    x_in = eng.arena["a.x"].copy()
    k_past, v_past = eng.cached_kv(layer, eng.position)
    for name in ("a.y", "a.qkv", "a.q", "a.attn", "a.gate_up", "a.act"):   # a.act: the FP8 engine's
        if name in eng.arena.plan.slots:
            eng.arena[name].fill(cp.nan)
    cp.cuda.Device().synchronize()                              # default-stream writes done
    with eng.stream:
        eng.layer_step(layer)
    eng.stream.synchronize()
    k_new, v_new = [t[-1] for t in eng.cached_kv(layer, eng.position + 1)]
    got = {"qkv": eng.arena["a.qkv"], "attn": eng.arena["a.attn"], "gate_up": eng.arena["a.gate_up"],
           "x": eng.arena["a.x"], "k": k_new, "v": v_new}
    got = {k: cp.asnumpy(v) for k, v in got.items()}
    for name, a in got.items():
        assert np.isfinite(a).all(), f"layer {layer} {name}: {int((~np.isfinite(a)).sum())} elements unwritten (NaN)"
    tensors = nq_file.model_tensors()
    w = ref.load_layer_weights(tensors, layer, xp=cp)
    fp8 = nq_file.encoding == "fp8"
    return layer_ops_check(nq_file.dims, w, x_in, k_past, v_past, got, Matvec(w, xp=cp),
                           scales=None if fp8 else layer_scales(tensors, layer), encoding="fp8" if fp8 else "int4")


def check_prefill(nq_file, refm, n, seed, layers, max_tokens, prefill_gemm=None):
    """The tensor-core prefill of the engine for the file's encoding, on an n-token prompt
    (pages shuffled, the pool and the prefill buffers poisoned first), against
    ReferenceModel.prefill on CuPy: K and V of `layers` in the pages, the last position's
    logits, and the first generated token. prefill_gemm: the engine's (default nanoqwen.yaml's)."""
    import cupy as cp
    from nanoqwen_lib.config import load
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.model.reference import argmax_and_gap
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 151643, n).tolist()
    eng = GpuBackend(nq_file, max_tokens=max_tokens, graphs=False, decode="graph",   # INT4 or FP8, by the file
                     prefill_gemm=prefill_gemm)
    eng.kv.fill(cp.nan)
    for name in ("p.x", "p.y", "p.qkv", "p.q", "p.attn", "p.gate_up", "p.act", "p.ts", "a.logits"):
        if name in eng.arena.plan.slots:                            # p.ts: the FP8 engine's
            eng.arena[name].fill(cp.nan)
    cp.cuda.Device().synchronize()
    first = eng.prefill(prompt, physical_pages=rng.permutation(eng.pages))
    assert eng.position == n and int(eng.scalar["position"].get()[0]) == n
    logits, cache = refm.prefill(prompt)
    # Bounds: 1e-2 (K/V) and 2e-2 (logits); for FP8 past layer 0, twice the reference's own
    # change under one-ulp input noise (tests/sensitivity.py says why).
    k_bound = {layer: (1e-2, 1e-2) for layer in layers}
    logit_bound = 2e-2
    if nq_file.encoding == "fp8":
        from nanoqwen_lib.model.reference import ReferenceModel
        from .sensitivity import one_ulp_sensitivity
        sens, sens_logits = one_ulp_sensitivity(ReferenceModel, nq_file.dims, nq_file.model_tensors(), prompt,
                                                layers, cp, seed=seed)
        for layer in layers:
            if layer > 0:
                k_bound[layer] = tuple(max(1e-2, 2 * x) for x in sens[layer])
        logit_bound = max(logit_bound, 2 * sens_logits)
        print(f"n={n} FP8 one-ulp sensitivity of the reference: {sens}, logits {sens_logits:.2e}")
    for layer in layers:
        got_k, got_v = eng.cached_kv(layer, n)
        want_k, want_v = cache.past(layer)
        for name, a, b, bound in (("k", got_k, want_k, k_bound[layer][0]), ("v", got_v, want_v, k_bound[layer][1])):
            a = a.astype(cp.float32)
            assert bool(cp.isfinite(a).all()), f"layer {layer} {name}: unwritten (NaN) slots"
            rel = float(cp.linalg.norm(a - b) / cp.linalg.norm(b))
            print(f"n={n} layer {layer} {name}: relative error {rel:.2e} (bound {bound:.2e})")
            assert rel < bound, f"layer {layer} {name}: relative error {rel:.2e}, bound {bound:.2e}"
    got = eng.arena["a.logits"]
    want = logits[-1]
    assert bool(cp.isfinite(got).all())
    rel = float(cp.linalg.norm(got - want) / cp.linalg.norm(want))
    best, gap = argmax_and_gap(want)
    print(f"n={n} logits relative error {rel:.2e} (bound {logit_bound:.2e}); first token {first} "
          f"(reference {best}, top-2 gap {gap:.3f})")
    assert rel < logit_bound, f"logits relative error {rel:.2e}, bound {logit_bound:.2e}"
    assert first == best or gap < load().validation.near_tie_logit_gap, (first, best, gap)
    assert int(eng.arena["s.generated"][n - 1].get()) == first


def forced_near_ties(eng, prompt, ids, physical_pages=None, what="engine") -> int:
    """eng prefilled with prompt, then teacher-forced on another step's greedy tokens ids
    (ids[0] its first token): at every step eng picks ids[i + 1], or the two are a near-tie in
    eng's own logits (validation.near_tie_logit_gap). Returns the near-ties."""
    gap_max = load().validation.near_tie_logit_gap
    assert eng.prefill(prompt, physical_pages=physical_pages) == ids[0]
    ties = 0
    for i in range(len(ids) - 1):
        got = eng.force(ids[i])
        if got != ids[i + 1]:
            logits = eng.logits()
            gap = abs(float(logits[got]) - float(logits[ids[i + 1]]))
            assert gap < gap_max, f"{what}, step {i}: {got}, expected {ids[i + 1]}, logit gap {gap:.3f}"
            ties += 1
    return ties


def prompt_ids(rng, n, vocab=151643) -> list[int]:
    """n random ids of the BPE range (no special tokens)."""
    return rng.integers(0, vocab, n).tolist()


def greedy_agreement_of(nq_file, prompts, new_tokens, decode: str, max_tokens=4096, prefill_gemm=None):
    """validate.greedy_agreement of a fresh engine with the given decode step (and prefill GEMM,
    default nanoqwen.yaml's) against the reference on CuPy."""
    import cupy as cp
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.measure.validate import greedy_agreement
    gpu = GpuBackend(nq_file, max_tokens=max_tokens, decode=decode, prefill_gemm=prefill_gemm)
    refm = ReferenceModel(nq_file.dims, nq_file.model_tensors(), xp=cp)
    return greedy_agreement(gpu, refm, prompts, new_tokens)
