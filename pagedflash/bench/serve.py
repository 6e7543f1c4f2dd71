"""``pagedflash bench serve``: the serving engine end to end, against transformers in the same run.

Model: a Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32/8 heads, head dim 64, intermediate
8192, vocab 128256, llama3 RoPE), random weights in bf16, written once to a temp directory so the
engine and transformers load the very same tensors; ``--model DIR`` serves a directory instead (any
supported family; ``tools/random_model.py`` writes random ones of other shapes). ``--shape NAME``
builds the engine from a named config (:mod:`pagedflash.bench.shapes`: ``llama-3.2-1b``,
``qwen3-30b-a3b``, ``gpt-oss-20b``, ...) with seeded random weights in memory, nothing written (a
30B model's checkpoint would not fit a device's disk); with ``--quick``, the shape's family at tiny
sizes. No checkpoint, no transformers baselines: ``throughput`` then needs ``--no-hf``; the other
sections read token ids only. ``--max-model-len N`` caps the engines' length (``itl`` then skips
longer contexts; ``longctx`` and ``tp`` set their own). serve.json's summary names the model
(``model``). Sections (``--sections``, default all):

- ``throughput``: 256 requests, prompt and output lengths uniform in 100..1024, ignore_eos. Output
  tokens/s of the engine against transformers' continuous batching (``init_continuous_batching``,
  the manager behind ``generate_batch``, with per-request ``max_new_tokens``) and a padded
  static-batch ``generate`` with SDPA (requests sorted by output length, batches of
  ``--hf-batch-size``; only the requested tokens count). Target: >= 3x the best transformers path.
- ``prefix``: 64 requests sharing a 4K-token system prompt plus distinct 128-token suffixes, 128
  output tokens, prefix caching on and off. Targets: >= 3x throughput and >= 5x lower mean TTFT.
- ``itl``: inter-token latency at batch 1 and 32, context 1K and 32K, CUDA graphs on and off. The
  prompts are prefilled once beforehand, so the timed run serves them from the prefix cache and the
  whole batch decodes together; the median gap after every request has its first token is
  reported. ``% of bound``: the memory-bandwidth bound of a decode step (weight bytes + KV bytes
  read, over the GPU's datasheet HBM bandwidth, ``bench.hbm.hbm_bandwidth``) divided by the
  measured gap. The weights count every parameter once but an
  untied input embedding (its lookup reads a row per token; the LM head, tied or not, reads the
  whole ``[vocab, hidden]`` matrix) and, in a mixture of experts, the experts no row is routed to
  (batch 1: the active parameters; a batch: the experts its rows reach under uniform routing, in
  expectation); the KV read counts each layer's cached tokens, at most the
  window in a sliding-window layer. A context longer than the model's maximum length is skipped.
  Target: batch 1 at 1K with graphs >= 50%.
- ``longctx``: 32 requests of 16K-token prompts, 256 output tokens each, ignore_eos, with the KV
  cache in the model's dtype and in fp8 (``kv_cache_dtype="fp8_e4m3"``, scales 1.0): output tokens/s,
  the steady decode gap once every request decodes, the pool each gets from the same memory, and
  the fp8/bf16 ratios.
- ``tp`` (with ``--tensor-parallel-size N``, N >= 2; then the default section): Llama-3-8B-shaped
  random weights, one GPU against N: batch-1 inter-token latency at 1K context (target: N GPUs <=
  0.6x one GPU's) and output tokens/s of 64 requests, prompts and outputs uniform in 100..1024
  (target >= 1.5x), the N-GPU engine once per all-reduce on GPUs (``PAGEDFLASH_ALLREDUCE``: the
  environment's, default ``nccl``, then ``symm_mem``); then a Llama-3-70B-shaped model (too large for one H200 with its KV pool) on N
  GPUs alone: tokens/s, ITL and ``% of bound``, the bound of a decode step with the weights and KV
  spread over N GPUs (each reads its shard at the datasheet HBM bandwidth). Random weights are made on each rank, tensor
  by tensor, keeping its slice (:func:`pagedflash.engine.weights.init_random_weights`): the model is
  never whole on one GPU.
  ``--tensor-parallel-size`` also runs the other sections' engine on N GPUs.

``--kv-cache-dtype fp8_e4m3`` runs the other sections' engines with an fp8 KV cache too (the ``%
of bound`` of ``itl`` and ``tp`` then counts one byte per cached K/V element). ``--batch-invariant``
runs the engines of ``throughput`` and ``itl`` with the batch-invariant mode off and on, and reports
the on/off time ratios (:mod:`pagedflash.bench.serve_invariant`). ``--rounds N`` runs the
``throughput`` workload N times a mode, each on a new engine, the modes in turn, and reports each
mode's median run (the other sections run once).

Figures are printed and written to ``<out>/serve.json`` (tables of sections not run this time are
kept from an earlier file). ``--quick`` runs a tiny model with tiny workloads anywhere (CPU: Triton
interpreter): a smoke test of the plumbing, not figures.

The ``longctx`` and ``tp`` sections are in :mod:`pagedflash.bench.serve_scale`; what every section
shares, in :mod:`pagedflash.bench.serve_common`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedflash.bench.common import free_memory
from pagedflash.bench.decode_bound import bound_seconds, bytes_read, experts_note, kv_read
from pagedflash.bench.hbm import hbm_bandwidth
from pagedflash.bench.hf_baselines import continuous_batching, load_hf, quiet_transformers, static_batches
from pagedflash.bench.report import Table, print_table, write_results
from pagedflash.bench.serve_common import _close, _graph_ms, _steady_gaps, _tokens, _warm
from pagedflash.bench.serve_invariant import COLUMNS as INV_COLUMNS
from pagedflash.bench.serve_invariant import NOTE as INV_NOTE
from pagedflash.bench.serve_invariant import engine_modes, itl_summary, label, throughput_summary
from pagedflash.bench.serve_scale import TP_TARGETS, bench_long_context, bench_tp
from pagedflash.bench.shapes import SHAPES, shape_config, write_random_model
from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import LLAMA_3_2_1B, TINY_LLAMA, ModelConfig

SECTIONS = ("throughput", "prefix", "itl", "longctx", "tp")
FULL = dict(num_requests=256, prompt=(100, 1024), output=(100, 1024), prefix_requests=64, system=4096, suffix=128,
            prefix_output=128, itl_batches=(1, 32), itl_contexts=(1024, 32768), itl_tokens=64, tp_requests=64,
            tp_context=1024, tp_max_model_len=4096, long_requests=32, long_context=16384, long_output=256)
QUICK = dict(num_requests=6, prompt=(8, 24), output=(3, 8), prefix_requests=4, system=32, suffix=8,
             prefix_output=4, itl_batches=(1, 2), itl_contexts=(16, 48), itl_tokens=4, tp_requests=3, tp_context=16,
             tp_max_model_len=256, long_requests=3, long_context=40, long_output=4)
TARGETS = {"throughput": 3.0, "prefix_tps": 3.0, "prefix_ttft": 5.0, "itl_bound": 0.5, **TP_TARGETS}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedflash bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and workloads (CPU ok): plumbing only")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="directory for serve.json")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of {SECTIONS} (default: all but tp; with N >= 2 GPUs: tp)")
    p.add_argument("--model", default=None, help="local HF directory to use instead of random weights")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a named config built in memory, random weights (--quick: its family at tiny sizes)")
    p.add_argument("--max-model-len", type=int, default=None, help="every engine's length cap (default: the model's)")
    p.add_argument("--num-requests", type=int, default=None, help="throughput requests (default 256)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static-batch generate: requests per batch")
    p.add_argument("--hf-timeout", type=float, default=420.0,
                   help="seconds per transformers path; one that runs longer reports its rate so far")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs per engine; >= 2 adds the 'tp' section (then the default) comparing 1 and N GPUs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="KV cache of the throughput/prefix/itl engines (longctx runs both auto and fp8_e4m3)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="throughput and itl: the engine with the batch-invariant mode off and on, and the on/off ratios")
    p.add_argument("--rounds", type=int, default=1,
                   help="throughput only: runs of the workload per engine mode, each on a new engine, the modes in "
                        "turn; each mode's row is its median run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_transformers()
    tp = args.tensor_parallel_size
    if args.sections is None:
        args.sections = "tp" if tp > 1 else ",".join(s for s in SECTIONS if s != "tp")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in sections if s not in SECTIONS]:
        print(f"bench serve: unknown sections {unknown}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    if tp < 1 or ("tp" in sections and tp < 2):
        print(f"bench serve: the tp section needs --tensor-parallel-size >= 2 (got {tp})", file=sys.stderr)
        return 2
    if args.batch_invariant and tp > 1:
        print(f"bench serve: --batch-invariant times one-GPU engines, mode off and on (got --tensor-parallel-size {tp}; "
              "the mode's tensor-parallel engine is not benchmarked here)", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.quick:
        print("bench serve: needs a CUDA GPU (use --quick for a CPU smoke run)", file=sys.stderr)
        return 2
    if args.shape is not None and args.model is not None:
        print(f"bench serve: --shape {args.shape} and --model {args.model} both name the model; give one", file=sys.stderr)
        return 2
    if args.shape is not None and "throughput" in sections and not args.no_hf:
        print(f"bench serve: --shape {args.shape} builds the engine in memory, with no checkpoint for transformers' "
              "baselines: add --no-hf (or serve a directory with --model DIR)", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"bench serve: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.max_model_len is not None and args.max_model_len < 1:
        print(f"bench serve: --max-model-len must be >= 1, got {args.max_model_len}", file=sys.stderr)
        return 2
    try:
        print(f"bench serve: % of bound at {hbm_bandwidth()}", flush=True)
    except ValueError as e:  # PAGEDFLASH_HBM_TBPS
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    w = dict(QUICK if args.quick else FULL)
    if args.num_requests:
        w["num_requests"] = args.num_requests
    engine_kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     kv_cache_dtype=args.kv_cache_dtype)
    if args.quick:
        engine_kw.update(num_blocks=512, max_num_batched_tokens=min(args.max_num_batched_tokens, 128))
    if args.max_model_len is not None:
        engine_kw["max_model_len"] = args.max_model_len
    if sections == ["tp"]:  # its own models, random weights drawn on the GPUs: no checkpoint to write
        return _run(args, sections, w, engine_kw, None, None, on_gpu)
    if tp > 1:
        engine_kw["tensor_parallel_size"] = tp
    tmp = None
    if args.shape is not None:  # a config: every engine draws the same seeded random weights on its device
        model, engine_kw["seed"] = shape_config(args.shape, small=args.quick), args.seed
    elif args.model is None:
        tmp = tempfile.mkdtemp(prefix="pagedflash_serve_")
        model = write_random_model(TINY_LLAMA if args.quick else LLAMA_3_2_1B, tmp, on_gpu, args.seed)
    else:
        model = args.model
    try:
        config = ModelConfig.from_dict(model) if isinstance(model, dict) else ModelConfig.from_pretrained(model)
        return _run(args, sections, w, engine_kw, model, config, on_gpu)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(args, sections, w, engine_kw, model, config, on_gpu) -> int:
    device = "bf16 on " + torch.cuda.get_device_name() if on_gpu else "fp32 on CPU (interpreter)"
    model_name = args.shape or args.model or ("tiny" if args.quick else "llama-3.2-1b")
    if config is not None:
        active = f" ({config.num_active_parameters() / 1e9:.2f} B active)" if config.num_experts else ""
        print(f"bench serve: {model_name}, {config.architecture} {config.num_layers}x{config.hidden_size}, "
              f"{config.num_parameters() / 1e9:.2f} B params{active}, {device}", flush=True)
    tables, summary = [], ({"model": model_name} if config is not None else {})
    runners = {
        "throughput": lambda rng: bench_throughput(model, config, w, rng, engine_kw, args, summary),
        "prefix": lambda rng: bench_prefix(model, config, w, rng, engine_kw, summary),
        "itl": lambda rng: bench_itl(model, config, w, rng, engine_kw, summary, on_gpu, args.batch_invariant),
        "longctx": lambda rng: bench_long_context(model, config, w, rng, engine_kw, summary, on_gpu),
        "tp": lambda rng: bench_tp(w, rng, engine_kw, args, summary, on_gpu),
    }
    for name in SECTIONS:
        if name in sections:
            t0 = time.perf_counter()
            tables.append(runners[name](random.Random(args.seed)))
            print_table(tables[-1])
            print(f"section {name}: {time.perf_counter() - t0:.0f} s", flush=True)
            _save(args.out, tables, summary, quick=args.quick)  # a later timeout keeps this section
    print("summary: " + ", ".join(f"{k} = {v:.2f}" if isinstance(v, float) else f"{k} = {v}" for k, v in summary.items()))
    print(f"wrote {args.out / 'serve.json'}")
    return 0


def _save(out: Path, tables: list[Table], summary: dict, *, quick: bool) -> None:
    """serve.json with this run's tables, plus those of other sections from an earlier file."""
    kept, old_summary = _previous(out, {t.name for t in tables}, quick=quick)
    write_results("serve", tables + kept, out, quick=quick, summary={**old_summary, **summary})


def _previous(out: Path, have: set[str], *, quick: bool) -> tuple[list[Table], dict]:
    """Tables of sections not in ``have`` (and the summary) from an earlier serve.json of the same kind."""
    path = out / "serve.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], {}
    if doc.get("env", {}).get("quick") != quick:
        return [], {}
    tables = [Table(name, t["title"], t["columns"], t["rows"], t.get("note", ""))
              for name, t in doc.get("tables", {}).items() if name not in have]
    return tables, doc.get("summary", {})


# ------------------------------------------------------------------------------------ sections
def bench_throughput(model, config, w, rng, engine_kw, args, summary) -> Table:
    n, (plo, phi), (olo, ohi) = w["num_requests"], w["prompt"], w["output"]
    prompts = [_tokens(rng, config, rng.randint(plo, phi)) for _ in range(n)]
    out_lens = [rng.randint(olo, ohi) for _ in range(n)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in out_lens]
    useful = sum(out_lens)
    runs = {invariant: [] for invariant in engine_modes(args.batch_invariant)}
    for r in range(args.rounds):  # the modes in turn, so that a drift of the machine reaches both
        for invariant, done in runs.items():
            llm = LLM(model, batch_invariant=invariant, **engine_kw)
            _warm(llm, config, rng)
            outs = llm.generate(prompts, params, use_tqdm=True)
            s = llm.last_stats
            assert s["output_tokens"] == useful, f"engine produced {s['output_tokens']} tokens, expected {useful}"
            system = "pagedflash engine" + (", batch-invariant" if invariant else "")
            print(f"{system}: {s['output_tokens_per_s']:.0f} output tok/s, {s['elapsed_s']:.1f} s, {s['steps']} steps"
                  + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else ""), flush=True)
            done.append(dict(system=system, invariant=label(invariant), tok_s=s["output_tokens_per_s"],
                             seconds=s["elapsed_s"], ttft_ms=1e3 * statistics.mean(o.ttft for o in outs),
                             itl_ms=1e3 * statistics.mean(x for o in outs for x in o.itl), note=f"{s['steps']} steps"))
            _close(llm)
    rows = [_median_run(done) for done in runs.values()]
    ours = rows[0]["tok_s"]
    best = None
    if not args.no_hf:
        hf = load_hf(model)
        for name, fn in (("transformers continuous batching (paged)", continuous_batching),
                         (f"transformers generate, static batch {args.hf_batch_size}, SDPA", static_batches)):
            try:
                done, secs, note = fn(hf, prompts, out_lens, args.hf_batch_size, args.hf_timeout)
                print(f"{name}: {done / secs:.0f} output tok/s, {secs:.1f} s ({note})", flush=True)
                rows.append(dict(system=name, tok_s=done / secs, seconds=secs, note=note))
                best = max(best or 0.0, done / secs)
            except Exception as e:  # a baseline that does not run is reported, never fatal
                rows.append(dict(system=name, tok_s=None, note=f"unavailable: {type(e).__name__}: {e}"[:160]))
            free_memory()
        del hf
        free_memory()
    for row in rows:
        row["vs_best_hf"] = row["tok_s"] / best if best and row.get("tok_s") else None
    if best:
        summary["throughput_vs_best_transformers"] = ours / best
    if args.batch_invariant:
        throughput_summary(rows, summary)
    return Table("throughput", f"Throughput: {n} requests, prompts {plo}-{phi}, outputs {olo}-{ohi} tokens "
                 f"({useful} output tokens), ignore_eos",
                 {"system": "system", "tok_s": "output tok/s", "seconds": "s", "ttft_ms": "mean TTFT ms",
                  "itl_ms": "mean ITL ms", "vs_best_hf": "x best transformers", "note": "note"}
                 | (INV_COLUMNS if args.batch_invariant else {}),
                 rows, note=f"target: pagedflash >= {TARGETS['throughput']}x the best transformers path"
                            + (f"; {INV_NOTE}" if args.batch_invariant else ""))


def _median_run(done: list[dict]) -> dict:
    """The run of median output tok/s (the lower of the middle two for an even count), its note
    listing every run's."""
    row = sorted(done, key=lambda d: d["tok_s"])[(len(done) - 1) // 2]
    if len(done) > 1:
        row = dict(row, note=row["note"] + f"; median of {len(done)} runs: "
                   + " / ".join(f"{d['tok_s']:.0f}" for d in done) + " tok/s")
    return row


def bench_prefix(model, config, w, rng, engine_kw, summary) -> Table:
    system = _tokens(rng, config, w["system"])
    prompts = [system + _tokens(rng, config, w["suffix"]) for _ in range(w["prefix_requests"])]
    params = SamplingParams(max_tokens=w["prefix_output"], ignore_eos=True)
    rows = []
    for caching in (True, False):
        llm = LLM(model, enable_prefix_caching=caching, **engine_kw)
        _warm(llm, config, rng)
        outs = llm.generate(prompts, params, use_tqdm=True)
        s = llm.last_stats
        ttft = [o.ttft for o in outs]
        rows.append(dict(caching="on" if caching else "off", tok_s=s["output_tokens_per_s"], seconds=s["elapsed_s"],
                         ttft_mean_ms=1e3 * statistics.mean(ttft), ttft_p50_ms=1e3 * statistics.median(ttft),
                         hit_rate=s["prefix_cache_hit_rate"], prefill_tokens=s["computed_prefill_tokens"]))
        _close(llm)
    on, off = rows
    on["tps_ratio"] = on["tok_s"] / off["tok_s"]
    on["ttft_ratio"] = off["ttft_mean_ms"] / on["ttft_mean_ms"]
    summary["prefix_throughput_ratio"] = on["tps_ratio"]
    summary["prefix_ttft_ratio"] = on["ttft_ratio"]
    return Table("prefix", f"Shared prefix: {len(prompts)} requests, {w['system']}-token system prompt + "
                 f"{w['suffix']}-token suffixes, {w['prefix_output']} output tokens",
                 {"caching": "prefix caching", "tok_s": "output tok/s", "seconds": "s", "ttft_mean_ms": "mean TTFT ms",
                  "ttft_p50_ms": "p50 TTFT ms", "hit_rate": "hit rate", "prefill_tokens": "prefilled tokens",
                  "tps_ratio": "throughput x", "ttft_ratio": "TTFT x lower"},
                 rows, note=f"targets: throughput >= {TARGETS['prefix_tps']}x, mean TTFT >= {TARGETS['prefix_ttft']}x lower")


def _free_note() -> str:
    """The GPU's free memory now (a pool sized next to memory another engine still holds is short)."""
    if not torch.cuda.is_available():
        return ""
    free, total = torch.cuda.mem_get_info()
    return f" ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free now)"


def bench_itl(model, config, w, rng, engine_kw, summary, on_gpu, invariant=False) -> Table:
    weight_bytes, kv_bytes = bytes_read(config, engine_kw, on_gpu)
    rows = []
    for graphs, inv in itertools.product((True, False), engine_modes(invariant)):
        llm = LLM(model, cuda_graphs=graphs, batch_invariant=inv, **engine_kw)
        print(f"itl: engine (graphs {graphs}, batch-invariant {inv}): a pool of {llm.num_blocks} pages"
              f"{_free_note()}", flush=True)
        _warm(llm, config, rng)
        for batch in w["itl_batches"]:
            for ctx in w["itl_contexts"]:
                if ctx + w["itl_tokens"] > llm.max_model_len:
                    print(f"itl: context {ctx} skipped (the model's maximum length is {llm.max_model_len})",
                          flush=True)
                    continue
                pages = batch * -(-(ctx + w["itl_tokens"]) // llm.page_size)
                if pages > llm.num_blocks:  # the requests would decode in turns, not as one batch
                    print(f"itl: batch {batch} at context {ctx} skipped: it needs {pages} pages, the pool has "
                          f"{llm.num_blocks}{_free_note()}", flush=True)
                    continue
                prompts = [_tokens(rng, config, ctx) for _ in range(batch)]
                # prefill once, so that the timed run finds the prompts in the prefix cache: all
                # requests then start decoding in the same step and decode together to the end
                llm.generate(prompts, SamplingParams(max_tokens=1))
                outs = llm.generate(prompts, SamplingParams(max_tokens=w["itl_tokens"], ignore_eos=True))
                gaps = _steady_gaps(outs)
                itl = statistics.median(gaps)
                step_weights = bytes_read(config, engine_kw, on_gpu, batch)[0]
                bound_s = bound_seconds(step_weights, batch * kv_read(config, kv_bytes, ctx + w["itl_tokens"] / 2))
                fwd_ms = _graph_ms(llm, batch) if graphs else None
                rows.append(dict(graphs="on" if graphs else "off", invariant=label(inv), batch=batch, context=ctx,
                                 itl_ms=1e3 * itl,
                                 itl_mean_ms=1e3 * statistics.mean(gaps), tok_s=batch / itl, bound_ms=1e3 * bound_s,
                                 pct_bound=100 * bound_s / itl, fwd_ms=fwd_ms,
                                 rest_ms=None if fwd_ms is None else 1e3 * itl - fwd_ms))
        _close(llm)
    key = next((r for r in rows if r["graphs"] == "on" and r["invariant"] == "off" and r["batch"] == w["itl_batches"][0]
                and r["context"] == w["itl_contexts"][0]), None)
    if key:
        summary["itl_b1_1k_graphs_pct_of_bound"] = key["pct_bound"]
    if invariant:
        itl_summary(rows, summary)
    return Table("itl", f"Inter-token latency (median steady-state gap over {w['itl_tokens']} tokens)",
                 {"graphs": "CUDA graphs", "batch": "batch", "context": "context", "itl_ms": "ITL ms",
                  "itl_mean_ms": "mean ms", "tok_s": "tok/s", "bound_ms": "bound ms", "pct_bound": "% of bound",
                  "fwd_ms": "graph ms", "rest_ms": "rest ms"} | (INV_COLUMNS if invariant else {}),
                 rows, note=(f"{INV_NOTE}; " if invariant else "") + f"bound = (weights {weight_bytes / 1e9:.2f} GB{experts_note(config)} + KV read"
                            f"{', sliding layers at most their window' if config.sliding_window else ''}) "
                            f"/ {hbm_bandwidth()}; "
                            "graph ms: GPU time of one replay of the decode graph (forward, LM head, greedy "
                            "argmax); rest = ITL - graph: the host's step work and the token read; "
                            f"target: batch 1, 1K, graphs >= {100 * TARGETS['itl_bound']:.0f}%")


if __name__ == "__main__":
    sys.exit(main())
