#!/usr/bin/env bash
# One device call, several steps, every result back in $OUT/results.tgz.
#   STEPS="tests tune:paged bench:decode serve:prefix,itl serve:throughput:64" bash tools/h200.sh
# Steps: tests (the compiled matrix, -n 12; tests:K/N its Kth of N parts, every Nth test file: the whole
# matrix passed 560 s on an H100 in v60, so run it as tests:1/2 and tests:2/2 in two calls), sanitize (compute-sanitizer memcheck over SANITIZE_TESTS,
# the invalid-metadata tests by default), bench:<name>[:<option>...] (any `pagedflash bench` benchmark but
# serve and tune; options after the name, colons for spaces: bench:decode:--batch-invariant,
# bench:invariance:--logprobs:0), tune:<prefill|decode|overhead|paged>, tune:matmul[:--sweep]
# (tools/tune_matmul.py: the batch-invariant GEMM vs cuBLAS), serve:<sections>[:<num-requests>],
# profile:<context>[:--batch:B][:--batch-invariant][:--shape:NAME][:--max-model-len:N] (tools/profile_engine_step.py: a decode step's kernels, the 1B shape by default),
# splits[:VAR=VALUE...] (tools/invariant_splits.py under those environment variables: the batch-invariant
# mode's cost on its cells, e.g. splits:PAGEDFLASH_INVARIANT_HEAD_KEYS=2048; SPLITS_ARGS=--engine: the
# engine's decode cells only); TUNE_ARGS
# adds options to the bench tune steps (--cells, --tiles, ...), TESTS picks test files. Any step may run under
# environment variables of its own: VAR=VALUE[:VAR=VALUE...]@<step> (a colon before the next NAME= separates
# them, so values may hold colons: PAGEDFLASH_MATMUL_WARP_TILE=16:16:256:2:4@serve:itl; its log named after them, its results in
# $R/<their letters and digits>/), e.g. the same serve section with and without an opt-in, in one call:
#   SERVE_ARGS="--no-hf --batch-invariant" STEPS="serve:itl PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT=8@serve:itl"
# Issue 32's cost and invariance (batch-invariant mode off vs on, same run), one call (estimated ~12 min,
# never measured: past the device's 10-minute limit per command, run bench:invariance in a call of its own):
#   SERVE_ARGS="--no-hf --batch-invariant" T_bench=400 T_serve=300 STEPS="bench:decode:--batch-invariant
#   bench:prefill:--batch-invariant serve:throughput serve:itl bench:invariance:--logprobs:0" bash tools/h200.sh
# Each kind of step has its own time limit (T_<kind>, seconds) so
# that the archive is written inside the call's limit; logs land beside the results. The whole
# compiled matrix took 380 s with -n 12 (2079 cases, 2026-12-01): NPROC defaults to 12, T_tests to 540.
# Two instances may run side by side (one per GPU of a 2-GPU machine): give each its own R (results
# folder, also the archive's name) and CUDA_VISIBLE_DEVICES. An R under $OUT (R=$OUT/r1) is not archived:
# its logs come back as written, those of a call cut short by its limit too. SERVE_ARGS adds options to serve steps
# (--tensor-parallel-size 2), PYTEST_EXTRA to the tests step (--timeout=300 --timeout-method=thread).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
source tools/wheels.sh  # the serve extra (carry [".whl"])
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
R=${R:-bench_results}; mkdir -p $R
step_vars() { sed -E 's/:([A-Z_][A-Z0-9_]*=)/ \1/g' <<< "$1"; }  # NAME=V[:NAME=V...] -> NAME=V NAME=V
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee $R/gpu.txt
for step in ${STEPS:-tests}; do
  vars=; case $step in *@*) vars=$(step_vars "${step%%@*}"); step=${step#*@} ;; esac
  vt=${vars:+_${vars//[^A-Za-z0-9]/}}; out=$R${vars:+/${vars//[^A-Za-z0-9]/}}; mkdir -p $out
  kind=${step%%:*}; arg=${step#*:}; t0=$SECONDS
  case $kind in
    tests) files=${TESTS:-tests}; part=; [ "$arg" != tests ] && part=$arg  # tests:K/N: every Nth file from the Kth
           if [ -n "$part" ]; then
             [[ $part =~ ^[1-9][0-9]*/[1-9][0-9]*$ ]] || { echo "h200.sh: expected tests:K/N, got tests:$part"; continue; }
             files=$(for f in $files; do [ -d $f ] && ls $f/test_*.py || echo $f; done \
                     | awk -v k=${part%/*} -v n=${part#*/} '(NR - k) % n == 0' | tr '\n' ' ')
           fi
           log=$R/test_gpu${part:+_${part//\//of}}$vt.log
           env $vars timeout ${T_tests:-540} python3 -m pytest -v -n ${NPROC:-12} ${PYTEST_EXTRA:-} --maxfail=25 --durations=15 -p no:cacheprovider $files > $log 2>&1 ;;
    bench) name=${arg%%:*}; opts=; [ "$name" != "$arg" ] && opts=${arg#*:}; tag=${opts//[^a-z0-9]/}
           log=$R/bench_$name${tag:+_$tag}$vt.log
           env $vars timeout ${T_bench:-170} python3 -m pagedflash bench $name --out $out --rep-ms ${REP:-60} --warmup-ms 10 \
             ${opts//:/ } > $log 2>&1 ;;
    tune)  name=${arg%%:*}; opts=; [ "$name" != "$arg" ] && opts=${arg#*:}; log=$R/tune_$name$vt.log
           if [ "$name" = matmul ]; then
             env $vars timeout ${T_tune:-170} python3 tools/tune_matmul.py ${opts//:/ } > $log 2>&1
           else
             env $vars timeout ${T_tune:-170} python3 -m pagedflash bench tune --only $arg --out $out ${TUNE_ARGS:-} > $log 2>&1
           fi ;;
    sanitize) log=$R/sanitize$vt.log  # memcheck over the invalid-metadata tests (no caching allocator: every
           # tensor its own allocation, so a read past one is seen)
           env $vars PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${T_sanitize:-240} compute-sanitizer --tool memcheck \
             --error-exitcode 9 --print-limit 20 python3 -m pytest -p no:xdist -q -p no:cacheprovider \
             ${SANITIZE_TESTS:-tests/test_metadata_faults.py tests/test_write_faults.py tests/test_varlen_bounds.py} \
             > $log 2>&1 ;;
    profile) ctx=${arg%%:*}; opts=; [ "$ctx" != "$arg" ] && opts=${arg#*:}; tag=${opts//[^a-z0-9]/}
           log=$R/profile_$ctx${tag:+_$tag}$vt.log
           env $vars timeout ${T_profile:-90} python3 tools/profile_engine_step.py $ctx ${opts//:/ } > $log 2>&1 ;;
    splits) [ "$arg" != splits ] && vars="$vars $(step_vars "$arg")"; sa=${SPLITS_ARGS:-}
           log=$R/splits${vars:+_${vars//[^A-Za-z0-9]/}}${sa:+_${sa//[^A-Za-z0-9]/}}.log
           env $vars timeout ${T_splits:-90} python3 tools/invariant_splits.py $sa > $log 2>&1 ;;
    serve) sec=${arg%%:*}; n=${arg#*:}; [ "$n" = "$arg" ] && n=; log=$R/serve_${sec//,/_}$vt.log
           env $vars timeout ${T_serve:-150} python3 -m pagedflash bench serve --out $out --sections $sec ${n:+--num-requests $n} ${SERVE_ARGS:-} > $log 2>&1 ;;
  esac
  rc=$?
  grep -E " passed| failed|^FAILED|Error|^summary|geomean|speedup|failures|tok/s|TTFT|ITL|ERROR SUMMARY|cuBLAS/ours|% of requests|graph replay|on/off" $log | tail -${TAIL:-14}
  echo "== ${vars:+$vars @ }$step rc=$rc $((SECONDS - t0)) s"
done
case $R in
  "$OUT"/*) ;;  # already under $OUT: its files come back as they are
  *) [ "$R" = bench_results ] && a=results || a=$(basename "$R"); tar czf "$OUT/$a.tgz" "$R" ;;
esac
