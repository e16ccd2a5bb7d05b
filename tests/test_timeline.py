"""measure.timeline: the persistent kernel's per-CTA event buffer, summed up and drawn (CPU, Agg)."""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.measure import timeline as tl

G, L, E = 8, 2, 16
T0 = 1_700_000_000_000_000_000            # %globaltimer is ns since the epoch
PROGRAM = ([(0, "begin")] + [(layer, k) for layer in range(L) for k in ("qkv", "attention", "o_proj", "gate_up", "down")]
           + [(L, "lm_head"), (L, "end")])


def synthetic() -> np.ndarray:
    """13 instructions on 8 CTAs: instruction i on CTA g begins at 1000 i + 10 g, is ready
    100 + 5 g later and ends 600 + 20 g after its begin; but CTA 3's begin ends 1500 later
    (so qkv 0 ends before it and owns nothing) and only CTAs 0..3 run lm_head."""
    buf = np.full((G, E, 4), -1, np.int64)
    for g in range(G):
        row = 0
        for i, (layer, kind) in enumerate(PROGRAM):
            if kind == "lm_head" and g >= 4:
                continue
            b = T0 + 1000 * i + 10 * g
            end = b + 600 + 20 * g + (1500 if (i, g) == (0, 3) else 0)
            buf[g, row] = (tl.code_of(layer, kind), b, b + 100 + 5 * g, end)
            row += 1
    return buf


# kind: (count, span, exposed, summed mean wait), worked out by hand from synthetic()'s rule
EXPECTED = {
    "begin": (1, 2190, 2190, 117.5),
    "qkv": (2, 1620, 0 + 1000, 235.0),
    "attention": (2, 1620, 620 + 1000, 235.0),
    "o_proj": (2, 1620, 2000, 235.0),
    "gate_up": (2, 1620, 2000, 235.0),
    "down": (2, 1620, 2000, 235.0),
    "lm_head": (1, 690, 880, 107.5),
    "end": (1, 810, 1120, 117.5),
}


def test_kinds_and_codes():
    assert tl.KINDS == ("begin", "qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "end")
    assert len(tl.KINDS) <= tl.CODE_STRIDE == 16
    assert tl.code_of(0, "begin") == 0 and tl.code_of(3, "down") == 53 and tl.code_of(28, "end") == 28 * 16 + 7
    assert set(tl.TIMELINE_COLORS) == set(tl.KINDS)


def test_events_relative_to_the_earliest_begin():
    ev = tl.events_from_buffer(synthetic())
    assert len(ev) == 13 * G - 4
    assert ev["t_begin"].min() == 0 and ev["t_end"].max() == 12810
    first = ev[(ev["cta"] == 3)][0]
    assert (first["code"], first["layer"], tl.KINDS[first["kind"]]) == (0, 0, "begin")
    assert (first["t_begin"], first["t_ready"], first["t_end"]) == (30, 145, 2190)
    last = ev[ev["cta"] == 7][-1]
    assert (last["layer"], tl.KINDS[last["kind"]], last["t_end"]) == (L, "end", 12810)


def test_summarize_exact():
    s = tl.summarize(synthetic(), {"qkv": 800.0, "down": 2500.0})
    assert (s["ctas"], s["events"], s["total_ns"], len(s["instructions"])) == (G, 13 * G - 4, 12810, 13)
    assert list(s["kinds"]) == list(tl.KINDS)
    for name, (count, span, exposed, wait) in EXPECTED.items():
        r = s["kinds"][name]
        assert (r["count"], r["span_ns"], r["exposed_ns"]) == (count, span, exposed), name
        assert r["wait_ns"] == pytest.approx(wait) and r["mean_wait_ns"] == pytest.approx(wait / count), name
    assert sum(r["exposed_ns"] for r in s["kinds"].values()) == s["total_ns"]
    assert s["kinds"]["qkv"]["floor_ns"] == 800.0 and s["kinds"]["qkv"]["above_floor_ns"] == 200.0
    assert s["kinds"]["down"]["above_floor_ns"] == -500.0
    assert s["kinds"]["attention"]["floor_ns"] is None and s["kinds"]["attention"]["above_floor_ns"] is None
    lm = [i for i in s["instructions"] if i["kind"] == "lm_head"][0]
    assert (lm["layer"], lm["ctas"], lm["t_begin"], lm["t_end"]) == (L, 4, 11000, 11690)
    assert [i["code"] for i in s["instructions"]] == [tl.code_of(layer, k) for layer, k in PROGRAM]


def test_wait_adds_a_ctas_rows_of_one_code():
    """Two rows of one code on a CTA (two work items): their waits add up, then the mean over CTAs."""
    buf = np.full((2, 3, 4), -1, np.int64)
    buf[0, 0] = (17, 0, 10, 20)
    buf[0, 1] = (17, 20, 50, 60)
    buf[1, 0] = (17, 5, 15, 30)
    (i,) = tl.instructions(buf)
    assert (i["ctas"], i["span_ns"], i["exposed_ns"], i["wait_ns"]) == (2, 60, 60, 25.0)


def test_format_summary():
    text = tl.format_summary(tl.summarize(synthetic(), {"qkv": 800.0}))
    lines = text.splitlines()
    assert "0.0128 ms" in lines[0] and "8 CTAs" in lines[0]
    assert lines[1].split()[:3] == ["kind", "count", "span"]
    qkv = next(line for line in lines if line.startswith("qkv ")).split()
    assert qkv == ["qkv", "2", "0.0016", "0.0010", "7.8%", "0.0008", "0.0002", "0.12"]
    assert next(line for line in lines if line.startswith("token")).split()[:3] == ["token", "13", "0.0128"]


def _error(buf) -> str:
    with pytest.raises(NanoqwenError) as e:
        tl.events_from_buffer(buf)
    return str(e.value)


def test_bad_buffers_are_named():
    good = synthetic()
    msg = _error(good[..., :3])
    assert "timeline buffer: shape: expected [G, E, 4]" in msg and "found [8, 16, 3]" in msg
    assert "shape" in _error(good[0])
    assert "dtype: expected int64, found float64" in _error(good.astype(np.float64))
    assert "dtype: expected int64, found int32" in _error(good.astype(np.int32))
    assert "type:" in _error(good.tolist())
    assert "at least one used row" in _error(np.full((2, 3, 4), -1, np.int64))
    bad = good.copy()
    bad[2, 5, 2] = -1
    assert "row [2, 5]: expected all four fields set, or all -1" in _error(bad)
    bad = good.copy()
    bad[1, 15] = bad[1, 0]
    assert "row [1, 15]" in _error(bad) and "used row after an unused one" in _error(bad)
    bad = good.copy()
    bad[4, 2, 0] = 8
    assert "row [4, 2] code" in _error(bad) and "found 8" in _error(bad)
    bad = good.copy()
    bad[6, 3, 2] = bad[6, 3, 1] - 1
    assert "row [6, 3] times: expected t_begin <= t_ready <= t_end" in _error(bad)
    bad = good.copy()
    bad[0, 1, 0], bad[0, 2, 0] = bad[0, 2, 0], bad[0, 1, 0]
    assert "row [0, 2] code" in _error(bad) and "program order" in _error(bad)
    with pytest.raises(NanoqwenError, match="floor_ns_by_kind"):
        tl.summarize(good, {"mlp": 1.0})


def test_plot_timeline_draws():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = tl.events_from_buffer(synthetic())
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    ax = tl.plot_timeline(ev, ax=axes[0], title="one token")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(tl.KINDS) + ["waiting (lighter)"]
    assert ax.get_ylim() == (G - 0.5, -0.5)
    lo, hi = ax.get_xlim()
    assert lo < 0 and hi > 12.81
    zoom = tl.plot_timeline(synthetic(), ax=axes[1], layers=range(1, 2))
    lo, hi = zoom.get_xlim()
    assert 5.9 < lo < 6.0 and 10.81 < hi < 11.0                       # layer 1: instructions 6..10
    assert [t.get_text() for t in zoom.get_legend().get_texts()][:2] == ["qkv", "attention"]
    fig.canvas.draw()
    plt.close(fig)
    with pytest.raises(NanoqwenError, match="layers"):
        tl.plot_timeline(ev, layers=[7])
    ax = tl.plot_timeline(ev)                                          # its own figure
    ax.figure.canvas.draw()
    plt.close(ax.figure)


def test_persistent_figures_from_the_committed_record():
    """The figures chapters 4, 7, 9 and 11 quote come from chapter 10's record, consistently."""
    from nanoqwen_lib.measure import bench
    pd = bench.persistent_figures()
    assert pd["speedup"] == pytest.approx(pd["graph_itl_ms"] / pd["itl_ms"])
    assert 0 < pd["of_ceiling"] < 1 and pd["floor_ms"] < pd["itl_ms"]
    assert all(0 < r <= 1.05 for r in pd["rate"].values()), pd["rate"]
    assert pd["layer_floor_us"] < pd["layer_us"] < pd["itl_ms"] * 1e3 / 28
    assert len(pd["commit"]) == 7


def test_persistent_figures_refuse_a_record_without_a_field(tmp_path):
    import json
    from nanoqwen_lib.errors import NanoqwenError
    from nanoqwen_lib.measure import bench
    r = json.loads(bench.PERSISTENT_RECORD.read_text())
    del r["graph_itl_ms"]
    bad = tmp_path / "persistent.json"
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match=r"persistent\.json: graph_itl_ms: expected .*found missing"):
        bench.persistent_figures(bad)
    r = json.loads(bench.PERSISTENT_RECORD.read_text())
    del r["timeline"]["kinds"]["attention"]
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match="timeline.kinds.*no attention"):
        bench.persistent_figures(bad)


def test_persistent_variants_from_the_committed_record():
    """Chapter 10's variant plot: every row of every run, each with its ITL and one token's
    exposed time per kind (which sums to about the ITL: the timeline build is a little slower)."""
    from nanoqwen_lib.measure import bench
    rows = bench.persistent_variants()
    assert len(rows) >= 2 and len({r["run"] for r in rows}) >= 1
    for r in rows:
        total = sum(r["exposed_ms"][k] for k in bench.RECORD_KINDS)
        assert 0.9 * r["ms"] < total < 1.15 * r["ms"], r
        assert 0 <= r["same_tokens"] <= r["steps"]


def test_persistent_variants_refuse_a_row_without_a_field(tmp_path):
    import json
    from nanoqwen_lib.errors import NanoqwenError
    from nanoqwen_lib.measure import bench
    r = json.loads(bench.VARIANTS_RECORD.read_text())
    del r["runs"][1]["rows"][2]["ms"]
    bad = tmp_path / "persistent-variants.json"
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match=r"runs\[1\]\.rows\[2\]\.ms: expected .*found missing"):
        bench.persistent_variants(bad)
    r = json.loads(bench.VARIANTS_RECORD.read_text())
    del r["runs"][0]["rows"][0]["exposed_ms"]["down"]
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match=r"runs\[0\]\.rows\[0\]\.exposed_ms.*no down"):
        bench.persistent_variants(bad)
    r = json.loads(bench.VARIANTS_RECORD.read_text())
    del r["runs"][2]["steps"]
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match=r"runs\[2\]\.steps"):
        bench.persistent_variants(bad)
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(NanoqwenError, match="runs"):
        bench.persistent_variants(bad)


def test_persistent_bounds_from_the_committed_record():
    """Chapter 10's bounds: the diagnostic run's builds, each at most the whole token, and its
    parts add up: the schedule alone plus what the streams and the chains each add to it is
    the whole token within 3% (nothing in one overlaps the other)."""
    from nanoqwen_lib.measure import bench
    b = bench.persistent_bounds()
    ms = {k: r["ms"] for k, r in b["rows"].items()}
    full = (ms["baseline"] + ms["baseline, again"]) / 2
    assert ms["the schedule alone"] < ms["the chains alone"] < ms["the streams alone"] < ms["no attention"] < full
    parts = ms["the streams alone"] + ms["the chains alone"] - ms["the schedule alone"]
    assert abs(parts / full - 1) < 0.03
    assert set(bench.RECORD_KINDS) <= set(b["floor_ms"]) and sum(b["floor_ms"].values()) < full
    assert all(r["diagnostic"] for r in b["rows"].values())
    assert not any(r["diagnostic"] for r in bench.persistent_variants() if r["run"] != b["run"])


def test_persistent_bounds_refuse_a_missing_build_or_floor(tmp_path):
    import json
    from nanoqwen_lib.errors import NanoqwenError
    from nanoqwen_lib.measure import bench
    r = json.loads(bench.VARIANTS_RECORD.read_text())
    diag = next(run for run in r["runs"] if run.get("diagnostic"))
    diag["rows"] = [row for row in diag["rows"] if row["label"] != "the chains alone"]
    bad = tmp_path / "persistent-variants.json"
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match=r"persistent-variants.json: runs\[diagnostic\].*no the chains alone"):
        bench.persistent_bounds(bad)
    r = json.loads(bench.VARIANTS_RECORD.read_text())
    del next(run for run in r["runs"] if run.get("diagnostic"))["floor_ms"]["down"]
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match=r"floor_ms.*no down"):
        bench.persistent_bounds(bad)
    r = json.loads(bench.VARIANTS_RECORD.read_text())
    for run in r["runs"]:
        run.pop("diagnostic", None)
    bad.write_text(json.dumps(r))
    with pytest.raises(NanoqwenError, match="diagnostic"):
        bench.persistent_bounds(bad)


def test_spread_against_the_instructions_before():
    """synthetic(): instruction i on CTA g is ready at 1000 i + 100 + 15 g and ends at
    1000 i + 600 + 30 g, so instruction i - 1 last ended at 1000 (i - 1) + 810 (CTA 7), except
    begin, whose last end is CTA 3's 2190 (qkv 0 is ready before it: a negative time)."""
    sp = tl.spread(tl.events_from_buffer(synthetic()))
    assert "begin" not in sp and sp["qkv"]["count"] == 2 and sp["lm_head"]["count"] == 1
    a = sp["down"]                                   # i = 5 and 10: the same times after prev
    assert a["ready_first"] == 1000 + 100 - 810
    assert a["ready_median"] == 1000 + 100 + 15 * 3.5 - 810
    assert a["busy_median"] == 500 + 15 * 3.5
    assert a["end_median"] == 1000 + 600 + 30 * 3.5 - 810 and a["end_last"] == 1000 + 600 + 210 - 810
    assert a["tail"] == 210 - 30 * 3.5
    assert a["cta_lag"] == 210 - 30 * 3.5              # CTA 7 is the latest every time: its lag
    q = sp["qkv"]                                    # i = 1 (prev 2190) and i = 6 (prev 5810)
    assert q["ready_first"] == np.median([1100 - 2190, 6100 - 5810])
    text = tl.format_spread(sp)
    assert text.splitlines()[1].split()[0] == "kind" and "down" in text


def test_spread_tells_a_late_cta_from_noise():
    """cta_lag: with the same CTA 1000 ns late in every gate_up it is that lag; with a
    different CTA late in each, the tail is the same but no CTA is late as a rule (0)."""
    def gate_ups(late_cta):                              # 6 gate_ups on 8 CTAs, 1000 ns apart
        buf = np.full((G, 6, 4), -1, np.int64)
        for g in range(G):
            for layer in range(6):
                b = T0 + 1000 * layer
                buf[g, layer] = (tl.code_of(layer, "gate_up"), b, b + 50, b + 600 + (300 if g == late_cta(layer) else 0))
        return buf
    steady = tl.spread(gate_ups(lambda layer: 7))["gate_up"]
    noisy = tl.spread(gate_ups(lambda layer: layer))["gate_up"]
    assert steady["count"] == noisy["count"] == 5         # the first instruction has nothing before it
    assert steady["tail"] == noisy["tail"] == 300
    assert steady["cta_lag"] == 300 and noisy["cta_lag"] == 0


def test_persistent_spread_from_the_committed_record(tmp_path):
    """Chapter 10's per-CTA reading: every layer kind, its fields in us, a floor per layer
    below the slowest CTA's end; a record without the spread, or without a field of it, is
    refused naming the file and the field."""
    import json
    from nanoqwen_lib.measure import bench
    sp = bench.persistent_spread()
    assert list(sp) == list(bench.RECORD_KINDS[:-1])
    for k, r in sp.items():
        assert 0 <= r["ready_median"] < r["end_last"] and r["tail"] >= 0 and 0 < r["floor"] < r["end_last"], k
    rec = json.loads(bench.PERSISTENT_RECORD.read_text())
    del rec["spread"]["down"]["tail"]
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(rec))
    with pytest.raises(NanoqwenError, match=r"p.json: spread.down: expected .*tail.*found no tail"):
        bench.persistent_spread(bad)
    del rec["spread"]
    bad.write_text(json.dumps(rec))
    with pytest.raises(NanoqwenError, match="spread"):
        bench.persistent_spread(bad)
    # a run's record in memory (chapter 10 on a GPU) reads the same as the file it would write
    assert bench.persistent_spread(record=json.loads(bench.PERSISTENT_RECORD.read_text())) == sp
    with pytest.raises(NanoqwenError, match=r"the run's record \(in memory\): spread"):
        bench.persistent_spread(bad, record=rec)
