#!/usr/bin/env python3
"""One small decode step of the attention path, for compute-sanitizer and the bug demo.

    compute-sanitizer --tool racecheck python3 tools/sanitize_attention.py --variant fixed
    python3 tools/sanitize_attention.py --variant buggy --runs 8 --max-splits 64,1 --json

A run draws fresh inputs: a context of --ctx tokens (default 49 = 3 full pages + 1 token,
the tail-page case) at shuffled physical pages of a NaN-poisoned pool; rope_append writes
the last token (position ctx-1) into its slot and rotates q; paged attention (split +
combine) runs over the whole context. The output is compared, every element, with a
float64 reference built from what the cache then holds. Prints one line per --max-splits
value (or JSON with --json); exits 0 whatever the comparison says: the verdict is the
caller's (tests/test_gpu_attention.py), and under compute-sanitizer the sanitizer's.
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
from nanoqwen_lib.gpu.ops_attention import AttentionKernels, AttentionWorkspace  # noqa: E402
from nanoqwen_lib.model.kvcache import attention_ref_f64, attention_tolerance, random_paged_case  # noqa: E402


def decode_step(kern: AttentionKernels, ws: AttentionWorkspace, ctx: int, rng) -> tuple[bool, float]:
    """One fresh case -> (wrong, max |out - ref|)."""
    import cupy as cp
    d = kern.dims
    _, _, _, pool_h, table = random_paged_case(d, ctx, rng, ws.max_pages)
    pool = cp.asarray(pool_h)
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    qkv = cp.asarray(rng.standard_normal(d.qkv_dim).astype(np.float16))
    position = cp.asarray([ctx - 1], dtype=cp.int32)
    slot = cp.asarray([table.slot_mapping(ctx - 1)], dtype=cp.int32)
    q = cp.full(d.q_dim, np.nan, dtype=cp.float16)
    out = cp.full(d.q_dim, np.nan, dtype=cp.float16)
    block_table = cp.asarray(table.block_table)
    context_len = cp.asarray([ctx], dtype=cp.int32)
    ws.poison()
    kern.rope_append_kv(qkv, position, slot, k_cache, v_cache, q)
    kern.paged_attention(q, k_cache, v_cache, block_table, context_len, out, ws)
    cp.cuda.runtime.deviceSynchronize()
    k, v = kvcache.gather_kv(cp.asnumpy(pool), 0, table.block_table, ctx)
    ref = attention_ref_f64(cp.asnumpy(q), k, v, d)
    got = cp.asnumpy(out).astype(np.float64)
    err = np.abs(got - ref)
    wrong = (not np.isfinite(got).all()) or bool((err > attention_tolerance(ref)).any())
    return wrong, float(np.nanmax(err)) if np.isfinite(err).any() else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("fixed", "buggy"), default="fixed")
    ap.add_argument("--config", default="7b")
    ap.add_argument("--ctx", type=int, default=49)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-splits", default="64", help="comma-separated grid sizes to try")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dims = load().model(args.config)
    kern = AttentionKernels(dims, buggy_sync=args.variant == "buggy")
    rows = []
    for ms in (int(s) for s in args.max_splits.split(",")):
        ws = AttentionWorkspace(dims, max_context=args.ctx, max_splits=ms)
        rng = np.random.default_rng([args.seed, ms, args.ctx])
        results = [decode_step(kern, ws, args.ctx, rng) for _ in range(args.runs)]
        rows.append({"variant": args.variant, "config": args.config, "ctx": args.ctx, "max_splits": ms,
                     "runs": args.runs, "wrong_runs": sum(w for w, _ in results),
                     "max_abs_err": max(e for _, e in results)})
    for r in rows:
        print(json.dumps(r) if args.json else
              "variant={variant} config={config} ctx={ctx} max_splits={max_splits} "
              "wrong={wrong_runs}/{runs} max_abs_err={max_abs_err:.3g}".format(**r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
