"""The reference model: the whole Qwen2 forward, once, against an array module `xp`.

This is the oracle every GPU kernel and the engine are checked against. It runs on NumPy
(CPU, the `tiny` configs) or CuPy (GPU, the 7B), emulates the INT4 weights exactly
(W = codes * fp16 scale, dequantized once to float32), and rounds activations to FP16 at
exactly the points of the numerics contract (book/design.md / the kernels), no more, no less:

    x = embed[id]                                   fp16 row
    per layer:
      y  = fp16(x * rsqrt(mean(x^2) + eps) * w)     rmsnorm
      qkv = fp16(W_qkv . y + b)                      q, k, v
      q, k = fp16(rope(q)), fp16(rope(k))            K, V stored fp16 in the cache
      a  = fp16(softmax(q.k / sqrt(d)) . v)          fp32 scores and softmax
      x  = fp16(x + W_o . a)                         residual added in fp32, one rounding
      y  = rmsnorm(x); g, u = fp16(W_gate . y), fp16(W_up . y)
      x  = fp16(x + W_down . fp16(silu(g) * u))
    logits = fp32(W_lm_head . rmsnorm(x))            kept fp32; argmax, ties -> lowest id

Every activation is held as float32; "fp16(.)" is a cast to float16 and back (`round_fp16`),
so `act_dtype="float32"` (rounding nowhere, `keep_fp32`) is the same code with an identity.
Building blocks are plain functions so that each GPU kernel test can call its own one.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from nanoqwen_lib.errors import ConfigError, FormatError, LimitError
from nanoqwen_lib.format.layout import encoding_of, layer_prefix, packed_tensors
from nanoqwen_lib.format.quant import dequantize_int4, dequantize_projection, fp8_rows

ACT_DTYPES = ("float16", "float32")


def round_fp16(a):
    """Storage rounding of the GPU: cast to float16 and back (round to nearest even)."""
    return a.astype("float16").astype("float32")


def keep_fp32(a):
    return a


def array_module(a):
    """numpy for NumPy arrays, cupy for CuPy arrays (imported only when one is seen)."""
    return np if isinstance(a, np.ndarray) else importlib.import_module("cupy")


# ---------------------------------------------------------------- building blocks
def rmsnorm(x, w, eps, xp=np, rnd=round_fp16):
    """x [..., hidden] fp32, w [hidden] fp32 -> rnd(x * rsqrt(mean(x^2) + eps) * w)."""
    inv_rms = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    return rnd(x * inv_rms * w)


def rope_inv_freq(head_dim, theta, xp=np):
    """inv_freq[i] = 1 / theta^(2i/d) -> float32 [d/2]: the exponent in fp32 as Hugging Face
    computes it, the power in float64, rounded once (fp32 pow differs by an ulp between
    libraries and between NumPy's SIMD paths; this table is the same on every CPU). Kernels
    take it from here so that they and the reference share its bits."""
    exponents = np.arange(0, head_dim, 2, dtype="float32") / head_dim
    return xp.asarray((1.0 / theta ** exponents.astype(np.float64)).astype("float32"))


def rope_tables(positions, head_dim, theta, xp=np):
    """positions [T] ints -> (cos, sin), each float32 [T, head_dim/2].

    angle = fp32(pos) * inv_freq[i] in fp32; the half tables serve both halves of
    rotate_half."""
    inv_freq = rope_inv_freq(head_dim, theta, xp)
    angle = xp.asarray(positions).astype("float32")[:, None] * inv_freq[None, :]
    return f64(xp.cos, angle), f64(xp.sin, angle)


def apply_rope(x, cos, sin):
    """x [..., heads, head_dim] fp32; cos, sin [..., head_dim/2] (no heads axis) -> fp32.

    Hugging Face's rotate_half convention (halves, not interleaved pairs):
    out[i] = x[i] cos - x[i+d/2] sin,  out[i+d/2] = x[i+d/2] cos + x[i] sin."""
    xp = array_module(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def matmul(a, b):
    """a @ b as float32. On NumPy the sums run in float64 and are rounded once, so the bits
    do not depend on the BLAS (its kernel for this CPU, its threads); on CuPy, cuBLAS fp32."""
    if isinstance(a, np.ndarray):
        return (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).astype(np.float32)
    return a @ b


def f64(fn, a):
    """fn(a) as float32; on NumPy computed in float64 and rounded once, so the bits do not
    depend on which SIMD path NumPy's float32 exp/sin/cos take on this CPU."""
    if isinstance(a, np.ndarray):
        return fn(a.astype(np.float64)).astype(np.float32)
    return fn(a)


def linear(x, w, bias=None, residual=None, rnd=round_fp16):
    """x [..., in] fp32, w [out, in] fp32 -> rnd(residual + (W . x + bias)), FP32 inside."""
    y = matmul(x, w.T)
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = residual + y
    return rnd(y)


def gemv_int4_ref(x, qweight, scales, bias=None, residual=None):
    """The exact contract of a GPU INT4 GEMV: fp16 out = fp16(residual + W . x + bias).

    x [in] (or [T, in]) fp16; qweight uint32 [out, in/8] ValueShuffle; scales fp16
    [out, in/128]; bias [out] and residual [..., out] fp16 or None. Same array module in,
    same array module out."""
    xp = array_module(x)
    w = dequantize_int4(xp.asarray(qweight), xp.asarray(scales), xp=xp)
    f32 = lambda a: None if a is None else xp.asarray(a).astype("float32")  # noqa: E731
    return linear(f32(x), w, f32(bias), f32(residual), round_fp16).astype("float16")


def swiglu(gate_up, rnd=round_fp16):
    """gate_up [..., 2I] fp32 (gate rows, then up rows) -> rnd(silu(g) * u) [..., I]."""
    xp = array_module(gate_up)
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    return rnd(g / (1.0 + f64(xp.exp, -g)) * u)


def attention_prefill(q, k, v, rnd=round_fp16, hidden=None):
    """Causal GQA attention. q [T, heads, d]; k, v [ctx, kv_heads, d], ctx >= T; all fp32.

    The T queries are the last T positions of the context: query i sees keys
    0 .. ctx-T+i. Query head h reads KV head h // (heads / kv_heads). -> rnd(out) [T, heads, d].
    hidden [T, ctx] bool, when given, replaces the causal mask (True: the key is not seen),
    e.g. for several sequences' tokens side by side (ReferenceModel.decode_batch)."""
    xp = array_module(q)
    T, heads, d = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    qg = q.reshape(T, kv_heads, group, d).transpose(1, 2, 0, 3)      # [kv, group, T, d]
    kt = k.transpose(1, 2, 0)[:, None]                               # [kv, 1, d, ctx]
    scores = matmul(qg, kt) * (d ** -0.5)                            # [kv, group, T, ctx]
    future = xp.arange(ctx)[None, :] > (ctx - T + xp.arange(T))[:, None] if hidden is None else hidden
    scores = xp.where(future, -xp.inf, scores)
    p = f64(xp.exp, scores - scores.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    out = matmul(p, v.transpose(1, 0, 2)[:, None])                   # [kv, group, T, d]
    return rnd(out.transpose(2, 0, 1, 3).reshape(T, heads, d))


def attention_decode(q, k, v, rnd=round_fp16):
    """One query at the last position. q [heads, d]; k, v [ctx, kv_heads, d] -> [heads, d]."""
    return attention_prefill(q[None], k, v, rnd)[0]


# ---------------------------------------------------------------- one decoder layer
@dataclass
class LayerWeights:
    """One decoder layer on xp, float32. The q/k/v and gate/up projections are concatenated
    (rows are independent, so this changes nothing but the number of matmuls)."""
    input_norm: object   # [hidden]
    w_qkv: object        # [q_dim + 2 kv_dim, hidden]
    b_qkv: object        # [q_dim + 2 kv_dim]
    w_o: object          # [hidden, q_dim]
    post_norm: object    # [hidden]
    w_gate_up: object    # [2 intermediate, hidden]
    w_down: object       # [hidden, intermediate]


def load_layer_weights(tensors, i, xp=np) -> LayerWeights:
    """Layer i of a packed-tensor mapping (names of layout.packed_tensors) onto xp."""
    p = layer_prefix(i)
    f32 = lambda name: xp.asarray(tensors[p + name]).astype("float32")  # noqa: E731

    def deq(proj):
        """The projection's W as float32: dequantized (INT4 or FP8), or as stored (fp16)."""
        if p + proj + ".weight" in tensors:
            return f32(proj + ".weight")
        return dequantize_projection(xp.asarray(tensors[p + proj + ".qweight"]),
                                     xp.asarray(tensors[p + proj + ".scales"]), xp=xp)
    attn, mlp = "self_attn.", "mlp."
    return LayerWeights(
        input_norm=f32("input_layernorm.weight"),
        w_qkv=xp.concatenate([deq(attn + n) for n in ("q_proj", "k_proj", "v_proj")]),
        b_qkv=xp.concatenate([f32(attn + n + ".bias") for n in ("q_proj", "k_proj", "v_proj")]),
        w_o=deq(attn + "o_proj"),
        post_norm=f32("post_attention_layernorm.weight"),
        w_gate_up=xp.concatenate([deq(mlp + "gate_proj"), deq(mlp + "up_proj")]),
        w_down=deq(mlp + "down_proj"),
    )


def decoder_layer(x, w: LayerWeights, k_past, v_past, dims, rnd=round_fp16, act_q=None,
                  positions=None, hidden=None):
    """x [T, hidden] fp32 at positions P..P+T-1; k_past, v_past [P, kv_heads, d] fp32.

    -> (x_new [T, hidden], k_new [T, kv_heads, d], v_new [T, kv_heads, d]), all rounded
    by rnd; k_new (after RoPE) and v_new are what the cache stores. act_q, when given, is
    applied to the input of each of the four projections (the FP8 prefill: quant.fp8_rows).
    positions [T] and hidden [T, P + T] (attention_prefill) replace P..P+T-1 and the causal
    mask when the rows are tokens of different sequences (ReferenceModel.decode_batch)."""
    xp = array_module(x)
    aq = act_q or keep_fp32
    T, P, d = x.shape[0], k_past.shape[0], dims.head_dim
    positions = xp.arange(P, P + T) if positions is None else positions
    y = rmsnorm(x, w.input_norm, dims.rms_eps, xp, rnd)
    qkv = linear(aq(y), w.w_qkv, w.b_qkv, rnd=rnd)
    q = qkv[:, :dims.q_dim].reshape(T, dims.num_heads, d)
    k = qkv[:, dims.q_dim:dims.q_dim + dims.kv_dim].reshape(T, dims.num_kv_heads, d)
    v = qkv[:, dims.q_dim + dims.kv_dim:].reshape(T, dims.num_kv_heads, d)
    cos, sin = rope_tables(positions, d, dims.rope_theta, xp)
    q, k = rnd(apply_rope(q, cos, sin)), rnd(apply_rope(k, cos, sin))
    a = attention_prefill(q, xp.concatenate([k_past, k]), xp.concatenate([v_past, v]), rnd, hidden)
    x = linear(aq(a.reshape(T, dims.q_dim)), w.w_o, residual=x, rnd=rnd)
    y = rmsnorm(x, w.post_norm, dims.rms_eps, xp, rnd)
    act = swiglu(linear(aq(y), w.w_gate_up, rnd=rnd), rnd)
    x = linear(aq(act), w.w_down, residual=x, rnd=rnd)
    return x, k, v


def decoder_layer_decode(x, w: LayerWeights, k_past, v_past, dims, rnd=round_fp16):
    """One token: x [hidden] at position P = len(k_past) -> (x_new [hidden], k_new, v_new
    [kv_heads, d])."""
    x, k, v = decoder_layer(x[None], w, k_past, v_past, dims, rnd)
    return x[0], k[0], v[0]


def final_logits(x, norm_w, lm_head, eps, xp=np, rnd=round_fp16):
    """x [..., hidden] -> logits [..., vocab] float32 = W_lm_head . rmsnorm(x), unrounded."""
    return matmul(rmsnorm(x, norm_w, eps, xp, rnd), lm_head.T)


# ---------------------------------------------------------------- the KV cache
class ContiguousKV:
    """Per layer K and V as [capacity, kv_heads, head_dim] in act precision, contiguous.
    Rows [0, length) are valid; capacity doubles when a step would overflow it."""

    def __init__(self, dims, dtype, xp=np, capacity=64):
        self.xp, self.length = xp, 0
        shape = (capacity, dims.num_kv_heads, dims.head_dim)
        self.k = [xp.zeros(shape, dtype) for _ in range(dims.num_layers)]
        self.v = [xp.zeros(shape, dtype) for _ in range(dims.num_layers)]

    def past(self, layer):
        """(K, V) of the valid rows as float32 [length, kv_heads, d]."""
        n = self.length
        return self.k[layer][:n].astype("float32"), self.v[layer][:n].astype("float32")

    def write(self, layer, k_new, v_new):
        """Store k_new, v_new [T, kv_heads, d] at rows [length, length+T) (exact: they are
        already rounded to the cache's precision)."""
        end = self.length + k_new.shape[0]
        if end > self.k[layer].shape[0]:
            self.k[layer], self.v[layer] = self._grow(self.k[layer], end), self._grow(self.v[layer], end)
        self.k[layer][self.length:end] = k_new
        self.v[layer][self.length:end] = v_new

    def _grow(self, a, rows):
        """a [capacity, ...] -> a copy with capacity max(rows, 2 * capacity), same contents."""
        capacity = max(rows, 2 * a.shape[0])
        bigger = self.xp.zeros((capacity,) + a.shape[1:], a.dtype)
        bigger[:a.shape[0]] = a
        return bigger


# ---------------------------------------------------------------- the model
class ReferenceModel:
    """tensors: name -> array with exactly the names, dtypes and shapes of
    layout.packed_tensors(dims, encoding) for one encoding (fp16 under HF names; the
    projections as INT4 `<proj>.qweight` uint32 + `.scales` fp16, FP8 `.qweight` uint8 +
    `.scales` fp32, or unquantized fp16 `<proj>.weight`), e.g. the mmap of a .nanoqwen file."""

    def __init__(self, dims, tensors, xp=np, act_dtype="float16"):
        if act_dtype not in ACT_DTYPES:
            raise ConfigError("ReferenceModel", "act_dtype", f"one of {ACT_DTYPES}", repr(act_dtype))
        check_tensors(dims, tensors)
        self.dims, self.xp, self.act_dtype = dims, xp, act_dtype
        # An FP8 model's prefill runs its projections on FP8 activations (one E4M3 scale per
        # token, kernels/fp8.cu); decode keeps them in fp16, as the GEMV does.
        self.encoding = encoding_of(tensors)
        self.prefill_act_q = (lambda a: fp8_rows(a, xp)) if self.encoding == "fp8" else None
        self.rnd = round_fp16 if act_dtype == "float16" else keep_fp32
        self.embed = xp.asarray(tensors["model.embed_tokens.weight"])          # [vocab, hidden] fp16
        self.layers = [load_layer_weights(tensors, i, xp) for i in range(dims.num_layers)]
        self.norm = xp.asarray(tensors["model.norm.weight"]).astype("float32")
        head = "model.embed_tokens.weight" if dims.tie_embeddings else "lm_head.weight"
        self.lm_head = xp.asarray(tensors[head]).astype("float32")             # fp16 values, fp32 math
        if xp is np:   # the products summed in float64 (matmul): the weights held there once, exactly
            for w in self.layers:
                for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
                    setattr(w, name, getattr(w, name).astype(np.float64))
            self.lm_head = self.lm_head.astype(np.float64)

    def forward(self, ids, cache: ContiguousKV, prefill: bool = False):
        """ids [T] (list or NumPy ints) at positions cache.length.. -> logits float32
        [T, vocab]; appends the T positions to cache. prefill=True: the prompt's batch (an
        FP8 model then rounds the projections' inputs to FP8, as its prefill kernels do)."""
        xp, ids = self.xp, np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.dims.vocab:
            found = "no tokens" if ids.size == 0 else f"ids from {ids.min()} to {ids.max()}"
            raise LimitError("<arguments>", "token ids", f"1 or more ids in [0, {self.dims.vocab})", found)
        x = self.embed[xp.asarray(ids)].astype("float32")                      # [T, hidden]
        for i, w in enumerate(self.layers):
            k_past, v_past = cache.past(i)
            x, k, v = decoder_layer(x, w, k_past, v_past, self.dims, self.rnd,
                                    act_q=self.prefill_act_q if prefill else None)
            cache.write(i, k, v)
        cache.length += len(ids)
        return final_logits(x, self.norm, self.lm_head, self.dims.rms_eps, xp, self.rnd)

    def new_cache(self, capacity=64) -> ContiguousKV:
        return ContiguousKV(self.dims, self.act_dtype, self.xp, capacity)

    def prefill(self, ids):
        """ids [T] -> (logits float32 [T, vocab], cache holding T positions)."""
        cache = self.new_cache(max(64, len(ids)))
        return self.forward(ids, cache, prefill=True), cache

    def decode(self, token_id, cache: ContiguousKV):
        """One token at position cache.length -> logits float32 [vocab]."""
        return self.forward([int(token_id)], cache)[0]

    def decode_batch(self, token_ids, caches: list):
        """One token for each of B sequences, token_ids[b] at position caches[b].length ->
        logits float32 [B, vocab]; each cache gets its position. The B rows go through each
        projection as one matrix (the weights are read once per step for all of them), and
        through attention side by side over the concatenated caches, each row masked to its
        own sequence: the same arithmetic and rounding points as B calls of decode, summed
        in another order (a matrix product, not B vector products), so the logits differ
        by noise of the engine's kind (~5e-4 relative on tiny)."""
        xp, B = self.xp, len(caches)
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size != B or ids.min() < 0 or ids.max() >= self.dims.vocab:
            raise LimitError("<arguments>", "token ids", f"{B} ids in [0, {self.dims.vocab})", ids.tolist())
        lengths = np.array([c.length for c in caches])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ctx = int(lengths.sum()) + B
        seen = np.zeros((B, ctx), bool)                      # row b: its own past, then its own new token
        for b in range(B):
            seen[b, starts[b]:starts[b] + lengths[b]] = True
            seen[b, ctx - B + b] = True
        hidden, positions = xp.asarray(~seen), xp.asarray(lengths)
        x = self.embed[xp.asarray(ids)].astype("float32")                      # [B, hidden]
        for i, w in enumerate(self.layers):
            pasts = [c.past(i) for c in caches]
            x, k, v = decoder_layer(x, w, xp.concatenate([p[0] for p in pasts]), xp.concatenate([p[1] for p in pasts]),
                                    self.dims, self.rnd, positions=positions, hidden=hidden)
            for b, c in enumerate(caches):
                c.write(i, k[b:b + 1], v[b:b + 1])
        for c in caches:
            c.length += 1
        return final_logits(x, self.norm, self.lm_head, self.dims.rms_eps, xp, self.rnd)

    def greedy_steps_batch(self, prompts, max_new_tokens):
        """greedy_steps for several prompts at once: yields logits [B, vocab] per step. Each
        prompt is prefilled alone; the decode steps go through decode_batch."""
        caches, last = [], []
        for p in prompts:
            logits, cache = self.prefill(p)
            caches.append(cache)
            last.append(logits[-1])
        logits = self.xp.stack(last)
        for step in range(max_new_tokens):
            yield logits
            if step + 1 < max_new_tokens:
                logits = self.decode_batch([argmax_and_gap(row)[0] for row in logits], caches)

    def greedy_steps(self, prompt_ids, max_new_tokens):
        """Yields the logits (float32 [vocab]) of each of max_new_tokens greedy steps; the
        step after each decodes its argmax."""
        logits, cache = self.prefill(prompt_ids)
        logits = logits[-1]
        for step in range(max_new_tokens):
            yield logits
            if step + 1 < max_new_tokens:
                logits = self.decode(argmax_and_gap(logits)[0], cache)

    def greedy(self, prompt_ids, max_new_tokens):
        """-> (new token ids, top2_gaps): gap = best logit - second-best logit at each step."""
        steps = [argmax_and_gap(logits) for logits in self.greedy_steps(prompt_ids, max_new_tokens)]
        return [b for b, _ in steps], [g for _, g in steps]


def argmax_and_gap(logits):
    """logits [vocab] -> (argmax with ties to the lowest id, best - second best)."""
    best, second = top2(logits)
    return best, float(logits[best] - logits[second])


def top2(logits):
    """logits [vocab] -> (argmax, runner-up), ties to the lowest id."""
    best = int(logits.argmax())
    rest = logits.copy()
    rest[best] = -np.inf
    return best, int(rest.argmax())


def check_tensors(dims, tensors, source=None):
    """Refuse a mapping whose names, dtypes or shapes differ from layout.packed_tensors."""
    source = source or getattr(tensors, "path", "<tensors mapping>")
    want = packed_tensors(dims, encoding_of(tensors))
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise FormatError(source, "tensor names", "only the names of layout.packed_tensors",
                          f"{len(extra)} extra, first {extra[0]!r}")
    for name, (dtype, shape) in want.items():
        if name not in tensors:
            raise FormatError(source, name, f"{dtype} {shape}", "nothing (tensor missing)")
        t = tensors[name]
        if np.dtype(t.dtype) != dtype or tuple(t.shape) != shape:
            raise FormatError(source, name, f"{dtype} {shape}", f"{np.dtype(t.dtype)} {tuple(t.shape)}")
