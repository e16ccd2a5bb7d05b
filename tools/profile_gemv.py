"""One decode GEMV at a 7B shape, launched a few times, for a profiler (needs a GPU).

    ncu --launch-skip 3 --launch-count 1 --kernel-name regex:nq_gemv --section WarpStateStats \\
        python tools/profile_gemv.py gate_up --impl bulk --define NQ_GEMV_FOLD=1

Random weights (speed does not depend on their values); the launcher's own plan for the
impl and tuning given, exactly as tools/bench_gemv.py times them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

from nanoqwen_lib import config  # noqa: E402
from nanoqwen_lib.format import layout
from nanoqwen_lib.gpu.lab import gemv as lab_gemv

SHAPES = layout.decode_gemv_shapes(config.load().model("7b"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("--impl", default=None, choices=lab_gemv.IMPLS)
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, a tuning knob")
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args(argv)
    n, k = SHAPES[a.shape]
    tuning = {name: int(v) for name, v in (d.split("=", 1) for d in a.define)} or None
    x = (cp.random.standard_normal(k) * 0.5).astype(cp.float16)
    qw = cp.random.randint(0, 2**31, size=(n, k // 8), dtype=cp.int64).astype(cp.uint32)
    scales = cp.random.uniform(0.002, 0.02, size=(n, k // 128)).astype(cp.float16)
    out = cp.zeros(n, cp.float16)
    for _ in range(a.launches):
        lab_gemv.gemv_int4(x, qw, scales, out, tuning=tuning, impl=a.impl)
    cp.cuda.Device().synchronize()
    print(f"{a.shape} {n}x{k} impl={a.impl or 'tiles'} tuning={tuning}: {a.launches} launches")


if __name__ == "__main__":
    main()
