"""The engine's decode step, behind one protocol: the kernel-per-op step (this module's
KernelPerOpStep, the regions of gpu.layer) and the persistent step (gpu.persistent's
PersistentStep, one kernel a token) are interchangeable parts of one engine (gpu.engine).

A step says three things, and the engine asks nothing else of it:

    launches(new_page)   the whole token as (region, launch) pairs in order: what the eager
                         step enqueues, the CUDA graph captures and the ITL breakdown times
    layer_launches(l)    layer l alone on a.x (its K/V appended): the per-layer tests and
                         chapter 7's check run it after the shared bookkeeping and embedding
    reset()              its own device state back to a new sequence's (counters), on the
                         engine's current stream

and a `name`, the decode mode it is (nanoqwen.yaml engine.decode: "graph" or "persistent").
Both steps read token, position and pages from the arena's device scalars, so the engine's
host side (prefill, generate, the graphs, the error check) is the same code for both.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from nanoqwen_lib.gpu.layer import BOOKKEEPING, EMBED

Launch = tuple[str, Callable[[], None]]      # (region name, enqueue it on the current stream)
PERSISTENT_STEP = "persistent step"          # the one region of the persistent step


@runtime_checkable
class DecodeStep(Protocol):
    """What the engine needs of a decode step (the module's docstring says what each does)."""

    name: str

    def launches(self, new_page: bool) -> list[Launch]: ...

    def layer_launches(self, l: int) -> list[Launch]: ...

    def reset(self) -> None: ...


class KernelPerOpStep:
    """The decode step as a kernel per operation (chapters 4-9): the engine's bookkeeping and
    embedding, gpu.layer's regions for every layer, the final norm and lm_head with the argmax,
    the bookkeeping that moves the position. The kernels are the engine's own (the prefill's
    last row goes through the same head), so this step only orders them."""

    name = "graph"

    def __init__(self, eng):
        self.eng = eng

    def launches(self, new_page: bool) -> list[Launch]:
        e = self.eng
        out = [(BOOKKEEPING.name, lambda: e.begin_step(new_page)), (EMBED.name, e.embed_step)]
        for l in range(e.dims.num_layers):
            out += e.layer_launches(l)
        out += e.head_launches()
        out.append((BOOKKEEPING.name, e.end_step))
        return out

    def layer_launches(self, l: int) -> list[Launch]:
        return self.eng.layer_launches(l)

    def reset(self) -> None:
        """Nothing: the kernel-per-op step keeps no state between tokens beyond the arena's."""
