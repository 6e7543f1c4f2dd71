set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
source tools/wheels.sh
mkdir -p $OUT/r
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 150 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_prefill_hopper_invariant.py tests/test_prefill_hopper_plans.py > $OUT/r/tests.log 2>&1
echo "tests rc=$? $((SECONDS-t0)) s"; grep -E "passed|failed|FAILED|Error" $OUT/r/tests.log | tail -20
t0=$SECONDS
timeout 300 python3 -m pagedflash bench prefill --out $OUT/r --rep-ms 60 --warmup-ms 10 --batch-invariant > $OUT/r/bench_prefill_inv.log 2>&1
echo "bench rc=$? $((SECONDS-t0)) s"; grep -vE "Warn|^\s*$" $OUT/r/bench_prefill_inv.log | tail -60
