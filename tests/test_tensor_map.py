"""nanoqwen_lib.gpu.tensor_map on the CPU: the arguments of cuTensorMapEncodeTiled (innermost
first, byte strides) and the checks that name the field the driver would reject. The
encoding itself needs the driver (the GPU test at the end)."""
import numpy as np
import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.gpu import tensor_map as tm


def test_a_2d_fp16_tile_map():
    a = tm.tiled_args(0x7F0000000000, (512, 3584), np.float16, (128, 64))
    assert a.rank == 2 and a.data_type == tm.DATA_TYPES[np.dtype(np.float16)]
    assert a.dims == (3584, 512) and a.strides == (3584 * 2,) and a.box == (64, 128)
    assert a.swizzle == tm.SWIZZLES["128B"] and a.elem_strides == (1, 1) and a.oob_fill == 0


def test_fp8_codes_and_3d_strides():
    a = tm.tiled_args(256, (37888, 3584), np.uint8, (128, 128))
    assert a.dims == (3584, 37888) and a.strides == (3584,) and a.box == (128, 128)
    b = tm.tiled_args(256, (4, 8, 64), np.float16, (1, 8, 64), swizzle="none")
    assert b.dims == (64, 8, 4) and b.strides == (128, 1024) and b.box == (64, 8, 1)


@pytest.mark.parametrize("kw,field", [
    (dict(address=8), "address"),
    (dict(shape=(512, 3584, 1, 1, 1, 1)), "shape"),
    (dict(shape=(0, 3584)), "shape[0]"),
    (dict(box=(128,)), "box"),
    (dict(box=(300, 64)), "box[0]"),
    (dict(box=(128, 4)), "box[-1]"),                  # 8 bytes: not a multiple of 16
    (dict(box=(128, 128)), "box[-1]"),                # 256 bytes > the 128-byte swizzle span
    (dict(dtype=np.int8), "dtype"),
    (dict(strides=(7000, 2)), "strides[0]"),          # not a multiple of 16
    (dict(strides=(7168, 4)), "strides[-1]"),
    (dict(swizzle="256B"), "swizzle"),
])
def test_each_bad_field_is_named(kw, field):
    args = dict(address=0x1000, shape=(512, 3584), dtype=np.float16, box=(128, 64))
    args.update(kw)
    with pytest.raises(NanoqwenError) as ei:
        tm.tiled_args(args.pop("address"), args.pop("shape"), args.pop("dtype"), args.pop("box"), **args)
    assert ei.value.field == field, str(ei.value)


@pytest.mark.gpu
def test_the_driver_encodes_a_map():
    cp = pytest.importorskip("cupy")
    from nanoqwen_lib.gpu import cuda_build
    if not cuda_build.have_gpu():
        pytest.skip("no CUDA GPU")
    x = cp.zeros((512, 3584), cp.float16)
    dev = tm.device_map(x, (128, 64))
    assert dev.shape == (128,) and dev.dtype == cp.uint8 and int(dev.data.ptr) % 64 == 0
    assert tm.device_map(x, (128, 64)) is dev                     # cached
    assert int(cp.count_nonzero(dev)) > 0
