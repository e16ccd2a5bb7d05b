"""The launchers' buffer checks, on the CPU: CuPy is replaced by a stand-in whose ndarray
carries what the checks read (dtype, shape, flags, data.ptr)."""
import sys
import types

import numpy as np
import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_int4_weights, check_no_alias, device_ptr


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
    for mod in (ops_gemv, ops_prefill):
        with pytest.raises(NanoqwenError) as ei:
            mod._check("fn", "x", bad, np.float16, (8,))
        assert ei.value.file == f"{mod.__name__.split('.')[-1]}.fn"


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
