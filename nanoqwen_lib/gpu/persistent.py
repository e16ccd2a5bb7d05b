"""The persistent decode step (kernels/decode_persistent.cu): one kernel per token, one CTA
per SM, walking the layer's instructions with dependency counters in device memory.

The engine (gpu.engine, decode="persistent") owns the arena; this module adds what the
kernel needs besides it: the layout-3 copies of the four INT4 projections
(format/stream_layout.py; the prefill keeps reading layout 1), the counters and
workspaces, the pointer table, and the launch. The table's order, the flags and the error
codes are gpu.decode_contract's (the kernel includes the header generated from it). Nothing
here runs without a GPU except the pure functions (plan, shared-memory size), which the CPU
tests check against the kernel source.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import CONFIG_PATH, ModelDims, load
from nanoqwen_lib.errors import LimitError
from nanoqwen_lib.format.layout import decode_gemv_shapes
from nanoqwen_lib.format.stream_layout import BLOCK_BYTES, stream_bytes
from nanoqwen_lib.gpu import decode_contract, decode_knobs
from nanoqwen_lib.gpu.decode_step import PERSISTENT_STEP

KERNEL = "decode_persistent"
TUNING = load().tuning[KERNEL].defines
decode_knobs.check(TUNING, CONFIG_PATH, "tuning.decode_persistent.defines.")   # each knob in its range
# The pointer table's order, layer rows, launch flags and error codes: the contract module
# (gpu.decode_contract), which kernels/decode_contract.cuh is generated from.
TAB_GLOBALS, TAB_LAYER = decode_contract.TAB_GLOBALS, decode_contract.TAB_LAYER
LAYER_BASE, LAYER_STRIDE = decode_contract.LAYER_BASE, decode_contract.LAYER_STRIDE
MATRICES = ("qkv", "o_proj", "gate_up", "down")       # TAB_LAYER's first four, in order
# The file's projections each engine matrix stacks, in row order (gpu.engine.weight_sources).
STACKED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
           "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
F_BEGIN, F_HEAD = decode_contract.FLAGS["BEGIN"], decode_contract.FLAGS["HEAD"]
ERRORS = decode_contract.ERRORS       # scalars[error] code -> message (the kernel's own: 3, 4, 5)


def persistent_plan(dims: ModelDims, sms: int | None = None, hw=None, defines: dict | None = None) -> dict[str, int]:
    """How the persistent decode step (kernels/decode_persistent.cu) cuts each layer GEMV over
    a grid of `sms` CTAs (default: hardware().sms, the SMs this machine plans for): NQ_PD_<M>_TG tile sets x
    NQ_PD_<M>_KS K slices, one unit per CTA. A unit's time is modelled as its largest share of
    1056-byte layout-3 blocks at one SM's share of the read ceiling, plus one global round trip
    when KS > 1 (the last unit of a tile set adds the slices); the plan takes the cheapest
    split whose warps each touch at most NQ_PD_KMAX tiles and whose units have at most one row
    per thread (the epilogue); defines: knobs a build overrides (its NQ_PD_WARPS, NQ_PD_KMAX).
    With NQ_PD_O_MERGE ([pd-o-merge]: o_proj's units merge the attention's splits of the KV heads
    their K slice reads) o_proj's K is cut once per KV head (at most its groups), so that a unit
    loads the partials of about one KV head, not of all.
    Pure arithmetic: the CPU build and
    the engine (with the device's SM count) call the same function."""
    from nanoqwen_lib.gpu.hardware import hardware
    cfg, hw = load().engine.persistent, hw or hardware()
    sms = sms or hw.sms
    tun = dict(load().tuning["decode_persistent"].defines, **(defines or {}))
    warps, kmax = tun["NQ_PD_WARPS"], tun["NQ_PD_KMAX"]
    group = load().format.group_size
    block = 16 * group // 2 + 32                        # format/stream_layout.BLOCK_BYTES
    out = {}
    for name, (n, k) in (("QKV", (dims.qkv_dim, dims.hidden)), ("O", (dims.hidden, dims.q_dim)),
                         ("GU", (2 * dims.intermediate, dims.hidden)), ("DOWN", (dims.hidden, dims.intermediate))):
        t, g = -(-n // 16), k // group
        best = None
        o_merge = name == "O" and tun.get("NQ_PD_O_MERGE", 0)
        for ks in [min(dims.num_kv_heads, g)] if o_merge else range(1, g + 1):
            tg = min(t, sms // ks)
            if tg < 1:
                break
            ng, nt = -(-g // ks), -(-t // tg)
            if 16 * nt > 32 * warps:                    # the epilogue: one thread per row of the unit
                continue
            nb = nt * ng
            per_warp = -(-nb // warps)
            if (ng - 1 + per_warp - 1) // ng + 1 > kmax:
                continue
            cost = nb * block / hw.sm_bytes_per_ns + (cfg["reduce_ns"] if ks > 1 else 0.0)
            if best is None or cost < best[0]:
                best = (cost, tg, ks)
        if best is None:
            raise LimitError("kernels/decode_persistent.cu", f"{name} GEMV ({n} x {k}) over {sms} CTAs",
                             f"a split whose warps each touch <= NQ_PD_KMAX = {kmax} tiles",
                             "none (too few SMs: use decode=graph)")
        out[f"NQ_PD_{name}_TG"], out[f"NQ_PD_{name}_KS"] = best[1], best[2]
    return out


def check_plan(dims: ModelDims, plan: dict, grid: int) -> None:
    """Every unit of every GEMV must have a CTA: NQ_PD_<M>_TG tile sets x NQ_PD_<M>_KS K
    slices at most the grid (a split beyond it would leave work undone), and KS at most the
    matrix's groups. An override (a lab variant's split) is checked like the plan."""
    group = load().format.group_size
    for m, k in (("QKV", dims.hidden), ("O", dims.q_dim), ("GU", dims.hidden), ("DOWN", dims.intermediate)):
        tg, ks = plan[f"NQ_PD_{m}_TG"], plan[f"NQ_PD_{m}_KS"]
        if tg < 1 or ks < 1 or tg * ks > grid:
            raise LimitError(f"kernels/{KERNEL}.cu", f"NQ_PD_{m}_TG x NQ_PD_{m}_KS",
                             f"units (tile sets x K slices) between 1 and the grid, {grid} CTAs",
                             f"{tg} x {ks} = {tg * ks}")
        if ks > k // group:
            raise LimitError(f"kernels/{KERNEL}.cu", f"NQ_PD_{m}_KS", f"<= {k // group} (the groups of K = {k})", ks)


def check_smem(dims: ModelDims, plan: dict, defines: dict | None = None, static: int = 0) -> int:
    """The build's shared memory (smem_bytes, plus the kernel's `static` bytes once it is
    built) within what one CTA may opt into on this machine (hardware().smem_optin: 227 KiB
    on sm_90), or a LimitError naming the knobs that size it, before the driver refuses the
    attribute with an unnamed invalid argument. Returns the dynamic bytes."""
    from nanoqwen_lib.gpu.hardware import hardware
    dyn = smem_bytes(dims, plan, defines)
    limit = hardware().smem_optin
    if dyn + static > limit:
        t = dict(TUNING, **(defines or {}))
        knobs = ", ".join(f"{k}={t[k]}" for k in ("NQ_PD_WARPS", "NQ_PD_LOADER", "NQ_PD_LOADER_PAGE",
                                                  "NQ_PD_HEAD_BLOCKS", "NQ_PD_SMEM_RING", "NQ_PD_SMEM_PAD_KB") if k in t)
        raise LimitError(f"kernels/{KERNEL}.cu", f"shared memory per CTA ({knobs})",
                         f"<= {limit} bytes (what a CTA may opt into)", f"{dyn} dynamic + {static} static")
    return dyn


def block_threads(defines: dict | None = None) -> int:
    """The kernel's block (its kBlockThreads): 32 x the consumer warps, and one more warp, the
    loader, with NQ_PD_LOADER ([pd-loader]) unless the consumers load themselves
    (NQ_PD_LOADER_SELF, [pd-loader-self])."""
    t = dict(TUNING, **(defines or {}))
    return 32 * (t["NQ_PD_WARPS"] + (t["NQ_PD_LOADER"] > 0 and not t["NQ_PD_LOADER_SELF"]))


def instructions(num_layers: int) -> int:
    """Instructions of one full step: begin, 5 per layer, head, end (the timeline's rows)."""
    return 5 * num_layers + 3


def smem_bytes(dims: ModelDims, plan: dict, defines: dict | None = None) -> int:
    """Dynamic shared memory of the kernel (its kSmemBytes): the largest staging of any
    instruction (kStageBytes, rounded to 16 bytes; with NQ_PD_HEAD_BLOCKS, at least the
    warps' head blocks past the largest GEMV staging), then, with NQ_PD_SMEM_RING, every warp's
    ring of NQ_PD_RING layout-3 blocks, then with NQ_PD_LOADER ([pd-loader]) every consumer
    warp's ring of NQ_PD_LOADER pages of NQ_PD_LOADER_PAGE blocks the loader warp fills, then NQ_PD_SMEM_PAD_KB reserved
    (a lab variant). The kernel refuses a launch with less (scalars[error] = 4). The kernel
    exports its own figure (nq_pd_smem_bytes); tests/test_persistent_plan.py holds this one to
    it, build by build, on the CPU."""
    t = dict(TUNING, **(defines or {}))
    gqa = dims.num_heads // dims.num_kv_heads
    group, xgroup = load().format.group_size, 2 * load().geometry["gemv_int4"]["NQ_GEMV_X_GROUP_HALVES"]
    x = max(-(-(k // group) // plan[f"NQ_PD_{m}_KS"]) * xgroup
            for m, k in (("QKV", dims.hidden), ("O", dims.q_dim), ("GU", dims.hidden), ("DOWN", dims.intermediate)))
    # the warps' partials, or (the last split merging all, NQ_PD_ATTN_MERGE=0) the splits'
    parts = t["NQ_PD_WARPS"] if t["NQ_PD_ATTN_MERGE"] else max(t["NQ_PD_WARPS"], t["NQ_PD_ATTN_SPLITS"])
    attn = parts * gqa * (dims.head_dim + 2) * 4 + (gqa + 2) * dims.head_dim * 2   # + q, k, v fp16
    stage = -(-max(x, attn, dims.hidden * 4) // 16) * 16
    # [pd-head]: each warp's NQ_PD_HEAD_BLOCKS blocks past the largest GEMV staging
    head = -(-x // 128) * 128 + t["NQ_PD_WARPS"] * t["NQ_PD_HEAD_BLOCKS"] * BLOCK_BYTES if t["NQ_PD_HEAD_BLOCKS"] else 0
    ring = t["NQ_PD_RING"] * t["NQ_PD_WARPS"] * BLOCK_BYTES if t["NQ_PD_SMEM_RING"] else 0
    loader = t["NQ_PD_LOADER"] * t["NQ_PD_LOADER_PAGE"] * t["NQ_PD_WARPS"] * BLOCK_BYTES
    return max(stage, head) + ring + loader + t["NQ_PD_SMEM_PAD_KB"] * 1024


def layer_stream_slots(dims: ModelDims) -> dict[str, int]:
    """matrix -> bytes of its layout-3 copy (arena slot `w.<l>.<matrix>.s3`)."""
    return {m: stream_bytes(n, k) for m, (n, k) in decode_gemv_shapes(dims).items()}


def add_slots(plan, dims: ModelDims) -> None:
    """The arena slots of the layout-3 copies, every layer."""
    for l in range(dims.num_layers):
        for m, nbytes in layer_stream_slots(dims).items():
            plan.add(f"w.{l}.{m}.s3", np.uint8, (nbytes,))


class PersistentStep:
    """The kernel, its buffers and its pointer table for one engine (GpuBackend): the engine's
    decode step when decode="persistent" (gpu.decode_step's protocol: launches, layer_launches,
    reset)."""

    name = "persistent"

    def __init__(self, eng, timeline: bool = False, defines: dict | None = None, grid: int | None = None,
                 residency: bool = True):
        """grid: CTAs of a launch, default one per SM this machine plans for (hardware().sms).
        The plan and every per-CTA buffer are sized for it, and the kernel refuses any other
        grid (error 4). A grid the occupancy API says cannot be resident at once is refused
        here; residency=False skips that check (the timeout test's way to starve the waits)."""
        import cupy as cp
        from nanoqwen_lib.gpu.cuda_build import load_module
        self.cp, self.eng = cp, eng
        dims = self.dims = eng.dims
        from nanoqwen_lib.gpu.hardware import hardware
        dev = cp.cuda.Device()
        self.grid = grid or hardware().sms             # one CTA per SM this machine plans for
        if self.grid < dims.num_kv_heads:                # attention: a CTA per KV head at least
            raise LimitError(f"kernels/{KERNEL}.cu", "grid (CTAs of the persistent step)",
                             f">= num_kv_heads = {dims.num_kv_heads}", self.grid)
        self.extra = dict(defines or {})               # the knobs this build overrides (a diagnostic build keeps them)
        decode_knobs.check(self.extra, None, "PersistentStep(defines=): ")   # each in its range, before NVRTC
        # ... a split among them (NQ_PD_<M>_{TG,KS}, a lab variant) replaces the plan's, so that
        # the workspaces and the shared memory are sized for the split the kernel runs
        self.plan = persistent_plan(dims, self.grid, defines=self.extra)
        self.plan.update({k: int(v) for k, v in self.extra.items() if k in self.plan})
        check_plan(dims, self.plan, self.grid)
        self.defines = dict(self.plan, NQ_PD_TIMELINE=int(timeline), **self.extra)
        self.timeline_on = timeline
        check_smem(dims, self.plan, self.defines)       # before the build: a ring that cannot fit
        self.kernel = load_module(KERNEL, dims, self.defines).get_function("nq_decode_persistent")
        t = dict(TUNING, **self.defines)
        self.threads = block_threads(self.defines)     # [pd-loader]: with the loader warp, one more
        self.smem = check_smem(dims, self.plan, self.defines, static=self.kernel.shared_size_bytes)
        self.kernel.max_dynamic_shared_size_bytes = self.smem
        if residency:
            self._check_residency(dev)
        a, L = eng.arena, dims.num_layers
        gqa = dims.num_heads // dims.num_kv_heads
        ws_rows = max(self.plan[f"NQ_PD_{m}_KS"] * n
                      for m, n in (("QKV", dims.qkv_dim), ("O", dims.hidden), ("GU", 2 * dims.intermediate),
                                   ("DOWN", dims.hidden)))
        self.buf = {
            "SYNC": cp.zeros(instructions(L), cp.uint32),
            "WS": cp.zeros(ws_rows, cp.float32),
            "WS_DOWN": cp.zeros(self.plan["NQ_PD_DOWN_KS"] * dims.hidden, cp.float32),   # [pd-down-defer]
            "QKV_TAG": cp.zeros(dims.qkv_dim, cp.uint32),   # [pd-qkv-ll]: (layer + 1) << 16 | fp16, zeroed each launch
            "SLICE_CNT": cp.zeros(L * self.plan["NQ_PD_DOWN_KS"], cp.uint32),   # [pd-down-slices]: per layer and K slice
            "TILE_CNT": cp.zeros(max(self.plan[f"NQ_PD_{m}_TG"] for m in ("QKV", "O", "GU", "DOWN")), cp.int32),
            "ATTN_WS": cp.zeros(dims.num_kv_heads * t["NQ_PD_ATTN_SPLITS"] * gqa * (dims.head_dim + 2),
                                cp.float32),
            "ATTN_CNT": cp.zeros(dims.num_kv_heads * L, cp.int32),   # per KV head (and layer: NQ_PD_ATTN_MERGE)
            "ARG_VAL": cp.zeros(self.grid, cp.float32),
            "ARG_IDX": cp.zeros(self.grid, cp.int32),
            "ARG_CNT": cp.zeros(1, cp.uint32),
            "TIMELINE": cp.full((self.grid, instructions(L), 4) if timeline else (1,), -1, cp.int64),
            "PROBE": cp.zeros((self.grid, 16) if t.get("NQ_PD_PROBE") else (1,), cp.int64),   # lab stamps
        }
        g = {"EMBED": a["w.embed"], "NORM": a["w.norm"], "LM_HEAD": eng.lm_head, "LOGITS": a["a.logits"],
             "SCALARS": a["s.scalars"], "BLOCK_TABLE": a["s.block_table"], "FREE_PAGES": a["s.free_pages"],
             "GENERATED": a["s.generated"], "X": a["a.x"], "QKV": a["a.qkv"], "ATTN": a["a.attn"],
             "GATE_UP": a["a.gate_up"], "INV_FREQ": eng.attn.kernels(dims).inv_freq, **self.buf}
        tab = np.zeros(LAYER_BASE + LAYER_STRIDE * L, np.int64)
        for i, name in enumerate(TAB_GLOBALS):
            tab[i] = eng.pages if name == "MAX_PAGES" else self.grid if name == "GRID" else g[name].data.ptr
        for l in range(L):
            w = f"w.{l}."
            row = {"QKV": a[w + "qkv.s3"], "O": a[w + "o_proj.s3"], "GATE_UP": a[w + "gate_up.s3"],
                   "DOWN": a[w + "down.s3"], "LN1": a[w + "ln1"], "LN2": a[w + "ln2"],
                   "QKV_BIAS": a[w + "qkv.bias"], "K": eng.kv[l, 0], "V": eng.kv[l, 1]}
            for i, name in enumerate(TAB_LAYER):
                tab[LAYER_BASE + LAYER_STRIDE * l + i] = row[name].data.ptr
        self.tab = cp.asarray(tab)
        cp.cuda.Device().synchronize()      # the zeroed buffers (default stream) before any launch on the engine's

    def _check_residency(self, dev) -> None:
        """Every CTA must be resident at once (they wait on each other). The occupancy API
        says how many CTAs of this build (its registers, threads and shared memory) one SM
        holds; the grid must fit that many on every SM of the device, or the launch is
        refused here, before it could wait forever (the kernel's timeout is the last resort:
        MPS or a concurrent kernel can still take SMs away)."""
        from cupy_backends.cuda.api import driver
        regs = self.kernel.num_regs * self.threads
        smem = self.smem + self.kernel.shared_size_bytes
        if regs > dev.attributes["MaxRegistersPerMultiprocessor"]:
            raise LimitError(f"kernels/{KERNEL}.cu", "registers per CTA",
                             f"<= {dev.attributes['MaxRegistersPerMultiprocessor']}", regs)
        if smem > dev.attributes["MaxSharedMemoryPerMultiprocessor"]:
            raise LimitError(f"kernels/{KERNEL}.cu", "shared memory per CTA",
                             f"<= {dev.attributes['MaxSharedMemoryPerMultiprocessor']}", smem)
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(self.kernel.kernel.ptr, self.threads, self.smem)
        resident = per_sm * dev.attributes["MultiProcessorCount"]
        if self.grid > resident:
            raise LimitError(f"kernels/{KERNEL}.cu", "grid (CTAs that must be resident at once)",
                             f"<= {resident} ({per_sm} a SM by the occupancy API x "
                             f"{dev.attributes['MultiProcessorCount']} SMs)", self.grid)

    @staticmethod
    def upload_streams(arena, dims: ModelDims, nq_file=None) -> None:
        """Layout-3 copies of the four projections of every layer. A file stored in layout 3
        (`nanoqwen pack --layout stream`) gives its bytes as they are: the engine's stacked
        matrices are its projections' streams end to end (every N is a multiple of 16, so no
        padding rows sit between them). Otherwise they are repacked on the GPU from the
        layout-1 words and scales already in the arena (format.stream_layout.to_stream, the
        same code as the NumPy repacker)."""
        from nanoqwen_lib.format.stream_layout import to_stream
        stored = nq_file.stream_tensors() if nq_file is not None else None
        for l in range(dims.num_layers):
            for m in MATRICES:
                w = f"w.{l}.{m}"
                if stored is None:
                    arena[w + ".s3"][...] = to_stream(arena[w + ".qweight"], arena[w + ".scales"])
                    continue
                off = 0
                for part in STACKED[m]:
                    b = stored[f"model.layers.{l}.{part}.stream"]
                    arena.upload(w + ".s3", b, off)
                    off += b.size
                assert off == arena[w + ".s3"].size, (w, off)
        import cupy as cp
        cp.cuda.Device().synchronize()      # the repack ran on the default stream; the engine's is non-blocking

    def reset(self) -> None:
        """Counters to zero (the kernel leaves them so; a timed-out launch may not)."""
        for name in ("SYNC", "TILE_CNT", "ATTN_CNT", "ARG_CNT", "QKV_TAG", "SLICE_CNT"):
            self.buf[name].fill(0)

    def launches(self, new_page: bool) -> list:
        """The whole token: one launch, one region (gpu.decode_step)."""
        return [(PERSISTENT_STEP, lambda: self.launch(new_page))]

    def layer_launches(self, l: int) -> list:
        """Layer l alone on a.x (flags 0: no bookkeeping, no head), one launch (gpu.decode_step)."""
        return [(PERSISTENT_STEP, lambda: self.launch(False, l, l + 1, flags=0))]

    def launch(self, new_page: bool, first_layer: int = 0, last_layer: int | None = None,
               flags: int = F_BEGIN | F_HEAD) -> None:
        """Enqueue the step (or layers [first, last) alone, flags 0) on the current stream."""
        d = self.dims
        last = d.num_layers if last_layer is None else last_layer
        self.kernel((self.grid,), (self.threads,),
                    (self.tab, np.int32(first_layer), np.int32(last), np.int32(d.num_layers), np.int32(flags),
                     np.int32(new_page), np.float32(d.rms_eps)), shared_mem=self.smem)

    def timeline(self) -> np.ndarray:
        """The diagnostic build's records of the last launch, int64 [grid, instructions, 4]
        (measure.timeline reads them); then cleared to -1 for the next."""
        if not self.timeline_on:
            raise LimitError(f"kernels/{KERNEL}.cu", "NQ_PD_TIMELINE", "a timeline build (timeline=True)", 0)
        with self.eng.stream:
            out = self.buf["TIMELINE"].get(stream=self.eng.stream)
            self.buf["TIMELINE"].fill(-1)
        self.eng.stream.synchronize()
        return out
