"""Layout 3 as a file layout: `pack_checkpoint(..., layout="stream")` / `nanoqwen pack
--layout stream` store each INT4 projection as one `<proj>.stream`; the reader hands the
model back as layout 1 (model_tensors) and the streams as stored (stream_tensors). The
refusals of a bad layout-3 file are cases of tests/bad_inputs.py."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nanoqwen_lib.errors import CheckpointError, FormatError
from nanoqwen_lib.format import stream_layout as sl
from nanoqwen_lib.format.layout import (LAYOUTS, decode_gemv_shapes, layout_id_of, packed_tensor_count,
                                        packed_tensors, projection_tensors, stream_sources)
from nanoqwen_lib.format.weightfile import Layout1Tensors, NanoqwenFile, write_nanoqwen

from .test_cli import run_cli
from .test_fileformat import MICRO, random_producer, stream_producer
from .test_stream_layout import rand_layout1


# ----------------------------------------------------------------------------- the repacker's xp

def test_xp_numpy_is_the_same_code(rng):
    """to_stream / from_stream with xp=numpy (the path a CuPy array takes, with cupy as xp)
    give the default's bytes; a CuPy array picks cupy, imported only then."""
    words, scales = rand_layout1(rng, 40, 384)
    s = sl.to_stream(words, scales)
    np.testing.assert_array_equal(sl.to_stream(words, scales, xp=np), s)
    w2, s2 = sl.from_stream(s, 40, 384, xp=np)
    np.testing.assert_array_equal(w2, words)
    np.testing.assert_array_equal(s2.view(np.uint16), scales.view(np.uint16))
    assert sl.array_module(words) is np and sl.array_module(words, xp="given") == "given"


def test_array_module_picks_cupy_for_a_cupy_array(monkeypatch):
    fake = type(sys)("cupy")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    CupyArray = type("ndarray", (), {"__module__": "cupy._core.core"})
    assert sl.array_module(CupyArray()) is fake


def test_no_cupy_import_at_module_level():
    code = ("import sys, nanoqwen_lib.format.stream_layout, nanoqwen_lib.format.weightfile, "
            "nanoqwen_lib.format.packer; assert 'cupy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stacked_projections_stream_is_the_concatenation(rng):
    """Every projection's N is a multiple of 16, so the engine's stacked matrices (q, k, v ->
    qkv; gate, up -> gate_up) in layout 3 are their projections' streams end to end."""
    for dims in (MICRO,):
        n_q, n_kv, k = dims.q_dim, dims.kv_dim, dims.hidden
        parts = [rand_layout1(rng, n, k) for n in (n_q, n_kv, n_kv)]
        stacked = sl.to_stream(np.concatenate([w for w, _ in parts]), np.concatenate([s for _, s in parts]))
        np.testing.assert_array_equal(stacked, np.concatenate([sl.to_stream(w, s) for w, s in parts]))
        assert stacked.size == sl.stream_bytes(*decode_gemv_shapes(dims)["qkv"])


# ----------------------------------------------------------------------------- layout tables

def test_layout_ids_and_tensor_lists():
    assert LAYOUTS[1] == ("int4", "split") and LAYOUTS[2] == ("fp8", "split") and LAYOUTS[3] == ("int4", "stream")
    assert layout_id_of("int4", "stream") == sl.LAYOUT_ID == 3 and layout_id_of("int4") == 1
    with pytest.raises(ValueError):
        layout_id_of("fp8", "stream")
    with pytest.raises(ValueError):
        projection_tensors("fp8", 128, 128, "stream")
    t = packed_tensors(MICRO, "int4", "stream")
    assert len(t) == packed_tensor_count(MICRO, "stream") == packed_tensor_count(MICRO) - 7 * MICRO.num_layers
    for name, (base, n, k) in stream_sources(MICRO).items():
        assert t[name] == (np.dtype("u1"), (sl.stream_bytes(n, k),))
        assert base + ".qweight" not in t and base + ".scales" not in t


# ----------------------------------------------------------------------------- MICRO files

@pytest.fixture(scope="module")
def micro_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    split, stream = d / "split.nanoqwen", d / "stream.nanoqwen"
    write_nanoqwen(split, MICRO, random_producer(5), tokenizer_json=b'{"model": {}}')
    write_nanoqwen(stream, MICRO, stream_producer(5), tokenizer_json=b'{"model": {}}', storage="stream")
    return NanoqwenFile.open(split), NanoqwenFile.open(stream)


def assert_same_model(a, b):
    """model_tensors() of `a` and `b` agree name for name, dtype, shape and every byte (a
    tensor both files store: its verified payload CRC; a projection: compared)."""
    ta, tb = a.model_tensors(), b.model_tensors()
    assert list(ta) == list(tb) == list(packed_tensors(a.dims, "int4"))
    assert a.payload_verified and b.payload_verified
    crc_a, crc_b = ({e.name: e.crc32 for e in f.entries} for f in (a, b))
    for name in ta:
        x, y = ta[name], tb[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if name in crc_a and name in crc_b:
            assert crc_a[name] == crc_b[name], name
        else:
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)


def test_micro_round_trip(micro_pair):
    split, stream = micro_pair
    assert (split.header.layout_id, split.encoding, split.storage) == (1, "int4", "split")
    assert (stream.header.layout_id, stream.encoding, stream.storage) == (3, "int4", "stream")
    assert_same_model(split, stream)
    assert split.stream_tensors() is None
    streams = stream.stream_tensors()
    assert list(streams) == list(stream_sources(MICRO))
    flat = split.model_tensors()
    for name, (base, n, k) in stream_sources(MICRO).items():
        assert streams[name].dtype == np.uint8 and not streams[name].flags.writeable
        np.testing.assert_array_equal(streams[name], sl.to_stream(flat[base + ".qweight"], flat[base + ".scales"]))
    assert stream.tokenizer_json == b'{"model": {}}' and "tokenizer.json" not in stream.model_tensors()
    stream.verify()


def test_layout1_view_is_a_read_only_mapping(micro_pair):
    _, stream = micro_pair
    t = stream.model_tensors()
    q = "model.layers.0.self_attn.q_proj."
    assert q + "qweight" in t and q + "stream" not in t and "tokenizer.json" not in t
    assert t.get(q + "stream") is None and len(t) == len(packed_tensors(MICRO))
    assert t[q + "qweight"] is t[q + "qweight"]            # a projection is converted once in a row
    with pytest.raises(ValueError):
        t[q + "scales"][0, 0] = 1
    with pytest.raises(KeyError):
        t[q + "stream"]


def test_layout1_view_names_the_file_when_a_stream_does_not_convert(tmp_path):
    """Unreachable through open() (the directory pins every stream's size and valid dims
    have no padding rows); the view still refuses in the house format."""
    name, (base, n, k) = next(iter(stream_sources(MICRO).items()))
    view = Layout1Tensors(tmp_path / "x.nanoqwen", MICRO, {name: np.zeros(sl.stream_bytes(n, k) - 1, np.uint8)})
    with pytest.raises(FormatError) as e:
        view[base + ".scales"]
    assert str(tmp_path / "x.nanoqwen") in str(e.value) and e.value.field == f"tensor {name!r}: stream.shape"


def test_write_refuses_fp8_in_the_stream_storage(tmp_path):
    with pytest.raises(ValueError, match="stream"):
        write_nanoqwen(tmp_path / "x.nanoqwen", MICRO, random_producer(1), encoding="fp8", storage="stream")
    assert list(tmp_path.iterdir()) == []


def test_direct_producer_stream_is_its_split_words(rng):
    from nanoqwen_lib.synthetic.packed import _direct_producer
    produce = _direct_producer(MICRO, seed=3)
    name, (base, n, k) = list(stream_sources(MICRO).items())[1]            # k_proj: small
    split = {sfx: produce(f"{base}.{sfx}", dt, sh) for sfx, (dt, sh) in projection_tensors("int4", n, k).items()}
    np.testing.assert_array_equal(produce(name, np.uint8, (sl.stream_bytes(n, k),)),
                                  sl.to_stream(split["qweight"], split["scales"]))


# ----------------------------------------------------------------------------- the packer and CLI

@pytest.fixture(scope="module")
def tiny_pair():
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    return (NanoqwenFile.open(packed_synthetic("tiny")),
            NanoqwenFile.open(packed_synthetic("tiny", layout="stream")))


def test_tiny_packed_both_ways_is_one_model(tiny_pair):
    split, stream = tiny_pair
    assert stream.header.layout_id == 3 and stream.storage == "stream" and stream.encoding == "int4"
    assert_same_model(split, stream)
    assert stream.blob("tokenizer.json") == split.blob("tokenizer.json")
    assert stream.path.stat().st_size <= split.path.stat().st_size     # the same bytes, fewer tensors


def test_reference_model_reads_a_stream_file(tiny_pair):
    from nanoqwen_lib.model.reference import ReferenceModel
    logits = [ReferenceModel(f.dims, f.model_tensors()).prefill([9707, 1879, 11])[0] for f in tiny_pair]
    assert np.isfinite(logits[0]).all()
    np.testing.assert_array_equal(logits[0], logits[1])


def test_pack_refuses_bad_layout_arguments(tmp_path):
    from nanoqwen_lib.format.packer import pack_checkpoint
    for weights, layout, found in (("int4", "tiles", "'tiles'"), ("fp8", "stream", "'stream'")):
        with pytest.raises(CheckpointError) as e:
            pack_checkpoint(tmp_path / "nothing", tmp_path / "x.nanoqwen", progress=False, weights=weights,
                            layout=layout)
        assert e.value.field == "layout" and found in str(e.value.found)
    assert list(tmp_path.iterdir()) == []


def test_cli_pack_layout_stream_and_inspect(tmp_path):
    from .bad_inputs import micro_checkpoint
    out = tmp_path / "s.nanoqwen"
    r = run_cli("pack", micro_checkpoint(), "-o", out, "--layout", "stream", "--quiet")
    assert r.returncode == 0, r.stderr
    f = NanoqwenFile.open(out)
    assert f.storage == "stream" and f.stream_tensors() is not None
    r = run_cli("inspect", out, "--verify")
    assert r.returncode == 0, r.stderr
    assert "layout       3: int4, stream storage" in r.stdout and "q_proj.stream" in r.stdout
