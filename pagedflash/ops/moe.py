"""Fused mixture-of-experts layer: routing, token grouping by expert, and the expert MLP as two
grouped GEMMs (issue 33). Dimensions: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``I`` an
expert's intermediate size, ``k`` = ``top_k`` experts per token, ``P = T * k`` (token, slot) pairs.
This module holds the launch choices (:func:`tiles`) and the public API; the kernels live in
:mod:`pagedflash.ops.moe_kernels`, routing and the grouping kernels in
:mod:`pagedflash.ops.moe_routing` (``route`` is re-exported here).

- :func:`route`: router logits ``[T, E]`` -> ``(weights fp32 [T, k], ids int32 [T, k])`` in one
  kernel (the bias, softmax, top k and normalization fused; equal logits: lowest expert index first).
- :func:`fused_moe`: ``sum_j w[t, j] * expert_{ids[t, j]}(x_t)`` in three kernels:

  1. ``_gate_up_kernel``: for a block of ``BM`` pairs routed to one expert, ``x W_gate^T`` and
     ``x W_up^T`` (two accumulators over the same rows of ``x``), the biases and the activation
     fused; writes the intermediate ``[P, I]`` in the input dtype.
  2. ``_down_kernel``: the intermediate times ``W2^T`` (plus bias) times the pair's routing weight,
     written per pair into ``[P, H] = [T, k, H]`` partials, fp32 (or the input dtype:
     ``Tiles.part_fp32`` False): no atomics, so results are reproducible.
  3. ``_sum_k_kernel``: each token's ``k`` rows summed in fixed order in fp32, stored in ``out``.

  or, with ``Tiles.fused_sum`` (few tokens), in two: ``_down_sum_kernel`` replaces 2 and 3, one
  program per (token, column block) summing the token's ``k`` expert outputs in fixed order in
  fp32 and storing the row in ``out``'s dtype. ``Tiles.gemv`` (with the fused sum and direct
  grouping): one-row blocks, each product a matrix-vector product on the CUDA cores, not ``tl.dot``;
  ``Tiles.wide`` keeps each program's partial sums per element along K, reduced once after its loop
  (the down-and-sum kernel then scales each expert's row by its routing weight first: one
  accumulator for the token's ``k`` experts, their biases added after the loop).

Grouping (which pairs a block of rows holds) has two forms, chosen on the host from the shapes
(:func:`tiles`), never from device values:

- *direct* (few pairs, decode): block ``m`` is pair ``m`` alone; its expert id is read by the kernel.
  No grouping launch at all; an expert picked by two pairs is read twice (from L2 when the programs
  run together). One token always has distinct experts; a few tokens (the gemv tiles, up to
  :data:`GEMV_MAX_TOKENS`) read an expert they share once a pair.
- *sorted*: pairs grouped by expert (:func:`.moe_routing.group`: three small kernels), each
  expert's run padded to a multiple of ``BM``; block ``m`` holds ``BM`` slots of one expert (pad
  slots hold the sentinel ``P``). The padded length is bounded on the host by ``P + min(E + 1, P) *
  (BM - 1)``; blocks past the device's true end have expert ``-1`` and their programs return at once, so empty experts
  cost one early exit per program slot. With ``Tiles.half`` runs are padded to ``BM / 2``: a run's
  last block may hold ``BM / 2`` slots, and its programs run a tile of ``BM / 2`` rows (the kernels
  hold both tiles; the grouping writes each block's first slot and slots).

Invalid expert ids (outside ``[0, E)``, possible only with value checks off: the debug mode
:func:`pagedflash.validate.value_checks` refuses them on the host) read no weight: their pair's
contribution is NaN, so the token's output row is NaN, and the token is recorded in the fault
buffer (``validate.FAULT_TOPK_IDS``: :func:`pagedflash.validate.raise_if_invalid` names it). Pad
rows of a block read ``x``'s row 0 (or the intermediate's) and are never stored; every ragged edge
along ``H`` and ``I`` is masked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedflash import batch_invariance, validate
from pagedflash.ops import custom_ops, moe_routing
from pagedflash.ops.moe_kernels import _down_kernel, _down_sum_kernel, _gate_up_kernel, _sum_k_kernel
from pagedflash.ops.moe_routing import SCORINGS, route  # noqa: F401  (the layer's API: routing, then fused_moe)
from pagedflash.ops.utils import (
    Launch,
    PlanCache,
    cdiv,
    check_operand,
    interpreted,
    next_pow2,
    nvidia_capability,
    shared_memory,
)

ACTIVATIONS = {"silu": 0, "swigluoai": 1}  # name -> the kernels' ACT constexpr
SILU, SWIGLUOAI = 0, 1
_IDS_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- launch choices


class Tiles(NamedTuple):
    """One call's launch choices: grouping form, rows per block, the two GEMMs' column and
    reduction blocks, warps and pipeline stages; how the down GEMM's per-pair outputs are summed."""

    direct: bool
    bm: int
    bn13: int  # columns of gate (and as many of up) per program
    bn2: int
    bk: int
    warps: int
    stages: int
    group_m: int
    fused_sum: bool = False  # down GEMM and sum over k in one kernel (per token: for few tokens)
    part_fp32: bool = True  # per-pair partials fp32, else the input dtype (half the traffic); unfused only
    gemv: bool = False  # products on the CUDA cores, not tl.dot (with direct, fused_sum and bm 1: one row)
    wide: bool = False  # gemv: [bk, bn] accumulators, reduced along K once after the loop (both GEMMs)
    # fused sum on sm90+: the down-and-sum kernel launched as gate/up's programmatic dependent (its
    # launch and start overlap gate/up's tail); 2: it also asks for its first experts' weights in L2
    # before it waits (PDL_L2_BYTES of them)
    pdl: int = 0
    # sorted: a run's last block of bm // 2 slots (where they hold its pairs) runs a tile of bm // 2
    # rows, so each expert's rows are padded to bm // 2, not bm
    half: bool = False


TILES: Tiles | None = None  # forced tiles (tests, tuning)
GEMV_MAX_TOKENS = 4  # up to here the gemv tiles (measured at 1 and 4 tokens)
DECODE_MAX_TOKENS = 64  # up to here, or while experts average <= 16 rows, the decode tiles


def tiles(T: int, top_k: int, E: int, invariant: bool = False) -> Tiles:
    """Launch choices from the host's shapes (no device value); ``rows = T * top_k / E`` is the
    average number of rows an expert gets:

    - direct grouping up to :data:`GEMV_MAX_TOKENS` tokens (one token's experts are distinct; an
      expert a few tokens share is read again, from L2) or while pairs are at most a quarter of the
      experts (few experts picked twice), else sorted;
    - up to :data:`GEMV_MAX_TOKENS` tokens: products on the CUDA cores (the gemv form: one pair a
      program, 4 gate and 4 up columns, 1024-deep steps, 3 stages, wide accumulators) and the down GEMM
      summing each token's top-k outputs itself (fused sum, 8 columns a program), direct grouping;
    - more decode tokens (``T <= DECODE_MAX_TOKENS`` or ``rows <= 16``: weight-bandwidth bound):
      16-row blocks (the smallest ``tl.dot``), 32-wide column blocks so that even one token spreads each expert's
      weight over many programs, 128-deep reduction steps, 4 stages to keep weight bytes in flight;
    - prefill: 64-row blocks (128 from 256 rows per expert), 64-deep steps, per-pair partials in the
      input dtype (half the traffic of fp32); on the 128-row tiles 8 warps, 4 stages, 128 gate + 128
      up columns and 256 down columns and half tails (an expert's last 64 rows in a 64-row tile),
      else 3 stages, 64 + 64 and 128; programs grouped 8 row blocks at a time over the column blocks
      (L2 reuse of the rows).
    Stages are then cut to what the GPU's shared memory holds (:func:`fit_stages`).
    ``tools/tune_moe.py`` times candidate tiles against these (the measurements behind each choice:
    docs/performance.md v38, v42, v44, v53); :data:`TILES` is the override.

    ``invariant`` (batch-invariant mode): one tile for every ``T``, so that a pair's sums run in the
    same order whatever the other tokens (the grouping moves a pair between blocks and rows, which
    does not change its arithmetic)."""
    if TILES is not None:
        return TILES
    direct = T == 1 or T * top_k * 4 <= E
    if invariant:
        return Tiles(direct, 64, 64, 128, 64, 4, 3, 8)
    if T <= GEMV_MAX_TOKENS:
        return Tiles(True, 1, 4, 8, 1024, 4, 3, 1, fused_sum=True, gemv=True, wide=True)
    rows = T * top_k / E
    if T <= DECODE_MAX_TOKENS or rows <= 16:
        return decode_tiles(direct)
    if rows >= 256:
        return Tiles(False, 128, 128, 256, 64, 8, 4, 8, part_fp32=False, half=True)
    return Tiles(False, 64, 64, 128, 64, 4, 3, 8, part_fp32=False)


PDL_L2_BYTES = 16 << 20  # Tiles.pdl 2: the down weights a call asks for in L2 ahead, at most


def pdl_allowed(device: torch.device) -> bool:
    """Whether launches on ``device`` may use programmatic dependent launch: an NVIDIA GPU from sm90,
    or a CPU compiling for one (the compile check); never the interpreter."""
    if interpreted():
        return False
    capability = nvidia_capability(device)
    return device.type != "cuda" if capability is None else capability >= (9, 0)


SHARED_MEMORY_USE = 0.9  # of a block's shared memory, the operand pipeline's share (the rest: epilogues)


def fit_stages(t: Tiles, itemsize: int, shared_memory: int | None) -> Tiles:
    """``t`` with as many stages as ``shared_memory`` bytes a block hold (:data:`SHARED_MEMORY_USE`
    of them; a stage: one K step of a block's rows and of the wider GEMM's weight columns, gate and up
    together), at least 1; ``t`` as it is where ``shared_memory`` is None (off the GPU). Stages change
    no arithmetic: the same bits on every GPU. The tiles of :func:`tiles` keep their stages in sm90's
    227 KB; in ~99 KB a block (sm86/89/120) the 128-row prefill tiles get 1 stage, the others keep
    theirs (estimated: no such GPU has run them)."""
    if shared_memory is None:
        return t
    stage = itemsize * t.bk * (t.bm + max(2 * t.bn13, t.bn2))
    return t._replace(stages=max(1, min(t.stages, int(shared_memory * SHARED_MEMORY_USE) // stage)))


def decode_tiles(direct: bool) -> Tiles:
    """The tensor-core decode tiles of :func:`tiles` (``GEMV_MAX_TOKENS + 1`` to ``DECODE_MAX_TOKENS``
    tokens, and past them while experts average at most 16 rows)."""
    return Tiles(direct, 16, 32, 32, 128, 4, 4, 1)


# ---------------------------------------------------------------- host


def _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, out) -> None:
    check_operand("hidden", hidden, (None, None))
    T, H = hidden.shape
    if H < 1:
        raise ValueError(f"hidden: expected at least one column (H), got shape {tuple(hidden.shape)}")
    check_operand("w13", w13, (None, None, H), like=("hidden", hidden))
    E, two_i = w13.shape[0], w13.shape[1]
    if E < 1 or two_i < 2 or two_i % 2:
        raise ValueError(f"w13: expected [E, 2I, H] with E >= 1 and an even 2I >= 2 (gate rows, then up), "
                         f"got shape {tuple(w13.shape)}")
    I = two_i // 2
    check_operand("w2", w2, (E, H, I), like=("hidden", hidden))
    check_operand("topk_weights", topk_weights, (T, None), dtypes=(torch.float32,))
    k = topk_weights.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"topk_weights: expected between 1 and E = {E} columns (top_k), got shape "
                         f"{tuple(topk_weights.shape)}")
    if topk_weights.device != hidden.device:
        raise ValueError(f"topk_weights: expected a tensor on {hidden.device} (where hidden is), "
                         f"got one on {topk_weights.device}")
    validate.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_IDS_DTYPES, device=hidden.device)
    if tuple(topk_ids.shape) != (T, k):
        raise ValueError(f"topk_ids: expected shape {(T, k)} (topk_weights'), got {tuple(topk_ids.shape)}")
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("w13_bias, w2_bias: expected both or neither, got "
                         f"{'w13_bias' if w2_bias is None else 'w2_bias'} alone")
    if w13_bias is not None:
        if activation != SWIGLUOAI:
            raise ValueError("w13_bias: expert biases go with activation='swigluoai' (GPT-OSS), got activation='silu'")
        check_operand("w13_bias", w13_bias, (E, two_i), like=("hidden", hidden))
        check_operand("w2_bias", w2_bias, (E, H), like=("hidden", hidden))
    if out is not None:
        check_operand("out", out, (T, H), like=("hidden", hidden))
        validate.check_out_separate(out, dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights,
                                              topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias))
    validate.check_no_grad(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, w13_bias=w13_bias,
                           w2_bias=w2_bias)


class _Plan(NamedTuple):
    tiles: Tiles
    grouping: moe_routing.Grouping  # its num_blocks: pairs (direct) or the padded bound / bm (sorted)
    gate_up: Launch
    down: Launch  # _down_sum_kernel with tiles.fused_sum, else _down_kernel
    sum_k: Launch  # grid None with tiles.fused_sum

    @property
    def num_blocks(self) -> int:
        return self.grouping.num_blocks


def _plan(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, out,
          invariant: bool = False) -> _Plan:
    """Check the operands (all the checks read is in the plan's key) and work out the launches."""
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, out)
    T, H = hidden.shape
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    P = T * k
    t = fit_stages(tiles(T, k, E, invariant), hidden.element_size(), shared_memory(hidden.device))
    if t.gemv and not (t.direct and t.fused_sum and t.bm == 1):
        raise ValueError(f"moe.TILES: gemv=True goes with direct=True, fused_sum=True and bm=1, got {t}")
    if t.wide and not t.gemv:
        raise ValueError(f"moe.TILES: wide=True goes with gemv=True, got {t}")
    if t.pdl and not t.fused_sum:
        raise ValueError(f"moe.TILES: pdl goes with fused_sum=True, got {t}")
    if t.half and (t.direct or t.bm < 32):
        raise ValueError(f"moe.TILES: half=True goes with sorted grouping and bm >= 32 (the half tile a tl.dot), got {t}")
    if t.fused_sum and not t.part_fp32:
        raise ValueError(f"moe.TILES: part_fp32=False has no partials to keep with fused_sum=True, got {t}")
    pdl = t.pdl if pdl_allowed(hidden.device) else 0
    pf_k = min(k, PDL_L2_BYTES // max(1, T * H * I * w2.element_size())) if pdl == 2 else 0  # a call's total
    num_blocks = P if t.direct else moe_routing.sorted_blocks(P, E, t.bm)
    consts = dict(HAS_BIAS=w13_bias is not None, DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
                  BM=t.bm, BK=t.bk)
    grouped = dict(SORTED=not t.direct, GROUP_M=t.group_m, HALF=t.half)
    opts = dict(num_warps=t.warps, num_stages=t.stages)
    nothing = T == 0
    gate_up = Launch(_gate_up_kernel, None if nothing else (num_blocks * cdiv(I, t.bn13),),
                     dict(consts, **grouped, ACT=activation, EVEN_K=H % t.bk == 0, BN=t.bn13, USE_DOT=not t.gemv,
                          NUM_STAGES=t.stages, WIDE=t.wide, PDL=pdl > 0),
                     **opts)
    down_consts = dict(consts, EVEN_K=I % t.bk == 0, BN=t.bn2, FAULT=_fault_code(), NUM_STAGES=t.stages)
    if t.fused_sum:
        down = Launch(_down_sum_kernel, None if nothing else (T * cdiv(H, t.bn2),),
                      dict(down_consts, USE_DOT=not t.gemv, BLOCK_TOPK=next_pow2(k), WIDE=t.wide, PDL=pdl, PF_K=pf_k,
                           PF_LINES=next_pow2(cdiv(I * w2.element_size(), 128))),
                      **opts, **({"launch_pdl": True} if pdl else {}))
    else:
        down = Launch(_down_kernel, None if nothing else (num_blocks * cdiv(H, t.bn2),),
                      dict(down_consts, **grouped), **opts)
    block_h = min(1024, next_pow2(H))
    sum_k = Launch(_sum_k_kernel, None if nothing or t.fused_sum else (T, cdiv(H, block_h)), dict(BLOCK_H=block_h))
    grouping = moe_routing.plan_grouping(P, E, t.bm, num_blocks, launch=not (nothing or t.direct), half=t.half)
    return _Plan(t, grouping, gate_up, down, sum_k)


_PLANS = PlanCache()


def _launch(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, alpha: float,
            limit: float, out, batch_invariant: bool = False) -> None:
    key = _PLANS.key(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, out,
                     extra=(activation, TILES, _fault_code(), batch_invariant))
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias,
                                                    activation, out, batch_invariant))
    if validate.value_checks_enabled(topk_ids):
        _check_ids(topk_ids, w13.shape[0])
    T, H = hidden.shape
    if T == 0:
        return
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    P = T * k
    t = plan.tiles
    id0, id1 = topk_ids.stride()
    if t.direct:
        grouped = (topk_ids,) * 4  # unread
    else:
        grouped = _group(plan, topk_ids, P, E, k, id0, id1)
    inter = torch.empty((P, I), dtype=hidden.dtype, device=hidden.device)
    faults = validate.fault_buffer(hidden.device)  # before gate/up: a first call's fill launches here
    b13 = w13 if w13_bias is None else w13_bias
    b2 = w2 if w2_bias is None else w2_bias
    plan.gate_up(hidden, w13, b13, *grouped, topk_ids, inter,
                 P, H, I, E, k, plan.num_blocks,
                 hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), id0, id1, alpha, limit)
    w2_strides = (w2.stride(0), w2.stride(1), b2.stride(0), topk_weights.stride(0), topk_weights.stride(1), id0, id1)
    if t.fused_sum:
        plan.down(inter, w2, b2, topk_weights, topk_ids, out, faults, T, H, I, E, k, out.stride(0), *w2_strides)
        return
    part = torch.empty((P, H), dtype=torch.float32 if t.part_fp32 else hidden.dtype, device=hidden.device)
    plan.down(inter, w2, b2, topk_weights, *grouped, topk_ids, part, faults,
              P, H, I, E, k, plan.num_blocks, *w2_strides)
    plan.sum_k(part, out, H, k, out.stride(0))


def _group(plan: _Plan, topk_ids, P: int, E: int, k: int, id0: int, id1: int) -> moe_routing.Grouped:
    """The plan's pairs grouped by expert (:func:`.moe_routing.group`)."""
    return moe_routing.group(plan.grouping, topk_ids, P, E, k, id0, id1)


def _fault_code() -> int:
    """The fault buffer's entry for invalid expert ids (a plan keeps it: tests may move it)."""
    return validate.FAULT_TOPK_IDS


def _check_ids(topk_ids: torch.Tensor, E: int) -> None:
    """The debug mode's value check (reads the device)."""
    if topk_ids.numel() and bool(((topk_ids < 0) | (topk_ids >= E)).any()):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        raise ValueError(f"topk_ids: expected expert ids in [0, {E}) (E, w13's first dim), got ids in [{lo}, {hi}]")


_op = custom_ops.implement("fused_moe", _launch)


def _activation(activation) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
              out: torch.Tensor | None = None, batch_invariant: bool | None = None) -> torch.Tensor:
    """The experts' MLP of a mixture-of-experts layer, weighted and summed per token.

    hidden ``[T, H]`` fp16/bf16/fp32; w13 ``[E, 2I, H]`` (gate rows ``0..I-1``, up rows ``I..2I-1``:
    vLLM's layout), w2 ``[E, H, I]``, both in hidden's dtype (last dim contiguous, other strides
    free); topk_weights fp32 ``[T, k]`` and topk_ids int32/int64 ``[T, k]`` (from :func:`route`).
    Returns ``[T, H]`` in hidden's dtype (``out``, written and returned, if given)::

        sum_j topk_weights[t, j] * (act(x W_gate[e]^T + b_gate, x W_up[e]^T + b_up) W2[e]^T + b2[e]),  e = topk_ids[t, j]

    activation ``"silu"``: ``silu(g) * u`` (Mixtral, Qwen3-MoE; no biases). ``"swigluoai"`` (GPT-OSS):
    ``g = min(g, limit); u = clamp(u, -limit, limit); (u + 1) * g * sigmoid(alpha * g)``, with
    optional biases w13_bias ``[E, 2I]`` (gate then up) and w2_bias ``[E, H]``, both or neither.
    The activation is rounded to hidden's dtype (the intermediate); each pair's weighted output is
    fp32 at decode sizes and in batch-invariant mode, rounded to hidden's dtype at prefill sizes
    (``Tiles.part_fp32``: :func:`tiles`); the sum over k is fp32. No host sync (CUDA-graph safe). An id outside ``[0, E)`` makes its
    token's row NaN (refused on the host in the debug mode ``validate.value_checks(True)``).
    ``batch_invariant``: each token's row the same bits whatever the other tokens (one tile for every
    T: :func:`tiles`); None: the process-wide default (:mod:`pagedflash.batch_invariance`)."""
    act = _activation(activation)
    alpha, limit = _finite("alpha", alpha), _finite("limit", limit)
    if custom_ops.via_operator():
        _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, out)
    if out is None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, out)  # says what is wrong
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    elif isinstance(out, torch.Tensor):  # programs write out while others still read the inputs
        validate.check_out_separate(out, dict(hidden=hidden, w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias))
    _op(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, alpha, limit, out,
        batch_invariance.resolve(batch_invariant))
    return out
