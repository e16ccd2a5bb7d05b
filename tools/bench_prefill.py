"""Time the prefill kernels at the 7B shapes (needs a GPU): python tools/bench_prefill.py [--tokens 512].

For each INT4 GEMM of a layer (qkv + bias, o_proj + residual, gate_up, down with the SwiGLU
input fused or as a separate pass) at both token tiles (BM 64 / 128), the RoPE + KV write
and the attention: median of --reps launches, each timed by its own pair of CUDA events
after --warmup launches; random inputs (speed does not depend on weight values: synthetic
weights are faithful). Rates against the H200 ceilings of shared/device/README.md: ~790
TFLOP/s dense fp16 and 4.5 TB/s read; bytes are the fewest the op must move (each input
read once, each output written once). Where torch is present, its fp16 matmul (cuBLAS,
dense fp16 weights) on the same shape is the peer. The per-layer sum times 28 layers
estimates the prefill's share of TTFT (rmsnorms, embedding and the final lm_head GEMV are
not in it: ~0.3 ms together at T = 512).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoqwen_lib import config  # noqa: E402
from nanoqwen_lib.model import kvcache
from nanoqwen_lib.format import layout
from nanoqwen_lib.gpu import ops_prefill

PEAK_TFLOPS = 790.0
READ_TBPS = 4.5


def median_us(fn, warmup: int, reps: int) -> float:
    import cupy as cp
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    return float(np.median(times))


def rand16(rng, shape, scale=1.0):
    import cupy as cp
    return cp.asarray((scale * rng.standard_normal(shape)).astype(np.float16))


def rand_int4(rng, n, k):
    import cupy as cp
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    return cp.asarray(words), cp.asarray(scales)


def gemm_row(name, us, t, n, k, extra_bytes=0):
    flops = 2.0 * t * n * k
    nbytes = t * k * 2 + n * k // 2 + n * (k // 128) * 2 + t * n * 2 + extra_bytes
    return {"op": name, "us": us, "tflops": flops / us / 1e6, "pct_peak": 100 * flops / us / 1e6 / PEAK_TFLOPS,
            "gbs": nbytes / us / 1e3, "pct_bw": 100 * nbytes / us / 1e6 / READ_TBPS}


def torch_peer(t, n, k, warmup, reps):
    """cuBLAS fp16 X W^T with dense fp16 weights (torch), or None without torch+CUDA."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    x = torch.randn(t, k, dtype=torch.float16, device="cuda")
    w = torch.randn(n, k, dtype=torch.float16, device="cuda")
    y = torch.empty(t, n, dtype=torch.float16, device="cuda")

    def run():
        torch.matmul(x, w.t(), out=y)
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return float(np.median(times))


def gemm_configs(t, n, k):
    """Launch configs to time: every build at split 1, split-K 2..4 on the small-N shapes,
    and the plan's choice (ops_prefill.plan_gemm)."""
    cfgs = [dict(bm=bm, warps_m=w, split=1) for bm in ops_prefill.GEMM_BM_CHOICES for w in (2, 4)]
    if n <= 8192:
        cfgs += [dict(bm=64, warps_m=w, split=s) for w in (2, 4) for s in (2, 3, 4)]
    bm, split = ops_prefill.plan_gemm(t, n, k)
    planned = dict(bm=bm, warps_m=ops_prefill.GEMM_WARPS_M, split=split)
    return ([planned] if planned not in cfgs else []) + cfgs, planned


def cfg_name(c):
    return f"bm{c['bm']} w{c['warps_m']} s{c['split']}"


def bench_gemms(dims, t, rng, warmup, reps, only=None):
    import cupy as cp
    rows, best = [], {}
    for proj, (n, k) in layout.decode_gemv_shapes(dims).items():      # the same four matrices as decode
        if only and proj != only:
            continue
        words, scales = rand_int4(rng, n, k)
        out = rand16(rng, (t, n))
        x = rand16(rng, (t, k))
        bias = rand16(rng, (n,)) if proj == "qkv" else None
        res = out if proj in ("o_proj", "down") else None
        cfgs, planned = gemm_configs(t, n, k)
        cands = {}
        for c in cfgs:
            us = median_us(lambda: ops_prefill.gemm_int4(x, words, scales, out, bias=bias, residual=res, **c),
                           warmup, reps)
            cands[f"{proj} {cfg_name(c)}"] = us
            rows.append(gemm_row(f"{proj} {cfg_name(c)}" + (" *plan" if c == planned else ""), us, t, n, k))
        if proj == "down":
            gate_up = rand16(rng, (t, 2 * k), 2.0)
            act = cp.empty((t, k), cp.float16)
            fused = {}
            for c in [planned] + [c for c in cfgs if c["split"] == 1 and c != planned]:
                us = median_us(lambda: ops_prefill.gemm_int4_swiglu(gate_up, words, scales, out, residual=out, **c),
                               warmup, reps)
                fused[f"down fused {cfg_name(c)}"] = us
                rows.append(gemm_row(f"down fused {cfg_name(c)}", us, t, n, k, t * k * 2))
            us_act = median_us(lambda: ops_prefill.swiglu_act(gate_up, act), warmup, reps)
            rows.append({"op": "swiglu_act", "us": us_act, "tflops": 0.0, "pct_peak": 0.0,
                         "gbs": t * k * 6 / us_act / 1e3, "pct_bw": 100 * t * k * 6 / us_act / 1e6 / READ_TBPS})
            plain = min(cands, key=cands.get)                      # the best plain GEMM on act
            cands = dict(fused) | {f"act + {plain}": us_act + cands[plain]}
        if not only:
            peer = torch_peer(t, n, k, warmup, reps)
            if peer:
                rows.append(gemm_row(f"{proj} torch fp16 (peer)", peer, t, n, k) | {"peer": True})
        choice = min(cands, key=cands.get)
        best[proj] = (choice, cands[choice], cfg_name(planned))
    return rows, best


def bench_fp8_gemms(dims, t, rng, warmup, reps):
    """The FP8 prefill GEMMs (issue 7) at the 7B shapes: the per-token E4M3 quantizer, then
    gemm_fp8 on each implementation (mma_sync: FP16 HMMA after an unpack, as ptxas lowers E4M3
    mma.sync on sm_90; wgmma: QGMMA on sm_90a). Weight bytes are one per weight."""
    import cupy as cp
    from nanoqwen_lib.gpu import ops_fp8
    from nanoqwen_lib.gpu.lab import fp8 as lab_fp8
    rows = []
    for proj, (n, k) in layout.decode_gemv_shapes(dims).items():
        codes = cp.asarray(rng.integers(0, 0x7F, size=(n, k), dtype=np.uint8) | (rng.integers(0, 2, size=(n, k),
                           dtype=np.uint8) << 7))                  # every finite E4M3 code, both signs
        scales = cp.asarray(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        x = rand16(rng, (t, k))
        xq, ts = cp.empty((t, k), cp.uint8), cp.empty(t, cp.float32)
        out = rand16(rng, (t, n))
        us_q = median_us(lambda: ops_fp8.quantize_rows_fp8(x, xq, ts), warmup, reps)
        rows.append({"op": f"fp8 {proj} quantize x", "us": us_q, "tflops": 0.0, "pct_peak": 0.0,
                     "gbs": t * k * 3 / us_q / 1e3, "pct_bw": 100 * t * k * 3 / us_q / 1e6 / READ_TBPS})
        for impl in lab_fp8.GEMM_IMPLS:
            us = median_us(lambda: lab_fp8.gemm_fp8(xq, ts, codes, scales, out, impl=impl), warmup, reps)
            flops = 2.0 * t * n * k
            nbytes = t * k + n * k + n * 4 + t * n * 2
            rows.append({"op": f"fp8 {proj} {impl}", "us": us, "tflops": flops / us / 1e6,
                         "pct_peak": 100 * flops / us / 1e6 / PEAK_TFLOPS, "gbs": nbytes / us / 1e3,
                         "pct_bw": 100 * nbytes / us / 1e6 / READ_TBPS})
    return rows


# --quick: the INT4 (bn, split) candidates per shape (v3's best, bn256, and bn 128 / 112 with the v5
# kernel's 2 producer warpgroups), FP8 the plan only.
QUICK_INT4 = {"qkv": ((256, 1), (144, 1), (128, 1), (112, 1)), "o_proj": ((256, 2), (128, 1), (112, 1), (128, 2)),
              "gate_up": ((256, 1), (128, 1), (112, 1)), "down": ((256, 2), (256, 4), (128, 1), (112, 1), (128, 2))}


def bench_wgmma(dims, t, rng, warmup, reps, sweep=True, quick=False):
    """The four GEMMs of a layer (issue 17): wgmma (the plan, and with --sweep every BN build
    at split 1 and split-K 2..4) vs mma.sync (its plan) vs torch fp16 matmul (cuBLAS, dense
    fp16 weights) in the same process; gate_up also fused with the SwiGLU (act [T, I] out);
    FP8 (E4M3 both operands) wgmma vs mma. -> (rows, summary)."""
    import cupy as cp
    from nanoqwen_lib.gpu import ops_fp8
    rows, summary = [], {}
    for proj, (n, k) in layout.decode_gemv_shapes(dims).items():
        words, scales = rand_int4(rng, n, k)
        x = rand16(rng, (t, k))
        out = rand16(rng, (t, n))
        bias = rand16(rng, (n,)) if proj == "qkv" else None
        res = out if proj in ("o_proj", "down") else None
        flops = 2.0 * t * n * k

        def add(name, us, **kw):
            rows.append({"op": f"{proj} {name}", "us": us, "tflops": flops / us / 1e6, **kw})
            return us
        bn, split = ops_prefill.plan_wgmma(t, n, k)
        cands = {f"wgmma plan bn{bn} s{split}": add(f"wgmma plan bn{bn} s{split}", median_us(
            lambda: ops_prefill.gemm_int4(x, words, scales, out, bias=bias, residual=res, kernel="wgmma"), warmup, reps))}
        if sweep or quick:
            pairs = (QUICK_INT4.get(proj, ()) if quick else
                     [(b, sp) for b in ops_prefill.WGMMA_BN_CHOICES for sp in ((1, 2, 3, 4) if n <= 8192 else (1,))])
            for b, sp in pairs:
                    if (b, sp) == (bn, split):
                        continue
                    name = f"wgmma bn{b} s{sp}"
                    try:
                        cands[name] = add(name, median_us(lambda: ops_prefill.gemm_int4(
                            x, words, scales, out, bias=bias, residual=res, kernel="wgmma", bn=b, split=sp),
                            warmup, reps))
                    except Exception as e:       # a split the workspace refuses
                        print(f"{proj} {name}: {e}")
        mma = add("mma.sync plan", median_us(lambda: ops_prefill.gemm_int4(x, words, scales, out, bias=bias,
                                                                          residual=res, kernel="mma"), warmup, reps))
        peer = torch_peer(t, n, k, warmup, reps)
        if peer:
            add("torch fp16 (cuBLAS)", peer)
        best = min(cands, key=cands.get)
        summary[proj] = {"wgmma_best": best, "wgmma_best_us": cands[best], "wgmma_plan_us": next(iter(cands.values())),
                         "mma_us": mma, "torch_us": peer, "flops": flops}
        if proj == "gate_up":
            act, gu = cp.empty((t, n // 2), cp.float16), cp.empty((t, n), cp.float16)
            fused = add("wgmma fused swiglu (plan)", median_us(
                lambda: ops_prefill.gemm_int4_gate_up_swiglu(x, words, scales, act), warmup, reps))
            us_act = median_us(lambda: ops_prefill.swiglu_act(gu, act), warmup, reps)
            summary[proj].update(fused_us=fused, swiglu_act_us=us_act)
            if quick:   # bn 128: the 2-producer-warpgroup build (v5)
                add("wgmma fused swiglu bn128 s1", median_us(
                    lambda: ops_prefill.gemm_int4_gate_up_swiglu(x, words, scales, act, bn=128, split=1), warmup, reps))
        # FP8: E4M3 codes over every finite value, both signs
        codes = cp.asarray(rng.integers(0, 0x7F, size=(n, k), dtype=np.uint8) | (rng.integers(0, 2, size=(n, k),
                           dtype=np.uint8) << 7))
        s8 = cp.asarray(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        xq, ts = cp.empty((t, k), cp.uint8), cp.empty(t, cp.float32)
        ops_fp8.quantize_rows_fp8(x, xq, ts)
        f8w = add("fp8 wgmma plan", median_us(lambda: ops_fp8.gemm_fp8(xq, ts, codes, s8, out, bias=bias, residual=res,
                                                                      kernel="wgmma"), warmup, reps))
        if sweep and not quick:
            for b in ops_fp8.WGMMA_FP8_BN_CHOICES:
                for sp in (1, 2) if n <= 8192 else (1,):
                    try:
                        add(f"fp8 wgmma bn{b} s{sp}", median_us(lambda: ops_fp8.gemm_fp8(
                            xq, ts, codes, s8, out, bias=bias, residual=res, kernel="wgmma", bn=b, split=sp),
                            warmup, reps))
                    except Exception as e:
                        print(f"{proj} fp8 wgmma bn{b} s{sp}: {e}")
        f8m = add("fp8 mma.sync", median_us(lambda: ops_fp8.gemm_fp8(xq, ts, codes, s8, out, bias=bias, residual=res),
                                            warmup, reps))
        summary[proj].update(fp8_wgmma_us=f8w, fp8_mma_us=f8m)
    return rows, summary


def print_wgmma(dims, t, rows, summary):
    print(f"\nprefill GEMMs, 7B, T={t}: wgmma vs mma.sync vs cuBLAS (median us, TFLOP/s)")
    for r in rows:
        print(f"  {r['op']:36s} {r['us']:9.1f} {r['tflops']:7.1f}")
    tot = {key: sum(v[key] for v in summary.values() if v.get(key)) for key in
           ("wgmma_best_us", "wgmma_plan_us", "mma_us", "torch_us", "fp8_wgmma_us", "fp8_mma_us")}
    flops = sum(v["flops"] for v in summary.values())
    print(f"{'shape':8s} {'wgmma plan':>12s} {'wgmma best':>12s} {'mma.sync':>10s} {'cuBLAS':>10s} "
          f"{'fp8 wgmma':>10s} {'fp8 mma':>10s}  (TFLOP/s)")
    for proj, v in list(summary.items()) + [("layer", dict(tot, flops=flops))]:
        rate = {key: (v["flops"] / v[key] / 1e6 if v.get(key) else float("nan")) for key in tot}
        print(f"{proj:8s} {rate['wgmma_plan_us']:12.1f} {rate['wgmma_best_us']:12.1f} {rate['mma_us']:10.1f} "
              f"{rate['torch_us']:10.1f} {rate['fp8_wgmma_us']:10.1f} {rate['fp8_mma_us']:10.1f}")
    print(f"per layer (us): " + ", ".join(f"{key} {val:.1f}" for key, val in tot.items()) +
          f"; x{dims.num_layers} layers wgmma plan {tot['wgmma_plan_us'] * dims.num_layers / 1e3:.2f} ms, "
          f"cuBLAS {tot['torch_us'] * dims.num_layers / 1e3:.2f} ms")
    return tot


def bench_attention(dims, t, rng, warmup, reps):
    import cupy as cp
    pages = kvcache.pages_for(t)
    pool = cp.zeros((2, pages, dims.num_kv_heads, kvcache.PAGE_TOKENS, dims.head_dim), cp.float16)
    bt = cp.asarray(rng.permutation(pages).astype(np.int32))
    qkv = rand16(rng, (t, dims.qkv_dim))
    q = cp.empty((t, dims.num_heads, dims.head_dim), cp.float16)
    out = cp.empty((t, dims.q_dim), cp.float16)
    us_rope = median_us(lambda: ops_prefill.prefill_rope_write_kv(qkv, pool[0], pool[1], bt, q, dims),
                        warmup, reps)
    us_attn = median_us(lambda: ops_prefill.prefill_attention(q, pool[0], pool[1], bt, out, dims), warmup, reps)
    rope_bytes = t * dims.qkv_dim * 2 * 2
    attn_flops = 4.0 * dims.num_heads * dims.head_dim * t * (t + 1) / 2          # causal QK^T and PV
    attn_bytes = t * dims.q_dim * 2 * 2 + t * dims.kv_dim * 2 * 2
    return [{"op": "rope_write_kv", "us": us_rope, "tflops": 0.0, "pct_peak": 0.0,
             "gbs": rope_bytes / us_rope / 1e3, "pct_bw": 100 * rope_bytes / us_rope / 1e6 / READ_TBPS},
            {"op": "attention", "us": us_attn, "tflops": attn_flops / us_attn / 1e6,
             "pct_peak": 100 * attn_flops / us_attn / 1e6 / PEAK_TFLOPS,
             "gbs": attn_bytes / us_attn / 1e3, "pct_bw": 100 * attn_bytes / us_attn / 1e6 / READ_TBPS}], \
        us_rope + us_attn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=config.load().benchmark.prompt_tokens)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default=None, help="one GEMM (qkv, o_proj, gate_up, down), no attention: for ncu")
    ap.add_argument("--fp8", action="store_true", help="only the FP8 GEMMs, mma_sync against wgmma (PEAK is FP16's)")
    ap.add_argument("--wgmma", action="store_true", help="the four GEMMs: wgmma vs mma.sync vs cuBLAS, INT4 and FP8")
    ap.add_argument("--no-sweep", action="store_true", help="with --wgmma: the plans only, no BN / split sweep")
    ap.add_argument("--quick", action="store_true", help="with --wgmma: INT4 plan + QUICK_INT4 candidates, FP8 plan only")
    args = ap.parse_args(argv)
    import cupy as cp
    dims = config.load().model("7b")
    rng = np.random.default_rng(0)
    t = args.tokens
    if args.wgmma:
        rows, summary = bench_wgmma(dims, t, rng, args.warmup, args.reps, sweep=not args.no_sweep, quick=args.quick)
        tot = print_wgmma(dims, t, rows, summary)
        if args.json:
            args.json.write_text(json.dumps({"tokens": t, "rows": rows, "summary": summary, "layer_us": tot,
                                             "warmup": args.warmup, "reps": args.reps}, indent=1))
        return
    if args.fp8:
        rows = bench_fp8_gemms(dims, t, rng, args.warmup, args.reps)
        print(f"FP8 prefill GEMMs, 7B, T={t}, median of {args.reps} (CUDA events); %peak against the dense FP16 "
              f"{PEAK_TFLOPS:.0f} TFLOP/s (FP8's is twice that)")
        for r in rows:
            print(f"{r['op']:28s} {r['us']:9.1f} {r['tflops']:8.1f} {r['pct_peak']:6.1f} {r['gbs']:7.0f} {r['pct_bw']:5.1f}")
        if args.json:
            from nanoqwen_lib.measure import bench
            bench.write_json({"tokens": t, "rows": rows, "gpu": bench.gpu_conditions()["gpu"],
                              "git_commit": bench.git_commit(), "warmup": args.warmup, "reps": args.reps}, args.json)
        return
    rows, best = bench_gemms(dims, t, rng, args.warmup, args.reps, args.only)
    if args.only:
        return
    attn_rows, us_attn = bench_attention(dims, t, rng, args.warmup, args.reps)
    rows += attn_rows
    layer_us = sum(us for _, us, _ in best.values()) + us_attn
    print(f"\nprefill kernels, 7B, T={t}, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"median of {args.reps} (CUDA events); ceilings {PEAK_TFLOPS:.0f} TFLOP/s, {READ_TBPS} TB/s")
    print(f"{'op':28s} {'us':>9s} {'TFLOP/s':>8s} {'%peak':>6s} {'GB/s':>7s} {'%bw':>5s}")
    for r in rows:
        print(f"{r['op']:28s} {r['us']:9.1f} {r['tflops']:8.1f} {r['pct_peak']:6.1f} {r['gbs']:7.0f} {r['pct_bw']:5.1f}")
    for proj, (choice, us, planned) in best.items():
        print(f"layer uses {proj:8s}: {choice:30s} {us:8.1f} us   (plan_gemm picks {planned})")
    print(f"per layer {layer_us:.1f} us; x {dims.num_layers} layers = {layer_us * dims.num_layers / 1e3:.2f} ms "
          f"(prefill GEMMs + attention; TTFT estimate without norms / embedding / lm_head)")
    if args.json:
        args.json.write_text(json.dumps({"tokens": t, "rows": rows, "best": best, "layer_us": layer_us,
                                         "ttft_ms": layer_us * dims.num_layers / 1e3}, indent=1))


if __name__ == "__main__":
    main()
