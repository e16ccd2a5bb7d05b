"""Write book/data/persistent-bounds-loader.json (chapter 10's decomposition of the default
kernel and the loader build, one run) from the JSON of

    python tools/bench_persistent.py --timelines --spread --variants loader-bounds --json RAW.json

(tools/device_run.sh persistent-variants with VARIANTS=loader-bounds), run on the GPU at COMMIT:

    python tools/record_bounds.py RAW.json --gpu "NVIDIA H100 80GB HBM3" --commit 6760c13

Each row goes to the build whose knobs it sets (measure.decomposition.bounds_record); the
record's provenance is that commit's (records.write with commit=)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from nanoqwen_lib.gpu import decode_knobs
    from nanoqwen_lib.measure import decomposition, records
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--commit", required=True)
    a = ap.parse_args()
    rec = decomposition.bounds_record(json.loads(a.raw.read_text()), {"default": {}, "loader warp": decode_knobs.LOADER},
                                      a.gpu, a.commit)
    rec["source"] = ("tools/bench_persistent.py --timelines --spread --variants loader-bounds --json (one engine, "
                     "synthetic 7B, prompt 512, 64 steps between eager launches, CUDA events, median)")
    path = decomposition.SPLIT_RECORD
    records.write(path, rec, records.measures_for(path), commit=a.commit)
    print(records.load(path).banner())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
