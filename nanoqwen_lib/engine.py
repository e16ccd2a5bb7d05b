"""The GPU engine: one arena, the paged KV cache, and the decode step, eagerly.

    embed -> L x [rmsnorm, qkv GEMV(+bias), RoPE + append K/V, paged attention,
                  o_proj GEMV(+residual), rmsnorm, gate/up GEMV, SwiGLU + down GEMV(+residual)]
          -> rmsnorm -> lm_head GEMV -> argmax

Everything the step needs lives in the arena, including the scalars (token, position,
context length, slot) and the block table, so the same launches can later be captured in a
CUDA graph. Prefill here is the simple correct one: the prompt goes through the decode
step token by token (chapter 8 replaces it with a tensor-core prefill).
"""
from __future__ import annotations

import numpy as np

from .arena import ArenaPlan, DeviceArena
from .config import ModelDims, load
from .errors import LimitError
from .generate import check_request

KV = load().kv_cache
SCALARS = ("token", "position", "context_len", "slot")
SCALAR_STRIDE = 32          # int32s between scalars: each one starts on its own 128-byte line


def plan_arena(dims: ModelDims, max_tokens: int) -> ArenaPlan:
    """Every device buffer of the engine, by name. Weights are re-arranged for the kernels:
    q/k/v rows are stacked into one qkv matrix and gate/up into one gate_up matrix."""
    g = load().format.group_size
    p = ArenaPlan()
    h, i = dims.hidden, dims.intermediate
    p.add("w.embed", np.float16, (dims.vocab, h))
    for l in range(dims.num_layers):
        w = f"w.{l}."
        p.add(w + "ln1", np.float16, (h,))
        p.add(w + "qkv.qweight", np.uint32, (dims.qkv_dim, h // 8))
        p.add(w + "qkv.scales", np.float16, (dims.qkv_dim, h // g))
        p.add(w + "qkv.bias", np.float16, (dims.qkv_dim,))
        p.add(w + "o.qweight", np.uint32, (h, dims.q_dim // 8))
        p.add(w + "o.scales", np.float16, (h, dims.q_dim // g))
        p.add(w + "ln2", np.float16, (h,))
        p.add(w + "gate_up.qweight", np.uint32, (2 * i, h // 8))
        p.add(w + "gate_up.scales", np.float16, (2 * i, h // g))
        p.add(w + "down.qweight", np.uint32, (h, i // 8))
        p.add(w + "down.scales", np.float16, (h, i // g))
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
    p.add("s.scalars", np.int32, (len(SCALARS) * SCALAR_STRIDE,))
    p.add("s.block_table", np.int32, (pages,))
    return p


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
            out += [(f + f"self_attn.o_proj.{part}", w + f"o.{part}", 0),
                    (f + f"mlp.gate_proj.{part}", w + f"gate_up.{part}", 0),
                    (f + f"mlp.up_proj.{part}", w + f"gate_up.{part}", dims.intermediate),
                    (f + f"mlp.down_proj.{part}", w + f"down.{part}", 0)]
    return out


class GpuBackend:
    """Greedy decode on the GPU (eager launches). Backend protocol of generate.py."""

    name = "gpu"

    def __init__(self, nq_file, max_tokens: int | None = None):
        import cupy as cp
        from . import ops_attention, ops_gemv
        self.cp, self.gemv, self.attn = cp, ops_gemv, ops_attention
        dims = self.dims = nq_file.dims
        self.max_tokens = min(max_tokens or dims.max_position, dims.max_position)
        self.arena = a = DeviceArena(plan_arena(dims, self.max_tokens), source=nq_file.path)
        tensors = nq_file.model_tensors()      # validated before this point (NanoqwenFile.open)
        for src, dst, row in weight_sources(dims):
            a.upload(dst, tensors[src], row)
        self.lm_head = a["w.embed"] if dims.tie_embeddings else a["w.lm_head"]
        self.scalar = {n: a["s.scalars"][k * SCALAR_STRIDE:k * SCALAR_STRIDE + 1] for k, n in enumerate(SCALARS)}
        self.staging = cp.cuda.alloc_pinned_memory(a["s.scalars"].nbytes)
        self.host_scalars = np.frombuffer(self.staging, np.int32, a["s.scalars"].size)
        self.host_scalars[:] = 0
        self.workspace = ops_attention.AttentionWorkspace(dims, self.max_tokens)
        self.kv = a["kv"]
        self.pages = a["s.block_table"].size
        self.position = 0

    # -- host side of one step: the four scalars and the block table, in one copy each
    def _set_scalars(self, token: int, position: int) -> None:
        page = self.block_table_host[position // KV.page_tokens]
        slot = int(page) * KV.page_tokens + position % KV.page_tokens
        for name, v in zip(SCALARS, (token, position, position + 1, slot)):
            self.host_scalars[SCALARS.index(name) * SCALAR_STRIDE] = v
        self.arena["s.scalars"].set(self.host_scalars)

    def reset(self, physical_pages=None) -> None:
        """Start a new sequence. Logical page i lives in physical page physical_pages[i]
        (default: in order; tests pass a permutation to exercise the block table)."""
        self.position = 0
        pages = np.arange(self.pages) if physical_pages is None else np.asarray(physical_pages)
        assert sorted(pages.tolist()) == list(range(self.pages)), "a permutation of the pool's pages"
        self.block_table_host = pages.astype(np.int32)
        self.arena["s.block_table"].set(self.block_table_host)

    def decode_step(self) -> None:
        """Enqueue the whole model for the token/position in the scalars (no host sync)."""
        self.embed_step()
        for l in range(self.dims.num_layers):
            self.layer_step(l)
        self.head_step()

    def embed_step(self) -> None:
        g, a = self.gemv, self.arena
        g.embed(self.scalar["token"], a["w.embed"], a["a.x"])

    def layer_step(self, l: int) -> None:
        """One decoder layer on a.x (in place), K/V of this position appended to the cache."""
        a, d, g, at = self.arena, self.dims, self.gemv, self.attn
        x, y, w = a["a.x"], a["a.y"], f"w.{l}."
        g.rmsnorm(x, a[w + "ln1"], y, d.rms_eps)
        g.gemv_int4(y, a[w + "qkv.qweight"], a[w + "qkv.scales"], a["a.qkv"], bias=a[w + "qkv.bias"])
        at.rope_append_kv(a["a.qkv"], self.scalar["position"], self.scalar["slot"],
                          self.kv[l, 0], self.kv[l, 1], a["a.q"], d)
        at.paged_attention(a["a.q"], self.kv[l, 0], self.kv[l, 1], a["s.block_table"],
                           self.scalar["context_len"], a["a.attn"], self.workspace)
        g.gemv_int4(a["a.attn"], a[w + "o.qweight"], a[w + "o.scales"], x, residual=x)
        g.rmsnorm(x, a[w + "ln2"], y, d.rms_eps)
        g.gemv_int4(y, a[w + "gate_up.qweight"], a[w + "gate_up.scales"], a["a.gate_up"])
        g.gemv_int4_swiglu(a["a.gate_up"], a[w + "down.qweight"], a[w + "down.scales"], x, residual=x)

    def head_step(self) -> None:
        a, g = self.arena, self.gemv
        g.rmsnorm(a["a.x"], a["w.norm"], a["a.y"], self.dims.rms_eps)
        g.lm_head(a["a.y"], self.lm_head, a["a.logits"])
        g.argmax(a["a.logits"], self.scalar["token"])

    def cached_kv(self, layer: int, n: int):
        """K, V of positions [0, n) of `layer` gathered from the pages: [n, kv_heads, d] each."""
        pages = self.arena["s.block_table"].get()
        out = []
        for which in (0, 1):
            pool = self.kv[layer, which]                   # [pages, kv_heads, page_tokens, d]
            rows = pool[self.cp.asarray(pages[: -(-n // KV.page_tokens)])]
            out.append(rows.transpose(0, 2, 1, 3).reshape(-1, self.dims.num_kv_heads, self.dims.head_dim)[:n])
        return out

    def _step(self, token: int) -> int:
        if self.position >= self.max_tokens:
            raise LimitError("<generate>", "sequence length", f"<= {self.max_tokens} tokens (KV pool)",
                             self.position + 1)
        self._set_scalars(token, self.position)
        self.decode_step()
        self.position += 1
        return int(self.scalar["token"].get()[0])

    def prefill(self, ids: list[int], physical_pages=None) -> int:
        check_request(self.dims, list(ids), 1, self.max_tokens)
        self.reset(physical_pages)
        nxt = None
        for t in ids:
            nxt = self._step(int(t))
        return nxt

    def decode(self, token: int) -> int:
        return self._step(int(token))
