"""Peers timed in the same process, on the same synthetic weights (needs torch with CUDA).

* hf_fp16:    Hugging Face transformers Qwen2ForCausalLM in FP16 (the INT4 weights
              dequantized), eager `generate`, greedy: the baseline a user gets by default.
* torch_int4: the same model's decode step written in torch with tinygemm INT4 matmuls
              (`torch.ops.aten._weight_int4pack_mm`, group 128, bf16 activations, a static
              KV cache), captured in a CUDA graph: what a careful torch user gets.

Ratios against our ITL measured in the same run are what to read: absolute times drift
on shared machines, ratios in one run much less. torch is never a runtime dependency.

`nanoqwen bench --peers` now runs measure/peers_all.py (each peer checked by
measure/peer_check.py before it is timed; torch INT4 in measure/peers_torch.py,
transformers in measure/peers_hf.py); the two functions below are not used by it.
"""
from __future__ import annotations

import time

import numpy as np

from nanoqwen_lib.config import load


def _dequantized_fp16(nq_file, name, xp):
    from nanoqwen_lib.format.quant import dequantize_projection
    t = nq_file.model_tensors()
    if name.endswith("_proj.weight"):
        base = name[: -len(".weight")]
        return dequantize_projection(xp.asarray(t[base + ".qweight"]), xp.asarray(t[base + ".scales"]),
                                     xp=xp).astype(xp.float16)
    return xp.asarray(t[name])


def hf_fp16_peer(nq_file, prompt, gen_tokens, warmup=1) -> dict:
    import cupy as cp
    import torch
    import transformers
    from nanoqwen_lib.format.layout import hf_tensors
    from nanoqwen_lib.model.oracle import qwen2_config
    dims = nq_file.dims
    cfg = qwen2_config(dims, nq_file.hf_config)   # the checkpoint's own config.json
    cfg.torch_dtype = torch.float16
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    state = {n: torch.from_dlpack(_dequantized_fp16(nq_file, n, cp)) for n in hf_tensors(dims)}
    model.load_state_dict(state, assign=True, strict=False)
    if dims.tie_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg, device="cuda")
    model = model.to("cuda", torch.float16).eval()
    ids = torch.tensor([prompt], device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    with torch.inference_mode():
        for _ in range(warmup):
            run(4)
        t1, _ = run(1)                       # prefill + one token
        tn, toks = run(gen_tokens)
    del model, state
    torch.cuda.empty_cache()
    return {"ttft_ms": 1e3 * t1, "itl_ms": 1e3 * (tn - t1) / (gen_tokens - 1), "tokens": toks,
            "how": "transformers generate, FP16, eager, greedy; ITL = (t(n) - t(1)) / (n - 1), wall clock"}


def _int4pack(nq_file, name, torch, inner_k_tiles=8):
    """Our ValueShuffle INT4 -> tinygemm's packed int4 + scales_and_zeros (code + 8, zero 0)."""
    import cupy as cp
    from nanoqwen_lib.format.quant import unpack_int4_value_shuffle
    t = nq_file.model_tensors()
    base = name[: -len(".weight")]
    codes = unpack_int4_value_shuffle(cp.asarray(t[base + ".qweight"]), cp).astype(cp.int32) + 8       # [N, K] 0..15
    u8 = torch.from_dlpack(((codes[:, ::2] << 4) | codes[:, 1::2]).astype(cp.uint8))
    packed = torch.ops.aten._convert_weight_to_int4pack(u8, inner_k_tiles)
    scales = torch.from_dlpack(cp.asarray(t[base + ".scales"]).astype(cp.float32))      # [N, K/g]
    sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def torch_int4_peer(nq_file, prompt, gen_tokens) -> dict:
    import torch
    import torch.nn.functional as F
    dims = nq_file.dims
    g = load().format.group_size
    t = nq_file.model_tensors()
    dev, bf = "cuda", torch.bfloat16
    T = lambda name: torch.from_numpy(np.asarray(t[name])).to(dev, bf)  # noqa: E731
    layers = []
    for l in range(dims.num_layers):
        p = f"model.layers.{l}."
        L = {k: _int4pack(nq_file, p + k + ".weight", torch) for k in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        L["bias"] = [T(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
        L["ln1"], L["ln2"] = T(p + "input_layernorm.weight"), T(p + "post_attention_layernorm.weight")
        layers.append(L)
    embed = T("model.embed_tokens.weight")
    head = embed if dims.tie_embeddings else T("lm_head.weight")
    norm = T("model.norm.weight")
    max_len = len(prompt) + gen_tokens + 1
    kc = torch.zeros(dims.num_layers, dims.num_kv_heads, max_len, dims.head_dim, device=dev, dtype=bf)
    vc = torch.zeros_like(kc)
    inv = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, device=dev, dtype=torch.float32) / dims.head_dim))
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    ar = torch.arange(max_len, device=dev)

    def mm(x, w):
        return torch.ops.aten._weight_int4pack_mm(x, w[0], g, w[1])

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + dims.rms_eps)).to(bf) * w

    def rope(x):                                             # x [heads, d]
        ang = pos.float() * inv
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        x1, x2 = x[..., : dims.head_dim // 2], x[..., dims.head_dim // 2:]
        return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(bf)

    def step():
        x = embed[tok]                                       # [1, hidden]
        for l, L in enumerate(layers):
            y = rms(x, L["ln1"])
            q = (mm(y, L["self_attn.q_proj"]) + L["bias"][0]).view(dims.num_heads, dims.head_dim)
            k = (mm(y, L["self_attn.k_proj"]) + L["bias"][1]).view(dims.num_kv_heads, dims.head_dim)
            v = (mm(y, L["self_attn.v_proj"]) + L["bias"][2]).view(dims.num_kv_heads, dims.head_dim)
            q, k = rope(q), rope(k)
            kc[l].index_copy_(1, pos, k[:, None])
            vc[l].index_copy_(1, pos, v[:, None])
            mask = (ar <= pos)[None, None, :]
            o = F.scaled_dot_product_attention(q[:, None], kc[l].repeat_interleave(dims.gqa_ratio, 0),
                                               vc[l].repeat_interleave(dims.gqa_ratio, 0), attn_mask=mask)
            x = x + mm(o.reshape(1, -1), L["self_attn.o_proj"])
            y = rms(x, L["ln2"])
            act = F.silu(mm(y, L["mlp.gate_proj"])) * mm(y, L["mlp.up_proj"])
            x = x + mm(act, L["mlp.down_proj"])
        logits = rms(x, norm) @ head.t()
        tok.copy_(logits.float().argmax(-1))
        pos.add_(1)

    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()                                       # warm-up (allocations, kernels)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        pos.zero_()                                          # the warm-up steps advanced it
        for tk in prompt:                                    # the prompt, one step at a time
            tok.fill_(tk)
            graph.replay()
        torch.cuda.synchronize()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(gen_tokens + 1)]
        out = [tok.clone()]                                  # the first token (after the prompt)
        evs[0].record()
        for i in range(gen_tokens):
            graph.replay()
            evs[i + 1].record()
            out.append(tok.clone())
        torch.cuda.synchronize()
    itl = [evs[i].elapsed_time(evs[i + 1]) for i in range(gen_tokens)]
    return {"itl_ms": float(np.median(itl)), "itl_p10": float(np.percentile(itl, 10)),
            "itl_p90": float(np.percentile(itl, 90)), "tokens": [int(x) for x in torch.cat(out).tolist()][:gen_tokens],
            "how": "torch tinygemm INT4 (_weight_int4pack_mm, group 128, bf16), SDPA over a static "
                   "cache, CUDA graph; prompt fed step by step; ITL median of CUDA events"}
