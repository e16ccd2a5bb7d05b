"""plots.variant_steps (chapter 10's one figure of the tuning runs): what it draws is what the
rows say (CPU, Agg), on made-up rows and on the committed variants record."""
from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from nanoqwen_lib.measure import bench, plots  # noqa: E402


def _row(run, label, ms, same=64, diagnostic=False):
    return {"run": run, "label": label, "ms": ms, "same_tokens": same, "steps": 64, "diagnostic": diagnostic}


def test_baselines_dots_and_notes_follow_the_rows():
    import matplotlib.pyplot as plt
    rows = [_row("a", "baseline", 2.0), _row("a", "x", 1.9), _row("a", "y", 2.2, same=50),
            _row("b", "baseline", 1.9), _row("b", "z", 1.95), _row("b", "baseline, again", 1.91),
            _row("c", "baseline", 1.0, diagnostic=True), _row("c", "skip", 0.5, diagnostic=True)]
    ax = plots.variant_steps(rows)
    line = [ln for ln in ax.get_lines() if ln.get_label() == "the run's baseline"][0]
    assert list(line.get_ydata()) == [2.0, 1.9]                    # the diagnostic run left out
    dots = [ln for ln in ax.get_lines() if ln.get_label().startswith("_") and len(ln.get_ydata()) == 1]
    assert sorted(float(d.get_ydata()[0]) for d in dots) == [1.9, 1.95, 2.2]   # "baseline, again" is no variant
    hollow = [d for d in dots if d.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0))]
    assert [float(d.get_ydata()[0]) for d in hollow] == [2.2]       # its tokens parted
    notes = [t.get_text() for t in ax.texts if "\n" in t.get_text() or "faster" in t.get_text()]
    assert notes == ["x\n-5.0%", "no variant faster"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["run 1\na", "run 2\nb"]
    plt.close(ax.figure)


def test_no_run_is_refused():
    with pytest.raises(ValueError, match="no non-diagnostic run"):
        plots.variant_steps([_row("c", "baseline", 1.0, diagnostic=True)])


def test_the_committed_record_draws():
    import matplotlib.pyplot as plt
    rows = bench.persistent_variants()
    ax = plots.variant_steps(rows)
    runs = list(dict.fromkeys(r["run"] for r in rows if not r["diagnostic"]))
    line = [ln for ln in ax.get_lines() if ln.get_label() == "the run's baseline"][0]
    assert len(line.get_ydata()) == len(runs)
    plt.close(ax.figure)
