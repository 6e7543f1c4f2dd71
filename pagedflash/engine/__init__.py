"""A small serving engine on pagedflash's kernels and paged cache (in the spirit of nano-vllm).

- :class:`LLM` loads a Llama-architecture model (local HF directory or a config with random weights)
  and runs :meth:`LLM.generate` with continuous batching, chunked prefill and prefix caching.
- :class:`SamplingParams` says how each request generates; :class:`GenerationOutput` is its result.

Layout: ``config`` (ModelConfig) -> ``weights`` + ``model`` (the decoder) -> ``sequence`` ->
``scheduler`` (what runs each step) -> ``runner`` (metadata, forward, CUDA graphs, sampling) -> ``llm``.
"""

from pagedflash.engine.config import ModelConfig
from pagedflash.engine.llm import LLM
from pagedflash.engine.sampling import SamplingParams
from pagedflash.engine.sequence import GenerationOutput

__all__ = ["LLM", "GenerationOutput", "ModelConfig", "SamplingParams"]
