"""LLM: the user-facing engine. Load a model, own the page pool, run continuous batching.

Two ways to drive it: :meth:`LLM.generate` runs a list of prompts to completion; the step API
(:meth:`LLM.add_request`, :meth:`LLM.step`, :meth:`LLM.has_unfinished_requests`,
:meth:`LLM.abort_request`) runs one step at a time and hands back each request's new tokens as they
are produced, for streaming. ``generate`` is a loop over ``step``.

Bad requests: ``add_request`` raises ``TypeError``/``ValueError`` saying what is wrong (empty, longer
than the model's maximum, ids outside the vocabulary, a string without a tokenizer, sampling
parameters out of range, more pages than the whole pool) and queues nothing; ``generate`` returns a
:class:`GenerationOutput` with ``finish_reason="error"`` and that message for it, and runs the
others. Bad engine arguments (a missing directory, an unsupported architecture or dtype, missing or
mis-shaped weights) raise at construction.

A step that fails (an exception in the forward, ``KeyboardInterrupt``, out of memory) changes no
request's progress and puts no page in the prefix cache: pages join it only after the forward that
wrote them completed. The requests stay queued; the next ``step`` runs them again, or
``abort_request`` drops them. ``generate`` drops its requests when a step fails and re-raises.

Several GPUs: ``tensor_parallel_size=N`` splits the model over ``N`` ranks (one process each; this
one is rank 0 and runs the scheduler): :mod:`pagedflash.engine.parallel` says how,
:mod:`pagedflash.engine.workers` how the processes follow rank 0's steps, fail and stop. A rank that
dies makes ``step``/``generate`` raise :class:`~pagedflash.engine.workers.WorkerError` and closes the
engine. ``close()`` (or ``with LLM(...) as llm``) stops the processes; so does garbage collection.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import os
import threading
import time
import weakref

import torch

from pagedflash._progress import progress
from pagedflash.cache import BlockManager
from pagedflash.cache.kv_cache import layer_scales
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.executor import EngineSpec, build_rank
from pagedflash.engine.model import CausalLM
from pagedflash.engine.parallel import allreduce_kind, check_tensor_parallel_size
from pagedflash.engine.run_ahead import RunAhead
from pagedflash.engine.runner import ModelRunner
from pagedflash.engine.sampling import SamplingParams
from pagedflash.engine.scheduler import Batch, ScheduledRow, Scheduler
from pagedflash.engine.sequence import GenerationOutput, RequestOutput, Sequence
from pagedflash.engine.structured import GrammarCompiler
from pagedflash.engine.weights import read_kv_scales
from pagedflash.engine.workers import WorkerError, Workers
from pagedflash.ops import scratch
from pagedflash.ops.utils import on_device
from pagedflash.validate import check_int

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}  # the dtypes the kernels take
# kv_cache_dtype names (vLLM's); "auto" stores K/V in the model's dtype
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _on_engine_device(method):
    """Run an engine method with the engine's GPU current: its kernels, CUDA graphs, events and pinned
    copies go to that GPU whichever one the caller has current."""

    @functools.wraps(method)
    def on_its_device(self, *args, **kwargs):
        with on_device(self.device):
            return method(self, *args, **kwargs)

    return on_its_device


class LLM:
    """A serving engine on pagedflash's kernels and paged cache.

    Args:
        model: a local Hugging Face directory (config.json + *.safetensors), a ``transformers`` config,
            a :class:`ModelConfig` or an HF-style dict (the last three: seeded random weights).
        device: default ``cuda`` (the current GPU) when available, else ``cpu``; the engine's work
            runs with its GPU current and leaves the caller's current GPU as it was. dtype: ``torch.float32``,
            ``torch.float16`` or ``torch.bfloat16`` (or their names; bf16 not on the CPU, where the
            kernels run under the interpreter); default bf16 on GPU, fp32 on CPU.
        page_size: tokens per KV page. num_blocks: pages in the pool; None sizes it from free GPU
            memory (``gpu_memory_utilization`` of the total) or uses a modest default on CPU.
        max_num_seqs: running sequences at most. max_num_batched_tokens: tokens per step at most.
        enable_prefix_caching: share full pages of equal prompt prefixes. cuda_graphs: replay
            captured graphs for decode-only steps (GPU only).
        max_model_len: cap on prompt + generated tokens (default: the model's maximum).
        seed: random weights and unseeded sampling. tokenizer: path to a tokenizer.json (or a directory
            holding one), a ``tokenizers.Tokenizer``, or None to use ``<model dir>/tokenizer.json`` when
            present; string prompts, ``text`` and ``structured_outputs`` need one.
        tensor_parallel_size: ranks the model is split over (one process and one GPU each: GPUs
            ``device.index .. + N - 1``; gloo processes on the CPU). It must divide the attention
            heads and the intermediate size, and divide or be a multiple of the KV heads.
            ``PAGEDFLASH_ALLREDUCE=symm_mem`` picks the one-shot all-reduce for small messages.
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"fp8_e4m3"`` (``"fp8"``; also
            ``"fp8_e5m2"``): K/V pages in fp8, twice the tokens in the same memory.
        k_scale, v_scale: fp8 caches: the scale of each layer's keys / values (``stored = k /
            k_scale``): one float for every layer, or a list of one entry per layer, each a float
            (per tensor) or a list of ``num_key_value_heads`` floats (per KV head; a tensor-parallel
            rank keeps its heads'). None reads them from the checkpoint when it has them
            (``model.layers.N.self_attn.k_scale``, ``...k_proj.k_scale`` etc., as vLLM), else 1.0.
        batch_invariant: a request's tokens and logprobs bit for bit the same whatever else the
            engine serves (batch, chunking, preemption, prefix hits): attention in the kernels'
            batch-invariant mode and every projection through the batch-invariant product
            (README "Batch invariance"); with ``tensor_parallel_size > 1`` the ranks' sums too
            (:class:`~pagedflash.engine.parallel.Collectives`: two ranks through the group's
            all-reduce, more gathered and added in rank order).

    Not thread-safe: drive one engine from one thread.
    """

    def __init__(self, model, *, device=None, dtype=None, page_size: int = 16, num_blocks: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
                 cuda_graphs: bool = True, max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 seed: int = 0, tokenizer=None, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 k_scale=None, v_scale=None, batch_invariant: bool = False):
        check_int("page_size", page_size)
        check_int("max_num_seqs", max_num_seqs)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        if num_blocks is not None:
            check_int("num_blocks", num_blocks)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _check_dtype(dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            raise ValueError("dtype torch.bfloat16 is not supported on the CPU: the Triton interpreter computes bf16 "
                             "dots wrongly; use torch.float32 or torch.float16 there")

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
            check_int("max_model_len", max_model_len)
            self.max_model_len = min(self.max_model_len, max_model_len)
        if self.device.type == "cuda":
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if not visible or (self.device.index is not None and self.device.index >= visible):
                raise ValueError(f"device: expected a visible GPU ({visible} here), got {self.device}")
            if self.device.index is None:  # the current GPU (tensor-parallel rank r: the r-th after it)
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.tensor_parallel_size = check_tensor_parallel_size(self.config, tensor_parallel_size, self.device)
        _check_batch_invariant(batch_invariant)
        self.batch_invariant = batch_invariant
        self.tokenizer = _load_tokenizer(tokenizer, path)
        self._grammars: GrammarCompiler | None = None  # built on the first request with structured_outputs
        self._grammars_lock = threading.Lock()  # its construction, from compile_grammar's threads too
        self.eos_ids = set(self.config.eos_token_ids)
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        kv_format = _kv_cache_format(kv_cache_dtype, k_scale, v_scale, path, self.config)
        spec = EngineSpec(config=self.config, path=path, seed=seed, dtype=self.dtype, device=self.device,
                          max_model_len=self.max_model_len, page_size=page_size, num_blocks=num_blocks,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          cuda_graphs=cuda_graphs, gpu_memory_utilization=gpu_memory_utilization,
                          tensor_parallel_size=self.tensor_parallel_size,
                          all_reduce=allreduce_kind(self.device) if self.tensor_parallel_size > 1 else "nccl",
                          batch_invariant=batch_invariant, **kv_format)
        self.workers: Workers | None = None  # ranks 1..N-1 (tensor_parallel_size > 1)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        with on_device(self.device):
            if self.tensor_parallel_size == 1:
                rank0 = build_rank(spec, generator=generator)
            else:
                self.workers = Workers(spec)
                weakref.finalize(self, self.workers.close, "the LLM was garbage-collected")
                rank0 = self.workers.build_rank0(spec, generator)
        self.model: CausalLM = rank0.model
        self.kv_cache = rank0.kv_cache
        self.runner: ModelRunner = rank0.runner
        self.runner.workers = self.workers
        self.num_blocks = num_blocks = rank0.num_blocks
        self.block_manager = BlockManager(num_blocks, page_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.run_ahead = RunAhead(self.scheduler, self.runner)  # .enabled=False: the synchronous loop
        self._ids = itertools.count()  # request ids, and the block manager's ids of prompt_logits rows
        self._num_ids = 0
        self._requests: dict[int, Sequence] = {}  # unfinished requests by id
        self.counters = {"steps": 0, "computed_prefill_tokens": 0, "sampled_tokens": 0}  # since construction
        self.last_stats: dict = {}

    # ------------------------------------------------------------------ step API
    def add_request(self, prompt_token_ids, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id (what :meth:`step`'s outputs and :meth:`abort_request`
        name it by). ``prompt_token_ids``: a list of token ids (or a string, with a tokenizer).

        Raises ``TypeError``/``ValueError`` saying what is wrong with the request; nothing is queued.
        """
        self._check_open()
        params = SamplingParams() if sampling_params is None else sampling_params
        ids, error = self._check_request(prompt_token_ids, params)
        if error is not None:
            raise error
        return self._enqueue(ids, params, time.perf_counter()).seq_id

    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting or running (:meth:`step` has work)."""
        self._check_open()
        return self.scheduler.has_unfinished()

    @_on_engine_device
    def step(self) -> list[RequestOutput]:
        """Run one step of continuous batching.

        Returns one :class:`RequestOutput` per request that got a token or finished in this step
        (none for a prefill chunk that does not reach its prompt's end), with the tokens of this step
        in ``new_token_ids``: concatenating them over the steps streams the request's output. An
        empty list when nothing is unfinished.

        If it raises, no request advanced and no page joined the prefix cache; the requests stay
        queued (call ``step`` again to retry, or :meth:`abort_request`).
        """
        self._check_open()
        if not self.scheduler.has_unfinished():
            return []
        try:
            launched = self.run_ahead.next_step()
            self.run_ahead.launch_successor(launched)  # launched before its predecessor's tokens are read
            tokens = launched.tokens()
        except BaseException:
            self.runner.forget_decode_tables()  # first: host only, and discard may change tables
            self.run_ahead.discard()
            raise
        now = time.perf_counter()
        batch = launched.batch
        sampled = self.scheduler.postprocess(batch, tokens, now, self.eos_ids, self.max_model_len, launched.logprobs)
        self.run_ahead.confirm()
        self.counters["steps"] += 1
        self.counters["computed_prefill_tokens"] += sum(r.num_tokens for r in batch.rows if not r.decode)
        self.counters["sampled_tokens"] += len(tokens)
        outputs = [seq.step_output() for seq in sampled]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def abort_request(self, request_id: int) -> bool:
        """Stop a request now: its pages go back to the pool at once and it produces no more output.

        Returns True when the request was unfinished, False when it had already finished or been
        aborted (so aborting races harmlessly with completion). Raises ``ValueError`` for an id this
        engine never returned.
        """
        self._check_open()
        if self._drop(request_id):
            return True
        if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id < self._num_ids:
            raise ValueError(f"request_id {request_id!r} was never returned by this engine's add_request")
        return False

    def _drop(self, request_id) -> bool:
        """Abort an unfinished request (no check that the engine is open: cleanup after a failure)."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
        return seq is not None

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        """Run every prompt to completion with continuous batching (a loop over :meth:`step`);
        outputs in prompt order. Needs an engine with no unfinished request of ``add_request``.

        ``prompts``: lists of token ids (or strings, with a tokenizer). ``sampling_params``: one for all,
        or one per prompt.
        """
        self._check_open()
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of prompts (each a list of token ids or a string)")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        if self.has_unfinished_requests():
            raise RuntimeError(f"generate needs an idle engine, but {len(self._requests)} requests of add_request "
                               "are unfinished: step them to completion or abort them first")
        start = time.perf_counter()
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        seqs: dict[int, tuple[int, Sequence]] = {}
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids, error = self._check_request(prompt, params)
            if error is not None:
                outputs[i] = GenerationOutput(index=i, prompt_token_ids=ids or [], finish_reason="error",
                                              error=str(error))
                continue
            seq = self._enqueue(ids, params, start)
            seqs[seq.seq_id] = (i, seq)

        before = dict(self.counters, preemptions=self.scheduler.num_preemptions)
        bar = progress(desc="generate", total=len(seqs), unit="req", enabled=use_tqdm)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        i, seq = seqs[out.request_id]
                        outputs[i] = seq.to_output(i)
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    rate = (self.counters["sampled_tokens"] - before["sampled_tokens"]) / (time.perf_counter() - start)
                    bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        except BaseException:
            for request_id in seqs:  # a failed step (or Ctrl-C) leaves no request behind
                self._drop(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - start
        for out in outputs:
            if self.tokenizer is not None and out.finish_reason != "error":  # the ending stop id not written
                written = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
                out.text = self.tokenizer.decode(written)
        ok = [o for o in outputs if o.finish_reason != "error"]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in ok)
        output_tokens = sum(len(o.token_ids) for o in ok)
        self.last_stats = {
            "elapsed_s": elapsed,
            "steps": self.counters["steps"] - before["steps"],
            "num_requests": len(ok),
            "num_errors": len(outputs) - len(ok),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
            "prefix_cache_hit_rate": sum(o.num_cached_tokens for o in ok) / prompt_tokens if prompt_tokens else 0.0,
            "preemptions": self.scheduler.num_preemptions - before["preemptions"],
            "computed_prefill_tokens": self.counters["computed_prefill_tokens"] - before["computed_prefill_tokens"],
        }
        return outputs

    # ------------------------------------------------------------------ requests
    def _new_id(self) -> int:
        self._num_ids += 1
        return next(self._ids)

    def _enqueue(self, ids: list[int], params: SamplingParams, arrival: float) -> Sequence:
        # a copy: the request runs with the parameters it was checked with, whatever the caller changes later
        params = copy.copy(params)
        params.stop_token_ids = tuple(params.stop_token_ids)
        if params.logit_bias is not None:
            params.logit_bias = dict(params.logit_bias)
        seq = Sequence(self._new_id(), ids, params, arrival, self.device)
        if params.structured_outputs is not None:  # compiled by _check_request: a cache hit
            seq.grammar = self._grammars.grammar(params.structured_outputs)
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq
        return seq

    def _check_request(self, prompt, params) -> tuple[list[int] | None, Exception | None]:
        """(token ids, None) for a good request, else (ids or None, the error to raise or report)."""
        ids, error = self._check_prompt(prompt)
        if error is not None:
            return ids, error
        if not isinstance(params, SamplingParams):
            return ids, TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        problem = params.problem()
        if problem:
            return ids, ValueError(problem)
        bad = next((t for t in params.logit_bias or () if t >= self.config.vocab_size), None)
        if bad is not None:
            return ids, ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        total = min(len(ids) + params.max_tokens - 1, self.max_model_len)
        pages = -(-total // self.page_size)
        if pages > self.num_blocks:
            return ids, ValueError(
                f"request needs {pages} KV pages of {self.page_size} tokens ({len(ids)} prompt + {params.max_tokens} "
                f"max_tokens) but the whole pool has {self.num_blocks}: it can never fit")
        if params.structured_outputs is not None:
            try:
                self._grammar_compiler().check(params.structured_outputs)
            except (ValueError, TypeError) as e:
                return ids, e
        return ids, None

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` (nothing without one) into the engine's grammar cache, so
        that :meth:`add_request` with it finds the compiled grammar there; raises the ``ValueError``
        that ``add_request`` would for a grammar it refuses. Unlike the rest of the engine, safe to call
        from another thread while the engine runs (it touches only the grammar compiler, which
        compiles outside the GIL): the server compiles a request's grammar on a thread of its own, so
        that a new schema does not stall the steps of the requests already running."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None and not params.problem():
            self._grammar_compiler().check(params.structured_outputs)

    def grammar_compiled(self, params: SamplingParams) -> bool:
        """Whether ``params.structured_outputs`` is one of the grammars this engine compiled last (so
        :meth:`add_request` with it likely finds it in the cache); thread-safe as :meth:`compile_grammar`,
        and never waits for the compiler's construction (which holds its lock for seconds)."""
        grammars = self._grammars  # (one read of the reference: none until constructed)
        return grammars is not None and params.structured_outputs is not None and \
            grammars.compiled_before(params.structured_outputs)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the engine's tokenizer (its vocabulary's text), but it "
                                     "has none: pass LLM(..., tokenizer=...) or a model directory with a tokenizer.json")
                self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, sorted(self.eos_ids))
            return self._grammars

    def _check_prompt(self, prompt) -> tuple[list[int] | None, Exception | None]:
        """Token ids of a prompt (a string goes through the tokenizer), each in the vocabulary, at
        most ``max_model_len`` of them; or the error."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return None, TypeError("prompt is a string but the engine has no tokenizer (pass token ids)")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            return None, TypeError(f"prompt must be a list of int token ids (or a string), got {type(prompt).__name__}")
        # the element checks run at C speed (type set, min, max) and element by element only to name a bad one:
        # a 4K-token prompt took ~1 ms of Python per element loop, serial in a burst of requests
        if not set(map(type, prompt)) <= {int}:
            bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                return None, TypeError(f"prompt must be a list of int token ids, got an element {bad!r} of type "
                                       f"{type(bad).__name__}")
        ids = list(prompt)
        if not ids:
            return ids, ValueError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.config.vocab_size)
            return ids, ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) > self.max_model_len:
            return ids, ValueError(f"prompt has {len(ids)} tokens, more than the model's maximum length "
                                   f"{self.max_model_len}")
        return ids, None

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        """Raise ``RuntimeError`` once :meth:`close` ran, and the tensor-parallel group's
        :class:`~pagedflash.engine.workers.WorkerError` once a rank died (the engine closed itself)."""
        if self.runner is None:
            raise RuntimeError("the engine is closed (LLM.close() was called): build a new LLM to run requests")
        if self.workers is not None and self.workers.closed is not None:
            raise WorkerError(f"the tensor-parallel engine is closed: {self.workers.closed}")

    @_on_engine_device
    @torch.inference_mode()
    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits ``[len(p), vocab]`` at every position of each prompt, from one packed prefill
        through the paged cache (the pages are released afterwards; once the forward completed, their
        full pages stay in the prefix cache). For checks against references.

        Raises ``TypeError``/``ValueError`` naming the bad prompt, and
        :class:`pagedflash.cache.NoFreeBlocksError` when the prompts do not fit the free pages."""
        self._check_open()
        if not prompts:
            return []
        checked = []
        for i, prompt in enumerate(prompts):
            ids, error = self._check_prompt(prompt)
            if error is not None:
                raise type(error)(f"prompts[{i}]: {error}")
            checked.append(ids)
        seqs = [Sequence(self._new_id(), ids, SamplingParams(), 0.0, self.device) for ids in checked]
        try:
            for seq in seqs:
                seq.block_table, _ = self.block_manager.allocate(seq.seq_id, seq.token_ids)
            # every position is recomputed (rewriting a cached page with equal values is harmless)
            batch = Batch([ScheduledRow(seq, 0, len(seq)) for seq in seqs])
            logits = self.runner.prompt_logits(batch)
            for seq in seqs:
                self.block_manager.commit(seq.seq_id, len(seq))
        finally:
            for seq in seqs:
                if seq.seq_id in self.block_manager:
                    self.block_manager.free(seq.seq_id)
        return list(logits.split([len(s) for s in seqs]))

    @_on_engine_device
    def close(self) -> None:
        """Release the KV pool, CUDA graphs and weights, and this thread's reused launch buffers (their
        memory back to the GPU at once, the garbage collected first), and stop the tensor-parallel
        workers. Calling it again does nothing."""
        released = self.runner is not None
        if released:
            self.runner.graphs.clear()
        self.runner = self.run_ahead = self.kv_cache = self.model = None
        if self.workers is not None:
            self.workers.close()
        if released:
            scratch.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load_tokenizer(tokenizer, path: str | None):
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return _Tokenizer(tokenizer) if type(tokenizer).__module__.startswith("tokenizers") else tokenizer
    file = os.fspath(tokenizer) if tokenizer is not None else (os.path.join(path, "tokenizer.json") if path else None)
    if file is not None and os.path.isdir(file):
        file = os.path.join(file, "tokenizer.json")
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


def _check_batch_invariant(batch_invariant) -> None:
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected a bool, got {batch_invariant!r}")


def _kv_cache_format(kv_cache_dtype, k_scale, v_scale, path: str | None, config: ModelConfig) -> dict:
    """The pool's dtype and, for fp8, its per-layer scales (given, else the checkpoint's, else 1.0),
    as :class:`EngineSpec` fields."""
    if kv_cache_dtype == "auto":
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale, v_scale: apply to an fp8 KV cache only (kv_cache_dtype='fp8_e4m3'), "
                             "expected None with kv_cache_dtype='auto'")
        return {}
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    n, hkv = config.num_layers, config.num_kv_heads
    if path is not None and (k_scale is None or v_scale is None):
        k_file, v_file = read_kv_scales(path, n, hkv)
        k_scale = k_file if k_scale is None else k_scale
        v_scale = v_file if v_scale is None else v_scale
    return dict(kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
                **{name: tuple(map(tuple, layer_scales(name, value, n, hkv, "cpu").tolist()))
                   for name, value in (("k_scale", k_scale), ("v_scale", v_scale))})


def _check_dtype(dtype) -> torch.dtype | None:
    """One of the dtypes the kernels take (a name or a torch.dtype), or None for the default."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16 (or one of {sorted(_DTYPES)}), "
                     f"got {dtype!r}")
