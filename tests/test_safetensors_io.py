"""Our safetensors reader/writer against the real `safetensors` library (through torch), both ways."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from nanoqwen_lib.errors import CheckpointError
from nanoqwen_lib.format.safetensors_io import (SafetensorsWriter, bf16_bits, load_tensor, read_header,
                                         write_safetensors)

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _tensors(rng) -> dict[str, np.ndarray]:
    # wide dynamic range, odd shapes, a scalar-like and an empty tensor
    return {
        "a.weight": (rng.standard_normal((37, 129)) * 10.0 ** rng.integers(-3, 3, (37, 1))).astype(np.float32),
        "b.bias": rng.standard_normal(11).astype(np.float32),
        "c.one": np.array([3.14159], np.float32),
        "d.empty": np.zeros((0, 4), np.float32),
    }


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_ours_written_torch_reads(tmp_path, dtype):
    arrays = _tensors(np.random.default_rng(1))
    path = write_safetensors(tmp_path / "x.safetensors", arrays, dtype=dtype, metadata={"format": "pt"})
    got = st_torch.load_file(str(path))
    assert set(got) == set(arrays)
    for name, a in arrays.items():
        want = torch.from_numpy(a).to(TORCH_DTYPES[dtype])        # torch rounds to nearest even
        assert got[name].dtype == want.dtype and tuple(got[name].shape) == a.shape
        assert torch.equal(got[name], want), name                  # every element, same rounding
    _, meta, data_start = read_header(path)
    assert meta == {"format": "pt"} and data_start % 8 == 0


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_torch_written_ours_reads(tmp_path, dtype):
    rng = np.random.default_rng(2)
    ts = {k: torch.from_numpy(v).to(TORCH_DTYPES[dtype]) for k, v in _tensors(rng).items()}
    path = tmp_path / "t.safetensors"
    st_torch.save_file(ts, str(path), metadata={"k": "v"})
    tensors, meta, _ = read_header(path)
    assert meta == {"k": "v"}
    for name, t in ts.items():
        assert tensors[name].dtype == dtype and tensors[name].shape == tuple(t.shape)
        got = load_tensor(path, name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, t.float().numpy())     # bf16/f16 -> f32 is exact


def test_bf16_round_to_nearest_even_matches_torch():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    # force many exact halfway cases (low half 0x8000) with both parities of the kept bit
    bits[:50_000] = (bits[:50_000] & 0xFFFF0000) | 0x8000
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    x = np.concatenate([x, np.float32([np.inf, -np.inf, 0.0, -0.0, 3.3895314e38])])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16_bits(x), want)
    assert np.isnan((bf16_bits(np.float32([np.nan])).astype(np.uint32) << 16).view(np.float32)).all()


def test_writer_is_atomic(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(RuntimeError):
        with SafetensorsWriter(path, {"x": ("F32", (4,))}) as w:
            w.write(np.zeros(2, np.float32))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []                          # no file, no temp left
    with pytest.raises(ValueError, match="declares"):
        with SafetensorsWriter(path, {"x": ("F32", (4,))}) as w:
            w.write(np.zeros(3, np.float32))                       # short: refused at close
    assert list(tmp_path.iterdir()) == []


# ---- error paths: each names the file and the tensor/field ---------------------------
def _raw_file(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_truncated_file_says_so(tmp_path):
    path = write_safetensors(tmp_path / "full.safetensors",
                             {"first": np.ones((8, 8), np.float32), "second.weight": np.ones((64, 64), np.float32)})
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        read_header(cut)
    msg = str(e.value)
    assert str(cut) in msg and "'second.weight'" in msg and "truncated" in msg
    for n in (0, 5):
        tiny = tmp_path / f"len{n}.safetensors"
        tiny.write_bytes(b"\x01" * n)
        with pytest.raises(CheckpointError, match=f"{tiny}.*header length.*truncated"):
            read_header(tiny)
    head = tmp_path / "head.safetensors"
    head.write_bytes(path.read_bytes()[:20])                          # cut inside the JSON header
    with pytest.raises(CheckpointError, match=f"{head}.*header length.*truncated"):
        read_header(head)


def test_unknown_dtype_names_tensor(tmp_path):
    path = tmp_path / "i32.safetensors"
    st_torch.save_file({"ok": torch.zeros(3), "model.norm.weight": torch.zeros(4, dtype=torch.int32)}, str(path))
    with pytest.raises(CheckpointError) as e:
        read_header(path)
    assert str(path) in str(e.value) and "'model.norm.weight' dtype" in str(e.value) and "I32" in str(e.value)


@pytest.mark.parametrize("header,data,field", [
    ({"t": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(20), "'t' byte size"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}}, bytes(8), "'t' data_offsets"),
    ({"t": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, bytes(8), "'t' shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "'b' data_offsets"),
])
def test_bad_headers(tmp_path, header, data, field):
    path = tmp_path / "bad.safetensors"
    _raw_file(path, header, data)
    with pytest.raises(CheckpointError) as e:
        read_header(path)
    assert str(path) in str(e.value) and field in str(e.value)


def test_garbage_header(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{" + bytes(8))
    with pytest.raises(CheckpointError, match=f"{path}: header: expected valid UTF-8 JSON"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 10**12) + bytes(8))
    with pytest.raises(CheckpointError, match=f"{path}: header length"):
        read_header(path)
