"""torch.compile over every public function, through the ``torch.ops.pagedflash`` operators.

- ``torch._dynamo.explain`` finds no graph break in code calling each public function (and each
  mode of it: paged, appending new k/v, ``out=``, split KV, attention sinks, fp8 caches with their
  scales, the batch-invariant mode), and the one graph calls the operator;
- ``torch.compile(fullgraph=True)`` results, mutated caches included, are bit-identical to eager,
  with static and dynamic (SymInt) shapes: on the CPU with ``aot_eager`` (the kernels under the
  interpreter) and Inductor for two cases, on the GPU with Inductor for every case and
  ``mode="reduce-overhead"`` (CUDA graphs, tests marked ``gpu``);
- eager calls routed through the dispatcher give the same bits as the direct eager route;
- input checks still fire under compile, naming the argument.

The cases: tests/compile_cases.py. The operators called directly (``torch.library.opcheck``):
tests/test_compile_opcheck.py. A transformers model over pagedflash under compile:
tests/test_compile_transformers.py.
"""

import compile_cases
import pytest
import torch
import torch._dynamo.testing
from compile_cases import CASES, assert_identical, fresh_args, resized, run_on_clones
from helpers import ON_GPU

from pagedflash import flash_attn_func, validate
from pagedflash.ops import custom_ops, decode, prefill

fresh_dynamo = compile_cases.fresh_dynamo  # the shared autouse fixture, found by its name here
gpu_only = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")


def _ops_in(graphs) -> set[str]:
    names = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            target = getattr(node.target, "_schema", None)
            if target is not None and target.name.startswith("pagedflash::"):
                names.add(target.name.split("::")[1])
    return names


@pytest.mark.parametrize("name", list(CASES))
def test_explain_finds_no_graph_break(name):
    case = CASES[name]
    with torch.inference_mode():
        report = torch._dynamo.explain(case.fn)(*fresh_args(case))
    reasons = [b.reason.splitlines()[0] for b in report.break_reasons]
    assert report.graph_break_count == 0, reasons
    assert report.graph_count == 1
    assert _ops_in(report.graphs) == (case.op if isinstance(case.op, set) else {case.op})


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_aot_eager_is_bit_identical(name):
    case = CASES[name]
    args = fresh_args(case)
    want = run_on_clones(case.fn, args)
    compiled = torch.compile(case.fn, backend="aot_eager", fullgraph=True)
    assert_identical(run_on_clones(compiled, args), want, name)


@pytest.mark.parametrize("name", ["dense_out", "varlen_paged", "kvcache_paged_append", "kvcache_int_seqlens", "merge",
                                  "write_kv_cache", "decoder_ops", "moe_route"]
                         + (["kvcache_paged_fp8_sinks"] if ON_GPU else []))
def test_dynamic_shapes_compile_once(name):
    """``dynamic=True``: bit-identical to eager, and a second set of sizes reuses the graph (every
    check ran on SymInts). Duck sizing, off here, would specialize on sizes that happen to be equal
    in the first call (B == Hkv, say): torch's choice, not a check of ours."""
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        _compile_once(name)


def _compile_once(name):
    case = CASES[name]
    # the public calls' kept check outcomes, empty as in a fresh process: a graph that guarded on them would
    # recompile once the eager calls below fill them
    for kept in (prefill._CHECKED, prefill._CHECKED_VARLEN, decode._CHECKED):
        kept.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(case.fn, backend=counter, fullgraph=True, dynamic=True)
    first = fresh_args(case)
    assert_identical(run_on_clones(compiled, first), run_on_clones(case.fn, first), name)
    frames = counter.frame_count
    second = resized(name)
    assert_identical(run_on_clones(compiled, second), run_on_clones(case.fn, second), name)
    assert counter.frame_count == frames, "recompiled for the second set of sizes"


@pytest.mark.parametrize("name", list(CASES))
def test_eager_through_the_dispatcher_is_bit_identical(name):
    case = CASES[name]
    args = fresh_args(case)
    direct = run_on_clones(case.fn, args)
    previous = custom_ops.dispatch_eager(True)
    try:
        routed = run_on_clones(case.fn, args)
    finally:
        custom_ops.dispatch_eager(previous)
    assert_identical(routed, direct, name)


def test_checks_still_fire_while_compiling():
    q, k, v = fresh_args(CASES["dense"])

    def bad_window(q, k, v):
        return flash_attn_func(q, k, v, window_size=(-3, 0))

    with pytest.raises(ValueError, match="window_size: expected entries >= -1"):
        torch.compile(bad_window, backend="aot_eager")(q, k, v)
    with pytest.raises(Exception, match="window_size: expected entries >= -1"):  # fullgraph: dynamo's error
        torch.compile(bad_window, backend="aot_eager", fullgraph=True)(q, k, v)

    def wrong_kv_batch(q, k, v):
        return flash_attn_func(q, k[:1], v[:1])

    with pytest.raises(ValueError, match=r"k: expected batch 2 \(q's\), got 1"):
        torch.compile(wrong_kv_batch, backend="aot_eager", dynamic=True)(q, k, v)


def test_value_checks_are_skipped_while_compiling():
    """Checks that read device values (``.tolist()`` of cu_seqlens, page ids) cannot run on fake
    tensors: in the debug mode, off while compiling, on in eager."""
    x = torch.zeros(3)

    def probe(x):
        return x + 1 if validate.value_checks_enabled(x) else x - 1

    with validate.value_checks(True):
        assert torch.equal(probe(x), x + 1)
        assert torch.equal(torch.compile(probe, backend="aot_eager", fullgraph=True)(x), x - 1)


INDUCTOR_ON_CPU = ("kvcache_paged_append", "merge")  # Inductor's C++ builds are slow on a CPU: two cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(CASES))
def test_inductor_is_bit_identical(name, dynamic, dtype):
    """The default backend: the operators stay opaque calls between Inductor's kernels, the mutated
    ones functionalized and re-inplaced. The GPU runs every case at real sizes."""
    if not ON_GPU and (dynamic or name not in INDUCTOR_ON_CPU):
        pytest.skip("the CPU runs two static cases; the GPU runs the matrix")
    case = CASES[name]
    args = fresh_args(case, dtype, big=ON_GPU)
    want = run_on_clones(case.fn, args)
    compiled = torch.compile(case.fn, fullgraph=True, dynamic=dynamic)
    for _ in range(2):
        assert_identical(run_on_clones(compiled, args), want, name)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("name", list(CASES))
def test_reduce_overhead_cuda_graphs_are_bit_identical(name):
    """``mode="reduce-overhead"``: the calls replay a CUDA graph (no cudagraph skip) with the caches
    and outputs at fixed addresses, as an engine keeps them; every replay equals eager."""
    from torch._dynamo.utils import counters

    case = CASES[name]
    args = fresh_args(case, torch.bfloat16, big=True)
    want = run_on_clones(case.fn, args)
    # the same tensors on every call: mutated inputs must keep their addresses for graph replay
    static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    for a in static:
        if isinstance(a, torch.Tensor):
            torch._dynamo.mark_static_address(a)
    compiled = torch.compile(case.fn, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    for _ in range(4):  # warm-up, record, replays
        for a, src in zip(static, args):
            if isinstance(a, torch.Tensor):
                a.copy_(src)
        with torch.inference_mode():
            got = [t.clone() for t in compiled(*static)]
        assert_identical(got, want, name)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
