"""The "dequantize + cuBLAS" prefill: the bar our own prefill must beat.

The obvious way to prefill an INT4 model on a GPU with tensor cores: expand each layer's
INT4 weights to FP16 and hand the products to the vendor GEMM (cupy.matmul -> cuBLAS),
FP16 in, FP16 out, FP32 accumulation. Everything else is the reference's arithmetic
(model.reference.decoder_layer: the same norms, RoPE, attention and rounding points), so
the line differs from our prefill only in how the projections are computed.

`prefill_dequant_matmul(tensors, dims, ids, xp)` is the math on any array module (NumPy on
the CPU, where it is checked against the reference; CuPy on the GPU). `time_prefill_dequant`
times it with CUDA events: TTFT with the per-layer expansion inside the timed region (what
a user of this recipe pays when weights stay INT4 in memory), and the GEMMs alone on
weights expanded beforehand (the cuBLAS floor of the four projections).
"""
from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from nanoqwen_lib.model.reference import (LayerWeights, decoder_layer, final_logits, load_layer_weights,
                                          round_fp16)

WEIGHTS = ("w_qkv", "w_o", "w_gate_up", "w_down")


def fp16_layer(tensors, i, xp) -> LayerWeights:
    """Layer i with its four projections expanded to FP16 (norms and biases FP32)."""
    w = load_layer_weights(tensors, i, xp)
    return replace(w, **{f.name: getattr(w, f.name).astype(xp.float16) for f in fields(w) if f.name in WEIGHTS})


def to_fp16(a):
    """The projections' input: FP16, so the product is an FP16 GEMM (FP32 accumulation)."""
    return a.astype("float16")


def prefill_dequant_matmul(tensors, dims, ids, xp=np, layers=None, head=None):
    """ids [T] -> logits float32 [vocab] of the last position. layers: FP16 LayerWeights
    already expanded (None: expand each layer as it is reached); head: the lm_head as
    float32 (None: widened here), loaded once like any runtime's weights."""
    from nanoqwen_lib.model.reference import check_tensors
    check_tensors(dims, tensors)
    x = xp.asarray(tensors["model.embed_tokens.weight"])[xp.asarray(np.asarray(ids, dtype=np.int64))].astype("float32")
    empty = xp.zeros((0, dims.num_kv_heads, dims.head_dim), dtype="float32")
    for i in range(dims.num_layers):
        w = layers[i] if layers is not None else fp16_layer(tensors, i, xp)
        x, _, _ = decoder_layer(x, w, empty, empty, dims, round_fp16, act_q=to_fp16)
    norm = xp.asarray(tensors["model.norm.weight"]).astype("float32")
    head = lm_head_fp32(tensors, dims, xp) if head is None else head
    return final_logits(x[-1:], norm, head, dims.rms_eps, xp)[0]


def lm_head_fp32(tensors, dims, xp):
    name = "model.embed_tokens.weight" if dims.tie_embeddings else "lm_head.weight"
    return xp.asarray(tensors[name]).astype("float32")


def time_prefill_dequant(nq_file, prompt, warmup: int = 2, runs: int = 5) -> dict:
    """CUDA events around the whole prefill (expansion included) and around the GEMMs alone."""
    import cupy as cp
    dims, t = nq_file.dims, nq_file.model_tensors()
    dev = {k: cp.asarray(v) for k, v in t.items()}
    ev = cp.cuda.Event

    def timed(fn):
        out = []
        for k in range(warmup + runs):
            a, b = ev(), ev()
            a.record()
            fn()
            b.record()
            b.synchronize()
            if k >= warmup:
                out.append(cp.cuda.get_elapsed_time(a, b))
        return float(np.median(out))

    head = lm_head_fp32(dev, dims, cp)
    ttft = timed(lambda: int(prefill_dequant_matmul(dev, dims, prompt, cp, head=head).argmax()))
    layers = [fp16_layer(dev, i, cp) for i in range(dims.num_layers)]
    xs = {"w_qkv": dims.hidden, "w_o": dims.q_dim, "w_gate_up": dims.hidden, "w_down": dims.intermediate}
    xin = {k: cp.random.standard_normal((len(prompt), n), dtype=cp.float32).astype(cp.float16) for k, n in xs.items()}

    def gemms():
        for w in layers:
            for k in WEIGHTS:
                cp.matmul(xin[k], getattr(w, k).T)
    gemm = timed(gemms)
    ttft_pre = timed(lambda: int(prefill_dequant_matmul(dev, dims, prompt, cp, layers, head).argmax()))
    return {"how": "INT4 weights expanded to FP16 per layer, cupy.matmul (cuBLAS, FP16 in/out, FP32 accumulation) "
                   "for the four projections, the reference's norms/RoPE/attention on CuPy; CUDA events, median of "
                   f"{runs} after {warmup} warm-ups",
            "version": f"cupy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}",
            "ttft_ms": ttft, "ttft_weights_preexpanded_ms": ttft_pre, "gemm_only_ms": gemm,
            "prompt_tokens": len(prompt)}
