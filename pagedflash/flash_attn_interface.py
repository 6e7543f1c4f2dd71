"""flash-attn 2's function signatures, argument for argument, over pagedflash's kernels.

``from pagedflash.flash_attn_interface import flash_attn_func`` replaces
``from flash_attn import flash_attn_func`` (or ``flash_attn.flash_attn_interface``) in code that
calls it positionally or by flash-attn's keyword names: the same parameter order (``dropout_p``
fourth), defaults (``causal=False`` everywhere), return values (``return_attn_probs`` gives
``(out, softmax_lse, None)``; ``return_softmax_lse`` gives ``(out, softmax_lse)``), the packed
``qkv`` / ``kv`` variants, and ``flash_attn_with_kvcache``'s rotary embedding and
``cache_batch_idx``. pagedflash's own functions (``pagedflash.flash_attn_func`` ...) keep their
shorter signatures.

Forward only, for inference: ``dropout_p`` must be 0, ``alibi_slopes`` and ``cache_leftpad`` must
be None, and inputs that require grad are refused while autograd is on (a clear error in each
case); ``deterministic`` is accepted and changes nothing, since every pagedflash kernel is
deterministic. Bad input raises :class:`~pagedflash.validate.FlashAttnValueError` or
:class:`~pagedflash.validate.FlashAttnTypeError`: a ``ValueError``/``TypeError`` naming the argument,
and a ``RuntimeError`` too, which is what flash-attn's own checks raise and what code written for it
catches.

The rotary embedding of ``flash_attn_with_kvcache`` runs as PyTorch operations before the attention
kernel (flash-attn fuses it into its kernel), at flash-attn 2's positions and with its bounds: new
key ``t`` at ``cache_seqlens + t``; query row ``i`` at ``cache_seqlens + i`` when the call is causal
or local, else every query at ``cache_seqlens``; a window side at least the cache's length
``seqlen_k`` (``S_max``, or ``block_table`` columns x page size) is unbounded, so it does not make
the call local; ``rotary_cos``/``rotary_sin`` hold at least ``seqlen_k`` rows. flash-attn reads past
the table when a causal or local call's query rows outrun it (more queries than new keys in a nearly
full cache); pagedflash gives such rows NaN output and records a ``positions`` fault
(:func:`pagedflash.validate.raise_if_invalid`), and in the debug mode
(:func:`pagedflash.validate.value_checks`, which reads ``cache_seqlens`` from the device) raises
before launching. ``cache_batch_idx`` values are checked as a one-column block table (a row outside
``k_cache`` is a ``block_table`` fault) unless the debug mode checks them first. Two values differ
from flash-attn's:
a query row that sees no key has LSE ``-inf`` (flash-attn 2 writes ``+inf``; both are "empty" to
:func:`pagedflash.merge_attn_states`), and ``S_dmask`` is None, as in flash-attn 2.6 (2.7 returns an
empty tensor).

Two extensions beyond flash-attn 2, keyword-only in effect (they come after every flash-attn 2
parameter): attention sinks as ``learnable_sink`` (flash-attn 4's name; fp32 ``[Hq]``, see
:func:`pagedflash.flash_attn_func`'s ``sinks``) on every function, and fp8 K/V caches with
``k_descale``/``v_descale`` (flash-attn 3's names) on ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``.
"""

from __future__ import annotations

import functools

import torch

from pagedflash import validate
from pagedflash.ops.decode import flash_attn_with_kvcache as _with_kvcache
from pagedflash.ops.prefill import flash_attn_func as _dense
from pagedflash.ops.prefill import flash_attn_varlen_func as _varlen

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _runtime_errors(fn):
    """Raise bad-input errors as flash-attn's checks do, as RuntimeError: a ``ValueError`` becomes a
    :class:`~pagedflash.validate.FlashAttnValueError`, a ``TypeError`` a
    :class:`~pagedflash.validate.FlashAttnTypeError` (each both), message and traceback unchanged."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            if isinstance(e, RuntimeError):
                raise
            cls = validate.FlashAttnValueError if isinstance(e, ValueError) else validate.FlashAttnTypeError
            raise cls(*e.args).with_traceback(e.__traceback__) from None

    return call


def _inference_only(dropout_p, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: pagedflash runs the forward pass for inference, expected 0.0, got {dropout_p}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported by pagedflash, expected None")


def _returns(result, return_attn_probs: bool):
    """flash-attn returns ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs``; the attention
    probabilities exist only under dropout, so ``S_dmask`` is None as there."""
    return (*result, None) if return_attn_probs else result


def _unpack(packed: torch.Tensor, name: str, parts: int, axis: int) -> tuple[torch.Tensor, ...]:
    validate.check_tensor(name, packed)
    if packed.dim() <= axis or packed.shape[axis] != parts:
        raise ValueError(f"{name}: expected {parts} along dimension {axis} "
                         f"({'[..., 3, H, D]' if parts == 3 else '[..., 2, Hkv, D]'}), got shape {tuple(packed.shape)}")
    return packed.unbind(axis)


@_runtime_errors
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, learnable_sink=None):
    """flash-attn's ``flash_attn_func``: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``."""
    _inference_only(dropout_p, alibi_slopes)
    return _returns(_dense(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, return_lse=return_attn_probs, sinks=learnable_sink), return_attn_probs)


@_runtime_errors
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              learnable_sink=None):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv ``[B, S, 3, H, D]``."""
    q, k, v = _unpack(qkv, "qkv", 3, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink=learnable_sink)


@_runtime_errors
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             learnable_sink=None):
    """flash-attn's ``flash_attn_kvpacked_func``: q ``[B, Sq, Hq, D]``, kv ``[B, Sk, 2, Hkv, D]``."""
    k, v = _unpack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink=learnable_sink)


@_runtime_errors
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, learnable_sink=None,
                           k_descale=None, v_descale=None):
    """flash-attn's ``flash_attn_varlen_func``: packed q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``
    or, with ``block_table``, pages ``[num_blocks, page_size, Hkv, D]``; K/V may be fp8 with
    ``k_descale``/``v_descale``."""
    _inference_only(dropout_p, alibi_slopes)
    return _returns(_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                            return_lse=return_attn_probs, block_table=block_table, sinks=learnable_sink,
                            k_descale=k_descale, v_descale=v_descale), return_attn_probs)


@_runtime_errors
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, learnable_sink=None):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: qkv ``[total, 3, H, D]``."""
    q, k, v = _unpack(qkv, "qkv", 3, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink)


@_runtime_errors
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    learnable_sink=None):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q ``[total_q, Hq, D]``, kv ``[total_k, 2, Hkv, D]``."""
    k, v = _unpack(kv, "kv", 2, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[1]`` features of x ``[B, S, H, D]`` by the angles of rows
    ``positions`` ``[B, S]`` of cos/sin ``[seqlen_ro, rotary_dim / 2]``: pairs ``(2i, 2i + 1)`` when
    ``interleaved`` (GPT-J), halves ``(i, i + rotary_dim / 2)`` otherwise (GPT-NeoX). fp32 inside."""
    half = cos.shape[1]
    c = cos[positions].unsqueeze(2).float()  # [B, S, 1, half]
    s = sin[positions].unsqueeze(2).float()
    rot = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)


def _check_rotary(rotary_cos, rotary_sin, q, k, cache_seqlens, capacity: int) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if k is None:
        raise ValueError("k, v: required with rotary_cos/rotary_sin (as in flash-attn: the rotary embedding "
                         "applies to the new keys and the queries together)")
    validate.check_tensor("k", k, ndim=4, dtypes=(q.dtype,), device=q.device)
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        validate.check_tensor(name, t, ndim=2, dtypes=(q.dtype,), device=q.device)
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin: expected shape {tuple(rotary_cos.shape)} (rotary_cos's), "
                         f"got {tuple(rotary_sin.shape)}")
    if 2 * rotary_cos.shape[1] > q.shape[-1]:
        raise ValueError(f"rotary_cos: expected [seqlen_ro, rotary_dim / 2] with rotary_dim <= head dim "
                         f"{q.shape[-1]}, got shape {tuple(rotary_cos.shape)}")
    if rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos: expected at least {capacity} rows, the cache's length seqlen_k (as flash-attn "
                         f"requires), got shape {tuple(rotary_cos.shape)}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required with rotary_cos/rotary_sin (the positions to rotate at)")
    if isinstance(cache_seqlens, torch.Tensor):
        validate.check_int32_vector("cache_seqlens", cache_seqlens, length=q.shape[0], device=q.device)
    else:
        validate.check_int("cache_seqlens", cache_seqlens, minimum=0)


def _rotary_positions(q, k, cache_seqlens, rows: int, capacity: int, causal: bool, window_size):
    """Rows of rotary_cos/sin for q ``[B, Sq]`` and the new k ``[B, S_new]``, by flash-attn 2's rule
    (module doc), clamped into the table, and which query rows' positions were outside it ``[B, Sq]``
    (None where none can be: with valid lengths only causal or local rows past the new keys can)."""
    batch, sq = q.shape[:2]
    base = (torch.full((batch, 1), cache_seqlens, device=q.device) if isinstance(cache_seqlens, int)
            else cache_seqlens.long()[:, None])
    left, right = validate.check_window(window_size, causal)
    per_row = any(0 <= w < capacity for w in (left, right))  # causal (right 0) or local
    if batch and validate.value_checks_enabled(base):
        last = int(base.max()) + (sq - 1 if per_row else 0)
        if last >= rows:
            how = f"query row {sq - 1} at cache_seqlens + {sq - 1}" if per_row else "the queries at cache_seqlens"
            raise ValueError(f"rotary_cos: {rows} positions, but this {'causal or local ' if per_row else ''}call "
                             f"rotates {how} = position {last}")
    q_pos = (base + (torch.arange(sq, device=q.device) if per_row else 0)).expand(batch, sq)
    k_pos = base + torch.arange(k.shape[1], device=q.device)
    # positions outside the table: refused above; unchecked, a query row's becomes NaN (the caller's),
    # a new key's means cache_seqlens outside the cache, where nothing is written and attention is NaN
    outside = (q_pos < 0) | (q_pos >= rows) if per_row and sq > k.shape[1] else None
    return q_pos.clamp(0, rows - 1), k_pos.clamp(0, rows - 1), outside


def _poison_rows(q: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """q ``[B, Sq, H, D]`` with the rows ``bad`` ``[B, Sq]`` NaN (so are their outputs), the last
    such token (``b * Sq + i``) recorded as a ``positions`` fault, without reading ``bad`` on the host."""
    if bad.numel() == 0:  # a batch of 0: no row
        return q
    fault = validate.fault_buffer(q.device).narrow(0, validate.FAULT_POSITIONS, 1)
    token = torch.arange(bad.numel(), device=bad.device, dtype=torch.int32).view(bad.shape)
    fault.copy_(torch.maximum(fault, torch.where(bad, token, -1).amax().reshape(1)))
    return q.masked_fill(bad[:, :, None, None], float("nan"))


@_runtime_errors
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            learnable_sink=None, k_descale=None, v_descale=None):
    """flash-attn's ``flash_attn_with_kvcache``.

    Beyond :func:`pagedflash.flash_attn_with_kvcache`: ``rotary_cos``/``rotary_sin``
    ``[seqlen_ro, rotary_dim / 2]``, ``seqlen_ro >= seqlen_k``, rotate the new k at positions
    ``cache_seqlens + t`` and q at ``cache_seqlens + i`` when causal or local, else every query at
    ``cache_seqlens`` (flash-attn's rule, module doc); ``cache_batch_idx`` int32 ``[B]`` picks the
    row of a contiguous ``k_cache`` ``[B_cache, S_max, Hkv, D]`` that query row b reads and appends
    to (it runs through the paged path, one page of ``S_max`` rows per cache row). ``k_cache``/``v_cache``
    may be fp8 with ``k_descale``/``v_descale`` (flash-attn 3); ``learnable_sink`` as flash-attn 4."""
    _inference_only(0.0, alibi_slopes)
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: left-padded caches are not supported by pagedflash, expected None")
    validate.check_tensor("q", q, ndim=4, dtypes=validate.SUPPORTED_DTYPES)
    validate.check_tensor("k_cache", k_cache, ndim=4, device=q.device)
    if rotary_cos is not None or rotary_sin is not None:
        if block_table is not None:
            validate.check_tensor("block_table", block_table, ndim=2, device=q.device)
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)  # flash-attn's seqlen_k
        _check_rotary(rotary_cos, rotary_sin, q, k, cache_seqlens, capacity)
        q_pos, k_pos, q_outside = _rotary_positions(q, k, cache_seqlens, rotary_cos.shape[0], capacity, causal,
                                                    window_size)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        if q_outside is not None:
            q = _poison_rows(q, q_outside)
        k = apply_rotary(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx: not supported with block_table (a paged cache maps rows itself)")
        validate.check_int32_vector("cache_batch_idx", cache_batch_idx, length=q.shape[0], device=q.device)
        if validate.value_checks_enabled(cache_batch_idx):
            ids = cache_batch_idx.tolist()
            if ids and (min(ids) < 0 or max(ids) >= k_cache.shape[0]):
                raise ValueError(f"cache_batch_idx: expected rows in [0, {k_cache.shape[0]}) of k_cache, got {ids}")
        if cache_seqlens is None:
            cache_seqlens = k_cache.shape[1]
        block_table = cache_batch_idx.view(-1, 1)
    return _with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
                         softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                         num_splits=num_splits, return_lse=return_softmax_lse, k_descale=k_descale,
                         v_descale=v_descale, sinks=learnable_sink)
