"""What test files share (fixtures stay in conftest.py): the device and dtypes of the matrix, the
tolerance rule, random inputs, cu_seqlens and page pools on the test device, parametrize ids, and
the block manager's invariants and snapshot (its unit and stateful tests).

``ON_GPU`` selects the matrix: small and fp32/fp16 under the interpreter, full with bf16 and long
sequences when compiled on a GPU. The comparison rule and the pool builder are the package's
(:mod:`pagedflash.testing`), shared with the benchmarks and ``pagedflash demo``.
"""

import pagedflash  # noqa: F401, I001  (first: sets TRITON_INTERPRET on CPU-only machines)
import math
import os
from array import array
from pathlib import Path

import pytest
import torch

from pagedflash.cache import block_manager as bm_module
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.cache.block_manager import BlockManager
from pagedflash.testing import assert_close, random_paged_kv

__all__ = ["DEVICE", "DTYPES", "ON_GPU", "ROOT", "TWO_GPUS", "assert_close", "check_invariants", "child_env", "cu_seqlens",
           "fp8_pool", "ids", "make_pool", "needs_two_gpus", "randn", "snapshot"]

ON_GPU = torch.cuda.is_available()
TWO_GPUS = ON_GPU and torch.cuda.device_count() >= 2
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices")
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
ROOT = Path(__file__).resolve().parents[1]


def child_env(*, interpret: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a child Python (a tool, ``python -m pagedflash``) that imports this tree's
    pagedflash whether or not it is installed; ``interpret=False`` leaves out TRITON_INTERPRET (the
    child compiles its kernels); ``extra`` sets more variables."""
    env = {k: v for k, v in os.environ.items() if interpret or k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, **extra}


def randn(*shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    """Normal values on the test device, drawn in fp32 (the same draws whatever the dtype)."""
    return torch.randn(*shape, generator=generator, dtype=torch.float32, device=DEVICE).to(dtype)


def cu_seqlens(lengths) -> torch.Tensor:
    """:func:`pagedflash.cache.cu_seqlens_tensor` on the test device."""
    return cu_seqlens_tensor(lengths, device=DEVICE)


def make_pool(seqlens, page, hkv, d, dtype, *, share_first=0, spare=3):
    """:func:`pagedflash.testing.random_paged_kv` on the test device: a NaN-poisoned pool ``spare`` x
    larger than needed, block tables a random permutation of it; ``share_first`` > 0 makes every
    sequence alias the first sequence's first pages (prefix caching)."""
    return random_paged_kv(seqlens, page, hkv, d, dtype, device=DEVICE, spare=spare, share_first=share_first)


def fp8_pool(seqlens, page, hkv, d, fp8=torch.float8_e4m3fn, **kwargs):
    """:func:`make_pool` stored in fp8 (NaN in every unused slot); built in fp32 and converted, so no
    fp8 scatter is needed on the device."""
    k_cache, v_cache, table = make_pool(seqlens, page, hkv, d, torch.float32, **kwargs)
    return k_cache.to(fp8), v_cache.to(fp8), table


def ids(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return str(value)


# ------------------------------------------------------------------ block manager
def check_invariants(bm: BlockManager) -> None:
    """Every structural invariant of the manager (reads its private state)."""
    blocks, uncached, evictable = bm._blocks, list(bm._free_uncached), list(bm._evictable)
    free = uncached + evictable
    assert len(free) == len(set(free)), "a block is free twice"
    assert not set(uncached) & set(evictable)
    assert set(free) == {b.block_id for b in blocks if b.ref_count == 0}
    used = [b for b in blocks if b.ref_count > 0]
    assert bm.num_free_blocks == len(free) and len(free) + len(used) == bm.num_blocks
    assert all(blocks[b].hash is None for b in uncached)
    assert all(blocks[b].hash is not None for b in evictable)
    # Reference counts are exactly the number of live tables holding a block.
    owners: dict[int, list] = {}
    for seq_id, seq in bm._seqs.items():
        full = len(seq.token_ids) % bm.page_size == 0  # then one block may be reserved ahead of the next token
        assert len(seq.block_table) - math.ceil(len(seq.token_ids) / bm.page_size) in ((0, 1) if full else (0,))
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in seq.block_table:
            owners.setdefault(b, []).append(seq_id)
    for b in blocks:
        assert b.ref_count == len(owners.get(b.block_id, [])) >= 0
    # Hash chain of every committed block; partial and uncommitted blocks unhashed and unshared.
    p = bm.page_size
    for seq in bm._seqs.values():
        assert 0 <= seq.num_committed <= len(seq.token_ids) // p
        assert seq.num_committed == 0 or bm.enable_prefix_caching
        parent_hash = None
        for i, b in enumerate(seq.block_table):
            block, tokens = blocks[b], seq.token_ids[i * p : (i + 1) * p]
            if i < seq.num_committed:
                assert block.token_bytes == array("q", tokens).tobytes()
                assert block.hash == bm_module.chain_hash(parent_hash, tokens)  # the patched one, if any
                parent_hash = block.hash
            else:
                assert block.hash is None and block.ref_count == 1
    # A shared block holds the same token prefix in every sequence holding it.
    for b, seq_ids in owners.items():
        prefixes = set()
        for s in seq_ids:
            seq = bm._seqs[s]
            i = seq.block_table.index(b)
            prefixes.add(tuple(seq.token_ids[: (i + 1) * p]))
        assert len(prefixes) == 1, f"block {b} shared by sequences with different prefixes"
    for h, b in bm._hash_to_block.items():
        assert blocks[b].hash == h
    if not bm.enable_prefix_caching:
        assert not bm._hash_to_block and not evictable


def snapshot(bm: BlockManager):
    """Everything an all-or-nothing failure must leave unchanged."""
    return (
        [(b.ref_count, b.hash, b.token_bytes, b.parent, b.reuses) for b in bm._blocks],
        list(bm._free_uncached),
        list(bm._evictable),
        dict(bm._hash_to_block),
        {s: (list(q.token_ids), list(q.block_table), q.num_committed) for s, q in bm._seqs.items()},
        (bm.stats.queried_tokens, bm.stats.hit_tokens),
    )


@torch.no_grad()
def hf_greedy(model, prompt, n, processors=None):
    """``n`` greedy tokens of a transformers model after ``prompt``, one full forward per token;
    ``processors`` (transformers' ``LogitsProcessorList`` or any ``(ids, scores) -> scores``) adjust
    the last position's logits before the argmax."""
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        scores = model(ids).logits[:, -1]
        if processors is not None:
            scores = processors(ids, scores)
        tok = int(scores[0].argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


def prompts_of(lengths, seed=0, vocab=128, low=0):
    """Seeded random prompts of these lengths, ids in ``[low, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def count_kept_launches(monkeypatch, module):
    """Count the kept-plan launches (:func:`pagedflash.ops.attention.kept_forward` calls that
    launched) that the public functions of ``module`` make, in a one-element list; no plan is kept
    before, and eager calls are not routed through the dispatcher whatever PAGEDFLASH_EAGER_OPS
    says (the second value returned puts the dispatcher switch back)."""
    from pagedflash.ops import attention, custom_ops

    attention.clear_plans()
    previous = custom_ops.dispatch_eager(False)
    count = [0]
    real = attention.kept_forward

    def spy(*args):
        done = real(*args)
        count[0] += done is not None
        return done

    monkeypatch.setattr(module, "kept_forward", spy)
    return count, lambda: custom_ops.dispatch_eager(previous)
