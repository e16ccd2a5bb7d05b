"""benchmark_e2e: TTFT, ITL, tokens/s and MBU under the protocol of nanoqwen.yaml.

Protocol (batch 1): `warmup` untimed runs of the whole request, then one timed run:
prefill of `prompt_tokens` (TTFT = prompt in -> first token on the device, CUDA events) and
`gen_tokens` decode steps replayed as CUDA graphs, an event between every two steps (ITL =
the time between them; median, p10, p90). MBU = bytes a decode token must read (weights,
scales, lm_head, the KV cache at the mean context) / ITL / the read ceiling measured in the
same process. Speed does not depend on weight values, so synthetic weights are faithful.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.format.layout import bytes_per_decode_token


def git_commit() -> str:
    """The commit measured: NANOQWEN_GIT_COMMIT when set (a copy of the tree without .git,
    as on the device machine), else git's HEAD."""
    import os
    if os.environ.get("NANOQWEN_GIT_COMMIT"):
        return os.environ["NANOQWEN_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def gpu_conditions() -> dict:
    """GPU name and the clocks seen now (nvidia-smi, if present): clocks are not locked."""
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    from nanoqwen_lib.gpu.hardware import hardware
    hw = hardware()
    out = {"gpu": props["name"].decode(), "sms": props["multiProcessorCount"],
           "planned_sms": hw.sms, "hardware": hw.source, "clocks_locked": load().benchmark.lock_clocks}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        sm, mem, max_sm, temp, power = [v.strip() for v in q.stdout.strip().split(",")]
        out.update(sm_clock_mhz=sm, mem_clock_mhz=mem, max_sm_clock_mhz=max_sm, temp_c=temp, power_w=power)
    except Exception:
        pass
    return out


def _stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "mean": float(a.mean()), "n": int(a.size)}


def timed_request(engine, prompt: list[int], gen_tokens: int) -> dict:
    """One request: TTFT and the per-step ITLs, all from CUDA events on the engine's stream."""
    import cupy as cp
    from nanoqwen_lib.measure.timing import events_between, intervals_ms
    s = engine.stream
    start = cp.cuda.Event()
    start.record(s)
    engine.prefill_enqueue(prompt)
    steps = events_between(engine.launch_step, gen_tokens, s)   # the first marks the first token
    s.synchronize()                        # no host sync before here: graphs back to back
    ttft = cp.cuda.get_elapsed_time(start, steps[0])
    itl = intervals_ms(steps)
    ids = engine.arena["s.generated"][len(prompt) - 1:len(prompt) - 1 + gen_tokens + 1].get().tolist()
    return {"ttft_ms": ttft, "itl_ms": itl, "tokens": ids}


def benchmark_e2e(nq_file, prompt_tokens=None, gen_tokens=None, warmup=None, seed=0,
                  progress=print, prefill: str = "tensor-core", breakdown: bool = False,
                  prefill_gemm: str | None = None, decode: str | None = None, baseline: bool = True,
                  prefill_graphs: int | None = None) -> dict:
    """The protocol; with breakdown=True also the ITL breakdown (breakdown.itl_breakdown) on
    the same engine after the timed run. decode: the engine's decode step (default per
    encoding, nanoqwen.yaml engine.decode). With the persistent step and baseline=True the
    kernel-per-op graph is timed too, on its own engine in the same run (`graph_itl_ms`), and
    with breakdown=True one token's timeline of the persistent kernel is summarized against
    each instruction's byte floor (`timeline`). prefill_graphs: GpuBackend's (None: nanoqwen.yaml
    engine.prefill_graphs); with the warm-up runs the timed prefill replays its graphs, and the
    protocol records how many shapes were kept and whether the timed prefill replayed one."""
    from nanoqwen_lib.measure.breakdown import itl_breakdown, prefill_breakdown
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.measure.timing import measure_read_ceiling
    proto = load().benchmark
    prompt_tokens = prompt_tokens or proto.prompt_tokens
    gen_tokens = gen_tokens or proto.gen_tokens
    warmup = proto.warmup if warmup is None else warmup
    dims = nq_file.dims
    prompt = np.random.default_rng(seed).integers(0, 151643, prompt_tokens).tolist()
    progress(f"loading {nq_file.path} onto the GPU")
    max_tokens = prompt_tokens + max(gen_tokens, 128) + 16
    engine = GpuBackend(nq_file, max_tokens=max_tokens, graphs=True, prefill=prefill, prefill_gemm=prefill_gemm,
                        decode=decode, prefill_graphs=prefill_graphs)
    for i in range(warmup):
        progress(f"warm-up {i + 1}/{warmup}")
        timed_request(engine, prompt, gen_tokens)
    progress("timed run")
    replays = engine.prefill_graphs.replays
    run = timed_request(engine, prompt, gen_tokens)
    replayed = engine.prefill_graphs.replays > replays
    parts = pre = tl = graph_run = None
    persistent = engine.decode_mode == "persistent"
    if breakdown and engine.prefill_mode == "tensor-core" and prompt_tokens <= engine.chunk:
        # the prefill is the same whichever decode step follows it
        progress("prefill breakdown (each region alone, against its FLOP floor and cuBLAS FP16)")
        pre = prefill_breakdown(engine, prompt, cublas=True)
    if breakdown and persistent:
        from nanoqwen_lib.measure.timeline import timeline_token
        progress("one token's timeline (the persistent kernel's diagnostic build)")
        tl = timeline_token(engine, prompt)
    if persistent and baseline:
        progress("the kernel-per-op graph on its own engine (the baseline, same run)")
        graph_engine = GpuBackend(nq_file, max_tokens=max_tokens, graphs=True, prefill=prefill,
                                  prefill_gemm=prefill_gemm, decode="graph")
        timed_request(graph_engine, prompt, gen_tokens)                       # warm-up
        graph_run = timed_request(graph_engine, prompt, gen_tokens)
        if breakdown:
            progress("ITL breakdown of the graph (graph and eager steps, then each region alone)")
            parts = itl_breakdown(graph_engine, prompt)
        del graph_engine
    elif breakdown:
        progress("ITL breakdown (graph and eager steps, then each region alone)")
        parts = itl_breakdown(engine, prompt)
    progress("measuring the read ceiling")
    ceiling = measure_read_ceiling()
    itl = _stats(run["itl_ms"])
    ctx_mean = prompt_tokens + gen_tokens // 2
    need = bytes_per_decode_token(dims, ctx_mean, nq_file.encoding)
    bytes_tok = sum(need.values())
    return {
        "protocol": {"batch": proto.batch, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
                     "warmup": warmup, "lock_clocks": proto.lock_clocks,
                     "decode": ("one persistent kernel per token (CUDA graph)" if persistent
                                else "CUDA graphs (a kernel per op)"),
                     "prefill": engine.prefill_kind, "weights": "synthetic (speed does not depend on values)",
                     "prefill_graphs": {"kept": engine.prefill_graphs.kept, "timed_run_replayed": replayed}},
        "model": {"file": str(nq_file.path), "layers": dims.num_layers, "hidden": dims.hidden},
        "ttft_ms": run["ttft_ms"],
        "itl_ms": itl,
        "tokens_per_s": 1000.0 / itl["median"],
        "bytes_per_token": bytes_tok,
        "bytes_breakdown": need,
        "read_ceiling_tbps": ceiling["tbps"],
        "achieved_tbps": bytes_tok / (itl["median"] * 1e-3) / 1e12,
        "mbu": bytes_tok / (itl["median"] * 1e-3) / (ceiling["tbps"] * 1e12),
        "tokens": run["tokens"],
        **({"graph_itl_ms": _stats(graph_run["itl_ms"]),
            "graph_tokens_identical": graph_run["tokens"] == run["tokens"]} if graph_run else {}),
        **({"timeline": tl} if tl else {}),
        **({"itl_breakdown": parts} if parts else {}),
        **({"prefill_breakdown": pre} if pre else {}),
        "conditions": gpu_conditions(),
        "git_commit": git_commit(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_report(r: dict) -> str:
    itl = r["itl_ms"]
    c = r["conditions"]
    lines = [
        f"{c.get('gpu')}  (SM clock {c.get('sm_clock_mhz', '?')} MHz, not locked)  commit {r['git_commit'][:10]}",
        f"protocol  batch {r['protocol']['batch']}, pp{r['protocol']['prompt_tokens']} / tg{r['protocol']['gen_tokens']}, "
        f"warmup {r['protocol']['warmup']}, prefill: {r['protocol']['prefill']}",
        f"TTFT      {r['ttft_ms']:.2f} ms",
        f"ITL       median {itl['median']:.4f} ms  (p10 {itl['p10']:.4f}, p90 {itl['p90']:.4f})",
        f"tokens/s  {r['tokens_per_s']:.1f}",
        f"MBU       {100 * r['mbu']:.1f}%  ({r['bytes_per_token'] / 1e9:.3f} GB/token at "
        f"{r['achieved_tbps']:.2f} TB/s; read ceiling {r['read_ceiling_tbps']:.2f} TB/s measured now)",
    ]
    if "graph_itl_ms" in r:
        g = r["graph_itl_ms"]
        lines.append(f"graph     median {g['median']:.4f} ms (the kernel-per-op step, same run): persistent "
                     f"{g['median'] / itl['median']:.2f}x faster; tokens identical: {r['graph_tokens_identical']}")
    if "timeline" in r:
        from nanoqwen_lib.measure.timeline import format_summary
        lines.append(format_summary(r["timeline"]["summary"]))
    if "itl_breakdown" in r:
        from nanoqwen_lib.measure.breakdown import format_breakdown
        lines.append(format_breakdown(r["itl_breakdown"]))
    if "prefill_breakdown" in r:
        from nanoqwen_lib.measure.breakdown import format_prefill_breakdown
        lines.append(format_prefill_breakdown(r["prefill_breakdown"]))
    if "peers" in r:
        from nanoqwen_lib.measure.peers import format_peers
        lines += format_peers(r)
    return "\n".join(lines)


def write_json(r: dict, path) -> None:
    """Whole or not at all: a temporary file beside it, then a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(r, indent=2, default=str))
    tmp.replace(path)


PERSISTENT_RECORD = Path(__file__).resolve().parents[2] / "book" / "data" / "persistent.json"
RECORD_KINDS = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")


VARIANTS_RECORD = PERSISTENT_RECORD.with_name("persistent-variants.json")


def persistent_variants(path=VARIANTS_RECORD) -> list[dict]:
    """The persistent kernel's measured variants (tools/bench_persistent.py --timelines
    --json, several runs): one dict per row with run (its commit), baseline (what the run's
    other rows change), diagnostic (a run of builds that skip instructions, [pd-skip]: their
    values are meaningless), steps (timed, and compared with the run's first row), label, ms,
    same_tokens, exposed_ms (kind -> ms of one token, RECORD_KINDS) and spread (the per-CTA
    reading, measure.timeline.spread, or None where the run did not take it). A row that
    lacks a field is refused, naming the file, the row and the field."""
    from nanoqwen_lib.errors import NanoqwenError
    path = Path(path)
    r = json.loads(path.read_text())
    out = []
    for i, run in enumerate(r.get("runs") or []):
        if not isinstance(run.get("steps"), int) or run["steps"] < 1:
            raise NanoqwenError(str(path), f"runs[{i}].steps", "the steps each row timed (>= 1)", repr(run.get("steps")))
        for j, row in enumerate(run.get("rows") or []):
            where = f"runs[{i}].rows[{j}]"
            for field in ("label", "ms", "same_tokens", "exposed_ms"):
                if row.get(field) is None:
                    raise NanoqwenError(str(path), f"{where}.{field}", "a measured variant", "missing")
            missing = [k for k in RECORD_KINDS if k not in row["exposed_ms"]]
            if missing:
                raise NanoqwenError(str(path), f"{where}.exposed_ms", ", ".join(RECORD_KINDS), "no " + ", ".join(missing))
            out.append({"run": run.get("commit", "?"), "baseline": run.get("baseline", ""), "steps": run["steps"],
                        "diagnostic": bool(run.get("diagnostic")), "spread": row.get("spread"),
                        **{k: row[k] for k in ("label", "ms", "same_tokens", "exposed_ms")}})
    if not out:
        raise NanoqwenError(str(path), "runs", "at least one run with rows", "none")
    return out


BOUNDS_LABELS = ("baseline", "baseline, again", "no attention", "the streams alone", "the chains alone",
                 "the schedule alone")


def persistent_bounds(path=VARIANTS_RECORD) -> dict:
    """The diagnostic run of the variants record (builds that reduce some instructions to
    their place in the schedule, [pd-skip]): {"run": commit, "rows": label -> row (as
    persistent_variants), "floor_ms": kind -> ms of its bytes at the run's read ceiling}.
    Refused, naming the file and the field, without such a run, one of BOUNDS_LABELS or its
    floors."""
    from nanoqwen_lib.errors import NanoqwenError
    path = Path(path)
    runs = [r for r in json.loads(path.read_text()).get("runs") or [] if r.get("diagnostic")]
    if not runs:
        raise NanoqwenError(str(path), "runs[].diagnostic", "a run of [pd-skip] builds", "none")
    run = runs[-1]
    rows = {r["label"]: r for r in persistent_variants(path) if r["diagnostic"] and r["run"] == run.get("commit", "?")}
    missing = [k for k in BOUNDS_LABELS if k not in rows]
    if missing:
        raise NanoqwenError(str(path), "runs[diagnostic].rows[].label", ", ".join(BOUNDS_LABELS), "no " + ", ".join(missing))
    floors = run.get("floor_ms") or {}
    missing = [k for k in RECORD_KINDS if k not in floors]
    if missing:
        raise NanoqwenError(str(path), "runs[diagnostic].floor_ms", ", ".join(RECORD_KINDS), "no " + ", ".join(missing))
    return {"run": run.get("commit", "?"), "rows": rows, "floor_ms": floors}


SPREAD_FIELDS = ("ready_median", "busy_median", "end_median", "end_last", "tail")


def _persistent_record(path, fields: tuple, what: str) -> dict:
    """Chapter 10's record at path, refused (naming the file and the field) without fields."""
    from nanoqwen_lib.errors import NanoqwenError
    r = json.loads(Path(path).read_text())
    for field in fields:
        if field not in r:
            raise NanoqwenError(str(path), field, what, "missing")
    return r


def persistent_spread(path=PERSISTENT_RECORD, record: dict | None = None) -> dict:
    """Chapter 10's per-CTA reading of its timeline (measure.timeline.spread) for the layer
    kinds, in us: kind -> the spread's fields (SPREAD_FIELDS) and floor (the kind's byte floor
    per layer, from the same record's timeline). From `record` (a run's record in memory, as
    chapter 10 writes it) or, without one, the file at path. A record without them is
    refused, naming the file (or the run) and the field."""
    from nanoqwen_lib.errors import NanoqwenError
    if record is None:
        r = _persistent_record(path, ("spread", "timeline"), "the persistent step's record with its spread (chapter 10)")
    else:
        r, path = record, "the run's record (in memory)"
        for field in ("spread", "timeline"):
            if field not in r:
                raise NanoqwenError(path, field, "the persistent step's record with its spread (chapter 10)", "missing")
    out = {}
    for k in RECORD_KINDS[:-1]:
        sp, tk = r["spread"].get(k), r["timeline"]["kinds"].get(k)
        if sp is None or tk is None:
            raise NanoqwenError(str(path), f"spread.{k}" if sp is None else f"timeline.kinds.{k}", "a layer kind", "missing")
        missing = [f for f in SPREAD_FIELDS if f not in sp]
        if missing:
            raise NanoqwenError(str(path), f"spread.{k}", ", ".join(SPREAD_FIELDS), "no " + ", ".join(missing))
        out[k] = {**{f: sp[f] / 1e3 for f in SPREAD_FIELDS}, "floor": tk["floor_ns"] / tk["count"] / 1e3}
    return out


def persistent_figures(path=PERSISTENT_RECORD) -> dict:
    """The headline figures of the persistent step's run (chapter 10 writes the record), for
    the chapters that quote them: itl_ms and graph_itl_ms (both steps, same run), speedup
    (graph over persistent), floor_ms, of_ceiling (floor over ITL), rate (kind -> floor over
    the exposed time of the timeline, for the GEMVs and lm_head), layer_us (the layer kinds'
    exposed time per layer) and layer_floor_us, and commit and gpu for the conditions.
    A record without these fields is refused, naming the file and the field."""
    from nanoqwen_lib.errors import NanoqwenError
    r = _persistent_record(path, ("itl_ms", "graph_itl_ms", "floor_ms", "git_commit", "conditions", "timeline"),
                           "the persistent step's record (chapter 10)")
    kinds = r["timeline"]["kinds"]
    missing = [k for k in RECORD_KINDS if k not in kinds]
    if missing:
        raise NanoqwenError(str(path), "timeline.kinds", ", ".join(RECORD_KINDS), "no " + ", ".join(missing))
    layers = kinds["qkv"]["count"]
    layer_kinds = RECORD_KINDS[:-1]
    return {"itl_ms": r["itl_ms"], "graph_itl_ms": r["graph_itl_ms"], "speedup": r["graph_itl_ms"] / r["itl_ms"],
            "floor_ms": r["floor_ms"], "of_ceiling": r["floor_ms"] / r["itl_ms"],
            "rate": {k: kinds[k]["floor_ns"] / kinds[k]["exposed_ns"] for k in RECORD_KINDS if k != "attention"},
            "layer_us": sum(kinds[k]["exposed_ns"] for k in layer_kinds) / layers / 1e3,
            "layer_floor_us": sum(kinds[k]["floor_ns"] for k in layer_kinds) / layers / 1e3,
            "commit": r["git_commit"][:7], "gpu": r["conditions"].get("gpu", "?")}
