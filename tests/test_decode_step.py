"""The engine's two decode steps behind one protocol (gpu.decode_step), on the CPU: each step
class has the protocol's members with its signatures, the engine takes its launch lists, its
layers and its reset from whatever step it holds (a recording stand-in here), refuses what is
not a step, and rebuilds its launch lists and graphs when the step changes. (The persistent
step itself needs a GPU: tests/test_gpu_engine.py runs both steps through the same tests.)"""
import inspect

import pytest

from nanoqwen_lib.gpu import layer
from nanoqwen_lib.gpu.decode_step import PERSISTENT_STEP, DecodeStep, KernelPerOpStep
from nanoqwen_lib.gpu.persistent import PersistentStep

from .stand_in import stand_in_engine

MEMBERS = ("launches", "layer_launches", "reset")


@pytest.mark.parametrize("cls", [KernelPerOpStep, PersistentStep])
def test_each_step_has_the_protocols_members(cls):
    for m in MEMBERS:
        want = inspect.signature(getattr(DecodeStep, m))
        got = inspect.signature(getattr(cls, m))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, m, got, want)
    assert cls.name in ("graph", "persistent")
    from nanoqwen_lib.gpu.engine import DECODE_MODES
    assert {KernelPerOpStep.name, PersistentStep.name} == set(DECODE_MODES)


class Recording:
    """A decode step that records what the engine asks of it."""
    name = "persistent"

    def __init__(self):
        self.calls = []

    def launches(self, new_page):
        self.calls.append(("launches", new_page))
        return [(PERSISTENT_STEP, lambda: self.calls.append(("step", new_page)))]

    def layer_launches(self, l):
        self.calls.append(("layer_launches", l))
        return [(PERSISTENT_STEP, lambda: self.calls.append(("layer", l)))]

    def reset(self):
        self.calls.append(("reset",))


def test_the_engine_asks_its_step_and_nothing_else():
    eng = stand_in_engine("tiny", 64)
    assert isinstance(eng.step, DecodeStep) and eng.decode_mode == "graph" and eng.pd is None
    assert [r for r, _ in eng.step_launches(True)] == [r.name for r in layer.step_regions(eng.dims)]
    rec = Recording()
    eng.step = rec
    assert eng.decode_mode == "persistent" and eng.pd is rec
    assert eng.step_launches(True)[0][0] == PERSISTENT_STEP and rec.calls == [("launches", True)]
    eng.layer_step(3)
    assert rec.calls[1:] == [("layer_launches", 3), ("layer", 3)]
    eng.enqueue_step(False)                      # built once per variant, then reused
    eng.enqueue_step(False)
    assert rec.calls[3:] == [("launches", False), ("step", False), ("step", False)]


def test_a_new_step_rebuilds_the_launch_lists_and_the_graphs(monkeypatch):
    eng = stand_in_engine("tiny", 64)
    first = Recording()
    eng.step = first
    eng.enqueue_step(False)
    captured = []
    eng.graphs = {}                               # the engine holds graphs: a new step is captured again
    monkeypatch.setattr(type(eng), "_capture", lambda self: captured.append(self.step))
    second = Recording()
    eng.step = second
    assert captured == [second]
    eng.enqueue_step(False)
    assert ("launches", False) in second.calls and first.calls.count(("launches", False)) == 1


def test_the_engine_refuses_what_is_not_a_step():
    eng = stand_in_engine("tiny", 64)
    with pytest.raises(TypeError, match="DecodeStep"):
        eng.step = object()
    with pytest.raises(TypeError, match="DecodeStep"):
        eng.pd = "persistent"
    assert eng.decode_mode == "graph"
