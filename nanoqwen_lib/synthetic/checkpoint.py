"""Synthetic Qwen2 checkpoints in the exact Hugging Face layout, from a seed.

No weights can be downloaded here, so the loader, packer and runtime are exercised on
checkpoints that look byte-for-byte like a real one: config.json, generation_config.json,
bf16 shards `model-0000i-of-0000n.safetensors` + model.safetensors.index.json, and the real
Qwen2 tokenizer files. Speed does not depend on weight values; correctness checks do, so
the values follow a recipe that makes the model *decisive*:

Why decisive. The GPU path is checked by greedy-token agreement with the reference. Two
implementations that differ only by FP16 rounding and summation order move a logit by
roughly |logit| * 1e-3, about 0.01-0.03 here. If logits were near-uniform, top-1 and top-2
would sit closer than that noise and agreement would be a coin toss. With logits ~N(0, s^2)
over V = 152064 ids the top-1/top-2 gap is about s / sqrt(2 ln V) = s / 4.9 on average
(roughly exponential), so at s = 8 the mean gap is ~1.6, and P(gap < 0.1) is ~6%: those
near-ties (nanoqwen.yaml's near_tie_logit_gap) are what the validation counts apart.
(INT4 quantization moves the weights by ~10% of a group's rms, far more than that, but
reference and kernels use the same INT4 weights, so that error is common to both and does
not enter the comparison.)

The recipe (H = hidden, L = layers, all weights N(mean, std^2), bf16):
- embed_tokens: std s_e = 1, so the residual stream starts at rms 1.
- lm_head: std 8 / sqrt(H): the final norm's output has rms ~1, so logits have std ~8.
- Tied embeddings (one matrix does both jobs): s_e = 8 / sqrt(H). Then y . e_current
  would be ~H * s_e (~240 for H = 896) and the model would always repeat its input, so the
  final norm weight gets random signs (+-(1 + noise)): that term averages out.
- q_proj, k_proj: std sqrt(2 / H): q, k entries ~N(0, 2), attention scores std ~2 (peaked
  enough to make position matter, soft enough to mix several tokens).
- v_proj, gate_proj, up_proj: std 1 / sqrt(in): outputs rms ~1.
- o_proj: std s_e / sqrt(2L * in); down_proj: the same / 0.6 (rms of silu(g) * u for
  g, u ~N(0,1)). Each of the 2L residual updates then has rms ~s_e / sqrt(2L): the stream
  stays O(s_e) over depth and its context part is comparable to the current token's.
- norms: 1 + N(0, 0.05^2); q/k/v biases: N(0, 0.1^2).
- Rows of embed/lm_head past the tokenizer (ids 151665..152063, HF pads the vocab to
  152064) are scaled by 0.1, so their logits (std 0.8) never win and output decodes.

Every tensor is generated in row chunks, each from its own RNG seeded with (seed,
crc32(name), chunk index), so values do not depend on thread count; chunks are produced by
a thread pool (NumPy releases the GIL) and written in order, one tensor slice in memory
at a time: the 7B's 15 GB synthesizes with well under 4 GB of RAM (measured: 17.5 s and
1.1 GB peak RSS with 16 threads on the H200 host; 3.7 min and 0.3 GB on a 2-core CPU box).
The values are the same with NumPy 2.4 and 2.5 (checked by hash on both machines).
"""
from __future__ import annotations

import json
import math
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.errors import LimitError
from nanoqwen_lib.format.layout import hf_tensors
from nanoqwen_lib.format.hf_config import to_hf_config
from nanoqwen_lib.format.safetensors_io import SafetensorsWriter, bf16_bits

RECIPE_VERSION = 2          # bump when values change (cache.py keys on it); 2: Qwen2.5's full chat template
LOGIT_STD = 8.0
QK_GAIN = math.sqrt(2.0)
NORM_NOISE, BIAS_STD, PAD_ROW_SCALE = 0.05, 0.1, 0.1
ACT_RMS = 0.6               # rms of silu(g) * u for g, u ~ N(0, 1)
CHUNK_ELEMS = 1 << 22       # values per generated chunk (16 MB of float32)
MAX_SHARD_BYTES = 4 * 10**9
BF16 = "BF16"


def synthesize_dims(name: str) -> ModelDims:
    """The dims of a named model in nanoqwen.yaml (`7b`, `tiny`, `tiny-hd64`)."""
    return load().model(name)


def check_seed(seed, field: str = "seed") -> None:
    """A seed is a non-negative integer (what NumPy's SeedSequence takes); refused in one line
    before anything is written."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LimitError("<arguments>", field, "a non-negative integer", repr(seed))


def tokenizer_vocab() -> int:
    """Ids the tokenizer can decode: 0 .. last special id."""
    return max(load().tokenizer.special_tokens) + 1


def tensor_recipe(name: str, dims: ModelDims) -> tuple[float, float, bool]:
    """name -> (mean, std, random_sign) of its values (see the module docstring)."""
    h, two_l = dims.hidden, 2 * dims.num_layers
    s_e = LOGIT_STD / math.sqrt(h) if dims.tie_embeddings else 1.0
    if name == "model.embed_tokens.weight":
        return 0.0, s_e, False
    if name == "lm_head.weight":
        return 0.0, LOGIT_STD / math.sqrt(h), False
    if name.endswith("norm.weight"):
        return 1.0, NORM_NOISE, name == "model.norm.weight" and dims.tie_embeddings
    if name.endswith(".bias"):
        return 0.0, BIAS_STD, False
    proj = name.split(".")[-3] + "." + name.split(".")[-2]          # e.g. self_attn.q_proj
    fan_in = dims.projections()[proj][1]
    if proj in ("self_attn.q_proj", "self_attn.k_proj"):
        return 0.0, QK_GAIN / math.sqrt(fan_in), False
    if proj == "self_attn.o_proj":
        return 0.0, s_e / math.sqrt(two_l * fan_in), False
    if proj == "mlp.down_proj":
        return 0.0, s_e / math.sqrt(two_l * fan_in) / ACT_RMS, False
    return 0.0, 1.0 / math.sqrt(fan_in), False                       # v, gate, up


def row_chunks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of ~CHUNK_ELEMS values each (a 1-D tensor is one chunk)."""
    if len(shape) == 1:
        return [(0, shape[0])]
    rows_per = max(1, CHUNK_ELEMS // shape[1])
    return [(r, min(r + rows_per, shape[0])) for r in range(0, shape[0], rows_per)]


def generate_chunk(name: str, dims: ModelDims, seed: int, shape, k: int, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of tensor `name` (chunk k) as bf16 bits (uint16)."""
    mean, std, signed = tensor_recipe(name, dims)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), k])
    x = rng.standard_normal((r1 - r0, *shape[1:]), dtype=np.float32)   # [rows, cols] or [n]
    x *= np.float32(std)
    x += np.float32(mean)
    if signed:
        x *= rng.integers(0, 2, x.shape, dtype=np.int8).astype(np.float32) * 2 - 1
    if name in ("model.embed_tokens.weight", "lm_head.weight") and r1 > tokenizer_vocab():
        x[max(0, tokenizer_vocab() - r0):] *= np.float32(PAD_ROW_SCALE)
    return bf16_bits(x)


def plan_shards(dims: ModelDims, shard_bytes: int | None = None) -> list[dict[str, tuple[int, ...]]]:
    """Tensors (layout order) packed greedily into shards of at most shard_bytes (a larger
    tensor gets a shard alone). Default: 4 GB, or half the total so `tiny` has >= 2 shards."""
    tensors = hf_tensors(dims)
    nbytes = {n: 2 * math.prod(s) for n, s in tensors.items()}
    if shard_bytes is None:
        shard_bytes = min(MAX_SHARD_BYTES, -(-sum(nbytes.values()) // 2))
    shards, cur, size = [], {}, 0
    for name, shape in tensors.items():
        if cur and size + nbytes[name] > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = shape, size + nbytes[name]
    shards.append(cur)
    return shards


def write_shard(path, shard, dims, seed, pool, window, bar) -> None:
    jobs = [(n, s, k, r0, r1) for n, s in shard.items() for k, (r0, r1) in enumerate(row_chunks(s))]
    with SafetensorsWriter(path, {n: (BF16, s) for n, s in shard.items()}, {"format": "pt"}) as w:
        pending: deque = deque()
        for job in jobs:  # at most `window` chunks in flight: bounded memory, written in order
            pending.append(pool.submit(generate_chunk, job[0], dims, seed, *job[1:]))
            if len(pending) >= window:
                _drain_one(pending, w, bar)
        while pending:
            _drain_one(pending, w, bar)


def _drain_one(pending: deque, w: SafetensorsWriter, bar) -> None:
    data = pending.popleft().result()
    w.write(data)
    bar.update(data.nbytes)


def write_metadata_files(dims: ModelDims, out_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer files."""
    from nanoqwen_lib.format.tokenizer import QwenTokenizer, hf_tokenizer_files
    spec = load().tokenizer
    gen = {"bos_token_id": spec.bos_id, "pad_token_id": spec.pad_id, "eos_token_id": list(spec.eos_ids),
           "do_sample": False}
    files = {"config.json": json.dumps(to_hf_config(dims), indent=2).encode(),
             "generation_config.json": json.dumps(gen, indent=2).encode(),
             **hf_tokenizer_files(QwenTokenizer.default())}
    for fname, blob in files.items():
        (out_dir / fname).write_bytes(blob)


def synthesize(dims: ModelDims, seed: int, out_dir, shard_bytes: int | None = None,
               progress: bool = True, workers: int | None = None, label: str | None = None) -> Path:
    """Write a synthetic checkpoint of `dims` into out_dir (created); returns out_dir.
    `label` names the progress bar (default: out_dir's name; a caller writing into a
    temporary directory passes the final name)."""
    from tqdm import tqdm  # the console bar: no ipywidgets needed in notebooks
    check_seed(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(dims, shard_bytes)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = sum(2 * math.prod(s) for sh in shards for s in sh.values())
    workers = workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool, \
            tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc=f"synth {label or out_dir.name}") as bar:
        for fname, shard in zip(names, shards):
            write_shard(out_dir / fname, shard, dims, seed, pool, 2 * workers, bar)
    weight_map = {t: f for f, sh in zip(names, shards) for t in sh}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_metadata_files(dims, out_dir)
    return out_dir
