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


def bytes_bars(bars: dict[str, dict[str, int]], title: str = "", unit: float = 1e9,
               unit_name: str = "GB", ax=None, colors: dict | None = None):
    """Horizontal stacked bars of byte counts: one bar per label, one segment per kind.

    bars: label -> {kind -> bytes}; zero entries are left out. Segments wide enough to hold
    it carry their value; the legend names each kind once; colors: kind -> colour (default
    KIND_COLORS). Returns the Axes.
    """
    import matplotlib.pyplot as plt

    colors = KIND_COLORS if colors is None else colors
    if ax is None:
        _, ax = plt.subplots(figsize=(8.0, 1.0 + 0.6 * len(bars)))
    longest = max(sum(parts.values()) for parts in bars.values()) / unit
    seen = set()
    for y, parts in enumerate(bars.values()):
        left = 0.0
        for kind, n in parts.items():
            if n <= 0:
                continue
            width = n / unit
            ax.barh(y, width, left=left, color=colors.get(kind), edgecolor="white",
                    label=None if kind in seen else kind)
            seen.add(kind)
            if width > 0.06 * longest:
                ax.text(left + width / 2, y, f"{width:.3f}", ha="center", va="center",
                        color="white", fontsize=9)
            left += width
    ax.set_xlim(0, longest * 1.02)
    return _finish_barh(ax, list(bars), unit_name, title)


def grouped_barh(groups: dict[str, dict[str, float]], xlabel: str, title: str = "",
                 vline: float | None = None, vline_label: str = "", ax=None):
    """Horizontal grouped bars: one group per label (top to bottom), one bar per series.

    groups: label -> {series -> value}; every group names the same series, in the same
    order. vline draws a dashed reference (a ceiling, a floor) across the plot. Returns the
    Axes.
    """
    import matplotlib.pyplot as plt

    series = list(next(iter(groups.values())))
    if ax is None:
        _, ax = plt.subplots(figsize=(8.0, 1.0 + 0.45 * len(groups) * max(1, len(series)) ** 0.5))
    height = 0.8 / len(series)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for s, name in enumerate(series):
        ys = [y + (s - (len(series) - 1) / 2) * height for y in range(len(groups))]
        ax.barh(ys, [parts[name] for parts in groups.values()], height=height * 0.95,
                color=colors[s % len(colors)], label=name)
    if vline is not None:
        ax.axvline(vline, color="k", linestyle="--", linewidth=1, label=vline_label or None)
    return _finish_barh(ax, list(groups), xlabel, title)


def valued_barh(values: dict[str, float], xlabel: str, colors=None, log: bool = False,
                fmt: str = "{:.1f}", ax=None):
    """Horizontal bars, one per label (top to bottom), each with its value printed just past
    its end. The x range is widened so that every value label stays inside the Axes (on a
    log scale by a factor, on a linear one by a share of the longest bar): a label never
    runs into a neighbouring plot or its tick labels. Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 0.8 + 0.5 * len(values)))
    labels, vals = list(values), [float(v) for v in values.values()]
    ax.barh(range(len(vals)), vals, color=colors)
    if log:
        ax.set_xscale("log")
    for y, v in enumerate(vals):
        ax.text(v, y, " " + fmt.format(v), va="center")
    hi = max(vals)
    ax.set_xlim(right=hi * (VALUE_ROOM_LOG if log else VALUE_ROOM_LINEAR))
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(axis="y", visible=False)
    return ax


# How far valued_barh extends the x axis past the longest bar, for its value label.
VALUE_ROOM_LOG = 4.0
VALUE_ROOM_LINEAR = 1.18


def _finish_barh(ax, labels, xlabel: str, title: str):
    """The shared look of a horizontal bar chart: labels top to bottom, legend outside."""
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()  # first label on top
    ax.set_xlabel(xlabel)
    ax.grid(axis="y", visible=False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title)
    return ax


def itl_breakdown_bars(b: dict, title: str = ""):
    """Stacked bars of breakdown.itl_breakdown's result: eager and graph ITL, one segment per
    region (the same segments in both) plus each one's kernel_gap. Returns the Axes."""
    import matplotlib.pyplot as plt

    names = list(b["regions_ms"]) + ["kernel_gap"]
    cycle = plt.get_cmap("tab20").colors
    colors = {n: cycle[i % len(cycle)] for i, n in enumerate(names)}
    colors["kernel_gap"] = "#bbbbbb"
    bars = {f"{mode} ({b[mode]['itl_ms']:.2f} ms)": {**b["regions_ms"], "kernel_gap": max(b[mode]["kernel_gap_ms"], 0.0)}
            for mode in ("eager", "graph")}
    return bytes_bars(bars, title=title, unit=1.0, unit_name="ms per decode token", colors=colors)


def scoreboard_bars(rows: list[dict], article: dict, title: str = ""):
    """ITL and TTFT side by side (log scales) for scoreboard rows (peers.scoreboard_rows)
    and the article's quoted rows. Ours blue, peers that agree orange, rows without a
    verdict of agreement grey and hatched, quoted rows light grey. Returns the Figure."""
    import matplotlib.pyplot as plt

    def color(x):
        if x["key"] == "nanoqwen":
            return "#1f77b4", ""
        return ("#ff7f0e", "") if x["ratio"] is not None or x["status"].startswith("agrees") else ("#7f7f7f", "//")

    items = [(x["label"], x["itl_ms"], x["ttft_ms"], *color(x)) for x in rows]
    items += [(name + " (quoted)", a["itl_ms"], a["ttft_ms"], "#cccccc", "") for name, a in article.items()]
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 0.9 + 0.38 * len(items)), sharey=True)
    for ax, col, xlabel in ((axes[0], 1, "ITL, ms per token (log)"), (axes[1], 2, "TTFT, ms (log)")):
        for y, it in enumerate(items):
            if it[col] is not None:
                ax.barh(y, it[col], color=it[3], hatch=it[4], edgecolor="k" if it[4] else None, linewidth=0.3)
                ax.text(it[col], y, f" {it[col]:.2f}", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel(xlabel)
        ax.grid(axis="y", visible=False)
    axes[0].set_yticks(range(len(items)), [it[0] for it in items])
    axes[0].invert_yaxis()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def stacked_barh(rows: dict[str, dict[str, float]], xlabel: str, title: str = "", totals: dict | None = None,
                 fmt: str = "{:.3f}", ax=None):
    """Horizontal stacked bars, one per label (top to bottom), one segment per part (every
    row names the same parts, in the same order); totals (label -> value, default the sum of
    the parts) printed just past each bar's end. Returns the Axes."""
    import matplotlib.pyplot as plt

    parts = list(next(iter(rows.values())))
    if ax is None:
        _, ax = plt.subplots(figsize=(8.0, 1.0 + 0.38 * len(rows)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    left = [0.0] * len(rows)
    for p, name in enumerate(parts):
        vals = [float(r[name]) for r in rows.values()]
        ax.barh(range(len(rows)), vals, left=left, color=colors[p % len(colors)], label=name)
        left = [a + b for a, b in zip(left, vals)]
    ends = [float(totals[k]) if totals else left[y] for y, k in enumerate(rows)]
    for y, v in enumerate(ends):
        ax.text(max(v, left[y]), y, " " + fmt.format(v), va="center", fontsize=8)
    ax.set_xlim(right=max(max(ends), max(left)) * VALUE_ROOM_LINEAR)
    return _finish_barh(ax, list(rows), xlabel, title)


def variant_steps(variants: list[dict], title: str = "", ax=None):
    """The persistent kernel's tuning runs as one figure (measure.bench.persistent_variants'
    rows, diagnostic runs left out): one column per run in order, its baseline's ITL joined
    to the next run's by a line, every variant the run timed as a dot (green: faster than
    that run's baseline, red: slower; hollow: its greedy tokens part from the baseline's at
    a near-tie), under each column the run's fastest variant with its change, or "no variant
    faster". Returns the Axes."""
    import matplotlib.pyplot as plt

    runs: dict = {}
    for r in variants:
        if not r.get("diagnostic"):
            runs.setdefault(r["run"], []).append(r)
    if not runs:
        raise ValueError("variant_steps: no non-diagnostic run among the rows")
    if ax is None:
        _, ax = plt.subplots(figsize=(10.0, 4.2))
    base = []
    for x, rows in enumerate(runs.values()):
        b = rows[0]["ms"]
        base.append(b)
        others = [r for r in rows[1:] if not r["label"].startswith("baseline")]
        for j, r in enumerate(others):
            dx = (j - (len(others) - 1) / 2) * min(0.08, 0.6 / max(1, len(others)))
            color = "#2ca02c" if r["ms"] < b else "#d62728"
            hollow = r["same_tokens"] < r["steps"]
            ax.plot(x + dx, r["ms"], "o", ms=6, color=color, mfc="white" if hollow else color, alpha=0.85)
        low = min([b] + [r["ms"] for r in others])
        best = min(others, key=lambda r: r["ms"]) if others else None
        note = (f"{best['label'].strip(' +')}\n{best['ms'] / b - 1:+.1%}" if best and best["ms"] < b
                else "no variant faster")
        ax.annotate(note, (x, low), xytext=(0, -12), textcoords="offset points", ha="center", va="top", fontsize=7)
    ax.plot(range(len(base)), base, "-s", color="#1f77b4", ms=7, label="the run's baseline")
    for x, b in enumerate(base):
        ax.text(x, b, f" {b:.3f}", va="bottom", ha="left", fontsize=8, color="#1f77b4")
    ax.plot([], [], "o", color="#2ca02c", label="a variant, faster")
    ax.plot([], [], "o", color="#d62728", label="a variant, slower")
    ax.plot([], [], "o", color="#777777", mfc="white", label="tokens part at a near-tie")
    ax.set_xticks(range(len(runs)), [f"run {i + 1}\n{c}" for i, c in enumerate(runs)], fontsize=8)
    lo = min(min(r["ms"] for r in rows) for rows in runs.values())
    hi = max(max(r["ms"] for r in rows) for rows in runs.values())
    ax.set_ylim(lo - 0.16 * (hi - lo) - 0.02, hi + 0.05 * (hi - lo))
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylabel("ms a token (ITL, median)")
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title)
    return ax
