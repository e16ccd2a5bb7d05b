"""The persistent kernel's GEMV instruction, modelled in NumPy on the CPU: the same index
arithmetic as kernels/decode_persistent.cu (unit_of, each warp's block range, the tile-end
stores of the row sums into part[warp][slot], the per-row sum over the warps in warp order,
the K slices added in slice order), run on random per-block values. Every (tile, group)
block must reach its rows exactly once, and no warp may need more than NQ_PD_KMAX slots.
And its SASS (nvdisasm, no GPU): each GEMV loop streams weights global -> registers."""
from __future__ import annotations

import collections
import re

import numpy as np
import pytest

from nanoqwen_lib import config
from nanoqwen_lib.gpu import cuda_build, persistent

TUN = config.load().tuning["decode_persistent"].defines


def model_gemv(blocks: np.ndarray, tg: int, ks: int, warps: int, kmax: int) -> np.ndarray:
    """blocks: [T, G, 16] per-block row partials -> [T * 16] row sums, computed as the kernel does."""
    t_all, g_all, _ = blocks.shape
    slices = np.zeros((ks, t_all * 16))
    for u in range(tg * ks):
        g_, s_ = divmod(u, ks)
        t0, t1 = g_ * t_all // tg, (g_ + 1) * t_all // tg
        g0, g1 = s_ * g_all // ks, (s_ + 1) * g_all // ks
        nt, ng = t1 - t0, g1 - g0
        nb = nt * ng
        part = np.full((warps, kmax, 16), np.nan)
        wrange = []
        for w in range(warps):
            b0, b1 = w * nb // warps, (w + 1) * nb // warps
            wrange.append((b0 // ng, (b1 - 1) // ng) if b1 > b0 else (1 << 30, -1))
            if b1 <= b0:
                continue
            ct, cg = b0 // ng, b0 % ng
            ft, acc = ct, np.zeros(16)
            for _ in range(b0, b1):                       # the loop: one block a step
                acc = acc + blocks[t0 + ct, g0 + cg]
                cg += 1
                if cg == ng:
                    assert ct - ft < kmax
                    part[w, ct - ft] = acc
                    acc, cg, ct = np.zeros(16), 0, ct + 1
            if cg != 0:
                assert ct - ft < kmax
                part[w, ct - ft] = acc
        for tl in range(nt):                              # the epilogue: warps in warp order
            v = np.zeros(16)
            for w in range(warps):
                f, l = wrange[w]
                if f <= tl <= l:
                    v = v + part[w, tl - f]
            slices[s_, (t0 + tl) * 16:(t0 + tl + 1) * 16] = v
    return slices.sum(axis=0)                             # the last K slice adds the slices in order


@pytest.mark.parametrize("model", ["7b", "tiny", "tiny-hd64"])
@pytest.mark.parametrize("sms", [132, 78])
def test_every_block_reaches_its_rows_once(model, sms):
    dims = config.load().models[model]
    plan = persistent.persistent_plan(dims, sms)
    rng = np.random.default_rng(sms)
    shapes = {"QKV": (dims.qkv_dim, dims.hidden), "O": (dims.hidden, dims.q_dim),
              "GU": (2 * dims.intermediate, dims.hidden), "DOWN": (dims.hidden, dims.intermediate)}
    for m, (n, k) in shapes.items():
        t, g = -(-n // 16), k // 128
        blocks = rng.integers(-8, 8, (t, g, 16)).astype(np.float64)   # exact sums: any order agrees
        got = model_gemv(blocks, plan[f"NQ_PD_{m}_TG"], plan[f"NQ_PD_{m}_KS"], TUN["NQ_PD_WARPS"], TUN["NQ_PD_KMAX"])
        assert np.array_equal(got, blocks.sum(axis=1).reshape(-1)), m


def test_sass_gemv_loops_stream_weights_to_registers():
    """Each GEMV instantiation's loop: two 16-byte non-coherent weight loads and eight HMMA
    per block, no global store, no async copy (the kernel's one cp.async stages the
    attention's partials, outside these loops)."""
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    text = cuda_build.sass("decode_persistent", config.load().models["7b"])
    ring = TUN["NQ_PD_RING"]
    loops = [collections.Counter(lp) for lp in cuda_build.sass_loops(text, "nq_decode_persistent")   # innermost:
             if 0 < lp.count("HMMA.16816.F32") <= 8 * ring]                                       # one ring a pass
    assert len(loops) >= 4, len(loops)                   # qkv, o_proj, gate_up, down (steady state and tail)
    for loop in loops:
        hmma = loop["HMMA.16816.F32"]
        ldg_nc = sum(v for k, v in loop.items() if re.match(r"LDG\.E\.(NA\.)?128\.CONSTANT$", k))
        assert hmma % 8 == 0 and ldg_nc == 2 * hmma // 8, loop     # per block: 8 HMMA, 2 LDG.128.nc
        assert not any(k.startswith(("STG", "ST.", "LDGSTS", "UBLKCP", "UTMALDG")) for k in loop), loop
        per_block = sum(loop.values()) / (hmma // 8)
        print(f"GEMV loop: {sum(loop.values())} instructions, {hmma // 8} blocks, {per_block:.0f} a block")
        assert per_block < 130, per_block


def test_sass_gemv_loops_of_the_shared_memory_ring():
    """The NQ_PD_SMEM_RING build (PERFLOG persistent v7): per block, 8 HMMA fed from shared
    memory, three 16-byte cp.async (two a lane, one more in lanes 0-1 for the scales) that
    bypass L1, one commit and one wait; no weight load into registers, no local memory."""
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    ring = 4
    text = cuda_build.sass("decode_persistent", config.load().models["7b"], {"NQ_PD_SMEM_RING": 1, "NQ_PD_RING": ring})
    loops = [collections.Counter(lp) for lp in cuda_build.sass_loops(text, "nq_decode_persistent")   # innermost:
             if 0 < lp.count("HMMA.16816.F32") <= 8 * ring and "SHFL.BFLY" not in lp]     # no reduction inside
    assert len(loops) >= 4, len(loops)
    for loop in loops:
        blocks = loop["HMMA.16816.F32"] // 8
        assert loop["LDGSTS.E.BYPASS.128"] == 3 * blocks, loop
        assert loop["LDGDEPBAR"] == blocks and loop["DEPBAR.LE"] == blocks, loop
        assert not any(re.match(r"LDG\.E\.(NA\.)?128", k) for k in loop), loop
        assert not any(k.startswith(("STL", "LDL", "STG")) for k in loop), loop
