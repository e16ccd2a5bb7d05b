"""How much of the prefill is the host's: the 7B's tensor-core prefill of one 512-token chunk,
eager (the engine's prefill_launches, one Python launch each) against the same launches
captured once into a CUDA graph and replayed, and the host's own time to enqueue them.

    python3 tools/prefill_host.py [--gemms rs wgmma] [--fp8] [--json OUT]   (needs a GPU)

Per prefill GEMM (INT4 file; --fp8: also the FP8 file on its default): host ms to enqueue the
launches (perf_counter, no sync), eager GPU ms (CUDA events around the enqueue), graph replay
ms (events, median of 10), and whether the graph's p.x is bitwise the eager one. Then each
projection's GEMM timed eagerly and in a graph of 10 launches (--rates; prefill_gemms.rates; cuBLAS
eager only, it refuses capture), so a per-GEMM time that is the host's shows as the gap.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def probe(nq_file, gemm: str | None, tokens: int, reps: int = 5) -> dict:
    import cupy as cp
    from nanoqwen_lib.gpu.engine import GpuBackend
    eng = GpuBackend(nq_file, max_tokens=tokens + 64, graphs=True, prefill_gemm=gemm, decode="graph")
    prompt = np.random.default_rng(0).integers(0, 151643, tokens).tolist()
    s = eng.stream
    for _ in range(2):
        eng.prefill_enqueue(prompt)
        s.synchronize()
    launches = [fn for _, fn in eng.prefill_launches(0, tokens)]

    def eager():
        with s:
            for fn in launches:
                fn()

    host, gpu = [], []
    for _ in range(reps):
        s.synchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        a.record(s)
        eager()
        b.record(s)
        host.append((time.perf_counter() - t0) * 1e3)
        b.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(a, b))
    ref = eng.arena["p.x"][:tokens].copy()
    out = {"gemm": gemm or "default", "kind": eng.prefill_kind, "launches": len(launches),
           "host_enqueue_ms": float(np.median(host)), "eager_ms": float(np.median(gpu))}
    try:
        with s:
            s.begin_capture()
            for fn in launches:
                fn()
            g = s.end_capture()
        g.upload(s)
        eng.arena["p.x"][:tokens].fill(0)
        ms = []
        for _ in range(10):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            ms.append(cp.cuda.get_elapsed_time(a, b))
        out["graph_ms"] = float(np.median(ms))
        out["graph_equal"] = bool((eng.arena["p.x"][:tokens] == ref).all())
    except Exception as e:                      # noqa: BLE001 - what stops a capture is the finding
        out["graph_error"] = f"{type(e).__name__}: {e}"
    # The engine's own path (prefill_enqueue: reset, prompt copy, chunks, head), eager and with
    # PrefillGraphs (two untimed runs: eager, then eager + capture)
    from nanoqwen_lib.gpu.engine import PrefillGraphs

    def timed():
        s.synchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        eng.prefill_enqueue(prompt)
        b.record(s)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b), eng.token_at(tokens - 1)

    eng.prefill_graphs = PrefillGraphs(0)
    runs = [timed() for _ in range(reps)]
    out["enqueue_eager_ms"], tok = float(np.median([r[0] for r in runs])), runs[0][1]
    eng.prefill_graphs = PrefillGraphs(4)
    timed(), timed()
    runs = [timed() for _ in range(reps)]
    out["enqueue_graphs_ms"] = float(np.median([r[0] for r in runs]))
    out["graphs_same_token"] = all(r[1] == tok for r in runs) and len(eng.prefill_graphs) == 1
    del eng
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemms", nargs="+", default=["rs", "wgmma"])
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rates", action="store_true", help="also each GEMM eager and in a graph of 10 launches")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from nanoqwen_lib.config import load
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.measure import prefill_gemms
    from nanoqwen_lib.synthetic.packed import packed_synthetic_direct
    rows = []
    f = NanoqwenFile.open(packed_synthetic_direct("7b"), verify_payload=False)
    for g in a.gemms:
        rows.append(probe(f, g, a.tokens))
        print(json.dumps(rows[-1]), flush=True)
    if a.fp8:
        f8 = NanoqwenFile.open(packed_synthetic_direct("7b", weights="fp8"), verify_payload=False)
        rows.append(probe(f8, None, a.tokens) | {"file": "fp8"})
        print(json.dumps(rows[-1]), flush=True)
    result = {"prefill": rows}
    if a.rates:
        kernels = ("rs", "wgmma", "cublas fp16", "fp8 wgmma")
        dims = load().model("7b")
        result["rates_eager"] = prefill_gemms.rates(dims, a.tokens, kernels=kernels)
        result["rates_graph"] = prefill_gemms.rates(dims, a.tokens, kernels=kernels[:2] + kernels[3:], graph=True)
        print(f"{'matrix':<9}{'kernel':>13}{'eager us':>10}{'graph us':>10}")
        graphed = {(g["matrix"], g["kernel"]): g["ms"] for g in result["rates_graph"]}   # cuBLAS: not capturable
        for e in result["rates_eager"]:
            g = graphed.get((e["matrix"], e["kernel"]), float("nan"))
            print(f"{e['matrix']:<9}{e['kernel']:>13}{e['ms'] * 1e3:>10.1f}{g * 1e3:>10.1f}")
    print(f"{'prefill':<10}{'launches':>9}{'host ms':>9}{'eager ms':>9}{'graph ms':>9}  equal"
          f"{'engine eager':>14}{'engine graphs':>14}  same token")
    for r in rows:
        print(f"{r['gemm'] + ('/fp8' if r.get('file') else ''):<10}{r['launches']:>9}{r['host_enqueue_ms']:>9.2f}"
              f"{r['eager_ms']:>9.2f}{r.get('graph_ms', float('nan')):>9.2f}  {r.get('graph_equal', r.get('graph_error'))}"
              f"{r['enqueue_eager_ms']:>14.2f}{r['enqueue_graphs_ms']:>14.2f}  {r['graphs_same_token']}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
