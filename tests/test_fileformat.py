"""The .nanoqwen file: round trip and atomic writes. Every validation the reader makes is
a case of tests/bad_inputs.py (run by tests/test_bad_inputs.py), built with the helpers
below (`MICRO`, `random_producer`, `_rewrite`)."""
from __future__ import annotations

import dataclasses
import os
import struct
import zlib

import numpy as np
import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.format.fileformat import (DIR_STRUCT, FMT, HEADER_CRC_AT, HEADER_FIELDS, HEADER_STRUCT,
                                     TOKENIZER_BLOB, plan_layout)
from nanoqwen_lib.format.weightfile import NanoqwenFile, write_nanoqwen

# Small vocab and one layer: same structure as `tiny`, a file of a few MB.
MICRO = dataclasses.replace(load().model("tiny"), vocab=512, num_layers=1)


def random_producer(seed):
    rng = np.random.default_rng(seed)

    def produce(name, dtype, shape):
        if dtype == np.uint32:
            return rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        return rng.standard_normal(shape).astype(np.float16)
    return produce


def stream_producer(seed):
    """random_producer(seed)'s tensors for a layout-3 file: each `<proj>.stream` is
    to_stream of the `.qweight` and `.scales` random_producer(seed) makes for a layout-1
    file, drawn in the same order, so both files hold the same model."""
    from nanoqwen_lib.format.layout import projection_tensors, stream_sources
    from nanoqwen_lib.format.stream_layout import to_stream
    split, sources = random_producer(seed), stream_sources(MICRO)

    def produce(name, dtype, shape):
        if name in sources:
            base, n, k = sources[name]
            t = {sfx: split(f"{base}.{sfx}", dt, sh) for sfx, (dt, sh) in projection_tensors("int4", n, k).items()}
            return to_stream(t["qweight"], t["scales"])
        return split(name, dtype, shape)
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


# --------------------------------------------------------------------------- corruption helpers

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
        names = [f[0] for f in __import__("nanoqwen_lib.format.fileformat", fromlist=["DIR_FIELDS"]).DIR_FIELDS]
        for k, v in patch.items():
            vals[names.index(k)] = v
        DIR_STRUCT.pack_into(raw, base, *vals)
    if fix_crcs:
        d0 = FMT.header_bytes
        struct.pack_into("<I", raw, _field_offset("dir_crc32")[0],
                         zlib.crc32(bytes(raw[d0:d0 + n * FMT.dir_entry_bytes])))
        struct.pack_into("<I", raw, HEADER_CRC_AT, zlib.crc32(bytes(raw[:HEADER_CRC_AT])))
    path.write_bytes(bytes(raw))


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


def test_blobs_round_trip_and_are_validated(tmp_path):
    """config.json, generation_config.json and the chat template ride after the tensors;
    a carried generation config or template that does not parse is refused at open,
    naming the file and the blob."""
    from nanoqwen_lib.errors import FormatError
    from nanoqwen_lib.format.fileformat import CHAT_TEMPLATE_BLOB, CONFIG_BLOB, GENERATION_BLOB
    blobs = {CONFIG_BLOB: b'{"eos_token_id": 3}', GENERATION_BLOB: b'{"eos_token_id": [4, 5]}',
             CHAT_TEMPLATE_BLOB: "{{ messages[0]['content'] }}\u00df".encode()}
    path = tmp_path / "b.nanoqwen"
    write_nanoqwen(path, MICRO, random_producer(2), tokenizer_json=b'{"model": {}}', blobs=blobs)
    f = NanoqwenFile.open(path)
    assert [e.name for e in f.entries][-4:] == ["tokenizer.json", CONFIG_BLOB, GENERATION_BLOB, CHAT_TEMPLATE_BLOB]
    assert f.hf_config == {"eos_token_id": 3} and f.generation_eos == ((4, 5), "generation_config.json")
    assert f.chat_template == "{{ messages[0]['content'] }}\u00df" and set(f.model_tensors()).isdisjoint(blobs)
    no_gen = tmp_path / "c.nanoqwen"
    write_nanoqwen(no_gen, MICRO, random_producer(2), blobs={CONFIG_BLOB: blobs[CONFIG_BLOB]})
    assert NanoqwenFile.open(no_gen).generation_eos == ((3,), "config.json")
    for name, raw, field in ((GENERATION_BLOB, b'{"eos_token_id": "x"}', "eos_token_id"),
                             (CONFIG_BLOB, b"[1]", "blob 'config.json'"),
                             (CHAT_TEMPLATE_BLOB, b"{% if %}", "chat_template")):
        bad = tmp_path / f"bad-{name}.nanoqwen"
        write_nanoqwen(bad, MICRO, random_producer(2), blobs={**blobs, name: raw})
        with pytest.raises(FormatError, match=field) as e:
            NanoqwenFile.open(bad)
        assert str(bad) in str(e.value)
