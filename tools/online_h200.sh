#!/usr/bin/env bash
# The HTTP server's figures in one device call: a random Llama-3.2-1B-shaped model with a full-vocab
# tokenizer (tools/random_model.py), then `bench online --launch-server` against `pagedflash serve`
# on it, each run followed by the offline engine on the same requests (the overhead ratio), and the
# offline batch-1 ITL of `bench serve --sections itl` in the same call.
#   RUNS="itl conc64 prefix sweep" bash tools/online_h200.sh      (results in $OUT/online.tgz)
# PREFIX_WARMUPS sets the shared-prefix runs' warm-up count (64: the point's own shape).
# SERVER_ARGS adds options to every server it launches (--engine-process).
# The shared-prefix runs' servers keep a request timeline ($R/timeline_<name>.jsonl, warm-ups left out of
# its summary, $R/timeline_<name>.md): where each request's time to its first token goes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
source tools/wheels.sh  # the serve extra (carry [".whl"])
R=${R:-bench_results}; mkdir -p $R
M=${MODEL:-/tmp/pagedflash_model_1b}
[ -f $M/config.json ] || python3 tools/random_model.py $M > $R/model.log 2>&1 || { tail $R/model.log; exit 1; }
online() {  # name, then bench online's arguments
  local name=$1 t0=$SECONDS; shift
  timeout ${T_online:-240} python3 -m pagedflash bench online --out $R --result-name $name "$@" > $R/online_$name.log 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  grep -E "^\| (inf|[0-9])|^summary|offline:" $R/online_$name.log | tail -${TAIL:-8}
}
timeline() {  # name: the summary of the run's request timeline
  python3 -m pagedflash.bench.timeline --skip ${PREFIX_WARMUPS:-2} --json $R/timeline_$1.json \
    $R/timeline_$1.jsonl > $R/timeline_$1.md 2>&1
  cat $R/timeline_$1.md
}
prefix() {  # name, then the server's extra options
  local name=$1; shift
  rm -f $R/timeline_$name.jsonl
  online $name --dataset shared-prefix --prefix-groups 1 --prefix-len 4096 --suffix-len 128 \
    --output-len 32 --num-prompts 64 --num-warmups ${PREFIX_WARMUPS:-2} --no-offline --launch-server $M ${SERVER_ARGS:-} \
    --request-timeline $R/timeline_$name.jsonl "$@"
  timeline $name
}
for run in ${RUNS:-itl conc64 prefix sweep}; do
  case $run in
    itl) online itl --input-len 1024 --output-len 256 --num-prompts 8 --max-concurrency 1 --num-warmups 2 \
           --launch-server $M ${SERVER_ARGS:-}
         timeout 150 python3 -m pagedflash bench serve --sections itl --out $R > $R/serve_itl.log 2>&1
         grep -E "ITL|itl" $R/serve_itl.log | tail -6 ;;
    itlp) online itlp --input-len 1024 --output-len 256 --num-prompts 8 --max-concurrency 1 --num-warmups 2 \
            --no-offline --launch-server $M ${SERVER_ARGS:-} --engine-process ;;
    conc64) online conc64 --input-len 100:1024 --output-len 100:1024 --num-prompts 256 --max-concurrency 64 \
              ${CLIENT_ARGS:-} --launch-server $M ${SERVER_ARGS:-} ;;
    conc64p) online conc64p --input-len 100:1024 --output-len 100:1024 --num-prompts 256 --max-concurrency 64 \
               ${CLIENT_ARGS:-} --no-offline --launch-server $M ${SERVER_ARGS:-} --engine-process ;;
    prefixon) prefix prefix_on ;;
    prefix) prefix prefix_on
            prefix prefix_off --no-enable-prefix-caching ;;
    sweep) online sweep --input-len 100:1024 --output-len 100:512 --num-prompts 128 --request-rates 4,8,16,32,inf \
             --no-offline --launch-server $M ${SERVER_ARGS:-} ;;
  esac
done
[ "$R" = bench_results ] && a=online || a=$R
tar czf $OUT/$a.tgz $R
