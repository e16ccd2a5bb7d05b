#!/usr/bin/env bash
# One budgeted device call of the validation plan: STEPS (device_run.sh steps, run in order,
# each with the environment given as ENV=VALUE words before it), then fault injection if FAULTS is
# set and time is left. BUDGET: the call's seconds. Logs under $OUT.
set -uo pipefail
T0=$(date +%s)
left() { echo $(( ${BUDGET:-580} - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NANOQWEN_CACHE=${NANOQWEN_CACHE:-/tmp/nqc}
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
for step in ${STEPS:-}; do
  case $step in
    *=*=*|SMS=*) export NANOQWEN_SMS=${step#SMS=}; [ "$NANOQWEN_SMS" = all ] && unset NANOQWEN_SMS; echo "NANOQWEN_SMS=${NANOQWEN_SMS:-unset}"; continue ;;
  esac
  l=$(( $(left) - 10 )); [ $l -lt 30 ] && { echo "no time left for $step"; continue; }
  if [ $step = retest ]; then   # the node ids listed in .retest (GPU tests to run again), 4 workers
    bash tools/device_run.sh >/dev/null; t1=$(date +%s)
    timeout $l python3 -m pytest -q -rfE -n 4 --dist loadfile -p no:cacheprovider $(cat .retest) 2>&1 \
      | tee $OUT/retest-${NANOQWEN_SMS:-all}.log | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12
    echo "retest (SMs: ${NANOQWEN_SMS:-all}): $(( $(date +%s) - t1 )) s"; continue
  fi
  timeout $l bash tools/device_run.sh $step
done
if [ -n "${FAULTS:-}" ]; then
  unset NANOQWEN_SMS
  l=$(( $(left) - 10 ))
  [ $l -gt 60 ] && timeout $l bash tools/fault_injection.sh $FAULTS 2>&1 | tee $OUT/faults.log | tail -16
fi
echo "call: $(( $(date +%s) - T0 )) s"
