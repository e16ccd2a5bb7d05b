"""The persistent decode step on the GPU (marked gpu; skipped without one): the ladder the
kernel-per-op graph passes, on the one-kernel step.

layer   one decoder block run by the persistent kernel alone (layers [l, l+1)) against
        reference.decoder_layer_decode, pages shuffled (gpu_cases.check_decode_layer)
model   greedy tokens against the reference on the 7B, tiny (synth -> pack) and tiny-hd64
graph   the persistent step's tokens equal the kernel-per-op graph's up to near-ties
        (teacher-forced on the graph's tokens); its own eager launches and graph replays
        are identical (the kernel is deterministic: fixed reduction orders)
hang    a launch whose CTAs cannot all be resident ends with the timeout error instead of
        hanging the device (every wait has NQ_PD_TIMEOUT_MS)
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from nanoqwen_lib.gpu.cuda_build import have_gpu

from .gpu_cases import check_decode_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def file_7b():
    from nanoqwen_lib.synthetic.packed import packed_synthetic_direct
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic_direct("7b", seed=0), verify_payload=False)


@pytest.fixture(scope="module")
def engine_7b(file_7b):
    from nanoqwen_lib.gpu.engine import GpuBackend
    return GpuBackend(file_7b, max_tokens=4096, decode="persistent")


def _prompt(rng, n, vocab=151643):
    return rng.integers(0, vocab, n).tolist()


def test_layout3_copies_match_the_layout1_weights(file_7b, engine_7b):
    """The engine's repacked copies (GPU to_stream) read back as the file's words and scales."""
    from nanoqwen_lib.format.stream_layout import from_stream
    from nanoqwen_lib.format.layout import decode_gemv_shapes
    a = engine_7b.arena
    for l in (0, 27):
        for m, (n, k) in decode_gemv_shapes(file_7b.dims).items():
            qw, sc = from_stream(a[f"w.{l}.{m}.s3"].get(), n, k)
            assert np.array_equal(qw, a[f"w.{l}.{m}.qweight"].get()), (l, m)
            assert np.array_equal(sc.view(np.uint16), a[f"w.{l}.{m}.scales"].get().view(np.uint16)), (l, m)


def test_a_layout3_file_is_uploaded_as_stored():
    """tiny packed in layout 3 (`pack --layout stream`): the engine takes the file's streams
    as they are; they equal the GPU repack of the same weights packed in layout 1, and the
    two engines generate the same tokens."""
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    runs, arenas = {}, {}
    for layout in ("split", "stream"):
        f = NanoqwenFile.open(packed_synthetic("tiny", seed=0, layout=layout))
        eng = GpuBackend(f, max_tokens=256, decode="persistent")
        ids = [eng.prefill([5, 6, 7, 8, 9])]
        for _ in range(20):
            ids.append(eng.decode(ids[-1]))
        runs[layout] = ids
        arenas[layout] = {m: eng.arena[f"w.1.{m}.s3"].get() for m in ("qkv", "gate_up", "down")}
        del eng
    for m in arenas["split"]:
        assert np.array_equal(arenas["split"][m], arenas["stream"][m]), m
    assert runs["split"] == runs["stream"]


@pytest.mark.parametrize("layer", [0, 27])
def test_persistent_layer_matches_reference_7b(file_7b, engine_7b, layer):
    rng = np.random.default_rng(200 + layer)
    eng = engine_7b
    eng.prefill(_prompt(rng, 37), physical_pages=rng.permutation(eng.pages))   # 2 full pages + 5
    print(f"layer {layer}:", check_decode_layer(eng, file_7b, layer, int(rng.integers(0, 151643))))


def _agreement(nq_file, prompts, new_tokens, max_tokens=4096):
    import cupy as cp
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.measure.validate import greedy_agreement
    gpu = GpuBackend(nq_file, max_tokens=max_tokens, decode="persistent")
    refm = ReferenceModel(nq_file.dims, nq_file.model_tensors(), xp=cp)
    return greedy_agreement(gpu, refm, prompts, new_tokens)


def test_persistent_greedy_tokens_match_reference_7b(file_7b):
    rng = np.random.default_rng(17)
    prompts = [_prompt(rng, n) for n in (1, 15, 16, 17, 49)]
    a = _agreement(file_7b, prompts, 24)
    print("7b:", a.summary())
    assert a.passes(), a.summary()


@pytest.mark.parametrize("model", ["tiny", "tiny-hd64"])
def test_persistent_greedy_tokens_match_reference_tiny(model):
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(packed_synthetic(model, seed=0))
    rng = np.random.default_rng(18)
    prompts = [_prompt(rng, n) for n in (3, 16, 33)]
    a = _agreement(f, prompts, 40)
    print(f"{model}:", a.summary())
    assert a.passes(), a.summary()


def test_persistent_equals_graph_up_to_near_ties_7b(file_7b):
    """130 tokens of the kernel-per-op graph from one prompt; the persistent engine, forced
    with the same tokens, picks the graph's next token at every step, or the two are a
    near-tie in its own logits (validation.near_tie_logit_gap)."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.gpu.engine import GpuBackend
    gap_max = load().validation.near_tie_logit_gap
    rng = np.random.default_rng(5)
    prompt, perm = _prompt(rng, 17), rng.permutation(-(-600 // 16))
    graph = GpuBackend(file_7b, max_tokens=600, decode="graph")
    ids = [graph.prefill(prompt, physical_pages=perm)]
    for _ in range(129):
        ids.append(graph.decode(ids[-1]))
    del graph
    pers = GpuBackend(file_7b, max_tokens=600, decode="persistent")
    assert pers.prefill(prompt, physical_pages=perm) == ids[0]
    ties = 0
    for i in range(129):
        got = pers.force(ids[i])
        if got != ids[i + 1]:
            logits = pers.logits()
            gap = abs(float(logits[got]) - float(logits[ids[i + 1]]))
            assert gap < gap_max, f"step {i}: persistent {got}, graph {ids[i + 1]}, logit gap {gap:.3f}"
            ties += 1
    print(f"persistent vs graph: 129 steps, {ties} near-ties")


@pytest.mark.parametrize("prompt_len", [17])
def test_persistent_replay_identical_to_eager(file_7b, prompt_len):
    """130 tokens after a 17-token prompt cross eight page boundaries: both graph variants
    (mid-page, new page) are replayed many times."""
    from nanoqwen_lib.gpu.engine import GpuBackend
    rng = np.random.default_rng(prompt_len)
    prompt = _prompt(rng, prompt_len)
    perm = rng.permutation(-(-600 // 16))
    runs = {}
    for graphs in (False, True):
        eng = GpuBackend(file_7b, max_tokens=600, graphs=graphs, decode="persistent")
        ids = [eng.prefill(prompt, physical_pages=perm)]
        for _ in range(129):
            ids.append(eng.decode(ids[-1]))
        runs[graphs] = ids
        del eng
    assert runs[True] == runs[False]


def test_timeline_build_records_every_instruction():
    """The diagnostic build: every CTA writes one row per instruction, in program order."""
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.gpu.persistent import instructions
    from nanoqwen_lib.measure.timeline import KINDS, timeline_token
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0))
    eng = GpuBackend(f, max_tokens=256, decode="persistent")
    out = timeline_token(eng, list(range(100, 140)), steps=3, keep_events=True)
    ev = out["events"]
    assert len(ev) == eng.pd.grid * instructions(f.dims.num_layers)
    assert set(np.unique(ev["kind"])) == set(range(len(KINDS)))
    s = out["summary"]
    assert s["kinds"]["qkv"]["count"] == f.dims.num_layers
    assert s["total_ns"] > 0


def test_unresident_grid_times_out_instead_of_hanging():
    """Four CTAs per SM cannot all be resident (one fills an SM's registers): the resident
    ones wait for the rest, time out, and the launch ends with error 3, which the engine
    raises; the counters are reset and the engine decodes again."""
    import cupy as cp
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.errors import LimitError
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0))
    eng = GpuBackend(f, max_tokens=256, decode="persistent", graphs=False)
    first = eng.prefill([1, 2, 3])
    pd = eng.pd
    t0 = time.monotonic()
    with eng.stream:
        pd.kernel((4 * pd.grid,), (pd.threads,),
                  (pd.tab, np.int32(0), np.int32(f.dims.num_layers), np.int32(f.dims.num_layers), np.int32(3),
                   np.int32(0), np.float32(f.dims.rms_eps)), shared_mem=pd.smem)
    eng.stream.synchronize()
    took = time.monotonic() - t0
    assert int(eng.scalar["error"].get()[0]) == 3
    with pytest.raises(LimitError, match="timed out"):
        eng.token_at(eng.position)
    print(f"timed out in {took:.1f} s")
    # a fresh sequence works again
    eng.scalar["error"].fill(0)
    cp.cuda.Device().synchronize()
    assert eng.prefill([1, 2, 3]) == first
    eng.decode(first)
