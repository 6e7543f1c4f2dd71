"""The fast kernel launch (:mod:`pagedflash.ops.fastlaunch`) with its fallback to Triton's public
launch (attention's launch plans and reused split partials: tests/test_launch_plans.py; direct
launches through Triton's C launch function: tests/test_fastlaunch_direct.py).

Under the interpreter Triton's launch returns no compiled kernel, so the fast path cannot apply to
the real kernels on a CPU. Here it is driven through stand-ins shaped like triton 3.6's objects:
``_Jit`` wraps an interpreted kernel as a ``JITFunction`` whose launch returns a ``_Compiled``,
whose launcher runs that interpreted kernel with exactly the arguments the fast path hands it
(runtime arguments, then constexpr values, in parameter order). A wrong order or a stale
argument therefore shows as a wrong result, compared bit for bit with the public path and
against the fp32 reference. The compiled fast path itself runs in the GPU tests at the end.
"""

import importlib
import inspect
import types
import warnings

import pytest
import torch
import triton
from helpers import DEVICE, ON_GPU, assert_close, cu_seqlens, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash import reference as ref
from pagedflash.ops import (
    activation,
    attention,
    attention_launch,
    combine,
    fastlaunch,
    gemv,
    norm,
    rope,
    sampling,
)
from pagedflash.ops.utils import collector_paused

# ---------------------------------------------------------------- stand-ins for triton 3.6's objects


class _Knobs:
    launch_enter_hook = None
    launch_exit_hook = None
    debug = False


class _Compiled:
    """A CompiledKernel: ``run`` is its launcher, called as JITFunction.run calls it in 3.6."""

    function = 1234
    packed_metadata = (4, 1, 0)

    def __init__(self, jit):
        self.jit = jit
        self.calls = []  # (grid, stream, function, metadata, launch metadata, hooks)

    def run(self, g0, g1, g2, stream, function, metadata, launch_meta, enter, leave, *full):
        self.calls.append(((g0, g1, g2), stream, function, metadata, launch_meta, enter, leave))
        self.args = full
        if self.jit.raises is not None:
            raise self.jit.raises
        assert launch_meta is enter is leave is None  # hooks take the public launch
        n = self.jit.num_runtime
        consts = dict(zip(self.jit.const_names, full[n:]))
        self.jit.fn[(g0, g1, g2)](*full[:n], **consts)


class _Jit:
    """A JITFunction around an interpreted kernel (or any ``fn[grid](...)``): ``params`` and
    ``pre_run_hooks`` like 3.6's; its public launch runs the kernel and returns ``_Compiled``."""

    def __init__(self, fn, *, compiled=True):
        self.fn = fn
        sig = inspect.signature(fn.fn)
        self.params = [types.SimpleNamespace(name=name, is_constexpr="constexpr" in str(p.annotation))
                       for name, p in sig.parameters.items()]
        self.num_runtime = sum(not p.is_constexpr for p in self.params)
        self.const_names = [p.name for p in self.params if p.is_constexpr]
        self.pre_run_hooks = []
        self.public = 0
        self.raises = None
        self.compiled = _Compiled(self) if compiled else None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.public += 1
            self.public_args = args
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            self.fn[grid](*args, **kwargs)
            return self.compiled
        return launch


class _Device:
    index = 0

    def __call__(self):
        return self.index


@pytest.fixture
def fake_triton(monkeypatch):
    """attention's and combine's kernels wrapped in ``_Jit``, fastlaunch assuming 3.6's API; plans
    and reused buffers start empty and are dropped afterwards."""
    jits = types.SimpleNamespace(attention=_Jit(attention._attention_kernel), combine=_Jit(combine._combine_kernel),
                                 device=_Device(), knobs=_Knobs())
    monkeypatch.setattr(attention, "_attention_kernel", jits.attention)
    monkeypatch.setattr(combine, "_combine_kernel", jits.combine)
    attention.clear_plans()
    with fastlaunch.assume_api(jits.device, lambda index: 77, jits.knobs):
        yield jits
    attention.clear_plans()


# ---------------------------------------------------------------- the fast path gives the public path's results


def _decode(dtype=torch.float32, num_splits=0, return_lse=True, paged=False):
    b, hq, hkv, d = 3, 8, 2, 40
    seqlens = [70, 33, 0]
    q = randn(b, 1, hq, d, dtype=dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    if paged:
        k_cache, v_cache, table = make_pool(seqlens, 5, hkv, d, dtype)
    else:
        k_cache, v_cache, table = randn(b, 70, hkv, d, dtype=dtype), randn(b, 70, hkv, d, dtype=dtype), None

    def run():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                       num_splits=num_splits, return_lse=return_lse)

    def want():
        return ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)
    return run, want


def _prefill(dtype=torch.float32, causal=True, window=(-1, -1), softcap=0.0):
    q, k, v = randn(2, 37, 4, 24, dtype=dtype), randn(2, 50, 2, 24, dtype=dtype), randn(2, 50, 2, 24, dtype=dtype)

    def run():
        return flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)

    def want():
        return ref.attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap)
    return run, want


def _varlen(paged=False, num_splits=0):
    lq, lk = [5, 1, 17], [9, 40, 17]
    q = randn(sum(lq), 4, 32)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    if paged:
        k, v, table = make_pool(lk, 8, 2, 32, torch.float32)
    else:
        k, v, table = randn(sum(lk), 2, 32), randn(sum(lk), 2, 32), None

    def run():
        return flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True,
                                      block_table=table, num_splits=num_splits)

    def want():
        if paged:
            return ref.paged_varlen_attention_ref(q, k, v, cq, ck, table, causal=True)
        return ref.varlen_attention_ref(q, k, v, cq, ck, causal=True)
    return run, want


CASES = {
    "decode": lambda: _decode(),
    "decode_fp16_4_splits": lambda: _decode(torch.float16, num_splits=4),
    "decode_no_lse": lambda: _decode(return_lse=False, num_splits=3),
    "decode_paged": lambda: _decode(paged=True),
    "prefill_causal": lambda: _prefill(),
    "prefill_window_softcap": lambda: _prefill(causal=False, window=(7, 3), softcap=20.0),
    "varlen": lambda: _varlen(),
    "varlen_paged_split": lambda: _varlen(paged=True, num_splits=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_matches_public_path(fake_triton, case):
    run, want = CASES[case]()
    with_lse = case != "decode_no_lse"
    previous = fastlaunch.set_enabled(False)
    try:
        public = run()
    finally:
        fastlaunch.set_enabled(previous)
    assert not fake_triton.attention.compiled.calls, "a launch went the fast way while it was off"
    run()  # the first launch of each signature is public, and binds its slot
    launches = fake_triton.attention.public, len(fake_triton.attention.compiled.calls)
    fast = run()
    assert fake_triton.attention.public == launches[0], "the repeated launch was not a fast one"
    assert len(fake_triton.attention.compiled.calls) == launches[1] + 1
    (grid, stream, function, metadata, meta, enter, leave) = fake_triton.attention.compiled.calls[-1]
    assert (stream, function, metadata, meta, enter, leave) == (77, 1234, (4, 1, 0), None, None, None)
    plan = next(iter(attention._PLANS.values()))
    assert grid == plan.grid
    if plan.num_splits > 1:  # the combine kernel went the fast way too
        assert fake_triton.combine.compiled.calls
    outs = (public, fast) if with_lse else ((public,), (fast,))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    want_out, want_lse = want()
    dtype = fast[0].dtype if with_lse else fast.dtype
    assert_close(outs[1][0], want_out, dtype)
    if with_lse:
        assert_close(outs[1][1], want_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


def test_absent_tensors_reach_the_handle_as_null_pointers(fake_triton):
    """An absent optional tensor (its constexpr off) goes to the launcher as None, a null pointer
    for which Triton's C launcher reads no address; the public launch gets ``out`` in its place,
    since Triton would specialize a None into another kernel. Both kernels of a split decode."""
    run, _ = _decode(return_lse=False, num_splits=3)
    run()
    run()
    for jit, absent, out_at in ((fake_triton.attention, {"Lse", "CuSeqlensQ", "CuSeqlensK", "BlockTable", "Sinks",
                                                          "KDescale", "VDescale"}, 3),
                                (fake_triton.combine, {"Lse"}, 2)):
        names = [p.name for p in jit.params]
        public, fast = jit.public_args, jit.compiled.args
        for i, name in enumerate(names[:len(public)]):
            if name in absent:
                assert fast[i] is None and public[i] is public[out_at], name
            else:
                assert fast[i] is not None and public[i] is not None, name


def _decoder_calls():
    """Every decoder op once (fresh outputs each call; rope rotates a fresh copy)."""
    x, w, res = randn(3, 40), randn(40), randn(3, 40)
    qkv, pos, table = randn(2, 50), torch.tensor([3, 0], device=DEVICE), randn(8, 10)
    weight, gate_up, down = randn(24, 40), randn(1, 48), randn(40, 24)

    def rotated():
        t = qkv.clone()
        rope.rope_(t, pos, table.cos(), table.sin(), num_heads=4, head_dim=10)
        return t
    return [lambda: norm.rms_norm(x, w, 1e-5, res), rotated, lambda: activation.silu_mul(gate_up),
            lambda: sampling.argmax(res), lambda: gemv.rms_norm_gemv(x[:1], weight, norm_weight=w, eps=1e-5),
            lambda: gemv.silu_mul_gemv(gate_up, down)]


@pytest.mark.parametrize("op", range(6), ids=["rms_norm", "rope", "silu_mul", "argmax", "rms_norm_gemv",
                                              "silu_mul_gemv"])
def test_decoder_ops_relaunch_through_their_handles(monkeypatch, op):
    """The engine's ops keep a launch per signature (1-D and 2-D grids padded to the launcher's 3)
    and relaunch it through the handle with the public launch's results."""
    module = (norm, rope, activation, sampling, gemv, gemv)[op]
    names = [n for n in vars(module) if n.endswith("_kernel")]
    jits = {n: _Jit(getattr(module, n)) for n in names}
    for n, jit in jits.items():
        monkeypatch.setattr(module, n, jit)
    monkeypatch.setattr(module, "_PLANS", type(module._PLANS)())
    call = _decoder_calls()[op]
    with fastlaunch.assume_api(_Device(), lambda index: 77, _Knobs()):
        first, second = call(), call()
    for jit in jits.values():
        assert jit.public == 1 and len(jit.compiled.calls) == 1
        assert len(jit.compiled.calls[0][0]) == 3
    for a, b in zip(first if isinstance(first, tuple) else (first,), second if isinstance(second, tuple) else (second,)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- when the fast path must not apply


def test_a_failing_fast_launch_falls_back_for_good(fake_triton):
    run, want = _prefill()
    run()
    fake_triton.attention.raises = RuntimeError("launcher ABI changed")
    public = fake_triton.attention.public
    with pytest.warns(UserWarning, match="fast launch failed .*launcher ABI changed"):
        out, _ = run()
    assert fake_triton.attention.public == public + 1  # the same launch, repeated publicly
    assert_close(out, want()[0], torch.float32)
    assert not fastlaunch.enabled() and fastlaunch.status().startswith("off: a fast launch failed")
    calls = len(fake_triton.attention.compiled.calls)
    run()
    assert len(fake_triton.attention.compiled.calls) == calls  # never again


@pytest.mark.parametrize("change", ["kernel", "device", "pre_run_hook", "launch_hook", "debug", "disabled"])
def test_public_launch_when_the_handle_does_not_apply(fake_triton, monkeypatch, change):
    run, want = _prefill()
    run()
    if change == "kernel":  # e.g. a test wrapped the kernel: its wrapper must see the launch
        monkeypatch.setattr(attention, "_attention_kernel", _Jit(fake_triton.attention.fn))
    elif change == "device":
        fake_triton.device.index = 1
    elif change == "pre_run_hook":
        fake_triton.attention.pre_run_hooks.append(lambda *a, **k: None)
    elif change == "launch_hook":  # a profiler: Triton's launch runs it with the launch metadata
        fake_triton.knobs.launch_exit_hook = lambda meta: None
    elif change == "debug":
        fake_triton.knobs.debug = True
    else:
        fastlaunch.set_enabled(False)
    public, calls = attention._attention_kernel.public, len(fake_triton.attention.compiled.calls)
    out, _ = run()
    assert attention._attention_kernel.public == public + 1
    assert len(fake_triton.attention.compiled.calls) == calls
    assert_close(out, want()[0], torch.float32)


def _slot_after(jit) -> fastlaunch.Slot:
    slot = fastlaunch.Slot()
    fastlaunch.launch(slot, jit, (1, 1, 1), (), {"X": 1})
    return slot


def _kernel_stub(params, compiled):
    """A JITFunction-like kernel whose public launch returns ``compiled``."""
    class Stub:
        pre_run_hooks = []

        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled

    stub = Stub()
    stub.params = params
    return stub


@pytest.mark.parametrize("shape", ["constexpr_first", "interpreter_result", "async_result", "missing_run",
                                   "not_a_jit"])
def test_objects_of_another_shape_keep_the_public_launch(fake_triton, shape):
    p = types.SimpleNamespace
    params = [p(name="a", is_constexpr=False), p(name="X", is_constexpr=True)]
    compiled = _Compiled(None)
    if shape == "constexpr_first":
        params = params[::-1]
    elif shape == "interpreter_result":
        compiled = None
    elif shape == "async_result":  # a future, as under triton's async compile mode
        compiled = p(result=lambda: None, run=None, function=0, packed_metadata=())
    elif shape == "missing_run":
        compiled = p(function=0, packed_metadata=())
    if shape == "not_a_jit":
        kernel = type("Plain", (), {"__getitem__": lambda self, grid: lambda *a, **k: _Compiled(None)})()
    else:
        kernel = _kernel_stub(params, compiled)
    assert _slot_after(kernel).handle is None
    assert fastlaunch.status().startswith("refused: ")


def test_an_unknown_triton_keeps_the_public_launch(monkeypatch):
    monkeypatch.setattr(fastlaunch, "_enabled", True)  # on, as without PAGEDFLASH_FAST_LAUNCH=0
    monkeypatch.setattr(fastlaunch, "_api", False)
    monkeypatch.setattr(fastlaunch, "KNOWN_VERSIONS", ("0.0.",))
    jit = _kernel_stub([types.SimpleNamespace(name="X", is_constexpr=True)], _Compiled(None))
    assert _slot_after(jit).handle is None
    assert fastlaunch.status().startswith(f"unavailable: triton {triton.__version__} is not a known release")


def test_environment_switch_forces_the_public_launch(monkeypatch):
    monkeypatch.setenv("PAGEDFLASH_FAST_LAUNCH", "0")
    try:
        importlib.reload(fastlaunch)  # the switch is read when the module loads
        assert not fastlaunch.enabled() and fastlaunch.status() == "off: PAGEDFLASH_FAST_LAUNCH=0"
        jit = _kernel_stub([types.SimpleNamespace(name="X", is_constexpr=True)], _Compiled(None))
        assert _slot_after(jit).handle is None
    finally:
        monkeypatch.undo()  # the environment as the run had it, then the module as it loads there
        importlib.reload(fastlaunch)
        fastlaunch.register_scratch_allocator(attention_launch._tma_scratch)  # as attention_launch's import did


# ---------------------------------------------------------------- compiled (GPU)

gpu = pytest.mark.skipif(not ON_GPU, reason="the compiled fast path needs a GPU")


def _known_triton() -> bool:
    return triton.__version__.startswith(fastlaunch.KNOWN_VERSIONS)


def _gpu_cases():
    """Public calls over the launch modes, on inputs made once (a signature's calls repeat exactly)."""
    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda").to(dtype)

    q1, kc, vc = r(4, 1, 32, 128), r(4, 4096, 8, 128), r(4, 4096, 8, 128)
    lens = torch.tensor([4096, 1000, 1, 0], dtype=torch.int32, device="cuda")
    kp, vp, table = make_pool([4096, 100, 17, 0], 16, 8, 128, torch.bfloat16)
    plens = torch.tensor([4096, 100, 17, 0], dtype=torch.int32, device="cuda")  # what the pool holds
    kp64, vp64, table64 = make_pool([300, 65], 64, 8, 128, torch.bfloat16)
    q64, cu64 = r(365, 32, 128), cu_seqlens([300, 65])
    pq, pk, pv = r(1, 128, 32, 128), r(1, 128, 8, 128), r(1, 128, 8, 128)
    lq, lk = [100, 1, 300], [100, 50, 700]
    vq, vk, vv = r(sum(lq), 32, 128), r(sum(lk), 8, 128), r(sum(lk), 8, 128)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    skew = r(128 * 32 * 128 + 4).narrow(0, 4, 128 * 32 * 128).view(1, 128, 32, 128)  # 8-byte aligned q
    q80 = r(2, 1, 16, 80, dtype=torch.float16)
    k80, v80 = r(2, 333, 4, 80, dtype=torch.float16), r(2, 333, 4, 80, dtype=torch.float16)
    e4m3 = torch.float8_e4m3fn
    kp8, vp8 = kp.to(e4m3), vp.to(e4m3)  # fp8 pages, the side inputs: per-head, per-tensor, sinks
    kd, vd, sinks = torch.rand(8, device="cuda") + 0.5, torch.tensor([0.7], device="cuda"), r(32, dtype=torch.float32)
    kp64_8, vp64_8 = kp64.to(e4m3), vp64.to(e4m3)
    return {
        "decode_split": lambda: flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=lens, return_lse=True),
        "decode_d80_fp16": lambda: flash_attn_with_kvcache(q80, k80, v80, cache_seqlens=333, num_splits=3),
        "paged16": lambda: flash_attn_with_kvcache(q1, kp, vp, cache_seqlens=plens, block_table=table),
        "paged64_prefill_tma": lambda: flash_attn_varlen_func(q64, kp64, vp64, cu64, cu64, 300, 300, causal=True,
                                                              block_table=table64),
        "prefill_tma": lambda: flash_attn_func(pq, pk, pv, causal=True, return_lse=True),
        "prefill_misaligned_q": lambda: flash_attn_func(skew, pk, pv, causal=True),
        "varlen_window_softcap": lambda: flash_attn_varlen_func(vq, vk, vv, cq, ck, max(lq), max(lk), causal=True,
                                                                window_size=(64, 0), softcap=30.0),
        "paged16_fp8_sinks": lambda: flash_attn_with_kvcache(q1, kp8, vp8, cache_seqlens=plens, block_table=table,
                                                             k_descale=kd, v_descale=vd, sinks=sinks),
        "paged64_prefill_fp8": lambda: flash_attn_varlen_func(q64, kp64_8, vp64_8, cu64, cu64, 300, 300, causal=True,
                                                              block_table=table64, k_descale=vd, v_descale=vd),
        "prefill_sinks": lambda: flash_attn_func(pq, pk, pv, causal=True, sinks=sinks),
    }


@gpu
def test_gpu_fast_path_is_bit_identical_to_the_public_launch():
    attention.clear_plans()
    torch.manual_seed(0)
    with torch.inference_mode():
        cases = _gpu_cases()
        results = {}
        for enabled in (False, True):
            previous = fastlaunch.set_enabled(enabled)
            try:
                results[enabled] = {name: [call() for _ in range(3)] for name, call in cases.items()}
                status = fastlaunch.status()
            finally:
                fastlaunch.set_enabled(previous)
    for name in results[False]:
        for public, fast in zip(results[False][name], results[True][name]):
            public, fast = (public, fast) if isinstance(public, tuple) else ((public,), (fast,))
            for a, b in zip(public, fast):
                assert torch.equal(a, b), name
    if _known_triton():
        assert status == "on", status
        assert all(plan.slot.handle is not None for plan in attention._PLANS.values())


@gpu
@pytest.mark.skipif(not _known_triton(), reason="reads triton 3.6's binder")
def test_gpu_one_plan_means_one_triton_specialization():
    """Calls on fresh tensors that reuse a plan (so the fast path would launch the kernel that
    plan's handle holds) give Triton's own binder the same specialization and options: the plan key
    covers everything Triton specializes on."""
    real = attention._attention_kernel
    seen = []

    class Spy:
        params, pre_run_hooks = real.params, real.pre_run_hooks

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((args, kwargs))
                return real[grid](*args, **kwargs)
            return launch

    attention.clear_plans()
    previous = fastlaunch.set_enabled(False)  # every launch public, so the spy sees them all
    try:
        with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "_attention_kernel", Spy())
            for _ in range(2):  # fresh tensors of the same signatures
                for call in _gpu_cases().values():
                    call()
                plans = len(attention._PLANS)
    finally:
        fastlaunch.set_enabled(previous)
    assert plans == len(_gpu_cases()), "the second round did not reuse the first round's plans"
    binder = real.device_caches[torch.cuda.current_device()][4]

    def specialization(args, kwargs):
        kwargs = dict(kwargs, debug=kwargs.get("debug", real.debug) or triton.knobs.runtime.debug,
                      instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
        _, spec, options = binder(*args, **kwargs)
        return tuple(spec), str(options)

    half = len(seen) // 2
    for first, second in zip(seen[:half], seen[half:]):
        assert specialization(*first) == specialization(*second)


@gpu
def test_gpu_reused_partials_under_graph_capture_and_streams():
    """Split partials are reused by eager calls on one stream, never inside a CUDA-graph capture,
    and per stream: a captured decode and eager decodes on two streams all stay correct."""
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 2048, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    lens = torch.tensor([2048, 700], dtype=torch.int32, device="cuda")
    want = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=8).clone()
    side = torch.cuda.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=8)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph):
            captured = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=8)
    for _ in range(3):
        graph.replay()
        eager = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=8)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=8)
        torch.cuda.synchronize()
        assert torch.equal(captured, want) and torch.equal(eager, want) and torch.equal(other, want)
