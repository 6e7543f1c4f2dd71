"""Host-side helpers shared by every op launcher: integer arithmetic for grids and tiles, the head
stride of a per-head side input, the device's SM count and NVIDIA compute capability, whether kernels
run under the interpreter, the input checks of the engine's ops (on :mod:`pagedflash.validate`'s),
and the per-signature launch cache those ops share (:class:`PlanCache`, :class:`Launch`).

Whether to interpret is decided once, by :mod:`pagedflash._env`, before any kernel is defined.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
import triton

from pagedflash import _env, validate
from pagedflash.ops import fastlaunch


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` is a constexpr function: ~10 us per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` (same reason)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def head_stride(t: torch.Tensor | None) -> int:
    """Stride between heads of a per-head side input (attention sinks, K/V scales): 0 for one value
    shared by all heads (``[]``/``[1]``), or when there is none."""
    return t.stride(0) if t is not None and t.numel() > 1 else 0


@functools.cache
def interpreted() -> bool:
    """True when Triton kernels run under the CPU interpreter (how every kernel here was defined)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4 reads the switch through its knobs
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return _env.interpret_requested()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (AMD: compute units) of ``device``; a nominal 16 off the GPU."""
    if device.type != "cuda":
        return 16
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shared_memory(device: torch.device) -> int | None:
    """Bytes of shared memory one block may use on ``device`` (its opt-in maximum: 227 KB on sm90,
    ~99 KB on sm86/89/120); None off the GPU (the interpreter has no such limit)."""
    if device.type != "cuda":
        return None
    return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_block


@contextlib.contextmanager
def collector_paused():
    """Collect Python's garbage, then keep its collector off inside (its state before is restored
    after), around CUDA graph captures: a dead object's graph destroyed while a stream captures
    (``cudaGraphExecDestroy`` is refused then) invalidates the capture, and the CUDA generator stays
    in its capture state (every later random draw in the process raises)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def on_device(device: torch.device | int):
    """A context in which ``device`` (a torch device, or a GPU index) is the current GPU: Triton
    launches on the current device, as do CUDA graphs, events and pinned copies. A no-op where it
    already is, for the CPU or for ``cuda`` without an index. Decided at each call (never cached:
    the current device may differ between calls)."""
    index = device if isinstance(device, int) else device.index if device.type == "cuda" else None
    if index is not None and index != torch.cuda.current_device():
        return torch.cuda.device(index)
    return contextlib.nullcontext()


def descriptor_aligned(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor may cover ``t``: base address and outer strides 16-byte multiples."""
    align = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % align == 0 for s in t.stride()[:-1])


@functools.lru_cache(maxsize=16)
def nvidia_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of an NVIDIA CUDA device; None for anything else. ROCm builds of torch also
    call their GPUs ``cuda`` and report a gfx version as the capability (9.4 on an MI300), so the
    device type alone does not say NVIDIA: ``torch.version.hip`` does."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return tuple(torch.cuda.get_device_capability(device))


def fp8_cvt_device(device: torch.device) -> bool:
    """Whether kernels on ``device`` may convert fp8 to fp16 by the conversion instruction in inline
    asm (:func:`pagedflash.ops._jit.fp8_to_f16`): an NVIDIA GPU of compute capability 8.9 or newer,
    outside the interpreter."""
    capability = nvidia_capability(device)
    return capability is not None and capability >= (8, 9) and not interpreted()


def check_operand(name: str, t, shape: tuple[int | None, ...], *, like: tuple[str, torch.Tensor] | None = None,
                  dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32),
                  contiguous: bool = False) -> None:
    """Input check of the engine's ops: ``t`` is a tensor of ``shape`` (None: any size) whose last
    dimension is contiguous (the whole tensor with ``contiguous``); its dtype and device are those of
    ``like = (name, tensor)``, or without ``like`` its dtype is one of ``dtypes``."""
    validate.check_tensor(name, t, ndim=len(shape))
    if any(want is not None and got != want for got, want in zip(t.shape, shape)):
        expected = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(t.shape)}")
    if like is not None:
        ref_name, ref = like
        if t.dtype != ref.dtype:
            raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name}: expected a tensor on {ref.device} (where {ref_name} is), got one on {t.device}")
    elif t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_gate_up_width(name: str, t: torch.Tensor) -> int:
    """``t [..., 2n]``: gate then up, n >= 1; returns n."""
    width = t.shape[-1]
    if width < 2 or width % 2:
        raise ValueError(f"{name}: expected an even, nonzero number of columns (gate then up), "
                         f"got shape {tuple(t.shape)}")
    return width // 2


def check_eps(eps) -> float:
    """A normalization epsilon: a finite number >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    return float(eps)


class Launch:
    """One kernel launch worked out for a call signature: grid (one to three ints; None: nothing to
    launch), constexprs and options. Calls relaunch it through :mod:`pagedflash.ops.fastlaunch`
    from the second call on; the arguments are the kernel's runtime parameters, in order."""

    __slots__ = ("kernel", "grid", "consts", "options", "slot")

    def __init__(self, kernel, grid: tuple[int, ...] | None, consts: dict, **options) -> None:
        self.grid = None if grid is None else tuple(grid) + (1,) * (3 - len(grid))  # the launcher takes 3
        self.kernel, self.consts, self.options = kernel, consts, options
        self.slot = fastlaunch.Slot()

    def __call__(self, *args) -> None:
        if self.grid is not None:
            fastlaunch.launch(self.slot, self.kernel, self.grid, args, self.consts, **self.options)


def new_output(q: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of q's shape, dtype and device (uninitialized): ``torch.empty_like``
    in eager mode, at about half of ``torch.empty(q.shape, dtype=..., device=...)``'s host time
    (it parses no size, dtype or device); ``torch.empty`` while ``torch.compile`` traces, where
    Inductor refuses ``empty_like``'s result as the mutated ``out`` of the KV-cache operator."""
    if torch.compiler.is_compiling():
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


_SCALAR_TYPES = frozenset((type(None), bool, int, float))


def checked_signature(tensors: tuple, scalars: tuple) -> tuple | None:
    """The key under which a public function may keep the outcome of its input checks for these
    arguments: every property of ``tensors`` its checks read (type, shape, strides, dtype, device,
    whether autograd tracks it; None entries allowed), each pointer's 16-byte alignment (so that the
    key also covers what a launch plan reads of these tensors:
    :func:`pagedflash.ops.attention_plan.public_plan_key`), and ``scalars`` with their types (None,
    bool, int, float, or tuples of them, so that ``True``, ``1`` and ``1.0`` differ). None, and the
    checks run, when a scalar is of another type (a tensor's value may change), an argument that
    should be a tensor is not one, value checks are on (they read values) or ``torch.compile`` traces."""
    if torch.compiler.is_compiling() or validate.value_checks_enabled():
        return None
    key = []
    for e in scalars:
        kind = type(e)
        if kind is tuple:
            kinds = tuple(map(type, e))
            if not _SCALAR_TYPES.issuperset(kinds):
                return None
            key.append((kind, e, kinds))
        elif kind in _SCALAR_TYPES:
            key.append((kind, e))
        else:
            return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15, grad and t.requires_grad))
        else:
            return None
    return tuple(key)


class PlanCache(dict):
    """An op's launch plans by call signature (:meth:`key`): the op's input checks and launch
    numbers are worked out on a signature's first call only, as the plans depend on nothing else.
    Bounded: past ``maxsize`` signatures it starts over (a serving loop repeats a few)."""

    def __init__(self, maxsize: int = 1024) -> None:
        super().__init__()
        self.maxsize = maxsize
        self._last = None  # (key, value) that find() returned last

    def find(self, key: tuple):
        """``self.get(key)`` for a key that is not None, compared first with the key found last,
        which is then not hashed (a loop repeats one signature: the hash of a key of tensor
        properties costs about as much as the comparison). For values that follow from the key
        alone (a check outcome): a clear() racing a find() in another thread may leave the cleared
        value remembered, which is then still the right value for that key."""
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        found = self.get(key)
        if found is not None:
            self._last = (key, found)
        return found

    def clear(self) -> None:
        super().clear()
        self._last = None

    # every other removal or replacement forgets the remembered entry too (find must never return a
    # value get would not)
    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._last = None

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._last = None

    def setdefault(self, key, default=None):
        self._last = None
        return super().setdefault(key, default)

    def __ior__(self, other):
        self._last = None
        return super().__ior__(other)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._last = None

    def pop(self, *args):
        self._last = None
        return super().pop(*args)

    def popitem(self):
        self._last = None
        return super().popitem()

    @staticmethod
    def key(*tensors, extra: tuple = ()) -> tuple | None:
        """What Triton specializes a launch over ``tensors`` (None entries allowed) on, and what the
        checks read: shape, strides, dtype, device, the pointer's 16-byte alignment, and whether
        autograd tracks the tensor; plus ``extra`` (the call's other launch-shaping values, each with
        its type, as ``True == 1 == 1.0`` would share a plan and skip a type check). None
        when an argument is not a tensor (its check then says so)."""
        grad = torch.is_grad_enabled()
        try:
            return tuple((type(e), e) for e in extra) + tuple(
                None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15, grad and t.requires_grad)
                for t in tensors)
        except (AttributeError, TypeError):
            return None

    def add(self, key: tuple | None, plan):
        """Keep ``plan`` under ``key`` (not when the key is None); returns the plan."""
        if key is not None:
            if len(self) >= self.maxsize:
                self.clear()
            self[key] = plan
        return plan
