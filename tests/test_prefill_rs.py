"""The RS-form INT4 GEMM (kernels/prefill_rs.cu) on the CPU: its weight order puts
every code where wgmma's register A fragment wants it, and its build is the RS form (HGMMA with
a register A operand, no shared-memory store of the weights, no spill, no serialized wgmma).
Its results against float64: tests/test_gpu_prefill_rs.py (needs a Hopper GPU)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.format import quant
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs

# One RS word's 8 codes, in ValueShuffle's value order: (row, column) offsets from (16 w + g,
# 16 s + 2 t); the kernel's conversion pairs values (2p, 2p + 1) into its a[p].
FRAGMENT_ROWS = (0, 0, 8, 8, 0, 0, 8, 8)
FRAGMENT_COLS = (0, 1, 0, 1, 8, 9, 8, 9)


def fragment_codes(rs: np.ndarray) -> dict:
    """The codes each thread's A fragments hold, decoded from the RS order as the kernel reads
    it (word s of lane l of warp w at k-tile kt): {(row, col): code}, rows across the blocks."""
    nb, kt_n = rs.shape[:2]
    codes = quant.unpack_int4_value_shuffle(rs.reshape(-1, 1)).reshape(nb, kt_n, 4, 32, 4, 8)
    out = {}
    for b, kt, w, lane, s, i in np.ndindex(nb, kt_n, 4, 32, 4, 8):
        row = 64 * b + 16 * w + lane // 4 + FRAGMENT_ROWS[i]
        col = 64 * kt + 16 * s + 2 * (lane % 4) + FRAGMENT_COLS[i]
        out[(row, col)] = int(codes[b, kt, w, lane, s, i])
    return out


@pytest.mark.parametrize("n, k", [(64, 128), (200, 256)])
def test_rs_order_puts_every_code_in_its_fragment(rng, n, k):
    """wgmma's A fragment (PTX ISA, register fragment of m64nNk16 .f16; wgmma_rs_ops.cuh):
    thread (warp w, lane 4g + t) holds in a[0], a[1], a[2], a[3] the (row, k) pairs
    (16w+g, 2t..), (16w+g+8, 2t..), (16w+g, 2t+8..), (16w+g+8, 2t+8..) of each k16 step;
    decoded as the kernel reads it, the RS order must give W's code at each, zeros past N."""
    codes = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    rs = prefill_rs.rs_order(quant.pack_int4_value_shuffle(codes))
    assert rs.shape == (-(-n // 64), k // 64, 4, 32, 4) and rs.dtype == np.uint32
    got = fragment_codes(rs)
    rows = -(-n // 64) * 64
    assert len(got) == rows * k                                # every (row, col) exactly once
    for w in range(4):                                         # the fragment map, written out
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for pair, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                for half in (0, 1):                            # the lower k in the lower half
                    for s in range(k // 16):
                        row, col = 16 * w + g + dr, 16 * s + 2 * t + dc + half
                        want = codes[row, col] if row < n else 0
                        assert got[(row, col)] == want, (w, lane, pair, half, s)
    full = np.array([[got[(r, c)] for c in range(k)] for r in range(rows)])
    assert (full[:n] == codes).all() and (full[n:] == 0).all()


@pytest.mark.parametrize("n, k", [(64, 128), (200, 384)])
def test_rs_scales_put_each_block_and_group_together(rng, n, k):
    """The shared-memory path copies 128 bytes a feature block and group: the 64 rows' scales of
    that group, in row order, zeros past N."""
    scales = rng.uniform(0.001, 0.02, size=(n, k // quant.GROUP_SIZE)).astype(np.float16)
    got = prefill_rs.rs_scales(scales)
    nb = -(-n // 64)
    assert got.shape == (nb, k // quant.GROUP_SIZE, 64) and got.dtype == np.float16 and got.flags.c_contiguous
    for b, grp, r in np.ndindex(*got.shape):
        row = 64 * b + r
        assert got[b, grp, r] == (scales[row, grp] if row < n else 0), (b, grp, r)
    with pytest.raises(NanoqwenError, match="fp16"):
        prefill_rs.rs_scales(scales.astype(np.float32))


@pytest.mark.parametrize("i, k", [(64, 128), (40, 256)])
def test_swiglu_rows_give_one_thread_the_gate_and_up_of_a_feature(rng, i, k):
    """After swiglu_rows and rs_order, the thread whose fragments hold rows 16 w + g and
    16 w + g + 8 of block b holds gate row f = 32 b + 8 w + g and up row I + f of the file's
    gate_up (the SwiGLU epilogue's reading), every code of both, zeros for f >= I."""
    codes = rng.integers(-8, 8, size=(2 * i, k), dtype=np.int8)
    scales = rng.uniform(0.001, 0.02, size=(2 * i, k // quant.GROUP_SIZE)).astype(np.float16)
    words, sc = prefill_rs.swiglu_rows(quant.pack_int4_value_shuffle(codes), scales)
    nb = -(-i // 32)
    assert words.shape == (64 * nb, k // 8) and sc.shape == (64 * nb, k // quant.GROUP_SIZE)
    got = fragment_codes(prefill_rs.rs_order(words))
    for b, w, g in np.ndindex(nb, 4, 8):
        f, row = 32 * b + 8 * w + g, 64 * b + 16 * w + g
        for col in range(k):
            assert got[(row, col)] == (codes[f, col] if f < i else 0), (b, w, g, col)
            assert got[(row + 8, col)] == (codes[i + f, col] if f < i else 0), (b, w, g, col)
        want = (scales[f], scales[i + f]) if f < i else (0, 0)
        assert (sc[row] == want[0]).all() and (sc[row + 8] == want[1]).all()
    with pytest.raises(NanoqwenError, match="2I"):
        prefill_rs.swiglu_rows(np.zeros((3, 16), np.uint32), np.zeros((3, 1), np.float16))


def test_rs_order_refuses_what_it_cannot_lay_out():
    with pytest.raises(NanoqwenError, match="multiple of 128"):
        prefill_rs.rs_order(np.zeros((64, 8), np.uint32))     # K = 64
    with pytest.raises(NanoqwenError, match="uint32"):
        prefill_rs.rs_order(np.zeros((64, 16), np.int32))


BUILDS = [{}, {"NQ_RS_OVERLAP": 1, "NQ_RS_WSMEM": 0}, {"NQ_RS_BM": 64}, {"NQ_RS_CWG": 1},
          {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}, {"NQ_RS_KG": 2}, {"NQ_RS_WSMEM": 0},
          {"NQ_RS_WSMEM": 0, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6},
          {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6, "NQ_RS_KG": 2}, {"NQ_RS_SWIGLU": 1},
          {"NQ_RS_SWIGLU": 1, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6},
          {"NQ_RS_OVERLAP": 2}, {"NQ_RS_OVERLAP": 2, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6},
          {"NQ_RS_OVERLAP": 2, "NQ_RS_SWIGLU": 1, "NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}]   # the default and tests/test_gpu_prefill_rs.py's


@pytest.mark.parametrize("change", BUILDS, ids=lambda b: ",".join(f"{k[6:]}={v}" for k, v in b.items()) or "default")
def test_rs_build_is_the_register_form(change):
    build = {**prefill_rs.RS_BUILD, **change}
    overlap = build["NQ_RS_OVERLAP"]
    _, log = cuda_build.compile_cubin("prefill_rs", None, build)
    report = " ".join(cuda_build.resource_report(log))
    assert "0 bytes spill stores" in report, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs <= 65536 // (128 * (1 + build["NQ_RS_CWG"])), report
    # the default waits for each group before converting the next k-tile: no serialization;
    # overlapping one group a k-tile in one warpgroup is what ptxas serializes (C7513), kept to
    # show it; [rs-overlap]'s groups a k16 step with two fragment sets are not serialized
    assert ("C7513" in log) == (overlap == 1), log
    text = cuda_build.sass("prefill_rs", None, build)
    hgmma = [l for l in text.splitlines() if "HGMMA" in l]
    form = re.compile(rf"HGMMA\.64x{build['NQ_RS_BM']}x16\.F32 R\d+, R\d+, gdesc\[")
    assert hgmma and all(form.search(l) for l in hgmma), hgmma[:3]
    assert not re.search(r"\bSTS(\.|\s)", text), "a shared-memory store: the weights must stay in registers"
    if build["NQ_RS_WSMEM"]:   # the k loop reads W and its scales from the stage, never from global memory
        # (the shortest loop with the wgmmas: the mbarrier waits' retry blocks sit after the
        # epilogue, and their backward branches make longer spans that hold the epilogue's loads)
        k_loop = min((loop for loop in cuda_build.sass_loops(text, "nq_prefill_rs") if any("HGMMA" in op for op in loop)),
                     key=len)
        assert not any(op.startswith("LDG") for op in k_loop) and any(op.startswith("LDS") for op in k_loop), k_loop


@pytest.mark.parametrize("wsmem", [0, 1])
@pytest.mark.parametrize("probe", [1, 2])
def test_rs_probes_build(probe, wsmem):
    """The timing probes (tools/bench_prefill_rs.py): 1 keeps the wgmmas without the conversion,
    2 the conversion without the wgmmas; both compile without spills."""
    build = {**prefill_rs.RS_BUILD, "NQ_RS_PROBE": probe, "NQ_RS_WSMEM": wsmem}
    _, log = cuda_build.compile_cubin("prefill_rs", None, build)
    assert "0 bytes spill stores" in " ".join(cuda_build.resource_report(log)), log
    hgmma = [l for l in cuda_build.sass("prefill_rs", None, build).splitlines() if "HGMMA" in l]
    assert bool(hgmma) == (probe == 1)


def test_the_build_has_one_source():
    """The kernel's nq-build line is what the launcher reads and what compile_options passes."""
    assert set(prefill_rs.RS_BUILD) == {"NQ_RS_BM", "NQ_RS_CWG", "NQ_RS_STAGES", "NQ_RS_PF", "NQ_RS_OVERLAP", "NQ_RS_KG", "NQ_RS_WSMEM", "NQ_RS_PROBE",
                                       "NQ_RS_SWIGLU"}
    opts = cuda_build.compile_options(None, cuda_build.planned_defines("prefill_rs", None), include_cuda=False,
                                      name="prefill_rs")
    for k, v in prefill_rs.RS_BUILD.items():
        assert f"-D{k}={v}" in opts
    assert cuda_build.kernel_build("prefill_gemm") == {}


def test_plan_rs_picks_the_measured_fastest_build():
    """plan_rs's wave model picks, on 132 SMs at T = 512, the build measured fastest per shape
    (PERFLOG, "Issue 29 measured"): qkv and gate_up (SwiGLU, N = 2I) 3 consumer warpgroups,
    o_proj and down 2; one token tile (T <= 128) keeps qkv's 72 CTAs of 2c in one wave."""
    three = {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}
    assert [prefill_rs.plan_rs(512, n, 132) for n in (4608, 3584, 37888, 3584)] == [three, {}, three, {}]
    assert prefill_rs.plan_rs(100, 4608, 132) == {}
    assert prefill_rs.plan_rs(2048, 3584, 132) == {}     # 448 CTAs of 2c (4 waves) cost 304 of 3c (3): a tie keeps 2


@pytest.mark.parametrize("change", [{}, {"NQ_RS_CWG": 3, "NQ_RS_STAGES": 6}], ids=["2c", "3c"])
def test_rs_overlap_keeps_the_wgmmas_in_flight(change):
    """[rs-overlap] (NQ_RS_OVERLAP 2): the kernel's eight HGMMAs (the k loop's two k-tiles of four
    k16 steps) are each followed by a wait that leaves four groups in flight
    (WARPGROUP.DEPBAR.LE gsb0, 0x4), and the one full drain (0x0) is the one after the loop; the
    serialized build drains after every HGMMA. Their A operands are eight distinct register
    quads: two fragment sets, one read while the other is converted."""
    build = {**prefill_rs.RS_BUILD, "NQ_RS_OVERLAP": 2, **change}
    lines = cuda_build.sass("prefill_rs", None, build).splitlines()
    hgmma = [l for l in lines if "HGMMA" in l]
    waits = [re.search(r"gsb0,\s*(0x[0-9a-f]+)", l).group(1) for l in lines if "WARPGROUP.DEPBAR" in l]
    assert len(hgmma) == 8, hgmma
    assert sorted(waits) == ["0x0"] + ["0x4"] * 8, waits
    a_regs = {re.search(r"HGMMA\S* R\d+, (R\d+),", l).group(1) for l in hgmma}
    assert len(a_regs) == 8, hgmma
