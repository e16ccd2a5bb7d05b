"""One decode step of the synthetic 7B under Nsight Compute, for the ITL work (issue 6).

    ncu --clock-control none --cache-control none --target-processes all \\
        --kernel-name regex:"^nq_" --launch-skip $SKIP --launch-count $COUNT \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats --csv --page raw \\
        python3 tools/profile_decode.py > decode.csv

(tools/device_run.sh profile-decode runs exactly that.) The script prefills the benchmark's
512-token prompt and then runs eager decode steps: eager, so that every kernel is its own
launch that ncu can replay. The launches it prints to stderr before the profiled step
give the --launch-skip that lands on one whole step (every region of
GpuBackend.step_launches once per layer). Caches are not flushed between kernels
(--cache-control none), as in the real step; clocks are not locked (--clock-control none).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from nanoqwen_lib.config import load  # noqa: E402
from nanoqwen_lib.gpu.engine import GpuBackend  # noqa: E402
from nanoqwen_lib.synthetic.packed import packed_synthetic_direct  # noqa: E402
from nanoqwen_lib.format.weightfile import NanoqwenFile  # noqa: E402

STEPS = 2    # the first eager step warms every module; the second is the one to read


def main() -> None:
    f = NanoqwenFile.open(packed_synthetic_direct("7b"), verify_payload=False)
    eng = GpuBackend(f, max_tokens=1024, graphs=False)
    prompt = np.random.default_rng(0).integers(0, 151643, load().benchmark.prompt_tokens).tolist()
    eng.prefill(prompt)
    per_step = len(eng.step_launches(new_page=False))
    print(f"[profile] launcher calls per step: {per_step} (some launch two kernels: split-K "
          f"combines); profile the last {per_step}+ nq_ kernels", file=sys.stderr)
    for _ in range(STEPS):
        eng.launch_step()
    eng.token_at(eng.position - 1)


if __name__ == "__main__":
    main()
