"""The .nanoqwen file: a 256-byte header, a tensor directory, 128-byte-aligned payloads.

    offset 0     header (256 B): magic, version, layout, group, model dims, directory and
                 data offsets, file length, directory CRC, header CRC (last 4 bytes)
    offset 256   directory: n_tensors entries of 128 B (name, dtype, shape, offset,
                 nbytes, payload CRC32)
    data_offset  payloads, each starting on a 128-byte boundary, in directory order

Every field is little-endian. The reader checks everything before anything is used (and
so before anything reaches a GPU); every refusal names the file, the field, the expected
and the found value. The layout (`HEADER_FIELDS`, `DIR_FIELDS`) is data, so the book's
table in chapter 1 is generated from it.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.errors import ConfigError, FormatError
from nanoqwen_lib.format.layout import LAYOUTS, layout_id_of, layout_name, packed_tensor_count, packed_tensors

FMT = load().format

# (name, struct code, meaning) in file order; the header is padded to 256 bytes with the
# CRC32 of bytes [0, 252) in its last 4 bytes.
HEADER_FIELDS = [
    ("magic", "8s", "b'NANOQWEN'"),
    ("version", "I", "format version (this build reads 1)"),
    ("layout_id", "I", "weight encoding: 1 = INT4 symmetric, ValueShuffle nibbles; 2 = FP8 E4M3, row scales; "
                       "3 = layout 1 re-tiled into one lane-fragment stream per projection"),
    ("group_size", "I", "INT4 group along the input dim (128)"),
    ("alignment", "I", "payload alignment in bytes (128)"),
    ("header_bytes", "I", "256"),
    ("dir_entry_bytes", "I", "128"),
    ("num_layers", "I", "decoder layers"),
    ("hidden", "I", "hidden size"),
    ("intermediate", "I", "MLP size"),
    ("num_heads", "I", "query heads"),
    ("num_kv_heads", "I", "KV heads"),
    ("head_dim", "I", "head dim"),
    ("vocab", "I", "vocabulary rows"),
    ("max_position", "I", "max_position_embeddings"),
    ("tie_embeddings", "I", "1 if lm_head is the embedding"),
    ("flags", "I", "reserved, 0"),
    ("rope_theta", "d", "RoPE base"),
    ("rms_eps", "d", "RMSNorm epsilon"),
    ("n_tensors", "I", "directory entries"),
    ("dir_crc32", "I", "CRC32 of the directory bytes"),
    ("dir_offset", "Q", "directory start (256)"),
    ("dir_bytes", "Q", "n_tensors * 128"),
    ("data_offset", "Q", "first payload byte (128-aligned)"),
    ("file_bytes", "Q", "total file length"),
]
HEADER_STRUCT = struct.Struct("<" + "".join(code for _, code, _ in HEADER_FIELDS))
HEADER_CRC_AT = FMT.header_bytes - 4

DIR_FIELDS = [
    ("name", f"{FMT.dir_name_bytes}s", "UTF-8, NUL-padded"),
    ("dtype", "I", "1 = fp16, 2 = uint32 (packed INT4), 3 = uint8 (FP8 codes, INT4 stream, blob), 4 = fp32"),
    ("ndim", "I", "1 or 2"),
    ("shape0", "I", "first dim"),
    ("shape1", "I", "second dim (0 if ndim = 1)"),
    ("crc32", "I", "CRC32 of the payload"),
    ("reserved", "I", "0"),
    ("offset", "Q", "payload start, 128-aligned"),
    ("nbytes", "Q", "payload length"),
]
DIR_STRUCT = struct.Struct("<" + "".join(code for _, code, _ in DIR_FIELDS))
DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<u4"), 3: np.dtype("u1"), 4: np.dtype("<f4")}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
TOKENIZER_BLOB = "tokenizer.json"  # optional: the checkpoint's tokenizer, carried in the file
# Optional byte blobs (uint8, 1-D) after the model's tensors, in this order: the
# checkpoint's tokenizer, its config.json (the oracle builds transformers' model from it),
# its generation_config.json (EOS ids) and its chat template (format.hf_meta).
CONFIG_BLOB, GENERATION_BLOB, CHAT_TEMPLATE_BLOB = "config.json", "generation_config.json", "chat_template.jinja"
BLOBS = (TOKENIZER_BLOB, CONFIG_BLOB, GENERATION_BLOB, CHAT_TEMPLATE_BLOB)
DIMS_FIELDS = ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads",
               "head_dim", "vocab", "max_position", "rope_theta", "rms_eps", "tie_embeddings")
assert HEADER_STRUCT.size <= HEADER_CRC_AT and DIR_STRUCT.size <= FMT.dir_entry_bytes


def align_up(n: int, a: int = FMT.alignment) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class Header:
    fields: dict

    def __getattr__(self, k):
        try:
            return self.fields[k]
        except KeyError:
            raise AttributeError(k) from None


def blob_sizes(blobs) -> dict[str, int]:
    """None, the tokenizer's byte count, or {blob name: bytes} -> {blob name: bytes}."""
    if blobs is None:
        return {}
    if isinstance(blobs, int):
        return {TOKENIZER_BLOB: blobs}
    return {name: (len(v) if isinstance(v, (bytes, bytearray)) else int(v)) for name, v in blobs.items()}


def expected_entries(dims: ModelDims, blobs, encoding: str = "int4",
                     storage: str = "split") -> dict[str, tuple[np.dtype, tuple]]:
    """Every entry of a file: the model's tensors (projections in `storage`: layout.STORAGES),
    then the blobs it carries (`blobs`: see blob_sizes), in BLOBS order."""
    exp = dict(packed_tensors(dims, encoding, storage))
    sizes = blob_sizes(blobs)
    for name in BLOBS:
        if name in sizes:
            exp[name] = (DTYPES[3], (sizes[name],))
    return exp


def plan_layout(dims: ModelDims, blobs=None, encoding: str = "int4",
                storage: str = "split") -> tuple[list[TensorEntry], int, int]:
    """Offsets of every payload: (entries without CRCs, data_offset, file_bytes); `blobs`:
    None, the tokenizer's byte count, or {blob name: bytes or byte count}."""
    exp = expected_entries(dims, blobs, encoding, storage)
    data_offset = align_up(FMT.header_bytes + len(exp) * FMT.dir_entry_bytes)
    entries, off = [], data_offset
    for name, (dt, shape) in exp.items():
        nbytes = math.prod(shape) * dt.itemsize
        entries.append(TensorEntry(name, dt, tuple(shape), off, nbytes, 0))
        off = align_up(off + nbytes)
    return entries, data_offset, off


def encode_directory(entries: list[TensorEntry]) -> bytes:
    out = bytearray()
    for e in entries:
        raw = e.name.encode()
        assert len(raw) < FMT.dir_name_bytes, e.name
        shape = list(e.shape) + [0] * (2 - len(e.shape))
        rec = DIR_STRUCT.pack(raw, DTYPE_CODES[e.dtype], len(e.shape), shape[0], shape[1],
                              e.crc32, 0, e.offset, e.nbytes)
        out += rec.ljust(FMT.dir_entry_bytes, b"\0")
    return bytes(out)


def encode_header(dims: ModelDims, entries: list[TensorEntry], data_offset: int,
                  file_bytes: int, directory: bytes, encoding: str = "int4", storage: str = "split") -> bytes:
    values = {
        "magic": FMT.magic.encode(), "version": FMT.version, "layout_id": layout_id_of(encoding, storage),
        "group_size": FMT.group_size, "alignment": FMT.alignment,
        "header_bytes": FMT.header_bytes, "dir_entry_bytes": FMT.dir_entry_bytes,
        **{k: getattr(dims, k) for k in DIMS_FIELDS}, "flags": 0,
        "n_tensors": len(entries), "dir_crc32": zlib.crc32(directory),
        "dir_offset": FMT.header_bytes, "dir_bytes": len(directory),
        "data_offset": data_offset, "file_bytes": file_bytes,
    }
    values["tie_embeddings"] = int(values["tie_embeddings"])
    raw = HEADER_STRUCT.pack(*(values[k] for k, _, _ in HEADER_FIELDS)).ljust(HEADER_CRC_AT, b"\0")
    return raw + struct.pack("<I", zlib.crc32(raw))


def crc32_of(buf, chunk: int = 64 << 20) -> int:
    """CRC32 of a (possibly huge, memory-mapped) buffer, in chunks."""
    mv = memoryview(buf).cast("B")
    crc = 0
    for i in range(0, len(mv), chunk):
        crc = zlib.crc32(mv[i:i + chunk], crc)
    return crc


# ----------------------------------------------------------------------------- reading

def _check(path, field, ok: bool, expected, found, hint=None):
    if not ok:
        raise FormatError(path, field, expected, found, hint)


def parse_header(path, raw: bytes, file_len: int) -> Header:
    """Validate the 256 header bytes against this build and the file's length."""
    _check(path, "file length", file_len >= FMT.header_bytes,
           f">= {FMT.header_bytes} bytes (the header)", f"{file_len} bytes", "truncated file?")
    h = dict(zip([k for k, _, _ in HEADER_FIELDS], HEADER_STRUCT.unpack_from(raw)))
    _check(path, "magic", h["magic"] == FMT.magic.encode(), repr(FMT.magic.encode()), repr(h["magic"]),
           "not a .nanoqwen file")
    _check(path, "version", h["version"] == FMT.version, FMT.version, h["version"],
           "packed by another nanoqwen version; re-pack it with this one")
    (crc,) = struct.unpack_from("<I", raw, HEADER_CRC_AT)
    _check(path, "header_crc32", crc == zlib.crc32(raw[:HEADER_CRC_AT]),
           f"{zlib.crc32(raw[:HEADER_CRC_AT]):#010x} (CRC of bytes 0-251)", f"{crc:#010x}",
           "the header is corrupted")
    _check(path, "layout_id", h["layout_id"] in LAYOUTS,
           " or ".join(layout_name(i) for i in sorted(LAYOUTS)), h["layout_id"],
           "a weight layout this build does not know; it is never reinterpreted")
    for k in ("group_size", "alignment", "header_bytes", "dir_entry_bytes"):
        _check(path, k, h[k] == getattr(FMT, k), getattr(FMT, k), h[k])
    _check(path, "flags", h["flags"] == 0, 0, h["flags"])
    _check(path, "tie_embeddings", h["tie_embeddings"] in (0, 1), "0 or 1", h["tie_embeddings"])
    _check(path, "file_bytes", h["file_bytes"] == file_len,
           f"a file of {h['file_bytes']} bytes (what the header says)",
           f"{file_len} bytes (the file's length)", "truncated or extended file")
    _check(path, "dir_offset", h["dir_offset"] == FMT.header_bytes, FMT.header_bytes, h["dir_offset"])
    _check(path, "dir_bytes", h["dir_bytes"] == h["n_tensors"] * FMT.dir_entry_bytes,
           f"n_tensors * {FMT.dir_entry_bytes} = {h['n_tensors'] * FMT.dir_entry_bytes}", h["dir_bytes"])
    dir_end = h["dir_offset"] + h["dir_bytes"]
    _check(path, "data_offset", h["data_offset"] == align_up(dir_end) and h["data_offset"] <= file_len,
           f"{align_up(dir_end)} (directory end rounded up to {FMT.alignment}, inside the file)",
           h["data_offset"])
    return Header(h)


def dims_of(path, h: Header) -> ModelDims:
    dims = ModelDims(**{k: h.fields[k] for k in DIMS_FIELDS if k != "tie_embeddings"},
                     tie_embeddings=bool(h.tie_embeddings))
    try:
        dims.check_supported(source=f"{path} header")
    except ConfigError as e:  # the packer's own checks (u32 ranges, finite rope/eps, GQA, ...)
        raise FormatError(path, f"header {e.field}", e.expected, e.found) from None
    return dims


def parse_directory(path, h: Header, dims: ModelDims, directory: bytes) -> list[TensorEntry]:
    """Decode and validate every directory entry against the dims and the file."""
    encoding, storage = LAYOUTS[h.layout_id]
    count = packed_tensor_count(dims, storage)
    _check(path, "n_tensors", count <= h.n_tensors <= count + len(BLOBS),
           f"{count} for these dims in layout {layout_name(h.layout_id)} (up to {count + len(BLOBS)} with the "
           f"blobs {list(BLOBS)})", h.n_tensors)
    _check(path, "dir_crc32", zlib.crc32(directory) == h.dir_crc32, f"{zlib.crc32(directory):#010x}",
           f"{h.dir_crc32:#010x}", "the tensor directory is corrupted")
    entries, seen = [], set()
    for i in range(h.n_tensors):
        rec = directory[i * FMT.dir_entry_bytes:(i + 1) * FMT.dir_entry_bytes]
        name_b, code, ndim, s0, s1, crc, _, off, nbytes = DIR_STRUCT.unpack_from(rec)
        where = f"directory[{i}]"
        try:
            name = name_b.rstrip(b"\0").decode()
        except UnicodeDecodeError:
            raise FormatError(path, f"{where}.name", "UTF-8", repr(name_b[:20])) from None
        where = f"tensor {name!r}"
        _check(path, f"{where}: name", name not in seen, "a name used once", "a duplicate")
        seen.add(name)
        _check(path, f"{where}: dtype", code in DTYPES, f"one of {sorted(DTYPES)}", code)
        _check(path, f"{where}: ndim", ndim in (1, 2), "1 or 2", ndim)
        shape = (s0,) if ndim == 1 else (s0, s1)
        entries.append(TensorEntry(name, DTYPES[code], shape, off, nbytes, crc))
    blobs = {e.name: e.shape[0] for e in entries if e.name in BLOBS}
    expected = expected_entries(dims, blobs, encoding, storage)
    names = [e.name for e in entries]
    missing = [n for n in expected if n not in seen]
    _check(path, "tensors", not missing, "every tensor of the model", f"{len(missing)} missing",
           f"first missing: {missing[:1]}")
    extra = [n for n in names if n not in expected]
    _check(path, "tensors", not extra, "only the model's tensors", f"unexpected {extra[:1]}")
    for e in entries:
        dt, shape = expected[e.name]
        where = f"tensor {e.name!r}"
        _check(path, f"{where}: dtype", e.dtype == dt, dt.name, e.dtype.name)
        _check(path, f"{where}: shape", e.shape == tuple(shape), tuple(shape), e.shape,
               "disagrees with the model dims in the header")
        _check(path, f"{where}: nbytes", e.nbytes == math.prod(shape) * dt.itemsize,
               math.prod(shape) * dt.itemsize, e.nbytes)
        _check(path, f"{where}: offset", e.offset % FMT.alignment == 0,
               f"a multiple of {FMT.alignment}", e.offset)
        _check(path, f"{where}: offset", e.offset >= h.data_offset,
               f">= data_offset {h.data_offset}", e.offset)
        _check(path, f"{where}: end", e.offset + e.nbytes <= h.file_bytes,
               f"<= file length {h.file_bytes}", e.offset + e.nbytes, "payload runs past the end")
    by_off = sorted(entries, key=lambda e: e.offset)
    for a, b in zip(by_off, by_off[1:]):
        _check(path, f"tensor {b.name!r}: offset", b.offset >= a.offset + a.nbytes,
               f">= {a.offset + a.nbytes} (end of {a.name!r})", b.offset, "payloads overlap")
    return entries
