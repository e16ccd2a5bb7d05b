"""Small plotting helpers shared by the chapters: one look, and the bar chart of bytes.

matplotlib is a `book` extra, not a runtime dependency: it is imported inside the
functions, so `import nanoqwen_lib` never needs it. Figures are returned, never saved:
the notebook shows them inline (PNG), and nbval does not compare images, so each plot
cell also prints the number the plot is about.
"""
from __future__ import annotations

# One colour per kind of bytes, the same in every chapter.
KIND_COLORS = {
    "int4_weights": "#1f77b4",
    "scales": "#ff7f0e",
    "lm_head_fp16": "#2ca02c",
    "kv_cache": "#d62728",
    "embedding_row": "#9467bd",
    "norms_and_biases": "#8c564b",
    "fp16": "#7f7f7f",
}

BOOK_RC = {
    "figure.figsize": (7.0, 3.2),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 10,
}


def book_style() -> None:
    """Apply the book's matplotlib look (call once at the top of a chapter)."""
    import matplotlib.pyplot as plt

    plt.rcParams.update(BOOK_RC)


def bytes_bar(parts: dict[str, int], title: str = "", unit: float = 1e9, unit_name: str = "GB",
              ax=None):
    """One horizontal stacked bar of byte counts by kind, each segment labelled.

    parts: kind -> bytes (zero entries are left out). Returns the Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8.0, 1.9))
    left = 0.0
    for kind, n in parts.items():
        if n <= 0:
            continue
        width = n / unit
        ax.barh(0, width, left=left, color=KIND_COLORS.get(kind), edgecolor="white",
                label=f"{kind}: {width:.3f} {unit_name}")
        left += width
    ax.set_yticks([])
    ax.set_xlim(0, left * 1.02)
    ax.set_xlabel(unit_name)
    ax.grid(axis="y", visible=False)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2, frameon=False,
              fontsize=9)
    if title:
        ax.set_title(title)
    return ax


def bar_values(ax, bars, fmt: str = "{:.3g}") -> None:
    """Write each bar's value at its end (vertical bar charts)."""
    for b in bars:
        ax.annotate(fmt.format(b.get_height()), (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
