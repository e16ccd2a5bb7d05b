"""How much of the prefill is the host's: the 7B's tensor-core prefill of one 512-token chunk,
eager (the engine's prefill_launches, one Python launch each) against the same launches
captured once into a CUDA graph and replayed, and the host's own time to enqueue them.

    python3 tools/prefill_host.py [--gemms rs wgmma] [--fp8] [--json OUT]   (needs a GPU)

Per prefill GEMM (INT4 file; --fp8: also the FP8 file on its default): host ms to enqueue the
launches (perf_counter, no sync), eager GPU ms (CUDA events around the enqueue), graph replay
ms (timing.time_cuda: events, median of 10), and whether the graph's p.x is bitwise the eager
one; then TTFT through the engine (bench.timed_request) without and with PrefillGraphs. Then each
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
    from nanoqwen_lib.gpu.engine import GpuBackend, PrefillGraphs
    from nanoqwen_lib.measure.bench import timed_request
    from nanoqwen_lib.measure.timing import time_cuda
    eng = GpuBackend(nq_file, max_tokens=tokens + 64, graphs=True, prefill_gemm=gemm, decode="graph",
                     prefill_graphs=0)
    prompt = np.random.default_rng(0).integers(0, 151643, tokens).tolist()
    s = eng.stream
    for _ in range(2):                              # modules, tensor maps and workspaces built
        timed_request(eng, prompt, 1)

    def chunk():                                    # the chunk's launches, eager (prefill_graphs 0)
        eng.prefill_chunk(0, tokens)

    host = []
    with s:
        for _ in range(reps):
            s.synchronize()
            t0 = time.perf_counter()
            chunk()
            host.append((time.perf_counter() - t0) * 1e3)
        s.synchronize()
        out = {"gemm": gemm or "default", "kind": eng.prefill_kind, "launches": len(eng.prefill_launches(0, tokens)),
               "host_enqueue_ms": float(np.median(host)),
               "eager_ms": time_cuda(chunk, warmup=0, iters=reps)["median"]}
        ref = eng.arena["p.x"][:tokens].copy()
        eng.arena["p.x"][:tokens].fill(cp.float16(np.nan))   # the replays must write every row
        try:
            out["graph_ms"] = time_cuda(chunk, warmup=0, iters=10, graph=True)["median"]
            out["graph_equal"] = bool((eng.arena["p.x"][:tokens] == ref).all())
        except Exception as e:                      # noqa: BLE001 - what stops a capture is the finding
            out["graph_error"] = f"{type(e).__name__}: {e}"
    # The engine's own path (bench.timed_request: reset, prompt copy, chunks, head), eager and
    # with PrefillGraphs (two untimed runs: eager, then eager + capture)
    runs = [timed_request(eng, prompt, 1) for _ in range(reps)]
    out["enqueue_eager_ms"], tok = float(np.median([r["ttft_ms"] for r in runs])), runs[0]["tokens"][0]
    eng.prefill_graphs = PrefillGraphs(4)
    timed_request(eng, prompt, 1), timed_request(eng, prompt, 1)
    runs = [timed_request(eng, prompt, 1) for _ in range(reps)]
    out["enqueue_graphs_ms"] = float(np.median([r["ttft_ms"] for r in runs]))
    out["graphs_same_token"] = all(r["tokens"][0] == tok for r in runs) and eng.prefill_graphs.replays == reps
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
