#!/bin/bash
# One device call for issue 17 (prefill on wgmma): a smoke test that stops early on a hang,
# the GPU tests of the wgmma kernels, then the benchmark at T = 512 (table last).
# Usage on the device machine: bash tools/device_wgmma.sh [pytest -k expression] [bench timeout s]
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=${1:-}
BT=${2:-70}
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
if ! timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_prefill_wgmma.py -k "odd or split_is" \
      > "$OUT/smoke.log" 2>&1; then
  tail -40 "$OUT/smoke.log"; echo "SMOKE FAILED"; exit 1
fi
tail -2 "$OUT/smoke.log"
if [ -n "$K" ]; then
  timeout 150 python3 -m pytest -q --maxfail=4 -p no:cacheprovider -rs tests/test_gpu_prefill_wgmma.py -k "$K" \
      > "$OUT/tests.log" 2>&1
  grep -E "passed|failed|Error|assert|FAILED" "$OUT/tests.log" | tail -25
fi
timeout "$BT" python3 tools/bench_prefill.py --wgmma --tokens 512 --warmup 3 --reps 20 --json "$OUT/bench512.json" \
    > "$OUT/bench.log" 2>&1
tail -60 "$OUT/bench.log"
