"""tools/rs_issue_slots.py on the CPU: the loops it finds in the SASS of the RS builds plan_rs picks
are the register form's k-tile loops (the k-tile's wgmmas, their A from registers, no shared-memory
store of the weights), and its per-GEMM rows for the 7B at T = 512 on 132 SMs hold the grid, the
waves and the issue-slot arithmetic that their own fields imply."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from nanoqwen_lib import config
from nanoqwen_lib.format.layout import decode_gemv_shapes
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs

TOOL = Path(__file__).resolve().parents[1] / "tools" / "rs_issue_slots.py"
spec = importlib.util.spec_from_file_location("rs_issue_slots", TOOL)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

BK = 64            # k of a k-tile (prefill_rs.cu: BK; one stage's X is 128 bytes of fp16 k)
WGMMA_K = 16       # wgmma m64nNk16 .f16: 16 k an instruction
TOKENS, SMS = 512, 132
GEMMS = ("qkv", "o_proj", "gate_up", "down")


def _have_nvrtc() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except Exception:
        return False
    return True


# As tests/test_kernel_build.py: NVRTC compiles without a GPU; nvdisasm comes with the cuda13 extra.
needs_sass = pytest.mark.skipif(not _have_nvrtc() or cuda_build.nvdisasm_path() is None,
                                reason="NVRTC (cupy_backends) or nvdisasm not installed")


def plan_builds() -> dict[str, dict]:
    """The full build each 7B GEMM launches at T = 512 on 132 SMs (gate_up: the SwiGLU epilogue)."""
    shapes = decode_gemv_shapes(config.load().model("7b"))
    return {name: {**prefill_rs.RS_BUILD, **prefill_rs.plan_rs(TOKENS, shapes[name][0], SMS),
                   "NQ_RS_SWIGLU": int(name == "gate_up")} for name in GEMMS}


def test_the_mma_rate_is_the_spec_over_the_sms_and_the_clock():
    per_clock = tool.SPEC_DENSE_FP16_TFLOPS * 1e12 / (tool.SPEC_SMS * tool.SPEC_CLOCK_GHZ * 1e9)
    assert tool.MMA_FLOP_PER_CLOCK == 4096 and abs(per_clock / 4096 - 1) < 1e-3, per_clock
    assert 2 * 64 * 128 * 16 / tool.MMA_FLOP_PER_CLOCK == 64      # one m64n128k16: 64 clocks
    assert tool.ISSUE_PER_CLOCK == 4


def test_groups_split_the_conversion_from_the_rest():
    ops = ["LOP3.LUT", "PRMT", "HADD2", "HMUL2", "HFMA2", "LDS.128", "LDS.U16", "HGMMA.64x128x16.F32",
           "WARPGROUP.ARRIVE", "SYNCS.ARRIVE.TRANS64.A1T0", "WARPSYNC.ALL", "IMAD.MOV.U32", "BRA"]
    assert tool.groups(ops) == {"conversion": 5, "LDS": 2, "WGMMA": 2, "barrier/sync": 2, "other": 2}


@needs_sass
def test_the_kernel_k_tile_is_64():
    assert tool.kernel_k_tile() == BK


@needs_sass
@pytest.mark.parametrize("name", GEMMS)
def test_the_consumer_loop_is_the_register_form(name):
    build = plan_builds()[name]
    p = tool.loop_profile(build)
    c, prod = p["consumer"], p["producer"]
    # one iteration is KG k-tiles: KG x 64 / 16 wgmmas, every one m64 x BM x k16 with A from registers
    want = build["NQ_RS_KG"] * BK // WGMMA_K
    assert build["NQ_RS_KG"] == 1 and want == 4
    assert c["wgmma"] == want == c["wgmma_register_a"], c
    assert sum(op.startswith("HGMMA") for op in c["ops"]) == want
    assert c["wgmma_shape"] == [64, build["NQ_RS_BM"], WGMMA_K]
    assert c["k_per_iteration"] == BK and c["k_tiles_per_iteration"] == 1
    assert c["straight_line"] and prod["straight_line"]
    # the weights never round-trip through shared memory, nor come from global memory in the loop:
    # one LDS.128 of the words and two LDS.U16 of the rows' scales a k-tile
    assert c["sts"] == 0 and not any(op.startswith(("STS", "STSM", "ST.")) for op in c["ops"]), c["ops"]
    assert c["ldg"] == 0 and c["ops"].count("LDS.128") == 1 and c["ops"].count("LDS.U16") == 2, c["ops"]
    # prefill_rs.cu's convert, 4 words a k-tile: per word 1 PRMT, 4 (and ^ magic) LOP3, 4 HSUB2, 4 HMUL2
    assert c["ops"].count("PRMT") == 4 and c["ops"].count("HADD2") == 16 and c["ops"].count("HMUL2") == 16
    assert sum(op.startswith("LOP3") for op in c["ops"]) >= 16
    assert c["groups"]["conversion"] >= 52 and sum(c["groups"].values()) == c["instructions"] == len(c["ops"])
    assert sum(c["classes"].values()) == c["instructions"]
    # the producer's k-tile: one TMA load of X, a bulk copy of W and one of its scales per consumer warpgroup
    assert prod["tma_loads"] == 1 and prod["k_tiles_per_iteration"] == 1
    assert prod["bulk_copies"] == 2 * build["NQ_RS_CWG"], prod["ops"]
    # one CTA an SM (plan_rs's wave model): two do not fit the registers (2 CWG) or shared memory (3 CWG)
    assert p["ctas_per_sm"] == 1 and p["registers"] * p["threads"] <= 65536


@needs_sass
def test_a_loop_with_a_branch_inside_is_not_counted_as_one_iteration():
    """KG 2 issues a lone k-tile's group at an odd KT's end, inside the loop: its static body is not
    one iteration's path, and the profile says so (gemm_rows refuses such a build)."""
    p = tool.loop_profile({**prefill_rs.RS_BUILD, "NQ_RS_KG": 2})
    assert not p["consumer"]["straight_line"] and p["consumer"]["wgmma"] > 2 * BK // WGMMA_K


@pytest.fixture(scope="module")
def rows():
    return tool.gemm_rows(config.load().model("7b"), TOKENS, SMS)


@needs_sass
def test_rows_hold_the_grid_and_the_waves(rows):
    assert [r["gemm"] for r in rows] == list(GEMMS)
    by = {r["gemm"]: r for r in rows}
    # grid (ceil(N / 64 CWG), ceil(T / 128)); 132 SMs; the k-tiles of K / 64
    want = {"qkv": (3, [24, 4], 1, 36, 56), "o_proj": (2, [28, 4], 1, 20, 56),
            "gate_up": (3, [198, 4], 6, 0, 56), "down": (2, [28, 4], 1, 20, 296)}
    for name, (cwg, grid, waves, idle_sms, k_tiles) in want.items():
        r = by[name]
        assert (r["cwg"], r["grid"], r["waves"], r["k_tiles_per_cta"]) == (cwg, grid, waves, k_tiles), r
        assert r["ctas"] == grid[0] * grid[1] and r["consumer_warps"] == 4 * cwg
        assert r["tail_idle"] == pytest.approx(idle_sms / SMS)
        assert r["mma_clocks"] == cwg * 4 * 64                     # 4 wgmma m64n128k16 a warpgroup, 64 clocks each
        assert r["swiglu"] == (name == "gate_up")
    for r in rows:
        for key in ("n", "k", "ctas", "waves", "k_tiles_per_cta", "consumer_warps", "consumer_instr_per_ktile",
                    "producer_instr_per_ktile", "conversion_instr_per_ktile", "slots_needed", "mma_clocks",
                    "slots_available", "slots_fraction", "busiest_scheduler_fraction", "conversion_share"):
            assert r[key] > 0, (r["gemm"], key)
        assert 0 <= r["tail_idle"] < 1 and 0 < r["conversion_share"] < 1


@needs_sass
def test_rows_are_consistent_with_their_own_fields(rows):
    profiles = {name: tool.loop_profile(b) for name, b in plan_builds().items()}
    for r in rows:
        p = profiles[r["gemm"]]
        assert r["consumer_instr_per_ktile"] == p["consumer"]["instructions"]       # KG 1: an iteration a k-tile
        assert r["producer_instr_per_ktile"] == p["producer"]["instructions"]
        needed = r["consumer_warps"] * r["consumer_instr_per_ktile"] + r["producer_instr_per_ktile"]
        assert r["slots_needed"] == needed
        assert r["slots_available"] == 4 * r["mma_clocks"]
        assert r["slots_fraction"] == pytest.approx(r["slots_needed"] / r["slots_available"])
        assert r["busiest_scheduler_fraction"] == pytest.approx(
            (r["cwg"] * r["consumer_instr_per_ktile"] + r["producer_instr_per_ktile"]) / r["mma_clocks"])
        assert r["conversion_share"] == pytest.approx(
            r["consumer_warps"] * r["conversion_instr_per_ktile"] / r["slots_needed"])
        # the consumer warps alone need 4 CWG x instr of 4 x 256 CWG slots: instr / 256 of them
        assert r["slots_fraction"] == pytest.approx(
            r["consumer_instr_per_ktile"] / 256 + r["producer_instr_per_ktile"] / r["slots_available"])


@needs_sass
def test_main_prints_the_table_and_writes_the_rows(rows, tmp_path, capsys):
    out = tmp_path / "rows.json"
    tool.main(["--json", str(out)])
    text = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(rows))
    assert text == tool.format_table(rows) + "\n"
    for r in rows:
        line = next(ln for ln in text.splitlines() if ln.split()[:2] == [r["gemm"], f"{r['n']}x{r['k']}"])
        assert f"{r['slots_fraction']:.3f}" in line and f"{r['tail_idle']:.1%}" in line, line
