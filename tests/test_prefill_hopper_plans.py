"""The Gluon Hopper prefill kernel's launch plans (pagedflash/ops/prefill_hopper.py): the persistent
grid's program count shares the causal key tiles evenly, what varies between serving steps never
recompiles the kernel, a compile failure warns once and takes the portable kernel, and on an sm90 GPU
(``@pytest.mark.gpu``) a signature's later calls go through the plan's fast handle.
"""

import prefill_hopper_checks as checks
import pytest
import torch
from helpers import assert_close, randn
from prefill_hopper_checks import check_paged, check_varlen, empty_qkv, sm90

from pagedflash import flash_attn_func
from pagedflash import reference as ref
from pagedflash.ops import launch, prefill_hopper

gluon, hopper_here = checks.gluon, checks.hopper_here  # the shared fixtures, found by their names here


@pytest.mark.parametrize("sq, sk, heads", [(1024, 1024, 256), (2048, 2048, 128), (16384, 16384, 16),
                                           (32768, 32768, 16), (65536, 65536, 8), (6144, 6144, 16),
                                           (12288, 12288, 16), (700, 700, 12 * 40), (1000, 3000, 64)])
def test_causal_programs_share_the_key_tiles_evenly(sq, sk, heads):
    # the persistent grid's program count, scored here with the kernel's deal (round r: item
    # r * p + pid, or r * p + p - 1 - pid in odd rounds) and its key tiles (bottom-right causal): the
    # busiest program within 5 % and one item of an even share of all 132 SMs
    n_m = -(-sq // prefill_hopper.BLOCK_M)
    n_items = n_m * heads
    p = prefill_hopper.programs(n_items, n_m, True, 132, sq, sk)
    assert 0.85 * 132 <= p <= 132
    t = torch.arange(n_items)
    pid = torch.where(t // p % 2 == 0, t % p, p - 1 - t % p)
    m0 = (n_m - 1 - t % n_m) * prefill_hopper.BLOCK_M
    tiles = torch.clamp((m0 + prefill_hopper.BLOCK_M + sk - sq + 127) // 128, max=-(-sk // 128)).double()
    load = torch.bincount(pid, weights=tiles, minlength=p)
    assert load.max() <= 1.05 * tiles.sum() / 132 + tiles.max(), (p, load.max().item(), tiles.sum().item() / 132)
    assert prefill_hopper.programs(n_items, n_m, False, 132, sq, sk) == 132
    assert prefill_hopper.programs(100, n_m, True, 132, sq, sk) == 100
    assert all(1 <= prefill_hopper.programs(n_items, n_m, True, sms, sq, sk) <= sms for sms in (1, 2, 5))


def _plan_ints(q, k, varlen=None, block_table=None, causal=True):
    return prefill_hopper._make_plan(q, k, k, torch.empty_like(q), causal, False, varlen, block_table, None, None).ints


def _compile_classes(ints):
    """What Triton specializes an integer argument on: equal to 1, a multiple of 16, other."""
    return {name: (x == 1, x % 16 == 0) for name, x in ints.items() if name not in prefill_hopper.kernel.RUNTIME_INTS}


def test_what_varies_between_serving_steps_never_recompiles_the_kernel(hopper_here, monkeypatch):
    # two chunked-prefill steps of one engine (paged), two varlen calls, two dense calls of another
    # length and batch: every integer argument either stays in its class or is never specialized
    monkeypatch.setattr(prefill_hopper.kernel, "kernel_config", lambda *args: ({}, {}, None, None, None, None))
    cache, bf16 = torch.empty(512, 16, 8, 128, dtype=torch.bfloat16), torch.bfloat16
    step1 = _plan_ints(torch.empty(512, 32, 128, dtype=bf16), cache, (1, 512, 4096),
                       torch.zeros(1, 256, dtype=torch.int32))
    step2 = _plan_ints(torch.empty(307, 32, 128, dtype=bf16), cache, (2, 300, 1001),
                       torch.zeros(2, 63, dtype=torch.int32))
    assert step1 != step2 and _compile_classes(step1) == _compile_classes(step2)
    packed = torch.empty(5000, 8, 128, dtype=bf16)
    assert _compile_classes(_plan_ints(packed[:4096], packed, (4, 1024, 1024))) == \
        _compile_classes(_plan_ints(packed[:3001], packed, (3, 1700, 2001)))
    assert _compile_classes(_plan_ints(*empty_qkv(b=2, sq=1024, sk=1024)[:2])) == \
        _compile_classes(_plan_ints(*empty_qkv(b=1, sq=777, sk=1001)[:2]))


class _FakeCompileError(RuntimeError):
    pass


def test_a_compile_failure_warns_once_and_takes_the_portable_kernel(monkeypatch):
    tried = []

    class Failing:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                tried.append(grid)
                raise _FakeCompileError("ptxas died")
            return run

    monkeypatch.setattr(prefill_hopper.kernel, "prefill_kernel", Failing(), raising=False)
    monkeypatch.setattr(prefill_hopper.kernel, "TensorDescriptor", lambda *args: None, raising=False)
    monkeypatch.setattr(prefill_hopper.kernel, "kernel_config", lambda *args: ({}, {}, None, None, None, None))
    monkeypatch.setattr(prefill_hopper.kernel, "COMPILE_ERRORS", (_FakeCompileError,), raising=False)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    monkeypatch.setattr(prefill_hopper, "refusal", lambda *args: None)  # routed here, whatever the machine
    q, k, v = randn(1, 20, 2, 32), randn(1, 20, 2, 32), randn(1, 20, 2, 32)
    want = ref.attention_ref(q, k, v, causal=True)
    with pytest.warns(UserWarning, match="Gluon prefill kernel failed to compile .*_FakeCompileError"):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_close(out, want[0], torch.float32)
    assert_close(lse, want[1], torch.float32, name="lse")
    out, _ = flash_attn_func(q, k, v, causal=True, return_lse=True)  # remembered: the portable kernel at once
    assert_close(out, want[0], torch.float32)
    assert len(tried) == 1


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("paged", [False, True])
def test_gluon_relaunches_through_its_fast_handle(gluon, paged):
    # a signature's second call goes through the plan's fast handle (pagedflash.ops.fastlaunch), with
    # the same results, and the fast path stays on (a failed handle would turn it off for the process)
    from pagedflash.ops import fastlaunch

    if not fastlaunch.enabled() or fastlaunch._detect() is not None:
        pytest.skip(f"fast launch: {fastlaunch.status()}")
    for _ in range(3):
        if paged:
            check_paged([300, 100], [700, 900], 64, 4, 2, 128, torch.bfloat16, True)
        else:
            check_varlen([300, 200], [300, 200], 4, 2, 128, torch.bfloat16, True)
    assert fastlaunch.enabled(), fastlaunch.status()
    assert any(plan.slot.handle is not None for plan in prefill_hopper._PLANS.values())


def test_the_modes_key_tile_is_part_of_a_plans_signature(monkeypatch):
    # a plan kept for the mode's 64-key tiles never serves a call under 128-key ones (a row's bits
    # follow its tile), nor the other way round; back at 64 keys the first plan is found again
    made = []

    class Failed:  # a plan that failed to compile: the call takes the portable kernel
        failed = True

    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    monkeypatch.setattr(prefill_hopper, "_make_plan", lambda *args: made.append(launch.INVARIANT_TILE) or Failed())
    monkeypatch.setattr(prefill_hopper, "refusal", lambda *args: None)  # routed here, whatever the machine
    q, k, v = randn(1, 20, 2, 64), randn(1, 20, 2, 64), randn(1, 20, 2, 64)
    for tile in ("", "64:128:4:2", ""):
        monkeypatch.setattr(launch, "INVARIANT_TILE", tile)
        flash_attn_func(q, k, v, causal=True, batch_invariant=True)
    assert made == ["", "64:128:4:2"]
