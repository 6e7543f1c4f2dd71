#!/usr/bin/env bash
# Last GPU pass of a session: the whole compiled test matrix (kernels and engine), then the serving
# benchmark. Writes straight into $OUT so that whatever finishes comes back.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -n 8 --maxfail=25 -p no:cacheprovider tests > $OUT/test_gpu.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/test_gpu.log | tail -30
timeout ${SERVE1_TIMEOUT:-110} python3 -m pagedflash bench serve --out $OUT --sections prefix,itl > $OUT/serve_prefix_itl.log 2>&1
echo "serve prefix,itl rc=$?"; tail -30 $OUT/serve_prefix_itl.log
timeout ${SERVE2_TIMEOUT:-120} python3 -m pagedflash bench serve --out $OUT --sections throughput --num-requests ${NREQ:-64} > $OUT/serve_throughput.log 2>&1
echo "serve throughput rc=$?"; tail -20 $OUT/serve_throughput.log
