#!/bin/bash
# One device call for issue 17 (prefill on wgmma), <= 200 s in all (run it under timeout 230): a
# smoke test that stops early on a hang (60 s; the TMA layout probes before it, 20 s), the
# selected GPU tests of the wgmma kernels (100 s: 7B at T 17 / 512, FP8 at 17 / 512, every tiny
# shape, the odd shapes, split-K determinism, launch checks), then bench_prefill --wgmma --quick at
# T = 512 in the time left (INT4: the plan + bench_prefill.QUICK_INT4's bn / split candidates per
# shape, the fused SwiGLU at the plan and bn 128; FP8: the plan; mma.sync plan; cuBLAS; the table last). Logs and the JSON to $OUT. Every step runs under `timeout`: a hang fails, rc 124.
# Usage on the device machine: bash tools/device_wgmma.sh [pytest -k expression] [total budget s]
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=${1:-"(int4_7b and (17 or 512)) or (fp8 and (17 or 512)) or int4_tiny or odd or split_is or launch_checks"}
BUDGET=${2:-200}
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
# The TMA layouts alone first (kernels/lab/tma_probe.cu): if the GEMMs fail, this says whether
# the copy engine or the kernel is at fault. It never stops the run.
timeout -k 5 20 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_prefill_wgmma.py -k "tma_" > "$OUT/tma.log" 2>&1
echo "tma probes rc $?"; grep -E "passed|failed|Error|assert" "$OUT/tma.log" | tail -8
timeout -k 5 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_prefill_wgmma.py -k "odd or split_is" \
    > "$OUT/smoke.log" 2>&1
rc=$?
tail -3 "$OUT/smoke.log"
if [ $rc -ne 0 ]; then
  grep -E "Error|error|assert|FAILED|Timeout" "$OUT/smoke.log" | head -30; echo "SMOKE FAILED rc $rc (124: timeout)"; exit 1
fi
timeout -k 5 100 python3 -m pytest -q --maxfail=6 -p no:cacheprovider -rs tests/test_gpu_prefill_wgmma.py -k "$K" \
    > "$OUT/tests.log" 2>&1
echo "tests rc $? after $((SECONDS - T0)) s"
grep -E "passed|failed|Error|assert|FAILED" "$OUT/tests.log" | tail -25
LEFT=$((BUDGET - (SECONDS - T0)))
[ $LEFT -lt 30 ] && LEFT=30
timeout -k 5 $LEFT python3 tools/bench_prefill.py --wgmma --quick --tokens 512 --warmup 3 --reps 20 --json "$OUT/bench512.json" \
    > "$OUT/bench.log" 2>&1
echo "bench rc $? (124: out of its ${LEFT} s) after $((SECONDS - T0)) s"
tail -80 "$OUT/bench.log"
