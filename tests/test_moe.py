"""The fused MoE layer (pagedflash.ops.moe) against its fp32 references (moe_route_ref, fused_moe_ref).

Under the interpreter: decode sizes (T = 1, 3, 17, 64) and a prefill size (T = 300), 8 experts with
top 2 and 16 with top 4, hidden and intermediate sizes that are no multiple of any block; every
tensor a view into a NaN-padded buffer with a NaN expert after the last, so a load past a row, a
column or an expert shows as NaN; outputs from NaN-poisoned ``torch.empty``. Compiled on a GPU
(``-m gpu``): bf16 at the same sizes and the Qwen3-30B-A3B / GPT-OSS-20B layer shapes.
"""

import json

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, ids, randn

from pagedflash import reference as ref
from pagedflash import validate
from pagedflash.ops import custom_ops, moe
from pagedflash.testing import capture_graph

GPU_DTYPES = [torch.bfloat16, torch.float16]
H, I = 88, 40  # not multiples of any block (BK 64/128, BN 32/64/128)


def padded(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """``t`` as a view into a NaN buffer: every dim ``pad`` longer (an extra expert, row, column)."""
    buf = torch.full([n + pad for n in t.shape], float("nan"), dtype=t.dtype, device=t.device)
    view = buf[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


def make_layer(E, h, i, dtype, activation):
    """Weights scaled so that the activations stay of order one; NaN-padded views."""
    w13 = padded(randn(E, 2 * i, h, dtype=torch.float32).div(h ** 0.5).to(dtype))
    w2 = padded(randn(E, h, i, dtype=torch.float32).div(i ** 0.5).to(dtype))
    biases = {}
    if activation == "swigluoai":
        biases = dict(w13_bias=padded(randn(E, 2 * i, dtype=dtype)), w2_bias=padded(randn(E, h, dtype=dtype)))
    return w13, w2, biases


def make_ids(T, E, k, how):
    """Expert ids ``[T, k]`` (distinct per token): ``routed`` from random logits, ``all`` every expert
    hit (round robin), ``some_empty`` only the first half of the experts."""
    if how == "routed":
        return moe.route(randn(T, E), k)
    if how == "all":
        ids_ = (torch.arange(T * k, device=DEVICE).view(T, k) + torch.arange(T, device=DEVICE)[:, None]) % E
    else:
        ids_ = torch.stack([torch.randperm(E // 2, device=DEVICE)[:k] for _ in range(T)])
    weights = torch.softmax(randn(T, k), dim=-1)
    return weights, ids_.to(torch.int32)


def check_moe(T, E, k, dtype, activation, how, *, h=H, i=I):
    x = padded(randn(T, h, dtype=dtype))
    w13, w2, biases = make_layer(E, h, i, dtype, activation)
    weights, ids_ = make_ids(T, E, k, how)
    got = moe.fused_moe(x, w13, w2, weights, ids_, activation=activation, **biases)
    assert got.shape == (T, h) and got.dtype == dtype
    assert_close(got, ref.fused_moe_ref(x, w13, w2, weights, ids_, activation=activation, **biases), dtype)
    return x, w13, w2, weights, ids_, biases, got


# (T, E, k, activation, ids): decode sizes (T = 1 and 3: the gemv tiles, direct grouping; 17 and 64:
# the tensor-core tiles, sorted), prefill T = 300 on both expert counts
CASES = [
    (1, 16, 4, "silu", "routed"),
    (1, 8, 2, "swigluoai", "routed"),
    (3, 16, 4, "swigluoai", "some_empty"),
    (3, 8, 2, "silu", "all"),
    (17, 16, 4, "silu", "all"),
    (17, 8, 2, "swigluoai", "some_empty"),
    (64, 8, 2, "silu", "some_empty"),
    (64, 16, 4, "swigluoai", "routed"),
    (300, 8, 2, "swigluoai", "all"),
    (300, 16, 4, "silu", "some_empty"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("T,E,k,activation,how", CASES, ids=lambda v: str(v))
def test_fused_moe(T, E, k, activation, how, dtype):
    check_moe(T, E, k, dtype, activation, how)


# forced tiles of each launch form (tools/tune_moe.py's candidates) on a case each: the fused sum
# (direct and over sorted blocks), 16-wide column blocks, reduction steps deeper than H, more
# stages, partials in the input dtype with other prefill tiles, one-row matrix-vector products, and
# the default tile from 256 rows an expert (CASES stay below it)
TILE_FORMS = {
    "fused_direct_bn16": (moe.Tiles(True, 16, 16, 16, 128, 4, 4, 1, fused_sum=True), (1, 16, 4, "silu", "routed")),
    "fused_direct_bk256": (moe.Tiles(True, 16, 16, 32, 256, 2, 5, 1, fused_sum=True),
                           (3, 16, 4, "swigluoai", "some_empty")),
    "fused_sorted": (moe.Tiles(False, 16, 32, 64, 64, 4, 3, 1, fused_sum=True), (17, 8, 2, "swigluoai", "all")),
    "direct_bn16_bk256": (moe.Tiles(True, 16, 16, 16, 256, 2, 5, 1), (3, 8, 2, "silu", "all")),
    "part_in_dtype_bm32": (moe.Tiles(False, 32, 64, 32, 32, 4, 3, 4, part_fp32=False), (64, 16, 4, "silu", "some_empty")),
    "part_in_dtype_bm64": (moe.Tiles(False, 64, 16, 128, 64, 8, 2, 2, part_fp32=False),
                           (40, 8, 2, "swigluoai", "routed")),
    "gemv_bn8": (moe.Tiles(True, 1, 8, 8, 64, 4, 3, 1, fused_sum=True, gemv=True), (1, 16, 4, "swigluoai", "routed")),
    "gemv_bn4_bk256": (moe.Tiles(True, 1, 16, 4, 256, 4, 3, 1, fused_sum=True, gemv=True), (3, 8, 2, "silu", "all")),
    "gemv_wide": (moe.Tiles(True, 1, 8, 8, 64, 4, 3, 1, fused_sum=True, gemv=True, wide=True),
                  (1, 16, 4, "swigluoai", "routed")),
    "gemv_wide_bk256": (moe.Tiles(True, 1, 16, 4, 256, 4, 1, 1, fused_sum=True, gemv=True, wide=True),
                        (3, 8, 2, "silu", "all")),
    # programmatic dependent launch (compiled on sm90+; elsewhere the plain launches)
    "gemv_wide_pdl_l2": (moe.Tiles(True, 1, 8, 8, 64, 4, 3, 1, fused_sum=True, gemv=True, wide=True, pdl=2),
                         (3, 16, 4, "swigluoai", "routed")),
    "fused_pdl": (moe.Tiles(True, 16, 16, 32, 64, 4, 2, 1, fused_sum=True, pdl=1), (5, 16, 4, "silu", "some_empty")),
    "default_prefill_bm128": (moe.tiles(4096, 2, 8), (40, 8, 2, "swigluoai", "routed")),  # 1024 rows an expert
}


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("form", TILE_FORMS)
def test_tile_forms(monkeypatch, form, dtype):
    tiles, (T, E, k, activation, how) = TILE_FORMS[form]
    monkeypatch.setattr(moe, "TILES", tiles)
    check_moe(T, E, k, dtype, activation, how)


@pytest.mark.skipif(ON_GPU, reason="compiled, the fused sum may fuse a multiply and an add (one fma)")
def test_fused_sum_same_arithmetic(monkeypatch):
    """Under the interpreter the fused sum gives the bits of the partials and _sum_k_kernel (same tiles)."""
    x, (w13, w2, biases) = randn(5, H), make_layer(8, H, I, torch.float32, "swigluoai")
    weights, ids_ = make_ids(5, 8, 2, "routed")
    tiles = moe.Tiles(True, 16, 32, 32, 64, 4, 2, 1)
    got = []
    for fused in (False, True):
        monkeypatch.setattr(moe, "TILES", tiles._replace(fused_sum=fused))
        got.append(moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", **biases))
    assert torch.equal(*got)


@pytest.mark.parametrize("form", ["direct", "sorted", "fused_sum"])
def test_both_groupings_agree(monkeypatch, form):
    """The same call through each grouping form and the fused sum (forced tiles), duplicates of an
    expert in one token included; results match the reference and are bit-identical across calls
    and id dtypes."""
    monkeypatch.setattr(moe, "TILES", moe.Tiles(form != "sorted", 16, 32, 32, 32, 4, 2, 2, form == "fused_sum"))
    x, w13, w2, _ = randn(5, H), *make_layer(4, H, I, torch.float32, "silu")
    weights = torch.softmax(randn(5, 3), dim=-1)
    ids_ = torch.tensor([[0, 0, 1], [3, 2, 1], [1, 1, 1], [2, 0, 3], [3, 3, 0]], dtype=torch.int32, device=DEVICE)
    got = moe.fused_moe(x, w13, w2, weights, ids_)
    assert_close(got, ref.fused_moe_ref(x, w13, w2, weights, ids_), torch.float32)
    assert torch.equal(got, moe.fused_moe(x, w13, w2, weights, ids_))
    assert torch.equal(got, moe.fused_moe(x, w13, w2, weights, ids_.long()))  # int64 ids too


def test_grouping_layout(monkeypatch):
    """Grouped slots: each expert's pairs in one run padded to the block (any order within it), pad
    slots P, invalid ids in a run of their own (expert E), blocks past the end -1."""
    monkeypatch.setattr(moe, "TILES", moe.Tiles(False, 2, 32, 32, 32, 4, 2, 1))
    ids_ = torch.tensor([[2, 0], [2, 5], [-1, 2]], dtype=torch.int32, device=DEVICE)  # E = 4: 5, -1 invalid
    x, w13, w2, _ = randn(3, 16), *make_layer(4, 16, 8, torch.float32, "silu")
    plan = moe._plan(x, w13, w2, torch.ones(3, 2, device=DEVICE), ids_, None, None, moe.SILU, None)
    assert plan.num_blocks == 6  # cdiv(P + min(E + 1, P) * (BM - 1), BM): E runs and one of invalid ids
    sorted_ids, block_expert, block_start, block_slots = moe._group(plan, ids_, 6, 4, 2, *ids_.stride())
    assert block_expert.tolist() == [0, 2, 2, 4, -1, -1]
    assert block_start.tolist()[:4] == [0, 2, 4, 6] and block_slots.tolist()[:4] == [2, 2, 2, 2]
    runs = [sorted(sorted_ids[a:b].tolist()) for a, b in [(0, 2), (2, 6), (6, 8)]]
    assert runs == [[1, 6], [0, 2, 5, 6], [3, 4]]  # slots past the last run are never read


def test_grouping_layout_with_half_tails(monkeypatch):
    """Half tails: runs padded to half a block; a run's last block holds half a block's slots where
    they hold its pairs; blocks start where their run's previous block ends."""
    monkeypatch.setattr(moe, "TILES", moe.Tiles(False, 32, 32, 32, 32, 4, 2, 1, half=True))
    counts = {0: 16, 1: 0, 2: 17, 3: 40, 4: 33}  # expert -> pairs; 4 = E: invalid ids (-1)
    flat = [e if e < 4 else -1 for e, c in counts.items() for _ in range(c)]
    ids_ = torch.tensor(flat, dtype=torch.int32, device=DEVICE).view(-1, 2)  # P = 106, k = 2
    P = ids_.numel()
    x, w13, w2, _ = randn(P // 2, 16), *make_layer(4, 16, 8, torch.float32, "silu")
    plan = moe._plan(x, w13, w2, torch.ones(P // 2, 2, device=DEVICE), ids_, None, None, moe.SILU, None)
    sorted_ids, block_expert, block_start, block_slots = moe._group(plan, ids_, P, 4, 2, *ids_.stride())
    used = int((block_expert >= 0).sum())
    # runs padded to 16: 16, 0, 32, 48, 48 slots; blocks of 32 (16 for a run's odd tail)
    assert block_expert.tolist()[:used] == [0, 2, 3, 3, 4, 4] and set(block_expert.tolist()[used:]) <= {-1}
    assert block_start.tolist()[:used] == [0, 16, 48, 80, 96, 128]
    assert block_slots.tolist()[:used] == [16, 32, 32, 16, 32, 16]
    for e, (a, b) in zip([0, 2, 3, 4], [(0, 16), (16, 48), (48, 96), (96, 144)]):
        got = sorted_ids[a:b].tolist()
        pairs = sorted(i for i in got if i < P)
        assert pairs == [i for i, v in enumerate(flat) if (v if v >= 0 else 4) == e]
        assert got.count(P) == (b - a) - counts[e]


HALF = moe.Tiles(False, 32, 32, 32, 32, 4, 2, 2, half=True)


def test_half_tails_agree_with_whole_blocks(monkeypatch):
    """The same call with half tails and without: equal to the reference, and each form's rows equal
    to the other's (a pair's sums do not depend on its block's height). The routing gives runs of 40,
    17, 9 and 0 pairs: a whole block then a half tail, a whole block, a half block alone, none."""
    E, k, T = 4, 2, 33
    counts = [40, 17, 9, 0]
    flat = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)], dtype=torch.int32)
    ids_ = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))].view(T, k).to(DEVICE)
    x, (w13, w2, biases) = randn(T, H), make_layer(E, H, I, torch.float32, "swigluoai")
    weights = torch.softmax(randn(T, k), dim=-1)
    got = []
    for half in (False, True):
        monkeypatch.setattr(moe, "TILES", HALF._replace(half=half))
        got.append(moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", **biases))
    plan = moe._plan(x, w13, w2, weights, ids_, *biases.values(), moe.SWIGLUOAI, None)
    _, block_expert, _, block_slots = moe._group(plan, ids_, T * k, E, k, *ids_.stride())
    used = block_expert >= 0
    assert block_expert[used].tolist() == [0, 0, 1, 2] and block_slots[used].tolist() == [32, 16, 32, 16]
    assert_close(got[1], ref.fused_moe_ref(x, w13, w2, weights, ids_, activation="swigluoai", **biases), torch.float32)
    assert torch.equal(*got)


FUSED_SUM = moe.Tiles(True, 16, 16, 32, 64, 4, 2, 1, fused_sum=True)
GEMV = moe.Tiles(True, 1, 64, 128, 128, 4, 2, 1, fused_sum=True, gemv=True)
GEMV_WIDE = GEMV._replace(wide=True)


def test_gemv_needs_its_form(monkeypatch):
    monkeypatch.setattr(moe, "TILES", GEMV._replace(fused_sum=False))
    x, (w13, w2, _), (weights, ids_) = randn(3, H), make_layer(4, H, I, torch.float32, "silu"), make_ids(3, 4, 2, "routed")
    with pytest.raises(ValueError, match="moe.TILES: gemv=True goes with direct=True, fused_sum=True and bm=1"):
        moe.fused_moe(x, w13, w2, weights, ids_)
    monkeypatch.setattr(moe, "TILES", FUSED_SUM._replace(part_fp32=False))
    with pytest.raises(ValueError, match="moe.TILES: part_fp32=False has no partials to keep with fused_sum=True"):
        moe.fused_moe(x, w13, w2, weights, ids_)
    monkeypatch.setattr(moe, "TILES", GEMV._replace(fused_sum=False, gemv=False, pdl=1))
    with pytest.raises(ValueError, match="moe.TILES: pdl goes with fused_sum=True"):
        moe.fused_moe(x, w13, w2, weights, ids_)
    monkeypatch.setattr(moe, "TILES", FUSED_SUM._replace(wide=True))
    with pytest.raises(ValueError, match="moe.TILES: wide=True goes with gemv=True"):
        moe.fused_moe(x, w13, w2, weights, ids_)


@pytest.mark.parametrize("T,tiles", [(1, None), (17, None), (17, FUSED_SUM), (17, GEMV), (17, GEMV_WIDE), (17, HALF)],
                         ids=["direct", "sorted", "fused_sum", "gemv", "gemv_wide", "half_tails"])
def test_invalid_ids_give_nan_rows(monkeypatch, T, tiles):
    """Value checks off: an id outside [0, E) reads no weight (the next expert in memory is NaN, and
    so would be a read past it), its token's row is NaN and every other row is right; the debug mode
    refuses the call on the host, naming the argument."""
    monkeypatch.setattr(moe, "TILES", tiles)
    E, k = 8, 2
    x, (w13, w2, biases) = randn(T, H), make_layer(E, H, I, torch.float32, "swigluoai")
    weights, ids_ = make_ids(T, E, k, "routed")
    bad_rows = [0] if T == 1 else [0, 5, 16]
    for row, value in zip(bad_rows, [E, -1, 2**31 - 1]):
        ids_[row, row % k] = value
    got = moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", **biases)
    want = ref.fused_moe_ref(x, w13, w2, weights, ids_, activation="swigluoai", **biases)
    assert got[bad_rows].isnan().all()
    good = [t for t in range(T) if t not in bad_rows]
    assert_close(got[good], want[good], torch.float32)
    with validate.value_checks(True), pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 8\)"):
        moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", **biases)


@pytest.mark.parametrize("tiles", [None, FUSED_SUM, GEMV, GEMV_WIDE, HALF],
                         ids=["default", "fused_sum", "gemv", "gemv_wide", "half_tails"])
def test_invalid_ids_are_recorded(monkeypatch, tiles):
    """The last token with an expert id outside [0, E) is recorded; raise_if_invalid names topk_ids
    and clears the record."""
    monkeypatch.setattr(moe, "TILES", tiles)
    x, (w13, w2, _), (weights, ids_) = randn(3, H), make_layer(4, H, I, torch.float32, "silu"), make_ids(3, 4, 2, "routed")
    ids_[1, 0] = 9
    validate.invalid_metadata(DEVICE)  # clear
    got = moe.fused_moe(x, w13, w2, weights, ids_)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()
    assert validate.fault_buffer(DEVICE)[validate.FAULT_TOPK_IDS].item() == 1
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, E\).*token 1"):
        validate.raise_if_invalid(DEVICE)
    validate.raise_if_invalid(DEVICE)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
@pytest.mark.parametrize("pdl", [1, 2])
def test_pdl_in_a_cuda_graph(monkeypatch, pdl):
    """The down kernel as gate/up's programmatic dependent (where the GPU has it), captured in a CUDA
    graph and replayed on new inputs: the eager call's bits."""
    monkeypatch.setattr(moe, "TILES", moe.tiles(2, 4, 16)._replace(pdl=pdl))
    dtype = torch.bfloat16
    x = randn(2, H, dtype=dtype)
    w13, w2, biases = make_layer(16, H, I, dtype, "swigluoai")
    weights, ids_ = make_ids(2, 16, 4, "routed")
    out = torch.empty_like(x)
    graph, _ = capture_graph(lambda: moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", out=out,
                                                   **biases))
    for seed in range(3):
        x.copy_(randn(2, H, dtype=dtype))
        graph.replay()
        want = moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", **biases)
        assert torch.equal(out, want), seed


def test_out_and_operator():
    """``out`` (a strided view) is written and returned; the operator path (dispatcher) gives the same
    bits; an ``out`` that overlaps an input is refused; T = 0 returns an empty result."""
    x, (w13, w2, _), (weights, ids_) = randn(6, H), make_layer(8, H, I, torch.float32, "silu"), make_ids(6, 8, 2, "routed")
    out = padded(torch.zeros(6, H, device=DEVICE))
    assert moe.fused_moe(x, w13, w2, weights, ids_, out=out) is out
    assert_close(out, ref.fused_moe_ref(x, w13, w2, weights, ids_), torch.float32)
    previous = custom_ops.dispatch_eager(True)
    try:
        assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids_), out)
    finally:
        custom_ops.dispatch_eager(previous)
    with pytest.raises(ValueError, match="out: shares memory with hidden"):
        moe.fused_moe(x, w13, w2, weights, ids_, out=x)
    empty = moe.fused_moe(x[:0], w13, w2, weights[:0], ids_[:0])
    assert empty.shape == (0, H)


def test_compiled_is_bit_identical():
    """route + fused_moe under ``torch.compile(fullgraph=True)`` (traced on fake tensors through the
    operator's fake): no graph break, the eager bits; the operator passes ``torch.library.opcheck``
    (schema, fake kernel, mutation of out)."""
    x, (w13, w2, biases), logits = randn(5, H), make_layer(8, H, I, torch.float32, "swigluoai"), randn(5, 8)

    def layer(x, logits):
        weights, ids_ = moe.route(logits, 2, scoring="topk_softmax")
        return moe.fused_moe(x, w13, w2, weights, ids_, activation="swigluoai", **biases)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x, logits), layer(x, logits))
    weights, ids_ = moe.route(logits, 2)
    torch.library.opcheck(torch.ops.pagedflash.fused_moe.default,
                          (x, w13, w2, weights, ids_, biases["w13_bias"], biases["w2_bias"], moe.SWIGLUOAI, 1.702, 7.0,
                           torch.zeros(5, H, device=DEVICE)))


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", True)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_route(scoring, renormalize, with_bias):
    # fp16 logits, distinct in each row (ties: tests/test_moe_routing.py)
    logits = (torch.stack([torch.randperm(16, device=DEVICE) for _ in range(37)]) * 0.5 - 4).to(torch.float16)
    bias = randn(16) if with_bias else None
    weights, ids_ = moe.route(logits, 4, scoring=scoring, renormalize=renormalize, bias=bias)
    want_w, want_ids = ref.moe_route_ref(logits, 4, scoring=scoring, renormalize=renormalize, bias=bias)
    assert weights.dtype == torch.float32 and ids_.dtype == torch.int32 and ids_.shape == (37, 4)
    assert torch.equal(ids_, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)  # a GPU's exp and division are approximate
    if scoring == "topk_softmax" or renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37, device=DEVICE))


def _bad_calls():
    x, (w13, w2, b), (w, i) = randn(3, 16), make_layer(4, 16, 8, torch.float32, "swigluoai"), make_ids(3, 4, 2, "routed")

    def call(**kw):
        args = dict(hidden=x, w13=w13, w2=w2, topk_weights=w, topk_ids=i) | kw
        return lambda: moe.fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_weights"),
                                     args.pop("topk_ids"), **args)

    yield call(hidden=x[0]), ValueError, r"hidden: expected a 2-D tensor"
    yield call(hidden=x.long()), TypeError, r"hidden: expected dtype in"
    yield call(hidden=x[:, :0]), ValueError, r"hidden: expected at least one column"
    yield call(w13=w13[:, :, :8]), ValueError, r"w13: expected shape \(\*, \*, 16\)"
    yield call(w13=w13[:, :15]), ValueError, r"w13: expected \[E, 2I, H\] .* even 2I"
    yield call(w2=w2[:, :, :4]), ValueError, r"w2: expected shape \(4, 16, 8\)"
    yield call(w2=w2.half()), TypeError, r"w2: expected dtype torch.float32 \(the dtype of hidden\)"
    yield call(topk_weights=w.half()), TypeError, r"topk_weights: expected dtype in \['torch.float32'\]"
    yield call(topk_weights=torch.ones(3, 5, device=DEVICE)), ValueError, r"topk_weights: expected between 1 and E = 4"
    yield call(topk_ids=i.float()), TypeError, r"topk_ids: expected dtype in"
    yield call(topk_ids=i[:, :1]), ValueError, r"topk_ids: expected shape \(3, 2\)"
    yield call(w13_bias=b["w13_bias"]), ValueError, r"w13_bias, w2_bias: expected both or neither"
    yield call(**b), ValueError, r"w13_bias: expert biases go with activation='swigluoai'"
    yield call(activation="gelu"), ValueError, r"activation: expected one of"
    yield call(activation="swigluoai", limit=float("inf")), ValueError, r"limit: expected a finite number"
    yield call(out=torch.zeros(3, 15, device=DEVICE)), ValueError, r"out: expected shape \(3, 16\)"
    yield lambda: moe.route(x, 0), ValueError, r"top_k: expected an int in \[1, 16\]"
    yield lambda: moe.route(x, 17), ValueError, r"top_k: expected an int in \[1, 16\]"
    yield lambda: moe.route(x, 2, scoring="sigmoid"), ValueError, r"scoring: expected one of"
    yield lambda: moe.route(x, 2, bias=randn(15)), ValueError, r"bias: expected shape \(16,\)"
    yield lambda: moe.route(x.long(), 2), TypeError, r"router_logits: expected dtype in"


@pytest.mark.parametrize("case", range(21))
def test_input_validation(case):
    calls = list(_bad_calls())
    assert len(calls) == 21
    fn, error, match = calls[case]
    with pytest.raises(error, match=match):
        fn()


def test_bench_quick(monkeypatch, tmp_path):
    """``pagedflash bench moe --quick``: the benchmark's plumbing on tiny shapes (checked; wall-clock
    times, no figures): the decode rows' clean-L2 columns where the run zeroes L2, none under ``--flush
    read``, whose own columns are the clean-L2 ones; the decode rows' stacked-layer columns in both; the
    prefill rows' ratio to dense timed in turn."""
    from pagedflash import cli
    from pagedflash.bench import common

    monkeypatch.setattr(common, "_TIMING", dict(common._TIMING))  # --flush read must not outlive the test

    assert cli.main(["bench", "moe", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "moe.json").read_text())["tables"]["moe"]["rows"]
    decode = [r for r in rows if r["T"] == 1]
    assert decode and all(r["clean_ms"] > 0 and r["clean_pct_bound"] > 0 and r["clean_speedup"] > 0 for r in decode)
    assert decode and all(r["stack_ms"] > 0 and r["stack_pct_bound"] > 0 for r in decode)
    assert all("clean_ms" not in r and "stack_ms" not in r for r in rows if r["T"] > 1)  # prefill sizes: no bound
    prefill = [r for r in rows if r["T"] > 4]  # QUICK's decode_max
    assert prefill and all(r["vs_dense_rounds"] > 0 and "-" in r["vs_dense_spread"] for r in prefill)
    summary = json.loads((tmp_path / "moe.json").read_text())["summary"]
    assert all(summary[f"{name}_vs_dense_largest_T_rounds"] > 0 for name in ("tiny_silu", "tiny_swiglu"))
    assert cli.main(["bench", "moe", "--quick", "--flush", "read", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "moe.json").read_text())
    assert all("clean_ms" not in r for r in doc["tables"]["moe"]["rows"])
    assert all(r["stack_ms"] > 0 for r in doc["tables"]["moe"]["rows"] if r["T"] == 1)
    assert "clean L2" not in doc["tables"]["moe"]["note"]


# ---------------------------------------------------------------------------------------------- GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="compiled GPU run")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("T,E,k,activation,how", CASES, ids=lambda v: str(v))
def test_fused_moe_gpu(T, E, k, activation, how, dtype):
    check_moe(T, E, k, dtype, activation, how)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("form", TILE_FORMS)
def test_tile_forms_gpu(monkeypatch, form, dtype):
    """Each launch form compiled (16-wide column and 16-row blocks for tl.dot included)."""
    test_tile_forms(monkeypatch, form, dtype)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [1, 4, 16, 64, 1000, 4096])
@pytest.mark.parametrize("shape", ["qwen3_30b_a3b", "gpt_oss_20b"])
def test_fused_moe_gpu_real_shapes(T, shape):
    """The benchmark's layer shapes in bf16: every tile form (direct, sorted decode, prefill)."""
    h, i, E, k, activation = {"qwen3_30b_a3b": (2048, 768, 128, 8, "silu"),
                              "gpt_oss_20b": (2880, 2880, 32, 4, "swigluoai")}[shape]
    check_moe(T, E, k, torch.bfloat16, activation, "routed", h=h, i=i)


def test_stages_fit_the_shared_memory():
    """Stages are cut to a block's shared memory (a stage: one K step of the rows and of the wider
    GEMM's columns), never below 1, and left alone off the GPU; sm90's 227 KB keeps every tile's."""
    for T, k, E in [(1, 8, 128), (4, 8, 128), (64, 4, 32), (1024, 2, 8), (8192, 8, 128), (8192, 4, 32)]:
        t = moe.tiles(T, k, E)
        assert moe.fit_stages(t, 2, None) == t and moe.fit_stages(t, 2, 227 * 1024) == t
        small = moe.fit_stages(t, 2, 99 * 1024)
        stage = 2 * t.bk * (t.bm + max(2 * t.bn13, t.bn2))
        assert small._replace(stages=t.stages) == t and 1 <= small.stages <= t.stages
        assert small.stages == 1 or small.stages * stage <= 0.9 * 99 * 1024
    assert moe.fit_stages(moe.tiles(8192, 8, 128), 2, 99 * 1024).stages == 1  # the 128-row prefill tile
    assert moe.fit_stages(moe.tiles(8192, 8, 128), 2, 16 * 1024).stages == 1  # never 0
