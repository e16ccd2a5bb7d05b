"""The FP8 engine (GpuBackend on an FP8 file: gpu.projection.Fp8Projections) against the reference on the same FP8 file
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

from nanoqwen_lib.gpu.cuda_build import have_gpu

from .gpu_cases import check_decode_layer, check_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def fp8_file():
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic("tiny", weights="fp8"))


@pytest.fixture(scope="module")
def ref(fp8_file):
    import cupy as cp
    from nanoqwen_lib.model.reference import ReferenceModel
    return ReferenceModel(fp8_file.dims, fp8_file.model_tensors(), xp=cp)


def _prompt(rng, n):
    return rng.integers(0, 151643, n).tolist()


@pytest.mark.parametrize("layer", [0, 1])
def test_fp8_decode_layer_matches_reference(fp8_file, layer):
    from nanoqwen_lib.gpu.engine import GpuBackend

    rng = np.random.default_rng(40 + layer)
    eng = GpuBackend(fp8_file, max_tokens=256)
    assert eng.encoding == "fp8" and type(eng.proj).__name__ == "Fp8Projections"
    eng.prefill(_prompt(rng, 21), physical_pages=rng.permutation(eng.pages))
    print(f"layer {layer}:", check_decode_layer(eng, fp8_file, layer, int(rng.integers(0, 151643))))


@pytest.mark.parametrize("n", [17, 600])
def test_fp8_prefill_matches_reference(fp8_file, ref, n):
    check_prefill(fp8_file, ref, n, seed=n, layers=(0, 1), max_tokens=1024)


def test_fp8_greedy_tokens_match_reference(fp8_file, ref):
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.measure.validate import greedy_agreement
    rng = np.random.default_rng(9)
    prompts = [_prompt(rng, n) for n in (3, 16, 33)]
    a = greedy_agreement(GpuBackend(fp8_file, max_tokens=256), ref, prompts, 32)
    print("fp8 tiny:", a.summary())
    assert a.passes(), a.summary()


def test_fp8_graph_replay_identical_to_eager(fp8_file):
    from nanoqwen_lib.gpu.engine import GpuBackend
    rng = np.random.default_rng(16)
    prompt = _prompt(rng, 16)
    eng = GpuBackend(fp8_file, max_tokens=256)
    runs = {}
    for graphs in (False, True):
        eng.use_graphs = graphs
        ids = [eng.prefill(prompt)]
        for _ in range(63):
            ids.append(eng.decode(ids[-1]))
        runs[graphs] = ids
    assert runs[True] == runs[False]
