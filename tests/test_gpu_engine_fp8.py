"""The FP8 engine (engine_fp8.GpuBackendFp8) against the reference on the same FP8 file
(marked gpu). The `tiny` model through synth -> pack --weights fp8: the kernels' 7B shapes
are covered by tests/test_gpu_fp8.py; here the wiring is checked.

layer    one decode block against reference.decoder_layer_decode (fp16 activations)
prefill  K/V in the pages, the last logits and the first token against ReferenceModel.prefill,
         which rounds the four projections' inputs to FP8 per token as the kernels do
model    greedy tokens against the reference on CuPy; graph replay identical to eager
"""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.cuda_build import have_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def fp8_file():
    from nanoqwen_lib.synthetic import packed_synthetic
    from nanoqwen_lib.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic("tiny", weights="fp8"))


@pytest.fixture(scope="module")
def ref(fp8_file):
    import cupy as cp
    from nanoqwen_lib.reference import ReferenceModel
    return ReferenceModel(fp8_file.dims, fp8_file.model_tensors(), xp=cp)


def _prompt(rng, n):
    return rng.integers(0, 151643, n).tolist()


def _rel(a, b):
    import cupy as cp
    return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))


@pytest.mark.parametrize("layer", [0, 1])
def test_fp8_decode_layer_matches_reference(fp8_file, layer):
    import cupy as cp
    from nanoqwen_lib import reference as rf
    from nanoqwen_lib.engine import gpu_backend
    rng = np.random.default_rng(40 + layer)
    eng = gpu_backend(fp8_file, max_tokens=256)
    assert type(eng).__name__ == "GpuBackendFp8"
    eng.prefill(_prompt(rng, 21), physical_pages=rng.permutation(eng.pages))
    with eng.stream:
        eng.write_token(int(rng.integers(0, 151643)))
        eng.begin_step(new_page=eng.position % 16 == 0)
        eng.embed_step()
        for l in range(layer):
            eng.layer_step(l)
    eng.stream.synchronize()
    x_in = eng.arena["a.x"].copy()
    k_past, v_past = eng.cached_kv(layer, eng.position)
    for name in ("a.qkv", "a.attn", "a.gate_up", "a.act"):
        eng.arena[name].fill(cp.nan)
    cp.cuda.Device().synchronize()
    with eng.stream:
        eng.layer_step(layer)
    eng.stream.synchronize()
    got = eng.arena["a.x"].astype(cp.float32)
    k_new, v_new = [t[-1] for t in eng.cached_kv(layer, eng.position + 1)]
    w = rf.load_layer_weights(fp8_file.model_tensors(), layer, xp=cp)
    want, k_want, v_want = rf.decoder_layer_decode(x_in.astype(cp.float32), w, k_past.astype(cp.float32),
                                                   v_past.astype(cp.float32), fp8_file.dims)
    for name, a, b in (("x", got, want), ("k", k_new.astype(cp.float32), k_want), ("v", v_new.astype(cp.float32), v_want)):
        assert bool(cp.isfinite(a).all()), name
        err = cp.abs(a - b)
        bad = int((err > 2e-2 + 2e-2 * cp.abs(b)).sum())
        print(f"layer {layer} {name}: relative error {_rel(a, b):.2e}")
        assert bad == 0 and _rel(a, b) < 2e-3, f"{name}: {bad} elements off, relative {_rel(a, b):.2e}"


@pytest.mark.parametrize("n", [17, 600])
def test_fp8_prefill_matches_reference(fp8_file, ref, n):
    import cupy as cp
    from nanoqwen_lib.config import load
    from nanoqwen_lib.engine import gpu_backend
    from nanoqwen_lib.reference import argmax_and_gap
    rng = np.random.default_rng(n)
    prompt = _prompt(rng, n)
    eng = gpu_backend(fp8_file, max_tokens=1024, graphs=False)
    eng.kv.fill(cp.nan)
    for name in ("p.x", "p.y", "p.qkv", "p.q", "p.attn", "p.gate_up", "p.act", "p.ts", "a.logits"):
        eng.arena[name].fill(cp.nan)
    cp.cuda.Device().synchronize()
    first = eng.prefill(prompt, physical_pages=rng.permutation(eng.pages))
    logits, cache = ref.prefill(prompt)
    for layer in (0, 1):
        for name, got, want in zip("KV", eng.cached_kv(layer, n), cache.past(layer)):
            got = got.astype(cp.float32)
            assert bool(cp.isfinite(got).all()), f"layer {layer} {name}: unwritten slots"
            print(f"n={n} layer {layer} {name}: relative error {_rel(got, want):.2e}")
            assert _rel(got, want) < 1e-2
    rel = _rel(eng.arena["a.logits"], logits[-1])
    best, gap = argmax_and_gap(logits[-1])
    print(f"n={n}: logits relative error {rel:.2e}; first token {first} (reference {best}, gap {gap:.3f})")
    assert rel < 2e-2
    assert first == best or gap < load().validation.near_tie_logit_gap


def test_fp8_greedy_tokens_match_reference(fp8_file, ref):
    from nanoqwen_lib.engine import gpu_backend
    from nanoqwen_lib.validate import greedy_agreement
    rng = np.random.default_rng(9)
    prompts = [_prompt(rng, n) for n in (3, 16, 33)]
    a = greedy_agreement(gpu_backend(fp8_file, max_tokens=256), ref, prompts, 32)
    print("fp8 tiny:", a.summary())
    assert a.passes(), a.summary()


def test_fp8_graph_replay_identical_to_eager(fp8_file):
    from nanoqwen_lib.engine import gpu_backend
    rng = np.random.default_rng(16)
    prompt = _prompt(rng, 16)
    eng = gpu_backend(fp8_file, max_tokens=256)
    runs = {}
    for graphs in (False, True):
        eng.use_graphs = graphs
        ids = [eng.prefill(prompt)]
        for _ in range(63):
            ids.append(eng.decode(ids[-1]))
        runs[graphs] = ids
    assert runs[True] == runs[False]
