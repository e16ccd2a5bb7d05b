#!/usr/bin/env bash
# One device call of this session's plan: the grids, helper tests of the rounding checks, chapters 10, 4, 8.
set -uo pipefail
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
bash tools/device_run.sh ${FIRST:-grids}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NANOQWEN_CACHE=${NANOQWEN_CACHE:-/tmp/nqc}
t=$(( $(left) - 300 )); [ $t -gt 150 ] && t=150
if [ $t -gt 30 ] && [ -n "${TESTS:-}" ]; then
  timeout $t python3 -m pytest -q -rfE -n 4 -p no:cacheprovider $TESTS 2>&1 | tee $OUT/tests.log | tail -15
fi
export NANOQWEN_WRITE_RECORDS=1
mkdir -p /tmp/exec-logs
for n in ${CHAPTERS:-10 04 08}; do
  nb=$(ls book/$n-*.ipynb); jupytext --to ipynb "${nb%.ipynb}.md" -o "$nb" --update >/dev/null 2>&1; t1=$(date +%s); l=$(( $(left) - 15 ))
  [ $l -lt 30 ] && { echo "no time left for $nb"; continue; }
  timeout $l jupyter execute --inplace "$nb" >/tmp/exec-logs/$n.log 2>&1 && r=ok || r=FAILED
  echo "executed $nb: $r in $(( $(date +%s) - t1 )) s"; [ $r = ok ] || tail -5 /tmp/exec-logs/$n.log
done
tar czf $OUT/executed.tgz book/*.ipynb book/data -C /tmp exec-logs
echo "call: $(( $(date +%s) - T0 )) s"
