#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 60 python3 tools/profile_launch.py > $OUT/profile.txt 2>&1; head -5 $OUT/profile.txt; grep -A 14 "tottime" $OUT/profile.txt | head -32
timeout 200 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_portable_path.py tests/test_decode.py tests/test_prefill.py -k "portable or head_dims or long or varlen or decode or cuda_graph" 2>&1 | tail -5 | tee $OUT/test.log
timeout 150 python3 -m pagedflash.bench.tune --only prefill --out $OUT 2>&1 | sort -t: -k2 -n | tail -12
timeout 60 python3 -m pagedflash.bench.tune --only overhead --out $OUT/o 2>&1 | tail -4
