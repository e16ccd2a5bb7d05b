"""measure.decomposition (chapter 10's schedule / streams / chains of two kernels, one run): the
record is built from bench_persistent's JSON row by row, each row in exactly one build, and the
reader's parts add up as chapter 10 says; a row of no build, a repeated row, a missing row or a
missing floor is refused by name."""
import json

import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.measure import decomposition as dec
from nanoqwen_lib.measure.bench import RECORD_KINDS

LOADER = {"NQ_PD_WARPS": 15, "NQ_PD_LOADER": 5}
SKIPS = {0: {}, 4: {"NQ_PD_SKIP": 4}, 14: {"NQ_PD_SKIP": 14, "NQ_PD_QKV_PREFETCH": 0}, 48: {"NQ_PD_SKIP": 48},
         62: {"NQ_PD_SKIP": 62}}


def _raw(ms: dict) -> dict:
    rows = []
    for build, knobs in (("default", {}), ("loader", LOADER)):
        for skip, extra in SKIPS.items():
            rows.append({"variant": {**knobs, **{k: str(v) for k, v in extra.items()}}, "ms": ms[build][skip],
                         "exposed_ms": {k: 0.1 for k in RECORD_KINDS + ("begin",)}})
    kinds = {k: {"floor_ns": 1e5 * (i + 1), "count": 28} for i, k in enumerate(RECORD_KINDS)}
    return {"steps": 64, "rows": rows, "timeline": {"kinds": kinds}}


MS = {"default": {0: 2.15, 4: 1.95, 14: 1.65, 48: 1.01, 62: 0.49},
      "loader": {0: 2.17, 4: 1.94, 14: 1.63, 48: 0.99, 62: 0.49}}


def test_the_parts_add_up_as_the_chapter_reads_them(tmp_path):
    rec = dec.bounds_record(_raw(MS), {"default": {}, "loader warp": LOADER}, "GPU", "abc1234")
    assert rec["floor_ms"]["qkv"] == pytest.approx(0.1) and rec["steps"] == 64
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rec))
    d = dec.persistent_decomposition(path)
    for name, src in (("default", "default"), ("loader warp", "loader")):
        b, m = d["builds"][name], MS[src]
        assert b["schedule"] == m[62] and b["whole"] == m[0] and b["no_attention"] == m[4]
        assert b["streams"] == pytest.approx(m[14] - m[62]) and b["chains"] == pytest.approx(m[48] - m[62])
        assert b["parts"] == pytest.approx(m[14] + m[48] - m[62])
    assert d["gpu"] == "GPU" and d["commit"] == "abc1234"


def test_a_row_of_no_build_or_twice_is_refused():
    raw = _raw(MS)
    raw["rows"].append({"variant": {"NQ_PD_WARPS": 14}, "ms": 1.0, "exposed_ms": {}})
    with pytest.raises(ValueError, match="no build"):
        dec.bounds_record(raw, {"default": {}, "loader warp": LOADER}, "GPU", "c")
    raw = _raw(MS)
    raw["rows"].append(dict(raw["rows"][0]))
    with pytest.raises(ValueError, match="two rows 'baseline'"):
        dec.bounds_record(raw, {"default": {}, "loader warp": LOADER}, "GPU", "c")


def test_a_missing_row_or_floor_is_refused_by_name(tmp_path):
    rec = dec.bounds_record(_raw(MS), {"default": {}, "loader warp": LOADER}, "GPU", "c")
    del rec["builds"]["loader warp"]["rows"]["the chains alone"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rec))
    with pytest.raises(NanoqwenError, match="builds.loader warp.rows"):
        dec.persistent_decomposition(path)
    rec = dec.bounds_record(_raw(MS), {"default": {}, "loader warp": LOADER}, "GPU", "c")
    del rec["floor_ms"]["down"]
    path.write_text(json.dumps(rec))
    with pytest.raises(NanoqwenError, match="floor_ms"):
        dec.persistent_decomposition(path)
