"""Time the decode GEMVs and small decode kernels on the 7B shapes (needs a GPU).

    python tools/bench_gemv.py [--out bench.json] [--quick] [--s3]

--s3: only the layout-3 streaming GEMV (kernels/lab/gemv_stream3.cu, `s3 ...` rows) next to
the engine's tuned tiles GEMV, on the four 7B shapes (the weights repacked from the same
layout-1 copies by format/stream_layout.py; the same bytes, so the same GB/s basis).

Per shape and variant: median time (CUDA events, warm-up, many calls per event pair),
GB/s over the bytes the kernel must read, and that as a fraction of the read ceiling
measured in the same run (timing.measure_read_ceiling). Weights rotate among enough
copies that the set is 3x the L2, so no call finds its weights cached. Weights are random
(speed does not depend on their values), never zeros.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

from nanoqwen_lib import config  # noqa: E402
from nanoqwen_lib.format import layout, stream_layout
from nanoqwen_lib.gpu import ops_decode, ops_gemv
from nanoqwen_lib.gpu.lab import gemv as lab_gemv
from nanoqwen_lib.measure import timing

DIMS = config.load().model("7b")
SHAPES = layout.decode_gemv_shapes(DIMS)
EPILOGUE = {"qkv": "bias", "o_proj": "residual", "gate_up": None, "down": "residual"}
ROWS = []
STREAM_VARIANTS = (("16w x1", {}, 1), ("16w x1 ring8", {"NQ_GEMV_STREAM_RING": 8}, 1),
                   ("8w x2", {"NQ_GEMV_STREAM_WARPS": 8}, 2),
                   ("8w x2 ring8", {"NQ_GEMV_STREAM_WARPS": 8, "NQ_GEMV_STREAM_RING": 8}, 2),
                   ("8w x3", {"NQ_GEMV_STREAM_WARPS": 8}, 3))
# v5 bulk (persistent, cp.async.bulk ring): (label, tuning); ksplit and grid from lab_gemv.plan_bulk.
BULK_VARIANTS = (("bulk", {}), ("bulk FOLD", {"NQ_GEMV_FOLD": 1}),
                 ("bulk S6 FOLD", {"NQ_GEMV_FOLD": 1, "NQ_BULK_STAGES": 6}),
                 ("bulk S8 G4 FOLD", {"NQ_GEMV_FOLD": 1, "NQ_BULK_STAGES": 8, "NQ_BULK_GROUPS": 4}),
                 ("bulk S3 G16 FOLD", {"NQ_GEMV_FOLD": 1, "NQ_BULK_STAGES": 3, "NQ_BULK_GROUPS": 16}),
                 ("bulk FOLD CW8", {"NQ_GEMV_FOLD": 1, "NQ_BULK_CONSUMER_WARPS": 8}),
                 ("bulk S6 FOLD CW8", {"NQ_GEMV_FOLD": 1, "NQ_BULK_STAGES": 6, "NQ_BULK_CONSUMER_WARPS": 8}),
                 ("bulk FOLD suspend", {"NQ_GEMV_FOLD": 1, "NQ_BULK_WAIT_NS": 10_000_000}),
                 ("bulk S3 G16 FOLD suspend", {"NQ_GEMV_FOLD": 1, "NQ_BULK_STAGES": 3, "NQ_BULK_GROUPS": 16,
                                               "NQ_BULK_WAIT_NS": 10_000_000}),
                 ("bulk FOLD CW8 suspend", {"NQ_GEMV_FOLD": 1, "NQ_BULK_CONSUMER_WARPS": 8,
                                            "NQ_BULK_WAIT_NS": 10_000_000}))
# The copy path alone (NQ_BULK_COPY_ONLY: consumers release each stage unread; outputs meaningless):
# what the producer and the copy engine can stream, the roofline of every bulk variant above.
BULK_COPY_ONLY = (("bulk copy-only (roofline, no math)", {"NQ_BULK_COPY_ONLY": 1}),
                  ("bulk copy-only S8 (roofline)", {"NQ_BULK_COPY_ONLY": 1, "NQ_BULK_STAGES": 8}),
                  ("bulk copy-only S3 G16 (roofline)", {"NQ_BULK_COPY_ONLY": 1, "NQ_BULK_STAGES": 3,
                                                        "NQ_BULK_GROUPS": 16}))
V1 = ("v1 guarded", {})   # kernels/lab/gemv_v1.cu (impl="v1")
VARIANTS = (("U2", {"NQ_GEMV_UNROLL": 2}),
            ("W2", {"NQ_GEMV_WARPS": 2}), ("W8", {"NQ_GEMV_WARPS": 8}),
            ("W8 U2", {"NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}), ("MT2 U2", {"NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2}),
            ("FOLD", {"NQ_GEMV_FOLD": 1}), ("FOLD U2", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_UNROLL": 2}),
            ("FOLD W2", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 2}),
            # FOLD alone takes 180 / 191 registers (2 / 5 CTAs per SM, against 3 / 6 unfolded): capped
            ("FOLD C3", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_MIN_CTAS": 3}),
            ("FOLD W2 C6", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 2, "NQ_GEMV_MIN_CTAS": 6}),
            ("FOLD W8 U2", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_WARPS": 8, "NQ_GEMV_UNROLL": 2}),
            ("FOLD MT2 U2", {"NQ_GEMV_FOLD": 1, "NQ_GEMV_MTILES": 2, "NQ_GEMV_UNROLL": 2}))


def record(shape, variant, t, nbytes, ceiling, **extra):
    gbs = nbytes / (t["median"] * 1e-3) / 1e9
    ROWS.append({"shape": shape, "variant": variant, "us": t["median"] * 1e3, "p10_us": t["p10"] * 1e3,
                 "p90_us": t["p90"] * 1e3, "bytes": nbytes, "GBps": gbs, "frac": gbs / (ceiling * 1e3), **extra})


def weight_copies(n, k, l2):
    """Enough random (qweight, scales) copies that together they are 3x the L2."""
    nbytes = n * k // 2 + n * (k // 128) * 2
    copies = max(2, -(-3 * l2 // nbytes))
    out = []
    for _ in range(copies):
        qw = cp.random.randint(0, 256, size=n * k // 2, dtype=cp.uint8).view(cp.uint32).reshape(n, k // 8)
        sc = cp.random.uniform(0.002, 0.02, (n, k // 128)).astype(cp.float16)
        out.append((qw, sc))
    return out, nbytes


def rotating(fn, copies):
    state = {"i": 0}

    def call():
        qw, sc = copies[state["i"] % len(copies)]
        state["i"] += 1
        fn(qw, sc)
    return call


def shape_inputs(name, n, k, l2, quick):
    """One shape's weight copies (more than L2 holds), activations, epilogue arguments, the
    bytes a call moves and the timing arguments: what every bench of a shape starts from."""
    copies, wbytes = weight_copies(n, k, l2)
    epi = EPILOGUE[name]
    x = (cp.random.standard_normal(k) * 0.5).astype(cp.float16)
    gate_up = (cp.random.standard_normal(2 * k)).astype(cp.float16)
    out = cp.zeros(n, cp.float16)
    extra = cp.random.standard_normal(n).astype(cp.float16) if epi else None
    kw = {epi: (out if epi == "residual" else extra)} if epi else {}
    nbytes = wbytes + k * 2 + n * 2 + (n * 2 if epi else 0)
    inner = len(copies) * max(1, 12 // len(copies))
    t_args = dict(warmup=3, iters=15 if quick else 30, inner=inner, graph=True)
    return copies, wbytes, epi, x, gate_up, out, kw, nbytes, t_args


def bench_shape(name, n, k, ceiling, l2, quick, bulk_only=False):
    copies, wbytes, epi, x, gate_up, out, kw, nbytes, t_args = shape_inputs(name, n, k, l2, quick)

    def run(variant, fn, nb=nbytes, **info):
        t = timing.time_cuda(rotating(fn, copies), **t_args)
        record(name, variant, t, nb, ceiling, **info)

    auto = ops_gemv.gemv_config("gemv_int4", n, k)[1]      # the launcher's own choice (tuned table)
    if bulk_only:           # the tuned default against every bulk variant and the copy-only roofline
        run("prmt-mma", lambda q, s: lab_gemv.gemv_int4(x, q, s, out, **kw), ksplit=auto)
        for label, tv in BULK_VARIANTS + BULK_COPY_ONLY:
            run(label, lambda q, s, t=tv: lab_gemv.gemv_int4(x, q, s, out, tuning=t, impl="bulk", **kw))
        return
    t = timing.time_cuda(rotating(lambda q, s: lab_gemv.gemv_int4(x, q, s, out, **kw), copies),
                         **{**t_args, "graph": False})
    record(name, "prmt-mma eager (host-bound)", t, nbytes, ceiling, ksplit=auto)
    run("prmt-mma", lambda q, s: lab_gemv.gemv_int4(x, q, s, out, **kw), ksplit=auto)
    groups = k // 128
    for s_ in (1, 2, 3, 4, 6, 8, 12):
        if s_ != auto and s_ <= groups and -(-groups // s_) <= ops_gemv.SPLIT_MAX_CTA_GROUPS and not quick:
            run(f"prmt-mma fallback ks={s_}", lambda q, s, s_=s_: lab_gemv.gemv_int4(x, q, s, out, ksplit=s_, **kw),
                ksplit=s_)
    run(f"prmt-mma {V1[0]}", lambda q, s: lab_gemv.gemv_int4(x, q, s, out, impl="v1", **kw), ksplit=auto)
    for label, tv in VARIANTS:
        tuning = {**ops_gemv.GEMV_TUNING, **tv}
        s_auto = ops_gemv.plan_split(n, k, tuning)
        run(f"prmt-mma {label}", lambda q, s, t=tuning: lab_gemv.gemv_int4(x, q, s, out, tuning=t, **kw), ksplit=s_auto)
    for label, tv, cps in STREAM_VARIANTS:
        tuning = {**ops_gemv.GEMV_TUNING, **tv}
        g = cps * ops_gemv.num_sms()
        run(f"stream {label}", lambda q, s, t=tuning, g=g: lab_gemv.gemv_int4(x, q, s, out, tuning=t, impl="stream",
                                                                            ctas=g, **kw))
    for label, tv in BULK_VARIANTS:
        run(label, lambda q, s, t=tv: lab_gemv.gemv_int4(x, q, s, out, tuning=t, impl="bulk", **kw))
    xq, xs = cp.zeros(k, cp.int8), cp.zeros(k // 128, cp.float32)
    lab_gemv.quantize_act_int8(x, xq, xs)
    run("dp4a (gemv only)", lambda q, s: lab_gemv.gemv_int4_dp4a(xq, xs, q, s, out, **kw), ksplit=auto)
    run("dp4a (+quantize)", lambda q, s: (lab_gemv.quantize_act_int8(x, xq, xs),
                                          lab_gemv.gemv_int4_dp4a(xq, xs, q, s, out, **kw)), ksplit=auto)
    run("dp4a stream (gemv only)", lambda q, s: lab_gemv.gemv_int4_dp4a(xq, xs, q, s, out, impl="stream", **kw))
    if name == "down":
        auto = ops_gemv.gemv_config("gemv_int4_swiglu", n, k)[1]
        nb = wbytes + 2 * k * 2 + n * 4
        run("swiglu", lambda q, s: lab_gemv.gemv_int4_swiglu(gate_up, q, s, out, residual=out), nb, ksplit=auto)
        for s_ in (2, 4, 6, 8):
            if s_ != auto:
                run(f"swiglu ks={s_}", lambda q, s, s_=s_: lab_gemv.gemv_int4_swiglu(gate_up, q, s, out, residual=out,
                                                                                   ksplit=s_), nb, ksplit=s_)
        for label, tv, cps in STREAM_VARIANTS:
            tuning = {**ops_gemv.GEMV_TUNING, **tv}
            g = cps * ops_gemv.num_sms()
            run(f"swiglu stream {label}", lambda q, s, t=tuning, g=g: lab_gemv.gemv_int4_swiglu(
                gate_up, q, s, out, residual=out, tuning=t, impl="stream", ctas=g), nb)
        for label, tv in BULK_VARIANTS:
            run(f"swiglu {label}", lambda q, s, t=tv: lab_gemv.gemv_int4_swiglu(gate_up, q, s, out, residual=out,
                                                                              tuning=t, impl="bulk"), nb)
        for label, tv in VARIANTS:
            tuning = {**ops_gemv.GEMV_TUNING, **tv}
            run(f"swiglu {label}", lambda q, s, t=tuning: lab_gemv.gemv_int4_swiglu(gate_up, q, s, out, residual=out,
                                                                                      tuning=t), nb,
                ksplit=ops_gemv.plan_split(n, k, tuning))
    del copies


# layout 3 (impl "s3"): (label, tuning, ksplit or None for lab_gemv.plan_stream3's choice)
S3_VARIANTS = (("s3", {}, None), ("s3 FOLD", {"NQ_S3_FOLD": 1}, None),
               ("s3 C6", {"NQ_S3_MIN_CTAS": 6}, None), ("s3 C6 FOLD", {"NQ_S3_MIN_CTAS": 6, "NQ_S3_FOLD": 1}, None),
               ("s3 R2", {"NQ_S3_RING": 2}, None), ("s3 R8 C2", {"NQ_S3_RING": 8, "NQ_S3_MIN_CTAS": 2}, None),
               ("s3 W8 C3", {"NQ_S3_WARPS": 8, "NQ_S3_MIN_CTAS": 3}, None),
               ("s3 W8 C3 FOLD", {"NQ_S3_WARPS": 8, "NQ_S3_MIN_CTAS": 3, "NQ_S3_FOLD": 1}, None))
S3_KSPLITS = {"qkv": (1, 2, 4, 14), "o_proj": (1, 2, 4, 14), "gate_up": (2, 4), "down": (4, 6, 8, 14, 20)}


def bench_s3(name, n, k, ceiling, l2, quick):
    """The engine's tuned tiles GEMV, then the layout-3 variants, on the same weights."""
    copies, wbytes, epi, x, gate_up, out, kw, nbytes, t_args = shape_inputs(name, n, k, l2, quick)
    s3_copies = [(stream_layout.to_stream(qw, sc), None) for qw, sc in copies]     # repacked on the GPU
    assert s3_copies[0][0].size == wbytes, (s3_copies[0][0].size, wbytes)   # 7B shapes: no padding rows

    def run(variant, fn, cps, nb=nbytes, **info):
        record(name, variant, timing.time_cuda(rotating(fn, cps), **t_args), nb, ceiling, **info)
        r = ROWS[-1]                                   # as it goes: a run cut short keeps its rows
        print(f"{name:8} {variant:38} {info.get('ksplit', ''):>3} {r['us']:8.2f} us {r['frac']:6.1%}", flush=True)

    auto = ops_gemv.gemv_config("gemv_int4", n, k)[1]
    run("tiles (engine, tuned)", lambda q, s: ops_gemv.gemv_int4(x, q, s, out, **kw), copies, ksplit=auto)
    for label, tv, ks in S3_VARIANTS:
        s_ = lab_gemv.plan_stream3(n, k, ops_gemv.num_sms(), ks)
        run(label, lambda q, _, t=tv, s_=s_: lab_gemv.gemv_int4_s3(x, q, out, ksplit=s_, tuning=t, **kw), s3_copies,
            ksplit=s_)
    for s_ in S3_KSPLITS[name]:
        run(f"s3 ks={s_}", lambda q, _, s_=s_: lab_gemv.gemv_int4_s3(x, q, out, ksplit=s_, **kw), s3_copies, ksplit=s_)
        run(f"s3 FOLD ks={s_}", lambda q, _, s_=s_: lab_gemv.gemv_int4_s3(x, q, out, ksplit=s_,
                                                                          tuning={"NQ_S3_FOLD": 1}, **kw),
            s3_copies, ksplit=s_)
    if name == "down":
        nb = wbytes + 2 * k * 2 + n * 4
        auto = ops_gemv.gemv_config("gemv_int4_swiglu", n, k)[1]
        run("swiglu tiles (engine, tuned)", lambda q, s: ops_gemv.gemv_int4_swiglu(gate_up, q, s, out, residual=out),
            copies, nb, ksplit=auto)
        for label, tv, ks in S3_VARIANTS:
            s_ = lab_gemv.plan_stream3(n, k, ops_gemv.num_sms(), ks)
            run(f"swiglu {label}", lambda q, _, t=tv, s_=s_: lab_gemv.gemv_int4_s3_swiglu(
                gate_up, q, out, residual=out, ksplit=s_, tuning=t), s3_copies, nb, ksplit=s_)
        for s_ in S3_KSPLITS[name]:
            for label, tv in (("swiglu s3", {}), ("swiglu s3 FOLD", {"NQ_S3_FOLD": 1}),
                              ("swiglu s3 W8 C3 FOLD", {"NQ_S3_WARPS": 8, "NQ_S3_MIN_CTAS": 3, "NQ_S3_FOLD": 1})):
                run(f"{label} ks={s_}", lambda q, _, t=tv, s_=s_: lab_gemv.gemv_int4_s3_swiglu(
                    gate_up, q, out, residual=out, ksplit=s_, tuning=t), s3_copies, nb, ksplit=s_)
    del copies, s3_copies


def bench_layer_chain(ceiling, l2, quick, impl):
    """One layer's four GEMVs back to back (qkv+bias, o+residual, gate_up, SwiGLU down+residual),
    default variants, replayed from one graph over enough layer copies to defeat the L2."""
    h, i, qkv = DIMS.hidden, DIMS.intermediate, DIMS.qkv_dim
    shapes = [(qkv, h), (h, DIMS.q_dim), (2 * i, h), (h, i)]
    per_layer = sum(n * k // 2 + n * (k // 128) * 2 for n, k in shapes)
    layers = []
    for _ in range(max(2, -(-3 * l2 // per_layer))):
        layers.append([(cp.random.randint(0, 256, size=n * k // 2, dtype=cp.uint8).view(cp.uint32).reshape(n, k // 8),
                        cp.random.uniform(0.002, 0.02, (n, k // 128)).astype(cp.float16)) for n, k in shapes])
    y = cp.random.standard_normal(h).astype(cp.float16)
    xres = cp.random.standard_normal(h).astype(cp.float16)
    bias, a_qkv = cp.random.standard_normal(qkv).astype(cp.float16), cp.zeros(qkv, cp.float16)
    attn = cp.random.standard_normal(DIMS.q_dim).astype(cp.float16)
    gu = cp.zeros(2 * i, cp.float16)
    state = {"l": 0}

    def layer():
        (wq, sq), (wo, so), (wg, sg), (wd, sd) = layers[state["l"] % len(layers)]
        state["l"] += 1
        lab_gemv.gemv_int4(y, wq, sq, a_qkv, bias=bias, impl=impl)
        lab_gemv.gemv_int4(attn, wo, so, xres, residual=xres, impl=impl)
        lab_gemv.gemv_int4(y, wg, sg, gu, impl=impl)
        lab_gemv.gemv_int4_swiglu(gu, wd, sd, xres, residual=xres, impl=impl)
    nb = per_layer + 2 * (h * 2 + qkv * 2 * 2 + h * 2 * 2 + 2 * i * 2 * 2)
    t = timing.time_cuda(layer, warmup=3, iters=10 if quick else 20, inner=len(layers) * 2, graph=True)
    record("layer", f"4 GEMVs in one graph, {impl}", t, nb, ceiling)
    del layers


def bench_lm_head(ceiling, quick):
    v, h = DIMS.vocab, DIMS.hidden
    w = (cp.random.standard_normal((v, h), dtype=cp.float32) * 0.05).astype(cp.float16)   # 1.09 GB >> L2
    x = cp.random.standard_normal(h).astype(cp.float16)
    logits, tok = cp.zeros(v, cp.float32), cp.zeros(1, cp.int32)
    nb = v * h * 2 + h * 2 + v * 4
    args = dict(warmup=3, iters=10 if quick else 20, inner=3, graph=True)
    record("lm_head", "ffma", timing.time_cuda(lambda: ops_decode.lm_head(x, w, logits), **args), nb, ceiling)
    record("lm_head", "ffma + fused argmax",
           timing.time_cuda(lambda: ops_decode.lm_head(x, w, logits, tok), **args), nb, ceiling)
    for label, tv in (("R2", {"NQ_LMHEAD_ROWS_PER_WARP": 2}), ("U2", {"NQ_LMHEAD_UNROLL": 2})):
        t = {**ops_decode.LMHEAD_TUNING, **tv}
        record("lm_head", f"ffma {label}", timing.time_cuda(lambda: ops_decode.lm_head(x, w, logits, tuning=t), **args),
               nb, ceiling)
    for cps in (2, 8):
        g = cps * ops_gemv.num_sms()
        record("lm_head", f"ffma ctas={g}", timing.time_cuda(lambda: ops_decode.lm_head(x, w, logits, ctas=g), **args),
               nb, ceiling)
    record("lm_head", "cuBLAS fp16 (cupy.matmul, fp16 out)", timing.time_cuda(lambda: cp.matmul(w, x), **{**args, "graph": False}),
           v * h * 2 + h * 2 + v * 2, ceiling)
    record("lm_head", "ffma, then argmax kernel",
           timing.time_cuda(lambda: (ops_decode.lm_head(x, w, logits), ops_decode.argmax(logits, tok)), **args), nb, ceiling)
    record("argmax", "last-CTA merge", timing.time_cuda(lambda: ops_decode.argmax(logits, tok), warmup=5, iters=20,
                                                        inner=20, graph=True), v * 4, ceiling)
    del w


def bench_small(ceiling):
    h = DIMS.hidden
    x, wn, y = (cp.random.standard_normal(h).astype(cp.float16) for _ in range(3))
    record("rmsnorm", "one CTA", timing.time_cuda(lambda: ops_decode.rmsnorm(x, wn, y, 1e-6), warmup=5, iters=20,
                                                  inner=20, graph=True), 3 * h * 2, ceiling)
    table = cp.random.standard_normal((4096, h)).astype(cp.float16)
    tok = cp.full(1, 17, cp.int32)
    record("embed", "device token", timing.time_cuda(lambda: ops_decode.embed(tok, table, y), warmup=5, iters=20,
                                                     inner=20, graph=True), 2 * h * 2, ceiling)


def print_rows():
    print(f"\n{'shape':8} {'variant':38} {'ks':>3} {'us':>8} {'p10-p90':>13} {'GB/s':>7} {'ceil':>6}")
    for r in ROWS:
        print(f"{r['shape']:8} {r['variant']:38} {r.get('ksplit', ''):>3} {r['us']:8.2f} "
              f"{r['p10_us']:6.2f}-{r['p90_us']:6.2f} {r['GBps']:7.0f} {r['frac']:6.1%}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bulk-only", action="store_true", help="gate_up and down: the default, bulk variants, copy roofline")
    ap.add_argument("--s3", action="store_true", help="the layout-3 streaming GEMV (s3 rows) next to the engine's tiles")
    args = ap.parse_args()
    dev = cp.cuda.Device()
    l2 = dev.attributes["L2CacheSize"]
    ceil = timing.measure_read_ceiling()
    ceiling = ceil["tbps"]
    print(f"device {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, {ops_gemv.num_sms()} SMs, "
          f"L2 {l2 >> 20} MiB; read ceiling {ceiling:.3f} TB/s ({ceil['bytes'] / 1e9:.1f} GB, "
          f"{ceil['median'] * 1e3:.0f} us)")
    if args.s3:
        for name in ("gate_up", "down", "qkv", "o_proj"):
            bench_s3(name, *SHAPES[name], ceiling, l2, args.quick)
        ceiling_again = timing.read_ceiling_tbps()
        print_rows()
        print(f"ceiling {ceiling:.3f} TB/s (again at the end: {ceiling_again:.3f})")
        if args.out:
            Path(args.out).write_text(json.dumps({"what": "tools/bench_gemv.py --s3 (graph replay, medians, weights "
                                                  "rotating through 3x the L2)", "ceiling_tbps": ceiling,
                                                  "ceiling_again_tbps": ceiling_again, "rows": ROWS}, indent=1))
        return
    if args.bulk_only:
        for name in ("gate_up", "down"):
            bench_shape(name, *SHAPES[name], ceiling, l2, True, bulk_only=True)
        print_rows()
        if args.out:
            from nanoqwen_lib.measure import bench
            bench.write_json({"what": "tools/bench_gemv.py --bulk-only (graph replay, medians, weights rotating "
                              "through 3x the L2)", "gpu": bench.gpu_conditions()["gpu"],
                              "git_commit": bench.git_commit(), "ceiling_tbps": ceiling, "rows": ROWS}, args.out)
        return
    for name, (n, k) in SHAPES.items():
        bench_shape(name, n, k, ceiling, l2, args.quick)
    for impl in ("tiles", "stream"):
        bench_layer_chain(ceiling, l2, args.quick, impl)
    bench_lm_head(ceiling, args.quick)
    bench_small(ceiling)
    ceiling_again = timing.read_ceiling_tbps()
    if args.out:
        Path(args.out).write_text(json.dumps({"ceiling_tbps": ceiling, "ceiling_again_tbps": ceiling_again,
                                              "rows": ROWS}, indent=1))
    print_rows()
    best = {}
    for r in ROWS:
        if r["shape"] in SHAPES and not r["variant"].startswith("dp4a") and "eager" not in r["variant"]:
            best[r["shape"]] = min(best.get(r["shape"], 1e9), r["us"])
    lm = min(r["us"] for r in ROWS if r["shape"] == "lm_head" and r["variant"].startswith("ffma"))
    per_token = DIMS.num_layers * sum(best.values()) + lm
    chain = min(r["us"] for r in ROWS if r["shape"] == "layer")
    print(f"ceiling {ceiling:.3f} TB/s (again at the end: {ceiling_again:.3f}); best GEMVs x {DIMS.num_layers} layers "
          f"+ lm_head = {per_token / 1e3:.3f} ms/token; best layer chain x {DIMS.num_layers} + lm_head = "
          f"{(DIMS.num_layers * chain + lm) / 1e3:.3f} ms/token (floor {4.45e9 / (ceiling * 1e12) * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
