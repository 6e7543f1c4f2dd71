"""Prefill on Hopper (sm90): when a call takes the Gluon kernel (:mod:`pagedflash.ops.prefill_hopper_kernel`),
and its launch.

:func:`pagedflash.flash_attn_func` launches that kernel instead of the portable one
(:mod:`pagedflash.ops.attention`) where :func:`refusal` finds nothing against it: an NVIDIA GPU of
compute capability 9.0, compiled (not interpreted), Triton 3.6's Gluon, fp16/bf16, a head dim and
sizes where it measured faster (:data:`MIN_SEQLEN`), no window, softcap or sinks, 16-byte aligned
operands. :func:`pagedflash.flash_attn_varlen_func` over packed K/V or a paged cache of
:data:`PAGE_SIZES` does too where :func:`refusal_varlen` finds nothing, K/V in q's dtype or in fp8
(with their descales); it ignores ``num_splits``,
which never changes a result. Everything else, and every call with ``PAGEDFLASH_GLUON=0``, takes
the portable kernel, which stays the tested fallback.

In the batch-invariant mode (:mod:`pagedflash.batch_invariance`) the kernel's own variant
(``INVARIANT``: the mode's key tiles, 64 or 128 keys, and split rule, the portable kernel's EXACT softmax step,
finalize and merge) takes the same calls, with 16-bit or fp8 K/V (fp8 unless :data:`INVARIANT_FP8` is
off): a row gets the portable kernel's bits, so which kernel runs a call never changes a row.
``PAGEDFLASH_INVARIANT_GLUON=0`` sends the mode's calls to the portable kernel.

A varlen launch is preceded by :func:`pagedflash.ops.metadata.varlen_bounds`, which checks the
``cu_seqlens`` and page ids on the device and hands the kernel each sequence's rows, none for an
invalid sequence (NaN output, a recorded fault). A signature's launches after its first go through
the plan's fast handle (:mod:`pagedflash.ops.fastlaunch`), as the portable kernel's do.

Measured on an H200 (bf16, 16K tokens a launch, Hq·D = 2048, against the portable kernel and cuDNN
in the same run): docs/performance.md, v20, v22 (persistent), v23 (varlen, paged), v24 (fp8 K/V) and v25 (two loaders,
fp16 dots for fp8 K/V, launches of fewer work items than SMs).
"""

from __future__ import annotations

import os
import warnings

import torch

from pagedflash.ops import attention_plan, fastlaunch, launch, metadata
from pagedflash.ops import prefill_hopper_kernel as kernel
from pagedflash.ops._jit import LOG2E
from pagedflash.ops.attention_launch import ensure_tma_allocator
from pagedflash.ops.prefill_hopper_kernel import BLOCK_M, BLOCK_N, INVARIANT_BLOCK_N, UNAVAILABLE
from pagedflash.ops.utils import PlanCache, cdiv, descriptor_aligned, num_sms, nvidia_capability
from pagedflash.validate import FP8_DTYPES

# PAGEDFLASH_GLUON=0 sends every call to the portable kernel (tests flip this flag too).
ENABLED = os.environ.get("PAGEDFLASH_GLUON", "1") != "0"
# PAGEDFLASH_INVARIANT_GLUON=0 sends the batch-invariant mode's calls to the portable kernel (the same bits)
INVARIANT_ENABLED = os.environ.get("PAGEDFLASH_INVARIANT_GLUON", "1") != "0"
# The variant over fp8 K/V (a q shift a row, the descales in the portable kernel's order; rows bit for bit the
# portable kernel's, tests/test_prefill_hopper_invariant.py). False sends the mode's fp8 calls to the portable
# kernel. Invalid input excepted: one head's bad descale makes the whole call NaN here (metadata.varlen_bounds),
# that head's rows only in the portable kernel.
INVARIANT_FP8 = True

# Where the Gluon kernel measured at least as fast as the portable kernel (docs/performance.md, v22:
# bf16, B·S = 16K tokens with Sq = Sk = S in 256 .. 2K, Hq·D = 2048, at least 2048 work items a
# launch), by (head dim, causal): the shortest Sq and Sk routed. The kernel is faster in every
# measured cell, by 1.08x (D=64 non-causal 2K) to 1.57x (D=128 non-causal 256).
# Shorter lengths were not measured and stay portable; fp16 follows bf16's rule.
MIN_SEQLEN = dict.fromkeys([(128, False), (128, True), (64, False), (64, True)], 256)
# The Gluon kernel never splits the key range; the portable one does when its grid has fewer
# programs than SMs. Launches of fewer work items than SMs leave SMs idle; by head dim, the fewest
# work items a launch takes, as a share of the SMs (docs/performance.md, v25: chunked prefill of one
# sequence, 512 or 256 new tokens over 4K-64K cached, Hq = 32: at 128 items on 132 SMs the Gluon
# kernel measured 1.25-2.1x the portable one at both head dims; at 64 items 1.05-1.5x at D=128, but
# 0.6-1.0x at D=64).
MIN_PROGRAMS_PER_SM = {128: 0.45, 64: 0.95}
PAGE_SIZES = (16, 32, 64)  # paged caches the kernel reads (a copy per page of a key tile), and multiples of BLOCK_N

launches = 0  # Gluon launches so far (tests read it to see which path ran)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int,
            softcap: float, sinks: torch.Tensor | None = None, invariant: bool = False) -> str | None:
    """Why a validated dense call (:func:`pagedflash.flash_attn_func`'s operator arguments) does not
    take the Gluon kernel, or None when it does; ``invariant``: in the batch-invariant mode."""
    if not ENABLED:
        return "PAGEDFLASH_GLUON=0"
    if invariant and not INVARIANT_ENABLED:
        return "batch-invariant mode, PAGEDFLASH_INVARIANT_GLUON=0"
    if UNAVAILABLE is not None:
        return UNAVAILABLE
    batch, sq, hq, d = q.shape
    if window_right == 0 and sq > k.shape[1]:
        return "causal with Sq > Sk (rows that see no key)"
    if k.dtype in FP8_DTYPES:
        return "fp8 K/V in a dense call (the kernel takes them in varlen and paged calls)"
    return _refusal(q, k, v, batch, sq, k.shape[1], hq, k.shape[2], d, window_left, window_right, softcap, sinks,
                    invariant=invariant)


def refusal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, max_seqlen_q: int,
                   max_seqlen_k: int, block_table: torch.Tensor | None, window_left: int, window_right: int,
                   softcap: float, sinks: torch.Tensor | None = None, invariant: bool = False) -> str | None:
    """:func:`refusal` for a validated :func:`pagedflash.flash_attn_varlen_func` call, over packed K/V
    or (``block_table``) a paged cache of :data:`PAGE_SIZES`. The size rule takes the longest key
    length and, for the queries, the mean length of the sequences other than the longest: a serving
    step of one prompt's chunk and decode rows (one query over a long context each: a work item of
    one row that runs every key tile on one program) stays with the portable kernel, which packs and
    splits those rows."""
    if not ENABLED:
        return "PAGEDFLASH_GLUON=0"
    if invariant and not INVARIANT_ENABLED:
        return "batch-invariant mode, PAGEDFLASH_INVARIANT_GLUON=0"
    if UNAVAILABLE is not None:
        return UNAVAILABLE
    if block_table is not None:
        page = k.shape[1]
        if not (page in PAGE_SIZES or (page > 0 and page % BLOCK_N == 0)):
            return f"page size {page} (the kernel takes {PAGE_SIZES} or multiples of {BLOCK_N})"
    others = max(q.shape[0] - max_seqlen_q, 0) // (batch - 1) if batch > 1 else q.shape[0]
    return _refusal(q, k, v, batch, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[-2], q.shape[2], window_left,
                    window_right, softcap, sinks, typical_q=others, invariant=invariant)


def _refusal(q, k, v, batch: int, sq: int, sk: int, hq: int, hkv: int, d: int, window_left: int, window_right: int,
             softcap: float, sinks, typical_q: int | None = None, invariant: bool = False) -> str | None:
    causal = window_right == 0
    min_len = MIN_SEQLEN.get((d, causal))
    if min_len is None:
        return f"head dim {d} (routed: {sorted({dim for dim, _ in MIN_SEQLEN})})"
    if sk == 0:
        return "no keys"
    rule_q = sq if typical_q is None else typical_q
    if min(rule_q, sk) < min_len:  # first among the rest: the common refusal (short prefill chunks) costs least
        return f"Sq={rule_q}, Sk={sk}: under the measured {min_len} for D={d}{' causal' if causal else ''}"
    if q.dtype not in (torch.bfloat16, torch.float16) or v.dtype != k.dtype or k.dtype not in (q.dtype, *FP8_DTYPES):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (fp16 or bf16 q, K/V in q's dtype or one fp8 dtype)"
    if window_left != -1 or window_right not in (-1, 0):
        return f"window ({window_left}, {window_right})"
    if softcap:
        return "softcap"
    if sinks is not None:
        return "attention sinks"
    if nvidia_capability(q.device) != (9, 0):
        return f"device {q.device} is not an NVIDIA sm90 GPU"
    if hkv == 0 or hq % hkv:
        return f"Hq={hq} not a multiple of Hkv={hkv}"
    # varlen: items counted at the longest sequence's length (the lengths are on the device)
    n_items, sms = cdiv(sq, BLOCK_M) * hq * batch, num_sms(q.device)
    if n_items < MIN_PROGRAMS_PER_SM[d] * sms:
        return f"{n_items} work items on {sms} SMs (the portable kernel splits the keys)"
    bn = _invariant_variant(d)[2] if invariant else BLOCK_N
    if n_items >= 2**31 - sms or cdiv(n_items, max(int(0.85 * sms), 1)) * cdiv(sk, bn) >= 2**31:
        return "a program's work items or key tiles past int32"  # its ring index (programs() >= 85 % of sms, or n_items)
    for name, t in (("q", q), ("k", k), ("v", v)):  # what a TMA descriptor takes
        if t.stride(-1) != 1 or min(t.stride()) <= 0 or not descriptor_aligned(t):
            return f"{name}: strides {t.stride()} / address not 16-byte multiples"
    if invariant:
        if k.dtype in FP8_DTYPES and not INVARIANT_FP8:
            return "fp8 K/V in batch-invariant mode (INVARIANT_FP8)"
        return _invariant_variant(d)[1]
    return None


_VARIANTS: dict = {}  # _invariant_variant's answers by head dim and the launch table's switches


def _invariant_variant(d: int) -> tuple[launch.SplitRule, str | None, int]:
    """The batch-invariant mode's split rule at head dim ``d``, why the mode's prefill tile refuses the
    kernel's variant (None: it takes it) and the tile's keys, kept by the launch table's switches."""
    key = (d, attention_plan.launch_switches(True))
    known = _VARIANTS.get(key)
    if known is None:
        tile = launch.invariant_config(group=1, head_dim=d, capability=(9, 0), interpreted=False, prefill=True)
        why = None
        if tile.block_n not in INVARIANT_BLOCK_N or tile.block_m != 16 * tile.num_warps or tile.num_warps % 4:
            why = (f"the batch-invariant tile ({tile.block_m} rows, {tile.block_n} keys, {tile.num_warps} warps): the "
                   f"kernel's variant runs {' or '.join(map(str, INVARIANT_BLOCK_N))}-key tiles, 16 rows a warp of a "
                   f"warpgroup")
        known = _VARIANTS[key] = (launch.invariant_split_rule(False, d), why, tile.block_n)
    return known


def programs(n_items: int, n_m: int, causal: bool, sms: int, sq: int, sk: int, bn: int = BLOCK_N) -> int:
    """Programs of a launch over ``n_items`` work items, ``n_m`` row blocks per head. Non-causal
    items cost the same: one program per SM. A causal item costs its row block's key tiles, and how
    evenly the alternating rounds share them depends on the program count: at Sq = Sk every
    program's items pair up to ``n_m + 1`` tiles when ``n_m`` divides twice the count, and 16K rows
    of 16 heads leave the busiest of 132 programs 1.5x the mean, of 128 the mean. So a causal launch
    takes, of the counts from ``sms`` down to 85 % of it, the one whose busiest program ends first
    (the largest on a tie), stopping where even a perfect share of a smaller count could not.
    ``bn``: the launch's key tile."""
    if n_items <= sms:
        return n_items
    if not causal:
        return sms
    tiles = torch.clamp((torch.arange(1, n_m + 1, device="cpu") * BLOCK_M + sk - sq + bn - 1) // bn,
                        min=0, max=cdiv(sk, bn)).double()  # key tiles of row block m
    t = torch.arange(n_items, device="cpu")
    cost = tiles[n_m - 1 - t % n_m]  # item t's key tiles (the kernel's _item order)
    total = cost.sum().item()
    best_p, best = sms, float("inf")
    counts = list(range(sms, max(int(0.85 * sms), 1) - 1, -1))
    step = max(1, (1 << 22) // n_items)  # counts scored at once: ~4M items' deals in memory
    for i in range(0, len(counts), step):
        if best <= total / counts[i]:
            break  # no smaller count can beat it
        p = torch.tensor(counts[i:i + step], device="cpu")[:, None]
        pid = torch.where(t // p % 2 == 0, t % p, p - 1 - t % p)  # the kernel's deal (_schedule), per count
        loads = torch.zeros(len(p), sms, dtype=torch.float64).scatter_add_(1, pid, cost.expand(len(p), -1))
        load, at = loads.max(1).values.min(0)  # the first of equal loads: the largest count
        if load.item() < best:
            best_p, best = counts[i + at.item()], load.item()
    return best_p


class _Plan:
    """A launch for one call signature: what does not depend on the tensors' addresses."""

    __slots__ = ("grid", "grid3", "consts", "options", "ints", "int_values", "descs", "failed", "slot")


_PLANS = PlanCache()


def _make_plan(q, k, v, out, causal: bool, return_lse: bool, varlen: tuple | None, block_table, k_descale,
               v_descale, rule: launch.SplitRule | None = None) -> _Plan:
    """The launch of one signature; ``rule``: the batch-invariant variant's split rule (None: mode off)."""
    page = 0 if block_table is None else k.shape[1]
    consts, options, q_block, kv_block, q_layout, kv_layout = kernel.kernel_config(
        q.shape[-1], causal, return_lse, q.dtype, varlen is not None, page, k.dtype, rule)
    plan = _Plan()
    ints = dict.fromkeys(kernel.INT_ARGS, 0)  # the strides a launch kind does not use stay 0
    for name, scale in (("stride_kds", k_descale), ("stride_vds", v_descale)):  # per KV head, or one for all
        if scale is not None and scale.numel() > 1:
            ints[name] = scale.stride(0)
    if varlen is None:  # [B, S, H, D]: host descriptors; out and LSE by sequence
        batch, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        ints.update(stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2), lse_b=hq * sq,
                    lse_h=sq)
        plan.descs = tuple((list(t.shape), list(t.stride()), block, layout)
                           for t, block, layout in ((q, q_block, q_layout), (k, kv_block, kv_layout),
                                                    (v, kv_block, kv_layout)))
    else:  # packed q [total, H, D]: the kernel makes its descriptors; out and LSE [Hq, total_q] by token
        batch, sq, sk = varlen
        hq, hkv = q.shape[1], k.shape[-2]
        # K/V by token and head: packed [total, H, D], or paged [blocks, page, H, D] (token = row of a page)
        ints.update(stride_os=out.stride(0), stride_oh=out.stride(1), lse_h=q.shape[0], stride_qt=q.stride(0),
                    stride_qh=q.stride(1), stride_kt=k.stride(-3), stride_kh=k.stride(-2), stride_vt=v.stride(-3),
                    stride_vh=v.stride(-2))
        plan.descs = None
        if block_table is not None:  # host descriptors over the caches' pages too
            ints.update(stride_kb=k.stride(0), stride_vb=v.stride(0), stride_bt=block_table.stride(0),
                        stride_bp=block_table.stride(1))
            plan.descs = tuple((list(t.shape), list(t.stride()), kv_block, kv_layout) for t in (k, v))
    ints.update(Sq=sq, Sk=sk, Hq=hq, B=batch, GROUP=hq // hkv)
    plan.ints = ints
    plan.int_values = tuple(ints.values())  # the kernel's int parameters, in its order (INT_ARGS)
    n_m = cdiv(sq, BLOCK_M)
    bn = BLOCK_N if rule is None else _invariant_variant(q.shape[-1])[2]
    plan.grid = (programs(n_m * hq * batch, n_m, causal, num_sms(q.device), sq, sk, bn),)
    plan.grid3 = (plan.grid[0], 1, 1)
    plan.slot = fastlaunch.Slot()
    plan.consts, plan.options = consts, options
    plan.failed = False
    return plan


def _descriptors(tensors, descs) -> list:
    """Host TMA descriptors over ``tensors`` from a plan's ``(shape, strides, block, layout)``."""
    return [kernel.TensorDescriptor(t, *desc) for t, desc in zip(tensors, descs)]


class Fallback(Exception):
    """The Gluon kernel failed to compile for this call's signature (warned once): the caller takes
    the portable kernel, for this call and every later one of the signature."""


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, sm_scale: float, causal: bool,
            return_lse: bool, varlen: tuple | None = None, block_table: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
            invariant: bool = False) -> torch.Tensor | None:
    """Attention of a call :func:`refusal` accepted, written into ``out``; returns the LSE
    ``[B, Hq, Sq]`` fp32 (natural log) with ``return_lse``, else None. ``varlen``: ``(cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a call :func:`refusal_varlen` accepted (q
    ``[total, H, D]``, LSE ``[Hq, total_q]``; k/v packed ``[total, H, D]``, or with ``block_table``
    the paged caches; fp8 K/V with their validated descales, fp32 ``[]``/``[1]``/``[Hkv]`` or None).
    Raises :class:`Fallback` where the kernel does not compile for the signature (the first time
    with a warning). ``invariant``: the batch-invariant variant, for a call :func:`refusal` (or
    :func:`refusal_varlen`) accepted with it."""
    global launches
    sizes = None if varlen is None else (varlen[0].shape[0] - 1, varlen[2], varlen[3])
    rule, _, block_n = _invariant_variant(q.shape[-1]) if invariant else (None, None, BLOCK_N)
    # everything a launch specializes on (refusal() has made q, k, v 16-byte aligned), so that the
    # plan's fast handle (pagedflash.ops.fastlaunch) only relaunches the kernel compiled for it
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), q.dtype, k.dtype, q.device, causal,
           return_lse, sizes, out.data_ptr() % 16, None if block_table is None else
           (block_table.stride(), block_table.data_ptr() % 16),
           *((None,) if t is None else (t.numel(), t.stride(), t.data_ptr() % 16) for t in (k_descale, v_descale)),
           rule, block_n)
    plan = _PLANS.get(key) or _PLANS.add(key, _make_plan(q, k, v, out, causal, return_lse, sizes, block_table,
                                                         k_descale, v_descale, rule))
    if plan.failed:
        raise Fallback
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    if varlen is None:  # host descriptors over q, k, v
        operands = (*_descriptors((q, k, v), plan.descs), None, None, None, None, None)
    else:
        ensure_tma_allocator()  # the kernel's descriptors live in Triton's global scratch
        # each sequence's (start, end) rows, (0, 0) where its metadata is invalid (NaN rows, a fault)
        pairs = metadata.varlen_bounds(varlen[0], varlen[1], block_table, out, lse, total_k=k.shape[0],
                                       max_seqlen_q=varlen[2], num_blocks=k.shape[0], page_size=k.shape[1],
                                       k_descale=k_descale, v_descale=v_descale)
        if block_table is None:  # the packed tensors themselves
            operands = (q, k, v, None, None, None, *pairs)
        else:  # host descriptors over the caches' pages, and the caches for the last pages'
            operands = (q, *_descriptors((k, v), plan.descs), k, v, block_table, *pairs)
    q_t, k_t, v_t, k_c, v_c, table, cu_q, cu_k = operands
    args = (q_t, k_t, v_t, k_c, v_c, table, out, out if lse is None else lse, cu_q, cu_k, k_descale, v_descale,
            sm_scale if invariant else sm_scale * LOG2E.value, *plan.int_values)
    try:
        if not fastlaunch.run(plan.slot, kernel.prefill_kernel, plan.grid3, args):
            compiled = kernel.prefill_kernel[plan.grid](*args[:13], **plan.ints, **plan.consts, **plan.options)
            fastlaunch.bind(plan.slot, kernel.prefill_kernel, compiled, plan.consts)
    except kernel.COMPILE_ERRORS as e:
        warnings.warn(f"pagedflash: the Gluon prefill kernel failed to compile ({type(e).__name__}: "
                      f"{str(e)[:200]}); this signature takes the portable kernel", stacklevel=4)
        plan.failed = True
        raise Fallback from e
    launches += 1
    return lse
