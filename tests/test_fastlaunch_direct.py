"""Direct launches (:mod:`pagedflash.ops.fastlaunch`'s module doc): a fast handle calls Triton
3.6's C launch function itself, with the global scratch the launcher's allocator would have given.

On a CPU ``_Launcher`` stands in for 3.6's ``CudaLauncher``: its ``__call__`` is 3.6's body and
its ``launch`` (the C function) records what it is given, so a direct launch and a launcher call
are compared argument by argument; a module constant stands in for 3.6's driver module's format.
With ``gpu_scratch`` the scratch follows pagedflash.ops.scratch's CUDA rules for device cuda:0.
The compiled path runs in the GPU tests at the end.
"""

import contextvars
import importlib.util
import types

import pytest
import torch
import triton
from helpers import ON_GPU, assert_close
from test_fastlaunch import CASES, _Device, _Jit, _kernel_stub, _Knobs, _known_triton, gpu
from triton.runtime import _allocation

from pagedflash import flash_attn_func, flash_attn_with_kvcache
from pagedflash.ops import attention, attention_launch, combine, fastlaunch, scratch
from pagedflash.testing import capture_graph

_BASE_ARGS_FORMAT = "iiiKKppOOOOOO"  # 3.6's driver module: the C function's leading arguments


class _Launcher:
    """triton 3.6's ``CudaLauncher``: ``__call__`` is 3.6's body (the kernel's global and profile
    scratch from Triton's allocators, then the C function ``launch``); ``launch`` records what it
    was given and, with a ``_Jit``, runs its interpreted kernel on the kernel arguments."""

    def __init__(self, jit=None, *, scratch=0, align=128, num_ctas=1, profile=0):
        self.jit = jit
        self.num_ctas = num_ctas
        self.global_scratch_size, self.global_scratch_align = scratch, align
        self.profile_scratch_size, self.profile_scratch_align = profile, 1
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.launch = self._launch  # an attribute, as 3.6's compiled C function is
        self.called = 0  # __call__s
        self.calls = []  # the C function's arguments, one tuple per launch

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.called += 1

        def allocate_scratch(size, align, allocator):
            if size > 0:
                return allocator.get()(gridX * gridY * gridZ * self.num_ctas * size, align, stream)
            return None

        global_scratch = allocate_scratch(self.global_scratch_size, self.global_scratch_align, _allocation._allocator)
        profile_scratch = allocate_scratch(self.profile_scratch_size, self.profile_scratch_align,
                                           _allocation._profile_allocator)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)

    def _launch(self, *c_args):
        self.calls.append(c_args)
        if self.jit is None:
            return
        if self.jit.raises is not None:
            raise self.jit.raises
        (g0, g1, g2, _, _, _, _, _, profile, _, launch_meta, enter, leave), full = c_args[:13], c_args[13:]
        assert profile is launch_meta is enter is leave is None
        n = self.jit.num_runtime
        self.jit.fn[(g0, g1, g2)](*full[:n], **dict(zip(self.jit.const_names, full[n:])))


def _compiled36(launcher):
    return types.SimpleNamespace(run=launcher, function=1234, packed_metadata=(4, 1, 0))


@pytest.fixture
def gpu_scratch(monkeypatch):
    """pagedflash.ops.scratch's CUDA rules for device cuda:0 (the stand-in device), keyed by stream
    77, never captured unless a test says so; without a GPU the buffers are made on the CPU and the
    TMA allocator answers as on a GPU. The TMA allocator is Triton's current allocator."""
    state = types.SimpleNamespace(capturing=False)
    monkeypatch.setattr(scratch, "_stream", lambda index: 77)
    monkeypatch.setattr(scratch, "_capturing", lambda: state.capturing)
    if not ON_GPU:
        monkeypatch.setattr(scratch, "_fresh", lambda specs, device: tuple(torch.empty(s, dtype=d) for s, d in specs))
        monkeypatch.setattr(attention_launch, "interpreted", lambda: False)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fastlaunch, "DIRECT", True)
    scratch.clear()
    token = _allocation._allocator.set(attention_launch._tma_scratch)
    try:
        yield state
    finally:
        _allocation._allocator.reset(token)
        scratch.clear()


def _bound(launcher, grid=(3, 2, 1)):
    """A slot bound by a public launch of a stub kernel whose compiled launcher is ``launcher``,
    and the runtime arguments that launch took."""
    p = types.SimpleNamespace
    kernel = _kernel_stub([p(name="a", is_constexpr=False), p(name="n", is_constexpr=False),
                           p(name="X", is_constexpr=True)], _compiled36(launcher))
    slot, args = fastlaunch.Slot(), (torch.zeros(4), 5)
    fastlaunch.launch(slot, kernel, grid, args, {"X": 7})
    return slot, kernel, args


@pytest.mark.parametrize("scratch_bytes,num_ctas", [(0, 1), (96, 1), (96, 2)], ids=["no_scratch", "scratch",
                                                                                   "scratch_2ctas"])
def test_direct_launch_gives_the_c_function_the_launchers_arguments(gpu_scratch, monkeypatch, scratch_bytes,
                                                                   num_ctas):
    """The C function gets what 3.6's launcher would give it: the same grid, stream, function,
    flags, metadata and arguments, and as global scratch the very buffer the TMA allocator returns
    for the call (grid × num_ctas × global_scratch_size int8 bytes)."""
    launcher, grid = _Launcher(scratch=scratch_bytes, num_ctas=num_ctas), (3, 2, 1)
    with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
        slot, kernel, args = _bound(launcher, grid)
        assert slot.handle.direct == launcher.launch and fastlaunch.direct_status() == "on"
        assert fastlaunch.run(slot, kernel, grid, args)
        monkeypatch.setattr(fastlaunch, "DIRECT", False)
        assert fastlaunch.run(slot, kernel, grid, args)
    assert launcher.called == 1, "the direct launch called the launcher, or the switch did not stop it"
    direct, public = launcher.calls
    assert direct[:7] == public[:7] == (3, 2, 1, 77, 1234, False, True)
    assert direct[8:] == public[8:] == (None, (4, 1, 0), None, None, None, args[0], 5, 7)
    if scratch_bytes:
        buffer = direct[7]
        assert buffer is public[7], "not the allocator's (reused) buffer"
        assert buffer.dtype == torch.int8 and buffer.shape == (3 * 2 * 1 * num_ctas * scratch_bytes,)
        assert buffer.data_ptr() % 64 == 0  # the CPU's allocations; a GPU's start at multiples of 512
    else:
        assert direct[7] is public[7] is None


def test_direct_launch_keeps_a_users_allocator(gpu_scratch):
    """Under an allocator the user installed, a kernel with global scratch goes through the
    launcher, which asks that allocator; a kernel without scratch still launches directly."""
    asked = []

    def users(size, alignment, stream):
        asked.append((size, alignment, stream))
        return torch.zeros(size, dtype=torch.int8)

    token = _allocation._allocator.set(users)
    try:
        with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
            with_scratch, plain = _Launcher(scratch=32, align=64), _Launcher()
            bound = [_bound(with_scratch), _bound(plain)]
            for slot, kernel, args in bound:
                assert fastlaunch.run(slot, kernel, (3, 2, 1), args)
    finally:
        _allocation._allocator.reset(token)
    assert asked == [(3 * 2 * 32, 64, 77)] and with_scratch.called == 1 and plain.called == 0
    assert with_scratch.calls[0][7].shape == (3 * 2 * 32,)


def test_direct_scratch_is_fresh_under_graph_capture_and_no_reuse(gpu_scratch):
    """Eager direct launches on one stream reuse one buffer; while a CUDA graph is captured, and
    inside scratch.no_reuse(), each launch gets a fresh one."""
    launcher = _Launcher(scratch=16)
    with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
        slot, kernel, args = _bound(launcher)

        def buffer():
            assert fastlaunch.run(slot, kernel, (3, 2, 1), args)
            return launcher.calls[-1][7]
        kept = buffer()
        assert buffer() is kept
        gpu_scratch.capturing = True
        captured = [buffer(), buffer()]
        gpu_scratch.capturing = False
        with scratch.no_reuse():
            unshared = [buffer(), buffer()]
        assert buffer() is kept
    fresh = captured + unshared
    assert len({id(b) for b in fresh + [kept]}) == 5 and all(b.shape == kept.shape for b in fresh)
    assert launcher.called == 0


def test_status_says_when_only_some_kernels_launch_directly(gpu_scratch):
    """One kernel refused (profile scratch) beside one that launches directly: the status says both,
    not 'refused' for the whole fast path."""
    with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
        assert _bound(_Launcher(scratch=16))[0].handle.direct is not None
        assert fastlaunch.direct_status() == "on"
        assert _bound(_Launcher(profile=8))[0].handle.direct is None
        status = fastlaunch.direct_status()
        assert status.startswith("on, but not for every kernel (the last refused: ") and "profile" in status, status


@pytest.mark.parametrize("shape", ["format", "call", "profile_scratch", "alignment_512", "alignment_48",
                                   "missing_attribute"])
def test_launchers_of_another_shape_are_called_as_before(gpu_scratch, monkeypatch, shape):
    """A launcher not known to have 3.6's convention, or a kernel whose scratch a direct launch
    cannot give as the launcher would, keeps the launcher call; status says why."""
    launcher = _Launcher(scratch=16)
    monkeypatch.setattr(fastlaunch, "_LAUNCHER_TYPES", {})
    if shape == "format":
        monkeypatch.setitem(globals(), "_BASE_ARGS_FORMAT", "iiiKKOOOOOO")  # this module stands for 3.6's driver
    elif shape == "call":  # 3.9's: the kernel metadata and hooks named
        class Later(_Launcher):
            def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                         launch_enter_hook, launch_exit_hook, *args):
                super().__call__(gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                                 launch_enter_hook, launch_exit_hook, *args)
        launcher = Later(scratch=16)
    elif shape == "profile_scratch":  # proton's instrumentation: its allocator is asked per launch
        launcher = _Launcher(profile=8)
        _allocation._profile_allocator.set(lambda size, alignment, stream: torch.zeros(size, dtype=torch.int8))
    elif shape.startswith("alignment"):
        launcher = _Launcher(scratch=16, align=int(shape.split("_")[1]))
    else:
        del launcher.launch_pdl
    try:
        with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
            slot, kernel, args = _bound(launcher)
            assert slot.handle.direct is None
            assert fastlaunch.direct_status().startswith("refused: "), fastlaunch.direct_status()
            if shape != "missing_attribute":
                assert fastlaunch.run(slot, kernel, (3, 2, 1), args)
                assert launcher.called == 1 and len(launcher.calls) == 1
    finally:
        _allocation._profile_allocator.set(None)


def test_a_failing_direct_launch_falls_back_for_good(gpu_scratch):
    """An exception from the C function (here before it queued anything, as 3.6's does) turns the
    fast path off with a warning; the caller repeats the launch publicly."""
    launcher = _Launcher(scratch=16)
    with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
        slot, kernel, args = _bound(launcher)

        def refuse(*c_args):
            raise TypeError("function takes exactly 14 arguments")
        launcher.launch = slot.handle.direct = refuse
        with pytest.warns(UserWarning, match="fast launch failed .*exactly 14 arguments"):
            assert not fastlaunch.run(slot, kernel, (3, 2, 1), args)
        assert not fastlaunch.enabled() and not fastlaunch.run(slot, kernel, (3, 2, 1), args)
    assert launcher.called == 0


@pytest.mark.parametrize("case", ["decode_fp16_4_splits", "prefill_causal"])
def test_direct_launches_match_the_public_path(gpu_scratch, monkeypatch, case):
    """Attention and combine launched by 3.6-shaped launchers: the public results, bit for bit,
    from direct launches alone, the attention kernel taking its global scratch as a TMA one does."""
    jits = {"attention": _Jit(attention._attention_kernel), "combine": _Jit(combine._combine_kernel)}
    launchers = {}
    for name, jit in jits.items():
        launchers[name] = _Launcher(jit, scratch=64 if name == "attention" else 0)
        jit.compiled = _compiled36(launchers[name])
    monkeypatch.setattr(attention, "_attention_kernel", jits["attention"])
    monkeypatch.setattr(combine, "_combine_kernel", jits["combine"])
    attention.clear_plans()
    run, want = CASES[case]()
    try:
        with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
            previous = fastlaunch.set_enabled(False)
            try:
                public = run()
            finally:
                fastlaunch.set_enabled(previous)
            run()  # binds
            fast = run()
            grid = next(iter(attention._PLANS.values())).grid
    finally:
        attention.clear_plans()
    attention_calls = launchers["attention"].calls
    assert len(attention_calls) == 1 and launchers["attention"].called == 0
    assert attention_calls[0][:3] == grid and attention_calls[0][7].shape == (grid[0] * grid[1] * grid[2] * 64,)
    if case.startswith("decode"):
        assert len(launchers["combine"].calls) == 1 and launchers["combine"].calls[0][7] is None
    for a, b in zip(public, fast):
        assert torch.equal(a, b)
    assert_close(fast[0], want()[0], fast[0].dtype)


@pytest.mark.parametrize("value, on", [(None, True), ("0", False), ("1", True)])
def test_environment_switch(monkeypatch, value, on):
    """On by default, PAGEDFLASH_DIRECT_LAUNCH=0 turns it off, read when the module loads (a fresh
    copy of it, so that the module every other test uses keeps its state)."""
    if value is None:
        monkeypatch.delenv("PAGEDFLASH_DIRECT_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("PAGEDFLASH_DIRECT_LAUNCH", value)
    spec = importlib.util.spec_from_file_location("fastlaunch_copy", fastlaunch.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.DIRECT is on and copy.direct_status().startswith("off: ") is not on


# ---------------------------------------------------------------- compiled (GPU)


def _tma_decode():
    """A decode that the launch table gives device-side TMA descriptors on Hopper: a wide grid (32
    rows x 8 KV heads) of 1,024 keys over 64-row pages (``launch.choose_config``; a contiguous or
    split-grid decode takes pointer tiles), split in two for the combine."""
    b, pages = 32, 16
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b * pages, 64, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    lens = torch.full((b,), pages * 64, dtype=torch.int32, device="cuda")
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, num_splits=2)


def _tma_plans() -> list:
    plans = [plan for plan in attention._PLANS.values() if plan.tma_on]
    if torch.cuda.get_device_capability()[0] == 9:
        assert plans, "no TMA launch plan on Hopper"
    return plans


@gpu
def test_gpu_direct_launch_matches_the_launcher():
    """A TMA decode and a TMA prefill: direct launches (the C function with the reused global
    scratch) give the launcher's results bit for bit, and take the place of every launcher call."""
    attention.clear_plans()
    torch.manual_seed(0)
    pq, pk, pv = (torch.randn(1, 128, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8))
    calls = {"decode": _tma_decode(), "prefill": lambda: flash_attn_func(pq, pk, pv, causal=True, return_lse=True)}
    results, launcher_calls = {}, []
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        for direct in (False, True):
            mp.setattr(fastlaunch, "DIRECT", direct)
            results[direct] = {name: [call() for _ in range(3)] for name, call in calls.items()}
            if not direct and _known_triton():  # from now on every launcher call is counted
                for plan in _tma_plans():
                    handle = plan.slot.handle
                    mp.setattr(handle, "launcher", lambda *a, real=handle.launcher: launcher_calls.append(1) or real(*a))
    torch.cuda.synchronize()
    for name in calls:
        for public, fast in zip(results[False][name], results[True][name]):
            public, fast = (public, fast) if isinstance(public, tuple) else ((public,), (fast,))
            for a, b in zip(public, fast):
                assert torch.equal(a, b), name
    if _known_triton():
        for plan in _tma_plans():
            handle = plan.slot.handle
            assert handle.direct is not None and handle.scratch_bytes > 0, fastlaunch.direct_status()
        assert not launcher_calls, "a TMA launch went through Triton's launcher with direct launches on"


@gpu
def test_gpu_direct_launch_under_graph_capture_and_a_users_allocator():
    """Direct TMA launches: a CUDA graph captured among eager calls (fresh scratch in the capture,
    the reused one outside) replays right, and a user's own allocator serves the launch."""
    attention.clear_plans()
    torch.manual_seed(0)
    decode = _tma_decode()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastlaunch, "DIRECT", True)
        want = decode().clone()
        decode()
        graph, captured = capture_graph(decode)
        for _ in range(3):
            graph.replay()
            eager = decode()
            torch.cuda.synchronize()
            assert torch.equal(captured, want) and torch.equal(eager, want)
        asked = []

        def users(size, alignment, stream):
            asked.append(size)
            return torch.empty(size, dtype=torch.int8, device="cuda")

        def with_users():
            triton.set_allocator(users)
            return decode()
        out = contextvars.copy_context().run(with_users)
        torch.cuda.synchronize()
    assert torch.equal(out, want)
    if _tma_plans() and _known_triton():
        assert asked, "the user's allocator was not asked"
