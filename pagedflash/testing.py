"""What the tests, the benchmarks and ``pagedflash demo`` share to check a kernel: one tolerance rule
against the fp32 reference (:mod:`pagedflash.reference`), and random paged caches.

The rule, for an output in ``dtype`` against its fp32 reference ``ref``, element by element::

    |out - ref| <= atol * max|ref| + rtol * |ref|        (atol, rtol) = TOLERANCES[dtype]

``max|ref|`` is taken over the finite entries; equal infinities (an LSE of -inf for a row that sees
no key) match, NaN never does. ``atol`` is relative to the reference's scale because the error of a
softmax-weighted sum is proportional to the size of its terms, not of its result: a decode output
over 128K random keys is of order 1e-3, where an absolute ``atol`` would pass an all-zero output,
and a projection's outputs near zero carry the rounding of terms of order one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedflash.cache.kv_cache import PAD_BLOCK_ID
from pagedflash.ops.utils import collector_paused

__all__ = [
    "TOLERANCES",
    "Mismatch",
    "assert_close",
    "check_close",
    "compare",
    "compile_new",
    "cubin_resources",
    "random_block_table",
    "recorded_launches",
    "row_exact_interpreter_dot",
    "random_paged_kv",
    "to_paged",
]

# (atol, rtol) of the rule above, per output dtype; randn inputs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (6e-3, 6e-3),
    torch.bfloat16: (4e-2, 4e-2),
}
_MIN_SCALE = 1e-6  # an all-zero reference still gets a (tiny) allowance, and err stays finite


@dataclass
class Mismatch:
    """The rule applied to one pair: ``err`` = max |out - ref| / max|ref| (the figure the benchmarks
    report), ``bad`` the elements outside the allowance, ``diff`` |out - ref| (inf where NaN)."""

    err: float
    bad: torch.Tensor
    diff: torch.Tensor
    scale: float

    @property
    def ok(self) -> bool:
        return not bool(self.bad.any())


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Mismatch:
    """Apply the rule (module docstring) to ``out`` against ``ref`` with the tolerance of ``dtype``."""
    atol, rtol = TOLERANCES[dtype]
    o, r = out.float(), ref.float().to(out.device)
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} != reference shape {tuple(r.shape)}")
    if not o.numel():
        return Mismatch(0.0, torch.zeros_like(o, dtype=torch.bool), torch.zeros_like(o), _MIN_SCALE)
    diff = torch.where(o == r, torch.zeros_like(o), (o - r).abs())  # equal infinities match
    diff = torch.where(o.isnan() | r.isnan(), torch.full_like(o, float("inf")), diff)
    finite = r.isfinite()
    scale = max(float(r.abs().where(finite, 0.0).max()), _MIN_SCALE)
    bad = diff > atol * scale + rtol * r.abs().where(finite, 0.0)
    return Mismatch(float(diff.max()) / scale, bad, diff, scale)


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    """``(err, ok)`` of :func:`compare`: what a benchmark records for a checked case."""
    m = compare(out, ref, dtype)
    return m.err, m.ok


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "out") -> None:
    """:func:`compare`, raising ``AssertionError`` that shows the first elements outside the rule."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    m = compare(actual, expected, dtype)
    if m.ok:
        return
    atol, rtol = TOLERANCES[dtype]
    a, e = actual.float(), expected.float()
    idx = m.bad.nonzero()[:5].tolist()
    rows = "; ".join(f"{tuple(i)}: got {a[tuple(i)].item():.6g}, want {e[tuple(i)].item():.6g}" for i in idx)
    raise AssertionError(
        f"{name}: {int(m.bad.sum())}/{m.bad.numel()} elements off (max diff {m.diff.max().item():.3g}, "
        f"max|ref| {m.scale:.3g}, atol {atol} x max|ref|, rtol {rtol}); first: {rows}")


# ---------------------------------------------------------------- random paged caches


def random_block_table(pages: Sequence[int], num_blocks: int, *, device: torch.device | str,
                       share_first: int = 0) -> torch.Tensor:
    """Block tables ``int32 [B, max(pages)]`` (at least one column) drawn from one random permutation
    of a pool of ``num_blocks`` pages: row ``b`` takes the next ``pages[b]`` ids of the permutation (rows
    disjoint), then :data:`~pagedflash.cache.PAD_BLOCK_ID`. ``share_first`` > 0: every row's first
    ``share_first`` pages alias row 0's, as prefix caching produces."""
    pages = list(pages)
    if sum(pages) > num_blocks:
        raise ValueError(f"num_blocks must hold the {sum(pages)} pages the rows need, got {num_blocks}")
    perm = torch.randperm(num_blocks, device=device)
    table = torch.full((len(pages), max(max(pages, default=0), 1)), PAD_BLOCK_ID, dtype=torch.int32,
                       device=device)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used:used + p]
        used += p
    if share_first:
        table[1:, :share_first] = table[0, :share_first]
    return table


def to_paged(cache: torch.Tensor, page_size: int, block_table: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[B, N, Hkv, D]`` -> pool ``[B * N / page_size, page_size, Hkv, D]`` holding page ``j``
    of sequence ``b`` in block ``block_table[b, j]``; the table must be a permutation of the whole pool
    (``random_block_table([N // page_size] * B, B * N // page_size)``). Same values, so a check against
    the contiguous cache's reference applies to the pool."""
    b, n = cache.shape[:2]
    if n % page_size or block_table.numel() != b * n // page_size:
        raise ValueError(f"block_table must cover the {b} x {n} keys in pages of {page_size}, got shape "
                         f"{tuple(block_table.shape)}")
    chunks = cache.reshape(-1, page_size, *cache.shape[2:])
    pool = torch.empty_like(chunks)
    if cache.element_size() == 1:  # fp8: scatter the bytes (torch's index kernels need not cover float8)
        pool.view(torch.uint8)[block_table.flatten().long()] = chunks.view(torch.uint8)
    else:
        pool[block_table.flatten().long()] = chunks
    return pool


def random_paged_kv(seqlens: Sequence[int], page_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, *, device: torch.device | str, spare: int = 3,
                    share_first: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache, block_table)``: pools ``[num_blocks, page_size, Hkv, D]`` ``spare`` times
    larger than the sequences need, NaN everywhere but the slots of each sequence's first
    ``seqlens[b]`` tokens (normal random values, drawn in fp32), block tables from
    :func:`random_block_table` (``share_first``: aliased first pages). A kernel that reads a slot past
    a length, or a page outside its table, shows it as NaN."""
    pages = [-(-n // page_size) for n in seqlens]
    num_blocks = max(1, sum(pages) * spare)
    k_cache = torch.full((num_blocks, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = random_block_table(pages, num_blocks, device=device, share_first=share_first)
    for b, n in enumerate(seqlens):  # fill only the slots in use
        pos = torch.arange(n, device=device)
        blk, off = table[b, pos // page_size].long(), pos % page_size
        for cache in (k_cache, v_cache):
            cache[blk, off] = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
    return k_cache, v_cache, table


def capture_graph(fn):
    """``fn()`` once on a side stream (kernels compile outside the capture), then captured in a CUDA
    graph: ``(graph, what the captured call returned)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        result = fn()
    return graph, result


MMA_K_STEP = 16  # K depth of one 16-bit MMA instruction (sm80 mma.sync, sm90 wgmma)


@contextlib.contextmanager
def row_exact_interpreter_dot():
    """Inside the block the Triton interpreter's ``tl.dot`` computes each output element as a GPU's
    MMA instructions chain it: K in steps of :data:`MMA_K_STEP`, each step's products summed in K
    order and added to the accumulator, the steps in increasing K (in the accumulator's dtype). An
    element's bits then depend on its row, its column, the accumulator and K's order only, not on the
    tile's rows, columns or ``BLOCK_K`` (a multiple of the step): on an H100 every GEMM tile of
    16-256 columns and 64-256-deep steps gave the same bits (docs/performance.md v41). The
    interpreter's own ``numpy.matmul`` goes through the host BLAS, whose micro-kernels round an
    element differently by its row's place in a block: the batch-invariance tests would then measure
    the host BLAS, not the kernels' order of work. No effect on a GPU."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def operand(x):  # fp8 as the interpreter's own dot reads it: converted to fp16
        if x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating():
            return interpreter._convert_float(x.data, x.dtype, interpreter.tl.float16, None).view(np.float16)
        return x.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        a_k, b_k, out = operand(a).astype(acc), operand(b).astype(acc), d.data
        for k in range(0, a_k.shape[-1], MMA_K_STEP):
            step = a_k[..., :, k:k + MMA_K_STEP, None] * b_k[..., None, k:k + MMA_K_STEP, :]  # [.., M, step, N]
            out = np.add.reduce(step, axis=-2) + out
        return interpreter.TensorHandle(out, d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


ROW_EXACT_DOT_ENV = "PAGEDFLASH_ROW_EXACT_DOT"


def row_exact_dot_from_env():
    """:func:`row_exact_interpreter_dot` where the environment sets :data:`ROW_EXACT_DOT_ENV` to 1,
    else nothing: a test sets it before an engine spawns its tensor-parallel workers, processes its
    own patch does not reach (each worker runs its life inside this)."""
    if os.environ.get(ROW_EXACT_DOT_ENV) == "1":
        return row_exact_interpreter_dot()
    return contextlib.nullcontext()


def skip_repeated_interpreter_patching() -> bool:
    """Make Triton's interpreter stop re-patching ``triton.language`` on every call of a
    ``@triton.jit`` helper from inside a kernel: it scans the language modules with
    ``inspect.getmembers`` on each such call (~1.6 ms on the development CPU; a quarter of an
    interpreted engine test's time), though the launch that runs the kernel patched them already. A
    helper whose language modules (``tl``, ``tl.core`` among its globals) are all patched now runs
    straight away; any other call, as before. Results do not change (the same functions run); the
    test session installs it. Returns whether it installed (not where the interpreter's call differs
    from Triton 3.9's, or where it is installed already)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    cls = getattr(interpreter, "InterpretedFunction", None)
    original = vars(cls).get("__call__") if cls is not None else None
    lang = getattr(interpreter, "tl", None)
    if original is None or lang is None or getattr(original, "_pagedflash", False) or \
            not hasattr(interpreter, "InterpreterError") or not hasattr(cls, "rewrite") or \
            "_patch_lang" not in getattr(getattr(original, "__code__", None), "co_names", ()):  # the call this replaces
        return False
    langs_of: dict = {}  # by the helper's Python function (held: no id reuse)

    def patched(module) -> bool:  # a launch's patching replaced its builtins (program_id one of them)
        return not lang.core.is_builtin(getattr(module, "program_id", None))

    def call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = [v for v in self.fn.__globals__.values() if v is lang or v is lang.core]
        if not langs or not all(map(patched, langs)):
            return original(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    call._pagedflash = True
    cls.__call__ = call
    return True


def skip_interpreter_overflow_checks() -> bool:
    """Stop Triton's interpreter from computing an overflow check for every integer add, subtract and
    multiply narrower than 64 bits (its ``sanitize_overflow`` option): each check redoes the operation in
    int64 and compares it with the type's bounds, and then ``device_assert`` drops it, because the
    interpreter's options never turn ``debug`` on (Triton 3.9). That is ~29 % of an interpreted engine
    test's time spent on checks never asserted. Results do not change; the test session installs it.
    Returns whether it switched them off (not where the options differ from that, or already off)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True) or \
            not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


@contextlib.contextmanager
def recorded_launches():
    """Inside the block every launch written ``kernel[grid](*args, **keywords)`` is recorded instead
    of run, as ``(launch, args)`` in the list yielded: ``launch.kernel``, ``.grid`` and ``.kwargs``
    (constexprs and options such as ``num_warps``), ``args`` the positional arguments. That is every
    pagedflash launch whose fast-launch handle is not bound yet (:mod:`pagedflash.ops.fastlaunch`),
    so a fresh process's first calls of the public ops: their plans and arguments, for
    :func:`compile_new`, on any machine. Kernels defined for the compiler only (``TRITON_INTERPRET=0``
    before pagedflash is imported); launches of every thread are recorded while the block runs."""
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    from pagedflash.ops.utils import interpreted

    if interpreted():
        raise RuntimeError("recorded_launches: the kernels run under the Triton interpreter here, which it "
                           "cannot record; set TRITON_INTERPRET=0 before pagedflash is imported")
    calls = []

    def getitem(kernel, grid):
        return lambda *args, **kwargs: calls.append((SimpleNamespace(kernel=kernel, grid=grid, kwargs=kwargs), args))

    own = "__getitem__" in JITFunction.__dict__
    saved = JITFunction.__dict__.get("__getitem__")
    JITFunction.__getitem__ = getitem
    try:
        yield calls
    finally:
        if own:
            JITFunction.__getitem__ = saved
        else:
            del JITFunction.__getitem__


def _specialized(launch, args, capability: int):
    """``(key, source, target, options)``: what Triton's launcher would compile for ``launch(*args)``
    on an NVIDIA GPU of ``sm_<capability>``, worked out by Triton's own binder (its specialization
    rules: alignment and divisibility hints, ints equal to 1 folded, ``do_not_specialize``
    honoured), ready for ``triton.compile``; ``key`` identifies that compilation."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    key = (kernel.cache_key, str(specialization), str(sorted(options.__dict__.items())))
    return key, triton.compiler.ASTSource(kernel, signature, constexprs, attrs), target, options.__dict__


def compile_new(launches, seen: set, capability: int = 90):
    """Compile, by Triton's whole pipeline for NVIDIA ``sm_<capability>`` (the wheel's ptxas: no GPU
    needed; not under the interpreter), each ``(launch, args)`` of ``launches``
    (:func:`recorded_launches`) as Triton's launcher would specialize it, unless that specialization
    is in ``seen`` already (its key is added). Yields ``(launch, compiled, error, seconds)``: the
    compiled kernel (``.metadata``: ``shared``, ``num_warps``; ``.asm``: ``ttgir``, ``ptx``,
    ``cubin``), or None and the exception raised."""
    import time

    import triton

    for launch, args in launches:
        t0 = time.monotonic()
        try:
            key, source, target, options = _specialized(launch, args, capability)
            if key in seen:
                continue
            seen.add(key)
            compiled, error = triton.compile(source, target=target, options=options), None
        except Exception as e:  # noqa: BLE001 - the caller reports every kernel
            compiled, error = None, e
        yield launch, compiled, error, time.monotonic() - t0


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """What ``cuobjdump --dump-resource-usage`` (the Triton wheel's) reports for a compiled kernel's
    cubin: ``REG`` registers a thread, ``STACK``, ``SHARED``, ``LOCAL`` (bytes a thread: spills),
    ``CONSTANT[i]``, ... as ints."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = (w.split(":") for w in out.split() if ":" in w)
    return {k: int(v) for k, v in fields if k.isupper() or k.startswith("CONSTANT") if v.isdigit()}
