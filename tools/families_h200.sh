#!/usr/bin/env bash
# Issue 31's family figures in one device call: random Gemma-2-2B- and Qwen3-1.7B-shaped models and
# the Llama-3.2-1B shape as the same call's baseline (tools/random_model.py: transformers' own class
# for each, bf16), each through `bench serve --no-hf`: the itl section (batch 1 and 32, CUDA graphs
# on and off, ITL and its % of the bandwidth bound) for every model first, then throughput (NREQ
# requests, prompts and outputs 100-1024) for every model. Results in $OUT/families.tgz, one folder
# per shape ($R/<shape>/serve.json, logs beside them).
#   bash tools/families_h200.sh          (SHAPES="gemma-2-2b qwen3-1.7b llama-3.2-1b", NREQ=96)
# MAXLEN (default 8192, Gemma 2's own maximum) is every model's max_position_embeddings (a cap on
# the served length; the math of their default RoPE does not read it): the itl section then skips
# its 32K-context rows for all three alike (Qwen3-1.7B's 32 x 32K tokens, 114 KB each, would not fit
# the KV pool), which keeps the call within ~500 s. MAXLEN= keeps each config's own (Gemma still 8192).
# Each run has its own limit (T_itl, T_tput, seconds), clipped so that all ends by DEADLINE seconds
# (default 540) and the archive is written inside a 600 s call. RM_ARGS adds options to random_model.py,
# SERVE_ARGS to bench serve (a CPU dry run of the plumbing: RM_ARGS=--tiny SERVE_ARGS=--quick).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
R=${R:-bench_results}; mkdir -p $R
SHAPES=${SHAPES:-gemma-2-2b qwen3-1.7b llama-3.2-1b}
MAXLEN=${MAXLEN-8192}
DEADLINE=${DEADLINE:-540}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee $R/gpu.txt
limit() {  # the smaller of $1 and the seconds left before DEADLINE
  local left=$((DEADLINE - SECONDS)); [ $left -lt $1 ] && echo $left || echo $1
}
for shape in $SHAPES; do
  t0=$SECONDS; mkdir -p $R/$shape
  python3 tools/random_model.py /tmp/pagedflash_$shape --shape $shape \
    ${MAXLEN:+--set max_position_embeddings=$MAXLEN} ${RM_ARGS:-} > $R/$shape/model.log 2>&1
  echo "== model $shape rc=$? $((SECONDS - t0)) s"
done
for sec in itl throughput; do
  for shape in $SHAPES; do
    M=/tmp/pagedflash_$shape; t0=$SECONDS
    [ -f $M/config.json ] || { echo "== $sec $shape: no model (see $R/$shape/model.log)"; continue; }
    [ $sec = itl ] && t=$(limit ${T_itl:-130}) || t=$(limit ${T_tput:-60})
    [ $t -lt 20 ] && { echo "== $sec $shape: skipped, ${t} s left"; continue; }
    timeout $t python3 -m pagedflash bench serve --model $M --sections $sec --no-hf --num-requests ${NREQ:-96} \
      --out $R/$shape ${SERVE_ARGS:-} > $R/$shape/serve_$sec.log 2>&1
    echo "== $sec $shape rc=$? $((SECONDS - t0)) s (limit $t)"
    grep -E "^bench serve:|^pagedflash engine:|^\| on \| 1 \||^bound|^summary|Error" $R/$shape/serve_$sec.log | tail -${TAIL:-6}
  done
done
[ "$R" = bench_results ] && a=families || a=$(basename "$R")
tar czf $OUT/$a.tgz $R
