"""The one config: nanoqwen.yaml read once into frozen dataclasses.

Everything else (packer, reader, reference, kernels, benchmark) takes its constants from
here. `cuda_defines` turns them into the -D options every kernel is compiled with.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from nanoqwen_lib.errors import ConfigError

CONFIG_PATH = Path(__file__).with_name("nanoqwen.yaml")


U32_MAX = 2**32 - 1   # every integer dim is stored as a u32 in the .nanoqwen header


def positive_int(v, source, field) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= U32_MAX:
        raise ConfigError(source, field, f"an integer in [1, {U32_MAX}]", repr(v))
    return v


def real_in(v, source, field, lo: float, hi: float) -> float:
    """A finite number in the open interval (lo, hi)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo < v < hi:
        raise ConfigError(source, field, f"a finite number in ({lo:g}, {hi:g})", repr(v))
    return float(v)


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    max_position: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def projections(self) -> dict[str, tuple[int, int]]:
        """The seven quantized projections of a layer: HF name -> (out_features, in_features)."""
        h, i = self.hidden, self.intermediate
        return {
            "self_attn.q_proj": (self.q_dim, h),
            "self_attn.k_proj": (self.kv_dim, h),
            "self_attn.v_proj": (self.kv_dim, h),
            "self_attn.o_proj": (h, self.q_dim),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }

    def check_supported(self, source="config") -> None:
        sup = load().supported
        for name in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim",
                     "vocab", "max_position"):
            positive_int(getattr(self, name), source, name)
        real_in(self.rope_theta, source, "rope_theta", 0.0, math.inf)
        real_in(self.rms_eps, source, "rms_eps", 0.0, 1.0)
        if self.head_dim not in sup.head_dims:
            raise ConfigError(source, "head_dim", f"one of {list(sup.head_dims)}", self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(source, "num_key_value_heads",
                              f"a divisor of num_attention_heads {self.num_heads}", self.num_kv_heads)
        if not sup.gqa_ratio_min <= self.gqa_ratio <= sup.gqa_ratio_max:
            raise ConfigError(source, "num_attention_heads / num_key_value_heads",
                              f"a GQA ratio from {sup.gqa_ratio_min} to {sup.gqa_ratio_max}",
                              f"{self.num_heads}/{self.num_kv_heads}")
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v % sup.dim_multiple:
                field = {"hidden": "hidden_size", "intermediate": "intermediate_size"}[name]
                raise ConfigError(source, field, f"a multiple of {sup.dim_multiple}", v)


@dataclass(frozen=True)
class Supported:
    architectures: tuple[str, ...]
    model_type: str
    hidden_act: str
    head_dims: tuple[int, ...]
    gqa_ratio_min: int
    gqa_ratio_max: int
    dim_multiple: int


@dataclass(frozen=True)
class FormatSpec:
    magic: str
    version: int
    layout_id: int
    fp8_layout_id: int
    stream_layout_id: int
    fp8_max: float
    group_size: int
    alignment: int
    header_bytes: int
    dir_entry_bytes: int
    dir_name_bytes: int
    int4_qmax: int
    value_shuffle: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheSpec:
    page_tokens: int
    dtype_bytes: int
    attention_stages: int

    def head_slice_bytes(self, head_dim: int) -> int:
        """One KV head's K (or V) for one page: page_tokens x head_dim FP16."""
        return self.page_tokens * head_dim * self.dtype_bytes


@dataclass(frozen=True)
class EngineSpec:
    prefill_chunk_tokens: int    # prompt tokens per tensor-core prefill pass (activation buffers)
    prefill_gemm: dict           # weight encoding -> the prefill projections' GEMM: "wgmma" (sm_90a) or "mma"
    decode: dict                 # weight encoding -> the decode step: "persistent" (one kernel) or "graph"
    persistent: dict             # the persistent step's planning figures (persistent_plan)
    prefill_graphs: int          # prompt-chunk shapes whose prefill is kept as a CUDA graph (0: always eager)


@dataclass(frozen=True)
class BenchProtocol:
    batch: int
    prompt_tokens: int
    gen_tokens: int
    warmup: int
    lock_clocks: bool
    read_ceiling_tbps: float
    compute_ceiling_tflops: float


@dataclass(frozen=True)
class ValidationSpec:
    rel_err_vs_transformers: float
    graph_prompts: int
    graph_gen_tokens: int
    token_match_min: float
    near_tie_logit_gap: float
    logit_err_max: float
    peer_prompts: int
    peer_gen_tokens: int
    peer_noise_max: float


@dataclass(frozen=True)
class TokenizerSpec:
    bpe_tokens: int
    pattern: str
    normalization: str
    bos_id: int
    pad_id: int
    eos_ids: tuple[int, ...]
    default_system: str
    model_max_length: int
    special_tokens: dict  # id -> content (a plain dict inside a frozen dataclass: never mutated)


@dataclass(frozen=True)
class TuningEntry:
    """One kernel file's compile-time knobs (nanoqwen.yaml `tuning:`)."""
    module: str               # kernels/<module>.cu
    defines: dict             # NQ_NAME -> int, passed as -D to every build
    measured_at: str          # the commit of the GPU run that chose them, or "unmeasured"
    fallback: dict            # NQ_NAME -> int over `defines` for shapes `shapes` does not name
    shapes: tuple             # of GemvShape


@dataclass(frozen=True)
class GemvShape:
    """A per-shape entry of a GEMV's tuning table."""
    launcher: str
    n: str                    # a ModelDims field, or 2*field
    k: str
    ksplit: int
    defines: dict
    measured_at: str
    us: float

    def size(self, dims: "ModelDims") -> tuple[int, int]:
        return _dim_expr(dims, self.n), _dim_expr(dims, self.k)


def _dim_expr(dims: "ModelDims", expr: str) -> int:
    factor, _, name = expr.rpartition("*")
    return (int(factor) if factor else 1) * getattr(dims, name)


def _knobs(raw, source: str) -> dict:
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k.startswith("NQ_") and type(v) is int
                                            for k, v in raw.items()):
        raise ConfigError(CONFIG_PATH, source, "a mapping of NQ_* names to integers", repr(raw))
    return dict(raw)


def _tuning(raw: dict) -> dict:
    """module -> TuningEntry, every field checked (a knob is an NQ_* name with an int value)."""
    out = {}
    for module, entry in raw.items():
        src = f"tuning.{module}"
        if not isinstance(entry, dict) or not {"defines", "measured_at"} <= set(entry) \
                or set(entry) - {"defines", "measured_at", "fallback", "shapes"}:
            raise ConfigError(CONFIG_PATH, src, "defines, measured_at (and optional fallback, shapes)",
                              repr(sorted(entry) if isinstance(entry, dict) else entry))
        fb = entry.get("fallback", {"defines": {}, "measured_at": entry["measured_at"]})
        shapes = []
        for i, s in enumerate(entry.get("shapes", [])):
            need = {"launcher", "n", "k", "ksplit", "defines", "measured_at", "us"}
            if set(s) != need:
                raise ConfigError(CONFIG_PATH, f"{src}.shapes[{i}]", f"fields {sorted(need)}", repr(sorted(s)))
            for f in ("n", "k"):
                name = s[f].rpartition("*")[2]
                if name not in ModelDims.__dataclass_fields__ and not hasattr(ModelDims, name):
                    raise ConfigError(CONFIG_PATH, f"{src}.shapes[{i}].{f}", "a ModelDims field or 2*field",
                                      repr(s[f]))
            shapes.append(GemvShape(s["launcher"], s["n"], s["k"], positive_int(s["ksplit"], CONFIG_PATH,
                                    f"{src}.shapes[{i}].ksplit"), _knobs(s["defines"], f"{src}.shapes[{i}].defines"),
                                    str(s["measured_at"]), float(s["us"])))
        out[module] = TuningEntry(module, _knobs(entry["defines"], f"{src}.defines"), str(entry["measured_at"]),
                                  _knobs(fb["defines"], f"{src}.fallback.defines"), tuple(shapes))
    names = [k for e in out.values() for k in e.defines]
    if len(names) != len(set(names)):
        raise ConfigError(CONFIG_PATH, "tuning", "each NQ_* knob in one module's defines",
                          sorted({k for k in names if names.count(k) > 1}))
    return out


def _geometry(raw: dict, tuning: dict) -> dict:
    """module -> {NQ_NAME: int}: the kernel geometry (each name once, none also a tuning knob)."""
    out = {module: _knobs(g, f"geometry.{module}") for module, g in raw.items()}
    names = [k for g in out.values() for k in g] + [k for e in tuning.values() for k in e.get("defines", {})]
    if len(names) != len(set(names)):
        raise ConfigError(CONFIG_PATH, "geometry", "each NQ_* name once across geometry and tuning",
                          sorted({k for k in names if names.count(k) > 1}))
    return out


@dataclass(frozen=True)
class Config:
    models: dict  # name -> ModelDims (a plain dict inside a frozen dataclass: never mutated)
    supported: Supported
    format: FormatSpec
    kv_cache: KVCacheSpec
    engine: EngineSpec
    benchmark: BenchProtocol
    validation: ValidationSpec
    tokenizer: TokenizerSpec
    tuning: dict  # kernel module -> TuningEntry (a plain dict inside a frozen dataclass: never mutated)
    hardware: dict  # the design target (gpu.hardware.design_target), a plain dict likewise
    geometry: dict  # kernel module -> {NQ_NAME: int} (the same)

    def model(self, name: str) -> ModelDims:
        if name not in self.models:
            raise ConfigError(CONFIG_PATH, "models", f"one of {sorted(self.models)}", repr(name))
        return self.models[name]


def _build(cls, raw: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(raw) - set(fields)
    missing = set(fields) - set(raw)
    if extra or missing:
        raise ConfigError(CONFIG_PATH, cls.__name__, f"fields {sorted(fields)}",
                          f"extra {sorted(extra)}, missing {sorted(missing)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


HARDWARE_FIELDS = {"name": str, "sms": int, "smem_optin": int, "smem_per_sm": int, "regs_per_sm": int,
                   "clock_khz": int, "read_tbps": float, "read_efficiency": float}


def _hardware(raw: dict) -> dict:
    if set(raw) != set(HARDWARE_FIELDS):
        raise ConfigError(CONFIG_PATH, "hardware", f"fields {sorted(HARDWARE_FIELDS)}", sorted(raw))
    for k, t in HARDWARE_FIELDS.items():
        if not isinstance(raw[k], t) or (t is not str and raw[k] <= 0):
            raise ConfigError(CONFIG_PATH, f"hardware.{k}", f"a positive {t.__name__}", repr(raw[k]))
    return dict(raw)


@functools.lru_cache(maxsize=1)
def load() -> Config:
    """Read nanoqwen.yaml once."""
    raw = yaml.safe_load(CONFIG_PATH.read_text())
    return Config(
        models={name: _build(ModelDims, m) for name, m in raw["models"].items()},
        supported=_build(Supported, raw["supported"]),
        format=_build(FormatSpec, raw["format"]),
        kv_cache=_build(KVCacheSpec, raw["kv_cache"]),
        engine=_build(EngineSpec, raw["engine"]),
        benchmark=_build(BenchProtocol, raw["benchmark"]),
        validation=_build(ValidationSpec, raw["validation"]),
        tokenizer=_build(TokenizerSpec, raw["tokenizer"]),
        tuning=_tuning(raw["tuning"]),
        hardware=_hardware(raw["hardware"]),
        geometry=_geometry(raw["geometry"], raw["tuning"]),
    )


def tuning_defines() -> dict[str, int]:
    """Every kernel's tuning knobs at their defaults (nanoqwen.yaml `tuning:`, all modules)."""
    return {k: v for e in load().tuning.values() for k, v in e.defines.items()}


def cuda_defines(dims: ModelDims | None = None) -> dict[str, int]:
    """The compile-time constants every kernel sees (as -DNAME=value)."""
    cfg = load()
    d = {
        "NQ_GROUP_SIZE": cfg.format.group_size,
        "NQ_ALIGN": cfg.format.alignment,
        "NQ_LAYOUT_ID": cfg.format.layout_id,
        "NQ_FP8_LAYOUT_ID": cfg.format.fp8_layout_id,
        "NQ_STREAM_LAYOUT_ID": cfg.format.stream_layout_id,
        "NQ_FP8_MAX": int(cfg.format.fp8_max),
        "NQ_PAGE_TOKENS": cfg.kv_cache.page_tokens,
        "NQ_KV_DTYPE_BYTES": cfg.kv_cache.dtype_bytes,
        "NQ_ATTN_STAGES": cfg.kv_cache.attention_stages,
        # device-resident scalars of the decode step: one int32 per 128-byte line
        "NQ_SCALAR_STRIDE": cfg.format.alignment // 4,
    }
    d.update(tuning_defines())
    d.update({k: v for g in cfg.geometry.values() for k, v in g.items()})
    if dims is not None:
        d.update({
            "NQ_HIDDEN": dims.hidden,
            "NQ_INTERMEDIATE": dims.intermediate,
            "NQ_NUM_HEADS": dims.num_heads,
            "NQ_NUM_KV_HEADS": dims.num_kv_heads,
            "NQ_HEAD_DIM": dims.head_dim,
            "NQ_VOCAB": dims.vocab,
        })
    return d
