#!/usr/bin/env bash
# tools/fault_injection.sh: issue 31's deliberate faults, one at a time. Each is put into its
# kernel's source in place (a sed expression), the tests that must catch it are run, and the
# source is put back byte for byte from a backup (checked with cmp; also on Ctrl-C or error).
# Every test is run once on the clean source first: a fault counts as caught by a test only
# when that test passes clean and fails faulted.
#
#   tools/fault_injection.sh                  all faults (a b-mma b-wgmma c), on a GPU
#   tools/fault_injection.sh a c              some of them
#   tools/fault_injection.sh --compile-only   no GPU: apply each fault to a scratch copy of
#                                             kernels/ and compile it through NVRTC (sm_90/90a)
#
# Faults (the issue's "done when"):
#   a        a GEMV that zeroes one output row (gemv_int4.cuh store_row: row 1 stored as 0)
#   b-mma    the mma.sync prefill GEMM's epilogue rounds toward zero (prefill_gemm.cu store_tile)
#   b-wgmma  the wgmma prefill GEMM's INT4 epilogue rounds toward zero (prefill_wgmma.cu)
#   c        the persistent step drops one K slice of down (the last of NQ_PD_DOWN_KS, where the
#            last unit of a tile set adds the slices: kernels/decode/gemv.cuh)
set -u
cd "$(dirname "$0")/.."

FAULTS=(a b-mma b-wgmma c)
declare -A FILE SED CHECK TESTS
FILE[a]=kernels/gemv_int4.cuh
SED[a]='s|^  e\.out\[row\] = __float2half_rn(v);$|  e.out[row] = row == 1 ? __float2half_rn(0.f) : __float2half_rn(v);   // FAULT a|'
CHECK[a]='FAULT a'
TESTS[a]="tests/test_gpu_gemv.py::test_gemv_int4_7b[qkv] tests/test_gpu_gemv.py::test_gemv_int4_grid_exact[qkv-plain-None-table]"

FILE[b-mma]=kernels/prefill_gemm.cu
SED[b-mma]='s|= __floats2half2_rn(v\.x, v\.y);   // col even|= __halves2half2(__float2half_rz(v.x), __float2half_rz(v.y));   // FAULT b col even|; s|dst\[0\] = __float2half_rn(v\.x);|dst[0] = __float2half_rz(v.x);|; s|if (two) dst\[1\] = __float2half_rn(v\.y);|if (two) dst[1] = __float2half_rz(v.y);|'
CHECK[b-mma]='FAULT b'
TESTS[b-mma]="tests/test_gpu_prefill.py::test_gemm_odd[plain-130-136-384] tests/test_gpu_prefill.py::test_gemm_grid_exact[qkv-17-planned]"

FILE[b-wgmma]=kernels/prefill_wgmma.cu
SED[b-wgmma]='s|^          \*dst = __floats2half2_rn(v0, v1);$|          *dst = __halves2half2(__float2half_rz(v0), __float2half_rz(v1));   // FAULT b|'
CHECK[b-wgmma]='FAULT b'
TESTS[b-wgmma]="tests/test_gpu_prefill_wgmma.py::test_wgmma_int4_odd tests/test_gpu_prefill_wgmma.py::test_wgmma_int4_grid_exact[qkv-17]"

FILE[c]=kernels/decode/gemv.cuh
SED[c]='s|for (int s = 0; s < KS; ++s) v += __ldcg(ws + (size_t)s \* N + my_row);   // slice order|for (int s = 0; s < KS - (kind == K_DOWN ? 1 : 0); ++s) v += __ldcg(ws + (size_t)s * N + my_row);   // FAULT c|'
CHECK[c]='FAULT c'
TESTS[c]="tests/test_gpu_persistent.py::test_layer_ops_match_reference_tiny_split_down[0] tests/test_gpu_persistent.py::test_logits_match_reference_tiny_split_down tests/test_gpu_engine.py::test_decoder_layer_matches_reference_7b[persistent-27]"

# kernel module names (kernels/<name>.cu) that include each file, for --compile-only
declare -A MODULES
MODULES[a]="gemv_int4 decode_persistent"
MODULES[b-mma]="prefill_gemm"
MODULES[b-wgmma]="prefill_wgmma"
MODULES[c]="decode_persistent"

compile_only=0
picked=()
for arg in "$@"; do
  case "$arg" in
    --compile-only) compile_only=1 ;;
    a|b-mma|b-wgmma|c) picked+=("$arg") ;;
    *) echo "usage: $0 [--compile-only] [a] [b-mma] [b-wgmma] [c]" >&2; exit 2 ;;
  esac
done
[ ${#picked[@]} -eq 0 ] && picked=("${FAULTS[@]}")

if [ "$compile_only" = 1 ]; then
  status=0
  for f in "${picked[@]}"; do
    scratch=$(mktemp -d)
    cp -r kernels "$scratch/"
    sed -i "${SED[$f]}" "$scratch/${FILE[$f]}"
    n=$(grep -c "${CHECK[$f]}" "$scratch/${FILE[$f]}")
    if [ "$n" -lt 1 ]; then echo "fault $f: the sed did not apply to ${FILE[$f]}"; status=1; rm -rf "$scratch"; continue; fi
    if python3 - "$scratch/kernels" ${MODULES[$f]} <<'EOF'
import sys
from pathlib import Path
from nanoqwen_lib.config import load
from nanoqwen_lib.gpu import cuda_build
cuda_build.KERNEL_DIR = Path(sys.argv[1])
for name in sys.argv[2:]:
    for dims in ("7b", "tiny"):
        cuda_build.compile_cubin(name, load().model(dims))
EOF
    then echo "fault $f: applied ($n line(s) of ${FILE[$f]}), compiles (${MODULES[$f]})"
    else echo "fault $f: applied but does not compile"; status=1; fi
    rm -rf "$scratch"
  done
  exit $status
fi

BACKUP=""
TARGET=""
restore() {
  if [ -n "$BACKUP" ]; then
    cp "$BACKUP" "$TARGET" && cmp -s "$BACKUP" "$TARGET" && rm -f "$BACKUP" \
      || { echo "RESTORE FAILED: $TARGET (backup kept at $BACKUP)" >&2; exit 3; }
    BACKUP=""
  fi
}
trap restore EXIT
trap 'restore; exit 130' INT TERM

run_test() {   # prints pass, FAIL or skip (a test that did not run: no GPU, or deselected)
  if timeout 600 python3 -m pytest -q -x -p no:cacheprovider "$1" >"$2" 2>&1; then
    if grep -qE "[0-9]+ passed" "$2"; then echo pass; else echo skip; fi
  else
    echo FAIL
  fi
}

LOG=$(mktemp -d)
rows=()
for f in "${picked[@]}"; do
  read -r -a tests <<<"${TESTS[$f]}"
  declare -A clean=()
  for t in "${tests[@]}"; do
    clean[$t]=$(run_test "$t" "$LOG/clean.log")
    [ "${clean[$t]}" = FAIL ] && cp "$LOG/clean.log" "$LOG/clean-$f-${#rows[@]}.log"
    rows+=("$f|$t|${clean[$t]}|")
  done
  TARGET=${FILE[$f]}
  BACKUP=$(mktemp)
  cp "$TARGET" "$BACKUP"
  sed -i "${SED[$f]}" "$TARGET"
  if ! grep -q "${CHECK[$f]}" "$TARGET"; then
    echo "fault $f: the sed did not apply to $TARGET" >&2
    restore
    continue
  fi
  i=$(( ${#rows[@]} - ${#tests[@]} ))
  for t in "${tests[@]}"; do
    faulted=$(run_test "$t" "$LOG/fault.log")
    if [ "$faulted" = FAIL ]; then
      why=$(grep -m1 -E "^E  |Error|rounding bias|outside|differ" "$LOG/fault.log" | cut -c1-110)
    else
      why=""
    fi
    caught=no
    [ "${clean[$t]}" = pass ] && [ "$faulted" = FAIL ] && caught=yes
    rows[$i]="${rows[$i]}$faulted|$caught|$why"
    i=$((i + 1))
  done
  restore
  unset clean
done

printf '\n%-8s | %-92s | %-5s | %-7s | %-6s | %s\n' fault test clean faulted caught "first failure line (faulted)"
printf -- '-%.0s' {1..170}; echo
for r in "${rows[@]}"; do
  IFS='|' read -r f t c fa ca why <<<"$r"
  printf '%-8s | %-92s | %-5s | %-7s | %-6s | %s\n' "$f" "$t" "$c" "${fa:-?}" "${ca:-?}" "$why"
done
echo "logs: $LOG (clean-*.log: tests that failed on the clean source)"
git status --short -- kernels
