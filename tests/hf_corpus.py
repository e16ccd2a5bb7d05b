"""The config.json corpus: what real Qwen2-family checkpoints say, and what nanoqwen does with it.

Three sources of cases, each a (name, config dict, expected outcome):

* real files under tests/data/hf_configs/ (index.json gives each one's origin);
* derived cases: a real file with one documented edit (Qwen's own YaRN recipe, a
  quantizer's `quantization_config`, a legacy `rope_scaling` of type "default", ...);
* transformers' own saves: `Qwen2Config(...).save_pretrained` of the installed
  transformers, with every variation nanoqwen must read or refuse.

An outcome is "computed" (hf_config.dims_from_hf_config accepts it and agrees with
`transformers.Qwen2Config.from_dict` on every value that changes the math) or the config
key its one-line refusal names. tests/test_hf_configs.py checks every case; chapter 1
prints the table (`corpus_table`).
"""
from __future__ import annotations

import copy
import functools
import json
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from nanoqwen_lib.config import ModelDims
from nanoqwen_lib.format.hf_config import dims_from_hf_config
from nanoqwen_lib.errors import ConfigError

DATA = Path(__file__).resolve().parent / "data" / "hf_configs"
COMPUTED = "computed"
# ModelDims field -> how transformers' Qwen2Config says it (the values that change the math).
MATH = {
    "num_layers": lambda c: c.num_hidden_layers,
    "hidden": lambda c: c.hidden_size,
    "intermediate": lambda c: c.intermediate_size,
    "num_heads": lambda c: c.num_attention_heads,
    "num_kv_heads": lambda c: c.num_key_value_heads,
    "head_dim": lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    "vocab": lambda c: c.vocab_size,
    "max_position": lambda c: c.max_position_embeddings,
    "rope_theta": lambda c: c.rope_parameters["rope_theta"],
    "rms_eps": lambda c: c.rms_norm_eps,
    "tie_embeddings": lambda c: c.tie_word_embeddings,
}


@dataclass(frozen=True)
class ConfigCase:
    name: str
    source: str          # "real", "derived" or "transformers"
    config: dict
    expect: str          # COMPUTED or the key the refusal names
    origin: str


def real_cases() -> list[ConfigCase]:
    index = json.loads((DATA / "index.json").read_text())["files"]
    return [ConfigCase(name[: -len(".json")], "real", json.loads((DATA / name).read_text()), meta["expect"],
                       meta["origin"]) for name, meta in index.items()]


def _edit(base: str, note: str, expect: str, fn) -> ConfigCase:
    cfg = copy.deepcopy(json.loads((DATA / f"{base}.json").read_text()))
    fn(cfg)
    return ConfigCase(f"{base}+{note}", "derived", cfg, expect, f"{base}.json with {note}")


def derived_cases() -> list[ConfigCase]:
    awq = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq",
           "version": "gemm", "zero_point": True}
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    layers21 = ["full_attention"] * 21 + ["sliding_attention"] * 7
    return [
        _edit("qwen2.5-7b-instruct", "yarn", "rope_scaling.type",   # the model card's long-context recipe
              lambda c: c.update(rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768,
                                               "type": "yarn"})),
        _edit("qwen2.5-7b-instruct", "legacy-rope-default", COMPUTED,
              lambda c: c.update(rope_scaling={"type": "default"})),
        _edit("qwen2.5-7b-instruct", "awq", "quantization_config", lambda c: c.update(quantization_config=awq)),
        _edit("qwen2.5-7b-instruct", "fp8", "quantization_config", lambda c: c.update(quantization_config=fp8)),
        _edit("qwen2.5-7b-instruct", "mlx-quantization", "quantization",
              lambda c: c.update(quantization={"group_size": 64, "bits": 4})),
        _edit("qwen2.5-7b-instruct", "compression", "compression_config",
              lambda c: c.update(compression_config={"quant_method": "compressed-tensors",
                                                     "format": "pack-quantized"})),
        _edit("qwen2.5-7b-instruct", "swish", COMPUTED, lambda c: c.update(hidden_act="swish")),
        _edit("qwen2.5-7b-instruct-1m", "dca", "dual_chunk_attention_config",
              lambda c: c.update(dual_chunk_attention_config={"chunk_size": 262144, "local_size": 8192,
                                                              "original_max_position_embeddings": 262144})),
        _edit("qwen2.5-1.5b-instruct-tf5", "yarn", "rope_parameters.rope_type",
              lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                  "original_max_position_embeddings": 32768})),
        _edit("qwen2.5-1.5b-instruct-tf5", "theta-in-both", COMPUTED,   # rope_parameters' own wins
              lambda c: c.update(rope_theta=10000.0)),
        _edit("qwen2.5-1.5b-instruct-tf5", "sliding-layer-types", "layer_types[21]",
              lambda c: c.update(layer_types=layers21)),
        _edit("qwen2.5-1.5b-instruct-tf5", "use-sliding-window", "use_sliding_window",
              lambda c: (c.pop("layer_types"), c.update(use_sliding_window=True, sliding_window=32768))),
        _edit("qwen2.5-3b-instruct", "use-sliding-window", COMPUTED,   # max_window_layers 70 >= 36 layers: none slide
              lambda c: c.update(use_sliding_window=True)),
        _edit("qwen2.5-7b-instruct", "no-rope-theta", COMPUTED,      # both fall back to 10000
              lambda c: c.pop("rope_theta")),
        _edit("qwen2.5-1.5b-instruct-tf5", "sliding-no-max-window", COMPUTED,
              lambda c: (c.pop("layer_types"), c.pop("max_window_layers"),   # default 28 = all 28 layers full
                         c.update(use_sliding_window=True, sliding_window=32768))),
        _edit("qwen2-0.5b", "kv-heads-null", "num_attention_heads / num_key_value_heads",   # = 14 heads: GQA 1
              lambda c: c.update(num_key_value_heads=None)),
    ]


# transformers' own saves: Qwen2Config keyword arguments on top of a small base.
BASE = dict(architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=2432, num_hidden_layers=2, num_attention_heads=7,
            num_key_value_heads=1, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6)
HD64 = dict(num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
SAVES = {
    "theta-1e6": (dict(rope_theta=1e6), COMPUTED),
    "theta-1e4": (dict(rope_theta=1e4), COMPUTED),
    "head-dim-64-tied": (dict(HD64, rope_theta=1e6), COMPUTED),
    "swish": (dict(hidden_act="swish", rope_theta=1e6), COMPUTED),
    "yarn": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 8192}), "rope_parameters.rope_type"),
    "linear": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
               "rope_parameters.rope_type"),
    "dynamic": (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
                "rope_parameters.rope_type"),
    "dual-chunk": (dict(rope_theta=1e7, dual_chunk_attention_config={"chunk_size": 262144, "local_size": 8192}),
                   "dual_chunk_attention_config"),
    "sliding-window": (dict(use_sliding_window=True, sliding_window=4096, max_window_layers=1), "layer_types[1]"),
    "sliding-layer-types": (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types[1]"),
    "quantization-config": (dict(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128}),
                            "quantization_config"),
    "kv-heads-null": (dict(num_key_value_heads=None), "num_attention_heads / num_key_value_heads"),
}


def _transformers():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import transformers
    return transformers


def save_pretrained_config(**kwargs) -> dict:
    """The config.json the installed transformers writes for Qwen2Config(**kwargs)."""
    transformers = _transformers()
    with tempfile.TemporaryDirectory() as d:
        transformers.Qwen2Config(**kwargs).save_pretrained(d)
        return json.loads((Path(d) / "config.json").read_text())


def transformers_config_of(dims: ModelDims) -> dict:
    """The config.json transformers itself writes for a Qwen2 of these dims (never
    to_hf_config(dims): an oracle built from this cannot inherit a mistake of ours)."""
    return save_pretrained_config(
        architectures=["Qwen2ForCausalLM"], hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_hidden_layers=dims.num_layers, num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
        head_dim=dims.head_dim, vocab_size=dims.vocab, max_position_embeddings=dims.max_position,
        rope_theta=dims.rope_theta, rms_norm_eps=dims.rms_eps, tie_word_embeddings=dims.tie_embeddings)


@functools.lru_cache(maxsize=1)
def transformers_cases() -> tuple[ConfigCase, ...]:
    version = _transformers().__version__
    return tuple(ConfigCase(f"save_pretrained:{name}", "transformers", save_pretrained_config(**{**BASE, **kw}), expect,
                            f"Qwen2Config(...).save_pretrained, transformers {version}")
                 for name, (kw, expect) in SAVES.items())


def all_cases() -> list[ConfigCase]:
    return real_cases() + derived_cases() + list(transformers_cases())


def nanoqwen_reading(case: ConfigCase) -> ModelDims | ConfigError:
    """dims_from_hf_config on the case (its own copy), or the refusal it raises."""
    try:
        return dims_from_hf_config(copy.deepcopy(case.config), source=f"{case.name}/config.json")
    except ConfigError as e:
        return e


def transformers_reading(case: ConfigCase) -> tuple[dict, list[str]]:
    """(the math values of transformers.Qwen2Config.from_dict, what its model would compute
    that plain Qwen2 does not: scaled RoPE, sliding layers, quantized weights, not SiLU)."""
    transformers = _transformers()
    from transformers.activations import ACT2FN
    cfg = transformers.Qwen2Config.from_dict(copy.deepcopy(case.config))
    values = {field: get(cfg) for field, get in MATH.items()}
    extra = []
    if cfg.rope_parameters.get("rope_type", "default") != "default":
        extra.append(f"RoPE {cfg.rope_parameters['rope_type']}")
    if any(t != "full_attention" for t in cfg.layer_types):
        extra.append("sliding-window layers")
    for key in ("quantization_config", "quantization", "compression_config"):
        if getattr(cfg, key, None) is not None:
            extra.append(f"{key} (quantized weights)")
    if type(ACT2FN[cfg.hidden_act]).__name__ not in ("SiLU", "SiLUActivation"):
        extra.append(f"activation {cfg.hidden_act}")
    return values, extra


def corpus_table() -> list[tuple[str, str, str, str]]:
    """(case, source, what nanoqwen does, detail) for every case, in corpus order."""
    rows = []
    for case in all_cases():
        got = nanoqwen_reading(case)
        if isinstance(got, ConfigError):
            rows.append((case.name, case.source, f"refused: {got.field}", f"found {got.found}"))
        else:
            rows.append((case.name, case.source, COMPUTED,
                         f"theta {got.rope_theta:g}, head_dim {got.head_dim}, "
                         f"{'tied' if got.tie_embeddings else 'untied'}, {got.num_layers} layers"))
    return rows
