"""The GPU engine: one arena, the paged KV cache, and the decode step, eagerly.

    embed -> L x [rmsnorm, qkv GEMV(+bias), RoPE + append K/V, paged attention,
                  o_proj GEMV(+residual), rmsnorm, gate/up GEMV, SwiGLU + down GEMV(+residual)]
          -> rmsnorm -> lm_head GEMV -> argmax

Everything the step needs lives in the arena, including the scalars (token, position,
context length, slot) and the block table, so the same launches are captured once in a CUDA
graph per variant (chapter 9) and replayed every token.

Prefill (chapter 8) runs the prompt through the same layers as a batch, in chunks of
`engine.prefill_chunk_tokens`: INT4 tensor-core GEMMs (ops_prefill), RoPE writing K and V
straight into the pages, causal attention reading them back from the pages; then the last
row goes through the final norm and lm_head + argmax, as a decode step would. The simple
correct prefill, the prompt through the decode step token by token, stays available
(`prefill="token-by-token"`) as the baseline chapter 8 measures against.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import ModelDims, cuda_defines, load
from nanoqwen_lib.errors import LimitError
from nanoqwen_lib.gpu import decode_contract
from nanoqwen_lib.gpu.arena import ArenaPlan, DeviceArena
from nanoqwen_lib.gpu.decode_step import DecodeStep, KernelPerOpStep
from nanoqwen_lib.gpu.layer import (ATTENTION, DOWN, EMBED, GATE_UP, LM_HEAD, NORM_IN, NORM_MLP,
                                    NORM_OUT, O_PROJ, QKV, ROPE)
from nanoqwen_lib.gpu.projection import projections_for
from nanoqwen_lib.model.generate import check_request

KV = load().kv_cache
PREFILL_CHUNK = load().engine.prefill_chunk_tokens
PREFILL_MODES = ("tensor-core", "token-by-token")
PREFILL_GEMMS = ("wgmma", "mma", "rs")   # rs: INT4 only, the RS form (kernels/prefill_rs.cu) (gpu.projection.Int4RsProjections)
DECODE_MODES = ("persistent", "graph")
# Device-resident scalars of the decode step, one int32 per 128-byte line (kernels/engine_step.cu;
# the slots are gpu.decode_contract's, the kernels' S_* in kernels/decode_contract.cuh).
SCALARS = decode_contract.SCALARS
SCALAR_STRIDE = cuda_defines()["NQ_SCALAR_STRIDE"]


def plan_arena(dims: ModelDims, max_tokens: int, encoding: str = "int4", decode: str = "graph",
               prefill_gemm: str | None = None) -> ArenaPlan:
    """Every device buffer of the engine, by name. Weights are re-arranged for the kernels:
    q/k/v rows are stacked into one qkv matrix and gate/up into one gate_up matrix
    (layout.decode_gemv_shapes); the file's weight encoding lays out the four matrices and
    adds the buffers its kernels need (gpu.projection). The persistent decode step adds a
    layout-3 copy of each INT4 projection (gpu.persistent; the prefill reads layout 1), the RS
    prefill (prefill_gemm="rs") a copy in the RS order (gpu.projection.Int4RsProjections)."""
    projections = projections_for(encoding, prefill_gemm or load().engine.prefill_gemm[encoding])
    p = ArenaPlan()
    h, i = dims.hidden, dims.intermediate
    p.add("w.embed", np.float16, (dims.vocab, h))
    for l in range(dims.num_layers):
        w = f"w.{l}."
        p.add(w + "ln1", np.float16, (h,))
        p.add(w + "ln2", np.float16, (h,))
        p.add(w + "qkv.bias", np.float16, (dims.qkv_dim,))
        projections.add_slots(p, w, dims)
    p.add("w.norm", np.float16, (h,))
    if not dims.tie_embeddings:
        p.add("w.lm_head", np.float16, (dims.vocab, h))
    pages = -(-max_tokens // KV.page_tokens)
    p.add("kv", np.float16, (dims.num_layers, 2, pages, dims.num_kv_heads, KV.page_tokens, dims.head_dim))
    p.add("a.x", np.float16, (h,))
    p.add("a.y", np.float16, (h,))
    p.add("a.qkv", np.float16, (dims.qkv_dim,))
    p.add("a.q", np.float16, (dims.q_dim,))
    p.add("a.attn", np.float16, (dims.q_dim,))
    p.add("a.gate_up", np.float16, (2 * i,))
    p.add("a.logits", np.float32, (dims.vocab,))
    c = min(PREFILL_CHUNK, max_tokens)       # prefill activations: one chunk of prompt rows
    p.add("p.x", np.float16, (c, h))
    p.add("p.y", np.float16, (c, h))
    p.add("p.qkv", np.float16, (c, dims.qkv_dim))
    p.add("p.q", np.float16, (c, dims.num_heads, dims.head_dim))
    p.add("p.attn", np.float16, (c, dims.q_dim))
    p.add("p.gate_up", np.float16, (c, 2 * i))
    p.add("p.act", np.float16, (c, i))
    p.add("s.scalars", np.int32, (len(SCALARS) * SCALAR_STRIDE,))
    p.add("s.block_table", np.int32, (pages,))         # logical page -> physical page
    p.add("s.free_pages", np.int32, (pages,))          # a stack; the step pops from the top
    p.add("s.generated", np.int32, (pages * KV.page_tokens,))  # argmax after each position
    p.add("s.prompt", np.int32, (pages * KV.page_tokens,))     # the prompt's ids (prefill)
    projections.add_buffers(p, dims, c)
    if decode == "persistent":
        from nanoqwen_lib.gpu import persistent
        persistent.add_slots(p, dims)
    return p


def persistent_or_graph(dims: ModelDims, asked: bool) -> str:
    """The decode step for this machine when the persistent one is wanted: "persistent" if its
    plan fits the SMs this machine plans for (gpu.hardware), else, unless it was asked for by
    name (then the plan's error is raised), "graph", said in one line on stderr."""
    from nanoqwen_lib.gpu.hardware import hardware
    from nanoqwen_lib.gpu.persistent import persistent_plan
    try:
        persistent_plan(dims)
        return "persistent"
    except LimitError as e:
        if asked:
            raise
        import sys
        print(f"nanoqwen: the persistent decode step does not fit {hardware().sms} SMs ({e}); "
              f"decoding with the kernel-per-op step (decode=graph)", file=sys.stderr)
        return "graph"


def weight_sources(dims: ModelDims) -> list[tuple[str, str, int]]:
    """(file tensor, arena slot, first row) for every weight upload."""
    out = [("model.embed_tokens.weight", "w.embed", 0), ("model.norm.weight", "w.norm", 0)]
    if not dims.tie_embeddings:
        out.append(("lm_head.weight", "w.lm_head", 0))
    for l in range(dims.num_layers):
        f, w = f"model.layers.{l}.", f"w.{l}."
        out += [(f + "input_layernorm.weight", w + "ln1", 0),
                (f + "post_attention_layernorm.weight", w + "ln2", 0)]
        rows = {"q": 0, "k": dims.q_dim, "v": dims.q_dim + dims.kv_dim}
        for x, r in rows.items():
            for part in ("qweight", "scales"):
                out.append((f + f"self_attn.{x}_proj.{part}", w + f"qkv.{part}", r))
            out.append((f + f"self_attn.{x}_proj.bias", w + "qkv.bias", r))
        for part in ("qweight", "scales"):
            out += [(f + f"self_attn.o_proj.{part}", w + f"o_proj.{part}", 0),
                    (f + f"mlp.gate_proj.{part}", w + f"gate_up.{part}", 0),
                    (f + f"mlp.up_proj.{part}", w + f"gate_up.{part}", dims.intermediate),
                    (f + f"mlp.down_proj.{part}", w + f"down.{part}", 0)]
    return out


class PrefillGraphs:
    """The prefill's CUDA graphs, one per chunk shape (start, tokens), at most `kept` of them
    (least recently used out; 0: none, every chunk eager). A shape is captured the second time
    it is seen (seen_again), after that run's eager launches, so a one-off prompt never pays a
    capture and a repeated one replays from its third time on."""

    def __init__(self, kept: int):
        if not isinstance(kept, int) or kept < 0:
            raise LimitError("<engine>", "prefill_graphs", "an int >= 0 (chunk shapes kept as graphs)", repr(kept))
        self.kept = kept
        self.replays = 0                 # chunks replayed from a graph so far (bench records it)
        self._graphs: dict = {}          # key -> graph, oldest use first
        self._seen: dict = {}            # keys seen once (bounded like the graphs)

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key):
        graph = self._graphs.pop(key, None)
        if graph is not None:
            self._graphs[key] = graph    # now the most recent
            self.replays += 1
        return graph

    def seen_again(self, key) -> bool:
        """True when `key` was seen before (capture it now); records it otherwise."""
        if not self.kept:
            return False
        if self._seen.pop(key, None) is not None:
            return True
        self._seen[key] = True
        while len(self._seen) > 4 * self.kept:
            self._seen.pop(next(iter(self._seen)))
        return False

    def keep(self, key, graph) -> None:
        self._graphs[key] = graph
        while len(self._graphs) > self.kept:
            self._graphs.pop(next(iter(self._graphs)))


class GpuBackend:
    """Greedy decode on the GPU; the backend protocol of generate.py. The file's weight
    encoding (INT4 or FP8) picks the projections' kernels (gpu.projection); the rest of the
    engine is the same for both.

    All work is enqueued on one stream. The step's bookkeeping (slot, context length, page
    allocation on a page boundary, position) runs on the device, so a decode step needs
    nothing from the host: with `graphs=True` both variants of the step are captured once,
    at load, and replayed every token.

    decode picks the step: "persistent" (one kernel, gpu.persistent; INT4 files) or "graph"
    (a kernel per op, the regions of gpu.layer); default per encoding, nanoqwen.yaml
    engine.decode. Either is a gpu.decode_step.DecodeStep (self.step): the engine asks it for
    the token's launches, a layer's, and a reset, and never which one it is.
    timeline=True builds the persistent kernel's diagnostic timeline.
    """

    name = "gpu"
    _step = None         # the decode step (the step property)
    graphs = None

    def __init__(self, nq_file, max_tokens: int | None = None, graphs: bool = True,
                 prefill: str = "tensor-core", prefill_gemm: str | None = None, decode: str | None = None,
                 timeline: bool = False, prefill_graphs: int | None = None):
        if prefill not in PREFILL_MODES:               # refused before anything touches the GPU
            raise LimitError("<engine>", "prefill", f"one of {PREFILL_MODES}", repr(prefill))
        self.prefill_graphs = PrefillGraphs(load().engine.prefill_graphs if prefill_graphs is None else prefill_graphs)
        asked = decode
        decode = decode or load().engine.decode[nq_file.encoding]
        if decode not in DECODE_MODES:
            raise LimitError("<engine>", "decode", f"one of {DECODE_MODES}", repr(decode))
        if decode == "persistent" and nq_file.encoding != "int4":
            raise LimitError(str(nq_file.path), "decode", "graph for an FP8 file (the persistent step reads INT4)",
                             repr(decode))
        from nanoqwen_lib.gpu.hardware import require_hopper
        require_hopper("GpuBackend")                   # one line on any other GPU, before a kernel is built
        if decode == "persistent":
            decode = persistent_or_graph(nq_file.dims, asked is not None)
        if prefill_gemm is not None and prefill_gemm not in PREFILL_GEMMS:
            raise LimitError("<engine>", "prefill_gemm", f"one of {PREFILL_GEMMS}", repr(prefill_gemm))
        if prefill_gemm == "rs" and nq_file.encoding != "int4":
            raise LimitError(str(nq_file.path), "prefill_gemm", "wgmma or mma for an FP8 file (rs reads INT4)",
                             repr(prefill_gemm))
        import cupy as cp
        from nanoqwen_lib.gpu import ops_attention, ops_decode, ops_prefill
        from nanoqwen_lib.gpu.cuda_build import load_module
        self.cp, self.ops, self.attn, self.pf = cp, ops_decode, ops_attention, ops_prefill
        dims = self.dims = nq_file.dims
        self.encoding = nq_file.encoding
        self.max_tokens = min(max_tokens or dims.max_position, dims.max_position)
        gemm = prefill_gemm or load().engine.prefill_gemm[self.encoding]
        self.arena = a = DeviceArena(plan_arena(dims, self.max_tokens, self.encoding, decode, gemm),
                                     source=nq_file.path)
        self.proj = projections_for(self.encoding, gemm)(a, gemm)
        tensors = nq_file.model_tensors()      # validated before this point (NanoqwenFile.open)
        for src, dst, row in weight_sources(dims):
            a.upload(dst, tensors[src], row)
        self.proj.after_upload(dims)
        self.lm_head = a["w.embed"] if dims.tie_embeddings else a["w.lm_head"]
        self.scalar = {n: a["s.scalars"][k * SCALAR_STRIDE:k * SCALAR_STRIDE + 1] for k, n in enumerate(SCALARS)}
        self.staging = cp.cuda.alloc_pinned_memory(a["s.scalars"].nbytes)   # host -> scalars
        self.host_scalars = np.frombuffer(self.staging, np.int32, a["s.scalars"].size)
        self.workspace = ops_attention.AttentionWorkspace(dims, self.max_tokens)
        self.kv = a["kv"]
        self.pages = a["s.block_table"].size
        self.chunk = a["p.x"].shape[0]
        # One pinned slot per position for tokens the host feeds (the prompt): an async copy
        # reads its source when it runs, so a slot is never rewritten while a copy may be pending.
        self.token_staging = cp.cuda.alloc_pinned_memory(4 * self.pages * KV.page_tokens)
        self.host_tokens = np.frombuffer(self.token_staging, np.int32, self.pages * KV.page_tokens)
        step = load_module("engine_step", dims)
        self.k_begin, self.k_end = step.get_function("nq_step_begin"), step.get_function("nq_step_end")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.prefill_mode = prefill
        self.use_graphs, self.graphs = graphs, None
        if decode == "persistent":
            from nanoqwen_lib.gpu.persistent import PersistentStep
            PersistentStep.upload_streams(a, dims, nq_file)
            self.step = PersistentStep(self, timeline=timeline)
        else:
            self.step = KernelPerOpStep(self)
        self.position = 0
        if graphs:
            self.capture_graphs()

    @property
    def step(self) -> DecodeStep:
        """The decode step (gpu.decode_step): KernelPerOpStep or gpu.persistent.PersistentStep."""
        return self._step

    @step.setter
    def step(self, step: DecodeStep) -> None:
        """Replace the decode step (another build or grid of the persistent one: the bench, the
        timeline, the tests). The launch lists and the captured graphs hold the old step's
        kernels and buffers, which go with it, so they are built and captured again for the new
        one (capture only: no step runs, the sequence stays where it is)."""
        if not isinstance(step, DecodeStep):
            raise TypeError(f"GpuBackend.step: a gpu.decode_step.DecodeStep, not {type(step).__name__}")
        self._step = step
        self._steps = {}                 # new_page -> the step's launch list (enqueue_step)
        if self.graphs is not None:
            self._capture()

    @property
    def decode_mode(self) -> str:
        """The step's decode mode, "persistent" or "graph" (nanoqwen.yaml engine.decode)."""
        return self._step.name

    @property
    def pd(self):
        """The persistent step when it is the engine's step, else None (the bench, the
        timeline and the persistent tests read its plan, buffers and build through it)."""
        return self._step if self._step is not None and self._step.name == "persistent" else None

    @pd.setter
    def pd(self, step) -> None:
        """Another build of the persistent step as the engine's step (the step setter)."""
        self.step = step

    # ------------------------------------------------------------------ host -> device
    def _upload_scalars(self) -> None:
        """The one host -> device copy of the scalars: pinned staging, on the engine's stream
        (the safe pattern: ordered with the kernels, never a pageable or default-stream copy)."""
        dst = self.arena["s.scalars"]
        self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, self.staging.ptr, dst.nbytes,
                                         self.cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def reset(self, physical_pages=None, prompt_tokens: int = 0) -> None:
        """Start a sequence. The free list is popped from the top, so logical page i gets
        physical page physical_pages[i] (default in order; tests pass a permutation).
        With prompt_tokens > 0 (the batched prefill) the prompt's pages are taken here, as
        the device would have popped them, and the step state is the prompt's last position."""
        pages = np.arange(self.pages) if physical_pages is None else np.asarray(physical_pages)
        assert sorted(pages.tolist()) == list(range(self.pages)), "a permutation of the pool's pages"
        taken = -(-prompt_tokens // KV.page_tokens)
        table = np.full(self.pages, -1, np.int32)                # unallocated: never a valid page
        table[:taken] = pages[:taken]
        self.stream.synchronize()      # nothing of a previous sequence still reads the staging
        with self.stream:
            self.arena["s.free_pages"].set(pages[::-1].astype(np.int32), stream=self.stream)
            self.arena["s.block_table"].set(table, stream=self.stream)
            self.arena["s.generated"].fill(-1)
        self.host_scalars[:] = 0
        self.host_scalars[SCALARS.index("free_top") * SCALAR_STRIDE] = self.pages - taken
        self.host_scalars[SCALARS.index("position") * SCALAR_STRIDE] = max(prompt_tokens - 1, 0)
        self._upload_scalars()
        with self.stream:
            self.step.reset()
        self.position = 0

    # ------------------------------------------------------------------ one step
    def step_launches(self, new_page: bool) -> list[tuple[str, object]]:
        """The decode step as (region, launch) pairs in order: the one description that the
        eager step, the graph capture and the ITL breakdown (nanoqwen_lib.measure.breakdown) share
        (the step's launches: the persistent step's is one launch, one region)."""
        return self.step.launches(new_page)

    def enqueue_step(self, new_page: bool) -> None:
        """The whole decode step for the token and position in the device scalars. The
        launch list of each variant is built once (its launches read everything per token
        from device memory), not per step: ~70 us of host time saved per eager step."""
        if new_page not in self._steps:
            self._steps[new_page] = self.step_launches(new_page)
        for _, launch in self._steps[new_page]:
            launch()

    def write_token(self, token: int) -> None:
        """Feed `token` as the input of the step at self.position (host -> device, ordered)."""
        slot = self.host_tokens[self.position:self.position + 1]
        slot[0] = token
        self.cp.cuda.runtime.memcpyAsync(self.scalar["token"].data.ptr, slot.ctypes.data, 4,
                                         self.cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def begin_step(self, new_page: bool) -> None:
        a = self.arena
        self.k_begin((1,), (32,), (a["s.scalars"], a["s.block_table"], a["s.free_pages"],
                                   np.int32(new_page), np.int32(self.pages)))

    def end_step(self) -> None:
        self.k_end((1,), (32,), (self.arena["s.scalars"], self.arena["s.generated"]))

    def embed_step(self) -> None:
        self.ops.embed(self.scalar["token"], self.arena["w.embed"], self.arena["a.x"])

    # The kernel-per-op step's pieces (KernelPerOpStep orders them; the prefill's last row goes
    # through the same head; the per-layer tests run the bookkeeping and embedding before a layer).
    def layer_launches(self, l: int) -> list[tuple[str, object]]:
        """One decoder layer on a.x (in place) as a kernel per op, as (region, launch) in
        gpu.layer.LAYER's order; this position's K/V are appended to the cache."""
        a, d, ops, at, p = self.arena, self.dims, self.ops, self.attn, self.proj
        x, y, w = a["a.x"], a["a.y"], f"w.{l}."
        return [
            (NORM_IN.name, lambda: ops.rmsnorm(x, a[w + "ln1"], y, d.rms_eps)),
            (QKV.name, p.decode(w + "qkv", y, a["a.qkv"], bias=a[w + "qkv.bias"])),
            (ROPE.name, lambda: at.rope_append_kv(a["a.qkv"], self.scalar["position"], self.scalar["slot"],
                                                  self.kv[l, 0], self.kv[l, 1], a["a.q"], d)),
            (ATTENTION.name, lambda: at.paged_attention(a["a.q"], self.kv[l, 0], self.kv[l, 1], a["s.block_table"],
                                                        self.scalar["context_len"], a["a.attn"], self.workspace)),
            (O_PROJ.name, p.decode(w + "o_proj", a["a.attn"], x, residual=x)),
            (NORM_MLP.name, lambda: ops.rmsnorm(x, a[w + "ln2"], y, d.rms_eps)),
            (GATE_UP.name, p.decode(w + "gate_up", y, a["a.gate_up"])),
            (DOWN.name, p.decode_swiglu(w + "down", a["a.gate_up"], x, residual=x)),
        ]

    def layer_step(self, l: int) -> None:
        """One decoder layer of the engine's step on a.x (in place); this position's K/V
        appended to the cache."""
        for _, launch in self.step.layer_launches(l):
            launch()

    def head_launches(self, x=None) -> list[tuple[str, object]]:
        """Final norm of x (default the residual stream a.x; the prefill passes its last
        row), then lm_head with the argmax fused, into the token scalar."""
        a, ops = self.arena, self.ops
        x = a["a.x"] if x is None else x
        return [(NORM_OUT.name, lambda: ops.rmsnorm(x, a["w.norm"], a["a.y"], self.dims.rms_eps)),
                (LM_HEAD.name, lambda: ops.lm_head(a["a.y"], self.lm_head, a["a.logits"],
                                                 token_out=self.scalar["token"]))]

    def head_step(self) -> None:
        for _, launch in self.head_launches():
            launch()

    def capture_graphs(self) -> None:
        """Capture the two variants of the step once: mid-page and page boundary (which
        pops a new page). One eager step first, so that every module is compiled and every
        workspace allocated before capture (nothing may allocate inside it); then the
        sequence is reset. The graphs read token, position and pages from device memory, so
        they are never re-captured."""
        self.reset()
        self.launch_step(0)
        self._capture()
        self.reset()

    def _capture(self) -> None:
        """The two graphs of the step as it is now (every module already built)."""
        graphs = {}
        for new_page in (False, True):
            with self.stream:
                self.stream.begin_capture()
                self.enqueue_step(new_page)
                graphs[new_page] = self.stream.end_capture()
            graphs[new_page].upload(self.stream)
        self.graphs = graphs

    def launch_step(self, token: int | None = None, replay: bool | None = None) -> None:
        """Enqueue one step at self.position. token, when given, is written into the device
        scalar first (the prompt, teacher forcing); replay picks the captured graph over the
        eager launches: by default when graphs exist and no token is given (the argmax of
        the previous step is the input), replay=True also with a token (GpuBackend.force)."""
        if self.position >= self.max_tokens:
            raise LimitError("<generate>", "sequence length", f"<= {self.max_tokens} tokens (KV pool)",
                             self.position + 1)
        new_page = self.position % KV.page_tokens == 0
        graphs = self.graphs is not None and self.use_graphs
        if token is not None:
            self.write_token(token)                   # on self.stream, before the step reads it
        if graphs and (token is None if replay is None else replay):
            self.graphs[new_page].launch(self.stream)
        else:
            with self.stream:
                self.enqueue_step(new_page)
        self.position += 1

    def token_at(self, position: int) -> int:
        """The argmax after `position` (synchronizes: the only per-token sync, for streaming)."""
        self.stream.synchronize()
        err = int(self.scalar["error"].get()[0])
        if err:
            what = decode_contract.ERROR_CODES.get(err, (None, "a code the contract does not know"))[1]
            if err in decode_contract.ERRORS:          # the persistent kernel's own (3, 4, 5)
                raise LimitError("kernels/decode_persistent.cu", "persistent step", "no device error",
                                 f"error {err}: {what}")
            raise LimitError("<generate>", "KV pages", "a free page for every position", f"device error {err}: {what}")
        return int(self.arena["s.generated"][position].get())

    # ------------------------------------------------------------------ prefill
    @property
    def prefill_kind(self) -> str:
        if self.prefill_mode == "tensor-core":
            return f"{self.proj.prefill_gemms}, chunks of {self.chunk} tokens"
        return "token by token through the decode step"

    def prefill_launches(self, start: int, t: int) -> list[tuple[str, object]]:
        """Prompt positions start .. start+t-1 through every layer as one batch (rows of the
        p.* buffers), as (region, launch) in gpu.layer.LAYER's order under the regions'
        prefill names: their K and V go to the pages, and attention reads all earlier ones
        there."""
        a, d, ops, pf, p = self.arena, self.dims, self.ops, self.pf, self.proj
        x, y, qkv, q = a["p.x"][:t], a["p.y"][:t], a["p.qkv"][:t], a["p.q"][:t]
        attn, gate_up, act, bt = a["p.attn"][:t], a["p.gate_up"][:t], a["p.act"][:t], a["s.block_table"]
        out = [(EMBED.prefill, lambda: ops.embed(a["s.prompt"][start:start + t], a["w.embed"], x))]
        for l in range(d.num_layers):
            w, k_pool, v_pool = f"w.{l}.", self.kv[l, 0], self.kv[l, 1]
            out += [
                (NORM_IN.prefill, lambda w=w: ops.rmsnorm(x, a[w + "ln1"], y, d.rms_eps)),
                (QKV.prefill, p.prefill(w + "qkv", y, qkv, bias=a[w + "qkv.bias"])),
                (ROPE.prefill, lambda k=k_pool, v=v_pool: pf.prefill_rope_write_kv(qkv, k, v, bt, q, d,
                                                                                   start_pos=start)),
                (ATTENTION.prefill, lambda k=k_pool, v=v_pool: pf.prefill_attention(q, k, v, bt, attn, d,
                                                                                    start_pos=start)),
                (O_PROJ.prefill, p.prefill(w + "o_proj", attn, x, residual=x)),
                (NORM_MLP.prefill, lambda w=w: ops.rmsnorm(x, a[w + "ln2"], y, d.rms_eps)),
                (GATE_UP.prefill, p.prefill_gate_up(w + "gate_up", y, gate_up, act)),
                (DOWN.prefill, p.prefill_swiglu(w + "down", gate_up, act, x, residual=x)),
            ]
        return out

    def prefill_chunk(self, start: int, t: int) -> None:
        """Enqueue one chunk's launches on the stream (inside `with self.stream`): replayed from
        its CUDA graph when self.prefill_graphs holds one for (start, t); else eager, and
        captured after the eager run when this shape was seen before (PrefillGraphs). The
        launches read the prompt, block table and pages from device memory, so one graph
        serves every prompt whose chunk has this shape."""
        key = (start, t)
        graph = self.prefill_graphs.get(key)
        if graph is not None:
            graph.launch(self.stream)
            return
        launches = [fn for _, fn in self.prefill_launches(start, t)]
        for fn in launches:
            fn()
        if self.prefill_graphs.seen_again(key):
            # Every module, tensor map and workspace exists now (the eager runs built them):
            # the capture allocates nothing and records the same launches.
            self.stream.begin_capture()
            for fn in launches:
                fn()
            graph = self.stream.end_capture()
            graph.upload(self.stream)
            self.prefill_graphs.keep(key, graph)

    def prefill_enqueue(self, ids: list[int], physical_pages=None) -> None:
        """Enqueue the prefill of `ids` (no host sync, so TTFT can be timed with events). The
        first generated token ends in the device scalars and s.generated, as after a step."""
        n = len(ids)
        check_request(self.dims, list(ids), 1, self.max_tokens)
        if self.prefill_mode == "token-by-token":
            self.reset(physical_pages)
            for t in ids:
                self.launch_step(int(t))
            return
        self.reset(physical_pages, prompt_tokens=n)     # pages taken, position = n - 1
        self.host_tokens[:n] = ids                      # the stream is idle (reset synchronized)
        prompt = self.arena["s.prompt"]
        self.cp.cuda.runtime.memcpyAsync(prompt.data.ptr, self.host_tokens.ctypes.data, 4 * n,
                                         self.cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        with self.stream:
            for start in range(0, n, self.chunk):
                self.prefill_chunk(start, min(self.chunk, n - start))
            for _, launch in self.head_launches(self.arena["p.x"][(n - 1) % self.chunk]):   # the last row
                launch()
            self.end_step()                             # generated[n - 1] = token; position = n
        self.position = n

    # ------------------------------------------------------------------ the protocol
    def prefill(self, ids: list[int], physical_pages=None) -> int:
        self.prefill_enqueue(ids, physical_pages)
        return self.token_at(self.position - 1)

    def decode(self, token: int) -> int:
        """One step on the token the device already holds (argmax wrote it)."""
        self.launch_step(None if self.graphs is not None and self.use_graphs else int(token))
        return self.token_at(self.position - 1)

    def force(self, token: int) -> int:
        """One step on `token` given by the host, whatever the argmax before it was (teacher
        forcing: validate.teacher_forced): the token goes into the device scalar, on the
        stream, and the step is the graph replay (eager without graphs)."""
        self.launch_step(int(token), replay=True)
        return self.token_at(self.position - 1)

    def logits(self):
        """The last step's logits, float32 [vocab] on the device (after token_at's sync)."""
        self.stream.synchronize()
        return self.arena["a.logits"]

    def cached_kv(self, layer: int, n: int):
        """K, V of positions [0, n) of `layer` gathered from the pages: [n, kv_heads, d] each."""
        self.stream.synchronize()
        pages = self.arena["s.block_table"].get()[: -(-n // KV.page_tokens)]
        out = []
        for which in (0, 1):
            rows = self.kv[layer, which][self.cp.asarray(pages)]     # [pages, kv_heads, 16, d]
            out.append(rows.transpose(0, 2, 1, 3).reshape(-1, self.dims.num_kv_heads, self.dims.head_dim)[:n])
        return out

