"""torch INT4 at its best: the decode step a careful torch user writes (gpt-fast's shape).

* weights: our INT4 codes and scales repacked for tinygemm (`_convert_weight_to_int4pack`,
  `_weight_int4pack_mm`; on the CPU the `_for_cpu` twins), q/k/v fused into one matrix
  and gate/up into another, so a layer is four INT4 GEMVs; tinygemm takes bf16 activations
  and bf16 scales, the only places bf16 appears;
* numerics otherwise ours: the residual stream, the norms, RoPE and the biases in FP32,
  the KV cache in FP16, the lm_head an FP16 matmul, the logits FP32;
* RoPE from cos/sin tables precomputed for every position, indexed by the position tensor;
* GQA attention without copying the cache: the `gqa` query heads that share a KV head are
  laid out as `gqa` query rows of that head ([1, kv_heads, gqa * T, d]) and one SDPA call
  reads the static cache [1, kv_heads, max_len, d] in place, a mask hiding the future;
* a static KV cache written with index_copy_ at the position tensor, so the step has fixed
  shapes; on CUDA the step is compiled (torch.compile, Inductor, fusing the small ops)
  and captured with the cache, position and token in one CUDA graph; a compile failure
  falls back to the eager step in the graph and says so in `how`.

The prompt is one eager forward over all its tokens (tinygemm with M = prompt length).
torch is a peer-only dependency: imported here, never by the runtime.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load

PROJ_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "down": ("mlp.down_proj",)}


def tinygemm_pack(codes, scales, torch, inner_k_tiles=8):
    """codes: torch int32 [N, K] in -8..7, scales: torch [N, K/g], both on the target device ->
    (packed weight, scales_and_zeros [K/g, N, 2] bf16) for tinygemm: w = (q - 8) * scale + zero
    with q = code + 8 and zero 0."""
    q = codes.to(torch.int32) + 8
    if q.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), inner_k_tiles)
    else:
        u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(u8, inner_k_tiles)
    s = scales.float().t()
    return packed, torch.stack([s, torch.zeros_like(s)], dim=-1).to(torch.bfloat16).contiguous()


def as_torch(a, torch):
    """A NumPy or CuPy array -> a torch tensor on the same device (no copy for CuPy)."""
    return torch.from_numpy(np.array(a)) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


def int4_mm(x, w, group, torch):
    """x [M, K] bf16 @ tinygemm weight -> [M, N] bf16."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], group, w[1])
    return torch.ops.aten._weight_int4pack_mm(x, w[0], group, w[1])


class TorchInt4:
    """The model on torch: load(nq_file) once; forward(ids [T], start) -> logits [T, vocab]
    fp32 at positions start..start+T-1 (writes the cache); decode through `step`."""

    def __init__(self, nq_file, device="cuda", max_len=1024):
        import torch
        from nanoqwen_lib.format.quant import unpack_int4_value_shuffle
        self.torch, self.dev, self.dims, self.max_len = torch, device, nq_file.dims, max_len
        d, t = nq_file.dims, nq_file.model_tensors()
        xp = np if device == "cpu" else __import__("cupy")       # the INT4 codes unpacked on the device
        self.group = load().format.group_size
        f32 = lambda n: torch.as_tensor(np.asarray(t[n], dtype=np.float32)).to(device)  # noqa: E731
        self.layers = []
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            L = {}
            for key, projs in PROJ_GROUPS.items():
                codes = xp.concatenate([unpack_int4_value_shuffle(xp.asarray(t[p + n + ".qweight"]), xp) for n in projs])
                scales = xp.concatenate([xp.asarray(t[p + n + ".scales"]) for n in projs])
                L[key] = tinygemm_pack(as_torch(codes.astype(xp.int32), torch), as_torch(scales, torch), torch)
            L["b_qkv"] = torch.cat([f32(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            L["ln1"], L["ln2"] = f32(p + "input_layernorm.weight"), f32(p + "post_attention_layernorm.weight")
            self.layers.append(L)
        self.embed = torch.as_tensor(np.array(t["model.embed_tokens.weight"])).to(device)           # fp16
        self.head = self.embed if d.tie_embeddings else torch.as_tensor(np.array(t["lm_head.weight"])).to(device)
        self.norm = f32("model.norm.weight")
        inv = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float64) / d.head_dim))
        ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None]
        ang = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = ang.cos().float().to(device), ang.sin().float().to(device)   # [max_len, d]
        shape = (d.num_layers, 1, d.num_kv_heads, max_len, d.head_dim)
        self.kc = torch.zeros(shape, dtype=torch.float16, device=device)
        self.vc = torch.zeros_like(self.kc)
        self.ar = torch.arange(max_len, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)        # the decode step's position
        self.tok = torch.zeros(1, dtype=torch.long, device=device)        # ... and its input token
        self.out = torch.zeros(1, d.vocab, dtype=torch.float32, device=device)

    def rms(self, x, w):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.dims.rms_eps) * w

    def rope(self, x, positions):                     # x [T, heads, d] fp32
        h = self.dims.head_dim // 2
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        return x * cos + self.torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin

    def forward(self, ids, positions):
        """ids [T] long, positions [T] long (consecutive) -> logits [1, vocab] fp32 of the
        last position (the K, V of all T go to the cache)."""
        torch, d = self.torch, self.dims
        F = torch.nn.functional
        T, gqa, bf = ids.shape[0], d.gqa_ratio, torch.bfloat16
        mm = lambda x, w: int4_mm(x.to(bf), w, self.group, torch).float()  # noqa: E731
        x = self.embed[ids].float()                                                  # [T, H]
        seen = self.ar[None, :] <= positions[:, None]                                # [T, max_len]
        mask = seen[None].expand(gqa, T, self.max_len).reshape(1, 1, gqa * T, self.max_len)
        for i, L in enumerate(self.layers):
            qkv = mm(self.rms(x, L["ln1"]), L["qkv"]) + L["b_qkv"]
            q = qkv[:, :d.q_dim].view(T, d.num_heads, d.head_dim)
            k = qkv[:, d.q_dim:d.q_dim + d.kv_dim].view(T, d.num_kv_heads, d.head_dim)
            v = qkv[:, d.q_dim + d.kv_dim:].view(T, d.num_kv_heads, d.head_dim)
            q, k = self.rope(q, positions), self.rope(k, positions)
            self.kc[i].index_copy_(2, positions, k.to(torch.float16).permute(1, 0, 2)[None])
            self.vc[i].index_copy_(2, positions, v.to(torch.float16).permute(1, 0, 2)[None])
            # query head h = kv * gqa + g reads KV head kv: [kv, gqa * T, d] rows, no cache copy
            qg = q.to(torch.float16).view(T, d.num_kv_heads, gqa, d.head_dim).permute(1, 2, 0, 3)
            o = F.scaled_dot_product_attention(qg.reshape(1, d.num_kv_heads, gqa * T, d.head_dim),
                                               self.kc[i], self.vc[i], attn_mask=mask)
            o = o.reshape(d.num_kv_heads, gqa, T, d.head_dim).permute(2, 0, 1, 3).reshape(T, d.q_dim)
            x = x + mm(o, L["o"])
            gu = mm(self.rms(x, L["ln2"]), L["gate_up"])
            x = x + mm(F.silu(gu[:, :d.intermediate]) * gu[:, d.intermediate:], L["down"])
        return (self.rms(x[-1:], self.norm).to(torch.float16) @ self.head.t()).float()   # the last position

    def step(self):
        """One decode step on the static tensors: tok at pos -> out; pos += 1."""
        self.out.copy_(self.forward(self.tok, self.pos))
        self.tok.copy_(self.out.argmax(-1))
        self.pos.add_(1)


class TorchInt4Peer:
    """TorchInt4 behind measure.peer_check's peer protocol (prefill, step -> logits), its
    decode through the captured graph on CUDA (eager on the CPU)."""

    def __init__(self, nq_file, device="cuda", max_len=1024, compile_step=True):
        import torch
        self.torch, self.dev = torch, device
        self.m = TorchInt4(nq_file, device, max_len)
        self.how = ["eager step (CPU)"] if device == "cpu" else []
        self.graph = None
        if device != "cpu":
            self._capture(compile_step)

    def _capture(self, compile_step):
        """Warm up and capture the compiled step; if compiling or capturing it fails, the
        eager step (and `how` says why)."""
        torch, m = self.torch, self.m
        if compile_step:
            try:
                fn = torch.compile(m.step, fullgraph=True)     # Inductor fuses the small ops; the
                self._record(fn)                               # graph is captured by hand
                self.how.append("step compiled by torch.compile (Inductor, fullgraph)")
                return
            except Exception as e:  # reported in `how`; the eager step is captured instead
                self.how.append(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); eager step")
        self._record(m.step)

    def _record(self, fn):
        torch = self.torch
        self._warm(fn)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            fn()
        self.graph = graph
        self.how.append("the step captured in one CUDA graph")

    def _warm(self, fn):
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(s):
            for _ in range(3):
                self.m.pos.zero_()
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

    def prefill(self, ids):
        torch, m = self.torch, self.m
        with torch.inference_mode():
            t = torch.as_tensor(ids, device=self.dev)
            logits = m.forward(t, torch.arange(len(ids), device=self.dev))
            m.pos.fill_(len(ids))
            m.tok.copy_(logits.argmax(-1))                # the first token: the next step's input
            return logits[0].cpu().numpy()

    def launch(self, token=None):
        """Enqueue one decode step (token None: the previous step's argmax, already in tok)."""
        if token is not None:
            self.m.tok.fill_(int(token))
        if self.graph is not None:
            self.graph.replay()
        else:
            with self.torch.inference_mode():
                self.m.step()

    def step(self, token):
        self.launch(token)
        return self.m.out[0].cpu().numpy().copy()      # out is overwritten by the next step


def time_torch_int4(peer: TorchInt4Peer, prompt, gen_tokens: int, warmup: int) -> dict:
    """TTFT (eager prefill, CUDA events) and per-step ITL (events between graph replays)."""
    torch = peer.torch
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def request():
        e0 = ev()
        e0.record()
        peer.prefill(prompt)                          # the first token is known (and copied to the host)
        first = ev()
        first.record()
        evs = [first]
        for _ in range(gen_tokens):
            peer.launch()
            evs.append(ev())
            evs[-1].record()
        torch.cuda.synchronize()
        return e0.elapsed_time(first), [evs[i].elapsed_time(evs[i + 1]) for i in range(gen_tokens)]

    for _ in range(warmup):
        request()
    ttft, itl = request()
    return {"ttft_ms": ttft, "itl_ms": float(np.median(itl)), "itl_p10": float(np.percentile(itl, 10)),
            "itl_p90": float(np.percentile(itl, 90))}


def gemv_only_ms(peer: TorchInt4Peer, reps: int = 50) -> float:
    """The INT4 GEMVs of every layer (qkv, o, gate_up, down) and the FP16 lm_head, nothing
    else, captured in one CUDA graph: the floor the step's other ops sit on (CUDA only)."""
    torch, m = peer.torch, peer.m
    d = m.dims
    xs = {k: torch.randn(1, n, device="cuda").to(torch.bfloat16)
          for k, n in (("qkv", d.hidden), ("o", d.q_dim), ("gate_up", d.hidden), ("down", d.intermediate))}
    xh = torch.randn(1, d.hidden, device="cuda").half()

    def body():
        for L in m.layers:
            for k, x in xs.items():
                int4_mm(x, L[k], m.group, torch)
        xh @ m.head.t()

    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
    for _ in range(5):
        g.replay()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    evs[0].record()
    for i in range(reps):
        g.replay()
        evs[i + 1].record()
    torch.cuda.synchronize()
    return float(np.median([evs[i].elapsed_time(evs[i + 1]) for i in range(reps)]))


def torch_int4_peer(nq_file, prompt, gen_tokens: int, warmup: int, check) -> dict:
    """The peer on CUDA: checked (check(peer) -> peer_check verdict), then timed."""
    import torch
    peer = TorchInt4Peer(nq_file, "cuda", max_len=len(prompt) + gen_tokens + 16)
    r = {"how": "torch tinygemm INT4 (fused qkv, gate_up), FP32 residual/norms, FP16 KV cache and lm_head, "
                "precomputed RoPE, GQA SDPA on the static cache; " + "; ".join(peer.how),
         "version": f"torch {torch.__version__}", "agreement": check(peer)}
    r.update(time_torch_int4(peer, prompt, gen_tokens, warmup))
    r["gemv_only_ms"] = gemv_only_ms(peer)
    return r
