"""The launchers' buffer checks, on the CPU: CuPy is replaced by a stand-in whose ndarray
carries what the checks read (dtype, shape, flags, data.ptr)."""
import sys
import types

import numpy as np
import pytest

from nanoqwen_lib.errors import LimitError, NanoqwenError
from nanoqwen_lib.gpu.launch_checks import (check_device_buffer, check_int4_weights, check_no_alias,
                                            check_prefill_gemm, device_ptr)


class FakeDeviceArray:
    def __init__(self, shape, dtype, ptr, contiguous=True):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)
        self.strides = (0,) * len(shape)
        self.data = types.SimpleNamespace(ptr=ptr)


@pytest.fixture(autouse=True)
def fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeDeviceArray))


def test_a_good_buffer_passes():
    check_device_buffer("ops_gemv.gemv_int4", "x", FakeDeviceArray((3584,), np.float16, 0x7f0000000080),
                        np.float16, (3584,))


@pytest.mark.parametrize("a,field", [
    (np.zeros(8, np.float16), "x"),                                         # host array
    (FakeDeviceArray((8,), np.float32, 128), "x.dtype"),
    (FakeDeviceArray((9,), np.float16, 128), "x.shape"),
    (FakeDeviceArray((8,), np.float16, 128, contiguous=False), "x"),
    (FakeDeviceArray((8,), np.float16, 130), "x.data.ptr"),
])
def test_each_violation_named(a, field):
    with pytest.raises(NanoqwenError) as ei:
        check_device_buffer("ops_gemv.gemv_int4", "x", a, np.float16, (8,))
    e = ei.value
    assert e.file == "ops_gemv.gemv_int4" and e.field == field and "expected" in str(e) and "found" in str(e)


def test_alias_and_optional_pointers():
    a = FakeDeviceArray((8,), np.float16, 256)
    with pytest.raises(NanoqwenError):
        check_no_alias("ops_gemv.gemv_int4_swiglu", "out", a, a, "gate_up")
    check_no_alias("ops_gemv.gemv_int4_swiglu", "out", a, None, "gate_up")
    assert device_ptr(None) == 0 and device_ptr(a) == 256


def test_ops_modules_route_through_the_shared_checks():
    from nanoqwen_lib.gpu import ops_gemv, ops_prefill
    bad = FakeDeviceArray((8,), np.float32, 128)
    with pytest.raises(NanoqwenError) as ei:
        ops_gemv._check("fn", "x", bad, np.float16, (8,))
    assert ei.value.file == "ops_gemv.fn"
    # the prefill GEMMs (either kernel) and swiglu_act: the error names the public launcher
    qw, sc = FakeDeviceArray((128, 32), np.uint32, 128), FakeDeviceArray((128, 2), np.float16, 256)
    x32, out = FakeDeviceArray((4, 256), np.float32, 384), FakeDeviceArray((4, 128), np.float16, 4096)
    for call, file, field in [
        (lambda: ops_prefill.gemm_int4(x32, qw, sc, out, kernel="mma"), "ops_prefill.gemm_int4", "x.dtype"),
        (lambda: ops_prefill.gemm_int4(x32, qw, sc, out, kernel="wgmma"), "ops_prefill.gemm_int4", "x.dtype"),
        (lambda: ops_prefill.gemm_int4_swiglu(x32, qw, sc, out), "ops_prefill.gemm_int4_swiglu", "gate_up.dtype"),
        (lambda: ops_prefill.gemm_int4_gate_up_swiglu(x32, qw, sc, out), "ops_prefill.gemm_int4_gate_up_swiglu",
         "x.dtype"),
        (lambda: ops_prefill.swiglu_act(x32, out), "ops_prefill.swiglu_act", "gate_up.dtype"),
    ]:
        with pytest.raises(NanoqwenError) as ei:
            call()
        assert (ei.value.file, ei.value.field) == (file, field), str(ei.value)


def test_int4_weights_give_n_k_and_refuse_what_no_kernel_can_read():
    """One check for the GEMV and the prefill GEMM: (N, K) of uint32 codes [N, K/8] with fp16
    scales [N, K/128]; K must hold at least one group (K = 0 would launch an empty range)."""
    qw = FakeDeviceArray((4608, 3584 // 8), np.uint32, 128)
    sc = FakeDeviceArray((4608, 3584 // 128), np.float16, 256)
    assert check_int4_weights("ops_gemv.gemv_int4", qw, sc) == (4608, 3584)
    for bad_qw, bad_sc, field in [
        (FakeDeviceArray((4608, 0), np.uint32, 128), FakeDeviceArray((4608, 0), np.float16, 256), "qweight.shape"),
        (FakeDeviceArray((4608, 3), np.uint32, 128), sc, "qweight.shape"),                 # K = 24
        (FakeDeviceArray((4608,), np.uint32, 128), sc, "qweight.shape"),
        (FakeDeviceArray((4608, 448), np.int32, 128), sc, "qweight.dtype"),
        (qw, FakeDeviceArray((4608, 27), np.float16, 256), "scales.shape"),
    ]:
        with pytest.raises(NanoqwenError) as ei:
            check_int4_weights("ops_prefill.gemm_int4", bad_qw, bad_sc)
        assert ei.value.field == field and "ops_prefill.gemm_int4" in str(ei.value), str(ei.value)



def _gemm_args(t=4, n=256, k=256, **change):
    """A prefill GEMM's x fp16 [T, K], out fp16 [T, N], bias [N], residual [T, N] at distinct
    aligned addresses, with `change` replacing some."""
    args = dict(x=FakeDeviceArray((t, k), np.float16, 1 << 20), out=FakeDeviceArray((t, n), np.float16, 2 << 20),
                bias=FakeDeviceArray((n,), np.float16, 3 << 20), residual=FakeDeviceArray((t, n), np.float16, 4 << 20))
    return {**args, **change}


def test_prefill_gemm_arguments_give_t():
    """launch_checks.check_prefill_gemm, the one check of a prefill GEMM's activations: T of x
    [T, K] with out [T, N], bias [N] and residual [T, N] (which may be `out`: in place)."""
    a = _gemm_args(n=128)
    assert check_prefill_gemm("ops_prefill.gemm_int4", a["x"], a["out"], 128, 256, a["bias"], a["residual"],
                              weight_elems=128 * 32) == 4
    assert check_prefill_gemm("ops_prefill.gemm_int4", a["x"], a["out"], 128, 256, residual=a["out"],
                              weight_elems=128 * 32) == 4
    gate_up = FakeDeviceArray((4, 512), np.float16, 5 << 20)                 # x_cols: the SwiGLU GEMM's [T, 2K]
    assert check_prefill_gemm("ops_prefill.gemm_int4_swiglu", gate_up, a["out"], 128, 256, x_field="gate_up",
                              x_cols=512, weight_elems=128 * 32) == 4
    act = FakeDeviceArray((4, 64), np.float16, 6 << 20)                      # out_cols: the fused gate_up's [T, I]
    assert check_prefill_gemm("ops_prefill.gemm_int4_gate_up_swiglu", a["x"], act, 128, 256, out_field="act",
                              out_cols=64, weight_elems=128 * 32) == 4
    xq = FakeDeviceArray((4, 256), np.uint8, 7 << 20)                        # FP8: E4M3 codes, no alias check
    assert check_prefill_gemm("ops_fp8.gemm_fp8", xq, a["out"], 128, 256, x_field="xq", x_dtype=np.uint8,
                              weight_elems=128 * 256, alias=False) == 4


@pytest.mark.parametrize("change,field", [
    (dict(x=FakeDeviceArray((0, 256), np.float16, 128)), "x.shape"),           # T = 0
    (dict(x=FakeDeviceArray((256,), np.float16, 128)), "x.shape"),             # not [T, K]
    (dict(x=FakeDeviceArray((4, 256), np.float32, 128)), "x.dtype"),
    (dict(x=FakeDeviceArray((4, 128), np.float16, 128)), "x.shape"),           # K of the weights: 256
    (dict(out=FakeDeviceArray((4, 255), np.float16, 128)), "out.shape"),
    (dict(out=FakeDeviceArray((4, 256), np.float16, 136)), "out.data.ptr"),
    (dict(bias=FakeDeviceArray((255,), np.float16, 128)), "bias.shape"),
    (dict(residual=FakeDeviceArray((4, 256), np.float32, 128)), "residual.dtype"),
    (dict(out=None), "out"),                                                   # out is x (N = K here)
])
def test_prefill_gemm_arguments_each_violation_named(change, field):
    a = _gemm_args(**change)
    if a["out"] is None:
        a["out"] = a["x"]
    with pytest.raises(NanoqwenError) as ei:
        check_prefill_gemm("ops_prefill.gemm_int4", a["x"], a["out"], 256, 256, a["bias"], a["residual"],
                           weight_elems=256 * 32)
    assert ei.value.file == "ops_prefill.gemm_int4" and ei.value.field == field, str(ei.value)


def test_prefill_gemm_32_bit_offsets():
    """T * x_cols, the weight array and (out_offsets) T * out_cols stay below 2^31 elements."""
    t = 1 << 23
    x, out = FakeDeviceArray((t, 128), np.float16, 1 << 20), FakeDeviceArray((t, 256), np.float16, 2 << 20)
    wide = FakeDeviceArray((t, 256), np.float16, 3 << 20)          # T * 256 = 2^31
    assert check_prefill_gemm("g", x, out, 256, 128, weight_elems=256 * 16, out_offsets=False) == t
    for args, kw in [((x, out), dict()),                                     # T * N
                     ((wide, out), dict(x_cols=256, out_offsets=False)),    # T * row of x
                     ((x, out), dict(weight_elems=2**31, out_offsets=False))]:
        with pytest.raises(LimitError) as ei:
            check_prefill_gemm("g", *args, 256, 128, **{"weight_elems": 256 * 16, **kw})
        assert ei.value.field == "T * row length", str(ei.value)
