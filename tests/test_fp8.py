"""FP8 E4M3 weights (CPU): the codec against torch's float8_e4m3fn, the row-wise quantizer's
error bound, the file (layout 2) end to end through the packer, the reader and the
reference, refusals, and accuracy against the unquantized weights next to INT4."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from nanoqwen_lib.format import quant
from nanoqwen_lib.errors import FormatError

torch = pytest.importorskip("torch")


def torch_e4m3(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_decode_table_is_e4m3fn():
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(quant.fp8_e4m3_decode(codes), want)      # NaN in the same two places
    assert float(np.nanmax(quant.E4M3_VALUES)) == 448.0 and quant.E4M3_VALUES[1] == 2.0 ** -9


def test_encode_matches_torch(rng):
    finite = quant.E4M3_VALUES[np.isfinite(quant.E4M3_VALUES)].astype(np.float64)
    pos = np.unique(finite[finite > 0])
    ties = (pos[:-1] + pos[1:]) / 2                                          # exact midpoints: to even
    spread = rng.standard_normal(100_000) * 10.0 ** rng.uniform(-5, 2.65, 100_000)
    x = np.concatenate([finite, ties, -ties, spread, [0.0, -0.0, 2.0 ** -10, 2.0 ** -10 * 1.0001]])
    x = x[np.abs(x) <= 448]
    # torch converts through float32 (torch_e4m3), so a float64 just past a midpoint would be
    # rounded twice there (to the midpoint, then to even): compare on float32 values, which
    # both sides then round once (a seed drew 0.0126953125408, 4e-11 above 6.5 / 512)
    x = x.astype(np.float32).astype(np.float64)
    got = quant.fp8_e4m3_encode(x)
    want = torch_e4m3(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(x[i], got[i], want[i]) for i in bad[:5]]


def test_encode_rounds_a_float64_once():
    """Just past a midpoint goes up, just before it goes down, whatever float32 would make of it."""
    finite = quant.E4M3_VALUES[np.isfinite(quant.E4M3_VALUES)].astype(np.float64)
    pos = np.unique(finite[finite > 0])
    mid = (pos[:-1] + pos[1:]) / 2
    up = quant.fp8_e4m3_encode(mid * (1 + 2.0 ** -40))
    down = quant.fp8_e4m3_encode(mid * (1 - 2.0 ** -40))
    np.testing.assert_array_equal(quant.fp8_e4m3_decode(up).astype(np.float64), pos[1:])
    np.testing.assert_array_equal(quant.fp8_e4m3_decode(down).astype(np.float64), pos[:-1])


def test_encode_saturates_and_refuses_nonfinite():
    assert quant.fp8_e4m3_encode(np.array([449.0, 1e6, -1e6])).tolist() == [0x7E, 0x7E, 0xFE]
    with pytest.raises(ValueError):
        quant.fp8_e4m3_encode(np.array([1.0, np.nan]))


@pytest.mark.parametrize("shape", [(64, 896), (7, 128), (3, 4864)])
def test_rowwise_quantizer_bound(rng, shape):
    w = (rng.standard_normal(shape) * rng.uniform(1e-3, 1.0, (shape[0], 1))).astype(np.float32)
    w[1] = 0.0                                                                # a zero row
    codes, scales = quant.quantize_fp8_rowwise(w)
    assert codes.dtype == np.uint8 and codes.shape == shape and scales.dtype == np.float32
    assert scales[1] == 0 and not codes[1].any()
    deq = quant.dequantize_fp8(codes, scales).astype(np.float64)
    # half an E4M3 step: 2^-4 relative for normals, 2^-10 * scale absolute for subnormals,
    # plus the FP32 roundings of w / scale and code * scale
    bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * scales[:, None] + 2.0 ** -22 * np.abs(w)
    err = np.abs(deq - w)
    assert (err <= bound).all(), float((err / np.maximum(bound, 1e-30)).max())
    live = scales > 0
    assert (np.abs(quant.fp8_e4m3_decode(codes[live])).max(axis=1) == 448.0).all()   # row max -> 448


@pytest.fixture(scope="module")
def fp8_tiny():
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    return NanoqwenFile.open(packed_synthetic("tiny", weights="fp8"))


def test_fp8_file_round_trip(fp8_tiny):
    from nanoqwen_lib.synthetic.cache import synthetic_checkpoint
    from nanoqwen_lib.format.checkpoint import Checkpoint
    f = fp8_tiny
    assert f.encoding == "fp8" and f.header.layout_id == 2
    name = "model.layers.1.mlp.down_proj"
    q, s = f.tensors[name + ".qweight"], f.tensors[name + ".scales"]
    assert q.dtype == np.uint8 and q.shape == (896, 2432) and s.dtype == np.float32 and s.shape == (896,)
    w = Checkpoint.open(synthetic_checkpoint("tiny")).tensor(name + ".weight")
    codes, scales = quant.quantize_fp8_rowwise(w)
    np.testing.assert_array_equal(q, codes)
    np.testing.assert_array_equal(s, scales)


def test_fp8_generates_on_the_reference(fp8_tiny):
    """The packed file through ReferenceBackend gives the greedy tokens of a reference model
    built here from the checkpoint itself (each projection quantized by
    quant.quantize_fp8_rowwise, every other tensor cast to its packed dtype): the file, its
    reader and the backend add nothing and drop nothing. The steps are decisive (no top-two
    gap below 1e-3), so equal tokens are a real agreement, not a tie broken the same way."""
    from nanoqwen_lib.format import layout
    from nanoqwen_lib.format.checkpoint import Checkpoint
    from nanoqwen_lib.model.generate import ReferenceBackend, generate_ids
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.synthetic.cache import synthetic_checkpoint
    prompt, n = [9707, 1879, 11], 6
    ids = list(generate_ids(ReferenceBackend(fp8_tiny), prompt, n))
    ck = Checkpoint.open(synthetic_checkpoint("tiny"))
    tensors = {}
    for name, (dtype, _) in layout.packed_tensors(fp8_tiny.dims, "fp8").items():
        if name.endswith(".qweight"):
            proj = name[:-len(".qweight")]
            tensors[name], tensors[proj + ".scales"] = quant.quantize_fp8_rowwise(ck.tensor(proj + ".weight"))
        elif not name.endswith(".scales"):
            tensors[name] = ck.tensor(name).astype(dtype)
    want, gaps = ReferenceModel(fp8_tiny.dims, tensors).greedy(prompt, n)
    assert ids == want, (ids, want)
    assert min(gaps) > 1e-3, gaps


def test_layout_id_is_never_reinterpreted(tmp_path):
    """An INT4 file whose header claims layout 2 (re-sealed, so only the meaning changed)
    is refused at its first projection's dtype, one that claims layout 3 (a projection a
    stream) at its tensor count; an unknown id is refused in the header."""
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.fileformat import FMT, HEADER_CRC_AT, HEADER_FIELDS, HEADER_STRUCT
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    raw = bytearray(packed_synthetic("tiny").read_bytes())
    at = struct.calcsize("<" + "".join(code for _, code, _ in HEADER_FIELDS[:2]))   # magic, version
    assert HEADER_STRUCT.unpack_from(raw)[2] == FMT.layout_id
    for layout, field in ((2, "dtype"), (3, "n_tensors"), (9, "layout_id")):
        bad = bytearray(raw)
        struct.pack_into("<I", bad, at, layout)
        struct.pack_into("<I", bad, HEADER_CRC_AT, zlib.crc32(bytes(bad[:HEADER_CRC_AT])))
        p = tmp_path / f"layout{layout}.nanoqwen"
        p.write_bytes(bad)
        with pytest.raises(FormatError) as ei:
            NanoqwenFile.open(p, verify_payload=False)
        assert field in ei.value.field, str(ei.value)
        p.unlink()                                     # one 0.5 GB copy on disk at a time


def test_fp8_rows_is_the_kernels_rounding(rng):
    """quant.fp8_rows (the reference's FP8 prefill activations) = decode(encode(x / ts)) * ts
    with ts = row absmax / 448; within half an E4M3 step of x; a zero row stays zero."""
    x = (rng.standard_normal((5, 896)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float16).astype(np.float32)
    x[2] = 0
    got = quant.fp8_rows(x)
    ts = np.abs(x).max(axis=1) / np.float32(448)
    assert not got[2].any()
    live = ts > 0
    want = quant.fp8_e4m3_decode(quant.fp8_e4m3_encode((x[live] / ts[live, None]).astype(np.float32))) * ts[live, None]
    np.testing.assert_array_equal(got[live], want)
    assert (np.abs(got - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * ts[:, None] * 1.0001).all()


def test_fp8_is_closer_to_the_fp16_weights_than_int4(fp8_tiny):
    """Logits of the whole tiny model on a 24-token prompt, FP8 and INT4 weights each
    against the unquantized FP16 weights (same activations contract): E4M3 keeps 3 mantissa
    bits per weight where INT4 keeps ~3 bits of a group's range, so FP8 must be closer."""
    from nanoqwen_lib.synthetic.cache import synthetic_checkpoint
    from nanoqwen_lib.format.checkpoint import Checkpoint
    from nanoqwen_lib.format.layout import packed_tensors
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    dims = fp8_tiny.dims
    ck = Checkpoint.open(synthetic_checkpoint("tiny"))
    fp16 = {n: ck.tensor(n).astype(np.float16) for n in packed_tensors(dims, "fp16")}
    prompt = np.random.default_rng(3).integers(0, 151643, 24).tolist()
    base, _ = ReferenceModel(dims, fp16).prefill(prompt)
    rel = {}
    for enc, f in (("fp8", fp8_tiny), ("int4", NanoqwenFile.open(packed_synthetic("tiny")))):
        logits, _ = ReferenceModel(dims, f.model_tensors()).prefill(prompt)
        rel[enc] = float(np.linalg.norm(logits - base) / np.linalg.norm(base))
    print(rel)
    assert rel["fp8"] < rel["int4"] / 2, rel


def test_fp8_prefill_amplifies_one_ulp_noise_int4_does_not():
    """The yardstick of tests/gpu_cases.check_prefill (tests/sensitivity.py): moving the
    embedding by one fp16 ulp moves the FP8 prefill's layer-1 K by percents (E4M3 rounding
    flips), the INT4 prefill's by far less. The GPU test bounds FP8 past layer 0 by it."""
    from nanoqwen_lib.model.reference import ReferenceModel
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile

    from .sensitivity import one_ulp_sensitivity
    prompt = np.random.default_rng(17).integers(0, 151643, 17).tolist()
    seen = {}
    for weights in ("int4", "fp8"):
        f = NanoqwenFile.open(packed_synthetic("tiny", weights=weights))
        seen[weights] = one_ulp_sensitivity(ReferenceModel, f.dims, f.model_tensors(), prompt, (0, 1), np, seed=17)
    (int4_layers, int4_logits), (fp8_layers, fp8_logits) = seen["int4"], seen["fp8"]
    assert max(fp8_layers[1]) > 1e-2 and fp8_logits > 1e-2, seen["fp8"]
    assert max(int4_layers[1]) < 2e-3 and int4_logits < 2e-3, seen["int4"]
    assert max(fp8_layers[1]) > 10 * max(int4_layers[1])


_LOGITS_SCRIPT = """
import hashlib, sys
import numpy as np
from nanoqwen_lib.format import layout
from nanoqwen_lib.format.checkpoint import Checkpoint
from nanoqwen_lib.model.reference import ReferenceModel
from nanoqwen_lib.synthetic.cache import synthetic_checkpoint
ck = Checkpoint.open(synthetic_checkpoint("tiny", progress=False))
fp16 = {n: ck.tensor(n).astype(np.float16) for n in layout.packed_tensors(ck.dims, "fp16")}
prompt = np.random.default_rng(12).integers(0, 151643, 32).tolist()
model = ReferenceModel(ck.dims, fp16)
logits, cache = model.prefill(prompt)
step = model.decode(int(logits[-1].argmax()), cache)
print(hashlib.sha256(logits.tobytes() + step.tobytes()).hexdigest())
"""


def test_reference_logits_do_not_depend_on_the_blas_or_simd_path():
    """Chapter 12's accuracy cells run the reference on the CPU and are compared on every
    machine: the same logits bits with another BLAS kernel and thread count, and with
    NumPy's SIMD paths above its baseline switched off (float32 BLAS sums, fp32 pow and
    exp/sin/cos SIMD paths all differ; the reference sums and evaluates them in float64)."""
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    root = Path(__file__).resolve().parents[1]
    envs = [{}, {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}]
    if platform.machine() in ("x86_64", "AMD64"):
        off = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
        envs.append({"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1",
                     **({"NPY_DISABLE_CPU_FEATURES": off} if off else {})})
    hashes = []
    for extra in envs:
        env = {**os.environ, "PYTHONPATH": str(root), **extra}
        r = subprocess.run([sys.executable, "-c", _LOGITS_SCRIPT], cwd=root, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        hashes.append(r.stdout.split()[-1])
    assert len(set(hashes)) == 1, list(zip(envs, hashes))
