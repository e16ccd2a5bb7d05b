"""A Hugging Face Qwen2 checkpoint directory, validated completely before any weight is read.

    ckpt = Checkpoint.open(dir)   # config.json, index, every shard header: names, dtypes, shapes
    for name in ckpt.names():     # layout order (layout.hf_tensors)
        w = ckpt.tensor(name)     # float32, one tensor at a time, through mmap; NaN/Inf refused

A checkpoint is either one `model.safetensors` or shards listed by
`model.safetensors.index.json` ({"weight_map": {tensor: shard file}}). Every failure is a
CheckpointError / ConfigError naming the file and the tensor or field.

The tensors are matched the way transformers 5 loads them: a tied config's checkpoint may
store the embedding, `lm_head.weight`, or both (equal: tied; different: transformers keeps
both, and so do we, untied); leftover `rotary_emb.inv_freq` buffers are ignored (RoPE's
frequencies come from config.json). The directory's `generation_config.json` and chat
template travel with it (format.hf_meta).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from nanoqwen_lib.config import ModelDims
from nanoqwen_lib.errors import CheckpointError
from nanoqwen_lib.format.fileformat import CHAT_TEMPLATE_BLOB, CONFIG_BLOB, GENERATION_BLOB
from nanoqwen_lib.format.hf_config import dims_from_hf_config
from nanoqwen_lib.format.hf_meta import GENERATION_CONFIG, read_chat_template, read_generation_eos
from nanoqwen_lib.format.layout import hf_tensors
from nanoqwen_lib.format.safetensors_io import DTYPES, TensorInfo, load_tensor, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
IGNORED = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")  # old saves' buffers


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(path, what, "a file", "nothing (missing)")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, what, "valid JSON", str(e)) from None
    if not isinstance(obj, dict):
        raise CheckpointError(path, what, "a JSON object", type(obj).__name__)
    return obj


class Checkpoint:
    def __init__(self, ckpt_dir: Path, dims: ModelDims, location: dict[str, tuple[Path, TensorInfo, int]],
                 hf_config: dict | None = None):
        self.dir = ckpt_dir
        self.dims = dims
        self._location = location   # tensor name -> (shard path, header entry, data_start)
        self.hf_config = hf_config  # config.json as read (the oracle builds transformers' model from it)

    @classmethod
    def open(cls, ckpt_dir) -> "Checkpoint":
        ckpt_dir = Path(ckpt_dir)
        if not ckpt_dir.is_dir():
            raise CheckpointError(ckpt_dir, "checkpoint directory", "a directory", "nothing there")
        cfg_path = ckpt_dir / "config.json"
        hf_config = _read_json(cfg_path, "config.json")
        dims = dims_from_hf_config(hf_config, source=cfg_path)
        weight_map = {n: s for n, s in _weight_map(ckpt_dir).items() if not IGNORED.fullmatch(n)}
        headers = _read_headers(ckpt_dir, weight_map)
        stored = {}    # model tensor name -> the name it is stored under, where they differ
        if dims.tie_embeddings:
            dims, stored = _resolve_tied(dims, weight_map, headers, ckpt_dir, cfg_path)
        expected = hf_tensors(dims)
        _check_unexpected(expected, stored, weight_map, headers, ckpt_dir)
        location = {}
        for name, shape in expected.items():
            location[name] = _locate(name, shape, weight_map, headers, ckpt_dir, cfg_path, stored.get(name, name))
        read_generation_eos(ckpt_dir, dims.vocab)   # validated now, before any work
        read_chat_template(ckpt_dir)
        return cls(ckpt_dir, dims, location, hf_config)

    def names(self) -> list[str]:
        """Every tensor the model uses, in layout order."""
        return list(self._location)

    def file_of(self, name: str) -> Path:
        return self._location[name][0]

    def dtype_of(self, name: str) -> str:
        return self._location[name][1].dtype

    def tensor(self, name: str) -> np.ndarray:
        """One tensor as float32 (read through mmap); NaN or Inf is a CheckpointError."""
        if name not in self._location:
            raise CheckpointError(self.dir, f"tensor {name!r}", "one of the model's tensors", "an unknown name")
        path, info, data_start = self._location[name]
        w = load_tensor(path, name, info, data_start)
        bad = ~np.isfinite(w)
        if bad.any():
            first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), w.shape))
            raise CheckpointError(path, f"tensor {name!r}", "finite values",
                                  f"{int(bad.sum())} NaN/Inf values, the first at index {list(first)}")
        return w

    def blobs(self) -> dict[str, bytes]:
        """What a .nanoqwen file carries besides the tokenizer: config.json exactly as read,
        generation_config.json when present, the chat template when there is one."""
        out = {CONFIG_BLOB: (self.dir / "config.json").read_bytes()}
        if (self.dir / GENERATION_CONFIG).is_file():
            out[GENERATION_BLOB] = (self.dir / GENERATION_CONFIG).read_bytes()
        chat = read_chat_template(self.dir)
        if chat is not None:
            out[CHAT_TEMPLATE_BLOB] = chat[0].encode("utf-8")
        return out

    def tokenizer_json_path(self) -> Path | None:
        p = self.dir / "tokenizer.json"
        return p if p.is_file() else None

    def tokenizer(self):
        """The checkpoint's own tokenizer.json when present, else the default Qwen2 tokenizer."""
        from nanoqwen_lib.format.tokenizer import QwenTokenizer
        p = self.tokenizer_json_path()
        return QwenTokenizer.from_tokenizer_json(p) if p else QwenTokenizer.default()


def _weight_map(ckpt_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name (relative to the directory)."""
    index_path = ckpt_dir / INDEX
    if not index_path.exists():
        if not (ckpt_dir / SINGLE).is_file():
            raise CheckpointError(ckpt_dir, "weights", f"{INDEX} or {SINGLE}", "neither")
        tensors, _, _ = read_header(ckpt_dir / SINGLE)
        return {name: SINGLE for name in tensors}
    wm = _read_json(index_path, INDEX).get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(index_path, "weight_map", "an object {tensor: shard file}", type(wm).__name__)
    for name, shard in wm.items():
        if Path(shard).name != shard:
            raise CheckpointError(index_path, f"weight_map[{name!r}]", "a file name inside the directory", shard)
        if not (ckpt_dir / shard).is_file():
            raise CheckpointError(index_path, f"weight_map[{name!r}]", "an existing shard file",
                                  f"{shard!r}, which does not exist")
    return wm


def _read_headers(ckpt_dir: Path, weight_map: dict[str, str]) -> dict[str, tuple[dict, int]]:
    """shard file name -> (tensors of its header, data_start); every shard is validated."""
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors, _, data_start = read_header(ckpt_dir / shard)
        out[shard] = (tensors, data_start)
    return out


def _resolve_tied(dims, weight_map, headers, ckpt_dir, cfg_path):
    """A tied config, as transformers 5 loads it: only the embedding stored -> tied; only
    lm_head.weight stored -> it is the embedding too; both stored and equal -> tied; both
    stored and different -> transformers does not tie them, so neither do we (the dims
    become untied and lm_head is packed). -> (dims, {model name: stored name}), where
    {LM_HEAD: LM_HEAD} marks a stored copy that is read by no one."""
    if LM_HEAD not in weight_map:
        return dims, {}
    if EMBED not in weight_map:
        return dims, {EMBED: LM_HEAD}
    shape = (dims.vocab, dims.hidden)
    a, b = (_locate(n, shape, weight_map, headers, ckpt_dir, cfg_path) for n in (EMBED, LM_HEAD))
    if _same_values(a, b):
        return dims, {LM_HEAD: LM_HEAD}
    return dataclasses.replace(dims, tie_embeddings=False), {}


def _same_values(a, b, rows: int = 4096) -> bool:
    """Two located tensors of one shape hold the same values: compared bytewise when
    stored in one dtype, else as float32; a few thousand rows at a time (the 0.5B's
    embedding is 136M values)."""
    (pa, ia, sa), (pb, ib, sb) = a, b
    if ia.dtype == ib.dtype:
        ma = np.memmap(pa, np.uint8, "r", offset=sa + ia.begin, shape=(ia.nbytes,))
        mb = np.memmap(pb, np.uint8, "r", offset=sb + ib.begin, shape=(ib.nbytes,))
        step = rows * (ia.nbytes // max(ia.shape[0], 1))
        return all(np.array_equal(ma[i:i + step], mb[i:i + step]) for i in range(0, ia.nbytes, max(step, 1)))
    return np.array_equal(load_tensor(pa, EMBED, ia, sa), load_tensor(pb, LM_HEAD, ib, sb))


def _check_unexpected(expected, stored, weight_map, headers, ckpt_dir) -> None:
    allowed = {stored.get(n, n) for n in expected} | set(stored.values())
    for name, shard in weight_map.items():
        if name not in allowed:
            where = ckpt_dir / (INDEX if (ckpt_dir / INDEX).exists() else shard)
            raise CheckpointError(where, f"tensor {name!r}", "only the tensors of a Qwen2ForCausalLM",
                                  "an unexpected tensor", hint="a different architecture or an adapter?")
    for shard, (tensors, _) in headers.items():
        for name in tensors:
            if name not in allowed and not IGNORED.fullmatch(name):
                raise CheckpointError(ckpt_dir / shard, f"tensor {name!r}",
                                      "only the tensors of a Qwen2ForCausalLM", "an unexpected tensor")


def _locate(name, shape, weight_map, headers, ckpt_dir, cfg_path, stored_as=None) -> tuple[Path, TensorInfo, int]:
    """Where tensor `name` lies (stored under `stored_as`, by default its own name), checked."""
    name = stored_as or name
    if name not in weight_map:
        where = ckpt_dir / (INDEX if (ckpt_dir / INDEX).exists() else SINGLE)
        raise CheckpointError(where, f"tensor {name!r}", "present", "missing")
    shard = weight_map[name]
    tensors, data_start = headers[shard]
    path = ckpt_dir / shard
    if name not in tensors:
        raise CheckpointError(path, f"tensor {name!r}", f"in this shard (as {INDEX} says)", "absent from its header")
    info = tensors[name]
    if info.dtype not in DTYPES:  # read_header already refuses others; kept as the stated invariant
        raise CheckpointError(path, f"tensor {name!r} dtype", f"one of {sorted(DTYPES)}", info.dtype)
    if info.shape != tuple(shape):
        raise CheckpointError(path, f"tensor {name!r} shape", f"{list(shape)} (from {cfg_path.name})",
                              list(info.shape))
    return path, info, data_start
