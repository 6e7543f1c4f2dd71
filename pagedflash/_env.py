"""Where the kernels run: on a CUDA device compiled, elsewhere under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported, so this module must run before
anything imports triton. ``pagedflash/__init__.py`` imports it first. A user who has already set the
variable (either way) keeps their choice.
"""

import os
import sys


def _configure_interpreter() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_configure_interpreter()


def interpreted() -> bool:
    """True when Triton kernels run under the CPU interpreter (read once: triton reads it at import)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        _INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return _INTERPRETED


_INTERPRETED: bool | None = None
