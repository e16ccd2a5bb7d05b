#!/usr/bin/env python3
"""Time paged attention (split kernel + combine) on the 7B heads, one decode token.

    python3 tools/bench_attention.py [--contexts 512,2000,8192,32768] [--splits 16,32,64,96,128]

Napkin math: a context of T tokens reads K and V once, T x 4 KV heads x 128 x 2 B x 2 =
2 KiB per token (64 MiB at 32768), so at the read ceiling (~4.5 TB/s here, re-measured in
this process) the floor is ~15 us at 32768 and ~0.23 us at 512, where launch latency and
the per-CTA prologue dominate instead. Method (book/design.md, the measurement protocol): each
timed unit is a CUDA graph of R launches over R different page tables of one pool with
R x bytes >= 256 MiB, so the data never sits in the 60 MiB L2 between launches; events
around graph replays, warm-up, median over replays, divided by R. K/V are random fp16 (not
zeros), pages shuffled. Prints a table last; --out writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoqwen_lib.model import kvcache  # noqa: E402
from nanoqwen_lib.config import load  # noqa: E402
from nanoqwen_lib.gpu.ops_attention import AttentionWorkspace, kernels  # noqa: E402
from nanoqwen_lib.measure.timing import measure_read_ceiling, time_cuda  # noqa: E402

ROTATION_BYTES = 256 << 20


def kv_bytes(dims, ctx: int) -> int:
    """Bytes of K and V a decode step must read: every token, every KV head, once."""
    return ctx * dims.num_kv_heads * dims.head_dim * 2 * 2


def bench_context(dims, ctx: int, splits: list[int], rng) -> list[dict]:
    import cupy as cp
    pages = kvcache.pages_for(ctx)
    rot = int(min(128, max(1, -(-ROTATION_BYTES // kv_bytes(dims, ctx)))))
    pool = cp.random.standard_normal((1, 2, rot * pages, dims.num_kv_heads, 16, dims.head_dim),
                                     dtype=cp.float32).astype(cp.float16)
    perm = rng.permutation(rot * pages).astype(np.int32).reshape(rot, pages)
    tables = [cp.asarray(row) for row in perm]                     # R page tables over one pool
    q = cp.asarray((1.5 * rng.standard_normal(dims.q_dim)).astype(np.float16))
    out = cp.empty(dims.q_dim, cp.float16)
    context_len = cp.asarray([ctx], cp.int32)
    kern = kernels(dims)
    # The setup above ran on the legacy stream (RNG kernels, pageable copies that return
    # before the device write lands); the graph replays on a non-blocking stream, which does
    # not wait for it: finish the setup first, or the kernels read half-written page tables.
    cp.cuda.runtime.deviceSynchronize()
    rows = []
    for ms in splits:
        ws = AttentionWorkspace(dims, max_context=ctx, max_splits=ms)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            for table in tables:
                kern.paged_attention(q, pool[0, 0], pool[0, 1], table, context_len, out, ws)
            graph = stream.end_capture()
            t = time_cuda(lambda: graph.launch(stream), warmup=3, iters=15)
        us = t["median"] * 1e3 / rot
        rows.append({"ctx": ctx, "max_splits": ms, "ctas": dims.num_kv_heads * min(ms, pages),
                     "rotation": rot, "us": us, "p10_us": t["p10"] * 1e3 / rot, "p90_us": t["p90"] * 1e3 / rot,
                     "bytes": kv_bytes(dims, ctx), "gbps": kv_bytes(dims, ctx) / (us * 1e-6) / 1e9})
    del pool
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="7b")
    ap.add_argument("--contexts", default="512,2000,8192,32768")
    ap.add_argument("--splits", default="16,32,64,96,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy as cp
    dims = load().model(args.config)
    ceiling = measure_read_ceiling(2 << 30)["tbps"]
    rng = np.random.default_rng(0)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        rows += bench_context(dims, ctx, [int(s) for s in args.splits.split(",")], rng)
    for r in rows:
        r["frac_of_ceiling"] = r["gbps"] / (ceiling * 1e3)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": dev, "read_ceiling_tbps": ceiling,
                                              "config_ceiling_tbps": load().benchmark.read_ceiling_tbps,
                                              "rows": rows}, indent=1))
    print(f"paged attention, {args.config} heads ({dims.num_heads}/{dims.num_kv_heads}, d {dims.head_dim}), "
          f"{dev}, read ceiling measured {ceiling:.2f} TB/s; us = split + combine, median")
    print(f"{'ctx':>6} {'splits':>6} {'CTAs':>5} {'us':>8} {'GB/s':>7} {'ceil%':>6}")
    for r in rows:
        print(f"{r['ctx']:>6} {r['max_splits']:>6} {r['ctas']:>5} {r['us']:>8.2f} {r['gbps']:>7.0f} "
              f"{100 * r['frac_of_ceiling']:>5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
