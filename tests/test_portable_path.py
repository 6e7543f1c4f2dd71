"""Both ways K/V reach the kernel must stay correct: tensor descriptors (TMA: contiguous K/V, and
page pools whose pages hold whole key tiles) and the portable pointer path.

On a Hopper GPU every case runs twice, TMA on and off. On the CPU the interpreter runs the descriptor
path too (``launch.INTERPRET_TMA``), so its addressing and the masking of stale page slots are
checked there; the pointer variant is what the rest of the suite covers, so it is skipped there.

Without a CUDA device the kernels run under the interpreter however the process began: with triton
(or transformers, which imports it) imported before pagedflash too (checked in fresh processes)."""

import subprocess
import sys

import pytest
import torch
from helpers import ON_GPU, ROOT, assert_close, child_env, cu_seqlens, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash import reference as ref
from pagedflash.ops import launch

DTYPE = torch.bfloat16 if ON_GPU else torch.float16


@pytest.fixture(params=[True, False], ids=["tma", "pointers"])
def tma(request, monkeypatch):
    if not ON_GPU and not request.param:
        pytest.skip("the pointer path is the default under the interpreter")
    monkeypatch.setattr(launch, "TMA", request.param)
    monkeypatch.setattr(launch, "INTERPRET_TMA", request.param)
    launch.choose_config.cache_clear()
    yield request.param
    launch.choose_config.cache_clear()


@pytest.mark.parametrize("d", [64, 80, 128, 256] if ON_GPU else [64])
@pytest.mark.parametrize("causal", [False, True])
def test_dense(tma, d, causal):
    sq, sk = (300, 333) if ON_GPU else (37, 45)
    q = randn(2, sq, 8, d, dtype=DTYPE)
    k, v = randn(2, sk, 2, d, dtype=DTYPE), randn(2, sk, 2, d, dtype=DTYPE)
    assert_close(flash_attn_func(q, k, v, causal=causal), ref.attention_ref(q, k, v, causal=causal)[0], DTYPE)


def test_varlen(tma):
    lens = [1, 200, 0, 77, 513] if ON_GPU else [1, 40, 0, 23]
    q = randn(sum(lens), 4, 128, dtype=torch.float16)
    k, v = randn(sum(lens), 4, 128, dtype=torch.float16), randn(sum(lens), 4, 128, dtype=torch.float16)
    cu = cu_seqlens(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(100, 0))
    want = ref.varlen_attention_ref(q, k, v, cu, cu, causal=True, window_size=(100, 0))[0]
    assert_close(out, want, torch.float16)


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode(tma, num_splits):
    n, cut = (999, 517) if ON_GPU else (99, 51)
    q = randn(3, 1, 32, 128, dtype=DTYPE)
    k_cache, v_cache = randn(3, n, 8, 128, dtype=DTYPE), randn(3, n, 8, 128, dtype=DTYPE)
    lens = torch.tensor([n, 0, cut], dtype=torch.int32, device=q.device)
    k_cache[2, cut:] = float("nan")  # past the length: must never be read
    v_cache[2, cut:] = float("nan")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens)[0], DTYPE)


# Pages of 64+ rows hold whole key tiles, so they load through one descriptor over the pool; the
# pool is NaN outside the slots in use, so a stale slot of a sequence's last page that reached the
# output would show.
@pytest.mark.parametrize("page", [64, 128, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode(tma, page, num_splits):
    seqlens = [1, page - 1, page, page + 1, 3 * page + 5]
    k_cache, v_cache, table = make_pool(seqlens, page, 2, 64, DTYPE)
    q = randn(len(seqlens), 2, 8, 64, dtype=DTYPE)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=num_splits)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)[0], DTYPE)


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("window", [(-1, 0), (30, 0), (-1, -1)])
def test_paged_varlen(tma, page, window):
    new = [70, 1, 33, 1] if ON_GPU else [20, 1, 9, 1]
    cached = [0, 2 * page - 1, page + 7, 3]
    total = [c + n for c, n in zip(cached, new)]
    k_cache, v_cache, table = make_pool(total, page, 2, 64, DTYPE)
    q = randn(sum(new), 4, 64, dtype=DTYPE)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), window_size=window,
                                 block_table=table, num_splits=2)
    want = ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, window_size=window)[0]
    assert_close(out, want, DTYPE)


# Kernels that call triton's own library functions (tl.cdiv in attention, tl.sum in the norm,
# tl.max / tl.min in the argmax): those were defined when triton was imported.
_KERNELS_RUN = """
import torch
from pagedflash import flash_attn_func, reference as ref
from pagedflash.ops import norm, sampling
q = torch.randn(1, 5, 2, 16)
assert torch.allclose(flash_attn_func(q, q, q, causal=True), ref.attention_ref(q, q, q, causal=True)[0], atol=1e-4)
x, w = torch.randn(3, 40), torch.randn(40)
assert torch.allclose(norm.rms_norm(x, w, 1e-6)[0], ref.rms_norm_ref(x, w, 1e-6)[0], atol=1e-4)
logits = torch.randn(2, 5000)
assert sampling.argmax(logits).tolist() == logits.argmax(-1).tolist()
print("kernels ran")
"""


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter that sees no CUDA device and no TRITON_INTERPRET."""
    return subprocess.run([sys.executable, "-c", code], env=child_env(interpret=False, CUDA_VISIBLE_DEVICES=""),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("first", [
    "import pagedflash",
    "import triton",
    "from transformers import LlamaForCausalLM",  # transformers imports triton with its model code
    "import os, triton; os.environ['TRITON_INTERPRET'] = '1'",  # the switch set after the import
], ids=["pagedflash_first", "triton_first", "transformers_first", "switch_after_triton"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="emulates a CPU-only machine; a CUDA image's triton "
                    "may not interpret there (triton 3.6's interpreter fails with numpy >= 2.5)")
def test_kernels_run_without_cuda_whatever_was_imported_first(first):
    if "transformers" in first:
        pytest.importorskip("transformers")
    done = _fresh_python(f"{first}\nimport pagedflash\n{_KERNELS_RUN}")
    assert done.returncode == 0 and "kernels ran" in done.stdout, done.stderr[-3000:]


def test_a_triton_that_cannot_be_switched_gets_one_clear_error():
    """Where triton's internals do not allow switching it after its import (here: its interpreter
    module hidden), importing pagedflash fails at once, saying what to do."""
    done = _fresh_python("import sys, triton\nsys.modules['triton.runtime.interpreter'] = None\nimport pagedflash")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: pagedflash: triton"), done.stderr[-3000:]
    assert "import pagedflash before triton" in last and "TRITON_INTERPRET=1" in last


def test_a_failed_switch_leaves_triton_as_it_was():
    """The switch is all or nothing: when it fails part-way, every triton.language function is the
    one triton defined, so code that catches the ImportError keeps a consistent triton."""
    done = _fresh_python(
        "import triton, triton.language as tl\n"
        "import triton.runtime.interpreter as it\n"
        "from triton.runtime.jit import JITFunction\n"
        "before = {n: v for n, v in vars(tl).items() if isinstance(v, JITFunction)}\n"
        "real, count = it.InterpretedFunction, [0]\n"
        "def flaky(fn):\n"
        "    count[0] += 1\n"
        "    if count[0] == 5:\n"
        "        raise RuntimeError('boom')\n"
        "    return real(fn)\n"
        "it.InterpretedFunction = flaky\n"
        "try:\n"
        "    import pagedflash\n"
        "except ImportError as e:\n"
        "    assert 'boom' in str(e)\n"
        "assert {n: v for n, v in vars(tl).items() if isinstance(v, JITFunction)} == before\n"
        "print('unchanged', len(before))\n")
    assert done.returncode == 0 and "unchanged" in done.stdout, done.stderr[-3000:]
