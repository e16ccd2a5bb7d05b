"""The layout-3 streaming GEMV (kernels/lab/gemv_stream3.cu) on the CPU: NVRTC builds it for
sm_90 (7b and tiny dims, every knob set the bench times; no spills), and its SASS (nvdisasm)
shows what the design says: per group, two 16-byte global loads straight to registers with
the non-coherent, L1-bypassing path (LDG.E.NA.128.CONSTANT), shared memory read only for the
x fragments (4 x 16 bytes, plus the 16-byte fold / magic words or two 4-byte magic words),
nothing stored to shared memory, no cp.async or bulk copy anywhere, tensor-core MMAs, and an
issue count well under the ~3.7 lane-instructions per INT4 weight the read ceiling allows."""
from __future__ import annotations

import collections
import re

import pytest

from nanoqwen_lib import config
from nanoqwen_lib.gpu import cuda_build

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

KNOBS = [{}, {"NQ_S3_FOLD": 1}, {"NQ_S3_WARPS": 8, "NQ_S3_MIN_CTAS": 3}, {"NQ_S3_RING": 2},
         {"NQ_S3_RING": 8, "NQ_S3_MIN_CTAS": 2}, {"NQ_S3_RING": 8, "NQ_S3_MIN_CTAS": 2, "NQ_S3_FOLD": 1},
         {"NQ_S3_MIN_CTAS": 6}, {"NQ_S3_MIN_CTAS": 6, "NQ_S3_FOLD": 1}]
ENTRIES = ("nq_gemv_s3", "nq_gemv_s3_swiglu")


def knob_id(k):
    return ",".join(f"{a}={b}" for a, b in k.items()) or "defaults"


@pytest.mark.parametrize("dims", ["7b", "tiny"])
@pytest.mark.parametrize("extra", KNOBS, ids=knob_id)
def test_builds_without_spills(dims, extra):
    _, log = cuda_build.compile_cubin("lab/gemv_stream3", config.load().model(dims), extra)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    print(f"{dims} {knob_id(extra)}: registers {regs}, stack/spills {spills}")
    assert len(regs) == 2 and all(s == ("0", "0", "0") for s in spills), log


def main_loop(sass_text, entry):
    """The innermost loop holding the MMAs (the group loop)."""
    loops = [loop for loop in cuda_build.sass_loops(sass_text, entry) if "HMMA.16816.F32" in loop]
    assert loops, f"{entry}: no loop with HMMA"
    return min(loops, key=len)


@pytest.mark.parametrize("extra", KNOBS, ids=knob_id)
def test_sass_streams_weights_to_registers(extra):
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    t = {**config.load().tuning["lab/gemv_stream3"].defines, **extra}
    ring, fold = t["NQ_S3_RING"], t["NQ_S3_FOLD"]
    text = cuda_build.sass("lab/gemv_stream3", None, extra)
    for entry in ENTRIES:
        start = text.index(f".text.{entry}:")
        body = text[start:text.find("//----", start)]
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", body)
        whole = collections.Counter(ops)
        assert not any(o.startswith(("LDGSTS", "UBLKCP", "UTMALDG", "LDGDEPBAR")) for o in whole), whole
        loop = collections.Counter(main_loop(text, entry))
        ldg128 = sum(v for k, v in loop.items() if k.startswith("LDG") and ".128" in k)
        ldg128_nc = sum(v for k, v in loop.items() if re.match(r"LDG\.E\.(NA\.)?128\.CONSTANT$", k))
        lds128, lds32 = loop["LDS.128"], loop["LDS"]
        stores = sum(v for k, v in loop.items() if k.startswith(("STS", "STG", "ST.")))
        instr = sum(loop.values())
        per_weight = instr / (64 * ring)                  # a group is 64 weights per lane (2 rows x 32)
        print(f"{entry} {knob_id(extra)}: main loop {instr} instructions for {ring} groups, {per_weight:.2f} per weight; "
              f"LDG.128 {ldg128} (non-coherent {ldg128_nc}), LDS.128 {lds128}, LDS {lds32}, HMMA {loop['HMMA.16816.F32']}")
        assert ldg128 == ldg128_nc == 2 * ring, loop       # two 16-byte weight loads per group, .nc, no L1
        assert stores == 0, loop                           # nothing written to shared (or global) memory
        # shared memory: x (4 x LDS.128 per group) and the fold / magic words, never weights
        assert lds128 <= 5 * ring and lds32 <= 2 * ring and lds128 >= 4 * ring, loop
        assert lds128 + lds32 / 4 <= 5 * ring, loop
        assert loop["HMMA.16816.F32"] == 8 * ring, loop   # two m16n8k16 per word pair (rows g, g+8)
        assert loop["HADD2"] == (0 if fold else 32 * ring), loop   # the per-pair subtraction, or none (FOLD)
        assert per_weight < (1.5 if fold else 2.0), per_weight
