"""The timeline of one decode token in the persistent kernel: what every CTA did, and when.

The persistent decode kernel runs a token as one launch: every CTA (one per SM, grid G)
walks the same list of instructions. Its diagnostic build records, per instruction a CTA
executes, one row of four int64 into a device buffer int64 [G, E, 4] (E: the most rows a
CTA may write; unused rows are all -1):

    (code, t_begin, t_ready, t_end)

    code      layer * CODE_STRIDE + kind, kind an index into KINDS; begin is layer 0,
              lm_head and end are layer num_layers, so sorting by code is program order
    t_begin   %globaltimer ns when the CTA starts the instruction (it then issues its
              weight loads and prefetches)
    t_ready   when its inputs are ready (the dependency counter it waited on is satisfied)
    t_end     when it has finished and published its result

A CTA writes its rows from row 0, in program order (codes never decrease along a row).

For one instruction (one code, over the CTAs that ran it):

    span      max t_end - min t_begin
    exposed   the token's wall time it owns, walking the instructions in program order:
              instruction i owns [end of i-1, end of i], an end being the latest t_end of
              its CTAs (a running maximum, so an instruction that ends before the one
              before it owns nothing); the exposed times add up to the token's time
    wait      the mean over its CTAs of t_ready - t_begin

summarize adds these up by kind and sets each kind's exposed time against its floor (its
bytes over the read ceiling, which the caller computes, e.g. gpu.layer.decode_region_bytes).
Pure NumPy; matplotlib only inside plot_timeline (a `book` extra, as in measure.plots).
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.errors import NanoqwenError

# The kinds of instruction, index = kind. The kernel's enum must match this tuple.
KINDS = (
    "begin",       # 0: bookkeeping + embed (layer 0)
    "qkv",         # 1: rmsnorm + qkv GEMV + bias
    "attention",   # 2: RoPE, append K/V, split attention, combine
    "o_proj",      # 3: o_proj GEMV + residual
    "gate_up",     # 4: rmsnorm + gate/up GEMV
    "down",        # 5: SwiGLU + down GEMV + residual
    "lm_head",     # 6: final norm, lm_head + argmax (layer num_layers)
    "end",         # 7: bookkeeping (layer num_layers)
)
CODE_STRIDE = 16                       # code = layer * CODE_STRIDE + kind
UNUSED = -1                            # every field of an unused row
FIELDS = ("code", "t_begin", "t_ready", "t_end")
SOURCE = "timeline buffer"

# One row per recorded instruction; times in ns from the token's earliest t_begin.
EVENT_DTYPE = np.dtype([("cta", np.int32), ("code", np.int64), ("layer", np.int32), ("kind", np.int32),
                        ("t_begin", np.int64), ("t_ready", np.int64), ("t_end", np.int64)])

# One colour per kind, the same in every timeline plot.
TIMELINE_COLORS = {
    "begin": "#7f7f7f",
    "qkv": "#1f77b4",
    "attention": "#d62728",
    "o_proj": "#ff7f0e",
    "gate_up": "#2ca02c",
    "down": "#9467bd",
    "lm_head": "#8c564b",
    "end": "#bcbd22",
}


def code_of(layer: int, kind: str | int) -> int:
    """The code of an instruction: kind by name (a KINDS entry) or by index."""
    k = KINDS.index(kind) if isinstance(kind, str) else int(kind)
    return int(layer) * CODE_STRIDE + k


def _bad(field: str, expected, found, source: str) -> NanoqwenError:
    return NanoqwenError(source, field, expected, found)


def events_from_buffer(buf, source: str = SOURCE) -> np.ndarray:
    """The kernel's int64 [G, E, 4] buffer (a NumPy array; a CuPy one is copied to the host)
    -> a structured array of EVENT_DTYPE, one row per used buffer row, by CTA then row,
    times in ns from the earliest t_begin. Raises NanoqwenError naming the field that is
    off: the shape, the dtype, a partly unused row, an unknown kind, a row whose times run
    backwards, a used row after an unused one, codes out of program order."""
    if not isinstance(buf, np.ndarray) and hasattr(buf, "get"):
        buf = buf.get()                                   # cupy -> numpy
    if not isinstance(buf, np.ndarray):
        raise _bad("type", "a NumPy (or CuPy) array", type(buf).__name__, source)
    if buf.ndim != 3 or buf.shape[2] != len(FIELDS):
        raise _bad("shape", f"[G, E, {len(FIELDS)}] (CTAs, events per CTA, {', '.join(FIELDS)})",
                   list(buf.shape), source)
    if buf.dtype != np.int64:
        raise _bad("dtype", "int64", str(buf.dtype), source)
    G, E, _ = buf.shape
    unused = buf == UNUSED
    used = ~unused.all(axis=2)
    partly = used & unused.any(axis=2)
    if partly.any():
        g, e = np.argwhere(partly)[0]
        raise _bad(f"row [{g}, {e}]", "all four fields set, or all -1 (unused)", buf[g, e].tolist(), source)
    if not used.any():
        raise _bad("rows", "at least one used row", f"all {G} x {E} rows unused (-1)", source)
    after_gap = used & ~np.logical_and.accumulate(used, axis=1)
    if after_gap.any():
        g, e = np.argwhere(after_gap)[0]
        raise _bad(f"row [{g}, {e}]", "the used rows of a CTA first (from row 0), the unused after them",
                   "a used row after an unused one", source)
    rows = buf[used]                                      # row-major: CTA by CTA, row by row
    cta = np.nonzero(used)[0]
    code, t_begin, t_ready, t_end = rows.T
    where = np.argwhere(used)
    kind = code % CODE_STRIDE
    bad = (code < 0) | (kind >= len(KINDS))
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad(f"row {where[i].tolist()} code", f"layer * {CODE_STRIDE} + kind, kind in 0..{len(KINDS) - 1} "
                   f"({', '.join(KINDS)})", int(code[i]), source)
    bad = (t_ready < t_begin) | (t_end < t_ready)
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad(f"row {where[i].tolist()} times", "t_begin <= t_ready <= t_end",
                   f"t_begin {t_begin[i]}, t_ready {t_ready[i]}, t_end {t_end[i]}", source)
    back = (cta[1:] == cta[:-1]) & (code[1:] < code[:-1])
    if back.any():
        i = int(np.argmax(back)) + 1
        raise _bad(f"row {where[i].tolist()} code", f"at least the code before it ({int(code[i - 1])}): "
                   "a CTA records in program order", int(code[i]), source)
    t0 = t_begin.min()
    out = np.empty(len(rows), EVENT_DTYPE)
    out["cta"], out["code"] = cta, code
    out["layer"], out["kind"] = code // CODE_STRIDE, kind
    out["t_begin"], out["t_ready"], out["t_end"] = t_begin - t0, t_ready - t0, t_end - t0
    return out


def _as_events(events) -> np.ndarray:
    if isinstance(events, np.ndarray) and events.dtype == EVENT_DTYPE:
        return events
    return events_from_buffer(events)


def instructions(events) -> list[dict]:
    """One dict per instruction (code) in program order: code, layer, kind (name), ctas (how
    many ran it), t_begin (earliest), t_end (latest), span_ns, exposed_ns, wait_ns (mean over
    its CTAs of t_ready - t_begin, a CTA's rows of one code added up). Times in ns.
    events: events_from_buffer's array, or the raw buffer."""
    ev = _as_events(events)
    codes, inv = np.unique(ev["code"], return_inverse=True)
    n = len(codes)
    begin = np.full(n, np.iinfo(np.int64).max)
    end = np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(begin, inv, ev["t_begin"])
    np.maximum.at(end, inv, ev["t_end"])
    wait = np.bincount(inv, weights=ev["t_ready"] - ev["t_begin"], minlength=n)
    G = int(ev["cta"].max()) + 1
    ctas = np.bincount(np.unique(inv.astype(np.int64) * G + ev["cta"]) // G, minlength=n)
    frontier = np.maximum.accumulate(end)
    exposed = np.diff(frontier, prepend=ev["t_begin"].min())
    return [{"code": int(c), "layer": int(c // CODE_STRIDE), "kind": KINDS[c % CODE_STRIDE],
             "ctas": int(ctas[i]), "t_begin": int(begin[i]), "t_end": int(end[i]),
             "span_ns": int(end[i] - begin[i]), "exposed_ns": int(exposed[i]),
             "wait_ns": float(wait[i] / ctas[i])} for i, c in enumerate(codes)]


def summarize(events, floor_ns_by_kind: dict[str, float] | None = None) -> dict:
    """Where the token's time went, by kind.

    Returns {"ctas": CTAs with a row, "events": rows, "instructions": instructions(events),
    "total_ns": max t_end - min t_begin, "kinds": {kind: row}} with kinds in KINDS order
    (those that ran), each row: count (instructions, i.e. layers), span_ns and exposed_ns
    (summed over them), wait_ns (their mean waits added up: the time one CTA spends
    waiting on this kind in a token, on average), mean_wait_ns (per instruction), and
    floor_ns, above_floor_ns (exposed - floor; None for a kind without a floor).
    floor_ns_by_kind: kind -> the floor of all its instructions in one token (its bytes over
    the read ceiling), ns."""
    ev = _as_events(events)
    floors = dict(floor_ns_by_kind or {})
    unknown = [k for k in floors if k not in KINDS]
    if unknown:
        raise NanoqwenError("<arguments>", "floor_ns_by_kind", f"kinds among {', '.join(KINDS)}",
                            ", ".join(map(repr, unknown)))
    ins = instructions(ev)
    kinds: dict[str, dict] = {}
    for name in KINDS:
        mine = [i for i in ins if i["kind"] == name]
        if not mine:
            continue
        exposed = sum(i["exposed_ns"] for i in mine)
        wait = sum(i["wait_ns"] for i in mine)
        floor = floors.get(name)
        kinds[name] = {"count": len(mine), "span_ns": sum(i["span_ns"] for i in mine), "exposed_ns": exposed,
                       "wait_ns": wait, "mean_wait_ns": wait / len(mine),
                       "floor_ns": None if floor is None else float(floor),
                       "above_floor_ns": None if floor is None else exposed - float(floor)}
    return {"ctas": int(len(np.unique(ev["cta"]))), "events": int(len(ev)), "instructions": ins,
            "total_ns": int(ev["t_end"].max() - ev["t_begin"].min()), "kinds": kinds}


def spread(events) -> dict:
    """When the CTAs of each instruction become ready and finish, against the moment the
    instructions before it are all done (prev: the latest t_end of every earlier code), by
    kind, the median over its instructions (layers) of, in ns:
        ready_first, ready_median   min and median over CTAs of t_ready - prev
        busy_median                 median over CTAs of t_end - t_ready
        end_median, end_last        median and max over CTAs of t_end - prev
        tail                        end_last - end_median: what the slowest CTA adds
    and, over the kind's instructions together, cta_lag: the largest over CTAs of a CTA's
    median lateness (t_end - the instruction's median end). Near the tail, the same SMs are
    late every time (a pace of their own); near 0, the late ones change (noise).
    The first instruction of the token (nothing before it) is left out. events:
    events_from_buffer's array, or the raw buffer."""
    ev = _as_events(events)
    codes = np.unique(ev["code"])
    rows: dict[str, list] = {}
    late: dict[str, dict[int, list]] = {}
    prev = None
    for c in codes:
        mine = ev[ev["code"] == c]
        if prev is not None:
            kind = KINDS[c % CODE_STRIDE]
            r, e = mine["t_ready"] - prev, mine["t_end"] - prev
            rows.setdefault(kind, []).append(
                (r.min(), np.median(r), np.median(mine["t_end"] - mine["t_ready"]), np.median(e), e.max(),
                 e.max() - np.median(e)))
            for cta, lag in zip(mine["cta"].tolist(), (e - np.median(e)).tolist()):
                late.setdefault(kind, {}).setdefault(cta, []).append(lag)
        end = int(mine["t_end"].max())
        prev = end if prev is None else max(prev, end)
    names = ("ready_first", "ready_median", "busy_median", "end_median", "end_last", "tail")
    return {k: {"count": len(v), **{n: float(x) for n, x in zip(names, np.median(np.array(v, float), axis=0))},
                "cta_lag": float(max(np.median(x) for x in late[k].values()))}
            for k, v in rows.items()}


def format_spread(sp: dict) -> str:
    """spread's result as a table, us."""
    lines = ["per kind, median over its instructions; us from the moment the instructions before it are done",
             f"{'kind':<12}{'ready first':>12}{'ready med':>11}{'busy med':>10}{'end med':>9}{'end last':>10}{'tail':>7}"]
    for k, r in sp.items():
        lines.append(f"{k:<12}{r['ready_first'] / 1e3:>12.2f}{r['ready_median'] / 1e3:>11.2f}{r['busy_median'] / 1e3:>10.2f}"
                     f"{r['end_median'] / 1e3:>9.2f}{r['end_last'] / 1e3:>10.2f}{r['tail'] / 1e3:>7.2f}")
    return "\n".join(lines)


def format_summary(s: dict) -> str:
    """summarize's result as a table: one row per kind, then the token (its time, the sum of
    the floors given and the time above them)."""
    lines = [f"decode token timeline: {s['total_ns'] / 1e6:.4f} ms, {s['ctas']} CTAs, "
             f"{len(s['instructions'])} instructions ({s['events']} rows); exposed = the token's time "
             "each kind owns, in program order",
             f"{'kind':<12}{'count':>6}{'span ms':>10}{'exposed ms':>12}{'of token':>10}{'floor ms':>10}"
             f"{'above floor':>13}{'mean wait us':>14}"]

    def ms(x):
        return "-" if x is None else f"{x / 1e6:.4f}"

    total = s["total_ns"] or 1
    for name, r in s["kinds"].items():
        lines.append(f"{name:<12}{r['count']:>6}{ms(r['span_ns']):>10}{ms(r['exposed_ns']):>12}"
                     f"{r['exposed_ns'] / total:>10.1%}{ms(r['floor_ns']):>10}{ms(r['above_floor_ns']):>13}"
                     f"{r['mean_wait_ns'] / 1e3:>14.2f}")
    floors = [r["floor_ns"] for r in s["kinds"].values() if r["floor_ns"] is not None]
    floor = sum(floors) if floors else None
    exposed = sum(r["exposed_ns"] for r in s["kinds"].values())
    lines.append(f"{'token':<12}{len(s['instructions']):>6}{'':>10}{ms(exposed):>12}{exposed / total:>10.1%}"
                 f"{ms(floor):>10}{ms(None if floor is None else exposed - floor):>13}".rstrip())
    return "\n".join(lines)


def _layer_set(layers):
    if layers is None:
        return None
    if isinstance(layers, (int, np.integer)):
        return {int(layers)}
    return {int(x) for x in layers}


def plot_timeline(events, ax=None, layers=None, title: str = ""):
    """A Gantt chart of one token: one row per CTA (top: CTA 0), x in microseconds from the
    token's start, one bar per instruction coloured by kind (TIMELINE_COLORS), its wait
    (t_begin..t_ready) in a lighter shade of the same colour. layers: an int or an iterable
    of layer indices (a range) to draw only those instructions, the x axis zoomed to them
    (begin is layer 0; lm_head and end are layer num_layers). events: events_from_buffer's
    array, or the raw buffer. Returns the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    ev = _as_events(events)
    G = int(ev["cta"].max()) + 1
    keep = _layer_set(layers)
    if keep is not None:
        ev = ev[np.isin(ev["layer"], list(keep))]
        if not len(ev):
            raise NanoqwenError("<arguments>", "layers", "layers the timeline holds",
                                sorted(keep))
    if ax is None:
        _, ax = plt.subplots(figsize=(10.0, max(2.5, 1.0 + 0.045 * G)))
    h = 0.8

    def boxes(x0, x1, y):
        x0, x1 = x0 / 1e3, x1 / 1e3
        y0, y1 = y - h / 2, y + h / 2
        return np.stack([np.stack([x0, y0], -1), np.stack([x0, y1], -1),
                         np.stack([x1, y1], -1), np.stack([x1, y0], -1)], axis=1)

    handles = []
    for k, name in enumerate(KINDS):
        mine = ev[ev["kind"] == k]
        if not len(mine):
            continue
        color = TIMELINE_COLORS[name]
        y = mine["cta"].astype(float)
        wait = mine["t_ready"] > mine["t_begin"]
        ax.add_collection(PolyCollection(boxes(mine["t_begin"][wait], mine["t_ready"][wait], y[wait]),
                                         facecolors=to_rgba(color, 0.3), edgecolors="none"))
        ax.add_collection(PolyCollection(boxes(mine["t_ready"], mine["t_end"], y),
                                         facecolors=color, edgecolors="none"))
        handles.append(Patch(color=color, label=name))
    handles.append(Patch(facecolor=to_rgba("#7f7f7f", 0.3), label="waiting (lighter)"))
    lo, hi = ev["t_begin"].min() / 1e3, ev["t_end"].max() / 1e3
    pad = 0.01 * (hi - lo) or 0.5
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_ylim(G - 0.5, -0.5)                            # CTA 0 on top
    ax.set_xlabel("us from the token's start")
    ax.set_ylabel("CTA (one per SM)")
    ax.grid(axis="y", visible=False)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title)
    return ax


# The decode regions (gpu.layer) whose bytes are each kind's floor.
REGION_OF_KIND = {"begin": "embed", "qkv": "qkv_gemv", "attention": "paged_attention", "o_proj": "o_proj",
                  "gate_up": "gate_up_gemv", "down": "swiglu_down", "lm_head": "lm_head+argmax"}


def floors_ns(dims, context_tokens: int, ceiling_tbps: float, encoding: str = "int4") -> dict[str, float]:
    """kind -> ns its bytes take at the read ceiling, all layers of one token at `context_tokens`
    (gpu.layer.decode_region_bytes; the norms' few bytes ride with qkv and gate_up)."""
    from nanoqwen_lib.gpu.layer import decode_region_bytes
    b = decode_region_bytes(dims, context_tokens, encoding)
    return {k: b[r] / (ceiling_tbps * 1e12) * 1e9 for k, r in REGION_OF_KIND.items()}


def timeline_token(engine, prompt: list[int], steps: int = 8, keep_events: bool = False) -> dict:
    """One token of the persistent kernel's diagnostic build (its timeline records), run on
    the engine's own arena after `prompt` and `steps` - 1 untimed steps: the summary against
    each kind's floor at the read ceiling measured now, and with keep_events the event rows
    (plot_timeline's input). The diagnostic build keeps the knobs the engine's step was built
    with. The engine's sequence is left where this ends (bench's next prefill resets it)."""
    from nanoqwen_lib.gpu.persistent import PersistentStep
    from nanoqwen_lib.measure.timing import measure_read_ceiling
    diag = PersistentStep(engine, timeline=True, defines=engine.pd.extra)
    saved, engine.pd = engine.pd, diag
    try:
        engine.prefill_enqueue(prompt)
        for _ in range(steps):
            with engine.stream:                  # ordered with the launches (a non-blocking stream)
                diag.buf["TIMELINE"].fill(-1)
            engine.launch_step(replay=False)
        engine.token_at(engine.position - 1)
        buf = diag.timeline()
    finally:
        engine.pd = saved
        with engine.stream:
            saved.reset()
    ceiling = measure_read_ceiling()["tbps"]
    ev = events_from_buffer(buf)
    s = summarize(ev, floors_ns(engine.dims, engine.position, ceiling, engine.encoding))
    out = {"summary": s, "ceiling_tbps": ceiling, "context_tokens": engine.position}
    if keep_events:                      # the plot's input (large: a row per CTA and instruction)
        out["events"] = ev
    return out
