"""The SASS of a kernel's hot loops, on the CPU: instruction mix and instructions per weight.

    python tools/sass_report.py gemv_int4 nq_gemv_int4 [--define NQ_GEMV_UNROLL=2 ...]

Builds kernels/<file>.cu for sm_90 exactly as the runtime does (NVRTC, no GPU),
disassembles it (cuda_build.sass: nvdisasm from the cuda13 extra's `nvidia-cuda-nvdisasm`)
and prints every loop of the kernel: its length, its 16-byte global loads, its most
frequent opcodes. For a GEMV the line to read is lane-instructions per weight. At the read
ceiling an H200 must take ~34 INT4 weights (or ~17 FP8 weights) per SM per clock, and an
SM issues 128 lane-instructions per clock, so above ~3.7 (INT4) or ~7.4 (FP8) per weight a
kernel cannot reach the ceiling; well below that, the limit is the bytes in flight. A
tensor-core kernel shows its MMA path: HMMA (mma.sync), HGMMA / QGMMA (wgmma, sm_90a).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoqwen_lib.gpu import cuda_build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", help="kernels/<file>.cu")
    ap.add_argument("kernel", help="the entry point, e.g. nq_gemv_int4")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE (an nq-variants define)")
    ap.add_argument("--weights-per-load", type=int, default=32, help="weights in one 16-byte load (INT4 32, FP8 16)")
    a = ap.parse_args()
    text = cuda_build.sass(a.file, None, dict(d.split("=", 1) for d in a.define))
    for ops in cuda_build.sass_loops(text, a.kernel):
        count = collections.Counter(ops)
        wide = sum(v for k, v in count.items() if k.startswith("LDG") and ".128" in k)
        line = f"loop of {len(ops)} instructions, {wide} 16-byte global loads"
        if wide:
            line += f": {len(ops) / (wide * a.weights_per_load):.2f} lane-instructions per weight"
        print(line)
        print("   ", ", ".join(f"{k} {v}" for k, v in count.most_common(10)))


if __name__ == "__main__":
    main()
