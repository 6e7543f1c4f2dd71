"""The Gluon Hopper prefill kernel's varlen path on an sm90 GPU (``@pytest.mark.gpu``; skipped
elsewhere), against the fp32 reference: packed sequences with ragged tails, an empty sequence, Sq < Sk
and Sq > Sk, q/k/v as views of one fused qkv buffer and a strided ``out``, a CUDA graph replayed with
new lengths, few programs over many items with inf in a neighbour's V; and invalid metadata (packed
or paged) giving NaN rows and a fault that names the argument.
"""

import prefill_hopper_checks as checks
import pytest
import torch
from helpers import assert_close, cu_seqlens, ids, make_pool, randn
from prefill_hopper_checks import check_varlen, sm90, through_gluon

from pagedflash import flash_attn_varlen_func
from pagedflash import reference as ref
from pagedflash.ops import prefill_hopper
from pagedflash.testing import capture_graph

gluon = checks.gluon  # the shared fixture, found by its name here


VARLEN_CASES = [  # (lengths of q, lengths of k): ragged tails, an empty sequence, Sq < Sk, Sq > Sk (causal: rows
    # that see no key), one sequence
    ([300, 1000, 77], [300, 1000, 77]), ([128, 0, 513], [128, 0, 513]), ([200, 300], [700, 900]),
    ([500, 130], [200, 0]), ([1000], [1000]),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_CASES, ids=str)
def test_gluon_varlen_against_reference(gluon, dtype, d, causal, lens):
    check_varlen(*lens, 4, 2, d, dtype, causal)
    check_varlen(*lens, 4, 2, d, dtype, causal, return_lse=False)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_fused_qkv_and_strided_out(gluon, causal):
    check_varlen([300, 1000, 77], [300, 1000, 77], 4, 2, 128, torch.float16, causal, fused=True)


@pytest.mark.gpu
@sm90
def test_gluon_varlen_in_a_cuda_graph_with_new_lengths(gluon):
    # the descriptors are made in the kernel, so a replay follows the cu_seqlens it finds
    dtype, total = torch.bfloat16, 1400
    q, k, v = randn(total, 4, 128, dtype=dtype), randn(total, 2, 128, dtype=dtype), randn(total, 2, 128, dtype=dtype)
    cu = torch.tensor([0, 300, 1300, total], dtype=torch.int32, device="cuda")
    before = prefill_hopper.launches
    graph, out = capture_graph(lambda: flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True))
    assert prefill_hopper.launches == before + 2  # the warm-up call and the captured one
    for lengths in ([0, 1000, 1077, total], [0, 1, 700, total]):
        cu.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref.varlen_attention_ref(q, k, v, cu, cu, causal=True)[0], dtype)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_few_programs_and_a_poisoned_neighbour(gluon, monkeypatch, programs, causal):
    # many items a program (the descriptors are rewritten item after item) and inf in the last
    # sequence's V, which no other sequence may see
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: programs)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    check_varlen([300, 1000, 77, 129], [300, 1000, 77, 129], 4, 1, 128, torch.bfloat16, causal, poison_last_v=True)
    check_varlen([100, 0, 130, 40], [300, 5, 130, 0], 2, 2, 64, torch.bfloat16, causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fault", ["lengths", "page id"])
def test_gluon_invalid_metadata_gives_nan_rows_and_a_fault(gluon, paged, fault):
    # value checks off (the default): the host reads nothing; the sequence whose metadata is invalid
    # gets NaN rows and LSE, the others are exact, and raise_if_invalid names the argument
    from pagedflash import validate

    if fault == "page id" and not paged:
        pytest.skip("page ids are paged metadata")
    dtype, d, hq, hkv = torch.bfloat16, 128, 4, 2
    lens_q, lens_k = [300, 200, 130], [700, 900, 130]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype)
    if paged:
        k, v, table = make_pool(lens_k, 64, hkv, d, dtype)
    else:
        k, v, table = randn(int(cu_k[-1]), hkv, d, dtype=dtype), randn(int(cu_k[-1]), hkv, d, dtype=dtype), None
    want, want_lse = (ref.paged_varlen_attention_ref(q, k, v, cu_q, cu_k, table, causal=True) if paged
                      else ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True))
    bad_cu_k = cu_k
    if fault == "lengths":  # sequence 1's keys end past the packed keys / the block table's pages
        bad_cu_k = cu_k.clone()
        bad_cu_k[2] = cu_k[1] + (table.shape[1] * 64 + 1 if paged else int(cu_k[-1]))
    else:  # a page id outside the pool in sequence 1's pages
        table = table.clone()
        table[1, 3] = k.shape[0] + 5
    validate.invalid_metadata()
    with validate.value_checks(False):
        got, lse = through_gluon(q, k, v, cu_q, bad_cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True,
                                 block_table=table)
    rows = slice(int(cu_q[1]), int(cu_q[2]))
    assert got[rows].isnan().all() and lse[:, rows].isnan().all()
    others = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    others[rows] = False
    if fault == "lengths":  # the next sequence starts at sequence 1's bad end: invalid too
        others[int(cu_q[2]):] = False
    assert_close(got[others], want[others], dtype)
    assert_close(lse[:, others], want_lse[:, others], torch.float16, name="lse")
    name = "block_table" if fault == "page id" else "cu_seqlens_k"
    with pytest.raises(ValueError, match=name):
        validate.raise_if_invalid()
