"""The reference model against its oracles (CPU).

1. Hugging Face transformers' Qwen2ForCausalLM (torch float32, eager attention) on the same
   dequantized weights: the outside oracle for RoPE, GQA, bias and norm conventions.
2. Itself: prefill + decode steps == one longer prefill; fp16 emulation close to fp32.
3. Straightforward float64 NumPy formulas for each building block.
Synthetic weights from a seed; the projections go through the real quantizer and packer,
so the reference consumes the packed form and HF gets dequantize_int4 of it.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.format import layout
from nanoqwen_lib.model import reference as ref
from nanoqwen_lib.config import load
from nanoqwen_lib.format.hf_config import dims_from_hf_config
from nanoqwen_lib.errors import ConfigError, FormatError, LimitError
from nanoqwen_lib.format.quant import dequantize_int4, pack_int4_value_shuffle, quantize_int4_groupwise

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2  # noqa: E402

from nanoqwen_lib.model.oracle import hf_model  # noqa: E402

from .hf_corpus import transformers_config_of  # noqa: E402

CONFIGS = ("tiny", "tiny-hd64")
LOGIT_STD = 8.0   # confident logits: top-2 gaps are mostly far above FP16 noise
MEASURED = {}     # what the tests measured (max errors, agreement), printed at the end (pytest -s)


# ---------------------------------------------------------------- synthetic models
def synthetic_weights(dims, seed):
    """-> (packed: names of layout.packed_tensors -> numpy, hf: HF names -> torch float32).

    Scales keep every sublayer's contribution comparable to the residual stream, so a
    wrong convention in attention or the MLP shows in the logits."""
    rng = np.random.default_rng(seed)
    packed, hf = {}, {}
    # q, k: scores of std ~2 (peaked, not one-hot). o, down: the layers outweigh the
    # embedding, so even with tied embeddings the argmax is not "repeat the input token".
    gains = {"q_proj": 1.5, "k_proj": 1.5, "o_proj": 4.0, "down_proj": 4.0}
    head_std = LOGIT_STD / np.sqrt(dims.hidden)
    for name, shape in layout.hf_tensors(dims).items():
        if layout.is_quantized(name):
            gain = gains.get(name.split(".")[-2], 1.0)
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(shape[1]))
            codes, scales = quantize_int4_groupwise(w)
            words = pack_int4_value_shuffle(codes)
            base = name[: -len(".weight")]
            packed[base + ".qweight"], packed[base + ".scales"] = words, scales
            hf[name] = torch.from_numpy(dequantize_int4(words, scales))
            continue
        mean, std = 0.0, 1.0
        if name.endswith("norm.weight"):
            mean, std = 1.0, 0.1
        elif name.endswith(".bias"):
            std = 0.5
        elif name == "lm_head.weight" or dims.tie_embeddings:
            std = head_std
        a = (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
        packed[name], hf[name] = a, torch.from_numpy(a.astype(np.float32))
    return packed, hf


@functools.lru_cache(maxsize=None)
def weights(name):
    """-> (dims, packed tensors, HF state dict), built once per config."""
    dims = load().model(name)
    return (dims, *synthetic_weights(dims, seed=CONFIGS.index(name)))


@functools.lru_cache(maxsize=None)
def hf_config(name) -> dict:
    """The config.json transformers writes for these dims; ours reads it back as the dims."""
    dims = load().model(name)
    cfg = transformers_config_of(dims)
    assert dims_from_hf_config(cfg) == dims
    return cfg


@functools.lru_cache(maxsize=None)
def synthetic(name):
    """-> (dims, packed tensors, HF model, {act_dtype: ReferenceModel on NumPy}). The HF
    model is built from transformers' own config.json for the dims, not from ours."""
    dims, packed, hf_state = weights(name)
    models = {a: ref.ReferenceModel(dims, packed, act_dtype=a) for a in ref.ACT_DTYPES}
    return dims, packed, hf_model(dims, hf_state, hf_config(name)), models


def prompt(dims, n, seed=0):
    return np.random.default_rng(100 + seed).integers(0, dims.vocab, n).tolist()


def rel_err_per_position(ours, theirs):
    """[T, vocab] x2 -> [T]: ||ours - theirs|| / ||theirs|| per position."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def assert_same_until_near_tie(got, want, gaps, min_steps=0):
    """Greedy streams agree up to the first step whose top-2 gap (in `want`'s run) is a
    near-tie; after a tie the two contexts may legitimately differ."""
    tie = next((i for i, g in enumerate(gaps) if g <= load().validation.near_tie_logit_gap), len(gaps))
    assert tie >= min_steps, f"a near-tie too early to judge anything: gaps {gaps}"
    assert got[:tie] == want[:tie], (got, want, gaps)


def record(key, value):
    MEASURED[key] = max(MEASURED.get(key, 0.0), float(value))


@pytest.fixture(scope="module", autouse=True)
def report_measured():
    yield
    for key, value in sorted(MEASURED.items()):
        print(f"\n  measured {key}: {value:.3g}", end="")


# ---------------------------------------------------------------- vs transformers
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("seq_len", [1, 16, 17, 49])
def test_logits_match_transformers(name, seq_len):
    dims, _, model, ours = synthetic(name)
    ids = prompt(dims, seq_len, seed=seq_len)
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    logits, _ = ours["float32"].prefill(ids)
    assert logits.shape == (seq_len, dims.vocab) and logits.dtype == np.float32
    err = rel_err_per_position(logits, theirs)
    record(f"rel_err vs transformers ({name})", err.max())
    limit = load().validation.rel_err_vs_transformers
    assert err.max() <= limit, f"position {err.argmax()}: rel err {err.max():.3g} > {limit}"
    # Argmax per position, except where HF's own top-2 gap is below fp32 noise.
    top2 = np.partition(theirs, [-2, -1], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(logits.argmax(-1)[clear], theirs.argmax(-1)[clear])


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_transformers_generate(name):
    """Our prefill + decode path against HF's own KV-cache generation."""
    dims, _, model, ours = synthetic(name)
    ids = prompt(dims, 7, seed=1)
    new = 8
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    mine, gaps = ours["float32"].greedy(ids, new)
    assert len(gaps) == new and min(gaps) >= 0
    assert mine == theirs, (mine, theirs, gaps)


# ---------------------------------------------------------------- self-consistency
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("act_dtype", ref.ACT_DTYPES)
def test_decode_steps_equal_longer_prefill(name, act_dtype):
    """prefill(n) + k decodes == prefill(n + k) at those positions; also chunked prefill
    into a small cache, so the cache grows and the causal offset is exercised."""
    dims, _, _, models = synthetic(name)
    model = models[act_dtype]
    n, k = 13, 6
    ids = prompt(dims, n + k, seed=2)
    full, full_cache = model.prefill(ids)
    _, cache = model.prefill(ids[:n])
    stepped = np.stack([model.decode(t, cache) for t in ids[n:]])
    chunked_cache = model.new_cache(capacity=4)
    chunked = np.concatenate([model.forward(ids[a:b], chunked_cache)
                              for a, b in [(0, 5), (5, 6), (6, n + k)]])
    assert cache.length == chunked_cache.length == full_cache.length == n + k
    assert cache.k[0].dtype == np.dtype(act_dtype) and chunked_cache.k[0].shape[0] >= n + k
    # fp32: summation order only. fp16: a few activations land on the other side of an
    # fp16 rounding boundary and carry one ulp (~5e-4 relative) downstream.
    limit = 1e-5 if act_dtype == "float32" else 5e-3
    for label, got, want in [("decode", stepped, full[n:]), ("chunked", chunked, full)]:
        err = rel_err_per_position(got, want)
        record(f"rel_err {label} vs prefill ({act_dtype})", err.max())
        assert err.max() <= limit, (label, err)
    for layer in range(dims.num_layers):
        kc, kf = cache.past(layer)[0], full_cache.past(layer)[0]
        np.testing.assert_allclose(kc, kf, rtol=limit, atol=limit)


@pytest.mark.parametrize("name", CONFIGS)
def test_fp16_emulation_close_to_fp32(name):
    """Rounding happens (logits differ) but stays small, and greedy choices agree."""
    dims, _, _, models = synthetic(name)
    ids32, gaps32 = models["float32"].greedy(prompt(dims, 9, seed=3), 24)
    seq = prompt(dims, 9, seed=3) + ids32
    l16, _ = models["float16"].prefill(seq)
    l32, _ = models["float32"].prefill(seq)
    err = rel_err_per_position(l16, l32)
    record(f"rel_err fp16 vs fp32 emulation ({name})", err.max())
    assert 1e-5 < err.max() < 2e-2, err
    # Teacher-forced: the next token at every position, near-ties counted apart.
    top2 = np.partition(l32, [-2, -1], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > load().validation.near_tie_logit_gap
    assert clear.mean() > 0.8
    agree = (l16.argmax(-1) == l32.argmax(-1))[clear].mean()
    MEASURED[f"fp16/fp32 argmax agreement, clear positions ({name})"] = agree
    assert agree >= 0.97
    ids16, _ = models["float16"].greedy(prompt(dims, 9, seed=3), 24)
    assert_same_until_near_tie(ids16, ids32, gaps32, min_steps=8)


def test_refuses_wrong_tensors_and_act_dtype():
    dims, packed, _, _ = synthetic("tiny-hd64")
    name = "model.layers.1.mlp.down_proj.scales"
    with pytest.raises(FormatError, match=name):
        ref.ReferenceModel(dims, {k: v for k, v in packed.items() if k != name})
    with pytest.raises(FormatError, match="float16"):
        ref.ReferenceModel(dims, {**packed, name: packed[name].astype(np.float32)})
    with pytest.raises(FormatError, match="extra"):
        ref.ReferenceModel(dims, {**packed, "lm_head.weight": packed["model.embed_tokens.weight"]})
    with pytest.raises(ConfigError, match="act_dtype"):
        ref.ReferenceModel(dims, packed, act_dtype="bfloat16")
    model = synthetic("tiny-hd64")[3]["float32"]
    for bad in ([], [5, dims.vocab], [-1]):
        with pytest.raises(LimitError, match="token ids"):
            model.prefill(bad)


# ---------------------------------------------------------------- building blocks
def fp16_values(rng, shape, std=1.0):
    return (std * rng.standard_normal(shape)).astype(np.float16).astype(np.float32)


def assert_fp16_rounding_of(got, exact, fp32_noise=1e-5):
    """got (fp16 values) == fp16(exact) except where exact sits within float32 noise
    (fp32_noise x the largest |exact|) of a rounding boundary: there, one fp16 ulp apart.
    Checks every element."""
    got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    excess = np.abs(got - exact) - (0.5 * ulp + fp32_noise * np.abs(exact).max())
    assert np.all(excess <= 0), f"{np.sum(excess > 0)} elements off by more than half an fp16 ulp"
    assert np.mean(got == exact.astype(np.float16)) > 0.99


def test_rmsnorm_matches_float64():
    rng = np.random.default_rng(10)
    x, w = fp16_values(rng, (5, 896), 3.0), fp16_values(rng, (896,)) + 1
    xd = x.astype(np.float64)
    exact = xd / np.sqrt(np.mean(xd * xd, axis=-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ref.rmsnorm(x, w, 1e-6, np, ref.keep_fp32), exact, rtol=2e-6, atol=1e-6)
    assert_fp16_rounding_of(ref.rmsnorm(x, w, 1e-6), exact)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_transformers(head_dim):
    dims = load().model("tiny" if head_dim == 128 else "tiny-hd64")
    cfg = transformers.Qwen2Config.from_dict(hf_config("tiny" if head_dim == 128 else "tiny-hd64"))
    positions = np.array([0, 1, 2, 15, 16, 48, 511, 4095, 32767])
    x = torch.zeros(1)
    cos_hf, sin_hf = hf_qwen2.Qwen2RotaryEmbedding(cfg)(x, torch.tensor(positions)[None])
    cos, sin = ref.rope_tables(positions, head_dim, dims.rope_theta)
    assert cos.shape == (len(positions), head_dim // 2) and cos.dtype == np.float32
    # inv_freq: fp32 pow differs between builds by an ulp or two (seen: 2 ulps between this
    # reference and HF with numpy 2.5 / torch 2.11 on the GPU host, 0-1 with numpy 2.4 /
    # torch 2.13 on the CPU), so the angles may differ by pos * 2 ulp(inv_freq):
    # tight at small positions, ~1e-2 at 32767 (the real precision of fp32 RoPE there).
    inv = ref.rope_inv_freq(head_dim, dims.rope_theta)
    np.testing.assert_array_max_ulp(inv, hf_qwen2.Qwen2RotaryEmbedding(cfg).inv_freq.numpy(), maxulp=2)
    atol = 4e-6 + positions[:, None] * 2.0 * np.spacing(inv)[None, :].astype(np.float64)
    for ours, theirs in [(cos, cos_hf[0].numpy()), (sin, sin_hf[0].numpy())]:
        assert np.all(np.abs(np.concatenate([ours, ours], -1) - theirs) <= np.concatenate([atol, atol], -1))
    # Our own construction, exactly: cos/sin (float64) of the fp32 angle fp32(pos) * inv_freq.
    angle = (positions.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)
    np.testing.assert_allclose(cos, np.cos(angle), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angle), rtol=0, atol=1e-6)
    inv64 = 1.0 / dims.rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_array_max_ulp(inv, inv64.astype(np.float32), maxulp=2)
    # apply_rope on [T, heads, d] against HF's apply_rotary_pos_emb ([B, heads, T, d]) fed
    # our tables (full width, as HF's): this checks the rotate_half convention itself.
    rng = np.random.default_rng(11)
    q, k = fp16_values(rng, (len(positions), 7, head_dim)), fp16_values(rng, (len(positions), 1, head_dim))
    full = lambda t: torch.from_numpy(np.concatenate([t, t], -1))[None]  # noqa: E731
    q_hf, k_hf = hf_qwen2.apply_rotary_pos_emb(torch.from_numpy(q).transpose(0, 1)[None],
                                               torch.from_numpy(k).transpose(0, 1)[None], full(cos), full(sin))
    np.testing.assert_allclose(ref.apply_rope(q, cos, sin), q_hf[0].transpose(0, 1).numpy(), atol=1e-5)
    np.testing.assert_allclose(ref.apply_rope(k, cos, sin), k_hf[0].transpose(0, 1).numpy(), atol=1e-5)
    # One head of one position against the float64 formula of the contract.
    c, s, v, half = cos[3].astype(np.float64), sin[3].astype(np.float64), q[3, 2].astype(np.float64), head_dim // 2
    want = np.concatenate([v[:half] * c - v[half:] * s, v[half:] * c + v[:half] * s])
    np.testing.assert_allclose(ref.apply_rope(q[3:4, 2:3], cos[3:4], sin[3:4])[0, 0], want, atol=1e-5)


@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, False), (False, True)])
def test_gemv_int4_ref_matches_float64(with_bias, with_residual):
    rng = np.random.default_rng(12)
    out_f, in_f = 384, 896
    codes, scales = quantize_int4_groupwise(rng.standard_normal((out_f, in_f)).astype(np.float32))
    qweight = pack_int4_value_shuffle(codes)
    x = fp16_values(rng, (in_f,)).astype(np.float16)
    bias = fp16_values(rng, (out_f,)).astype(np.float16) if with_bias else None
    residual = fp16_values(rng, (out_f,), 4.0).astype(np.float16) if with_residual else None
    out = ref.gemv_int4_ref(x, qweight, scales, bias, residual)
    assert out.dtype == np.float16 and out.shape == (out_f,)
    w64 = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), 128, axis=1)
    exact = w64 @ x.astype(np.float64)
    exact += 0 if bias is None else bias.astype(np.float64)
    exact += 0 if residual is None else residual.astype(np.float64)
    assert_fp16_rounding_of(out, exact)


def test_swiglu_matches_float64():
    rng = np.random.default_rng(13)
    gu = fp16_values(rng, (3, 2 * 2432), 3.0)
    g, u = gu[:, :2432].astype(np.float64), gu[:, 2432:].astype(np.float64)
    assert_fp16_rounding_of(ref.swiglu(gu), g / (1 + np.exp(-g)) * u)


def attention_float64(q, k, v):
    """One head at a time, one query at a time: the plainest causal GQA attention."""
    T, heads, d = q.shape
    ctx, kv_heads, _ = k.shape
    out = np.zeros((T, heads, d))
    for t in range(T):
        visible = ctx - T + t + 1
        for h in range(heads):
            kv = h // (heads // kv_heads)
            s = k[:visible, kv].astype(np.float64) @ q[t, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:visible, kv].astype(np.float64)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(7, 1, 128), (14, 2, 64), (28, 4, 128)])
def test_attention_matches_float64(heads, kv_heads, head_dim):
    rng = np.random.default_rng(14)
    T, ctx = 17, 49   # a chunk at the end of a longer context (tail page of 49)
    q = fp16_values(rng, (T, heads, head_dim), 2.0)
    k, v = fp16_values(rng, (ctx, kv_heads, head_dim)), fp16_values(rng, (ctx, kv_heads, head_dim))
    exact = attention_float64(q, k, v)
    np.testing.assert_allclose(ref.attention_prefill(q, k, v, ref.keep_fp32), exact, rtol=1e-5, atol=1e-5)
    assert_fp16_rounding_of(ref.attention_prefill(q, k, v), exact)
    assert_fp16_rounding_of(ref.attention_decode(q[-1], k, v), exact[-1])
    # Decode at the first position sees only itself: out = v of that position.
    np.testing.assert_array_equal(ref.attention_decode(q[0], k[:1], v[:1]),
                                  np.repeat(v[0], heads // kv_heads, axis=0))


# ---------------------------------------------------------------- the same code on CuPy
@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_cupy_matches_numpy(name):
    """xp=cupy runs the same functions: logits match NumPy's up to summation order."""
    cp = pytest.importorskip("cupy")
    if not cuda_build.have_gpu():
        pytest.skip("no CUDA GPU")
    dims, packed, _ = weights(name)
    ids = prompt(dims, 17, seed=4)
    for act_dtype, limit in (("float32", 1e-5), ("float16", 5e-3)):
        cpu = ref.ReferenceModel(dims, packed, act_dtype=act_dtype)
        gpu = ref.ReferenceModel(dims, packed, xp=cp, act_dtype=act_dtype)
        (want, want_cache), (got, got_cache) = cpu.prefill(ids), gpu.prefill(ids)
        assert isinstance(got, cp.ndarray) and got.dtype == cp.float32
        want_step, got_step = cpu.decode(ids[0], want_cache), gpu.decode(ids[0], got_cache)
        for label, g, w in (("prefill", got, want), ("decode", got_step[None], want_step[None])):
            err = rel_err_per_position(cp.asnumpy(g), w)
            record(f"rel_err cupy vs numpy {label} ({act_dtype})", err.max())
            assert err.max() <= limit, (label, act_dtype, err)
        want_ids, want_gaps = cpu.greedy(ids, 8)
        got_ids, _ = gpu.greedy(ids, 8)
        assert_same_until_near_tie(got_ids, want_ids, want_gaps)
    # The GEMV contract on CuPy inputs: within one fp16 ulp of NumPy's, every element.
    rng = np.random.default_rng(15)
    p = layout.layer_prefix(0) + "self_attn.q_proj"
    x = fp16_values(rng, (dims.hidden,)).astype(np.float16)
    bias = packed[p + ".bias"]
    want = ref.gemv_int4_ref(x, packed[p + ".qweight"], packed[p + ".scales"], bias)
    got = ref.gemv_int4_ref(cp.asarray(x), cp.asarray(packed[p + ".qweight"]),
                            cp.asarray(packed[p + ".scales"]), cp.asarray(bias))
    assert isinstance(got, cp.ndarray) and got.dtype == cp.float16
    ulp = np.spacing(np.abs(want)).astype(np.float32)
    assert np.all(np.abs(cp.asnumpy(got).astype(np.float32) - want.astype(np.float32)) <= ulp)


def test_decode_batch_is_decode_side_by_side():
    """ReferenceModel.decode_batch: B sequences of different lengths decoded as one matrix
    give each sequence the logits and the cache rows of its own decode (up to fp32
    summation order, far below fp16 rounding), and greedy_steps_batch the same tokens as
    greedy_steps prompt by prompt (allowing near-ties)."""
    from nanoqwen_lib.model.reference import ReferenceModel, argmax_and_gap
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(packed_synthetic("tiny"))
    ref = ReferenceModel(f.dims, f.model_tensors())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 151643, n).tolist() for n in (1, 7, 16, 17)]
    alone, side = [], []
    for p in prompts:
        alone.append(ref.prefill(p)[1])
        side.append(ref.prefill(p)[1])
    tokens = rng.integers(0, 151643, len(prompts)).tolist()
    want = np.stack([ref.decode(t, c) for t, c in zip(tokens, alone)])
    got = ref.decode_batch(tokens, side)
    rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert (rel < 1e-3).all(), rel
    for c_alone, c_side in zip(alone, side):
        assert c_alone.length == c_side.length
        for layer in (0, f.dims.num_layers - 1):
            for a, b in zip(c_alone.past(layer), c_side.past(layer)):
                assert np.abs(a - b).max() <= 2e-3 * np.abs(a).max()
    near = load().validation.near_tie_logit_gap
    batched = list(ref.greedy_steps_batch(prompts, 6))
    for b, p in enumerate(prompts):
        for i, r in enumerate(ref.greedy_steps(p, 6)):
            mine, gap = argmax_and_gap(r)
            theirs = argmax_and_gap(batched[i][b])[0]
            assert theirs == mine or gap < near, (b, i, gap)
            if theirs != mine:
                break                      # after a near-tie flip the streams may part
