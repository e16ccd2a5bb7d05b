"""The ladder's layer and model rungs on the GPU (marked gpu; skipped without one), on both
decode steps: "graph" (a kernel per op, the baseline) and "persistent" (one kernel a token,
the default; what only it needs is in tests/test_gpu_persistent.py).

layer: one decoder block of the GPU engine against reference.decoder_layer_decode on the
       7B's shapes, given the same input and the same cached K/V (read back from the pages).
model: greedy tokens of the eager GPU engine against the reference on CuPy, on the 7B
       (a directly-written synthetic file) and on `tiny` (through synth -> pack).
"""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.gpu.cuda_build import have_gpu

from .gpu_cases import check_decode_layer, greedy_agreement_of, prompt_ids, check_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def file_7b():
    from nanoqwen_lib.synthetic.packed import packed_synthetic_direct
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic_direct("7b", seed=0), verify_payload=False)


DECODES = ("graph", "persistent")


@pytest.fixture(scope="module", params=DECODES)
def engine_7b(file_7b, request):
    from nanoqwen_lib.gpu.engine import GpuBackend
    return GpuBackend(file_7b, max_tokens=4096, decode=request.param)



@pytest.mark.parametrize("layer", [0, 27])
def test_decoder_layer_matches_reference_7b(file_7b, engine_7b, layer):
    rng = np.random.default_rng(100 + layer)
    eng = engine_7b                                   # the layer runs alone on the engine's decode step
    eng.prefill(prompt_ids(rng, 37), physical_pages=rng.permutation(eng.pages))   # 2 full pages + 5
    print(f"layer {layer}:", check_decode_layer(eng, file_7b, layer, int(rng.integers(0, 151643))))


@pytest.mark.parametrize("decode", DECODES)
def test_greedy_tokens_match_reference_7b(file_7b, decode):
    rng = np.random.default_rng(7)
    prompts = [prompt_ids(rng, n) for n in (1, 15, 16, 17, 49)]
    a = greedy_agreement_of(file_7b, prompts, 24, decode)
    print(f"7b {decode}:", a.summary())
    assert a.passes(), a.summary()


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("model", ["tiny", "tiny-hd64"])
def test_greedy_tokens_match_reference_tiny_pipeline(model, decode):
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(packed_synthetic(model, seed=0))
    rng = np.random.default_rng(8)
    prompts = [prompt_ids(rng, n) for n in (3, 16, 33)]
    a = greedy_agreement_of(f, prompts, 40, decode)
    print(f"{model} {decode}:", a.summary())
    assert a.passes(), a.summary()


@pytest.mark.parametrize("decode,prompt_len", [("graph", 15), ("graph", 16), ("graph", 17), ("persistent", 17)])
def test_graph_replay_identical_to_eager(file_7b, decode, prompt_len):
    """Prompts that end just before, on and just after a page boundary; 130 new tokens,
    so both graph variants (mid-page, new page) are replayed many times (they cross eight
    page boundaries from any prompt: one length for the persistent step)."""
    from nanoqwen_lib.gpu.engine import GpuBackend
    rng = np.random.default_rng(prompt_len)
    prompt = prompt_ids(rng, prompt_len)
    perm = rng.permutation(-(-600 // 16))
    runs = {}
    for graphs in (False, True):
        eng = GpuBackend(file_7b, max_tokens=600, graphs=graphs, decode=decode)
        first = eng.prefill(prompt, physical_pages=perm)
        ids = [first]
        for _ in range(129):
            ids.append(eng.decode(ids[-1]))
        assert (eng.graphs is not None) == graphs
        runs[graphs] = ids
        del eng
    assert runs[True] == runs[False]


@pytest.mark.parametrize("model", ["tiny", "tiny-hd64"])
def test_prefill_graph_replay_identical_to_eager(model):
    """The prefill's CUDA graphs (PrefillGraphs): a prompt of two chunks (512 + 88) prefilled
    four times on an engine that keeps graphs (eager, eager + capture, then two replays) leaves
    the same residual rows, the same K/V in every page and the same first token, bit for bit,
    as the always-eager engine; the residual rows are poisoned before each replay."""
    import cupy as cp
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    f = NanoqwenFile.open(packed_synthetic(model, seed=0))
    rng = np.random.default_rng(9)
    prompt = prompt_ids(rng, 600)
    perm = rng.permutation(-(-700 // 16))
    eager = GpuBackend(f, max_tokens=700, prefill_graphs=0)
    eager.kv.fill(0)                                        # pages the prompt leaves alone compare too
    first = eager.prefill(prompt, physical_pages=perm)
    want_x, want_kv = eager.arena["p.x"].get(), eager.kv.get()
    del eager
    eng = GpuBackend(f, max_tokens=700, prefill_graphs=4)
    for run in range(4):
        eng.arena["p.x"].fill(cp.float16(np.nan))          # poisoned: a replay must rewrite it
        eng.kv.fill(0)
        assert eng.prefill(prompt, physical_pages=perm) == first, f"run {run}"
        assert len(eng.prefill_graphs) == (0 if run == 0 else 2), f"run {run}: the two chunks' graphs"
        np.testing.assert_array_equal(eng.arena["p.x"].get(), want_x, err_msg=f"run {run}: p.x")
        np.testing.assert_array_equal(eng.kv.get(), want_kv, err_msg=f"run {run}: the pages")


# ---- the tensor-core prefill in the engine ------------------------------------------------
@pytest.fixture(scope="module")
def ref_7b(file_7b):
    import cupy as cp
    from nanoqwen_lib.model.reference import ReferenceModel
    return ReferenceModel(file_7b.dims, file_7b.model_tensors(), xp=cp)


@pytest.mark.parametrize("n,gemm", [(1, None), (17, None), (512, None), (600, None), (17, "wgmma"), (600, "wgmma")])
def test_prefill_matches_reference_7b(file_7b, ref_7b, n, gemm):
    """One chunk (1, 17, 512 tokens) and two chunks (600 = 512 + 88: the second attends to
    the first through the pages), on the default GEMMs (nanoqwen.yaml: the RS form) and on the
    producer-form wgmma kept beside them."""
    check_prefill(file_7b, ref_7b, n, seed=n, layers=(0, 27), max_tokens=1024, prefill_gemm=gemm)


def test_prefill_matches_reference_tiny_three_chunks():
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    import cupy as cp
    from nanoqwen_lib.model.reference import ReferenceModel
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0))
    refm = ReferenceModel(f.dims, f.model_tensors(), xp=cp)
    check_prefill(f, refm, 1100, seed=11, layers=(0, 1), max_tokens=1200)


def test_tensor_core_and_token_by_token_prefill_agree_7b(file_7b):
    """The engine's two prefills give the same first token (unless the top-2 logits are a
    near-tie) and K/V within FP16 rounding of each other; the greedy streams that follow on
    graphs are reported (after a near-tie they may part)."""
    import cupy as cp
    from nanoqwen_lib.config import load
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.model.reference import argmax_and_gap
    rng = np.random.default_rng(5)
    prompt = prompt_ids(rng, 77)
    runs = {}
    for mode in ("tensor-core", "token-by-token"):
        eng = GpuBackend(file_7b, max_tokens=256, prefill=mode, decode="graph")
        ids = [eng.prefill(prompt)]
        logits, kv = eng.arena["a.logits"].copy(), eng.cached_kv(27, len(prompt))
        for _ in range(31):
            ids.append(eng.decode(ids[-1]))
        runs[mode] = ids, logits, kv
        del eng
    (ids_a, la, kva), (ids_b, lb, kvb) = runs.values()
    for a, b in zip(kva, kvb):
        rel = float(cp.linalg.norm(a.astype(cp.float32) - b) / cp.linalg.norm(b.astype(cp.float32)))
        assert rel < 1e-2, f"layer 27 K/V of the two prefills: relative error {rel:.2e}"
    _, gap = argmax_and_gap(lb)
    same = sum(a == b for a, b in zip(ids_a, ids_b))
    print(f"tensor-core vs token-by-token prefill: {same}/32 tokens identical; top-2 gap {gap:.3f}")
    assert ids_a[0] == ids_b[0] or gap < load().validation.near_tie_logit_gap
