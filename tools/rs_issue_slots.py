"""Issue slots of the RS-form INT4 prefill GEMM (kernels/prefill_rs.cu), per k-tile, from its SASS
(CPU only: NVRTC builds it for sm_90a, nvdisasm reads it; no GPU).

    python tools/rs_issue_slots.py [--tokens 512] [--sms 132] [--model 7b] [--json OUT]

For each build `ops_prefill_rs.plan_rs` picks for the model's four prefill GEMMs (qkv, o_proj,
gate_up with the SwiGLU epilogue, down), loop_profile finds in the SASS the consumer's k-tile
loop (the loop with the HGMMAs whose A operand is a register) and the producer's (the one with
the TMA load of X and the bulk copies of W and its scales), and counts their instructions per
iteration and warp, by class. gemm_rows turns that into a CTA's issue slots per k-tile,

    needed = consumer warps x consumer instructions per k-tile + producer instructions per k-tile

(the producer is one thread of one warp; a predicated-off instruction still takes its slot)
against what the SM can issue while the tensor cores do the k-tile's wgmmas at the dense FP16
rate, available = ISSUE_PER_CLOCK x MMA clocks: above 1 the k-tile is issue-bound. Beside it:
the busiest scheduler's share (warp w on scheduler w % 4: the producer's warp 0 and CWG consumer
warps on scheduler 0), the conversion's share of the needed slots, and the grid's one-wave tail.

The counts are static (one pass through each loop body, the mbarrier waits succeeding at once:
their retry blocks sit after the epilogue and are not counted), so they are issue slots, not
cycles: stalls, the wgmma wait of each group and the scoreboard are not in them. Of
cuda_build.sass_loop_spans' backward-branch spans, a span holding an EXIT is a retry block's jump back
(not an iteration); of the rest, the consumer loop is the one with the HGMMAs, the producer's the
one with the UTMALDG, each required unique and straight-line.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoqwen_lib import config  # noqa: E402
from nanoqwen_lib.format.layout import decode_gemv_shapes  # noqa: E402
from nanoqwen_lib.gpu import cuda_build, hardware  # noqa: E402
from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs  # noqa: E402

KERNEL, ENTRY = "prefill_rs", "nq_prefill_rs"

# The tensor cores' dense FP16 rate (FP32 accumulation) of one SM, FLOP a clock: H100 / H200 SXM
# are quoted at 989 TFLOP/s dense FP16 for 132 SMs at 1.83 GHz: 989e12 / (132 x 1.83e9) = 4094,
# i.e. 4096 = 1024 FP16 FMAs a clock (4 tensor cores x 256). One wgmma m64n128k16 (2 x 64 x 128 x
# 16 FLOP) then takes 64 clocks.
SPEC_DENSE_FP16_TFLOPS, SPEC_SMS, SPEC_CLOCK_GHZ = 989, 132, 1.83
MMA_FLOP_PER_CLOCK = 4096
SCHEDULERS = 4                 # warp schedulers per SM, one instruction each a clock
ISSUE_PER_CLOCK = SCHEDULERS   # issue slots per clock per SM
RESERVED_SMEM = 1024           # shared memory sm_90 reserves per block (cudaDevAttrReservedSharedMemoryPerBlock)

# The consumer loop's instructions in the classes that matter here, by opcode (the name before its
# first dot). The conversion is prefill_rs.cu's `convert`: PRMT, LOP3 (the mask and the magic
# number's XOR in one), HADD2 (hsub2), HMUL2 (the scale); HFMA2 for an FMA form. Every other
# opcode (addresses, the ring's counters, the masks' register moves, branches) is "other".
GROUPS = (("conversion", ("LOP3", "PRMT", "HADD2", "HMUL2", "HFMA2")),
          ("LDS", ("LDS", "LDSM")),
          ("WGMMA", ("HGMMA", "WARPGROUP")),
          ("barrier/sync", ("SYNCS", "BAR", "WARPSYNC", "DEPBAR")))
RS_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.\S+\s+R\d+,\s*R\d+,\s*gdesc\[")   # D, A from registers, B desc
MASK_MOVE = re.compile(r"^(IMAD\.MOV\.U32\s+R\d+,\s*RZ,\s*RZ|MOV\s+R\d+),\s*0xf000f0?\b")


def groups(ops) -> dict[str, int]:
    """Opcodes -> count per GROUPS name, every one present, in order, plus "other"."""
    out = {name: 0 for name, _ in GROUPS} | {"other": 0}
    for op, n in collections.Counter(ops).items():
        base = op.split(".")[0]
        out[next((name for name, members in GROUPS if base in members), "other")] += n
    return out


def kernel_k_tile() -> int:
    """k of one k-tile, read from kernels/prefill_rs.cu (`constexpr int BK = 64;`)."""
    return int(re.search(r"constexpr int BK = (\d+);", cuda_build.kernel_source(KERNEL)).group(1))


def _straight(lines: list[str], labels: dict[str, int], first: int, last: int) -> bool:
    """Whether the loop lines[first..last] is straight-line: no branch before its last lands
    inside it. A branch out and back (to a retry block) is straight-line, and so is BRA.U.ANY:
    the elect loop around a uniform TMA / bulk copy, one pass for the producer's one active thread."""
    targets = [labels.get(m.group(1), -1) for ln in lines[first:last]
               if not ln.startswith("BRA.U.ANY") and (m := re.search(r"BRA\S*\s.*?(\.L_x_\d+)", ln))]
    return not any(first < t < last + 1 for t in targets)


def _one(lines: list[str], spans: list[tuple[int, int]], what: str, has) -> tuple[int, int]:
    found = [(a, b) for a, b in spans if any(has(ln) for ln in lines[a:b + 1])]
    if len(found) != 1:
        raise RuntimeError(f"{ENTRY}: expected one {what} loop, found {len(found)} "
                           f"(lengths {[b - a + 1 for a, b in found]}); the SASS's shape changed")
    return found[0]


@functools.lru_cache(maxsize=None)
def _profile(build_items: tuple) -> dict:
    build = dict(build_items)
    _, log = cuda_build.compile_cubin(KERNEL, None, build)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    text = cuda_build.sass(KERNEL, None, build)
    code, labels = cuda_build.sass_code(text, ENTRY)
    # A backward branch whose span holds an EXIT is a retry block's jump back into a loop over the
    # code between (the mbarrier waits' retry blocks sit after the epilogue), not an iteration.
    spans = [(a, b) for a, b in cuda_build.sass_loop_spans(code, labels)
             if not any(ln.startswith("EXIT") for ln in code[a:b + 1])]
    ca, cb = _one(code, spans, "consumer (HGMMA)", lambda ln: ln.startswith("HGMMA"))
    pa, pb = _one(code, spans, "producer (UTMALDG)", lambda ln: ln.startswith("UTMALDG"))
    lines = code[ca:cb + 1]
    cons, prod = [ln.split()[0] for ln in lines], [ln.split()[0] for ln in code[pa:pb + 1]]
    straight, prod_straight = _straight(code, labels, ca, cb), _straight(code, labels, pa, pb)
    hgmma = [ln for ln in lines if ln.startswith("HGMMA")]
    shapes = {tuple(int(x) for x in m.groups()) for m in map(RS_HGMMA.match, hgmma) if m}
    if len(shapes) != 1 or sum(map(bool, map(RS_HGMMA.match, hgmma))) != len(hgmma):
        raise RuntimeError(f"{ENTRY}: the consumer loop's HGMMAs are not one register-A shape: {hgmma}")
    (m, n, k16), = shapes
    bk = kernel_k_tile()
    k_iter = len(hgmma) * k16
    tma = sum(op.startswith("UTMALDG") for op in prod)
    return {
        "build": build, "registers": regs, "threads": 128 * (1 + build["NQ_RS_CWG"]),
        "ctas_per_sm": ctas_per_sm(build, regs), "k_tile": bk,
        "consumer": {
            "ops": cons, "instructions": len(cons), "straight_line": straight,
            "classes": cuda_build.sass_classes(cons), "groups": groups(cons),
            "wgmma": len(hgmma), "wgmma_register_a": sum(bool(RS_HGMMA.match(ln)) for ln in hgmma),
            "wgmma_shape": [m, n, k16], "k_per_iteration": k_iter,
            "k_tiles_per_iteration": k_iter // bk if k_iter % bk == 0 else k_iter / bk,
            "sts": sum(op.startswith("STS") for op in cons), "ldg": sum(op.startswith("LDG") for op in cons),
            "mask_moves": sum(bool(MASK_MOVE.match(ln)) for ln in lines)},
        "producer": {
            "ops": prod, "instructions": len(prod), "straight_line": prod_straight,
            "classes": cuda_build.sass_classes(prod), "groups": groups(prod),
            "tma_loads": tma, "bulk_copies": sum(op.startswith("UBLKCP") for op in prod),
            "k_tiles_per_iteration": tma},     # its loop is prefill_rs.cu's `for kt`: one X tile a k-tile
    }


def loop_profile(build: dict) -> dict:
    """The SASS of one full build (RS_BUILD's names, as the launcher compiles it): its consumer
    k-tile loop and producer loop, per iteration and warp, by class; registers, CTAs per SM."""
    return _profile(tuple(sorted(build.items())))


def ctas_per_sm(build: dict, regs: int) -> int:
    """CTAs of a build one SM holds: registers (allocated per warp in 256s), shared memory
    (ops_prefill_rs.smem_bytes plus the reserved 1 KiB) and 2048 threads (the design target's
    numbers: nanoqwen.yaml `hardware:`, as every planner's on a CPU)."""
    hw = hardware.design_target()
    threads = 128 * (1 + build["NQ_RS_CWG"])
    by_regs = hw.regs_per_sm // (threads // 32 * -(-regs * 32 // 256) * 256)
    by_smem = hw.smem_per_sm // (prefill_rs.smem_bytes(build) + RESERVED_SMEM)
    return min(by_regs, by_smem, 2048 // threads)


def gemm_rows(dims, tokens: int, sms: int) -> list[dict]:
    """One row per prefill GEMM of the model (decode_gemv_shapes: qkv, o_proj, gate_up with the
    SwiGLU epilogue, down) at `tokens` tokens on `sms` SMs, with the build plan_rs picks."""
    rows = []
    for name, (n, k) in decode_gemv_shapes(dims).items():
        swiglu = name == "gate_up"                         # the engine's gate_up: gemm_int4_rs_swiglu, N = 2I
        plan = prefill_rs.plan_rs(tokens, n, sms)
        # the defines exactly as the launchers merge them (gemm_int4_rs / gemm_int4_rs_swiglu call _build)
        build = prefill_rs._build("tools/rs_issue_slots", plan, NQ_RS_SWIGLU=int(swiglu))
        p = loop_profile(build)
        cons, prod = p["consumer"], p["producer"]
        cwg, bm, bk = build["NQ_RS_CWG"], build["NQ_RS_BM"], p["k_tile"]
        if not (cons["straight_line"] and prod["straight_line"]):     # e.g. KG 2: a tail group inside the loop
            raise RuntimeError(f"{name}: a loop body with branches inside it: its static count is not one iteration's")
        if k % bk or cons["k_per_iteration"] % bk or cons["wgmma_shape"][1] != bm:
            raise RuntimeError(f"{name}: K {k}, k-tile {bk}, consumer loop {cons['k_per_iteration']} k, "
                               f"wgmma N {cons['wgmma_shape'][1]} vs BM {bm}")
        grid = [-(-n // (prefill_rs.ROWS * cwg)), -(-tokens // bm)]          # ops_prefill_rs._launch's
        ctas = grid[0] * grid[1]
        slots_per_wave = sms * p["ctas_per_sm"]
        waves = -(-ctas // slots_per_wave)
        last = ctas - (waves - 1) * slots_per_wave
        warps = 4 * cwg
        c_kt = cons["instructions"] / cons["k_tiles_per_iteration"]        # per consumer warp and k-tile
        p_kt = prod["instructions"] / prod["k_tiles_per_iteration"]
        conv_kt = cons["groups"]["conversion"] / cons["k_tiles_per_iteration"]
        m, wn, k16 = cons["wgmma_shape"]
        wgmma_kt = cons["wgmma"] / cons["k_tiles_per_iteration"]           # per warpgroup and k-tile
        mma_clocks = cwg * wgmma_kt * 2 * m * wn * k16 / MMA_FLOP_PER_CLOCK
        needed = warps * c_kt + p_kt
        available = ISSUE_PER_CLOCK * mma_clocks
        busiest = warps // SCHEDULERS * c_kt + p_kt                        # scheduler 0: the producer's warp too
        rows.append({
            "gemm": name, "n": n, "k": k, "tokens": tokens, "sms": sms, "swiglu": swiglu,
            "cwg": cwg, "stages": build["NQ_RS_STAGES"], "bm": bm, "registers": p["registers"],
            "grid": grid, "ctas": ctas, "ctas_per_sm": p["ctas_per_sm"], "waves": waves,
            "tail_idle": 1 - last / slots_per_wave, "k_tiles_per_cta": k // bk, "consumer_warps": warps,
            "consumer_instr_per_ktile": c_kt, "producer_instr_per_ktile": p_kt,
            "conversion_instr_per_ktile": conv_kt, "consumer_groups": cons["groups"],
            "mask_moves_per_ktile": cons["mask_moves"] / cons["k_tiles_per_iteration"],
            "slots_needed": needed, "mma_clocks": mma_clocks, "slots_available": available,
            "slots_fraction": needed / available, "busiest_scheduler_fraction": busiest / mma_clocks,
            "conversion_share": warps * conv_kt / needed,
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as two text tables: the consumer loop per build, then the per-GEMM slots."""
    out = [f"RS-form INT4 prefill GEMM ({KERNEL}.cu), T = {rows[0]['tokens']}, {rows[0]['sms']} SMs; "
           f"MMA at {MMA_FLOP_PER_CLOCK} FLOP/clock/SM (dense FP16), {ISSUE_PER_CLOCK} issue slots/clock/SM", "",
       "consumer loop, instructions per warp and k-tile (SASS; (mask mov): of other, the 0xf000f / 0xf000f0 "
           "masks moved into registers for LOP3), producer loop per k-tile:"]
    names = [name for name, _ in GROUPS] + ["other"]
    head = (f"  {'gemm':8} {'build':14} {'regs':>4} {'instr':>6} " + " ".join(f"{n:>12}" for n in names)
            + f" {'(mask mov)':>10} {'producer':>9}")
    out += [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        g = r["consumer_groups"]
        build = f"{r['cwg']}c st{r['stages']}" + (" swiglu" if r["swiglu"] else "")
        out.append(f"  {r['gemm']:8} {build:14} {r['registers']:>4} {r['consumer_instr_per_ktile']:>6.0f} "
                   + " ".join(f"{g[n]:>12}" for n in names)
                   + f" {r['mask_moves_per_ktile']:>10.0f} {r['producer_instr_per_ktile']:>9.0f}")
    out += ["", "per GEMM, per CTA and k-tile:"]
    cols = [("gemm", 8, "", "gemm"), ("N x K", 11, "", "shape"), ("CTAs", 5, "", "ctas"), ("waves", 5, "", "waves"),
            ("tail idle", 9, ".1%", "tail_idle"), ("k-tiles", 7, "", "k_tiles_per_cta"),
            ("c.warps", 7, "", "consumer_warps"), ("slots", 6, ".0f", "slots_needed"),
            ("MMA clk", 7, ".0f", "mma_clocks"), ("avail", 6, ".0f", "slots_available"),
            ("need/avail", 10, ".3f", "slots_fraction"), ("busiest sch", 11, ".3f", "busiest_scheduler_fraction"),
            ("conversion", 10, ".1%", "conversion_share")]
    head = "  " + " ".join(f"{c:{'<' if key == 'gemm' else '>'}{w}}" for c, w, _, key in cols)
    out += [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        r = {**r, "shape": f"{r['n']}x{r['k']}"}
        out.append("  " + " ".join(f"{r[key]:{'<' if key == 'gemm' else '>'}{w}{spec}}" for _, w, spec, key in cols))
    out += ["", "slots = consumer warps x consumer instr + producer instr; avail = 4 x MMA clk; need/avail > 1: "
            "issue-bound; busiest sch = scheduler 0 (CWG consumer warps + the producer's) / MMA clk; conversion = "
            "LOP3/PRMT/HADD2/HMUL2/HFMA2 of the consumers / slots; tail idle = SMs idle in the last wave"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--model", default="7b")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    rows = gemm_rows(config.load().model(a.model), a.tokens, a.sms)
    print(format_table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
