"""One device allocation for everything: weights, KV pages, activations, scalars.

Planned first (name -> dtype, shape), then allocated once; every buffer starts on a
128-byte boundary. Nothing is allocated per token: the decode step only ever touches
views handed out here. The plan is plain data, so its size is known (and checked against
free device memory, with a clear message) before anything is uploaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError

ALIGN = load().format.alignment


@dataclass
class ArenaPlan:
    slots: dict = field(default_factory=dict)   # name -> (offset, dtype, shape)
    nbytes: int = 0

    def add(self, name: str, dtype, shape) -> None:
        assert name not in self.slots, name
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        off = (self.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.slots[name] = (off, dtype, shape)
        self.nbytes = off + int(np.prod(shape)) * dtype.itemsize

    def bytes_of(self, prefix: str = "") -> int:
        return sum(int(np.prod(s)) * d.itemsize for n, (_, d, s) in self.slots.items() if n.startswith(prefix))


class DeviceArena:
    """The allocation behind an ArenaPlan; `arena[name]` is a CuPy view."""

    def __init__(self, plan: ArenaPlan, source="device arena"):
        import cupy as cp
        free, total = cp.cuda.runtime.memGetInfo()
        if plan.nbytes > free:
            raise LimitError(source, "GPU memory", f"{plan.nbytes / 2**30:.2f} GiB free for the arena "
                             f"(weights {plan.bytes_of('w.') / 2**30:.2f} GiB, KV {plan.bytes_of('kv') / 2**30:.2f} GiB)",
                             f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB",
                             "lower --max-tokens or free the GPU")
        self.plan = plan
        self.mem = cp.cuda.alloc(plan.nbytes)
        assert self.mem.ptr % ALIGN == 0
        self.views = {}
        for name, (off, dtype, shape) in plan.slots.items():
            n = int(np.prod(shape))
            self.views[name] = cp.ndarray((n,), dtype=dtype, memptr=self.mem + off).reshape(shape)

    def __getitem__(self, name):
        return self.views[name]

    def upload(self, name: str, host: np.ndarray, row0: int = 0) -> None:
        """Copy a validated host array (e.g. an mmap view) into its slot, at row `row0`."""
        dst = self.views[name]
        host = np.ascontiguousarray(host)
        assert host.dtype == dst.dtype, (name, host.dtype, dst.dtype)
        rows = host.shape[0]
        assert host.shape[1:] == dst.shape[1:] and row0 + rows <= dst.shape[0], (name, host.shape, dst.shape)
        dst[row0:row0 + rows].set(host)
