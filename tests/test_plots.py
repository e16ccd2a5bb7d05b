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
