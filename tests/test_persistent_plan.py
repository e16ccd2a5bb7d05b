"""The persistent decode step's host side, without a GPU: the pointer table's order against
the kernel's enums, the plan of each GEMV split (config.persistent_plan) against the
kernel's limits, the shared-memory size, and the engine's refusals."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.gpu.persistent import persistent_plan
from nanoqwen_lib.errors import LimitError
from nanoqwen_lib.gpu import cuda_build, persistent
from nanoqwen_lib.measure.timeline import KINDS

SRC = cuda_build.kernel_source("decode_persistent")


def _enum(name: str) -> list[str]:
    body = re.search(r"enum %s \{(.*?)\};" % name, SRC, re.S).group(1)
    return [e.strip() for e in body.replace("\n", " ").split(",") if e.strip()]


def test_table_order_matches_the_kernel():
    assert _enum("Tab") == [f"T_{n}" for n in persistent.TAB_GLOBALS] + ["T_GLOBALS"]
    assert _enum("LayerTab") == [f"L_{n}" for n in persistent.TAB_LAYER] + ["L_FIELDS"]
    assert f"kLayerBase = {persistent.LAYER_BASE}, kLayerStride = {persistent.LAYER_STRIDE}" in SRC


def test_kinds_match_the_timeline():
    names = [k[2:].lower() for k in _enum("Kind")]
    assert names == ["begin", "qkv", "attn", "o", "gate_up", "down", "lm_head", "end"]
    assert len(names) == len(KINDS)


@pytest.mark.parametrize("model", ["7b", "tiny", "tiny-hd64"])
@pytest.mark.parametrize("sms", [132, 114, 78])
def test_plan_covers_every_block_within_the_kernel_limits(model, sms):
    """Every unit fits the grid; the units' tile sets and slices partition the matrix; no
    warp touches more than NQ_PD_KMAX tiles (the kernel's shared row sums)."""
    dims = load().models[model]
    plan = persistent_plan(dims, sms)
    t = load().tuning["decode_persistent"].defines
    for m, (n, k) in {"QKV": (dims.qkv_dim, dims.hidden), "O": (dims.hidden, dims.q_dim),
                      "GU": (2 * dims.intermediate, dims.hidden), "DOWN": (dims.hidden, dims.intermediate)}.items():
        tg, ks = plan[f"NQ_PD_{m}_TG"], plan[f"NQ_PD_{m}_KS"]
        tiles, groups = -(-n // 16), k // 128
        assert 1 <= tg * ks <= sms and tg <= tiles and ks <= groups
        assert 16 * -(-tiles // tg) <= 32 * t["NQ_PD_WARPS"]          # a row a thread in the epilogue
        covered = 0
        for u in range(tg * ks):            # the kernel's unit_of
            g_, s_ = divmod(u, ks)
            nt = (g_ + 1) * tiles // tg - g_ * tiles // tg
            ng = (s_ + 1) * groups // ks - s_ * groups // ks
            covered += nt * ng
            nb = nt * ng
            for w in range(t["NQ_PD_WARPS"]):   # tiles a warp's block range touches
                b0, b1 = w * nb // t["NQ_PD_WARPS"], (w + 1) * nb // t["NQ_PD_WARPS"]
                if b1 > b0:
                    assert (b1 - 1) // ng - b0 // ng + 1 <= t["NQ_PD_KMAX"], (m, u, w)
        assert covered == tiles * groups


def test_too_few_sms_is_refused_clearly():
    with pytest.raises(LimitError, match="decode=graph"):
        persistent_plan(load().models["7b"], 16)


def test_plan_of_the_7b_on_132_sms():
    """The split the H200's run used (a change here changes what was measured)."""
    assert persistent_plan(load().models["7b"], 132) == {
        "NQ_PD_QKV_TG": 132, "NQ_PD_QKV_KS": 1, "NQ_PD_O_TG": 132, "NQ_PD_O_KS": 1,
        "NQ_PD_GU_TG": 132, "NQ_PD_GU_KS": 1, "NQ_PD_DOWN_TG": 33, "NQ_PD_DOWN_KS": 4}


@pytest.mark.parametrize("model", ["7b", "tiny", "tiny-hd64"])
def test_shared_memory_fits_an_sm(model):
    dims = load().models[model]
    b = persistent.smem_bytes(dims, persistent_plan(dims))
    assert dims.hidden * 4 <= b <= 200 * 1024


@pytest.mark.parametrize("ring", [3, 4, 6, 8])
def test_shared_memory_ring_adds_its_blocks_behind_the_staging(ring):
    """NQ_PD_SMEM_RING: every warp's ring of NQ_PD_RING 1056-byte blocks behind the largest
    staging (rounded to 16 bytes), within the 227 KiB a CTA may opt into on sm_90."""
    dims = load().models["7b"]
    plan = persistent_plan(dims)
    base = persistent.smem_bytes(dims, plan)
    b = persistent.smem_bytes(dims, plan, {"NQ_PD_SMEM_RING": 1, "NQ_PD_RING": ring})
    assert b - -(-base // 16) * 16 == ring * persistent.TUNING["NQ_PD_WARPS"] * 1056
    assert b <= 227 * 1024


@pytest.mark.parametrize("head", [2, 4, 6])
def test_head_blocks_sit_past_the_largest_gemv_staging(head):
    """NQ_PD_HEAD_BLOCKS ([pd-head]): every warp's head of 1056-byte blocks starts at the
    largest GEMV staging rounded to 128 bytes (for the 7B, down's K slice: 37 groups x 320
    bytes), overlapping what only the attention and the lm_head use, within 227 KiB."""
    dims = load().models["7b"]
    plan = persistent_plan(dims)
    assert plan["NQ_PD_DOWN_KS"] == 4
    b = persistent.smem_bytes(dims, plan, {"NQ_PD_HEAD_BLOCKS": head})
    offset = -(-(37 * 320) // 128) * 128
    assert b == max(persistent.smem_bytes(dims, plan), offset + head * persistent.TUNING["NQ_PD_WARPS"] * 1056)
    assert b <= 227 * 1024


def test_engine_refuses_bad_decode_modes_before_the_gpu():
    from nanoqwen_lib.gpu.engine import GpuBackend
    f = SimpleNamespace(encoding="fp8", path="model-fp8.nanoqwen")
    with pytest.raises(LimitError, match="decode"):
        GpuBackend(f, decode="eager")
    with pytest.raises(LimitError, match="model-fp8.nanoqwen.*FP8"):
        GpuBackend(f, decode="persistent")
    assert load().engine.decode == {"int4": "persistent", "fp8": "graph"}
