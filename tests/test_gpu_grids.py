"""The persistent step at other grids than the H200's 132 CTAs (marked gpu): the grids a
114-SM H100 PCIe and smaller Hopper parts (or MIG slices, or $NANOQWEN_SMS) plan for, each
built alone and rebuilt one after the other on one live engine with its CUDA graphs; the
tokens equal the kernel-per-op step's up to near-ties (teacher-forced). Below the smallest
grid the plan accepts, the default decode is the kernel-per-op step, said in one line.
"""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.gpu.cuda_build import have_gpu

from .gpu_cases import forced_near_ties, prompt_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a Hopper GPU")]

GRIDS = (132, 114, 96, 78, 74)
STEPS = 40


@pytest.fixture(scope="module")
def file_7b():
    from nanoqwen_lib.synthetic.packed import packed_synthetic_direct
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic_direct("7b", seed=0), verify_payload=False)


@pytest.fixture(scope="module")
def graph_run(file_7b):
    """The kernel-per-op step's greedy tokens from one prompt on shuffled pages."""
    from nanoqwen_lib.gpu.engine import GpuBackend
    rng = np.random.default_rng(11)
    prompt, perm = prompt_ids(rng, 21), rng.permutation(-(-512 // 16))
    graph = GpuBackend(file_7b, max_tokens=512, decode="graph")
    ids = [graph.prefill(prompt, physical_pages=perm)]
    for _ in range(STEPS):
        ids.append(graph.decode(ids[-1]))
    del graph
    return prompt, perm, ids


def _forced_ties(eng, prompt, perm, ids) -> int:
    """Teacher-forced on the graph's tokens (graph replay: the engine's captured step)."""
    return forced_near_ties(eng, prompt, ids, perm, what=f"grid {eng.pd.grid}")


@pytest.mark.parametrize("grid", GRIDS)
def test_each_grid_alone(file_7b, graph_run, grid):
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.gpu.persistent import PersistentStep
    eng = GpuBackend(file_7b, max_tokens=512, decode="persistent", graphs=False)
    eng.pd = PersistentStep(eng, grid=grid)
    eng.capture_graphs()
    ties = _forced_ties(eng, *graph_run)
    print(f"grid {grid}: {STEPS} steps, {ties} near-ties")


def test_grids_rebuilt_on_one_engine(file_7b, graph_run):
    """One engine with its graphs captured; its step rebuilt at every grid in turn (the graphs
    are captured again for each, gpu.engine's pd setter), and back to the first."""
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.gpu.persistent import PersistentStep
    eng = GpuBackend(file_7b, max_tokens=512, decode="persistent")
    assert eng.graphs is not None
    for grid in GRIDS[1:] + GRIDS[:1]:
        eng.pd = PersistentStep(eng, grid=grid)
        ties = _forced_ties(eng, *graph_run)
        print(f"rebuilt at grid {grid}: {ties} near-ties")


def test_too_few_sms_fall_back_in_one_line(file_7b, monkeypatch, capfd):
    """$NANOQWEN_SMS=73: the plan cannot fit, so the default decode is the kernel-per-op step."""
    from nanoqwen_lib.gpu import hardware
    from nanoqwen_lib.gpu.engine import GpuBackend
    monkeypatch.setenv(hardware.ENV_SMS, "73")
    hardware.cache_clear()
    try:
        eng = GpuBackend(file_7b, max_tokens=64, graphs=False)
        assert eng.pd is None and eng.decode_mode == "graph"
        err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("nanoqwen:")]
        assert len(err) == 1 and "73 SMs" in err[0], err
        first = eng.prefill([1, 2, 3])
        eng.decode(first)
    finally:
        monkeypatch.delenv(hardware.ENV_SMS)
        hardware.cache_clear()


def test_a_grid_that_cannot_be_resident_is_refused(file_7b):
    """More CTAs than the occupancy API says fit at once: refused when the step is built."""
    from nanoqwen_lib.errors import LimitError
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.gpu.persistent import PersistentStep
    import cupy as cp
    eng = GpuBackend(file_7b, max_tokens=64, decode="persistent", graphs=False)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    with pytest.raises(LimitError, match="resident at once"):
        PersistentStep(eng, grid=4 * sms)
