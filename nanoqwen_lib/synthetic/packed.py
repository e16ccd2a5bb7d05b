"""Cached synthetic models for the demo, the chapters and the tests (never in the repo)."""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from nanoqwen_lib.synthetic.cache import build_once, cache_dir, synthetic_checkpoint
from nanoqwen_lib.format.packer import pack_checkpoint
from nanoqwen_lib.synthetic.checkpoint import RECIPE_VERSION


def _tag(weights: str, layout: str) -> str:
    return ("" if weights == "int4" else f"-{weights}") + ("" if layout == "split" else f"-{layout}")


def packed_synthetic(dims_name: str = "tiny", seed: int = 0, progress: bool = False,
                     weights: str = "int4", layout: str = "split") -> Path:
    """The .nanoqwen file of the synthetic `dims_name` checkpoint, packed once (with the
    projections' encoding `weights`: int4 or fp8, stored `layout`: split, or stream for
    layout 3) and cached."""
    out = cache_dir() / f"{dims_name}-seed{seed}-r{RECIPE_VERSION}{_tag(weights, layout)}.nanoqwen"
    # pack_checkpoint writes through weightfile.AtomicOutput (an unnamed file, then a rename)
    return build_once(out, lambda path: pack_checkpoint(synthetic_checkpoint(dims_name, seed=seed, progress=progress),
                                                        path, progress=progress, weights=weights, layout=layout))


# A 7B checkpoint in bf16 is 15 GB and packing it quantizes 7.6e9 weights: minutes of CPU.
# For GPU tests and benchmarks, where speed does not depend on weight values, the packed
# file can be written directly: uniform INT4 codes in [-7, 7] (what the quantizer emits)
# and per-group FP16 scales chosen so the dequantized weights have the same std as the
# synthesizer's recipe; the FP16 tensors are the synthesizer's own values.
CODE_STD = float(np.sqrt(np.mean(np.arange(-7, 8) ** 2)))   # std of codes uniform in [-7, 7]
_PAIR_LUT = np.array([((lo & 0xF) | ((hi & 0xF) << 4)) for hi in range(-7, 8) for lo in range(-7, 8)],
                     dtype=np.uint8)                          # 225 byte values: two codes each


def _fp8_code_lut() -> np.ndarray:
    """65536 E4M3 codes at the quantiles of what quantize_fp8_rowwise emits for a Gaussian
    row (absmax ~ 4 sigma -> 448): indexing it with uniform uint16 draws samples that
    distribution at memory speed (the 7B has 7.6e9 weights)."""
    from nanoqwen_lib.format.quant import fp8_e4m3_encode
    g = np.random.default_rng(0).standard_normal(1 << 20) * (448 / 4.0)
    codes = fp8_e4m3_encode(np.clip(g, -448, 448))
    order = np.argsort(g, kind="stable")
    return codes[order][np.arange(65536) * (codes.size // 65536)]


def _direct_producer(dims, seed, weights="int4"):
    from nanoqwen_lib.format.quant import fp8_e4m3_decode
    from nanoqwen_lib.synthetic.checkpoint import row_chunks, generate_chunk, tensor_recipe
    lut = _fp8_code_lut() if weights == "fp8" else None
    fp8_code_std = float(fp8_e4m3_decode(lut).astype(np.float64).std()) if weights == "fp8" else None

    def produce(name, dtype, shape):
        if name.endswith(".stream"):      # layout 3: the split storage's own words and scales, re-tiled
            from nanoqwen_lib.format.layout import projection_tensors, stream_sources
            from nanoqwen_lib.format.stream_layout import to_stream
            base, n, k = stream_sources(dims)[name]
            split = {s: produce(f"{base}.{s}", dt, sh) for s, (dt, sh) in projection_tensors("int4", n, k).items()}
            return to_stream(split["qweight"], split["scales"])
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith(".qweight") and weights == "fp8":
            out = np.empty(shape, np.uint8)
            flat = out.reshape(-1)
            step = 1 << 26
            for i in range(0, flat.size, step):
                flat[i:i + step] = lut[rng.integers(0, 65536, min(step, flat.size - i), dtype=np.uint16)]
            return out
        if name.endswith(".scales") and weights == "fp8":
            _, std, _ = tensor_recipe(name[: -len(".scales")] + ".weight", dims)
            jitter = np.exp(0.1 * rng.standard_normal(shape, dtype=np.float32))
            return (std / fp8_code_std * jitter).astype(np.float32)
        if name.endswith(".qweight"):
            out = np.empty(shape, np.uint32)
            flat = out.view(np.uint8).reshape(-1)
            step = 1 << 26
            for i in range(0, flat.size, step):   # codes iid uniform: nibble order is immaterial
                flat[i:i + step] = _PAIR_LUT[rng.integers(0, 225, min(step, flat.size - i), dtype=np.uint8)]
            return out
        if name.endswith(".scales"):
            _, std, _ = tensor_recipe(name[: -len(".scales")] + ".weight", dims)
            jitter = np.exp(0.1 * rng.standard_normal(shape, dtype=np.float32))
            return (std / CODE_STD * jitter).astype(np.float16)
        parts = [generate_chunk(name, dims, seed, shape, k, r0, r1)
                 for k, (r0, r1) in enumerate(row_chunks(shape))]
        bits = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16).reshape(shape)
    return produce


def packed_synthetic_direct(dims_name: str = "7b", seed: int = 0, progress: bool = False,
                            weights: str = "int4", layout: str = "split") -> Path:
    """A .nanoqwen file of `dims_name` written directly (no bf16 checkpoint), cached; the
    projections INT4 (uniform codes) or FP8 (`weights="fp8"`: codes drawn from a Gaussian
    row's E4M3 distribution, FP32 row scales), each with the recipe's weight std. INT4 with
    `layout="stream"` is layout 3, the same words and scales as the split file's."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.format.weightfile import write_nanoqwen
    out = cache_dir() / f"{dims_name}-seed{seed}-r{RECIPE_VERSION}-direct{_tag(weights, layout)}.nanoqwen"

    def build(out: Path) -> None:      # write_nanoqwen writes through weightfile.AtomicOutput
        dims = load().model(dims_name)
        bar = None
        if progress:
            from tqdm import tqdm  # the console bar: no ipywidgets needed in notebooks
            from nanoqwen_lib.format.fileformat import plan_layout
            bar = tqdm(total=plan_layout(dims, None, weights, layout)[2], unit="B", unit_scale=True, desc=out.name)
        write_nanoqwen(out, dims, _direct_producer(dims, seed, weights), progress=bar.update if bar else None,
                       encoding=weights, storage=layout)
        if bar:
            bar.close()

    return build_once(out, build)
