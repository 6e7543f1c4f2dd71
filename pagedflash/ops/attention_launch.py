"""How :mod:`pagedflash.ops.attention` launches its kernel: the plan's fast-launch handle, else
Triton's launch with a safe-tile retry where compiling fails, and the global scratch that device-side
tensor descriptors (TMA) take.

The kernel is an argument, read by the caller at each call (:data:`pagedflash.ops.attention._attention_kernel`,
which tools and tests replace there).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import triton

from pagedflash.ops import fastlaunch
from pagedflash.ops.attention_plan import Plan
from pagedflash.ops.launch import LaunchConfig
from pagedflash.ops.utils import interpreted

try:  # Triton's allocator slot for global scratch (a ContextVar), read on every TMA launch
    from triton.runtime import _allocation
except ImportError:  # another triton layout: ensure_tma_allocator just sets ours
    _allocation = None


# the current GPU's index without torch.cuda.current_device()'s lazy-init check: Triton asks for
# scratch only while it launches on a GPU, so CUDA is initialized (None in a CPU-only torch)
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (Triton asks for it per launch, on the
    current device; fast launches take the same buffer without the call:
    :func:`pagedflash.ops.fastlaunch.register_scratch_allocator`)."""
    if interpreted():
        return fastlaunch.global_scratch(size, -1)
    index = _cuda_get_device() if _cuda_get_device is not None else torch.cuda.current_device()
    return fastlaunch.global_scratch(size, index)


fastlaunch.register_scratch_allocator(_tma_scratch)


def ensure_tma_allocator() -> None:
    """Device-side descriptors need a Triton allocator; install ours only where none is set, so a
    user's own allocator (used by their kernels) is left in place and serves ours too."""
    try:
        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except AttributeError:  # another triton layout: just set ours
        pass
    triton.set_allocator(_tma_scratch)


# Triton 3.6's ptxas crashes (SIGSEGV) on some tile/pipeline combinations of this kernel on sm90. A
# launch whose compile fails retries once with a conservative tile (same rows, so the same grid)
# and remembers the substitution; the failure is reported as a warning, never a wrong answer.
_COMPILE_ERRORS = tuple(
    e for e in (getattr(triton.runtime.errors, "PTXASError", None), getattr(triton.runtime.errors, "OutOfResources", None))
    if e is not None
)
_FALLBACK: dict[tuple, tuple[LaunchConfig, bool]] = {}


def _launch_with_fallback(plan: Plan, args: tuple, kernel) -> None:
    """The public launch of ``kernel``, retried once with a safe tile if compiling fails; a launch
    that compiled as planned binds the plan's slot (:mod:`pagedflash.ops.fastlaunch`) for its next
    call. None arguments (absent optional tensors) become ``out`` (``args[3]``), as Triton would
    specialize a None into the kernel."""
    args = fastlaunch.stand_in(args, args[3])
    key = plan.fallback_key
    cfg, tma_on = _FALLBACK.get(key, (plan.cfg, plan.tma_on))
    for attempt in range(2):
        if tma_on:
            ensure_tma_allocator()
        try:
            compiled = kernel[plan.grid](*args, **plan.consts, BLOCK_N=cfg.block_n, USE_TMA=tma_on,
                                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        except _COMPILE_ERRORS as e:
            if plan.consts["INVARIANT"]:  # another tile would round other rows otherwise: no fallback
                raise RuntimeError(f"pagedflash: the batch-invariant tile {cfg} does not compile here "
                                   f"({type(e).__name__}); set PAGEDFLASH_INVARIANT_TILE to another (or, for calls "
                                   f"of several query rows, PAGEDFLASH_INVARIANT_PREFILL_TILE; for wide decode "
                                   f"calls, PAGEDFLASH_INVARIANT_DECODE_TILE)") from e
            safe = dataclasses.replace(cfg, block_n=32, num_warps=4, num_stages=1, tma=False)
            if attempt or (cfg, tma_on) == (safe, False):
                raise
            warnings.warn(f"pagedflash: compiling {cfg} failed ({type(e).__name__}); using {safe}", stacklevel=4)
            _FALLBACK[key] = (safe, False)
            cfg, tma_on = safe, False
            continue
        if key not in _FALLBACK:
            fastlaunch.bind(plan.slot, kernel, compiled, dict(plan.consts, BLOCK_N=cfg.block_n, USE_TMA=tma_on))
        return


def launch(plan: Plan, args: tuple, kernel) -> None:
    """``kernel`` (the attention kernel, read by the caller at each call) over the plan's grid:
    through the plan's fast-launch handle when it has one and no compile fallback applies, else
    :func:`_launch_with_fallback`."""
    if not (_FALLBACK and plan.fallback_key in _FALLBACK):
        if plan.tma_on:
            ensure_tma_allocator()
        if fastlaunch.run(plan.slot, kernel, plan.grid, args):
            return
    _launch_with_fallback(plan, args, kernel)
