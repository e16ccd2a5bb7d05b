#!/usr/bin/env python3
"""A few decode steps of the persistent kernel on a small model, for compute-sanitizer.

    compute-sanitizer --tool racecheck python3 tools/sanitize_persistent.py
    compute-sanitizer --tool synccheck python3 tools/sanitize_persistent.py --model tiny-hd64
    compute-sanitizer --tool racecheck python3 tools/sanitize_persistent.py --defines NQ_PD_LOADER=4,NQ_PD_LOADER_SELF=1

Packs (or reuses) the synthetic `--model` file, prefills a short prompt on shuffled pages and
runs `--steps` persistent steps eagerly (no graph: the sanitizer follows launches). Under the
sanitizer every CTA still has to be resident at once; the kernel's waits time out (error 3)
rather than hang if the tool's slower execution ever starved one. Prints the tokens and
the device error scalar; exits 0 whatever they are: the verdict is the sanitizer's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=19)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--defines", default="", help="a lab build's knobs, 'A=1,B=2' (default: the default build)")
    a = ap.parse_args(argv)
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    f = NanoqwenFile.open(packed_synthetic(a.model, seed=0))
    eng = GpuBackend(f, max_tokens=128, graphs=False, decode="persistent")
    if a.defines:
        from nanoqwen_lib.gpu.persistent import PersistentStep
        eng.pd = PersistentStep(eng, defines={k: int(v) for k, v in (p.split("=", 1) for p in a.defines.split(","))})
    rng = np.random.default_rng(a.seed)
    ids = [eng.prefill(rng.integers(0, 151643, a.prompt_tokens).tolist(), physical_pages=rng.permutation(eng.pages))]
    for _ in range(a.steps):
        ids.append(eng.decode(ids[-1]))
    print(f"model {a.model} {a.defines}: tokens {ids}; device error {int(eng.scalar['error'].get()[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
