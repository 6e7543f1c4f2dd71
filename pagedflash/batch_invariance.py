"""Batch-invariant mode: a row's attention output (and LSE) bit for bit the same whatever else is in
the call.

With the mode on, every attention entry point computes a query row the same way whatever the batch
size, the other rows' lengths, the SM count, the split count, and however the row's keys reached the
cache (one prefill, chunked-prefill chunks, decode steps): one key tile and one layout of a row in
its warp for every call (:func:`pagedflash.ops.launch.invariant_config`; the decode tile of wide
decode launches and the opt-in prefill tile change how many rows and warps share a tile, never a
row's layout), keys in splits at fixed absolute key positions (:class:`pagedflash.ops.launch.SplitRule`:
a row's first 4,096 keys in splits of 512, then splits of 2,048; opt-in, a middle tier of its own
split size), each split's state computed by the same EXACT step (masked or not, a key's bits agree), and the splits merged left to
right in one order, by the kernel itself (one program per row) or by the combine (programs sharing a
row's splits, a partial state each). On Hopper the Gluon prefill kernel takes the mode's prefill
calls (16-bit or fp8 K/V) in a variant of its own that gives a row the portable kernel's bits
(:mod:`pagedflash.ops.prefill_hopper`). See README "Batch invariance" for what is guaranteed and what
it costs.

The switch: an argument of each entry point (``batch_invariant=True``), else the process-wide
default set here (:func:`set_batch_invariant`, the :func:`batch_invariant` context manager, or the
environment variable ``PAGEDFLASH_BATCH_INVARIANT=1`` read at import).
"""

from __future__ import annotations

import contextlib
import os

_ENABLED = os.environ.get("PAGEDFLASH_BATCH_INVARIANT", "0") == "1"


def is_batch_invariant() -> bool:
    """The process-wide default of the mode."""
    return _ENABLED


def set_batch_invariant(enabled: bool) -> None:
    """Set the process-wide default of the mode (entry points called with ``batch_invariant=None``)."""
    global _ENABLED
    _ENABLED = _check(enabled)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """``with batch_invariant():`` — the mode on (or off) as the default inside the block."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, _check(enabled)
    try:
        yield
    finally:
        _ENABLED = previous


def resolve(batch_invariant: bool | None) -> bool:
    """An entry point's ``batch_invariant`` argument: None is the process-wide default."""
    return _ENABLED if batch_invariant is None else _check(batch_invariant)


def _check(enabled) -> bool:
    if not isinstance(enabled, bool):
        raise TypeError(f"batch_invariant: expected a bool (or None for the default), got {enabled!r}")
    return enabled
