#!/usr/bin/env bash
# Issue 33's engine figures in one device call: Qwen3-30B-A3B- and GPT-OSS-20B-shaped models and the
# Llama-3.2-1B shape as the same call's baseline, each built in memory by `bench serve --shape` (the
# published configs, seeded random bf16 weights drawn on the GPU: no checkpoint on the disk) and run
# with --no-hf: the itl section (batch 1 and 32 at 1K context, CUDA graphs on and off, ITL and its %
# of the bandwidth bound, which counts the routed experts' bytes) for every model first, then
# throughput (NREQ requests, prompts and outputs 100-1024, ignore_eos) for every model. Results in
# $OUT/moe.tgz, one folder per shape ($R/<shape>/serve.json and .md, logs beside them).
#   bash tools/moe_h200.sh          (SHAPES="qwen3-30b-a3b gpt-oss-20b llama-3.2-1b", NREQ=64)
# MAXLEN (default 4096) caps every engine's length: itl skips its 32K-context rows (32 x 32K tokens of
# Qwen3-30B-A3B's KV, 96 KiB each, would not fit beside its 61 GB of weights), as families_h200.sh
# does; MAXSEQS (default 64) caps the running requests (8 CUDA graphs to capture, not 20; NREQ=64
# requests run together either way). Estimated, never measured: itl ~100 s per MoE model (two
# engines, each drawing its weights in seconds, one cold Triton compile, 8 graph captures), ~40 s
# for the 1B; throughput ~50 s per MoE model (36K output tokens at >= 1K tok/s), ~25 s for the 1B:
# ~6-7 min in all. Each run has its own limit (T_itl, T_tput, seconds), clipped so that all ends by
# DEADLINE seconds (default 540) and the archive is written inside a 600 s call: a run cut short keeps
# the sections it finished (serve.json is written after each). SERVE_ARGS adds options to bench serve
# (a CPU dry run of the plumbing, tiny models of each family: SERVE_ARGS=--quick).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
R=${R:-bench_results}; mkdir -p $R
SHAPES=${SHAPES:-qwen3-30b-a3b gpt-oss-20b llama-3.2-1b}
DEADLINE=${DEADLINE:-540}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee $R/gpu.txt
limit() {  # the smaller of $1 and the seconds left before DEADLINE
  local left=$((DEADLINE - SECONDS)); [ $left -lt $1 ] && echo $left || echo $1
}
for sec in itl throughput; do
  for shape in $SHAPES; do
    t0=$SECONDS; mkdir -p $R/$shape
    [ $sec = itl ] && t=$(limit ${T_itl:-170}) || t=$(limit ${T_tput:-110})
    [ $t -lt 20 ] && { echo "== $sec $shape: skipped, ${t} s left"; continue; }
    timeout $t python3 -m pagedflash bench serve --shape $shape --sections $sec --no-hf --num-requests ${NREQ:-64} \
      --max-model-len ${MAXLEN:-4096} --max-num-seqs ${MAXSEQS:-64} --out $R/$shape ${SERVE_ARGS:-} \
      > $R/$shape/serve_$sec.log 2>&1
    echo "== $sec $shape rc=$? $((SECONDS - t0)) s (limit $t)"
    grep -E "^bench serve:|^pagedflash engine:|^\| on \| (1|32) \||^section|^summary|Error" $R/$shape/serve_$sec.log \
      | tail -${TAIL:-8}
  done
done
case $R in
  "$OUT"/*) ;;  # already under $OUT: its files come back as they are, a call cut short's too
  *) [ "$R" = bench_results ] && a=moe || a=$(basename "$R"); tar czf $OUT/$a.tgz $R ;;
esac
