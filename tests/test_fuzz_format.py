"""Fuzzing the .nanoqwen reader (hypothesis, bounded in time).

Whatever bytes are changed, `NanoqwenFile.open` either returns a file whose every
payload matches its CRC, or raises FormatError naming the file: never another exception,
a hang, or an out-of-bounds read (the reader only touches [0, file length) through mmap
views whose bounds it checked). Interesting failures are kept as a corpus that the
tests regenerate (CORPUS below: a mutation spec each, applied to a fresh micro file).
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoqwen_lib.errors import FormatError
from nanoqwen_lib.format.fileformat import FMT, HEADER_FIELDS
from nanoqwen_lib.format.weightfile import NanoqwenFile, write_nanoqwen

from .test_fileformat import MICRO, random_producer

_BASE: dict = {}


def base_bytes(tmp_path_factory) -> bytes:
    if "raw" not in _BASE:
        p = tmp_path_factory.mktemp("fuzz") / "base.nanoqwen"
        write_nanoqwen(p, MICRO, random_producer(11), tokenizer_json=b'{"x": 1}')
        _BASE["raw"] = p.read_bytes()
        _BASE["data_offset"] = NanoqwenFile.open(p).header.data_offset
    return _BASE["raw"]


def open_mutated(tmp_path, raw: bytes):
    p = tmp_path / "m.nanoqwen"
    p.write_bytes(raw)
    try:
        f = NanoqwenFile.open(p)
    except FormatError as e:
        assert str(p) in str(e) and "expected" in str(e) and "found" in str(e), str(e)
        return "refused"
    # Accepted: then it must be exactly consistent (no mutation slipped past the checks
    # other than one that leaves the file valid, e.g. a byte set to its own value).
    f.verify()
    return "accepted"


@pytest.fixture
def raw(tmp_path_factory):
    return base_bytes(tmp_path_factory)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_header_and_directory_mutations_are_refused_cleanly(tmp_path, raw, data):
    end = _BASE["data_offset"]
    n = data.draw(st.integers(1, 4))
    buf = bytearray(raw)
    for _ in range(n):
        i = data.draw(st.integers(0, end - 1))
        buf[i] = data.draw(st.integers(0, 255))
    outcome = open_mutated(tmp_path, bytes(buf))
    if bytes(buf) != raw:
        assert outcome == "refused"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_payload_mutations_are_caught_by_crc(tmp_path, raw, data):
    i = data.draw(st.integers(_BASE["data_offset"], len(raw) - 1))
    v = data.draw(st.integers(0, 255))
    buf = bytearray(raw)
    changed = buf[i] != v
    buf[i] = v
    outcome = open_mutated(tmp_path, bytes(buf))
    # Bytes in the alignment padding between payloads belong to no tensor: a change there is
    # harmless and accepted; a change inside a payload must be refused.
    if changed and _inside_payload(raw, i):
        assert outcome == "refused"


def _inside_payload(raw: bytes, i: int) -> bool:
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "b.nanoqwen"
        p.write_bytes(raw)
        f = NanoqwenFile.open(p, verify_payload=False)
        return any(e.offset <= i < e.offset + e.nbytes for e in f.entries)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from([k for k, c, _ in HEADER_FIELDS if c in "IQ"]), value=st.integers(0, 2**32 - 1))
def test_sealed_header_field_values_refused_or_consistent(tmp_path, raw, field, value):
    """Set one integer header field to any value and re-seal the header CRC, so the check
    under test is the field's own validation, not the CRC."""
    import zlib
    off = 0
    for k, code, _ in HEADER_FIELDS:
        size = struct.calcsize("<" + code)
        if k == field:
            break
        off += size
    buf = bytearray(raw)
    struct.pack_into("<" + code, buf, off, value)
    struct.pack_into("<I", buf, FMT.header_bytes - 4, zlib.crc32(bytes(buf[:FMT.header_bytes - 4])))
    outcome = open_mutated(tmp_path, bytes(buf))
    # max_position is the one integer field whose other values describe another valid
    # model (generate refuses longer requests); every other change must be refused.
    if bytes(buf) != raw and field != "max_position":
        assert outcome == "refused"


# Regression corpus: mutations that once deserved a look. Each is (offset from, value).
CORPUS = [
    ("dir_bytes huge", "header", "dir_bytes", 2**63),
    ("data_offset past the end", "header", "data_offset", 2**40),
    ("n_tensors zero", "header", "n_tensors", 0),
    ("n_tensors huge", "header", "n_tensors", 2**31),
    ("vocab zero", "header", "vocab", 0),
    ("num_kv_heads zero", "header", "num_kv_heads", 0),
    ("head_dim zero", "header", "head_dim", 0),
]


@pytest.mark.parametrize("name,where,field,value", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus(tmp_path, raw, name, where, field, value):
    import zlib
    off = 0
    for k, code, _ in HEADER_FIELDS:
        if k == field:
            break
        off += struct.calcsize("<" + code)
    buf = bytearray(raw)
    struct.pack_into("<" + code, buf, off, value)
    struct.pack_into("<I", buf, FMT.header_bytes - 4, zlib.crc32(bytes(buf[:FMT.header_bytes - 4])))
    assert open_mutated(tmp_path, bytes(buf)) == "refused"


def test_random_garbage_files(tmp_path):
    rng = np.random.default_rng(5)
    for n in (0, 1, 255, 256, 257, 4096):
        assert open_mutated(tmp_path, rng.integers(0, 256, n, dtype=np.uint8).tobytes()) == "refused"
    assert open_mutated(tmp_path, FMT.magic.encode() + bytes(300)) == "refused"


@pytest.mark.parametrize("num_layers", [2**20, 2**32 - 1])
def test_huge_num_layers_refused_without_building_names(tmp_path, raw, num_layers):
    """A sealed header claiming billions of layers is refused by arithmetic, at once."""
    import time
    import zlib
    off = 0
    for k, code, _ in HEADER_FIELDS:
        if k == "num_layers":
            break
        off += struct.calcsize("<" + code)
    buf = bytearray(raw)
    struct.pack_into("<I", buf, off, num_layers)
    struct.pack_into("<I", buf, FMT.header_bytes - 4, zlib.crc32(bytes(buf[:FMT.header_bytes - 4])))
    t0 = time.perf_counter()
    assert open_mutated(tmp_path, bytes(buf)) == "refused"
    assert time.perf_counter() - t0 < 5
