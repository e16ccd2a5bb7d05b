"""tools/overlap_budget.py: issue 28's overlap model, on a hand-made timeline."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "overlap_budget.py"


def _tool():
    spec = importlib.util.spec_from_file_location("overlap_budget", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(chain_ns=10_000, chain_floor_ns=2_000, stream_floor_ns=20_000, layers=2, other_ns=5_000, tbps=4.0):
    k = {"qkv": {"count": layers, "exposed_ns": chain_ns * layers, "floor_ns": chain_floor_ns * layers},
         "attention": {"count": layers, "exposed_ns": 0, "floor_ns": 0},
         "o_proj": {"count": layers, "exposed_ns": 0, "floor_ns": 0},
         "gate_up": {"count": layers, "exposed_ns": 99_999, "floor_ns": stream_floor_ns * layers},
         "down": {"count": layers, "exposed_ns": 99_999, "floor_ns": 0},
         "lm_head": {"count": 1, "exposed_ns": other_ns, "floor_ns": other_ns}}
    return {"timeline": {"kinds": k, "total_ns": 1}, "read_ceiling_tbps": tbps, "floor_ms": 0.0}


def test_no_buffer_is_chain_plus_stream_at_the_ceiling():
    b = _tool().budget(_record(), {"none": 0.0})
    row = b["rows"][0]
    assert row["layer_us"] == pytest.approx(10 + 20)                    # chain, then 80 MB at 4 TB/s
    assert row["itl_ms"] == pytest.approx((2 * 30_000 + 5_000) / 1e6)


def test_staging_is_limited_by_the_buffer_and_by_the_chain():
    # spare bandwidth during the chain: 4 TB/s less 8 MB / 10 us = 3.2 TB/s -> 32 MB in 10 us
    b = _tool().budget(_record(), {"small": 16e6, "huge": 1e9})
    small, huge = b["rows"]
    assert small["staged_MB"] == pytest.approx(16) and small["layer_us"] == pytest.approx(10 + 16)
    assert huge["staged_MB"] == pytest.approx(32) and huge["layer_us"] == pytest.approx(10 + 12)


def test_the_chain_for_the_target_reaches_it():
    t = _tool()
    rec = _record()
    need = t.budget(rec, {"small": 16e6}, target_ms=0.05)["rows"][0]["chain_for_target_us"]
    again = t.budget(_record(chain_ns=need * 1e3), {"small": 16e6}, target_ms=0.05)["rows"][0]
    assert again["itl_ms"] == pytest.approx(0.05)
