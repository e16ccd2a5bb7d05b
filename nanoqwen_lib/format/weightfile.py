"""Open a validated .nanoqwen file (mmap), and write one atomically.

`NanoqwenFile.open` validates header, directory and (unless told not to) every payload's
CRC32 before returning; its `tensors` are read-only NumPy views of the mapping, which the
GPU engine uploads and the reference model reads.

`AtomicOutput` never leaves a half-written file: on Linux the data goes to an unnamed
O_TMPFILE that only gets a name (linkat) once complete, so even SIGKILL leaves nothing
behind; elsewhere a hidden temp file is removed on any exception or Ctrl-C.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanoqwen_lib.config import ModelDims
from nanoqwen_lib.errors import FormatError
from nanoqwen_lib.format.layout import ENCODING_OF_LAYOUT
from nanoqwen_lib.format.fileformat import (FMT, TOKENIZER_BLOB, Header, TensorEntry, crc32_of, dims_of,
                         encode_directory, encode_header, parse_directory, parse_header,
                         plan_layout)


def _what_directory(path: Path) -> str:
    """How to describe a directory given where a .nanoqwen file was expected."""
    if (path / "config.json").is_file() or any(path.glob("*.safetensors")):
        return (f"a checkpoint directory (pack it first: nanoqwen pack {path} -o "
                f"{path.name or 'model'}.nanoqwen)")
    return "a directory"


@dataclass
class NanoqwenFile:
    path: Path
    header: Header
    dims: ModelDims
    entries: list[TensorEntry]
    tensors: dict[str, np.ndarray]   # read-only views of the mapping
    payload_verified: bool

    @classmethod
    def open(cls, path, verify_payload: bool = True) -> "NanoqwenFile":
        path = Path(path)
        if path.is_dir():
            raise FormatError(path, "path", "a .nanoqwen file", _what_directory(path))
        if not path.is_file():
            raise FormatError(path, "path", "an existing .nanoqwen file", "no such file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(FMT.header_bytes)
            h = parse_header(path, raw.ljust(FMT.header_bytes, b"\0"), size)
            dims = dims_of(path, h)
            f.seek(h.dir_offset)
            directory = f.read(h.dir_bytes)
        entries = parse_directory(path, h, dims, directory)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = {}
        for e in entries:
            buf = mm[e.offset:e.offset + e.nbytes]
            if verify_payload:
                crc = crc32_of(buf)
                if crc != e.crc32:
                    raise FormatError(path, f"tensor {e.name!r}: crc32", f"{e.crc32:#010x}",
                                      f"{crc:#010x}", "payload corrupted")
            tensors[e.name] = buf.view(e.dtype).reshape(e.shape)
        return cls(path, h, dims, entries, tensors, verify_payload)

    @property
    def encoding(self) -> str:
        """The projections' weight encoding, from the header's layout_id: "int4" or "fp8"."""
        return ENCODING_OF_LAYOUT[self.header.layout_id]

    @property
    def tokenizer_json(self) -> bytes | None:
        t = self.tensors.get(TOKENIZER_BLOB)
        return None if t is None else t.tobytes()

    def model_tensors(self) -> dict[str, np.ndarray]:
        """The model's tensors only (layout.packed_tensors names), without blobs."""
        return {k: v for k, v in self.tensors.items() if k != TOKENIZER_BLOB}

    def verify(self) -> None:
        """Check every payload's CRC32 (what `nanoqwen inspect --verify` runs)."""
        for e in self.entries:
            crc = crc32_of(self.tensors[e.name].view(np.uint8).reshape(-1))
            if crc != e.crc32:
                raise FormatError(self.path, f"tensor {e.name!r}: crc32", f"{e.crc32:#010x}",
                                  f"{crc:#010x}", "payload corrupted")
        self.payload_verified = True


class AtomicOutput:
    """A file that appears at `path` complete, or not at all."""

    def __init__(self, path):
        self.path = Path(path)
        self.tmp_name: Path | None = None
        self.fd = -1

    def __enter__(self):
        d = self.path.parent
        if self.path.is_dir():
            raise FormatError(self.path, "output path", "a file path", "an existing directory")
        d.mkdir(parents=True, exist_ok=True)
        try:
            self.fd = os.open(d, os.O_TMPFILE | os.O_RDWR, 0o644)
        except (AttributeError, OSError):
            self.tmp_name = d / f".{self.path.name}.tmp-{os.getpid()}"
            self.fd = os.open(self.tmp_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        return self

    def pwrite(self, data, offset: int) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = os.pwrite(self.fd, mv, offset)
            mv, offset = mv[n:], offset + n

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                os.fsync(self.fd)
                if self.tmp_name is None:
                    staged = self.path.parent / f".{self.path.name}.link-{os.getpid()}"
                    if staged.exists():
                        staged.unlink()
                    # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N names the unnamed file;
                    # passing a dir fd makes CPython call linkat rather than link.
                    procfd = os.open("/proc/self/fd", os.O_RDONLY)
                    try:
                        os.link(str(self.fd), staged, src_dir_fd=procfd, follow_symlinks=True)
                    finally:
                        os.close(procfd)
                    try:
                        os.replace(staged, self.path)
                    except OSError:
                        staged.unlink()   # never leave the complete hidden copy behind
                        raise
                else:
                    os.replace(self.tmp_name, self.path)
                    self.tmp_name = None
        finally:
            os.close(self.fd)
            if self.tmp_name is not None and self.tmp_name.exists():
                self.tmp_name.unlink()
        return False


def write_nanoqwen(path, dims: ModelDims, produce, tokenizer_json: bytes | None = None,
                   progress=None, encoding: str = "int4") -> Path:
    """Write a .nanoqwen file with this weight encoding. `produce(name, dtype, shape)`
    returns that tensor's array (called once per tensor, in file order, so a packer holds
    one tensor at a time). `progress(nbytes)` is called after each payload."""
    entries, data_offset, file_bytes = plan_layout(dims, None if tokenizer_json is None else len(tokenizer_json),
                                                   encoding)
    done = []
    with AtomicOutput(path) as out:
        for e in entries:
            if e.name == TOKENIZER_BLOB:
                arr = np.frombuffer(tokenizer_json, dtype=np.uint8)
            else:
                arr = np.ascontiguousarray(produce(e.name, e.dtype, e.shape))
                if arr.dtype != e.dtype or arr.shape != e.shape:
                    raise AssertionError(f"{e.name}: produced {arr.dtype}{arr.shape}, "
                                         f"layout wants {e.dtype}{e.shape}")
            out.pwrite(arr, e.offset)
            done.append(TensorEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, crc32_of(arr)))
            if progress:
                progress(e.nbytes)
        directory = encode_directory(done)
        os.ftruncate(out.fd, file_bytes)  # the file's full length, tail padding included
        out.pwrite(directory, FMT.header_bytes)
        out.pwrite(encode_header(dims, done, data_offset, file_bytes, directory, encoding), 0)
    return Path(path)
