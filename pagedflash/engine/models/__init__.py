"""The decoder families, one module per layer structure over the shared layers of :mod:`.common`
(as vLLM's ``model_executor/models`` and nano-vllm's ``models``), and the registry that picks the
class from the checkpoint's ``architectures`` (:data:`pagedflash.engine.config.FAMILIES` says which
families exist and which config keys each implements)."""

from __future__ import annotations

from pagedflash.engine.config import ModelConfig
from pagedflash.engine.models.common import AttentionMetadata, CausalLM
from pagedflash.engine.models.gemma import GemmaForCausalLM
from pagedflash.engine.models.llama import LlamaForCausalLM
from pagedflash.engine.models.moe import (
    GptOssForCausalLM,
    GraniteMoeForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from pagedflash.engine.models.olmo2 import Olmo2ForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class that builds ``config``'s architecture."""
    try:
        return MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {config.architecture!r}; "
                         f"supported: {', '.join(MODELS)}") from None


__all__ = ["MODELS", "AttentionMetadata", "CausalLM", "model_class"]
