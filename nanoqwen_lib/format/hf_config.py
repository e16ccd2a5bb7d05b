"""A Hugging Face `config.json` read as transformers reads it (its Qwen2Config and
PreTrainedConfig precedence), into the model's dims, or one ConfigError naming the key when
it says something nanoqwen does not compute (RoPE scaling, sliding layers, dual chunk
attention, pre-quantized exports). Beside hf_meta (the checkpoint's tokenizer files and
chat template), the other half of what nanoqwen reads from a checkpoint directory.
"""
from __future__ import annotations

import math

from nanoqwen_lib.config import ModelDims, positive_int, real_in, load
from nanoqwen_lib.errors import ConfigError


# What a Qwen2 config.json may say that nanoqwen does not compute: key -> why (the hint of
# the refusal). Each is refused when present and not null.
REFUSED_KEYS = {
    "quantization_config": "a pre-quantized export (AWQ, GPTQ, FP8, ...); pack the bf16/fp16 checkpoint instead",
    "quantization": "a pre-quantized export (MLX and others); pack the bf16/fp16 checkpoint instead",
    "compression_config": "a compressed-tensors export; pack the bf16/fp16 checkpoint instead",
    "dual_chunk_attention_config": "Dual Chunk Attention (the -1M models) is not implemented",
    "partial_rotary_factor": "partial RoPE is not implemented",
}
HIDDEN_ACTS = ("silu", "swish")      # transformers' ACT2FN maps both to SiLU
# transformers' defaults where config.json is silent (PreTrainedConfig.default_theta,
# Qwen2Config.max_window_layers); nanoqwen reads the same file, so it must fill in the same.
HF_DEFAULT_THETA, HF_DEFAULT_MAX_WINDOW_LAYERS = 10000.0, 28
ROPE_KEYS = ("rope_scaling", "rope_parameters")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _brief(v, n: int = 80) -> str:
    """A found value for a one-line message: its JSON, cut at n characters."""
    import json
    try:
        text = json.dumps(v, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


def rope_theta_of(cfg: dict, source="config.json") -> float:
    """RoPE's base as transformers reads it: the RoPE dict is `rope_scaling or
    rope_parameters` (a legacy `rope_scaling` wins); its `rope_type` (or legacy `type`)
    must be "default" (plain RoPE: yarn, linear, dynamic, longrope, llama3, mrope are
    refused); its own `rope_theta` wins over the top-level one, which wins over 10000."""
    for key in ROPE_KEYS:
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(source, key, "an object or null", _brief(cfg[key]))
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(key) or {}
    if set(rope) & set(LAYER_TYPES):
        raise ConfigError(source, key, "one RoPE for every layer", f"RoPE per layer type {sorted(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = f"{key}.rope_type" if "rope_type" in rope else f"{key}.type"
        raise ConfigError(source, field, "'default' (plain RoPE)", repr(rope_type),
                          "RoPE scaling is not implemented")
    if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ConfigError(source, f"{key}.partial_rotary_factor", "absent or 1.0",
                          _brief(rope["partial_rotary_factor"]), "partial RoPE is not implemented")
    if rope.get("mrope_section") is not None or cfg.get("use_mrope"):
        raise ConfigError(source, f"{key}.mrope_section" if rope.get("mrope_section") else "use_mrope",
                          "absent (1-D RoPE)", "multimodal RoPE", "a vision-language model?")
    if "rope_theta" in rope:
        theta, field = rope["rope_theta"], f"{key}.rope_theta"
    else:
        theta, field = cfg.get("rope_theta", HF_DEFAULT_THETA), "rope_theta"
    return real_in(theta, source, field, 0.0, math.inf)


def check_full_attention(cfg: dict, num_layers: int, source="config.json") -> None:
    """Every layer attends to the whole context, as transformers decides it: explicit
    `layer_types` (transformers 5) or, absent, sliding layers from `max_window_layers` on
    when `use_sliding_window` is true and `sliding_window` is set."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(source, "layer_types", f"a list of {num_layers} layer types", _brief(types))
        for i, t in enumerate(types):
            if t != "full_attention":
                raise ConfigError(source, f"layer_types[{i}]", "'full_attention'", repr(t),
                                  "sliding-window attention is not implemented")
        return
    if not isinstance(cfg.get("use_sliding_window", False), bool):
        raise ConfigError(source, "use_sliding_window", "true or false", _brief(cfg["use_sliding_window"]))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        first = cfg.get("max_window_layers", HF_DEFAULT_MAX_WINDOW_LAYERS)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ConfigError(source, "max_window_layers", "an integer", _brief(first))
        if first < num_layers:
            raise ConfigError(source, "use_sliding_window", "false (or no layer from max_window_layers on)",
                              f"true, sliding layers {max(first, 0)}..{num_layers - 1}",
                              "sliding-window attention is not implemented")


def to_hf_config(dims: ModelDims) -> dict:
    """config.json fields of a Qwen2ForCausalLM with these dims (what the synthetic checkpoints write)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "max_position_embeddings": dims.max_position,
        "max_window_layers": dims.num_layers,
        "rope_theta": dims.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": dims.rms_eps,
        "tie_word_embeddings": dims.tie_embeddings,
        "use_sliding_window": False,
        "sliding_window": dims.max_position,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }



def dims_from_hf_config(cfg: dict, source="config.json") -> ModelDims:
    """A Hugging Face config.json -> the dims transformers would compute from it, or one
    ConfigError naming the key, when it says something nanoqwen does not compute.

    Read with transformers' precedence (its Qwen2Config and PreTrainedConfig): RoPE from
    `rope_scaling`, else `rope_parameters` (what transformers 5 writes), its own
    `rope_theta` first, then the top-level `rope_theta`, then 10000; `num_key_value_heads:
    null` means one KV head per query head; `head_dim` absent means hidden / heads."""
    sup = load().supported

    def need(key):
        if key not in cfg:
            raise ConfigError(source, key, "a value", "nothing (field missing)")
        return cfg[key]

    archs = need("architectures")
    if not isinstance(archs, list) or archs[:1] != list(sup.architectures):
        raise ConfigError(source, "architectures", sup.architectures, archs)
    if need("model_type") != sup.model_type:
        raise ConfigError(source, "model_type", repr(sup.model_type), repr(cfg["model_type"]))
    for key in REFUSED_KEYS:
        if cfg.get(key) is not None:
            raise ConfigError(source, key, "absent or null", _brief(cfg[key]), REFUSED_KEYS[key])
    act = cfg.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ConfigError(source, "hidden_act", " or ".join(map(repr, HIDDEN_ACTS)) + " (SiLU)", repr(act))
    ints = {key: positive_int(need(key), source, key)
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "vocab_size")}
    hidden, heads, layers = ints["hidden_size"], ints["num_attention_heads"], ints["num_hidden_layers"]
    kv = need("num_key_value_heads")
    kv = heads if kv is None else positive_int(kv, source, "num_key_value_heads")
    if hidden % heads:
        raise ConfigError(source, "num_attention_heads", f"a divisor of hidden_size {hidden}", heads)
    head_dim = cfg.get("head_dim", hidden // heads)
    head_dim = positive_int(head_dim, source, "head_dim")
    if head_dim * heads != hidden:
        raise ConfigError(source, "head_dim", f"hidden_size / num_attention_heads = {hidden // heads}", head_dim)
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ConfigError(source, "tie_word_embeddings", "true or false", repr(tied))
    check_full_attention(cfg, layers, source)
    dims = ModelDims(
        num_layers=layers, hidden=hidden,
        intermediate=ints["intermediate_size"], num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, vocab=ints["vocab_size"],
        max_position=positive_int(cfg.get("max_position_embeddings", 32768), source, "max_position_embeddings"),
        rope_theta=rope_theta_of(cfg, source),
        rms_eps=real_in(cfg.get("rms_norm_eps", 1e-6), source, "rms_norm_eps", 0.0, 1.0),
        tie_embeddings=tied,
    )
    dims.check_supported(source)
    return dims
