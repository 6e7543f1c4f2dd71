"""The sections of ``pagedflash bench serve`` (:mod:`pagedflash.bench.serve`, whose docstring
describes every section) that scale the engine's memory and GPUs: ``longctx`` (long prompts with the
KV cache in the model's dtype, then in fp8) and ``tp`` (one GPU against ``--tensor-parallel-size`` N,
then a Llama-3-70B shape on N GPUs alone).
"""

from __future__ import annotations

import os
import statistics
import time
from unittest import mock

from pagedflash.bench.decode_bound import bound_seconds, bytes_read, kv_read
from pagedflash.bench.hbm import hbm_bandwidth
from pagedflash.bench.report import Table
from pagedflash.bench.serve_common import _close, _graph_ms, _steady_gaps, _tokens, _warm
from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import LLAMA_3_8B, LLAMA_3_70B, TINY_LLAMA, ModelConfig
from pagedflash.engine.parallel import ALLREDUCE_ENV, ALLREDUCE_KINDS

TP_TARGETS = {"tp_itl": 0.6, "tp_tps": 1.5}  # N GPUs' batch-1 ITL at most, throughput at least, x one GPU's


def bench_long_context(model, config, w, rng, engine_kw, summary, on_gpu) -> Table:
    """The same long-context workload with the KV cache in the model's dtype, then in fp8; each
    decode gap beside its bandwidth bound and the GPU time of one replay of the step's graph."""
    n, ctx, out = w["long_requests"], w["long_context"], w["long_output"]
    prompts = [_tokens(rng, config, ctx) for _ in range(n)]
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    rows = []
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(model, **{**engine_kw, "kv_cache_dtype": kv, "max_model_len": ctx + out})
        _warm(llm, config, rng)
        outs = llm.generate(prompts, params, use_tqdm=True)
        s = llm.last_stats
        gaps = _steady_gaps(outs)
        weight_bytes, kv_bytes = bytes_read(config, {**engine_kw, "kv_cache_dtype": kv}, on_gpu, n)
        bound_ms = 1e3 * bound_seconds(weight_bytes, n * kv_read(config, kv_bytes, ctx + out / 2))
        itl_ms = 1e3 * statistics.median(gaps)
        # The run's last steps decode only the requests that started last (chunked prefill staggers
        # them), so its graph state is not a full step. Two more tokens of the same prompts, found in
        # the prefix cache, start every request in one step (each recomputes at most a page: n pages
        # of tokens fit the default step budget): the graph then holds all n rows.
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        rows.append(dict(kv_cache=str(llm.kv_cache.dtype).removeprefix("torch."), pool_pages=llm.num_blocks,
                         pool_gb=llm.kv_cache.nbytes / 1e9, tok_s=s["output_tokens_per_s"], seconds=s["elapsed_s"],
                         ttft_mean_ms=1e3 * statistics.mean(o.ttft for o in outs), itl_ms=itl_ms,
                         bound_ms=bound_ms, pct_bound=100 * bound_ms / itl_ms, fwd_ms=_graph_ms(llm, n),
                         preemptions=s["preemptions"]))
        print(f"long context, KV {rows[-1]['kv_cache']}: {rows[-1]['tok_s']:.0f} output tok/s, "
              f"decode gap {rows[-1]['itl_ms']:.2f} ms", flush=True)
        _close(llm)
    base, fp8 = rows
    fp8["tps_ratio"] = fp8["tok_s"] / base["tok_s"]
    fp8["itl_ratio"] = base["itl_ms"] / fp8["itl_ms"]
    summary["longctx_fp8_throughput_ratio"] = fp8["tps_ratio"]
    summary["longctx_fp8_decode_speedup"] = fp8["itl_ratio"]
    return Table("longctx", f"Long context: {n} requests x {ctx}-token prompts, {out} output tokens, KV cache "
                 "in the model's dtype vs fp8 (e4m3, scales 1.0)",
                 {"kv_cache": "KV cache", "pool_pages": "pool pages", "pool_gb": "pool GB", "tok_s": "output tok/s",
                  "seconds": "s", "ttft_mean_ms": "mean TTFT ms", "itl_ms": "decode gap ms",
                  "bound_ms": "bound ms", "pct_bound": "% of bound", "fwd_ms": "graph ms",
                  "preemptions": "preemptions", "tps_ratio": "throughput x", "itl_ratio": "decode gap x lower"},
                 rows, note="decode gap: median token gap once every request decodes; bound = (weights + the "
                            f"mean KV read) / {hbm_bandwidth()}; graph ms: GPU time of one replay of the decode "
                            "graph with every row at the prompt's length (the prompts again after the run, "
                            "prefix-cached, two tokens each); pool: pages sized from the same free memory (fp8: "
                            "twice the pages, up to the engine's cap of max_num_seqs sequences at full length)")


def bench_tp(w, rng, engine_kw, args, summary, on_gpu) -> Table:
    """One GPU against ``--tensor-parallel-size`` N on a Llama-3-8B shape (batch-1 ITL at 1K context,
    throughput of the 64-request workload), on GPUs with each all-reduce (``PAGEDFLASH_ALLREDUCE``),
    then a Llama-3-70B shape on N GPUs alone (the default all-reduce). A run that fails is reported
    in its row."""
    n = args.tensor_parallel_size
    default = os.environ.get(ALLREDUCE_ENV, "nccl")
    kinds = [default] + [k for k in ALLREDUCE_KINDS if k != default and on_gpu]
    models = [("Llama-3-8B", LLAMA_3_8B, [(1, default)] + [(n, k) for k in kinds]),
              ("Llama-3-70B", LLAMA_3_70B, [(n, default)])]
    if args.quick:
        models = [("tiny", TINY_LLAMA, [(1, default), (n, default)])]
    lo, hi = w["prompt"]
    olo, ohi = w["output"]
    rows = []
    for name, cfg, sizes in models:
        config = ModelConfig.from_dict(cfg)
        weight_bytes, kv_bytes = bytes_read(config, engine_kw, on_gpu)
        requests = [(_tokens(rng, config, rng.randint(lo, hi)), rng.randint(olo, ohi)) for _ in range(w["tp_requests"])]
        context = [_tokens(rng, config, w["tp_context"])]
        for size, kind in sizes:
            kw = {**engine_kw, "tensor_parallel_size": size, "max_model_len": w["tp_max_model_len"], "seed": args.seed}
            row = dict(model=name, gpus=size, all_reduce=kind if size > 1 else "-")
            rows.append(row)
            llm = None
            try:
                with mock.patch.dict(os.environ, {ALLREDUCE_ENV: kind}):  # read as the engine (and its workers) start
                    t0 = time.perf_counter()
                    llm = LLM(cfg, **kw)
                print(f"{name} on {size} GPU(s), {row['all_reduce']}: built in {time.perf_counter() - t0:.0f} s",
                      flush=True)
                _warm(llm, config, rng)
                llm.generate(context, SamplingParams(max_tokens=1))  # prefilled once: the timed run decodes at once
                outs = llm.generate(context, SamplingParams(max_tokens=w["itl_tokens"], ignore_eos=True))
                itl = statistics.median(_steady_gaps(outs))
                bound_s = bound_seconds(weight_bytes, kv_read(config, kv_bytes, w["tp_context"] + w["itl_tokens"] / 2),
                                   gpus=size)
                llm.generate([p for p, _ in requests],
                             [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in requests], use_tqdm=True)
                s = llm.last_stats
                sent = llm.workers.stats if llm.workers is not None else None
                row.update(itl_ms=1e3 * itl, bound_ms=1e3 * bound_s, pct_bound=100 * bound_s / itl,
                           tok_s=s["output_tokens_per_s"], seconds=s["elapsed_s"], steps=s["steps"],
                           msg_us=1e6 * sent["send_s"] / sent["messages"] if sent else None)
            except Exception as e:  # noqa: BLE001  (an all-reduce that does not run here: reported, not fatal)
                row["note"] = f"failed: {type(e).__name__}: {e}"[:160]
                print(f"{name} on {size} GPU(s), {row['all_reduce']}: {row['note']}", flush=True)
            finally:
                if llm is not None:
                    _close(llm)
    by = {(r["model"], r["gpus"], r["all_reduce"]): r for r in rows if "itl_ms" in r}
    base = models[0][0]
    one = by.get((base, 1, "-"))
    for kind in kinds:
        many = by.get((base, n, kind))
        if one and many:
            many["itl_x"], many["tps_x"] = many["itl_ms"] / one["itl_ms"], many["tok_s"] / one["tok_s"]
            tag = "" if kind == default else f"_{kind}"
            summary[f"tp{n}{tag}_itl_vs_1gpu"], summary[f"tp{n}{tag}_throughput_vs_1gpu"] = many["itl_x"], many["tps_x"]
    if ("Llama-3-70B", n, default) in by:
        big = by[("Llama-3-70B", n, default)]
        summary[f"tp{n}_70b_tok_s"], summary[f"tp{n}_70b_itl_ms"] = big["tok_s"], big["itl_ms"]
        summary[f"tp{n}_70b_pct_of_bound"] = big["pct_bound"]
    return Table("tp", f"Tensor parallelism: batch-1 ITL at {w['tp_context']} context (median gap over "
                 f"{w['itl_tokens']} tokens), throughput of {w['tp_requests']} requests (prompts {lo}-{hi}, "
                 f"outputs {olo}-{ohi}, ignore_eos)",
                 {"model": "model", "gpus": "GPUs", "all_reduce": "all-reduce", "itl_ms": "ITL ms",
                  "bound_ms": "bound ms", "pct_bound": "% of bound", "itl_x": "ITL x 1 GPU", "tok_s": "output tok/s",
                  "tps_x": "tok/s x 1 GPU", "steps": "steps", "msg_us": "step message us", "note": "note"},
                 rows, note=f"bound = (weights + KV read) / (GPUs x {hbm_bandwidth()}); step message us: rank 0's host "
                            f"time to send one step to the other ranks; targets: {n} GPUs ITL <= "
                            f"{TP_TARGETS['tp_itl']}x and throughput >= {TP_TARGETS['tp_tps']}x one GPU's (8B)")
