"""The persistent kernel's attention instruction ([pd-attention] in kernels/decode_persistent.cu),
modelled in NumPy on the CPU with the kernel's own partition and arithmetic order: the context
cut into splits (at most NQ_PD_ATTN_SPLITS, at least NQ_PD_ATTN_MIN_TOKENS tokens each), each
warp's tokens j0 + w, j0 + w + W, ... with the online-softmax update of `consume`, the CTA's
warps merged and then the head's splits merged by `merge_weights` / `merged_acc` (the max and
the weighted l over the parts, an empty part weighing 0). Every token must be counted once and
the result must be softmax(q K^T / sqrt(D)) V, whatever the context length: one token, fewer
tokens than warps, a split boundary inside a page, the longest context of the benchmark."""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib import config

TUN = config.load().tuning["decode_persistent"].defines
F32 = np.float32


SMS = config.load().hardware["sms"]
KVH_7B = config.load().models["7b"].num_kv_heads


def splits_of(n: int, max_splits: int, min_tokens: int, grid: int = SMS, kv_heads: int = KVH_7B) -> int:
    """The kernel's count: at most max_splits and a CTA of the grid per split of each KV head,
    at least min_tokens tokens a split."""
    return min(max_splits, grid // kv_heads, max(1, -(-n // min_tokens)))


def warp_part(q, k, v, tokens):
    """One warp's (acc, m, l) over its tokens, in the kernel's order (`consume`)."""
    d = q.shape[-1]
    scale = F32(1.0 / np.sqrt(F32(d)))
    m = np.full(q.shape[0], -np.inf, F32)
    l = np.zeros(q.shape[0], F32)
    acc = np.zeros(q.shape, F32)
    for j in tokens:
        sc = (q @ k[j]).astype(F32) * scale
        mn = np.maximum(m, sc)
        alpha = np.exp(m - mn).astype(F32)
        p = np.exp(sc - mn).astype(F32)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v[j][None, :]
        m = mn
    return acc, m, l


def merge(parts):
    """merge_weights + merged_acc over parts [(acc, m, l)]: (acc, M, L) unnormalized."""
    ms = np.stack([p[1] for p in parts])                 # [parts, heads]
    M = ms.max(axis=0)
    e = np.where(ms == -np.inf, F32(0), np.exp(ms - M)).astype(F32)
    L = (np.stack([p[2] for p in parts]) * e).sum(axis=0, dtype=F32)
    acc = np.zeros_like(parts[0][0])
    for i, p in enumerate(parts):                        # merged_acc: parts in order
        acc = acc + p[0] * e[i][:, None]
    return acc, M, L


def lanes_part(q, k, v, tokens, chains=1):
    """[pd-attn-lanes]: a warp per query head, a lane per token (at most 32): each lane's score
    summed over the half2 pairs in its rotated order (chains: pair i into chain i % chains,
    the chains added pairwise, NQ_PD_ATTN_LANES=3), the softmax over the lanes, each output
    dim summed over the tokens in order."""
    gqa, d = q.shape
    scale = F32(1.0 / np.sqrt(F32(d)))
    sc = np.zeros((gqa, len(tokens)), F32)
    for t, j in enumerate(tokens):
        for h in range(gqa):
            acc = [F32(0)] * chains
            for i in range(d // 2):
                c2 = (i + t) & (d // 2 - 1)
                acc[i % chains] = F32(acc[i % chains] + q[h, 2 * c2] * k[j, 2 * c2])
                acc[i % chains] = F32(acc[i % chains] + q[h, 2 * c2 + 1] * k[j, 2 * c2 + 1])
            total = acc[0] if chains == 1 else F32(F32(acc[0] + acc[1]) + F32(acc[2] + acc[3]))
            sc[h, t] = total * scale
    m = sc.max(axis=1)
    p = np.exp(sc - m[:, None]).astype(F32)
    acc = np.zeros((gqa, d), F32)
    for t, j in enumerate(tokens):
        acc = acc + p[:, t:t + 1] * v[j][None, :]
    return acc, m, p.sum(axis=1, dtype=F32)


def attention_model(q, k, v, warps, max_splits, min_tokens, grid=SMS, kv_heads=KVH_7B, lanes=0):
    """The instruction for one KV head: q [gqa, D], k, v [n, D] -> [gqa, D], plus the tokens
    each (split, warp) touched. lanes: NQ_PD_ATTN_LANES (a split of <= 32 tokens by lanes;
    3: the scores in 4 chains; 2 computes what 1 does)."""
    n = k.shape[0]
    splits = splits_of(n, max_splits, min_tokens, grid, kv_heads)
    seen = np.zeros(n, int)
    split_parts = []
    for s in range(splits):
        j0, j1 = s * n // splits, (s + 1) * n // splits
        if lanes and j1 - j0 <= 32:
            seen[j0:j1] += 1
            split_parts.append(lanes_part(q, k, v, list(range(j0, j1)), chains=4 if lanes == 3 else 1))
            continue
        parts = []
        for w in range(warps):
            tokens = list(range(j0 + w, j1, warps))
            seen[tokens] += 1
            parts.append(warp_part(q, k, v, tokens))
        split_parts.append(merge(parts))                 # the CTA's warps
    acc, _, L = merge(split_parts) if splits > 1 else split_parts[0]
    return acc / L[:, None], seen


@pytest.mark.parametrize("n", [1, 5, 16, 17, 31, 32, 33, 100, 576, 640])
@pytest.mark.parametrize("lanes", [0, 1, 3])
@pytest.mark.parametrize("model,grid", [("7b", SMS), ("7b", 114), ("tiny-hd64", SMS), ("tiny-hd64", 5)])
def test_split_attention_is_softmax_attention(n, model, grid, lanes):
    dims = config.load().models[model]
    gqa, d = dims.num_heads // dims.num_kv_heads, dims.head_dim
    rng = np.random.default_rng(n)
    q = rng.standard_normal((gqa, d)).astype(F32)
    k = (rng.standard_normal((n, d)) * 2).astype(F32)
    v = rng.standard_normal((n, d)).astype(F32)
    out, seen = attention_model(q, k, v, TUN["NQ_PD_WARPS"], TUN["NQ_PD_ATTN_SPLITS"], TUN["NQ_PD_ATTN_MIN_TOKENS"],
                                grid, dims.num_kv_heads, lanes)
    assert (seen == 1).all(), np.flatnonzero(seen != 1)
    s = (q.astype(np.float64) @ k.T.astype(np.float64)) / np.sqrt(d)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    ref = (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("n", [1, 32, 33, 576, 4096])
def test_splits_fit_the_kernel(n):
    """The splits the kernel takes fit its workspace and its lane-per-part merge, and a split of
    a benchmark-length context has no more tokens than its warps load before the wait."""
    t = TUN
    kvh = config.load().models["7b"].num_kv_heads
    for grid in (kvh, 114, SMS):                          # every split of every head a CTA (H100 PCIe: 114 SMs)
        assert splits_of(n, t["NQ_PD_ATTN_SPLITS"], t["NQ_PD_ATTN_MIN_TOKENS"], grid, kvh) * kvh <= grid
    s = splits_of(n, t["NQ_PD_ATTN_SPLITS"], t["NQ_PD_ATTN_MIN_TOKENS"], SMS, kvh)
    assert 1 <= s <= t["NQ_PD_ATTN_SPLITS"] <= 32
    if n <= config.load().benchmark.prompt_tokens + 128:
        assert -(-n // s) <= t["NQ_PD_WARPS"] * t["NQ_PD_ATTN_PRE"]


def merge_slices(splits: int, gqa: int, d: int) -> list[tuple[int, int, int, int]]:
    """[pd-merge-all] (NQ_PD_ATTN_MERGE=1): split s merges outputs [o0, o1) of its KV head's
    gqa x d, heads h0 .. h0 + nh - 1 (the kernel's arithmetic)."""
    out = []
    for s in range(splits):
        o0, o1 = s * (gqa * d) // splits, (s + 1) * (gqa * d) // splits
        out.append((o0, o1, o0 // d, (o1 - 1) // d - o0 // d + 1))
    return out


@pytest.mark.parametrize("model", ["7b", "tiny", "tiny-hd64"])
def test_merge_slices_cover_every_output_once(model):
    """Every split merging a slice: each of the head's outputs is merged by exactly one split,
    a slice's heads fit the warps that compute their weights (a warp per head), and what it
    stages stays inside the partials buffer. The merge of one output uses every split's
    (m, l) of its head and acc in split order, as the last-split merge does, so the two
    builds give the same bits."""
    dims = config.load().models[model]
    gqa, d = dims.num_heads // dims.num_kv_heads, dims.head_dim
    parts = max(TUN["NQ_PD_WARPS"], 32)
    for splits in range(2, 33):
        seen = np.zeros(gqa * d, int)
        for o0, o1, h0, nh in merge_slices(splits, gqa, d):
            assert o0 < o1, (splits, o0)
            seen[o0:o1] += 1
            assert 1 <= nh <= gqa <= TUN["NQ_PD_WARPS"]
            assert h0 + nh <= gqa
            assert ((splits - 1) * gqa + h0 + nh - 1) * (d + 2) + d + 1 < parts * gqa * (d + 2)
        assert (seen == 1).all(), splits


@pytest.mark.parametrize("model,n", [("7b", 600), ("7b", 9), ("tiny", 87), ("tiny-hd64", 87), ("tiny-hd64", 40)])
def test_o_merge_staging_gathers_each_heads_splits(model, n):
    """[pd-o-merge] (stage_merged in kernels/decode/attention.cuh), with the kernel's index
    arithmetic: each o_proj unit of the plan (K cut by KV head) reads split s of query head q at
    ((q / gqa) * NQ_PD_ATTN_SPLITS + s) * gqa + q % gqa rows of D + 2 floats, packs the (m, l)
    of the heads its slice meets as [split][head][m, l], and writes output k of its slice to
    byte x_chunk_offset(k / 8) + 2 (k % 8) of its staging. Every output of the attention is
    staged exactly once, inside the unit's staging and short of the scratch behind it, and
    equals the merge of its head's splits (the values the attention's own merge writes). A model
    of the addressing, not of the bits: the GPU tests compare the kernel's bits
    (test_gpu_persistent.py, test_o_proj_merging_the_attention_splits_gives_the_same_bits)."""
    from nanoqwen_lib.gpu.persistent import persistent_plan
    dims, group = config.load().models[model], config.load().format.group_size
    gqa, d, kvh, S = dims.num_heads // dims.num_kv_heads, dims.head_dim, dims.num_kv_heads, TUN["NQ_PD_ATTN_SPLITS"]
    plan = persistent_plan(dims, SMS, defines={"NQ_PD_O_MERGE": 1})
    ks, groups = plan["NQ_PD_O_KS"], dims.q_dim // group
    splits = splits_of(n, S, TUN["NQ_PD_ATTN_MIN_TOKENS"], SMS, kvh)
    rng = np.random.default_rng(n)
    ws = np.zeros(kvh * S * gqa * (d + 2), F32)            # T_ATTN_WS: [kv head][split][head][acc, m, l]
    part_of = lambda q, s: ((q // gqa) * S + s) * gqa * (d + 2) + (q % gqa) * (d + 2)
    for q in range(dims.num_heads):
        for s in range(splits):
            o = part_of(q, s)
            ws[o:o + d] = rng.standard_normal(d)
            ws[o + d] = rng.standard_normal() * 3
            ws[o + d + 1] = rng.random() + 0.5
    x_chunk_offset = lambda c: 16 * (c + c // 4)
    merge_offset = -(-(-(-groups // ks) * 320) // 16) * 16            # kOMergeOffset
    staged = np.full(dims.q_dim, np.nan, F32)
    for u in range(ks):                                    # a tile set's units: one per K slice
        k0, k1 = u * groups // ks * group, (u + 1) * groups // ks * group
        h0, nh = k0 // d, (k1 - 1) // d - k0 // d + 1
        sml = np.array([ws[part_of(h0 + (i % (nh * 2)) // 2, i // (nh * 2)) + d + (i & 1)]
                        for i in range(splits * nh * 2)], F32).reshape(splits, nh, 2)
        M = sml[:, :, 0].max(axis=0)
        e = np.where(sml[:, :, 0] == -np.inf, F32(0), np.exp(sml[:, :, 0] - M)).astype(F32)
        L = (sml[:, :, 1] * e).sum(axis=0, dtype=F32)
        buf = {}
        for k in range(k0, k1):
            q, dd = k // d, k % d
            v = F32(0)
            for s in range(splits):
                v = F32(v + ws[part_of(q, s) + dd] * e[s, q - h0])
            kl = k - k0
            at = x_chunk_offset(kl // 8) + 2 * (kl % 8)
            assert 0 <= at and at + 2 <= min(merge_offset, (k1 - k0) // group * 320) and at not in buf
            buf[at] = v / L[q - h0]
        for kl in range(k1 - k0):
            staged[k0 + kl] = buf[x_chunk_offset(kl // 8) + 2 * (kl % 8)]
    for g in range(kvh):                                   # the attention's own merge, KV head by head
        parts = [(ws[[part_of(g * gqa + h, s) + np.arange(d) for h in range(gqa)]].reshape(gqa, d),
                  np.array([ws[part_of(g * gqa + h, s) + d] for h in range(gqa)], F32),
                  np.array([ws[part_of(g * gqa + h, s) + d + 1] for h in range(gqa)], F32)) for s in range(splits)]
        acc, _, L = merge(parts)
        np.testing.assert_allclose(staged[g * gqa * d:(g + 1) * gqa * d], (acc / L[:, None]).ravel(), rtol=1e-6, atol=1e-7)
