"""Launch plans of the attention kernel: what :func:`pagedflash.ops.attention.attention_forward`
launches for a call signature (tiles, KV split count, grid, the kernel's integer arguments and
constexprs), derived from the launch table (:mod:`pagedflash.ops.launch`) once per signature.

:func:`plan_key` is the signature: everything a plan depends on, and everything Triton specializes
a launch on beyond the plan's own numbers (shapes, strides, dtypes, device, the 16-byte alignment of
every pointer, the call's integers and flags, the launch table's switches), so that one key means
one compiled kernel and :mod:`pagedflash.ops.fastlaunch` may relaunch it. Nothing in a plan depends
on the values in the tensors.
"""

from __future__ import annotations

import functools
import itertools

import torch

from pagedflash import validate
from pagedflash.ops import fastlaunch
from pagedflash.ops import launch as launch_table
from pagedflash.ops.launch import (
    LONG_KV_KEYS,
    MAX_SPLITS,
    PACK_MAX_ROWS,
    choose_config,
    choose_num_splits,
    invariant_config,
    invariant_num_splits,
    invariant_split_programs,
    invariant_split_rule,
    use_tma,
)
from pagedflash.ops.utils import (
    PlanCache,
    cdiv,
    fp8_cvt_device,
    head_stride,
    interpreted,
    next_pow2,
    num_sms,
    nvidia_capability,
)


def _bsh(strides: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch or page, token or slot, head) strides of a 4-D tensor; batch stride 0 for a 3-D one."""
    if len(strides) == 4:
        return strides[0], strides[1], strides[2]
    return 0, strides[0], strides[1]


class Plan:
    """What one signature (:func:`plan_key`) launches: tiles, split count, grid, the kernel's
    integer arguments and constexprs, the combine launch (made by the first launch, from its
    tensors), and the fast-launch slot."""

    __slots__ = ("cfg", "tma_on", "num_splits", "grid", "part_shapes", "ints", "head_strides", "window", "consts",
                 "fallback_key", "slot", "combine", "tokens_per_batch")


def _per_head(t) -> tuple | None:
    """What Triton specializes a per-head side input (``[H]`` fp32, one value per head or one for
    all) on: dtype, the stride between heads (0 for one value) and the pointer's alignment."""
    return None if t is None else (t.dtype, head_stride(t), t.data_ptr() & 15)


def plan_key(q, k, v, out, lse, device, batch, max_seqlen_q, max_seqlen_k, window, softcap, cu_seqlens_q,
             cu_seqlens_k, seqused_k, block_table, num_splits, config, sinks=None, k_descale=None,
             v_descale=None, invariant=False) -> tuple:
    """What a launch plan depends on, and every input of Triton's specialization of the launch
    beyond the plan's own numbers: shapes, strides, dtypes and device, the 16-byte alignment of
    every pointer, the integers and flags of the call, the launch table's switches, and for each
    per-head side input (``sinks``, ``k_descale``, ``v_descale``) whether it is given, its dtype,
    head stride (per head or one value) and alignment. (Fresh outputs and split partials are always
    aligned and contiguous.)"""
    return (q.shape, q.stride(), q.dtype, device, q.data_ptr() & 15,
            k.shape, k.stride(), k.dtype, k.data_ptr() & 15, v.stride(), v.dtype, v.data_ptr() & 15,
            out.stride(), out.dtype, out.data_ptr() & 15, None if lse is None else lse.stride(),
            None if cu_seqlens_q is None else (cu_seqlens_q.dtype, cu_seqlens_q.data_ptr() & 15),
            None if cu_seqlens_k is None else (cu_seqlens_k.dtype, cu_seqlens_k.data_ptr() & 15),
            None if seqused_k is None else (seqused_k.dtype, seqused_k.data_ptr() & 15),
            None if block_table is None else (block_table.dtype, block_table.stride(0), block_table.data_ptr() & 15),
            batch, max_seqlen_q, max_seqlen_k, window, softcap > 0, num_splits, config,
            None if sinks is None else _per_head(sinks), None if k_descale is None else _per_head(k_descale),
            None if v_descale is None else _per_head(v_descale), launch_switches(invariant))


def launch_switches(invariant: bool) -> tuple:
    """The launch table's switches a plan depends on (module constants that tests and tuning change)."""
    return (launch_table.TMA, launch_table.TMA_FP8, launch_table.INTERPRET_TMA,
            invariant and (launch_table.INVARIANT_SPLIT_KEYS, launch_table.INVARIANT_HEAD_KEYS,
                           launch_table.INVARIANT_HEAD_SPLIT_KEYS, launch_table.INVARIANT_MID_KEYS,
                           launch_table.INVARIANT_MID_SPLIT_KEYS, launch_table.INTERPRET_SPLIT_RULE,
                           launch_table.INVARIANT_TILE, launch_table.INVARIANT_PREFILL_TILE,
                           launch_table.INVARIANT_MAX_SPLITS, launch_table.INVARIANT_SPLIT_STATES,
                           launch_table.INVARIANT_SPLIT_WAVES, launch_table.INVARIANT_DECODE_TILE,
                           launch_table.INVARIANT_DECODE_WAVES, launch_table.INVARIANT_DECODE_WAVES_FP8,
                           launch_table.INVARIANT_DECODE_WAVES_SPLIT, launch_table.INVARIANT_COMBINE_LOADS))


checks_id = itertools.count().__next__  # a number per kept outcome of a public call's checks (public_plan_key)


def keep_checks(kept: PlanCache | None, key: tuple | None, checked: tuple, softmax_scale: float | None,
                head_dim: int) -> tuple:
    """A public call's check outcome ``checked`` with the scale the kernel takes (``softmax_scale``
    or its default) and a :func:`checks_id`, kept in ``kept`` under ``key``; a None key (torch.compile
    tracing, among others) never touches the cache: the outcome then comes with None for both. Callers
    pass None for ``kept`` with a None key, never naming their cache where torch.compile traces: Dynamo
    (torch 2.11) guards on the length of a dict it is handed, and a later eager call that filled it
    would recompile the graph."""
    if kept is None or key is None:
        return (*checked, None, None)
    return kept.add(key, (*checked, validate.check_scale(softmax_scale, head_dim), checks_id()))


def public_plan_key(entry: str, checks: int, return_lse: bool, invariant: bool) -> tuple:
    """The plan key of a public call, standing for the :func:`plan_key` of its arguments, from the
    outcome of the call's input checks kept under their key
    (:func:`pagedflash.ops.utils.checked_signature` over every tensor and scalar the call takes,
    pointer alignments included): ``checks`` is the number :func:`checks_id` gave that outcome when
    it was kept, one per key and never reused, so that a call reads and hashes its tensors'
    properties once. Valid only where everything else :func:`plan_key` reads follows from that key:
    the output and LSE fresh (contiguous, aligned, shaped from q), the call's tensors passed to
    :func:`~pagedflash.ops.attention.attention_forward` (or ``kept_forward``) as they were checked, and its sizes and
    window derived from the checked shapes and scalars alone. ``entry`` names the public function
    (a tag: two functions' keys never meet). The launch table's switches as in :func:`plan_key`."""
    return entry, checks, return_lse, invariant, launch_switches(invariant)


def make_plan(q, k, v, out, lse, *, batch, max_seqlen_q, max_seqlen_k, window, softcap, cu_seqlens_q,
              cu_seqlens_k, seqused_k, block_table, num_splits, config, sinks=None, k_descale=None,
              v_descale=None, invariant=False) -> Plan:
    """The plan of a call with these arguments (``out`` and ``lse`` as the call will write them).

    ``invariant`` (batch-invariant mode): the one tile of :func:`~pagedflash.ops.launch.invariant_config`
    unless ``config`` is given, and either no split (one program folds a row's splits) or a partial
    state per split of the longest row under the mode's :class:`~pagedflash.ops.launch.SplitRule`
    (any other count would merge partials in another order), programs sharing a row's splits
    (:func:`~pagedflash.ops.launch.invariant_split_programs`); a decode launch that splits asks for its
    tile again with ``split=True`` (:data:`~pagedflash.ops.launch.INVARIANT_DECODE_WAVES_SPLIT`)."""
    varlen_q = cu_seqlens_q is not None
    paged = block_table is not None
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    group = hq // hkv
    page_size = k.shape[1] if paged else 0
    fp8_cvt = k.element_size() == 1 and fp8_cvt_device(q.device)
    tma_ok = use_tma(k, v, paged)
    packed = max(max_seqlen_q, 1) * group <= PACK_MAX_ROWS
    wide = batch * cdiv(max(max_seqlen_q, 1) * group, PACK_MAX_ROWS) * hkv >= num_sms(q.device)
    if config is not None and (group % config.g_pack or config.block_m % config.g_pack):
        raise ValueError(f"config.g_pack: expected a divisor of the GQA group ({group}) and of block_m "
                         f"({config.block_m}), got {config.g_pack}")
    pick = functools.partial(choose_config, head_dim=d, group=group, max_seqlen_q=max_seqlen_q,
                             causal=window[1] >= 0, interpreted=interpreted(), tma=tma_ok, page_size=page_size,
                             wide=wide, kv_itemsize=k.element_size(), fp8_cvt=fp8_cvt)
    # the tile of an unsplit program; its rows and heads per tile do not depend on the key count
    rule = invariant_split_rule(interpreted(), d) if invariant else None
    if invariant:
        # decode tiles: 16-bit q over 16-bit K/V, or over fp8 converted by the instruction
        # (attention_tiles.attend_range's EXACT)
        decode_tile_kv = q.element_size() == 2 and (k.element_size() == 2 or fp8_cvt)
        tile = functools.partial(invariant_config, group=group, head_dim=d, capability=nvidia_capability(q.device),
                                 interpreted=interpreted(),
                                 prefill=max_seqlen_q > 1 and (interpreted() or q.element_size() == 2),
                                 decode_programs=batch * hkv if max_seqlen_q <= 1 and decode_tile_kv else 0,
                                 sms=num_sms(q.device), fp8=k.element_size() == 1)
        cfg = config or tile()
        if rule.keys % cfg.block_n or rule.head_split % cfg.block_n or (rule.mid_end > rule.head_keys
                                                                         and rule.mid_split % cfg.block_n):
            raise ValueError(f"config.block_n: expected a divisor of the batch-invariant splits "
                             f"({rule.head_split}, {rule.mid_split} and {rule.keys} keys), got {cfg.block_n}")
    else:
        cfg = config or pick(long_kv=max_seqlen_k >= LONG_KV_KEYS)
    block_q = cfg.block_m // cfg.g_pack
    if num_splits <= 0:
        num_splits = choose_num_splits(
            programs=batch * cdiv(max(max_seqlen_q, 1), block_q) * hkv * (group // cfg.g_pack),
            max_seqlen_k=max_seqlen_k, block_n=cfg.block_n, kv_bytes_per_key=2 * d * k.element_size(),
            decode=packed, page_size=page_size, device=q.device,
        )
    tokens = q.shape[0] if varlen_q else q.shape[0] * q.shape[1]
    if invariant and num_splits > 1:  # the mode's own cap and budget (invariant_num_splits), not MAX_SPLITS
        num_splits = invariant_num_splits(max_seqlen_k, rule, tokens * hq)
        split_programs = invariant_split_programs(
            num_splits, batch * cdiv(max(max_seqlen_q, 1), block_q) * hkv * (group // cfg.g_pack), num_sms(q.device))
        if split_programs == 1:  # one program a row: it folds the splits itself, the same bits
            num_splits = 1
        elif config is None and max_seqlen_q <= 1:  # a split decode launch may take the decode tile from fewer rows
            split_cfg = tile(split=True)
            if split_cfg.g_pack == cfg.g_pack and split_cfg.block_n == cfg.block_n:  # the same programs and splits
                cfg, block_q = split_cfg, split_cfg.block_m // split_cfg.g_pack
    else:
        num_splits = split_programs = min(num_splits, MAX_SPLITS)
        if config is None and num_splits > 1:  # a split streams fewer keys: maybe a shorter tile
            cfg = pick(long_kv=cdiv(max_seqlen_k, num_splits) >= LONG_KV_KEYS)
    if varlen_q:
        # a program a sequence where none has more rows than a tile (decode); else the tiles of
        # attention_tiles.find_seq. Either grid covers every row (invalid cu_seqlens_q: all NaN)
        one_tile = max_seqlen_q <= block_q
        num_q_tiles = 1 if one_tile else 0
        grid_q = max(batch, cdiv(tokens, block_q)) if one_tile else tokens // block_q + batch
    else:
        num_q_tiles = cdiv(q.shape[1], block_q)
        grid_q = batch * num_q_tiles
    if lse is None:
        stride_l = (0, 0, 0)
    elif varlen_q:  # [Hq, total_q]
        stride_l = (0, lse.stride(0), lse.stride(1))
    else:  # [B, Hq, Sq]
        stride_l = lse.stride()
    split = num_splits > 1

    plan = Plan()
    plan.cfg, plan.num_splits = cfg, num_splits
    plan.tma_on = cfg.tma and tma_ok and (not paged or page_size % cfg.block_n == 0)
    plan.grid = (grid_q, hkv * (group // cfg.g_pack), split_programs if split else 1) \
        if tokens > 0 and grid_q > 0 else None
    # the mode's LSE partials hold one more plane: each row's count of slots (attention._attention_kernel)
    plan.part_shapes = (((num_splits, tokens, hq, d), torch.float32),
                        ((num_splits + invariant, tokens, hq), torch.float32)) if split else None
    plan.tokens_per_batch = tokens if varlen_q else q.shape[1]
    plan.ints = (  # the kernel's integer arguments from stride_qb to num_splits (partials contiguous)
        *_bsh(q.stride()), *_bsh(k.stride()), *_bsh(v.stride()), *_bsh(out.stride()), *stride_l,
        block_table.stride(0) if paged else 0,
        *((tokens * hq * d, hq * d, d) if split else (0, 0, 0)),
        *((tokens * hq, hq) if split else (0, 0)),
        batch, q.shape[1] if not varlen_q else 0, k.shape[1] if (k.dim() == 4 and not paged) else 0,
        k.shape[0] * page_size, num_q_tiles, num_splits,
    )
    plan.head_strides = (head_stride(sinks), head_stride(k_descale), head_stride(v_descale))
    plan.window = window
    # a sequence of at most one query row sees every key below its length under any right window
    # (bottom-right aligned): no right edge to mask, the same bits (masking is a select)
    plan.consts = dict(
        GROUP=group, G_PACK=cfg.g_pack, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_M=cfg.block_m, PAGE_SIZE=page_size or 1,
        SPLIT_KV=split, VARLEN_Q=varlen_q, VARLEN_K=cu_seqlens_k is not None,
        HAS_SEQUSED=seqused_k is not None, PAGED=paged, HAS_LEFT=window[0] >= 0,
        HAS_RIGHT=window[1] >= 0 and max_seqlen_q > 1,
        HAS_SOFTCAP=softcap > 0, WRITE_LSE=lse is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_SINKS=sinks is not None,
        HAS_K_DESCALE=k_descale is not None, HAS_V_DESCALE=v_descale is not None,
        FP8_CVT=fp8_cvt, INVARIANT=invariant,
        SPLIT_N=rule.keys if rule else 1,
        HEAD_N=rule.head_split if rule else 1, HEAD_KEYS=rule.head_keys if rule else 0,
        MID_N=rule.mid_split if rule else 1, MID_KEYS=rule.mid_end if rule else 0,
    )
    plan.fallback_key = (q.dtype, k.dtype, cfg, plan.tma_on, tuple(sorted(plan.consts.items())))
    plan.slot = fastlaunch.Slot()
    plan.combine = None  # made by the first launch, from its tensors
    return plan
