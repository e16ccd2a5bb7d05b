"""tools/bench_persistent.py on the CPU: its variant sets parse into knob sets within their
ranges, and the probe stamps a build that runs qkv and attention (a run of [pd-skip] builds
once lost its JSON to a probe of a build that skips them)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from nanoqwen_lib.gpu import decode_knobs

_spec = importlib.util.spec_from_file_location("bench_persistent",
                                               Path(__file__).resolve().parents[1] / "tools" / "bench_persistent.py")
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)


@pytest.mark.parametrize("name", sorted(bp.SETS))
def test_every_set_parses_into_knobs_in_range(name):
    builds = bp.parse(bp.SETS[name])
    assert builds
    planned = set(decode_knobs.PLANNED)
    for b in builds:
        assert all(k in decode_knobs.BY_DEFINE or k in planned for k in b), b
        decode_knobs.check({k: v for k, v in b.items() if k in decode_knobs.BY_DEFINE}, "test")


def test_self_sets_use_the_chapter_build():
    self_build = bp.parse(bp.SELF_BUILD)[0]
    assert self_build == decode_knobs.LOADER_SELF
    assert self_build in bp.parse(bp.SELF) and self_build in bp.parse(bp.SELF_BOUNDS)


def test_probe_takes_the_fastest_build_that_decodes():
    rows = [{"variant": {}, "ms": 2.15}, {"variant": {"NQ_PD_SKIP": 62}, "ms": 0.49},
            {"variant": {"NQ_PD_QKV_TG": 132, "NQ_PD_QKV_KS": 1}, "ms": 2.11},
            {"variant": {"NQ_PD_LOADER": 4}, "error": "does not fit"}]
    assert bp.probe_build(rows) == {"NQ_PD_QKV_TG": 132, "NQ_PD_QKV_KS": 1}
    assert bp.probe_build([{"variant": {"NQ_PD_SKIP": 14}, "ms": 1.6}]) is None
    assert bp.probe_build([]) is None
