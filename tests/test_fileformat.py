"""The .nanoqwen file: round trip, and every validation the reader makes, one by one."""
from __future__ import annotations

import dataclasses
import os
import struct
import zlib

import numpy as np
import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import FormatError
from nanoqwen_lib.fileformat import (DIR_STRUCT, FMT, HEADER_CRC_AT, HEADER_FIELDS, HEADER_STRUCT,
                                     TOKENIZER_BLOB, plan_layout)
from nanoqwen_lib.weightfile import NanoqwenFile, write_nanoqwen

# Small vocab and one layer: same structure as `tiny`, a file of a few MB.
MICRO = dataclasses.replace(load().model("tiny"), vocab=512, num_layers=1)


def random_producer(seed):
    rng = np.random.default_rng(seed)

    def produce(name, dtype, shape):
        if dtype == np.uint32:
            return rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        return rng.standard_normal(shape).astype(np.float16)
    return produce


@pytest.fixture
def micro_file(tmp_path):
    path = tmp_path / "micro.nanoqwen"
    write_nanoqwen(path, MICRO, random_producer(1), tokenizer_json=b'{"model": {}}')
    return path


def test_round_trip_exact(tmp_path):
    path = tmp_path / "rt.nanoqwen"
    write_nanoqwen(path, MICRO, random_producer(7))
    f = NanoqwenFile.open(path)
    again = random_producer(7)
    for e in f.entries:
        np.testing.assert_array_equal(f.tensors[e.name], again(e.name, e.dtype, e.shape))
        assert e.offset % FMT.alignment == 0
    assert f.dims == MICRO and f.tokenizer_json is None
    assert path.stat().st_size == f.header.file_bytes


def test_tokenizer_blob_carried(micro_file):
    f = NanoqwenFile.open(micro_file)
    assert f.tokenizer_json == b'{"model": {}}'
    assert TOKENIZER_BLOB not in f.model_tensors()


def test_header_is_256_bytes_and_layout_is_planned():
    assert HEADER_STRUCT.size <= HEADER_CRC_AT == 252
    entries, data_offset, total = plan_layout(MICRO)
    assert data_offset % 128 == 0 and total % 128 == 0
    assert all(b.offset >= a.offset + a.nbytes for a, b in zip(entries, entries[1:]))


# --------------------------------------------------------------------------- corruption

def _field_offset(name):
    off = 0
    for n, code, _ in HEADER_FIELDS:
        if n == name:
            return off, code
        off += struct.calcsize("<" + code)
    raise KeyError(name)


def _rewrite(path, header_patch=None, dir_patch=None, fix_crcs=True):
    """Patch header fields / directory entries, then (optionally) re-seal the CRCs so the
    reader gets past them to the check under test."""
    raw = bytearray(path.read_bytes())
    for name, value in (header_patch or {}).items():
        off, code = _field_offset(name)
        struct.pack_into("<" + code, raw, off, value)
    n = struct.unpack_from("<I", raw, _field_offset("n_tensors")[0])[0]
    for i, patch in (dir_patch or {}).items():
        base = FMT.header_bytes + i * FMT.dir_entry_bytes
        vals = list(DIR_STRUCT.unpack_from(raw, base))
        names = [f[0] for f in __import__("nanoqwen_lib.fileformat", fromlist=["DIR_FIELDS"]).DIR_FIELDS]
        for k, v in patch.items():
            vals[names.index(k)] = v
        DIR_STRUCT.pack_into(raw, base, *vals)
    if fix_crcs:
        d0 = FMT.header_bytes
        struct.pack_into("<I", raw, _field_offset("dir_crc32")[0],
                         zlib.crc32(bytes(raw[d0:d0 + n * FMT.dir_entry_bytes])))
        struct.pack_into("<I", raw, HEADER_CRC_AT, zlib.crc32(bytes(raw[:HEADER_CRC_AT])))
    path.write_bytes(bytes(raw))


def _refused(path, field_part, **kw):
    with pytest.raises(FormatError) as ei:
        NanoqwenFile.open(path, **kw)
    msg = str(ei.value)
    assert str(path) in msg and field_part in msg and "expected" in msg and "found" in msg, msg
    return msg


@pytest.mark.parametrize("field,value", [
    ("magic", b"NOTQWEN!"), ("version", 2), ("layout_id", 9), ("group_size", 64),
    ("alignment", 64), ("num_heads", 6), ("head_dim", 96), ("hidden", 900),
    ("file_bytes", 12345), ("dir_offset", 512), ("n_tensors", 3), ("data_offset", 4096 * 1024),
    ("tie_embeddings", 7), ("flags", 1),
])
def test_bad_header_field_refused(micro_file, field, value):
    _rewrite(micro_file, header_patch={field: value})
    _refused(micro_file, field if field not in ("num_heads", "head_dim", "hidden") else "header")


def test_header_crc_catches_unsealed_change(micro_file):
    _rewrite(micro_file, header_patch={"rope_theta": 10.0}, fix_crcs=False)
    _refused(micro_file, "header_crc32")


def test_directory_crc_catches_unsealed_change(micro_file):
    raw = bytearray(micro_file.read_bytes())
    raw[FMT.header_bytes + 3] ^= 0x20  # a letter of the first name
    micro_file.write_bytes(bytes(raw))
    _refused(micro_file, "dir_crc32")


@pytest.mark.parametrize("patch,field", [
    ({"offset": 200}, "offset"),              # misaligned / inside the directory
    ({"nbytes": 8}, "nbytes"),
    ({"shape0": 7}, "shape"),
    ({"dtype": 9}, "dtype"),
    ({"ndim": 3}, "ndim"),
    ({"name": b"model.layers.0.bogus.weight"}, "tensors"),
])
def test_bad_directory_entry_refused(micro_file, patch, field):
    _rewrite(micro_file, dir_patch={1: patch})
    _refused(micro_file, field)


def test_overlap_refused(micro_file):
    f = NanoqwenFile.open(micro_file)
    e1 = f.entries[1]
    del f
    _rewrite(micro_file, dir_patch={2: {"offset": e1.offset}})
    _refused(micro_file, "offset")


def test_payload_past_end_refused(micro_file):
    size = micro_file.stat().st_size
    _rewrite(micro_file, dir_patch={3: {"offset": size - 128}})
    _refused(micro_file, "end")


@pytest.mark.parametrize("cut", [0, 100, 255, 1000, -1])
def test_truncated_refused(micro_file, cut):
    raw = micro_file.read_bytes()
    micro_file.write_bytes(raw[:cut] if cut >= 0 else raw[:-128])
    _refused(micro_file, "file")


def test_payload_flip_caught_by_crc_and_opt_out(micro_file):
    f = NanoqwenFile.open(micro_file)
    victim = f.entries[5]
    del f
    raw = bytearray(micro_file.read_bytes())
    raw[victim.offset + 17] ^= 0x01
    micro_file.write_bytes(bytes(raw))
    msg = _refused(micro_file, "crc32")
    assert victim.name in msg
    g = NanoqwenFile.open(micro_file, verify_payload=False)  # the opt-out loads...
    with pytest.raises(FormatError):                        # ...and verify() still catches it
        g.verify()


def test_missing_file_refused(tmp_path):
    _refused(tmp_path / "nope.nanoqwen", "path")


# --------------------------------------------------------------------------- atomic writes

class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_interrupted_write_leaves_nothing(tmp_path, exc):
    calls = {"n": 0}
    base = random_producer(3)

    def produce(name, dtype, shape):
        calls["n"] += 1
        if calls["n"] == 4:
            raise exc()
        return base(name, dtype, shape)

    with pytest.raises(exc):
        write_nanoqwen(tmp_path / "x.nanoqwen", MICRO, produce)
    assert os.listdir(tmp_path) == []


def test_existing_file_replaced_only_when_complete(tmp_path):
    path = tmp_path / "m.nanoqwen"
    write_nanoqwen(path, MICRO, random_producer(1))
    before = path.read_bytes()

    def failing(name, dtype, shape):
        raise Boom()
    with pytest.raises(Boom):
        write_nanoqwen(path, MICRO, failing)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.nanoqwen"]
