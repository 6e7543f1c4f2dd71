"""The varlen metadata check in front of the Gluon prefill kernel (pagedflash/ops/metadata.py): the
``(start, end)`` pairs it gives for every sequence, against the reference, on valid metadata and on
every kind of invalid one (offsets out of order, not starting at 0 or not ending at the total, past
the total, longer than ``max_seqlen_q``, keys past the block table, page ids outside the pool); the
rows of an invalid sequence become NaN (out and LSE) and nothing else of ``out`` changes; the fault
is recorded and ``raise_if_invalid`` names the argument.
"""

import pytest
import torch
from helpers import DEVICE

from pagedflash import validate
from pagedflash.ops import metadata
from pagedflash.reference import varlen_bounds_reference

HQ, D = 3, 16


def _case(name):
    """(cu_q, cu_k, block_table or None, total_q, total_k, max_q, num_blocks, page, invalid sequences)."""
    cu_q, cu_k, table = [0, 3, 3, 10], [0, 5, 9, 20], None
    total_q, total_k, max_q, blocks, page = 10, 20, 7, 0, 0
    paged = name.startswith("paged")
    if paged:
        cu_k, table, blocks, page = [0, 5, 9, 41], [[0, 1, 2], [3, 4, 5], [6, 7, 8]], 9, 16
    edit = {
        "valid": lambda: None, "paged valid": lambda: None,
        "q decreasing": lambda: cu_q.__setitem__(1, 5),  # [0, 5), [5, 3), [3, 10): all three overlap or invert
        "q not from 0": lambda: cu_q.__setitem__(0, 1),
        "q short of the total": lambda: cu_q.__setitem__(3, 9),
        "q past the total": lambda: cu_q.__setitem__(3, 12),
        "q longer than max_seqlen_q": lambda: None,
        "k decreasing": lambda: cu_k.__setitem__(2, 4),
        "k negative": lambda: cu_k.__setitem__(0, -2),
        "k past the total": lambda: cu_k.__setitem__(3, 25),
        "paged keys past the table": lambda: cu_k.__setitem__(3, 9 + 49),
        "paged id -1": lambda: table[2].__setitem__(1, -1),
        "paged id past the pool": lambda: table[0].__setitem__(0, 9),
        "paged unused id out of range": lambda: (cu_k.__setitem__(3, 9 + 20), table[2].__setitem__(2, -7)),
    }[name]
    edit()
    if name == "q longer than max_seqlen_q":
        max_q = 6
    invalid = {"valid": set(), "paged valid": set(), "q decreasing": {0, 1, 2}, "q not from 0": {0, 1, 2},
               "q short of the total": {0, 1, 2}, "q past the total": {0, 1, 2},
               "q longer than max_seqlen_q": {0, 1, 2},
               "k decreasing": {0, 1, 2}, "k negative": {0}, "k past the total": {2},
               "paged keys past the table": {2}, "paged id -1": {2}, "paged id past the pool": {0},
               "paged unused id out of range": set()}[name]
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return t(cu_q), t(cu_k), None if table is None else t(table), total_q, total_k, max_q, blocks, page, invalid


CASES = ["valid", "q decreasing", "q not from 0", "q short of the total", "q past the total",
         "q longer than max_seqlen_q", "k decreasing", "k negative", "k past the total", "paged valid",
         "paged keys past the table", "paged id -1", "paged id past the pool", "paged unused id out of range"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("with_lse", [True, False])
def test_pairs_nan_rows_and_faults(name, with_lse):
    cu_q, cu_k, table, total_q, total_k, max_q, blocks, page, invalid = _case(name)
    validate.invalid_metadata(DEVICE)  # a clean record
    base = torch.randn(total_q, HQ, D + 5, device=DEVICE)
    out = base[..., :D]  # strided rows; the pad must stay
    lse = torch.randn(HQ, total_q, device=DEVICE) if with_lse else None
    before, before_base, before_lse = out.clone(), base.clone(), None if lse is None else lse.clone()
    pairs_q, pairs_k = metadata.varlen_bounds(cu_q, cu_k, table, out, lse, total_k=total_k, max_seqlen_q=max_q,
                                              num_blocks=blocks, page_size=page)
    want_q, want_k, want_invalid = varlen_bounds_reference(cu_q.cpu(), cu_k.cpu(), None if table is None else table.cpu(),
                                                           total_q=total_q, total_k=total_k, max_seqlen_q=max_q,
                                                           num_blocks=blocks, page_size=page)
    assert want_invalid == invalid
    assert [tuple(p) for p in pairs_q.tolist()] == want_q and [tuple(p) for p in pairs_k.tolist()] == want_k
    nan_rows = set()
    for b in invalid:  # the rows each invalid sequence names, within the output
        lo, hi = int(cu_q[b]), int(cu_q[b + 1])
        nan_rows |= set(range(max(lo, 0), min(max(hi, lo), total_q)))
    cq = cu_q.tolist()
    if not (cq[0] == 0 and cq[-1] == total_q and all(0 <= b - a <= max_q for a, b in zip(cq[:-1], cq[1:]))):
        nan_rows = set(range(total_q))  # cu_seqlens_q invalid as a whole: every row
    for r in range(total_q):
        if r in nan_rows:
            assert out[r].isnan().all() and (lse is None or lse[:, r].isnan().all())
        else:
            assert torch.equal(out[r], before[r]) and (lse is None or torch.equal(lse[:, r], before_lse[:, r]))
    assert torch.equal(base[..., D:], before_base[..., D:])
    messages = validate.invalid_metadata(DEVICE)
    assert bool(messages) == bool(invalid)
    if invalid:
        assert any(m.startswith(("cu_seqlens_q", "cu_seqlens_k", "block_table")) for m in messages)
        assert any(f"sequence {b}" in m for m in messages for b in invalid), messages
    validate.raise_if_invalid(DEVICE)  # the record was cleared


def test_raise_if_invalid_names_the_argument_then_clears():
    cu_q, cu_k, table, total_q, total_k, max_q, blocks, page, _ = _case("paged id -1")
    out = torch.zeros(total_q, HQ, D, device=DEVICE)
    metadata.varlen_bounds(cu_q, cu_k, table, out, None, total_k=total_k, max_seqlen_q=max_q, num_blocks=blocks,
                           page_size=page)
    with pytest.raises(ValueError, match=r"block_table: page ids must be in \[0, num_blocks\).*sequence 2"):
        validate.raise_if_invalid()
    validate.raise_if_invalid()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_bad_descale_makes_every_row_nan(bad, which):
    # the Gluon kernel would use it as given: a zero or negative scale gives plausible numbers
    cu_q, cu_k, table, total_q, total_k, max_q, blocks, page, _ = _case("paged valid")
    scales = {"k": torch.ones(2, device=DEVICE), "v": torch.ones(2, device=DEVICE)}
    scales[which][1] = bad
    out, lse = torch.zeros(total_q, HQ, D, device=DEVICE), torch.zeros(HQ, total_q, device=DEVICE)
    pairs_q, pairs_k = metadata.varlen_bounds(cu_q, cu_k, table, out, lse, total_k=total_k, max_seqlen_q=max_q,
                                              num_blocks=blocks, page_size=page, k_descale=scales["k"],
                                              v_descale=scales["v"])
    assert pairs_q.eq(0).all() and pairs_k.eq(0).all()
    assert out.isnan().all() and lse.isnan().all()
    ok = torch.ones(1, device=DEVICE)  # a per-tensor scale of 1: valid
    out.zero_()
    pairs_q, _ = metadata.varlen_bounds(cu_q, cu_k, table, out, None, total_k=total_k, max_seqlen_q=max_q,
                                        num_blocks=blocks, page_size=page, k_descale=ok, v_descale=None)
    assert not out.isnan().any() and pairs_q.tolist() == [[0, 3], [3, 3], [3, 10]]


def test_a_fault_buffer_first_made_under_inference_mode_clears_outside_it(monkeypatch):
    # an engine's first launch runs under torch.inference_mode; the record is read and cleared outside
    monkeypatch.setattr(validate, "_fault_buffers", {})
    cu_q, cu_k, table, total_q, total_k, max_q, blocks, page, _ = _case("paged id -1")
    with torch.inference_mode():
        metadata.varlen_bounds(cu_q, cu_k, table, torch.zeros(total_q, HQ, D, device=DEVICE), None, total_k=total_k,
                               max_seqlen_q=max_q, num_blocks=blocks, page_size=page)
    with pytest.raises(ValueError, match="block_table"):
        validate.raise_if_invalid(DEVICE)
    validate.raise_if_invalid(DEVICE)
