#!/usr/bin/env bash
# One device call: compiled test matrix + launch-choice sweep on the H200. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -x -n 8 -p no:cacheprovider ${TESTS:-tests/test_prefill.py tests/test_decode.py tests/test_paged.py tests/test_validation.py} 2>&1 | tail -40 > "$OUT/test.log"
tail -15 "$OUT/test.log"
if [ -n "${TUNE:-}" ]; then
  timeout ${TUNE_TIMEOUT:-220} python3 -m pagedflash.bench.tune --out "$OUT" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | grep -v "^prefill" | tail -60
  grep "^prefill" "$OUT/tune.log" | sort -t: -k2 -n | tail -40
fi
