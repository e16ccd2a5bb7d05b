"""The bulk GEMV's launch plan (nanoqwen_lib.gpu.lab.gemv.plan_bulk), on the CPU: every 7B shape gets slices
that fit the scale buffer, a grid no larger than its items, shared memory that fits an SM,
and items spread over the SMs; impossible requests are refused with the field named."""
import pytest

from nanoqwen_lib.format import layout
from nanoqwen_lib.gpu import ops_gemv
from nanoqwen_lib.gpu.lab import gemv as lab_gemv
from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError, NanoqwenError

D = load().model("7b")
T = {**ops_gemv.GEMV_TUNING, **lab_gemv.BULK_TUNING}
SHAPES = layout.decode_gemv_shapes(D)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("sms", [132, 114])            # H200 / H100 SXM, H100 PCIe
def test_bulk_plan_fits_and_spreads(shape, sms):
    n, k = SHAPES[shape]
    s, grid = lab_gemv.plan_bulk(n, k, T, sms)
    tiles, groups = -(-n // 16), k // 128
    assert -(-groups // s) <= T["NQ_BULK_MAX_ITEM_GROUPS"]          # every slice fits the scale buffer
    assert 1 <= grid <= tiles * s
    per_sm = lab_gemv.SMEM_PER_SM // (lab_gemv.bulk_smem_bytes(k, T) + lab_gemv.SMEM_PER_CTA_RESERVED)
    assert 1 <= grid <= min(lab_gemv.BULK_CTAS_PER_SM, per_sm) * sms   # all CTAs resident at once
    per = tiles * s / sms
    assert per / -(-per // 1) >= 0.7, (shape, s, per)               # no SM idles most of the launch


def test_bulk_plan_honours_and_checks_an_explicit_split():
    assert lab_gemv.plan_bulk(3584, 18944, T, 132, ksplit=148)[0] == 148
    with pytest.raises(NanoqwenError, match="ksplit"):
        lab_gemv.plan_bulk(3584, 18944, T, 132, ksplit=2)           # 74 groups > the 40 a slice holds
    with pytest.raises(LimitError, match="shared memory"):
        lab_gemv.plan_bulk(16, 128 * 600, {**T, "NQ_BULK_STAGES": 8, "NQ_BULK_GROUPS": 16}, 132)


def test_bulk_smem_matches_the_kernel_layout():
    """ring + x + two scale buffers, as gemv_bulk_body carves its dynamic shared memory."""
    t = {**T, "NQ_BULK_STAGES": 3, "NQ_BULK_GROUPS": 5, "NQ_BULK_MAX_ITEM_GROUPS": 40}
    assert lab_gemv.bulk_smem_bytes(3584, t) == 3 * 16 * (5 * 64) + 28 * 320 + 2 * 16 * 40 * 2    # odd: no pad
    assert lab_gemv.bulk_smem_bytes(3584, T) == 4 * 16 * (8 * 64 + 64) + 28 * 320 + 2 * 16 * 40 * 2
