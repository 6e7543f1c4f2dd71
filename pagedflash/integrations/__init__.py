"""Integrations of pagedflash's kernels into other libraries (``transformers``)."""
