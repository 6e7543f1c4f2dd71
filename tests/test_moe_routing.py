"""The routing kernel (pagedflash.ops.moe_routing.route) against its reference (moe_route_ref).

The ids must equal the reference's exactly (both rank ``logits + bias`` in fp32 by one rule: equal
values lowest index first, NaN as ``-inf``); the weights agree to fp32 rounding (the kernel's sums run
in another order). Every input is a view into a NaN-padded buffer, so a load past a row or past E
shows as NaN weights. Shapes: Mixtral (E 8, k 2), Qwen3-MoE (128, 8), GPT-OSS (32, 4, topk_softmax
with a router bias), an E that is no power of two (60, 6), T from 0 to 300. The operator under
``torch.compile`` and ``torch.library.opcheck``: the ``moe_route`` case of tests/compile_cases.py.
"""

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, ids, randn

from pagedflash import reference as ref
from pagedflash.ops import moe, moe_routing
from pagedflash.testing import capture_graph

# (E, k, scoring, renormalize, bias)
MODELS = {
    "mixtral": (8, 2, "softmax", True, False),
    "qwen3": (128, 8, "softmax", True, False),
    "gpt-oss": (32, 4, "topk_softmax", True, True),
    "odd-e": (60, 6, "softmax", False, False),
}
NAN = float("nan")


def padded(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """``t`` as a view into a NaN buffer ``pad`` longer in every dim (rows strided past E)."""
    buf = torch.full([n + pad for n in t.shape], NAN, dtype=t.dtype, device=t.device)
    view = buf[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


def check(logits, k, scoring="softmax", renormalize=True, bias=None):
    """route against the reference: ids equal, weights close (NaN where the reference's are);
    returns route's result."""
    weights, ids_ = moe.route(logits, k, scoring=scoring, renormalize=renormalize, bias=bias)
    want_w, want_ids = ref.moe_route_ref(logits, k, scoring=scoring, renormalize=renormalize, bias=bias)
    T, E = logits.shape
    assert weights.shape == ids_.shape == (T, k) and weights.dtype == torch.float32 and ids_.dtype == torch.int32
    assert weights.is_contiguous() and ids_.is_contiguous()
    assert torch.equal(ids_, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6, equal_nan=True)
    if T:
        assert int(ids_.min()) >= 0 and int(ids_.max()) < E
        assert (ids_.sort(-1).values.diff(dim=-1) > 0).all(), "an expert twice in a row"
    return weights, ids_


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("T", [0, 1, 3, 64, 300])
@pytest.mark.parametrize("model", list(MODELS))
def test_matches_reference(model, T, dtype):
    E, k, scoring, renormalize, with_bias = MODELS[model]
    logits = padded(randn(T, E, dtype=dtype))
    bias = padded(randn(E, dtype=dtype)) if with_bias else None
    weights, _ = check(logits, k, scoring, renormalize, bias)
    assert not weights.isnan().any()
    if renormalize or scoring == "topk_softmax":
        torch.testing.assert_close(weights.sum(-1), torch.ones(T, device=DEVICE))
    assert (weights.diff(dim=-1) <= 0).all(), "weights not in descending order"


@pytest.mark.parametrize("E,k", [(1, 1), (2, 2), (60, 60), (60, 1), (512, 16), (4096, 4)])
def test_sizes(E, k):
    """One expert, top_k = E (a full sort), top 1, and the larger expert counts (E = MAX_EXPERTS)."""
    check(padded(randn(5, E)), k)
    check(padded(randn(5, E)), k, "topk_softmax")


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", True)])
def test_strided_logits(scoring, renormalize):
    """Any strides: rows of a transposed tensor (last dim not contiguous), every other column, a
    broadcast row (stride 0): the contiguous copy's ids, and its weights' bits where they are sums
    over the k (plain softmax sums the row, in an order the compiled load's layout sets)."""
    base = randn(96, 70)
    for logits in (base.t()[:, :60], base[:40, ::2][:, :32], base[:1, :64].expand(7, 64)):
        want = moe.route(logits.contiguous(), 4, scoring=scoring, renormalize=renormalize)
        got = check(logits, 4, scoring, renormalize)
        assert torch.equal(got[1], want[1])
        if scoring == "softmax" and not renormalize:
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
        else:
            assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", True)])
@pytest.mark.parametrize("E,k", [(60, 6), (128, 8)])
def test_ties_go_to_the_lower_index(E, k, scoring, renormalize):
    """Logits of three values (most picks tie), bf16-like: the lower expert index first, as the
    reference's stable sort; a row of equal logits picks experts 0..k-1; -0.0 ties with 0.0."""
    g = torch.Generator(device=DEVICE).manual_seed(E)
    logits = padded(torch.randint(0, 3, (64, E), generator=g, device=DEVICE).float() * 0.5)
    logits[0] = 1.0
    logits[1, :] = 0.0
    logits[1, 1::2] = -0.0
    weights, ids_ = check(logits, k, scoring, renormalize)
    expected = torch.arange(k, dtype=torch.int32, device=DEVICE)
    assert torch.equal(ids_[0], expected) and torch.equal(ids_[1], expected)
    x = logits.gather(1, ids_.long())
    tied = x[:, 1:] == x[:, :-1]
    assert tied.any() and (ids_[:, 1:] > ids_[:, :-1])[tied].all()
    bias = torch.zeros(E, device=DEVICE)
    bias[E - 1] = 2.0  # the bias ranks too: the last expert first everywhere
    _, biased = check(logits, k, scoring, renormalize, bias)
    assert (biased[:, 0] == E - 1).all()


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", True)])
def test_nan_and_infinite_rows(scoring, renormalize):
    """A NaN anywhere in a row: all its k weights NaN, its ids the top k of the rest (NaN ranks as
    -inf); a row of -inf, or with +inf: NaN weights; -inf experts picked only when fewer than k are
    finite, lowest index first, weight 0. Ids stay distinct, in [0, E); the other rows are untouched."""
    E, k = 12, 4
    logits = randn(8, E)
    logits[0, 5] = NAN
    logits[1] = NAN
    logits[2] = float("-inf")
    logits[3, 7] = float("inf")
    logits[4] = float("-inf")
    logits[4, [3, 9]] = torch.tensor([1.0, 2.0], device=DEVICE)
    logits[5, :k] = float("-inf")  # never picked: enough finite ones
    weights, ids_ = check(padded(logits), k, scoring, renormalize)
    assert weights[:4].isnan().all() and not weights[4:].isnan().any()
    assert 5 not in ids_[0].tolist()
    assert ids_[1].tolist() == ids_[2].tolist() == [0, 1, 2, 3]
    assert ids_[3, 0] == 7
    assert ids_[4].tolist() == [9, 3, 0, 1]
    assert weights[4, 2:].eq(0).all()
    assert not set(ids_[5].tolist()) & set(range(k))
    nan_bias = torch.zeros(E, device=DEVICE)
    nan_bias[2] = NAN  # every row has it: every weight NaN, ids still valid
    weights, ids_ = check(padded(randn(5, E)), k, scoring, renormalize, nan_bias)
    assert weights.isnan().all() and 2 not in ids_.flatten().tolist()


@pytest.mark.parametrize("E,k", [(8, 2), (128, 8), (4096, 4)])
def test_rows_alone_equal_rows_in_a_batch(E, k):
    """A token's row has the same bits whatever the other tokens (the tile follows from E only)."""
    logits = randn(67, E)
    bias = randn(E)
    batch = moe.route(logits, k, bias=bias, renormalize=False)
    for t in (0, 1, 31, 66):
        alone = moe.route(logits[t:t + 1], k, bias=bias, renormalize=False)
        assert torch.equal(alone[0], batch[0][t:t + 1]) and torch.equal(alone[1], batch[1][t:t + 1]), t


def test_refusals():
    x = randn(3, 16)
    with pytest.raises(ValueError, match=r"router_logits: expected at most 4096 experts"):
        moe.route(randn(1, moe_routing.MAX_EXPERTS + 1), 2)
    with pytest.raises(ValueError, match=r"router_logits: requires grad"):
        moe.route(x.clone().requires_grad_(), 2)
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, 16\]"):
        moe.route(x, True)
    with pytest.raises(TypeError, match=r"bias: expected dtype in"):
        moe.route(x, 2, bias=torch.zeros(16, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_in_a_cuda_graph():
    """Captured in a CUDA graph and replayed on new logits: the eager call's bits."""
    logits = randn(64, 128, dtype=torch.bfloat16)
    graph, (weights, ids_) = capture_graph(lambda: moe.route(logits, 8))
    for seed in range(3):
        logits.copy_(randn(64, 128, dtype=torch.bfloat16))
        graph.replay()
        want = moe.route(logits, 8)
        assert torch.equal(weights, want[0]) and torch.equal(ids_, want[1]), seed
