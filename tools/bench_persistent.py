"""Time variants of the persistent decode kernel on one engine (GPU): each variant's build
(extra -D knobs of nanoqwen.yaml tuning decode_persistent) replaces the engine's step, the
prompt is prefilled again, and STEPS steps are timed with CUDA events between launches
(median ms), its tokens compared with the first variant's; then one token's timeline of the
fastest variant (with --timelines: of every variant, one line each), against each
instruction's byte floor.

    python tools/bench_persistent.py [--model 7b] [--steps 64] [--variants 'A=1,B=2;C=3'] [--timelines [--spread]] [--json out.json]

The default variants are the ones PERFLOG.md's latest persistent rows were measured with;
`--variants v8` the v8 rows, `--variants lanes` the lane path's first run, `--variants v10`
the request placements and the LL polling, `--variants bounds` the diagnostic builds that
skip instructions (their tokens are meaningless; their time is what the rest costs alone),
`--variants head` the shared-memory heads of gate_up and down, `--variants loader` the loader
warp ([pd-loader]) at several ring depths, `--variants loader-bounds` the bounds' builds of the
default and of chapter 10's loader build (gpu.decode_knobs.LOADER) in one run, `--variants slices`
down's per-slice counters ([pd-down-slices]) with and without the loader, twice, `--variants self`
the consumers filling their own rings ([pd-loader-self]) at several depths beside the default and
the loader warp, `--variants self-bounds` the bounds' builds of the default and of that build,
`--variants qkv-split` qkv in 132 units of whole tiles (no fold) and in 66 x 2 beside the default,
`--variants folds` the measurements that bound the planner's fold cost (nanoqwen.yaml
engine.persistent.reduce_ns): down in 132 units of whole tiles (no fold) and in 66 x 2 beside the
default's 33 x 4, and qkv in 33 x 4 (the plan an H100 made with the old figure); the default and
down 132 x 1 twice; `--variants rings` the builds that keep more bytes in flight than the default's
two blocks a warp in registers (~33 KiB an SM: enough for an H100's share of the bandwidth at
~1.4 us of loaded latency, not for an H200's) beside it: the loader warp, the consumers filling
their own rings, the loader warp's 3 x 3 ring; the default and the loader warp twice.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoqwen_lib.gpu import decode_knobs  # noqa: E402 (after the path)

V7 = "NQ_PD_ATTN_MERGE=0,NQ_PD_NORM_1PASS=0,NQ_PD_ATTN_SPLITS=16,NQ_PD_ATTN_MIN_TOKENS=32"   # v7's attention and norm
S32 = "NQ_PD_ATTN_SPLITS=32,NQ_PD_ATTN_MIN_TOKENS=16"
P3 = ",NQ_PD_ATTN_PRE=3,NQ_PD_ATTN_LANES=0"              # v8's time: 3 K/V rows before attention's wait, a warp a token
V8 = ";".join([                                          # PERFLOG "Persistent decode v8" (--variants v8)
    V7 + P3,
    "NQ_PD_ATTN_MERGE=0,NQ_PD_NORM_1PASS=0," + S32 + P3,
    "NQ_PD_NORM_1PASS=0,NQ_PD_ATTN_SPLITS=16,NQ_PD_ATTN_MIN_TOKENS=32" + P3,   # every split merges a slice
    "NQ_PD_NORM_1PASS=0" + P3,
    "NQ_PD_ATTN_MERGE=0,NQ_PD_ATTN_SPLITS=16,NQ_PD_ATTN_MIN_TOKENS=32" + P3,   # the norm in one pass
    P3[1:],                                              # both, 32 splits
    "NQ_PD_SELF_PREFETCH=8" + P3,                        # gate_up's and down's own blocks into L2 first
    "NQ_PD_SELF_PREFETCH=24" + P3,
    "NQ_PD_DOWN_TG=132,NQ_PD_DOWN_KS=1" + P3,            # down without split-K: no fold, 1-2 tiles a CTA
    "NQ_PD_DOWN_TG=66,NQ_PD_DOWN_KS=2" + P3,
    "NQ_PD_QKV_TG=66,NQ_PD_QKV_KS=2" + P3,               # qkv: 4-5 tiles x half of K, a fold
    "NQ_PD_ATTN_LANES=0",                                # 2 rows before the wait
])
DEFAULT = ";".join([                                     # PERFLOG "Persistent decode v9"
    "", "NQ_PD_DOWN_DEFER=1", "", "NQ_PD_DOWN_DEFER=1",  # down's fold deferred ([pd-down-defer]), twice
])
LANES = ";".join([                                       # PERFLOG v8's next: attention by lanes, twice (--variants lanes)
    "NQ_PD_ATTN_LANES=0", "", "NQ_PD_ATTN_LANES=0", "",
])
V10 = ";".join([                                         # PERFLOG v9's next, measured in v10 (--variants v10)
    "", "NQ_PD_ATTN_LANES=2", "NQ_PD_ATTN_LANES=3",     # the lane path's arithmetic unrolled
    "NQ_PD_QKV_PREFETCH=0", "NQ_PD_QKV_PREFETCH=2", "NQ_PD_QKV_PREFETCH=3",   # where down asks for the next qkv
    "NQ_PD_LATE_RING=32", "NQ_PD_LATE_RING=58",         # down's / every GEMV's ring after its wait
    "NQ_PD_QKV_LL=1",                                    # the attention polls tagged q, k, v ([pd-qkv-ll])
    "",
])
STREAMS = "NQ_PD_SKIP=14,NQ_PD_QKV_PREFETCH=0"             # qkv, attention, o_proj skipped: no qkv share to prefetch
BOUNDS = ";".join([                                      # PERFLOG v10: what each part costs alone ([pd-skip])
    "", "NQ_PD_SKIP=4",                                  # no attention (nor the o_proj prefetch it issues)
    STREAMS,                                             # gate_up, down, lm_head: the streams alone
    "NQ_PD_SKIP=48",                                     # qkv, attention, o_proj, lm_head: the chains alone
    "NQ_PD_SKIP=62",                                     # the schedule alone: 140 empty instructions, the lm_head
    "",
])
HEAD = ";".join([                                        # [pd-head]: gate_up's and down's last blocks a warp in shared memory
    "", "NQ_PD_HEAD_BLOCKS=2", "NQ_PD_HEAD_BLOCKS=4", "NQ_PD_HEAD_BLOCKS=6", "NQ_PD_HEAD_BLOCKS=8",
    "", "NQ_PD_HEAD_BLOCKS=4",
])
LOADER_BUILD = ",".join(f"{k}={v}" for k, v in decode_knobs.LOADER.items())   # chapter 10's loader build (R5 x P2)
LOADER = ";".join([                                      # [pd-loader]: a loader warp fills per-warp rings across instructions
    "", "NQ_PD_WARPS=15",                                # the default, and its 15 consumer warps without a loader
    "NQ_PD_WARPS=15,NQ_PD_LOADER=10",                   # pages of one block
    LOADER_BUILD, "NQ_PD_WARPS=15,NQ_PD_LOADER=3,NQ_PD_LOADER_PAGE=3",
    "NQ_PD_WARPS=15,NQ_PD_LOADER=2,NQ_PD_LOADER_PAGE=5",
    LOADER_BUILD + ",NQ_PD_LOADER_L2=1",                # ... its copies reading L2
    "", LOADER_BUILD,
])
LOADER_BOUNDS = ";".join(                                 # the decomposition of v10 and of the loader build, one run
    BOUNDS.split(";")[:-1] + [",".join(x for x in (LOADER_BUILD, v) if x) for v in BOUNDS.split(";")[:-1]])
SLICES = ";".join([                                      # [pd-down-slices]: down waits for its K slice of gate_up only
    "", "NQ_PD_DOWN_SLICES=1", LOADER_BUILD, LOADER_BUILD + ",NQ_PD_DOWN_SLICES=1", "", "NQ_PD_DOWN_SLICES=1",
])
SELF_BUILD = ",".join(f"{k}={v}" for k, v in decode_knobs.LOADER_SELF.items())   # [pd-loader-self], chapter 10's
SELF = ";".join([                                        # [pd-loader-self]: the 16 consumers fill their own rings
    "", SELF_BUILD,                                      # 4 pages of 2 blocks a warp
    "NQ_PD_LOADER=8,NQ_PD_LOADER_PAGE=1,NQ_PD_LOADER_SELF=1", "NQ_PD_LOADER=3,NQ_PD_LOADER_PAGE=3,NQ_PD_LOADER_SELF=1",
    "NQ_PD_LOADER=2,NQ_PD_LOADER_PAGE=2,NQ_PD_LOADER_SELF=1",   # a shallow ring: what depth buys
    LOADER_BUILD, "", SELF_BUILD,                        # the loader warp, then the first two again
])
SELF_BOUNDS = ";".join(                                   # the decomposition of v10 and of the self-loading build, one run
    BOUNDS.split(";")[:-1] + [",".join(x for x in (SELF_BUILD, v) if x) for v in BOUNDS.split(";")[:-1]])
QKV_SPLIT = ";".join([                                   # qkv without its split-K fold: 132 units of 2-3 whole tiles
    "", "NQ_PD_QKV_TG=132,NQ_PD_QKV_KS=1", "NQ_PD_QKV_TG=66,NQ_PD_QKV_KS=2", "", "NQ_PD_QKV_TG=132,NQ_PD_QKV_KS=1",
])
FOLDS = ";".join([                                       # a fold against the imbalance it removes (planner: reduce_ns)
    "", "NQ_PD_DOWN_TG=132,NQ_PD_DOWN_KS=1", "NQ_PD_DOWN_TG=66,NQ_PD_DOWN_KS=2", "NQ_PD_QKV_TG=33,NQ_PD_QKV_KS=4",
    "", "NQ_PD_DOWN_TG=132,NQ_PD_DOWN_KS=1",
])
RINGS = ";".join([                                       # bytes in flight an SM: the default's 33 KiB against more
    "", LOADER_BUILD, SELF_BUILD, "NQ_PD_WARPS=15,NQ_PD_LOADER=3,NQ_PD_LOADER_PAGE=3",
    "", LOADER_BUILD,
])
OMERGE = ";".join([                                      # [pd-o-merge]: o_proj merges the attention's splits
    "", "NQ_PD_O_TG=33,NQ_PD_O_KS=4",                    # the default, and its o_proj cut by KV head alone
    "NQ_PD_O_MERGE=1", "NQ_PD_O_MERGE=1,NQ_PD_O_MERGE_PRE=8", "NQ_PD_O_MERGE=1,NQ_PD_O_MERGE_PRE=32",
    "", "NQ_PD_O_MERGE=1,NQ_PD_O_MERGE_PRE=8",
])
CHAIN_OWN = "NQ_PD_LOADER_OWN=10"                        # [pd-loader-own]: qkv and o_proj (1 << 1 | 1 << 3) load their own
OWN = ";".join([                                         # the loader's rings for the streams only
    "", LOADER_BUILD, LOADER_BUILD + "," + CHAIN_OWN, SELF_BUILD + "," + CHAIN_OWN,
    "", LOADER_BUILD + "," + CHAIN_OWN,
])
SETS = {"v8": V8, "lanes": LANES, "v10": V10, "bounds": BOUNDS, "head": HEAD, "loader": LOADER,
        "loader-bounds": LOADER_BOUNDS, "slices": SLICES, "self": SELF, "self-bounds": SELF_BOUNDS,
        "qkv-split": QKV_SPLIT, "folds": FOLDS, "rings": RINGS,
        "omerge": OMERGE, "own": OWN}


def parse(spec: str) -> list[dict]:
    out = []
    for item in spec.split(";"):
        pairs = [p.strip() for p in item.split(",") if p.strip()]
        out.append({k: int(v) for k, v in (p.split("=", 1) for p in pairs)})
    return out


POINTS = {0: "qkv begin", 1: "qkv ready", 2: "qkv staged", 3: "qkv summed", 4: "qkv signalled",
          5: "attn begin", 6: "attn ready", 7: "attn q roped", 8: "attn parts", 9: "attn split stored",
          10: "attn merged (last)", 11: "attn signalled"}


def probe_build(rows: list[dict]) -> dict | None:
    """The build the probe stamps: the fastest row that decodes (a [pd-skip] build may skip qkv
    and attention, whose steps the probe stamps; a row with an error has no time), or None."""
    decoding = [r for r in rows if "ms" in r and not r["variant"].get("NQ_PD_SKIP")]
    return min(decoding, key=lambda r: r["ms"])["variant"] if decoding else None


def probe(eng, prompt, defines) -> None:
    """The stamps of one step of the probe build: per point, min / median / max over the CTAs
    that reached it, in us from the earliest qkv begin."""
    from nanoqwen_lib.gpu.persistent import PersistentStep
    eng.pd = PersistentStep(eng, defines=defines)
    eng.prefill_enqueue(prompt)
    for _ in range(4):
        with eng.stream:
            eng.pd.buf["PROBE"].fill(0)
        eng.launch_step(replay=False)
    eng.token_at(eng.position - 1)
    p = eng.pd.buf["PROBE"].get().astype(np.float64)
    t0 = p[:, 0][p[:, 0] > 0].min()
    print(f"probe: layer {defines['NQ_PD_PROBE']}, us from the first qkv begin (min / median / max over CTAs)")
    for k, name in POINTS.items():
        v = p[:, k][p[:, k] > 0]
        if v.size:
            v = (v - t0) / 1e3
            print(f"  {k:2d} {name:22s} {v.min():8.2f} {np.median(v):8.2f} {v.max():8.2f}  ({v.size} CTAs)")


def measure(eng, v: dict, prompt: list[int], a) -> tuple[dict, dict | None]:
    """One variant on the engine's step (eng.pd, built with v): a.steps steps timed between
    eager launches (median ms), its tokens, and with a.timelines one token's timeline summary
    (and with a.spread its per-CTA reading). Raises what the engine raises (a timed-out wait)."""
    from nanoqwen_lib.measure.timeline import spread, timeline_token
    from nanoqwen_lib.measure.timing import events_between, intervals_ms
    eng.prefill_enqueue(prompt)
    for _ in range(3):
        eng.launch_step(replay=False)                           # warm-up
    ev = events_between(lambda: eng.launch_step(replay=False), a.steps, eng.stream)
    eng.stream.synchronize()
    eng.token_at(eng.position - 1)
    start = a.prompt_tokens - 1
    row = {"variant": v, "ms": float(np.median(intervals_ms(ev))), "regs": eng.pd.kernel.num_regs,
           "tokens": eng.arena["s.generated"][start:start + a.steps].get().tolist()}
    summary = None
    if a.timelines:
        tl = timeline_token(eng, prompt, steps=4, keep_events=a.spread)
        summary = tl["summary"]
        if a.spread:
            row["spread"] = spread(tl["events"])
        row["exposed_ms"] = {k: r["exposed_ns"] / 1e6 for k, r in summary["kinds"].items()}
    return row, summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--probe", type=int, default=0,
                    help="also: layer whose qkv and attention stamp their steps (NQ_PD_PROBE build), printed per point")
    ap.add_argument("--timelines", action="store_true", help="a timeline of every variant, one line each")
    ap.add_argument("--spread", action="store_true",
                    help="with --timelines: when each kind's CTAs get ready and finish (measure.timeline.spread)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import cupy as cp
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.gpu.persistent import PersistentStep
    from nanoqwen_lib.errors import NanoqwenError
    from nanoqwen_lib.measure.timeline import format_spread, format_summary, timeline_token
    from nanoqwen_lib.synthetic.packed import packed_synthetic_direct
    f = NanoqwenFile.open(packed_synthetic_direct(a.model, seed=0), verify_payload=False)
    eng = GpuBackend(f, max_tokens=a.prompt_tokens + a.steps + 64, graphs=False, decode="persistent")
    prompt = np.random.default_rng(0).integers(0, 151643, a.prompt_tokens).tolist()
    rows, ref_tokens, best = [], None, None
    for v in parse(SETS.get(a.variants, a.variants)):
        try:
            eng.pd = PersistentStep(eng, defines=v)
        except Exception as e:                                  # a variant that does not build or fit
            rows.append({"variant": v, "error": str(e)[:200]})
            print(f"{v}: {str(e)[:200]}", flush=True)
            continue
        try:
            row, summary = measure(eng, v, prompt, a)
        except NanoqwenError as e:                              # the step reported an error (a timeout: error 3)
            rows.append({"variant": v, "error": str(e)[:200]})
            print(f"{v}: {str(e)[:200]}", flush=True)
            eng.pd.reset()
            eng.scalar["error"].fill(0)
            cp.cuda.Device().synchronize()
            continue
        toks = row.pop("tokens")
        ref_tokens = ref_tokens or toks
        row["same_tokens"] = same = sum(x == y for x, y in zip(toks, ref_tokens))
        rows.append(row)
        ms = row["ms"]
        print(f"{str(v):60s} {ms:.4f} ms  tokens same as first: {same}/{len(toks)}  regs {row['regs']}", flush=True)
        if "spread" in row:
            print(format_spread(row["spread"]), flush=True)
            print("    a CTA late every time (cta_lag, us): " + "  ".join(
                f"{k} {r['cta_lag'] / 1e3:.2f}" for k, r in row["spread"].items()), flush=True)
        if "exposed_ms" in row:
            print("    exposed ms: " + "  ".join(f"{k} {x:.3f}" for k, x in row["exposed_ms"].items()), flush=True)
        if best is None or ms < best[1]:
            best = (v, ms, summary)
    print(f"fastest: {best[0]} {best[1]:.4f} ms", flush=True)
    summary = best[2]
    if summary is None:                                         # (with --timelines it was taken above)
        eng.pd = PersistentStep(eng, defines=best[0])
        summary = timeline_token(eng, prompt, steps=4)["summary"]
    print(format_summary(summary))
    cp.cuda.Device().synchronize()
    if a.json:                                                  # (before the probe: the rows are the run's result)
        a.json.write_text(json.dumps({"steps": a.steps, "rows": rows, "fastest": best[:2], "timeline": summary}, indent=1,
                                     default=str))
    # The probe stamps qkv and attention: of the fastest build that runs them (a [pd-skip] build
    # may skip both: then the fastest build that skips nothing).
    if a.probe and (pb := probe_build(rows)) is not None:
        probe(eng, prompt, dict(pb, NQ_PD_PROBE=a.probe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
