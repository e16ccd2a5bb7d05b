"""How much the reference itself moves under one-ulp input noise: the yardstick for the
FP8 prefill, whose activations are rounded to E4M3 (3 mantissa bits) per token.

The engine and the reference sum in different orders, so after the first layer their
activations differ by an fp16 ulp here and there. An INT4 prefill carries that noise
through unchanged in size. An FP8 prefill rounds each projection's input to E4M3, and a
value within one fp16 ulp of an E4M3 rounding midpoint moves by a whole E4M3 step (1/8 to
1/16 of itself): the noise is amplified at every layer. Layer 0 sees identical inputs in
both, so it is compared at the fixed bound; later layers and the logits are compared
against twice what the reference does to itself when its embedding table moves by one ulp
on half of its entries (`one_ulp_sensitivity`).
"""
from __future__ import annotations

import numpy as np


def one_ulp_sensitivity(ref_cls, dims, tensors, prompt, layers, xp, seed=0):
    """-> ({layer: (k_rel, v_rel)}, logits_rel): the relative change of the reference's
    prefill K, V and last logits when the embedding rows of `prompt` move by +-1 fp16 ulp
    on a random half of their entries. ref_cls: ReferenceModel."""
    rng = np.random.default_rng(seed)
    emb = np.asarray(tensors["model.embed_tokens.weight"]).astype(np.float16)
    rows = np.unique(np.asarray(prompt))
    bits = emb[rows].view(np.uint16).astype(np.int32)
    step = np.where(rng.random(bits.shape) < 0.5, 0, np.where(rng.random(bits.shape) < 0.5, 1, -1))
    moved = emb.copy()
    moved[rows] = (bits + step).astype(np.uint16).view(np.float16)
    base = ref_cls(dims, tensors, xp=xp)
    noisy = ref_cls(dims, {**dict(tensors), "model.embed_tokens.weight": moved}, xp=xp)
    (l0, c0), (l1, c1) = base.prefill(prompt), noisy.prefill(prompt)
    rel = lambda a, b: float(xp.linalg.norm(a - b) / xp.linalg.norm(b))  # noqa: E731
    out = {}
    for layer in layers:
        (k0, v0), (k1, v1) = c0.past(layer), c1.past(layer)
        out[layer] = (rel(k1, k0), rel(v1, v0))
    return out, rel(l1[-1], l0[-1])
