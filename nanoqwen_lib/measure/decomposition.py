"""The decomposition of a persistent decode kernel's token into the schedule, the streams and
the chains ([pd-skip] builds, chapter 10): the record of one tools/bench_persistent.py run of
several kernels' bounds builds (bounds_record), and what chapter 10 reads from it
(persistent_decomposition). Pure data: no GPU."""
from __future__ import annotations

import json
from pathlib import Path

from nanoqwen_lib.measure.bench import PERSISTENT_RECORD, RECORD_KINDS

# The builds of a decomposition ([pd-skip]): NQ_PD_SKIP of each part's build -> its label
# (tools/bench_persistent.py's BOUNDS; the streams' build also drops down's qkv prefetch).
SKIP_LABELS = {0: "baseline", 4: "no attention", 14: "the streams alone", 48: "the chains alone",
               62: "the schedule alone"}
SPLIT_RECORD = PERSISTENT_RECORD.with_name("persistent-bounds-loader.json")   # chapter 10's


def bounds_record(raw: dict, builds: dict[str, dict], gpu: str, commit: str) -> dict:
    """The record of one tools/bench_persistent.py --json run of the bounds' builds of several
    kernels (--variants loader-bounds): {"gpu", "commit", "steps", "floor_ms": kind -> ms of its
    bytes at the run's read ceiling, "builds": name -> {"defines", "rows": label -> {"ms",
    "exposed_ms"}}}. builds: name -> the knobs every row of that build sets (besides
    NQ_PD_SKIP and the streams' NQ_PD_QKV_PREFETCH); each of raw's rows belongs to exactly one
    build and carries one of SKIP_LABELS' skips, else a ValueError names it."""
    tl = raw["timeline"]["kinds"]
    out = {"gpu": gpu, "commit": commit, "steps": raw["steps"],
           "floor_ms": {k: tl[k]["floor_ns"] / 1e6 for k in RECORD_KINDS},
           "builds": {name: {"defines": dict(d), "rows": {}} for name, d in builds.items()}}
    for row in raw["rows"]:
        v = {k: int(x) for k, x in row["variant"].items()}
        skip = v.pop("NQ_PD_SKIP", 0)
        if skip == 14:
            v.pop("NQ_PD_QKV_PREFETCH", None)
        owner = [name for name, d in builds.items() if v == d]
        if len(owner) != 1 or skip not in SKIP_LABELS:
            raise ValueError(f"bounds_record: row {row['variant']} belongs to {owner or 'no build'} "
                             f"(skip {skip}; expected one of {sorted(SKIP_LABELS)})")
        rows = out["builds"][owner[0]]["rows"]
        label = SKIP_LABELS[skip]
        if label in rows:
            raise ValueError(f"bounds_record: {owner[0]} has two rows '{label}'")
        rows[label] = {"ms": float(row["ms"]), "exposed_ms": {k: float(row["exposed_ms"][k]) for k in RECORD_KINDS}}
    return out


def persistent_decomposition(path=SPLIT_RECORD) -> dict:
    """Each build of a bounds record (bounds_record): name -> {"whole", "schedule", "streams",
    "chains", "parts", "no_attention"} in ms a token: the schedule alone; what gate/up and down
    add to it; what qkv, attention and o_proj add; their sum; and the token without attention.
    Plus "floor_ms" (kind -> ms of its bytes), "gpu", "commit". A record without a build's five
    rows or a floor is refused, naming the file and the field."""
    from nanoqwen_lib.errors import NanoqwenError
    path = Path(path)
    r = json.loads(path.read_text())
    for field in ("gpu", "commit", "floor_ms", "builds"):
        if field not in r:
            raise NanoqwenError(str(path), field, "a bounds record (bench.bounds_record)", "missing")
    missing = [k for k in RECORD_KINDS if k not in r["floor_ms"]]
    if missing:
        raise NanoqwenError(str(path), "floor_ms", ", ".join(RECORD_KINDS), "no " + ", ".join(missing))
    out = {"floor_ms": r["floor_ms"], "gpu": r["gpu"], "commit": r["commit"], "builds": {}}
    for name, b in r["builds"].items():
        ms = {label: row["ms"] for label, row in b.get("rows", {}).items()}
        missing = [x for x in SKIP_LABELS.values() if x not in ms]
        if missing:
            raise NanoqwenError(str(path), f"builds.{name}.rows", ", ".join(SKIP_LABELS.values()), "no " + ", ".join(missing))
        sched = ms["the schedule alone"]
        streams, chains = ms["the streams alone"] - sched, ms["the chains alone"] - sched
        out["builds"][name] = {"whole": ms["baseline"], "schedule": sched, "streams": streams, "chains": chains,
                               "parts": sched + streams + chains, "no_attention": ms["no attention"]}
    return out
