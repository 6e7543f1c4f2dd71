"""Ways in to the engine from outside Python: :mod:`pagedflash.entrypoints.openai`, the
OpenAI-compatible HTTP server (``pagedflash serve``). Nothing in the engine imports this package."""
