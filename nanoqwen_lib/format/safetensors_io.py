"""A small reader/writer of the safetensors format, for float tensors, with NumPy only.

Why our own: NumPy has no bfloat16, so the `safetensors` NumPy API cannot read the bf16
checkpoints Hugging Face ships. The format is simple enough to read by hand:

    [8 bytes: N, little-endian u64] [N bytes: JSON header] [data section]

The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the start of the data section) plus an optional "__metadata__"
dict of strings. Everything is validated before a byte of data is touched, and every
error is a CheckpointError naming the file and the tensor (or field) at fault.

bf16 -> f32 is exact: a bf16 is the top half of an f32, so `uint32(u16) << 16` is the
f32. f32 -> bf16 rounds to nearest even (what torch does), not truncation.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanoqwen_lib.errors import CheckpointError

# safetensors dtype name -> little-endian storage dtype (bf16 is stored as raw uint16).
DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
MAX_HEADER_BYTES = 100_000_000  # the limit the reference implementation enforces


@dataclass(frozen=True)
class TensorInfo:
    dtype: str              # "BF16" | "F16" | "F32"
    shape: tuple[int, ...]
    begin: int              # byte offsets relative to the data section, end exclusive
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _parse_entry(path, name, entry, data_bytes) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(path, f"tensor {name!r}", "a JSON object", type(entry).__name__)
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(path, f"tensor {name!r} dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(path, f"tensor {name!r} shape", "a list of non-negative ints", repr(shape))
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise CheckpointError(path, f"tensor {name!r} data_offsets", "[begin, end] with 0 <= begin <= end",
                              repr(offs))
    begin, end = offs
    if end > data_bytes:
        raise CheckpointError(path, f"tensor {name!r} data_offsets",
                              f"end <= {data_bytes} (the data section's size)", end,
                              hint="the file is truncated" if begin <= data_bytes else None)
    want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
    if end - begin != want:
        raise CheckpointError(path, f"tensor {name!r} byte size",
                              f"prod({shape}) * {DTYPES[dtype].itemsize} = {want}", end - begin)
    return TensorInfo(dtype, tuple(shape), begin, end)


def read_header(path) -> tuple[dict[str, TensorInfo], dict, int]:
    """Parse and validate a .safetensors header -> (tensors, metadata, data_start)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, "header length", "8 bytes", f"a {size}-byte file",
                                      hint="the file is truncated")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(path, "header length", f"<= {MAX_HEADER_BYTES} bytes", n,
                                      hint="not a safetensors file?")
            if 8 + n > size:
                raise CheckpointError(path, "header length", f"<= {size - 8} (bytes after the length)", n,
                                      hint="the file is truncated")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(path, "file", "a readable file", f"{type(e).__name__}: {e.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, "header", "valid UTF-8 JSON", str(e)) from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header", "a JSON object", type(header).__name__)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "__metadata__", "an object of strings", repr(metadata)[:80])
    data_start = 8 + n
    data_bytes = size - data_start
    tensors = {name: _parse_entry(path, name, e, data_bytes) for name, e in header.items()}
    _check_no_overlap(path, tensors)
    return tensors, metadata, data_start


def _check_no_overlap(path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items() if t.end > t.begin)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(path, f"tensor {n1!r} data_offsets",
                                  f"begin >= {e0} (the end of {n0!r})", b1, hint="tensors overlap")


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (any shape) -> a new float32 array."""
    if dtype == "BF16":
        u = raw.astype(np.uint32)
        u <<= np.uint32(16)
        return u.view(np.float32)
    return raw.astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding could carry a NaN's mantissa into the exponent; keep it quiet NaN
        out[nan] = np.uint16(0x7FC0)
    return out


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the array whose bytes are stored for `dtype`."""
    if dtype == "BF16":
        return bf16_bits(x)
    return np.asarray(x).astype(DTYPES[dtype])


def load_tensor(path, name: str, info: TensorInfo | None = None, data_start: int | None = None) -> np.ndarray:
    """One tensor as a float32 array, read through np.memmap (only its bytes are touched)."""
    if info is None or data_start is None:
        tensors, _, data_start = read_header(path)
        if name not in tensors:
            raise CheckpointError(path, f"tensor {name!r}", "present in the header", "absent")
        info = tensors[name]
    if info.nbytes == 0:
        return np.zeros(info.shape, np.float32)
    raw = np.memmap(path, dtype=DTYPES[info.dtype], mode="r", offset=data_start + info.begin, shape=info.shape)
    try:
        return to_float32(raw, info.dtype)
    finally:
        del raw


class SafetensorsWriter:
    """Streams tensors into a .safetensors file in a declared order; atomic on close.

    The header is known up front (specs: name -> (dtype, shape)), so data can be written
    in chunks as it is produced and no tensor has to be whole in memory. The file appears
    under its name only after the last byte is written (temp file + os.replace).
    """

    def __init__(self, path, specs: dict[str, tuple[str, tuple[int, ...]]], metadata: dict | None = None):
        self.path = Path(path)
        header, off = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for name, (dtype, shape) in specs.items():
            if dtype not in DTYPES:
                raise CheckpointError(self.path, f"tensor {name!r} dtype", f"one of {sorted(DTYPES)}", repr(dtype))
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # pad so the data section starts 8-byte aligned
        self.total = off
        self.written = 0
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        self._f.write(len(blob).to_bytes(8, "little") + blob)

    def write(self, data: np.ndarray) -> None:
        """Append the next bytes of data (already in the stored dtype, C order)."""
        b = np.ascontiguousarray(data).view(np.uint8)
        self.written += b.size
        if self.written > self.total:
            raise ValueError(f"{self.path}: {self.written} data bytes written, header declares {self.total}")
        self._f.write(b.data)

    def close(self) -> Path:
        self._f.close()
        if self.written != self.total:
            self._tmp.unlink(missing_ok=True)
            raise ValueError(f"{self.path}: {self.written} data bytes written, header declares {self.total}")
        os.chmod(self._tmp, 0o644)  # mkstemp makes it 0600; a checkpoint is an ordinary file
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_safetensors(path, tensors: dict[str, np.ndarray], dtype: str = "BF16", metadata: dict | None = None) -> Path:
    """Write float arrays as one .safetensors file (all in `dtype`), atomically."""
    arrays = {name: np.asarray(a, dtype=np.float32) for name, a in tensors.items()}
    specs = {name: (dtype, a.shape) for name, a in arrays.items()}
    with SafetensorsWriter(path, specs, metadata) as w:
        for a in arrays.values():
            w.write(encode(a, dtype))
    return Path(path)
