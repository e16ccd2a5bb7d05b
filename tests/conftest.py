"""Fixtures shared by the tests (the repository's conftest.py handles GPU skips and nbval)."""
import gc
import sys

import numpy as np
import pytest


@pytest.fixture
def rng():
    """Fresh inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """After each test, the device memory its dropped engines held goes back to the driver
    (CuPy's pool would keep it): with `-n 4` several workers share one GPU, and a persistent
    7B engine holds two copies of its weights. Nothing happens without CuPy or without a GPU."""
    yield
    if "cupy" in sys.modules and _have_gpu():
        gc.collect()
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


_GPU = []


def _have_gpu() -> bool:
    if not _GPU:
        from nanoqwen_lib.gpu.cuda_build import have_gpu
        _GPU.append(have_gpu())
    return _GPU[0]


# ---- the cheap GPU loop: `pytest -m "gpu and quick"` --------------------------------------
# One test per kernel the engines run, at one shape each (the sweeps stay in the full suite).
QUICK = {
    "tests/test_gpu_gemv.py::test_gemv_int4_7b[qkv]": "nq_gemv_int4 (7B table entry)",
    "tests/test_gpu_gemv.py::test_gemv_int4_swiglu[130-384-1]": "nq_gemv_int4_swiglu (fallback tuning)",
    "tests/test_gpu_gemv.py::test_rmsnorm_rows[37]": "nq_rmsnorm",
    "tests/test_gpu_gemv.py::test_embed": "nq_embed",
    "tests/test_gpu_gemv.py::test_lm_head[1000-3584]": "nq_lm_head (+ its argmax)",
    "tests/test_gpu_gemv.py::test_argmax_ties_lowest[None-1000]": "nq_argmax",
    "tests/test_gpu_attention.py::test_rope_append_matches_reference[49-7b]": "rope_append_kv",
    "tests/test_gpu_attention.py::test_paged_attention_matches_f64_reference[7b-49-64]":
        "paged_attention_split + _combine",
    "tests/test_gpu_prefill.py::test_gemm_odd[plain-130-136-384]": "nq_prefill_gemm (both tile heights)",
    "tests/test_gpu_prefill.py::test_swiglu_fused_equals_unfused": "nq_swiglu_act, nq_prefill_gemm_swiglu",
    "tests/test_gpu_prefill.py::test_prefill_rope_write_kv[7b-17-0]": "nq_prefill_rope_write_kv",
    "tests/test_gpu_prefill.py::test_prefill_attention[7b-17-0]": "nq_prefill_attention",
    "tests/test_gpu_fp8.py::test_gemv_fp8[130x2432]": "nq_gemv_fp8",
    "tests/test_gpu_fp8.py::test_quantize_rows_bit_exact[37-3584]": "nq_quantize_rows_fp8",
    "tests/test_gpu_fp8.py::test_gemm_fp8[130-896-17-mma_sync]": "nq_gemm_fp8",
    "tests/test_gpu_engine.py::test_greedy_tokens_match_reference_tiny_pipeline[tiny-graph]":
        "nq_step_begin / nq_step_end and the INT4 engine's kernel-per-op decode step, end to end",
    "tests/test_gpu_engine.py::test_greedy_tokens_match_reference_tiny_pipeline[tiny-persistent]":
        "nq_decode_persistent (the default decode step), end to end",
}


@pytest.hookimpl(tryfirst=True)        # before -m / -k deselect anything
def pytest_collection_modifyitems(config, items):
    """Mark the QUICK tests, and refuse a QUICK id that its (collected) file does not hold."""
    by_id = {item.nodeid: item for item in items}
    for nodeid in QUICK:
        if nodeid in by_id:
            by_id[nodeid].add_marker(pytest.mark.quick)
    files = {item.nodeid.split("::")[0] for item in items}
    missing = [n for n in QUICK if n.split("::")[0] in files and n not in by_id]
    if missing and all("::" not in str(a) for a in config.args):   # whole files collected
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that do not exist: {missing}")
