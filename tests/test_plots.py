"""The book's plotting helpers: what they draw stays inside its Axes (CPU, Agg)."""
from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from nanoqwen_lib.measure import plots  # noqa: E402


@pytest.mark.parametrize("log", [True, False])
def test_valued_barh_keeps_every_value_label_inside_its_axes(log):
    """Random bar lengths spanning three decades, two plots side by side (as chapter 8
    draws them): every value label ends inside its own Axes, left of the next plot's."""
    import matplotlib.pyplot as plt

    rng = np.random.default_rng()
    for _ in range(5):
        n = int(rng.integers(2, 6))
        values = {f"bar {i}": float(v) for i, v in enumerate(10 ** rng.uniform(0, 3, n))}
        fig, axes = plt.subplots(1, 2, figsize=(11, 2.8))
        ax = plots.valued_barh(values, "ms", log=log, ax=axes[0])
        axes[1].barh(["a long tick label", "b"], [1, 2])
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = ax.get_window_extent(renderer)
        right_neighbour = min(t.get_window_extent(renderer).x0 for t in axes[1].get_yticklabels())
        texts = [t for t in ax.texts]
        assert [t.get_text().strip() for t in texts] == [f"{v:.1f}" for v in values.values()]
        for t in texts:
            tb = t.get_window_extent(renderer)
            assert tb.x1 <= box.x1 + 0.5, (t.get_text(), tb.x1, box.x1)
            assert tb.x1 < right_neighbour, (t.get_text(), tb.x1, right_neighbour)
        assert [lab.get_text() for lab in ax.get_yticklabels()] == list(values)
        plt.close(fig)


def test_stacked_barh_stacks_every_part_and_labels_each_total_inside_its_axes():
    """Random parts: each bar's segments start where the previous one ended, and the total
    printed past each bar (given or summed) stays inside the Axes."""
    import matplotlib.pyplot as plt

    rng = np.random.default_rng()
    for given in (False, True):
        rows = {f"variant {i}": {p: float(v) for p, v in zip("abcd", rng.uniform(0.01, 1.0, 4))}
                for i in range(int(rng.integers(2, 7)))}
        totals = {k: sum(r.values()) * 1.01 for k, r in rows.items()} if given else None
        ax = plots.stacked_barh(rows, "ms", totals=totals)
        fig = ax.figure
        fig.tight_layout()
        fig.canvas.draw()
        bars = ax.patches
        assert len(bars) == 4 * len(rows)
        for y, (k, r) in enumerate(rows.items()):
            mine = sorted((b for b in bars if abs(b.get_y() + b.get_height() / 2 - y) < 1e-9), key=lambda b: b.get_x())
            assert [b.get_width() for b in mine] == pytest.approx(list(r.values()))
            assert [b.get_x() for b in mine] == pytest.approx(np.cumsum([0, *r.values()])[:-1])
        want = totals.values() if given else (sum(r.values()) for r in rows.values())
        assert [t.get_text().strip() for t in ax.texts] == [f"{v:.3f}" for v in want]
        box = ax.get_window_extent(fig.canvas.get_renderer())
        for t in ax.texts:
            assert t.get_window_extent(fig.canvas.get_renderer()).x1 <= box.x1 + 0.5, t.get_text()
        plt.close(fig)
