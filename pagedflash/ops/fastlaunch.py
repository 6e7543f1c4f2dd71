"""Relaunching a compiled Triton kernel without ``JITFunction.run``'s per-call work.

``kernel[grid](*args, **constexprs)`` binds every argument, specializes each one (pointer dtype and
16-byte alignment, the range and divisibility of every int), hashes that into a cache key, finds
the compiled kernel, checks the globals it read, and only then calls the compiled kernel's C
launcher: most of a launch's host time, paid again on every call. A caller that knows a launch
specializes exactly like an earlier one (its own key covers every dtype, alignment, int value,
constexpr and option: see :mod:`pagedflash.ops.attention_plan`) keeps a :class:`Slot` per such
key and, from the second call on, calls the launcher of the kernel the first call returned.

The launcher's calling convention is a Triton internal that changes between releases, so:

- handles are made only under the Triton releases whose convention is known
  (:data:`KNOWN_VERSIONS`) and only for objects that have its shape (a ``JITFunction`` whose
  constexpr parameters come last, a ``CompiledKernel`` with ``run``/``function``/
  ``packed_metadata``); anything else keeps the public launch, and :func:`status` says why;
- every slot's first launch is the public one;
- an exception from a handle turns the fast path off for the rest of the process (a warning says
  why) and that launch is repeated through the public path. A handle that raised launched nothing
  (it runs no launch hooks, the one code that runs after the kernel is queued; the launcher
  converts every argument before queueing, and a failed queueing queues nothing), so in-place
  kernels (RoPE) may use handles too;
- a handle is skipped (public launch) when the current device is not the one it was bound on,
  the kernel object changed, pre-run or launch hooks are set (profilers), or
  ``knobs.runtime.debug`` changed;
- ``PAGEDFLASH_FAST_LAUNCH=0`` or :func:`set_enabled` forces the public path (tests run both).

**Direct launches.** Triton 3.6's launcher (``CudaLauncher.__call__``) is itself Python around a C
launch function: per call it builds two closures and asks its allocators for the kernel's global
scratch (``grid × num_ctas × global_scratch_size`` bytes; kernels with device-side tensor
descriptors have some) and profile scratch, then calls ``launcher.launch``. Where the launcher has
3.6's shape (:func:`_direct_shape`: the C function's leading-argument format, ``__call__``'s
parameters, the attributes it reads; no profile scratch; a scratch alignment CUDA memory always
has), the handle records those attributes at bind time and calls ``launcher.launch`` itself,
passing the global scratch that the launcher's allocator would have returned: while Triton's
current allocator is pagedflash's (:func:`register_scratch_allocator`), :func:`global_scratch`'s
buffer, taken with a spec key kept per handle; under any other allocator (a user's
``triton.set_allocator``) the launcher is called as before. The exception argument above holds for
the direct call: the scratch is taken before anything is queued, the C function converts every
argument before queueing, and with no hooks passed it runs nothing after. :data:`DIRECT`
switches it: on by default, ``PAGEDFLASH_DIRECT_LAUNCH=0`` turns it off; :func:`direct_status`
says whether handles use it.

Not checked on the fast path, as ``JITFunction.run`` does: that globals the kernel read were not
reassigned (pagedflash's kernels read only constants) and compile knobs other than ``debug``
changed after the first launch (set them before launching, or turn the fast path off).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings

import torch
import triton

from pagedflash.ops import scratch

# Triton releases whose CompiledKernel launcher convention this module speaks: 3.6 (the H200's).
KNOWN_VERSIONS = ("3.6.",)
# 3.6's C launch function: grid (3 ints), stream and function (2 handles), cooperative grid and PDL
# (2 flags), then global scratch, profile scratch, kernel metadata, launch metadata, enter and exit
# hooks (6 objects), then the kernel's arguments; and its launcher's __call__ parameters
DIRECT_FORMAT = "iiiKKppOOOOOO"
DIRECT_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
DIRECT_ALIGNMENT = 256  # every CUDA allocation starts at a multiple of this (torch's at 512)
DIRECT = os.environ.get("PAGEDFLASH_DIRECT_LAUNCH", "1") != "0"  # direct launches (module doc)

_enabled = os.environ.get("PAGEDFLASH_FAST_LAUNCH", "1") != "0"
_off_reason = "" if _enabled else "PAGEDFLASH_FAST_LAUNCH=0"
_api: str | None | bool = False  # False: not detected yet; None: the known API is there; str: why not
_refused = ""  # the last reason a launch kept the public path (a kernel or result of another shape)
_driver = None  # (get_current_device, get_current_stream), taken from Triton's active driver once
_knobs = None  # triton.knobs.runtime: the launch hooks and the debug flag
_HookChain = None  # 3.6's hook list type: one with no hooks needs no call
_allocator = None  # Triton's allocator ContextVar (triton.runtime._allocation._allocator)
_own_allocator = None  # the allocator whose buffers direct launches take themselves
_direct_refused = ""  # the last reason a handle kept calling its launcher
_direct_handles = 0  # handles made that call the C launch function
_LAUNCHER_TYPES: dict[type, str | None] = {}  # launcher class -> why it has not 3.6's shape (None: it has)
_DEVICES: dict[int, torch.device] = {}  # CUDA devices by index, made once (-1: the CPU)


class Slot:
    """The fast handle of one launch signature (None until a public launch binds one)."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle = None


def set_enabled(enabled: bool) -> bool:
    """Turn the fast path on or off for the process; returns the previous setting. Turning it on
    again also forgets a failure that turned it off, and the last refused kernel."""
    global _enabled, _off_reason, _refused
    previous, _enabled = _enabled, bool(enabled)
    _off_reason = "" if _enabled else "set_enabled(False)"
    if _enabled:
        _refused = ""
    return previous


def enabled() -> bool:
    return _enabled


def status() -> str:
    """"on", or why launches take the public path: turned off, an unknown Triton, or a refused kernel."""
    if not _enabled:
        return f"off: {_off_reason}"
    if isinstance(_api, str):
        return f"unavailable: {_api}"
    if _refused:
        return f"refused: {_refused}"
    return "on" if _api is None else "no launch yet"


def direct_status() -> str:
    """"on" (every handle calls the C launch function), "on, but not for every kernel (...)" (some
    kept their launcher), "no handle yet", or why no handle calls it (module doc)."""
    if not DIRECT:
        return "off: DIRECT = False (PAGEDFLASH_DIRECT_LAUNCH=0, or set by the caller)"
    if not _enabled or isinstance(_api, str):
        return f"off: the fast launch is {status()}"
    if _direct_refused:
        if _direct_handles:
            return f"on, but not for every kernel (the last refused: {_direct_refused})"
        return f"refused: {_direct_refused}"
    return "on" if _direct_handles else "no handle yet"


def register_scratch_allocator(allocator) -> None:
    """Name pagedflash's Triton allocator: one that returns :func:`global_scratch`'s buffer for
    the current device (on a GPU). While it is Triton's current allocator, direct launches take
    that buffer without calling it."""
    global _own_allocator
    _own_allocator = allocator


def _device(index: int) -> torch.device:
    device = _DEVICES.get(index)
    if device is None:
        device = _DEVICES[index] = torch.device("cpu") if index < 0 else torch.device("cuda", index)
    return device


def _scratch_specs(nbytes: int) -> tuple:
    return (((nbytes,), torch.int8),)


def global_scratch(nbytes: int, index: int) -> torch.Tensor:
    """Triton's global scratch for a launch on CUDA device ``index`` (-1: the CPU, for the
    interpreter): ``nbytes`` int8 under :mod:`pagedflash.ops.scratch`'s reuse rules (per thread,
    device and stream; fresh while a CUDA graph is captured or inside ``scratch.no_reuse()``),
    starting at a multiple of :data:`DIRECT_ALIGNMENT` on a GPU."""
    return scratch.buffers(_scratch_specs(nbytes), _device(index))[0]


class _Handle:
    """One compiled kernel's launcher with what it takes besides a call's grid and arguments: the
    launch is ``launcher(*grid, stream, function, metadata, None, None, None, *args, *tail)``, or,
    where ``direct`` (the launcher's C function) is set, ``direct(*grid, stream, function,
    cooperative, pdl, global scratch, None, metadata, None, None, None, *args, *tail)``, in
    :func:`run`, which also decides whether the handle applies."""

    __slots__ = ("fn", "compiled", "launcher", "function", "metadata", "tail", "device", "debug", "direct",
                 "cooperative", "pdl", "scratch_bytes", "scratch_device", "scratch_key")

    def __init__(self, fn, compiled, tail: tuple, device: int, debug) -> None:
        global _direct_refused, _direct_handles
        self.fn = fn
        self.compiled = compiled
        self.launcher = launcher = compiled.run  # a property in 3.6: loads the module once, then the launcher
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.tail = tail  # the constexpr values, in parameter order (they follow every runtime argument)
        self.device = device
        self.debug = debug
        self.direct = None
        reason = _direct_shape(launcher)
        if reason is None:
            self.direct = launcher.launch
            self.cooperative, self.pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
            self.scratch_bytes = launcher.num_ctas * launcher.global_scratch_size  # per program
            self.scratch_device = _device(device)
            self.scratch_key = ((), ())  # (grid, scratch specs) of the last direct launch
            _direct_handles += 1
        else:
            _direct_refused = reason


def _direct_shape(launcher) -> str | None:
    """Why ``launcher`` cannot be bypassed by a direct launch (None where it can: module doc)."""
    kind = type(launcher)
    reason = _LAUNCHER_TYPES.get(kind, False)
    if reason is False:
        module = sys.modules.get(kind.__module__)
        try:
            params = tuple(inspect.signature(kind.__call__).parameters)
        except (AttributeError, TypeError, ValueError):  # not a Python-level __call__
            params = ()
        reason = None
        if getattr(module, "_BASE_ARGS_FORMAT", None) != DIRECT_FORMAT:
            reason = f"{kind.__module__}'s launch format is not {DIRECT_FORMAT}"
        elif params != DIRECT_CALL:
            reason = f"{kind.__qualname__}.__call__ takes {params}, not {DIRECT_CALL}"
        _LAUNCHER_TYPES[kind] = reason
    if reason is not None:
        return reason
    names = ("launch", "num_ctas", "global_scratch_size", "global_scratch_align", "profile_scratch_size",
             "launch_cooperative_grid", "launch_pdl")
    missing = [name for name in names if not hasattr(launcher, name)]
    if missing:
        return f"{kind.__qualname__} lacks {missing}"
    if launcher.profile_scratch_size:  # instrumented: its allocator is asked on every launch
        return "the kernel asks for profile scratch"
    align = launcher.global_scratch_align
    if launcher.global_scratch_size:
        if _allocator is None:
            return "triton.runtime._allocation has no _allocator"
        if not (isinstance(align, int) and 0 < align <= DIRECT_ALIGNMENT and align & (align - 1) == 0):
            return f"global scratch alignment {align} is not a power of two up to {DIRECT_ALIGNMENT}"
    return None


def _detect() -> str | None:
    """Whether the known Triton API is there (detected once): None, or the reason it is not."""
    global _api, _driver, _knobs, _HookChain
    if _api is not False:
        return _api
    version = getattr(triton, "__version__", "")
    if not version.startswith(KNOWN_VERSIONS):
        _api = f"triton {version} is not a known release ({', '.join(v + 'x' for v in KNOWN_VERSIONS)})"
        return _api
    try:
        from triton.runtime import driver

        active = driver.active
        get_device = active.get_current_device
        if get_device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
            get_device = torch._C._cuda_getDevice  # the same answer without the lazy-init check
        getters = (get_device, active.get_current_stream)
        knobs = triton.knobs.runtime
        knobs.launch_enter_hook, knobs.launch_exit_hook, knobs.debug  # noqa: B018 (they exist)
    except Exception as e:  # noqa: BLE001  (any other layout: public launches only)
        _api = f"triton's driver/knobs layout differs ({type(e).__name__}: {e})"
        return _api
    _api, _driver, _knobs, _HookChain = None, getters, knobs, getattr(triton.knobs, "HookChain", None)
    _find_allocator()
    return None


def _find_allocator() -> None:
    global _allocator
    try:
        from triton.runtime import _allocation

        _allocator = _allocation._allocator
    except (ImportError, AttributeError):  # no direct launch of kernels with global scratch
        _allocator = None


def bind(slot: Slot, fn, compiled, consts: dict) -> None:
    """After a successful public launch ``compiled = fn[grid](*args, **consts, ...)``: give ``slot``
    a handle that repeats it for the same signature, where the installed Triton allows."""
    global _refused
    slot.handle = None
    if not _enabled or _detect() is not None:
        return
    reason, const_names = _kernel_shape(fn)
    if reason is None:
        reason = _compiled_shape(compiled)
    if reason is None:
        try:
            tail = tuple(consts[name] for name in const_names)
            slot.handle = _Handle(fn, compiled, tail, _driver[0](), _knobs.debug)
            return
        except Exception as e:  # noqa: BLE001
            reason = f"binding failed ({type(e).__name__}: {e})"
    _refused = reason


_KERNELS: dict[int, tuple] = {}  # id(fn) -> (fn, refusal reason or None, constexpr names in order)


def _kernel_shape(fn) -> tuple[str | None, tuple[str, ...]]:
    """Whether ``fn`` looks like 3.6's JITFunction with its constexprs last (once per kernel)."""
    known = _KERNELS.get(id(fn))
    if known is not None and known[0] is fn:
        return known[1], known[2]
    params = getattr(fn, "params", None)
    reason, names = None, ()
    if params is None or not hasattr(fn, "pre_run_hooks"):
        reason = f"{type(fn).__name__} is not a JITFunction"
    else:
        flags = [getattr(p, "is_constexpr", None) for p in params]
        if None in flags or flags != sorted(flags):  # runtime arguments first, then every constexpr
            reason = f"{fn}: constexpr parameters must follow the runtime ones"
        names = tuple(p.name for p in params if getattr(p, "is_constexpr", False))
    _KERNELS[id(fn)] = (fn, reason, names)
    return reason, names


def _compiled_shape(compiled) -> str | None:
    if compiled is None or hasattr(compiled, "result"):  # the interpreter, or an async compile
        return f"the launch returned {type(compiled).__name__}, not a compiled kernel"
    missing = [a for a in ("run", "function", "packed_metadata") if not hasattr(compiled, a)]
    if missing:
        return f"{type(compiled).__name__} lacks {missing}"
    return None


def run(slot: Slot, fn, grid: tuple[int, int, int], args: tuple) -> bool:
    """Launch ``fn`` over ``grid`` (three ints) through ``slot``'s handle; False (nothing launched) when there is
    none or it does not apply to this call (module doc), and the caller launches publicly."""
    handle = slot.handle
    if handle is None or not _enabled or fn is not handle.fn or fn.pre_run_hooks:
        return False
    knobs = _knobs
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    # a hook that does nothing: None, or 3.6's default, a chain of no hooks
    if ((enter is not None and (type(enter) is not _HookChain or enter.calls))
            or (leave is not None and (type(leave) is not _HookChain or leave.calls))
            or knobs.debug != handle.debug):
        return False
    device = handle.device
    getters = _driver
    if getters[0]() != device:
        return False
    try:
        direct = handle.direct if DIRECT else None
        buffer = None
        if direct is not None and handle.scratch_bytes:
            if _allocator.get() is _own_allocator:
                key = handle.scratch_key
                if key[0] != grid:
                    key = handle.scratch_key = (tuple(grid), _scratch_specs(grid[0] * grid[1] * grid[2]
                                                                            * handle.scratch_bytes))
                buffer = scratch.buffers(key[1], handle.scratch_device)[0]
            else:  # a user's allocator: the launcher asks it
                direct = None
        if direct is not None:
            direct(grid[0], grid[1], grid[2], getters[1](device), handle.function, handle.cooperative, handle.pdl,
                   buffer, None, handle.metadata, None, None, None, *args, *handle.tail)
        else:
            handle.launcher(grid[0], grid[1], grid[2], getters[1](device), handle.function, handle.metadata, None,
                            None, None, *args, *handle.tail)
    except Exception as e:  # noqa: BLE001  (any failure: the public path, for good)
        _disable(f"a fast launch failed ({type(e).__name__}: {e})")
        warnings.warn(f"pagedflash: {_off_reason}; using triton's public launch from now on", stacklevel=3)
        return False
    return True


def _disable(reason: str) -> None:
    global _enabled, _off_reason
    _enabled, _off_reason = False, reason


def stand_in(args: tuple, tensor) -> tuple:
    """``args`` with each None replaced by ``tensor``: the public launch's arguments where None marks
    an absent optional tensor the kernel never reads (its constexpr is off). The fast handle takes
    the None itself, a null pointer, so Triton's launcher reads no address for it; the public launch
    needs the tensor, since Triton would specialize a None into another kernel."""
    return tuple(tensor if a is None else a for a in args)


def launch(slot: Slot, fn, grid, args: tuple, consts: dict, *, absent=None, **options) -> None:
    """``fn[grid](*args, **consts, **options)``, through ``slot``'s handle when it has one. With
    ``absent`` (a tensor), None arguments are absent optional tensors: null pointers to the handle,
    ``absent`` to the public launch (:func:`stand_in`)."""
    if not run(slot, fn, grid, args):
        launch_public(slot, fn, grid, args, consts, absent=absent, **options)


def launch_public(slot: Slot, fn, grid, args: tuple, consts: dict, *, absent=None, **options) -> None:
    """:func:`launch` without trying ``slot``'s handle (for a caller whose :func:`run` just returned
    False): the public launch, which binds ``slot`` for the next call."""
    public = args if absent is None else stand_in(args, absent)
    bind(slot, fn, fn[grid](*public, **consts, **options), consts)


@contextlib.contextmanager
def assume_api(get_device, get_stream, knobs):
    """Inside: launch handles are made and called as under a known Triton, with these device and
    stream getters and this ``knobs.runtime`` stand-in (``launch_enter_hook``, ``launch_exit_hook``,
    ``debug``). For kernels that are stand-ins themselves: the overhead bench's CPU mode and the
    tests of this module, which run no GPU."""
    global _api, _driver, _knobs, _enabled, _off_reason, _refused, _direct_refused, _direct_handles
    saved = (_api, _driver, _knobs, _enabled, _off_reason, _refused, _direct_refused, _direct_handles)
    _api, _driver, _knobs, _enabled, _off_reason, _refused = None, (get_device, get_stream), knobs, True, "", ""
    _direct_refused, _direct_handles = "", 0
    _find_allocator()
    try:
        yield
    finally:
        _api, _driver, _knobs, _enabled, _off_reason, _refused, _direct_refused, _direct_handles = saved
