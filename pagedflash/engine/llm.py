"""LLM: the user-facing engine. Load a model, own the page pool, run continuous batching to completion.

Bad requests fail alone: ``generate`` validates every prompt up front (empty, longer than the
model's maximum, ids outside the vocabulary, a string without a tokenizer, sampling parameters out of
range, more pages than the whole pool) and returns a :class:`GenerationOutput` with
``finish_reason="error"`` and an ``error`` message for it; the other requests run normally.
Bad engine arguments (a missing directory, an unsupported architecture, missing or mis-shaped
weights) raise at construction.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch

from pagedflash.cache import BlockManager, KVCache
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.model import CausalLM
from pagedflash.engine.runner import ModelRunner
from pagedflash.engine.sampling import SamplingParams
from pagedflash.engine.scheduler import Batch, ScheduledRow, Scheduler
from pagedflash.engine.sequence import GenerationOutput, Sequence
from pagedflash.engine.weights import build_model, init_random_weights, load_weights

CPU_NUM_BLOCKS = 512  # default pool off the GPU: 8K tokens at page 16
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class LLM:
    """A serving engine on pagedflash's kernels and paged cache.

    Args:
        model: a local Hugging Face directory (config.json + *.safetensors), a ``transformers`` config,
            a :class:`ModelConfig` or an HF-style dict (the last three: seeded random weights).
        device: default ``cuda`` when available, else ``cpu``. dtype: default bf16 on GPU, fp32 on CPU.
        page_size: tokens per KV page. num_blocks: pages in the pool; None sizes it from free GPU
            memory (``gpu_memory_utilization`` of the total) or uses a modest default on CPU.
        max_num_seqs: running sequences at most. max_num_batched_tokens: tokens per step at most.
        enable_prefix_caching: share full pages of equal prompt prefixes. cuda_graphs: replay
            captured graphs for decode-only steps (GPU only).
        max_model_len: cap on prompt + generated tokens (default: the model's maximum).
        seed: random weights and unseeded sampling. tokenizer: path to a tokenizer.json, a
            ``tokenizers.Tokenizer``, or None to use ``<model dir>/tokenizer.json`` when present.
    """

    def __init__(self, model, *, device=None, dtype=None, page_size: int = 16, num_blocks: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
                 cuda_graphs: bool = True, max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 seed: int = 0, tokenizer=None):
        _check_int("page_size", page_size)
        _check_int("max_num_seqs", max_num_seqs)
        _check_int("max_num_batched_tokens", max_num_batched_tokens)
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
            dtype = _DTYPES[dtype]
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)

        path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        if path is not None:
            self.config = ModelConfig.from_pretrained(path)
        elif isinstance(model, ModelConfig):
            self.config = model
        elif isinstance(model, dict):
            self.config = ModelConfig.from_dict(model)
        elif hasattr(model, "to_dict"):
            self.config = ModelConfig.from_hf_config(model)
        else:
            raise TypeError(f"model must be a directory path or a config, got {type(model).__name__}")
        self.max_model_len = self.config.max_position_embeddings
        if max_model_len is not None:
            _check_int("max_model_len", max_model_len)
            self.max_model_len = min(self.max_model_len, max_model_len)
        self.model: CausalLM = build_model(self.config, max_len=self.max_model_len, dtype=self.dtype,
                                           device=self.device)
        if path is not None:
            load_weights(self.model, path)
        else:
            init_random_weights(self.model, seed)
        self.tokenizer = _load_tokenizer(tokenizer, path)
        self.eos_ids = set(self.config.eos_token_ids)
        self.run_ahead = True  # greedy decode: launch a step before the previous one's tokens are read
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        if num_blocks is None:
            num_blocks = self._auto_num_blocks(max_num_seqs, gpu_memory_utilization)
        self.num_blocks = num_blocks
        self.kv_cache = KVCache(num_layers=self.config.num_layers, num_blocks=num_blocks, page_size=page_size,
                                num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                                dtype=self.dtype, device=self.device)
        self.block_manager = BlockManager(num_blocks, page_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.runner = ModelRunner(self.model, self.kv_cache, max_model_len=self.max_model_len,
                                  max_num_seqs=max_num_seqs, use_cuda_graphs=cuda_graphs, generator=generator)
        self._ids = itertools.count()
        self.last_stats: dict = {}

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.

        ``prompts``: lists of token ids (or strings, with a tokenizer). ``sampling_params``: one for all,
        or one per prompt.
        """
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of prompts (each a list of token ids or a string)")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        start = time.perf_counter()
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        seqs: dict[int, tuple[int, Sequence]] = {}
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids, problem = self._validate(prompt, params)
            if problem:
                outputs[i] = GenerationOutput(index=i, prompt_token_ids=ids or [], finish_reason="error", error=problem)
                continue
            seq = Sequence(next(self._ids), ids, params, start, self.device)
            seqs[seq.seq_id] = (i, seq)
            self.scheduler.add(seq)

        bar = _progress(len(seqs), use_tqdm)
        steps = prefill_tokens = generated = 0
        preempt0 = self.scheduler.num_preemptions
        try:
            # ahead: (batch, pending tokens, kept rows or None) launched before its predecessor's tokens
            # were read; a step that lost rows meanwhile is not followed ahead (the runner's buffers are
            # laid out by row: the next step goes through the scheduler and re-lays them)
            ahead = None
            while self.scheduler.has_unfinished():
                if ahead is None:
                    batch = self.scheduler.schedule()
                    pending, keep = self.runner.launch(batch), None
                else:
                    batch, pending, keep = ahead
                nxt = None
                if self.run_ahead and pending.deferred and keep is None:
                    nxt = self.scheduler.schedule_ahead(batch)
                ahead = None if nxt is None else (nxt, self.runner.launch_ahead(nxt), None)
                tokens = pending.result()
                if keep is not None:
                    tokens = [tokens[i] for i in keep]
                now = time.perf_counter()
                prefill_tokens += sum(r.num_tokens for r in batch.rows if not r.decode)
                finished = self.scheduler.postprocess(batch, tokens, now, self.eos_ids, self.max_model_len)
                if ahead is not None:
                    launched = len(ahead[0].rows)
                    keep = self.scheduler.confirm_ahead(ahead[0])
                    ahead = (ahead[0], ahead[1], keep if len(keep) < launched else None) if keep else None
                steps += 1
                generated += len(tokens)
                for seq in finished:
                    i, _ = seqs[seq.seq_id]
                    outputs[i] = seq.to_output(i)
                if bar is not None:
                    bar.update(len(finished))
                    bar.set_postfix_str(f"{generated / (now - start):.1f} tok/s", refresh=False)
        except BaseException:
            self.scheduler.abort_all()  # an engine failure (or Ctrl-C) leaves no request behind
            raise
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - start
        for out in outputs:
            if self.tokenizer is not None and out.finish_reason != "error":
                out.text = self.tokenizer.decode(out.token_ids)
        ok = [o for o in outputs if o.finish_reason != "error"]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in ok)
        self.last_stats = {
            "elapsed_s": elapsed,
            "steps": steps,
            "num_requests": len(ok),
            "num_errors": len(outputs) - len(ok),
            "prompt_tokens": prompt_tokens,
            "output_tokens": sum(len(o.token_ids) for o in ok),
            "output_tokens_per_s": sum(len(o.token_ids) for o in ok) / elapsed if elapsed > 0 else 0.0,
            "prefix_cache_hit_rate": sum(o.num_cached_tokens for o in ok) / prompt_tokens if prompt_tokens else 0.0,
            "preemptions": self.scheduler.num_preemptions - preempt0,
            "computed_prefill_tokens": prefill_tokens,
        }
        return outputs

    def _validate(self, prompt, params) -> tuple[list[int] | None, str | None]:
        """(token ids, None) for a good request, else (ids or None, message)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return None, "prompt is a string but the engine has no tokenizer (pass token ids)"
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            return None, f"prompt must be a list of int token ids (or a string), got {type(prompt).__name__}"
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            return None, f"prompt must be a list of int token ids, got an element {bad!r} of type {type(bad).__name__}"
        ids = list(prompt)
        if not ids:
            return ids, "prompt is empty"
        if not isinstance(params, SamplingParams):
            return ids, f"sampling_params must be SamplingParams, got {type(params).__name__}"
        problem = params.problem()
        if problem:
            return ids, problem
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            return ids, f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
        if len(ids) > self.max_model_len:
            return ids, f"prompt has {len(ids)} tokens, more than the model's maximum length {self.max_model_len}"
        total = min(len(ids) + params.max_tokens - 1, self.max_model_len)
        pages = -(-total // self.page_size)
        if pages > self.num_blocks:
            return ids, (f"request needs {pages} KV pages of {self.page_size} tokens ({len(ids)} prompt + "
                         f"{params.max_tokens} max_tokens) but the whole pool has {self.num_blocks}: it can never fit")
        return ids, None

    # ------------------------------------------------------------------ helpers
    @torch.inference_mode()
    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits ``[len(p), vocab]`` at every position of each prompt, from one packed prefill
        through the paged cache (the pages are released afterwards). For checks against references."""
        seqs = [Sequence(next(self._ids), list(p), SamplingParams(), 0.0, self.device) for p in prompts]
        try:
            for seq in seqs:
                seq.block_table, _ = self.block_manager.allocate(seq.seq_id, seq.token_ids)
            # recompute every page (rewriting a shared page with equal values is harmless)
            batch = Batch([ScheduledRow(seq, 0, len(seq)) for seq in seqs])
            ids, pos, meta, _ = self.runner.prepare(batch)
            logits = self.model.compute_logits(self.model(ids, pos, meta, self.runner.kv_caches))
            for seq in seqs:  # only now are the pages written: a failed forward leaves none trusted
                self.scheduler.mark_written(seq.block_table, len(seq))
        finally:
            for seq in seqs:
                if seq.seq_id in self.block_manager:
                    self.block_manager.free(seq.seq_id)
        return list(logits.split([len(s) for s in seqs]))

    def _auto_num_blocks(self, max_num_seqs: int, utilization: float) -> int:
        per_block = KVCache.bytes_per_block(num_layers=self.config.num_layers, page_size=self.page_size,
                                            num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                                            dtype=self.dtype)
        if self.device.type != "cuda":
            return CPU_NUM_BLOCKS
        peak = self._profile_activations(max_num_seqs)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * utilization) - (total - free) - peak
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                               "lower max_num_batched_tokens or raise gpu_memory_utilization")
        # no more than every running sequence at full length needs (a small model on a big GPU)
        return int(min(num_blocks, max_num_seqs * -(-self.max_model_len // self.page_size)))

    @torch.inference_mode()
    def _profile_activations(self, max_num_seqs: int) -> int:
        """Peak activation bytes of a largest step (max_num_batched_tokens tokens), on a scratch pool."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        tokens = min(self.max_num_batched_tokens, max_num_seqs * self.max_model_len)
        num_seqs = min(max_num_seqs, tokens)
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        num_blocks = sum(-(-n // self.page_size) for n in lens)
        scratch = KVCache(num_layers=self.config.num_layers, num_blocks=num_blocks, page_size=self.page_size,
                          num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                          dtype=self.dtype, device=self.device)
        bm = BlockManager(num_blocks, self.page_size, enable_prefix_caching=False)
        seqs = [Sequence(i, [0] * n, SamplingParams(), 0.0, self.device) for i, n in enumerate(lens)]
        for seq in seqs:
            seq.block_table, _ = bm.allocate(seq.seq_id, seq.token_ids)
        runner = ModelRunner(self.model, scratch, max_model_len=self.max_model_len, max_num_seqs=num_seqs,
                             use_cuda_graphs=False, generator=None)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.run(Batch([ScheduledRow(seq, 0, len(seq)) for seq in seqs]))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del runner, scratch
        torch.cuda.empty_cache()
        return int(peak * 1.1) + (256 << 20)  # margin for CUDA graphs and allocator slack

    def close(self) -> None:
        """Release the KV pool, CUDA graphs and weights (GPU memory comes back on the next empty_cache)."""
        self.runner.graphs.clear()
        self.runner = self.kv_cache = self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _load_tokenizer(tokenizer, path: str | None):
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    file = os.fspath(tokenizer) if tokenizer is not None else (os.path.join(path, "tokenizer.json") if path else None)
    if file is None or not os.path.isfile(file):
        if tokenizer is not None:
            raise FileNotFoundError(f"tokenizer file {file!r} not found")
        return None
    from tokenizers import Tokenizer

    return _Tokenizer(Tokenizer.from_file(file))


class _Tokenizer:
    """Thin wrapper so ``encode`` returns ids and ``decode`` takes ids."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _progress(total: int, enabled: bool):
    """A tqdm bar on a terminal (requests done, tokens/s); nothing in a log or a pipe."""
    if not enabled or total == 0 or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
