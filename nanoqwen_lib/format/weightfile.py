"""Open a validated .nanoqwen file (mmap), and write one atomically.

`NanoqwenFile.open` validates header, directory and (unless told not to) every payload's
CRC32 before returning; its `tensors` are read-only NumPy views of the mapping, as stored.
`model_tensors()` is what the GPU engine uploads and the reference model reads: the
projections always as layout 1 (`.qweight` + `.scales`), converted from a layout-3 file's
`.stream` tensors when asked for; `stream_tensors()` hands out those streams as stored.

`AtomicOutput` never leaves a half-written file: on Linux the data goes to an unnamed
O_TMPFILE that only gets a name (linkat) once complete, so even SIGKILL leaves nothing
behind; elsewhere a hidden temp file is removed on any exception or Ctrl-C.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanoqwen_lib.config import ModelDims
from nanoqwen_lib.errors import FormatError, NanoqwenError
from nanoqwen_lib.format.layout import LAYOUTS, layout_id_of, packed_tensors, stream_sources
from nanoqwen_lib.format.stream_layout import from_stream
from nanoqwen_lib.format.fileformat import (BLOBS, CHAT_TEMPLATE_BLOB, CONFIG_BLOB, FMT, GENERATION_BLOB,
                                           TOKENIZER_BLOB, Header, TensorEntry, blob_sizes, crc32_of, dims_of,
                                           encode_directory, encode_header, parse_directory, parse_header,
                                           plan_layout)
from nanoqwen_lib.format.hf_meta import check_chat_template, generation_eos, parse_json_object


def _what_directory(path: Path) -> str:
    """How to describe a directory given where a .nanoqwen file was expected."""
    if (path / "config.json").is_file() or any(path.glob("*.safetensors")):
        return (f"a checkpoint directory (pack it first: nanoqwen pack {path} -o "
                f"{path.name or 'model'}.nanoqwen)")
    return "a directory"


class Layout1Tensors(Mapping):
    """A layout-3 file's model tensors as layout 1, under layout.packed_tensors(dims, "int4")
    names: each projection's `.qweight` and `.scales` are made from its `.stream` by
    stream_layout.from_stream when asked for (the last projection converted is kept, so
    reading a projection's qweight and then its scales converts it once); every other
    tensor is the file's own read-only view. `path` names the file in refusals."""

    def __init__(self, path, dims, stored: dict[str, np.ndarray]):
        self.path, self._stored = path, stored
        self._names = dict.fromkeys(packed_tensors(dims, "int4"))     # in file order
        self._from = {}                  # layout-1 name -> (stream name, N, K, 0 qweight / 1 scales)
        for stream, (base, n, k) in stream_sources(dims).items():
            self._from[base + ".qweight"] = (stream, n, k, 0)
            self._from[base + ".scales"] = (stream, n, k, 1)
        self._last: tuple[str | None, tuple] = (None, ())

    def __getitem__(self, name: str) -> np.ndarray:
        src = self._from.get(name)
        if src is None:
            if name not in self._stored or name not in self._names:
                raise KeyError(name)
            return self._stored[name]
        stream, n, k, i = src
        if self._last[0] != stream:
            try:
                pair = from_stream(self._stored[stream], n, k, xp=np)
            except NanoqwenError as e:
                raise FormatError(self.path, f"tensor {stream!r}: {e.field}", e.expected, e.found) from None
            for a in pair:
                a.flags.writeable = False       # as read-only as the mapping it comes from
            self._last = (stream, pair)
        return self._last[1][i]

    def __contains__(self, name) -> bool:      # without converting anything
        return name in self._from or (name in self._stored and name in self._names)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


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
        f = cls(path, h, dims, entries, tensors, verify_payload)
        f.check_blobs()
        return f

    def blob(self, name: str) -> bytes | None:
        t = self.tensors.get(name)
        return None if t is None else t.tobytes()

    def check_blobs(self) -> None:
        """The carried config.json, generation config and chat template parse (before any
        work): every refusal names the file and the blob."""
        if self.blob(CONFIG_BLOB) is not None:
            parse_json_object(self.blob(CONFIG_BLOB), self.path, f"blob {CONFIG_BLOB!r}", FormatError)
        _ = self.generation_eos     # parsed (and refused if bad) now, used by generate
        if self.chat_template is not None:
            check_chat_template(self.chat_template, f"{self.path} blob {CHAT_TEMPLATE_BLOB!r}", FormatError)

    @property
    def hf_config(self) -> dict | None:
        """The checkpoint's own config.json, when the file carries it."""
        raw = self.blob(CONFIG_BLOB)
        return None if raw is None else parse_json_object(raw, self.path, f"blob {CONFIG_BLOB!r}", FormatError)

    @property
    def generation_eos(self) -> tuple[tuple[int, ...], str] | None:
        """(EOS ids, the carried file they come from) by transformers' rule, or None."""
        return generation_eos(self.blob(GENERATION_BLOB), self.blob(CONFIG_BLOB), f"{self.path} blob",
                              self.dims.vocab, FormatError)

    @property
    def chat_template(self) -> str | None:
        raw = self.blob(CHAT_TEMPLATE_BLOB)
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(self.path, f"blob {CHAT_TEMPLATE_BLOB!r}", "UTF-8 text", str(e)) from None

    @property
    def encoding(self) -> str:
        """The projections' weight encoding, from the header's layout_id: "int4" (layouts 1
        and 3) or "fp8" (layout 2)."""
        return LAYOUTS[self.header.layout_id][0]

    @property
    def storage(self) -> str:
        """How the file stores its projections, from the header's layout_id: "split"
        (`.qweight` + `.scales`, layouts 1 and 2) or "stream" (one `.stream`, layout 3)."""
        return LAYOUTS[self.header.layout_id][1]

    @property
    def tokenizer_json(self) -> bytes | None:
        return self.blob(TOKENIZER_BLOB)

    def model_tensors(self) -> Mapping[str, np.ndarray]:
        """The model's tensors only (layout.packed_tensors(dims, self.encoding) names),
        without blobs; the projections in their split storage whatever the file's: a
        layout-3 file's come from its streams (Layout1Tensors), exactly layout 1's."""
        if self.storage == "stream":
            return Layout1Tensors(self.path, self.dims, self.tensors)
        return {k: v for k, v in self.tensors.items() if k not in BLOBS}

    def stream_tensors(self) -> dict[str, np.ndarray] | None:
        """A layout-3 file's projections as stored: `<proj>.stream` -> read-only uint8
        [stream_layout.stream_bytes(N, K)] (N, K: layout.stream_sources(dims)), in file
        order; None for a file that stores them split (layouts 1 and 2)."""
        if self.storage != "stream":
            return None
        return {name: self.tensors[name] for name in stream_sources(self.dims)}

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
                   progress=None, encoding: str = "int4", blobs: dict[str, bytes] | None = None,
                   storage: str = "split") -> Path:
    """Write a .nanoqwen file with this weight encoding, its projections in `storage`
    (layout.STORAGES: "stream" is layout 3, INT4 only). `produce(name, dtype, shape)`
    returns that tensor's array (called once per tensor, in file order, so a packer holds
    one tensor at a time). `progress(nbytes)` is called after each payload. `blobs`
    ({name in fileformat.BLOBS: bytes}) are carried after the tensors, as is
    `tokenizer_json`."""
    layout_id_of(encoding, storage)      # an encoding/storage pair with no layout: refused before any write
    blobs = dict(blobs or {})
    if tokenizer_json is not None:
        blobs[TOKENIZER_BLOB] = tokenizer_json
    unknown = set(blobs) - set(BLOBS)
    if unknown:
        raise ValueError(f"blobs {sorted(unknown)}: one of {list(BLOBS)}")
    entries, data_offset, file_bytes = plan_layout(dims, blob_sizes(blobs), encoding, storage)
    done = []
    with AtomicOutput(path) as out:
        for e in entries:
            if e.name in BLOBS:
                arr = np.frombuffer(bytes(blobs[e.name]), dtype=np.uint8)
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
        out.pwrite(encode_header(dims, done, data_offset, file_bytes, directory, encoding, storage), 0)
    return Path(path)
