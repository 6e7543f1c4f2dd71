"""Tensors on one GPU while another is current: every public kernel launches on its tensors' GPU
(Triton launches on the current device; flash-attn guards it the same way) and an engine on
``cuda:1`` runs its steps, graphs and events there. Two-GPU cases run on a 2-GPU host only."""

import pytest
import torch
from helpers import needs_two_gpus

import pagedflash as pf
from pagedflash import reference as ref
from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.ops.custom_ops import on_device_of
from pagedflash.ops.utils import on_device


def test_the_cpu_needs_no_device_switch():
    with on_device(torch.device("cpu")):
        pass
    assert on_device_of(torch.zeros(1), lambda a, b: a + b, (1, 2)) == 3


def test_the_switch_is_decided_at_each_call_and_restores_the_callers_gpu(monkeypatch):
    current = [0]

    class FakeDevice:  # torch.cuda.device: switch on enter, restore on exit
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    with on_device(torch.device("cuda", 1)):
        assert current == [1]
        with on_device(1):  # nested, already current: nothing to do
            assert current == [1]
        assert current == [1]
    assert current == [0]
    current[0] = 1
    with on_device(torch.device("cuda", 1)):  # the same device from another current GPU: no switch now
        assert current == [1]
    current[0] = 0
    with on_device(torch.device("cuda", 1)):  # ... and a switch again from cuda:0
        assert current == [1]
    assert current == [0]
    with on_device(torch.device("cuda")):  # no index: the current GPU
        assert current == [0]


@pytest.fixture
def on_gpu0():
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(previous)


@pytest.mark.gpu
@needs_two_gpus
def test_kernels_launch_on_their_tensors_gpu(on_gpu0):
    dev = torch.device("cuda", 1)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(2, 70, 4, 64, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
    out, lse = pf.flash_attn_func(q, k, v, causal=True, return_lse=True)
    want, want_lse = ref.attention_ref(q, k, v, causal=True)
    assert out.device == dev and torch.cuda.current_device() == 0
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)

    k_cache, v_cache = (torch.randn(2, 96, 2, 64, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([50, 96], dtype=torch.int32, device=dev)
    q1 = torch.randn(2, 1, 4, 64, device=dev, generator=g, dtype=torch.bfloat16)
    got = pf.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=lens)
    for b, n in enumerate((50, 96)):
        row = ref.attention_ref(q1[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n])[0]
        torch.testing.assert_close(got[b : b + 1].float(), row.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_two_gpus
def test_an_engine_on_the_second_gpu_gives_the_first_gpus_tokens(on_gpu0):
    prompts, params = [[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(dtype=torch.float32, num_blocks=64, cuda_graphs=True, max_num_seqs=4)
    with LLM(TINY_LLAMA, device="cuda:0", **kw) as first:
        want = [o.token_ids for o in first.generate(prompts, params)]
    with LLM(TINY_LLAMA, device="cuda:1", **kw) as second:
        assert torch.cuda.current_device() == 0  # the engine switches for its own work only
        assert second.kv_cache.device == torch.device("cuda", 1) and second.runner.graphs
        assert [o.token_ids for o in second.generate(prompts, params)] == want


def test_a_gpu_that_is_not_there_is_refused():
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in (f"cuda:{visible}", "cuda") if not visible else (f"cuda:{visible}",):
        with pytest.raises(ValueError, match=f"device: expected a visible GPU \\({visible} here\\), got cuda"):
            LLM(TINY_LLAMA, device=device)
