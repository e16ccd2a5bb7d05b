"""A GPU engine without a GPU, for CPU tests of its launch lists: the arena's slots are
NumPy views of one 128-byte-aligned host buffer that pass the launchers' device-buffer
checks (with `cupy` stood in by `stand_in_cupy`). Nothing is uploaded or launched."""
from __future__ import annotations

import types

import numpy as np

from nanoqwen_lib.gpu import ops_attention, ops_decode, ops_prefill
from nanoqwen_lib.config import load
from nanoqwen_lib.gpu.decode_step import KernelPerOpStep
from nanoqwen_lib.gpu.engine import GpuBackend, plan_arena
from nanoqwen_lib.gpu.projection import projections_for


class HostDeviceArray(np.ndarray):
    """A NumPy array standing in for a cupy.ndarray: `.data.ptr` is its real address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


stand_in_cupy = types.SimpleNamespace(ndarray=HostDeviceArray)


def stand_in_arena(plan) -> dict:
    raw = np.zeros(plan.nbytes + 256, np.uint8)
    base = (-raw.__array_interface__["data"][0]) % 128            # the arena starts 128-byte aligned
    views = {}
    for name, (off, dtype, shape) in plan.slots.items():
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        views[name] = raw[base + off: base + off + n].view(dtype).reshape(shape).view(HostDeviceArray)
    return views


def stand_in_engine(dims_name: str, max_tokens: int, encoding: str = "int4", prefill_gemm: str | None = None):
    """A GpuBackend for a file of this weight encoding, with only what its launch lists read
    (prefill_gemm: the engine's, default nanoqwen.yaml's)."""
    eng = object.__new__(GpuBackend)
    eng.dims, eng.encoding = load().model(dims_name), encoding
    gemm = prefill_gemm or load().engine.prefill_gemm[encoding]
    eng.arena = stand_in_arena(plan_arena(eng.dims, max_tokens, encoding, prefill_gemm=gemm))
    eng.proj = projections_for(encoding, gemm)(eng.arena, gemm)
    eng.chunk = eng.arena["p.x"].shape[0]
    eng.ops, eng.attn, eng.pf = ops_decode, ops_attention, ops_prefill
    eng.kv = eng.arena["kv"]
    eng.scalar = {}
    eng.step = KernelPerOpStep(eng)             # the kernel-per-op step (the persistent one needs a GPU)
    return eng
