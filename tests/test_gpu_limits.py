"""GPU-side limits (marked gpu): refused with what fits, before any GPU work is wasted."""
import numpy as np
import pytest

from nanoqwen_lib.gpu.cuda_build import have_gpu
from nanoqwen_lib.errors import LimitError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny_file():
    from nanoqwen_lib.synthetic.packed import packed_synthetic_direct
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic_direct("tiny"), verify_payload=False)


def test_arena_larger_than_the_gpu_is_refused_with_sizes(tiny_file):
    import cupy as cp
    from nanoqwen_lib.gpu.arena import DeviceArena
    from nanoqwen_lib.gpu.engine import plan_arena
    free, _ = cp.cuda.runtime.memGetInfo()
    plan = plan_arena(tiny_file.dims, 16)
    plan.add("too.big", np.uint8, (free + (1 << 30),))    # more than the device has free
    with pytest.raises(LimitError) as ei:
        DeviceArena(plan, source=tiny_file.path)
    assert "GPU memory" in str(ei.value) and "GiB free" in str(ei.value)


def test_sequence_beyond_the_kv_pool_refused_before_work(tiny_file):
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.model.generate import generate_ids
    eng = GpuBackend(tiny_file, max_tokens=64)
    with pytest.raises(LimitError) as ei:
        list(generate_ids(eng, [1] * 60, 10))
    assert "<= 64" in str(ei.value) and eng.position == 0     # nothing was enqueued
    assert len(list(generate_ids(eng, [1] * 54, 10))) == 10    # exactly what fits still runs
