"""The engine's model, under its earlier import path: :mod:`pagedflash.engine.models` holds the
families and their shared layers; ``CausalLM`` here is their base class (what the runner and the
executor type against), ``AttentionMetadata`` the per-step layout every layer reads."""

from pagedflash.engine.models import AttentionMetadata, CausalLM, model_class

__all__ = ["AttentionMetadata", "CausalLM", "model_class"]
