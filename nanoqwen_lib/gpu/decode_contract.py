"""The host <-> device contract of the decode step, written once: what the host puts where for
kernels/decode_persistent.cu (and the step's scalars and error codes, which
kernels/engine_step.cu shares), and what the device reports back.

tools/gen_decode_contract.py writes kernels/decode_contract.cuh from this module (the
kernels include it); gpu.persistent and gpu.engine import their constants from here. A CPU
test checks that the committed header is the generator's output. Plain data only: change it
here, run the generator, commit both.
"""
from __future__ import annotations

# The pointer table (one int64 per slot, built by gpu.persistent): the global slots, in
# order, as C++ enum Tab (T_<name>, then T_GLOBALS = how many). MAX_PAGES and GRID hold
# values, not pointers.
TAB_GLOBALS = ("EMBED", "NORM", "LM_HEAD", "LOGITS", "SCALARS", "BLOCK_TABLE", "FREE_PAGES", "GENERATED",
               "X", "QKV", "ATTN", "GATE_UP", "SYNC", "WS", "TILE_CNT", "ATTN_WS", "ATTN_CNT",
               "ARG_VAL", "ARG_IDX", "ARG_CNT", "TIMELINE", "INV_FREQ", "MAX_PAGES", "PROBE", "GRID",
               "WS_DOWN", "QKV_TAG", "SLICE_CNT")
# Each layer's slots, as enum LayerTab (L_<name>, then L_FIELDS): layer l's row starts at
# LAYER_BASE + LAYER_STRIDE * l (kLayerBase, kLayerStride).
TAB_LAYER = ("QKV", "O", "GATE_UP", "DOWN", "LN1", "LN2", "QKV_BIAS", "K", "V")
LAYER_BASE, LAYER_STRIDE = 32, 16

# The instruction kinds, as enum Kind (K_<name>, 0..7): the timeline's code is layer * 16 + kind
# (measure/timeline.py KINDS, same order).
KINDS = ("BEGIN", "QKV", "ATTN", "O", "GATE_UP", "DOWN", "LM_HEAD", "END")

# The launch's flags argument, as enum Flags (F_<name>): BEGIN: bookkeeping + embed first;
# HEAD: lm_head + argmax + bookkeeping last.
FLAGS = {"BEGIN": 1, "HEAD": 2}

# The step's device scalars, one int32 per 128-byte line (stride NQ_SCALAR_STRIDE), in order:
# gpu.engine SCALARS (these names) and C++ S_<short> (the slot index).
SCALARS = ("token", "position", "context_len", "slot", "free_top", "error")
SCALAR_CONSTS = ("S_TOKEN", "S_POSITION", "S_CONTEXT", "S_SLOT", "S_FREE_TOP", "S_ERROR")

# scalars[error]: code -> (C++ constant, what it means). 1 and 2 are the step's bookkeeping
# (engine_step.cu's nq_step_begin and the persistent step's begin); 3..5 the persistent kernel's.
ERROR_CODES = {
    1: ("kErrMaxPages", "the position is past the block table (max pages)"),
    2: ("kErrNoPage", "the KV page pool is exhausted (no free page)"),
    3: ("kErrTimeout", "a dependency wait timed out (NQ_PD_TIMEOUT_MS)"),
    4: ("kErrLaunch", "launched with too little shared memory or another grid than its buffers were sized for"),
    5: ("kErrPlan", "the plan broke a kernel limit (NQ_PD_KMAX tiles a warp, a row a thread)"),
}
STEP_ERRORS = (1, 2)            # the engine reports these as a KV-page limit
ERRORS = {code: msg for code, (_, msg) in ERROR_CODES.items() if code not in STEP_ERRORS}   # the persistent kernel's
