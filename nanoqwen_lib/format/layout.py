"""Which tensors a model has, by name, dtype and shape: the one list every piece agrees on.

Names follow Hugging Face's Qwen2 checkpoints. The seven projections of each layer become
two tensors in a .nanoqwen file, by the file's weight encoding (its header's layout_id):

    int4 (layout 1, the default)  `<proj>.qweight` uint32 [out, in/8] (ValueShuffle INT4),
                                  `<proj>.scales` fp16 [out, in/group]
    fp8  (layout 2)               `<proj>.qweight` uint8 [out, in] (E4M3 codes, `in`
                                  contiguous: the K-major operand order of the FP8 MMA),
                                  `<proj>.scales` fp32 [out] (one per output row)

That is the "split" storage, codes and scales in two tensors. INT4 may instead be stored
as one stream per projection (layout 3, the "stream" storage, format/stream_layout.py):

    int4 (layout 3)               `<proj>.stream` uint8 [stream_bytes(out, in)]: layout 1's
                                  words and scales re-tiled into 1056-byte blocks

The weight encoding stays "int4": a layout-3 file reads back as layout 1
(NanoqwenFile.model_tensors), so `packed_tensors(dims, "int4")` is what every consumer of
a file's model tensors sees, whatever its storage.

Everything else stays FP16 under its HF name. `fp16` (the projections unquantized, under
their HF names) exists for the reference model only, never in a file.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.format.stream_layout import stream_bytes

FP16 = np.dtype("<f2")
FP32 = np.dtype("<f4")
UINT32 = np.dtype("<u4")
UINT8 = np.dtype("u1")
# Weight encodings a .nanoqwen file may carry: name -> the header layout_id of its split storage.
ENCODINGS = {"int4": load().format.layout_id, "fp8": load().format.fp8_layout_id}
# How a file stores its projections: "split" (`.qweight` + `.scales`) or "stream" (one
# `.stream` in layout 3, INT4 only).
STORAGES = ("split", "stream")
STREAM_LAYOUT_ID = load().format.stream_layout_id
# Every header layout_id a file may carry -> (weight encoding, storage).
LAYOUTS = {**{i: (e, "split") for e, i in ENCODINGS.items()}, STREAM_LAYOUT_ID: ("int4", "stream")}
ENCODING_OF_LAYOUT = {i: e for i, (e, _) in LAYOUTS.items()}


def layout_id_of(encoding: str, storage: str = "split") -> int:
    """The header layout_id of a weight encoding in a storage (ValueError if there is none)."""
    for i, spec in LAYOUTS.items():
        if spec == (encoding, storage):
            return i
    raise ValueError(f"weight encoding {encoding!r} in storage {storage!r}: one of "
                     f"{sorted(LAYOUTS.values())}")


def layout_name(layout_id: int) -> str:
    """A layout id in words, e.g. "3 (int4, stream)"."""
    encoding, storage = LAYOUTS[layout_id]
    return f"{layout_id} ({encoding}, {storage})"


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def hf_tensors(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Qwen2ForCausalLM checkpoint: name -> shape."""
    t = {"model.embed_tokens.weight": (dims.vocab, dims.hidden)}
    for i in range(dims.num_layers):
        p = layer_prefix(i)
        t[p + "input_layernorm.weight"] = (dims.hidden,)
        t[p + "post_attention_layernorm.weight"] = (dims.hidden,)
        for proj, (out_f, in_f) in dims.projections().items():
            t[p + proj + ".weight"] = (out_f, in_f)
        t[p + "self_attn.q_proj.bias"] = (dims.q_dim,)
        t[p + "self_attn.k_proj.bias"] = (dims.kv_dim,)
        t[p + "self_attn.v_proj.bias"] = (dims.kv_dim,)
    t["model.norm.weight"] = (dims.hidden,)
    if not dims.tie_embeddings:
        t["lm_head.weight"] = (dims.vocab, dims.hidden)
    return t


def is_quantized(hf_name: str) -> bool:
    """True for the weight of one of the seven INT4 projections."""
    return hf_name.endswith("_proj.weight")


def projection_tensors(encoding: str, n: int, k: int,
                       storage: str = "split") -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The tensors that store one [n, k] projection in a weight encoding and storage:
    suffix -> (dtype, shape). The one statement of each encoding's storage: the file, the
    arena and every byte count derive from it."""
    if storage == "stream":
        if encoding != "int4":
            raise ValueError(f"storage 'stream' (layout {STREAM_LAYOUT_ID}) holds int4 weights, not {encoding!r}")
        return {"stream": (UINT8, (stream_bytes(n, k),))}
    if storage != "split":
        raise ValueError(f"storage {storage!r}: one of {STORAGES}")
    if encoding == "int4":
        return {"qweight": (UINT32, (n, k // 8)), "scales": (FP16, (n, k // load().format.group_size))}
    if encoding == "fp8":
        return {"qweight": (UINT8, (n, k)), "scales": (FP32, (n,))}
    raise ValueError(f"weight encoding {encoding!r}: one of {sorted(ENCODINGS)}")


def projection_bytes(encoding: str, n: int, k: int) -> int:
    """Bytes of one [n, k] projection in a weight encoding (codes and scales)."""
    return sum(int(np.prod(shape)) * dt.itemsize for dt, shape in projection_tensors(encoding, n, k).values())


def packed_tensors(dims: ModelDims, encoding: str = "int4",
                   storage: str = "split") -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every tensor of a .nanoqwen file with this weight encoding and storage, in file
    order: name -> (dtype, shape)."""
    if encoding not in (*ENCODINGS, "fp16"):
        raise ValueError(f"weight encoding {encoding!r}: one of {sorted(ENCODINGS)} (or fp16, unquantized)")
    out: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for name, shape in hf_tensors(dims).items():
        if is_quantized(name) and encoding != "fp16":
            base = name[: -len(".weight")]
            for suffix, spec in projection_tensors(encoding, *shape, storage).items():
                out[f"{base}.{suffix}"] = spec
        else:
            out[name] = (FP16, shape)
    return out


def encoding_of(tensors) -> str:
    """The weight encoding of a tensor mapping (a file's, or HF names for fp16), from the
    first projection it holds."""
    name = layer_prefix(0) + "self_attn.q_proj."
    if name + "weight" in tensors:
        return "fp16"
    qweight = tensors.get(name + "qweight") if hasattr(tensors, "get") else None
    if qweight is None:
        return "int4"                       # check_tensors then names what is missing
    return "fp8" if np.dtype(qweight.dtype) == UINT8 else "int4"


def packed_tensor_count(dims: ModelDims, storage: str = "split") -> int:
    """len(packed_tensors(dims, ..., storage)), by arithmetic (a hostile header's num_layers
    must not make the reader build a list of billions of names): embed, final norm, lm_head
    when untied, and per layer 2 norms + 3 biases + 7 projections x (qweight, scales), or x
    (stream) in the stream storage."""
    per_projection = 1 if storage == "stream" else 2
    return 2 + (0 if dims.tie_embeddings else 1) + dims.num_layers * (2 + 3 + per_projection * len(dims.projections()))


def stream_sources(dims: ModelDims) -> dict[str, tuple[str, int, int]]:
    """The stream storage's projections: `<proj>.stream` -> (`<proj>`, N, K), in file order."""
    out = {}
    for name, shape in hf_tensors(dims).items():
        if is_quantized(name):
            base = name[: -len(".weight")]
            out[base + ".stream"] = (base, *shape)
    return out


def bytes_per_decode_token(dims: ModelDims, context_tokens: int = 0, encoding: str = "int4") -> dict[str, int]:
    """What one decode token must read from device memory, by kind (batch 1). The key
    "int4_weights" holds the projections' codes whatever the encoding (FP8: a byte each)."""
    kvb = load().kv_cache.dtype_bytes
    codes = scales = 0
    for out_f, in_f in dims.projections().values():
        t = projection_tensors(encoding, out_f, in_f)
        codes += int(np.prod(t["qweight"][1])) * t["qweight"][0].itemsize * dims.num_layers
        scales += int(np.prod(t["scales"][1])) * t["scales"][0].itemsize * dims.num_layers
    small = dims.num_layers * (2 * dims.hidden + dims.qkv_dim) * 2 + dims.hidden * 2
    return {
        "int4_weights": codes,
        "scales": scales,
        "lm_head_fp16": dims.vocab * dims.hidden * 2,
        "embedding_row": dims.hidden * 2,
        "norms_and_biases": small,
        "kv_cache": 2 * dims.num_layers * dims.kv_dim * kvb * context_tokens,
    }


def decode_gemv_shapes(dims: ModelDims) -> dict[str, tuple[int, int]]:
    """The four matrices of a layer as the engine stores and launches them: name -> (N, K).
    q/k/v are stacked into one qkv matrix and gate/up into one gate_up matrix."""
    h, i = dims.hidden, dims.intermediate
    return {"qkv": (dims.qkv_dim, h), "o_proj": (h, dims.q_dim), "gate_up": (2 * i, h), "down": (h, i)}


def prefill_flops(dims: ModelDims, tokens: int) -> dict[str, int]:
    """FLOPs of a `tokens`-token prefill: every projection for every row (2 per weight),
    causal attention (QK^T and PV over the triangle, per layer and head), lm_head for the
    last row only (only its logits choose the first token)."""
    proj = sum(n * k for n, k in dims.projections().values()) * dims.num_layers
    attn = dims.num_layers * dims.num_heads * 2 * 2 * dims.head_dim * tokens * (tokens + 1) // 2
    return {"projections": 2 * proj * tokens, "attention": attn, "lm_head (last row)": 2 * dims.vocab * dims.hidden}
