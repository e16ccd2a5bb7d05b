"""Hugging Face checkpoint -> .nanoqwen: quantize the seven projections (INT4 by default,
or FP8 E4M3 with `weights="fp8"`), keep the rest FP16. INT4 projections are stored in
layout 1 (`.qweight` + `.scales`, the default) or, with `layout="stream"`, in layout 3
(one `.stream` each: format/stream_layout.py).

One tensor is read, converted and written at a time, so the 7B (15 GB of bf16) packs on a
24 GB machine. The checkpoint is validated completely (config, index, shards, names,
dtypes, shapes) before the first byte is written; NaN/Inf is refused as each tensor is
read; the output appears only when complete (weightfile.AtomicOutput).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nanoqwen_lib.format.checkpoint import Checkpoint
from nanoqwen_lib.errors import CheckpointError
from nanoqwen_lib.format.fileformat import TOKENIZER_BLOB, plan_layout
from nanoqwen_lib.format.layout import ENCODINGS, STORAGES, STREAM_LAYOUT_ID
from nanoqwen_lib.format.quant import pack_int4_value_shuffle, quantize_fp8_rowwise, quantize_int4_groupwise
from nanoqwen_lib.format.stream_layout import to_stream
from nanoqwen_lib.format.weightfile import write_nanoqwen

FP16_MAX = float(np.finfo(np.float16).max)


class _Producer:
    """Turns HF tensors into the file's tensors, in the file's order. A projection's
    `.qweight` comes right before its `.scales`, so the scales are kept for one call; a
    `.stream` (layout 3) is the same codes and scales, re-tiled by to_stream."""

    def __init__(self, ckpt: Checkpoint, weights: str = "int4"):
        self.ckpt, self.weights = ckpt, weights
        self.pending_scales: tuple[str, np.ndarray] | None = None

    def __call__(self, name: str, dtype, shape) -> np.ndarray:
        if name.endswith(".stream"):
            codes, scales = quantize_int4_groupwise(self.ckpt.tensor(name[: -len(".stream")] + ".weight"))
            return to_stream(pack_int4_value_shuffle(codes), scales)
        if name.endswith(".qweight"):
            hf = name[: -len(".qweight")] + ".weight"
            if self.weights == "fp8":
                codes, scales = quantize_fp8_rowwise(self.ckpt.tensor(hf))      # -> uint8 E4M3, fp32 [out]
            else:
                codes, scales = quantize_int4_groupwise(self.ckpt.tensor(hf))   # -> int8 [out, in], fp16
                codes = pack_int4_value_shuffle(codes)
            self.pending_scales = (name[: -len(".qweight")] + ".scales", scales)
            return codes
        if name.endswith(".scales"):
            want, scales = self.pending_scales
            assert want == name, (want, name)
            self.pending_scales = None
            return scales
        w = self.ckpt.tensor(name)
        big = np.abs(w) > FP16_MAX
        if big.any():
            raise CheckpointError(self.ckpt.file_of(name), f"tensor {name!r}",
                                  f"values within FP16 range (|x| <= {FP16_MAX:g})",
                                  f"{int(big.sum())} values outside, max |x| = {float(np.abs(w).max()):g}")
        return w.astype(np.float16)


def pack_checkpoint(ckpt_dir, out_path, progress: bool = True, include_tokenizer: bool = True,
                    weights: str = "int4", layout: str = "split") -> Path:
    """Pack a Hugging Face Qwen2 checkpoint directory into a .nanoqwen file; `weights` is
    the projections' encoding, "int4" (the default) or "fp8"; `layout` their storage,
    "split" (codes and scales in two tensors: layout 1 for int4, 2 for fp8; the default) or
    "stream" (int4 only: layout 3, one lane-fragment stream per projection)."""
    if weights not in ENCODINGS:
        raise CheckpointError("<arguments>", "weights", f"one of {sorted(ENCODINGS)}", repr(weights))
    if layout not in STORAGES:
        raise CheckpointError("<arguments>", "layout", f"one of {list(STORAGES)}", repr(layout))
    if layout == "stream" and weights != "int4":
        raise CheckpointError("<arguments>", "layout", f"'split' for {weights} weights (layout {STREAM_LAYOUT_ID}, "
                              "'stream', holds INT4 only)", repr(layout))
    ckpt = Checkpoint.open(ckpt_dir)  # validates everything before any work
    tok_path = ckpt.tokenizer_json_path() if include_tokenizer else None
    blobs = ckpt.blobs()
    if tok_path:
        blobs[TOKENIZER_BLOB] = Path(tok_path).read_bytes()
    _, _, total = plan_layout(ckpt.dims, blobs, weights, layout)
    bar = None
    if progress:
        from tqdm import tqdm  # the console bar: no ipywidgets needed in notebooks
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"pack {Path(out_path).name}")
    try:
        return write_nanoqwen(out_path, ckpt.dims, _Producer(ckpt, weights),
                              progress=bar.update if bar else None, encoding=weights, blobs=blobs,
                              storage=layout)
    finally:
        if bar:
            bar.close()
