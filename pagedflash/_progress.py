"""One progress-bar rule for the engine and the benchmarks: a tqdm bar when stderr is a terminal,
nothing in a log or a pipe (tqdm is optional; without it there is never a bar)."""

from __future__ import annotations

import sys
from collections.abc import Iterable


def progress(items: Iterable | None = None, *, desc: str, total: int | None = None, unit: str = "it",
             enabled: bool = True):
    """A tqdm bar over ``items`` (or a manual bar of ``total`` steps when ``items`` is None).

    Without a terminal, tqdm, or with ``enabled=False``: ``items`` unchanged, or None for a manual
    bar (callers write ``if bar: bar.update(n)``)."""
    if enabled and sys.stderr.isatty() and (items is not None or total):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            return tqdm(items, desc=desc, total=total, unit=unit, leave=False, dynamic_ncols=True)
    return items
