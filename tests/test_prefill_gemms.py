"""measure.prefill_gemms' arithmetic and table (CPU); its timings are the chapter's and the
benchmark's, on the GPU."""
from nanoqwen_lib.measure import prefill_gemms as pg


def test_per_layer_sums_and_table():
    rows = [{"matrix": m, "n": 8, "k": 128, "kernel": k, "ms": ms, "tflops": tf}
            for m, k, ms, tf in (("qkv", "wgmma", 0.1, 500.0), ("qkv", "mma", 0.2, 250.0),
                                 ("down", "wgmma", 0.3, 600.0), ("down", "mma", 0.4, 450.0))]
    assert pg.per_layer(rows) == {"wgmma": 0.1 + 0.3, "mma": 0.2 + 0.4}
    text = pg.format_rates(rows, 28)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["matrix", "wgmma", "mma"]
    assert lines[1].split() == ["qkv", "500", "250"] and lines[2].split() == ["down", "600", "450"]
    assert lines[-1].split() == ["x28", f"{0.4 * 28:.2f}", f"{0.6 * 28:.2f}"]


def test_every_kernel_has_a_launch_name():
    assert pg.KERNELS == ("wgmma", "mma", "cublas fp16", "fp8 wgmma", "fp8 mma")
