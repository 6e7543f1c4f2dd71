"""A small serving engine on pagedflash's kernels and paged cache (in the spirit of nano-vllm).

- :class:`LLM` loads a model of a supported family (:mod:`pagedflash.engine.models`: Llama, Mistral,
  Qwen2/3, Granite, Phi-3, OLMo 2, Gemma 2/3, and the mixtures of experts Mixtral, Qwen3-MoE, GPT-OSS;
  a local HF directory, strictly, or a config with random weights) and runs continuous batching with chunked prefill and prefix caching: :meth:`LLM.generate` to
  completion, or one step at a time (:meth:`LLM.add_request`, :meth:`LLM.step`, for streaming).
- :class:`SamplingParams` says how each request generates; :class:`RequestOutput` is what a step
  produced for a request, :class:`GenerationOutput` the result of ``generate``.

Layout: ``config`` (ModelConfig) -> ``weights`` + ``models`` (the decoders) -> ``sequence`` ->
``scheduler`` (what runs each step) -> ``runner`` (metadata, forward, CUDA graphs, sampling) ->
``run_ahead`` (launches steps, greedy decode one step ahead) -> ``llm``; for several GPUs
``parallel`` (what each rank holds), ``executor`` (what every rank builds), ``workers`` (the rank
processes; :class:`WorkerError` when one fails).
"""

from pagedflash.engine.config import ModelConfig
from pagedflash.engine.llm import LLM
from pagedflash.engine.sampling import SamplingParams
from pagedflash.engine.sequence import GenerationOutput, RequestOutput
from pagedflash.engine.workers import WorkerError

__all__ = ["LLM", "GenerationOutput", "ModelConfig", "RequestOutput", "SamplingParams", "WorkerError"]
