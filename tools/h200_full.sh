#!/usr/bin/env bash
# The full GPU pass in one device call: compiled test matrix, then the three kernel benchmarks.
# Everything lands in $OUT/results.tgz (plus the logs), fetched by the device tool.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=bench_results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee $R/gpu.txt
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 --maxfail=10 -p no:cacheprovider ${TESTS:-tests} 2>&1 | tail -25 > $R/test_gpu.log
  tail -6 $R/test_gpu.log
fi
for b in ${BENCHES:-prefill decode paged}; do
  timeout ${BENCH_TIMEOUT:-170} python3 -m pagedflash bench $b --out $R --rep-ms ${REP:-60} --warmup-ms 10 > $R/bench_$b.log 2>&1
  echo "== $b rc=$?"; grep -E "^summary|geomean|speedup|failures" $R/bench_$b.log | tail -3
done
tar czf $OUT/results.tgz $R
