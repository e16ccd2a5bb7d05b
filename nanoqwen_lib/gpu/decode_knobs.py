"""The persistent decode step's compile-time knobs, each described once: its -D name, the typed
field of `pd::Config` the kernel reads it as, the values it may take, its role and what it
does. nanoqwen.yaml `tuning.decode_persistent.defines` holds the values (one source); this
table holds the meaning. tools/gen_decode_contract.py writes kernels/decode/config.cuh from it
(struct Config, the constant kCfg built from the -D values, a static_assert per range); a CPU
test checks that the committed header is the generator's output and that the yaml sets exactly
these knobs, each within its range. `check` refuses a bad value by name before NVRTC runs.

Roles: "tuned", chosen by a measurement (PERFLOG) and part of the default build; "lab", a
variant the bench builds (tools/bench_persistent.py --variants), off by default; "diagnostic",
a build that measures rather than decodes (timeline, probes, skipped instructions).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from nanoqwen_lib.errors import ConfigError
from nanoqwen_lib.gpu.decode_contract import KINDS


def _mask(*kinds: str) -> int:
    """Bits 1 << kind of the named instruction kinds (decode_contract.KINDS, the kernel's enum Kind)."""
    return sum(1 << KINDS.index(k) for k in kinds)


GEMV_KINDS = _mask("QKV", "O", "GATE_UP", "DOWN")          # what NQ_PD_LATE_RING may name
LAYER_KINDS = GEMV_KINDS | _mask("ATTN")                   # ... and NQ_PD_SKIP


@dataclass(frozen=True)
class Knob:
    define: str          # the -D name (nanoqwen.yaml)
    field: str           # pd::Config's member
    ctype: str           # "bool", "int" or "mask" (bits 1 << kind)
    lo: int              # int: lo..hi; bool: 0..1; mask: 0, and hi the bits it may set
    hi: int
    role: str            # "tuned", "lab" or "diagnostic"
    doc: str

    def allows(self, value) -> bool:
        if not isinstance(value, numbers.Integral):       # int, numpy's integers
            return False
        return value >= 0 and not value & ~self.hi if self.ctype == "mask" else self.lo <= value <= self.hi

    def expected(self) -> str:
        return f"bits of {self.hi:#x} (1 << kind)" if self.ctype == "mask" else f"{self.lo}..{self.hi}"


KNOBS = (
    Knob("NQ_PD_WARPS", "warps", "int", 4, 32, "tuned",
         "consumer warps a CTA (one CTA per SM)"),
    Knob("NQ_PD_RING", "ring", "int", 1, 8, "tuned",
         "layout-3 blocks in flight per warp (its ring)"),
    Knob("NQ_PD_SMEM_RING", "smem_ring", "bool", 0, 1, "lab",
         "the ring in shared memory, filled by cp.async (1), or in registers (0)"),
    Knob("NQ_PD_SMEM_PAD_KB", "smem_pad_kb", "int", 0, 227, "lab",
         "shared memory reserved and unused, KiB: what taking it from L1 costs"),
    Knob("NQ_PD_FENCE", "fence", "int", 0, 2, "tuned",
         "the counters' ordering [pd-fence]: 0 fence.sc, 1 fence.acq_rel, 2 release/acquire operations"),
    Knob("NQ_PD_ATTN_PRE", "attn_pre", "int", 1, 8, "tuned",
         "K/V rows a warp loads before attention's wait"),
    Knob("NQ_PD_ATTN_MERGE", "attn_merge", "bool", 0, 1, "tuned",
         "who merges a KV head's splits: every split a slice (1) or the last split to arrive all (0)"),
    Knob("NQ_PD_ATTN_LANES", "attn_lanes", "int", 0, 3, "tuned",
         "a split of at most 32 tokens as a lane per token (1; 2 and 3 its arithmetic unrolled, lab) "
         "or a warp per token (0)"),
    Knob("NQ_PD_DOWN_DEFER", "down_defer", "bool", 0, 1, "lab",
         "down's K slices added by the next qkv and o_proj (1) or folded by down (0) [pd-down-defer]"),
    Knob("NQ_PD_DOWN_SLICES", "down_slices", "bool", 0, 1, "lab",
         "each down unit waits only for the gate_up units that wrote its K slice (a counter per layer "
         "and slice), not for all of gate_up [pd-down-slices]"),
    Knob("NQ_PD_QKV_PREFETCH", "qkv_prefetch", "int", 0, 3, "tuned",
         "when down prefetches the next qkv share into L2: 1 at its start, 2 after its wait, "
         "3 after its stream, 0 never"),
    Knob("NQ_PD_LATE_RING", "late_ring", "mask", 0, GEMV_KINDS, "lab",
         "the GEMVs that ask for their ring only after their wait (0: all before)"),
    Knob("NQ_PD_QKV_LL", "qkv_ll", "bool", 0, 1, "lab",
         "attention polls q, k, v tagged with the layer instead of waiting on qkv's counter [pd-qkv-ll]"),
    Knob("NQ_PD_O_MERGE", "o_merge", "bool", 0, 1, "lab",
         "o_proj merges the attention's splits into its own staging: each unit waits for the KV "
         "heads its K slice reads (a counter per layer and KV head) instead of for all of the "
         "attention, which stores its partials only; the plan cuts o_proj's K by KV head [pd-o-merge]"),
    Knob("NQ_PD_O_MERGE_PRE", "o_merge_pre", "int", 0, 32, "lab",
         "with NQ_PD_O_MERGE, the splits whose partials of its first two outputs a thread loads "
         "into registers while the splits' weights are computed (the rest after them)"),
    Knob("NQ_PD_SKIP", "skip", "mask", 0, LAYER_KINDS, "diagnostic",
         "layer instructions reduced to their place in the schedule (the token's values are "
         "meaningless) [pd-skip]"),
    Knob("NQ_PD_HEAD_BLOCKS", "head_blocks", "int", 0, 32, "lab",
         "gate_up's and down's last blocks a warp, bulk-copied into shared memory before their wait [pd-head]"),
    Knob("NQ_PD_LOADER", "loader", "int", 0, 32, "lab",
         "a loader warp that copies every GEMV block into per-warp rings of this many pages, across "
         "instruction boundaries (0: off, every warp loads its own) [pd-loader]"),
    Knob("NQ_PD_LOADER_PAGE", "loader_page", "int", 1, 16, "lab",
         "layout-3 blocks a loader page"),
    Knob("NQ_PD_LOADER_SELF", "loader_self", "bool", 0, 1, "lab",
         "with the loader's rings, no loader warp: each consumer warp's lane 0 walks its own share of "
         "the schedule and issues its ring's next page as it gives one back [pd-loader-self]"),
    Knob("NQ_PD_LOADER_OWN", "loader_own", "mask", 0, GEMV_KINDS, "lab",
         "with the loader's rings, the GEMVs whose warps load their own blocks (the register ring "
         "and the L2 prefetches a layer ahead, as without the loader); the rings carry the rest "
         "[pd-loader-own]"),
    Knob("NQ_PD_LOADER_L2", "loader_l2", "bool", 0, 1, "lab",
         "with the loader, keep the L2 prefetches a layer ahead (o_proj's share during attention, "
         "the next qkv's during down), so that its copies read L2 [pd-loader]"),
    Knob("NQ_PD_ATTN_PREFETCH", "attn_prefetch", "bool", 0, 1, "tuned",
         "o_proj's share prefetched into L2 during attention"),
    Knob("NQ_PD_SELF_PREFETCH", "self_prefetch", "int", 0, 32, "lab",
         "gate_up's and down's own blocks a warp prefetched into L2 before their wait, past the ring"),
    Knob("NQ_PD_NORM_1PASS", "norm_1pass", "bool", 0, 1, "tuned",
         "the rmsnorm staging in one pass over x (1) or two"),
    Knob("NQ_PD_EARLY_BLOCKS", "early_blocks", "int", 0, 32, "lab",
         "gate_up blocks a warp prefetched into L2 during attention"),
    Knob("NQ_PD_FOLD", "fold", "bool", 0, 1, "tuned",
         "the fold unpack of layout 3 (stream3.cuh)"),
    Knob("NQ_PD_KMAX", "kmax", "int", 1, 16, "tuned",
         "tiles a warp's block range may touch (the plan keeps every warp within it)"),
    Knob("NQ_PD_PREFETCH_KB", "prefetch_kb", "int", 0, 1 << 20, "tuned",
         "lm_head's L2 prefetch of its rows at its start, KiB"),
    Knob("NQ_PD_ATTN_SPLITS", "attn_splits", "int", 1, 32, "tuned",
         "attention splits a KV head at most"),
    Knob("NQ_PD_ATTN_MIN_TOKENS", "attn_min_tokens", "int", 1, 1 << 20, "tuned",
         "tokens a split at least"),
    Knob("NQ_PD_TIMELINE", "timeline", "bool", 0, 1, "diagnostic",
         "each CTA records (code, begin, ready, end) of every instruction in %globaltimer ns"),
    Knob("NQ_PD_TIMEOUT_MS", "timeout_ms", "int", 1, 600_000, "tuned",
         "a wait's timeout, ms: past it the step sets kErrTimeout and gives up instead of hanging"),
    Knob("NQ_PD_PROBE", "probe", "int", 0, 1 << 16, "diagnostic",
         "the layer whose qkv and attention stamp their steps (0: none)"),
)
BY_DEFINE = {k.define: k for k in KNOBS}
# The GEMV split the planner computes for the grid (gpu.persistent.persistent_plan), not the yaml.
PLANNED = tuple(f"NQ_PD_{m}_{p}" for m in ("QKV", "O", "GU", "DOWN") for p in ("TG", "KS"))


def check(defines: dict, source, field: str = "") -> None:
    """Every persistent-step knob in `defines` within its range (ConfigError naming the knob,
    what it may be and what it is; `source` says where the values came from, `field` the path
    to them in it)."""
    for name, value in defines.items():
        knob = BY_DEFINE.get(name)
        if knob is not None and not knob.allows(value):
            raise ConfigError(source, f"{field}{name}", f"an integer {knob.expected()} ({knob.doc})",
                              value if isinstance(value, numbers.Integral) else repr(value))


# The loader builds ([pd-loader]) chapter 10 measures beside the default, and the bench's loader
# set starts from: 15 consumer warps and the loader warp (16 warps of registers, as the default's
# 16 consumers), each consumer's ring 5 pages of 2 blocks (the fastest ring of PERFLOG's "the
# loader warp, built and measured"), without and with the default's L2 prefetches a layer ahead.
LOADER = {"NQ_PD_WARPS": 15, "NQ_PD_LOADER": 5, "NQ_PD_LOADER_PAGE": 2}
# [pd-loader-self]: the same rings without the loader warp, filled by the 16 consumers themselves;
# 4 pages of 2 blocks a warp, the deepest ring of 2-block pages that fits 227 KiB beside the staging.
LOADER_SELF = {"NQ_PD_LOADER": 4, "NQ_PD_LOADER_PAGE": 2, "NQ_PD_LOADER_SELF": 1}
LOADER_BUILDS = {"loader warp": LOADER, "loader warp, L2 a layer ahead": dict(LOADER, NQ_PD_LOADER_L2=1),
                 "consumers load their own rings": LOADER_SELF}
