"""Plain-PyTorch references for every kernel, in fp32, with the kernels' layouts and arguments.

These are the ground truth for tests and for the benchmarks' correctness checks. They are written
for clarity, not speed: they materialize the full score matrix, loop over sequences, and never
import a kernel.

Masking semantics (shared with the kernels, as in flash-attn): query ``i`` (0-based within its
sequence of length ``Sq``) may attend key ``j`` (within a sequence of length ``Sk``) iff ``j < Sk``
and, with ``delta = Sk - Sq`` (bottom-right alignment),

- ``causal``: ``j <= i + delta``
- ``window_size = (left, right)``: ``j >= i + delta - left`` if ``left >= 0`` and
  ``j <= i + delta + right`` if ``right >= 0``.

A query row that sees no key gets output 0 and LSE ``-inf``.

Attention sinks (``sinks``, fp32 ``[Hq]``, one logit per query head, as gpt-oss): the sink joins the
softmax denominator and carries no value, ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``; the
LSE is ``log(sum_k exp(s_k) + exp(sink_h))``, so a row that sees no key gets output 0 and LSE = sink.
Softcap applies to the scores, not to the sink.

FP8 caches: the real key is ``stored.float() * k_descale[head]`` (:func:`dequantize_ref`); writing
stores ``saturate(k / k_scale)`` rounded to nearest (:func:`quantize_fp8_ref`).
"""

from __future__ import annotations

import math

import torch


def _visible(sq: int, sk: int, causal: bool, window_size: tuple[int, int], device) -> torch.Tensor:
    """Boolean ``[sq, sk]``: which keys each query row may attend."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    delta = sk - sq
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i + delta - left
    if right >= 0:
        mask &= j <= i + delta + right
    return mask


def _attend(q, k, v, scale, causal, window_size, softcap, sinks=None):
    """One sequence. q ``[Sq, Hq, D]``, k/v ``[Sk, Hkv, D]`` -> out ``[Sq, Hq, D]``, lse ``[Hq, Sq]``."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    group = hq // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = _visible(sq, sk, causal, window_size, q.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Sq]; -inf for rows that see nothing
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.float().to(lse.device)[:, None])
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    p = p.masked_fill(~mask, 0.0)
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out, lse


def _scale(softmax_scale, d):
    return 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, sinks=None):
    """Dense attention. q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``.

    Returns out ``[B, Sq, Hq, D]`` fp32 and lse ``[B, Hq, Sq]`` fp32.
    """
    scale = _scale(softmax_scale, q.shape[-1])
    outs, lses = zip(*(_attend(q[b], k[b], v[b], scale, causal, window_size, softcap, sinks)
                       for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def varlen_attention_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    sinks=None,
):
    """Packed variable lengths. q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``, cu_seqlens ``[B+1]``.

    Returns out ``[total_q, Hq, D]`` fp32 and lse ``[Hq, total_q]`` fp32.
    """
    scale = _scale(softmax_scale, q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        o, l = _attend(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], scale, causal, window_size,
                       softcap, sinks)
        out[cq[b] : cq[b + 1]] = o
        lse[:, cq[b] : cq[b + 1]] = l
    return out, lse


def gather_paged(cache, block_table, seqlen: int, b: int):
    """The first ``seqlen`` tokens of sequence ``b`` from a paged cache ``[num_blocks, page, Hkv, D]``."""
    page = cache.shape[1]
    pos = torch.arange(seqlen, device=cache.device)
    blocks = block_table[b, pos // page].long()
    return cache[blocks, pos % page]


def paged_varlen_attention_ref(
    q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, *, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, sinks=None,
):
    """Varlen queries against a paged cache: sequence ``b``'s keys are its first
    ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` cached tokens, read through ``block_table[b]``."""
    ck = cu_seqlens_k.tolist()
    ks = [gather_paged(k_cache, block_table, ck[b + 1] - ck[b], b) for b in range(len(ck) - 1)]
    vs = [gather_paged(v_cache, block_table, ck[b + 1] - ck[b], b) for b in range(len(ck) - 1)]
    return varlen_attention_ref(
        q, torch.cat(ks), torch.cat(vs), cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, sinks=sinks,
    )


def kvcache_attention_ref(
    q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0, sinks=None,
):
    """Attention of q ``[B, Sq, Hq, D]`` over each row's first ``cache_seqlens[b]`` cached tokens
    (contiguous cache ``[B, S_max, Hkv, D]`` or paged with ``block_table``). New tokens must already
    be in the cache (see :func:`append_ref`). Returns out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]``."""
    scale = _scale(softmax_scale, q.shape[-1])
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            kb, vb = gather_paged(k_cache, block_table, n, b), gather_paged(v_cache, block_table, n, b)
        o, l = _attend(q[b], kb, vb, scale, causal, window_size, softcap, sinks)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def _per_head(scale, x: torch.Tensor) -> torch.Tensor:
    """A scale of one value (``[]``/``[1]``) or one per KV head (``[Hkv]``), shaped to broadcast over
    x ``[..., Hkv, D]``; None means 1."""
    if scale is None:
        return torch.ones((), device=x.device)
    scale = scale.float().to(x.device).reshape(-1)
    return scale.reshape(()) if scale.numel() == 1 else scale[:, None]


def dequantize_ref(cache, descale=None):
    """The real values of a (possibly fp8) cache ``[..., Hkv, D]``: ``stored.float() * descale[head]``."""
    return cache.float() * _per_head(descale, cache)


def quantize_fp8_ref(x, scale, dtype):
    """What a write stores in an fp8 cache of ``dtype``: ``x / scale[head]`` saturated at the format's
    largest finite value (448 for e4m3fn, 57344 for e5m2) and rounded to nearest, ties to even."""
    top = torch.finfo(dtype).max
    return (x.float() / _per_head(scale, x)).clamp(-top, top).to(dtype)


def _stored(x, cache, scale):
    """x as the cache stores it: quantized for an fp8 cache, else as is."""
    return quantize_fp8_ref(x, scale, cache.dtype) if cache.dtype.itemsize == 1 else x


def append_ref(k_cache, v_cache, k, v, cache_seqlens, block_table=None, *, k_scale=None, v_scale=None):
    """Write new tokens k/v ``[B, S_new, Hkv, D]`` at positions ``cache_seqlens[b] + t`` (in place;
    quantized with ``k_scale``/``v_scale`` into an fp8 cache)."""
    k, v = _stored(k, k_cache, k_scale), _stored(v, v_cache, v_scale)
    for b in range(k.shape[0]):
        for t in range(k.shape[1]):
            pos = int(cache_seqlens[b]) + t
            if block_table is None:
                k_cache[b, pos], v_cache[b, pos] = k[b, t], v[b, t]
            else:
                page = k_cache.shape[1]
                blk = int(block_table[b, pos // page])
                k_cache[blk, pos % page], v_cache[blk, pos % page] = k[b, t], v[b, t]


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Scatter k/v ``[T, Hkv, D]`` into paged caches by ``slot_mapping`` (negative slots skipped;
    quantized with ``k_scale``/``v_scale`` into an fp8 cache)."""
    k, v = _stored(k, k_cache, k_scale), _stored(v, v_cache, v_scale)
    page = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // page, slot % page] = k[t]
            v_cache[slot // page, slot % page] = v[t]


def merge_attn_states_ref(out_a, lse_a, out_b, lse_b):
    """Merge two partial states over disjoint key sets. out ``[..., H, D]``, lse ``[..., H]``.

    An lse of ``+inf`` is treated as an empty state, like ``-inf``.
    """
    la = lse_a.float().masked_fill(lse_a == float("inf"), float("-inf"))
    lb = lse_b.float().masked_fill(lse_b == float("inf"), float("-inf"))
    lse = torch.logaddexp(la, lb)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    wa = torch.exp(la - safe)[..., None]
    wb = torch.exp(lb - safe)[..., None]
    out = wa * out_a.float() + wb * out_b.float()
    return out, lse


# ------------------------------------------------------------------------------------------------
# The decoder's other kernels (pagedflash.ops.norm, rope, activation, sampling, gemv).
# Computed in fp32 and rounded to the input dtype exactly where the kernels round (as transformers'
# unfused model does), so they are exact up to fp32 summation order; the results are fp32. The
# engine runs them, cast to its dtype, as its PyTorch path off the GPU (pagedflash.engine.layers).


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype``, back in fp32."""
    return t.to(dtype).float()


def rms_norm_ref(x, weight, eps, residual=None):
    """``(rms_norm(x + residual) * weight, x + residual)``; x, residual ``[T, H]``, weight ``[H]``.
    The sum, and the normalized row before the weight, are rounded to x's dtype."""
    h = x.float() if residual is None else _rounded(x.float() + residual.float(), x.dtype)
    y = _rounded(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    return y * weight.float(), h


def rope_ref(x, positions, cos, sin, num_heads, head_dim, rotary_dim=None, *, q_norm_weight=None,
             k_norm_weight=None, num_q_heads=0, eps=0.0):
    """``x [T, W]`` with heads ``0 .. num_heads - 1`` (``head_dim`` wide, rotate-half) rotated by the
    angles of ``positions [T]``: each head's first ``rotary_dim`` dims (default ``head_dim``), pairs
    ``(i, i + rotary_dim / 2)``; ``cos``/``sin`` ``[max_len, >= rotary_dim]``, the first
    ``rotary_dim / 2`` entries of a row read. Returns the whole row ``[T, W]``, the rest of it (a
    head's dims past ``rotary_dim`` included) unchanged. With ``q_norm_weight``/``k_norm_weight``
    (``[head_dim]``, whole heads rotated) each head is first RMS-normed over its ``head_dim`` dims and
    scaled by the q weight (heads ``0 .. num_q_heads - 1``) or the k weight, in fp32, not rounded
    before the rotation."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    out = x.float().clone()
    half = rotary_dim // 2
    heads = out[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
    if q_norm_weight is not None:
        is_q = torch.arange(num_heads, device=x.device)[:, None] < num_q_heads
        weights = torch.where(is_q, q_norm_weight.float(), k_norm_weight.float())  # [num_heads, head_dim]
        heads.mul_(torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps) * weights)
    x1, x2 = heads[..., :half].clone(), heads[..., half:rotary_dim].clone()
    c, s = cos[positions, None, :half].float(), sin[positions, None, :half].float()
    heads[..., :rotary_dim] = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out


def silu_mul_ref(gate_up):
    """``silu(gate) * up`` for ``gate_up [T, 2n]`` (gate first) -> ``[T, n]``; SiLU rounded to the
    input dtype before the multiply."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _rounded(torch.nn.functional.silu(gate), gate_up.dtype) * up


def gelu_tanh_mul_ref(gate_up):
    """``gelu(gate, approximate="tanh") * up`` for ``gate_up [T, 2n]`` (gate first) -> ``[T, n]``; the GELU
    rounded to the input dtype before the multiply. The GELU in fp64: in fp32, ``1 + tanh(z)`` cancels
    for gates below about -4 (the value itself under 1e-4), off by up to 100 % where fp16 still holds it."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _rounded(torch.nn.functional.gelu(gate.double(), approximate="tanh"), gate_up.dtype) * up


def argmax_ref(logits):
    """First index of each row's maximum of ``logits [R, V]`` (NaN the largest) -> int64 ``[R]``."""
    return logits.float().argmax(-1)


def gemv_ref(x, weight, bias=None):
    """``x @ weight.T + bias``; x ``[1, k]``, weight ``[n, k]``, bias ``[n]`` -> ``[1, n]``."""
    out = x.float() @ weight.float().t()
    return out if bias is None else out + bias.float()


def rms_norm_gemv_ref(x, weight, bias=None, *, norm_weight, eps, residual=None):
    """``(gemv_ref(rms_norm(x + residual) * norm_weight), x + residual)``: the sum rounded to x's
    dtype, the normalized row not (the kernel scales its fp32 dot products by the rstd)."""
    h = x.float() if residual is None else _rounded(x.float() + residual.float(), x.dtype)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return gemv_ref(y, weight, bias), h


def silu_mul_gemv_ref(gate_up, weight, bias=None):
    """``gemv_ref(silu(gate) * up)`` for one row ``gate_up [1, 2k]``, the product rounded to its dtype."""
    return gemv_ref(_rounded(silu_mul_ref(gate_up), gate_up.dtype), weight, bias)


def gelu_tanh_mul_gemv_ref(gate_up, weight, bias=None):
    """``gemv_ref(gelu_tanh(gate) * up)`` for one row ``gate_up [1, 2k]``, the product rounded to its dtype."""
    return gemv_ref(_rounded(gelu_tanh_mul_ref(gate_up), gate_up.dtype), weight, bias)


def varlen_bounds_reference(cu_seqlens_q, cu_seqlens_k, block_table=None, *, total_q, total_k=0, max_seqlen_q,
                            num_blocks=0, page_size=0):
    """Each sequence's ``(start, end)`` query and key rows as :func:`pagedflash.ops.metadata.varlen_bounds`
    gives them, ``(0, 0)`` where its metadata is invalid, and the set of invalid sequences:
    ``(pairs_q, pairs_k, invalid)``, host lists (descales not covered: any bad one invalidates all)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch = len(cq) - 1
    steps = [b - a for a, b in zip(cq[:-1], cq[1:])]
    whole = cq[0] == 0 and cq[-1] == total_q and all(0 <= n <= max_seqlen_q for n in steps)
    pairs_q, pairs_k, invalid = [], [], set()
    for b in range(batch):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        q_prev, q_next = (cq[b - 1] if b else 0), (cq[b + 2] if b < batch - 1 else total_q)
        k_prev, k_next = (ck[b - 1] if b else 0), (ck[b + 2] if b < batch - 1 else 2**31 - 1)
        ok = q_prev <= q0 and 0 <= q0 <= q1 <= min(q_next, total_q) and q1 - q0 <= max_seqlen_q
        ok = ok and (b > 0 or q0 == 0) and (b < batch - 1 or q1 == total_q)
        ok = ok and k_prev <= k0 and 0 <= k0 <= k1 <= k_next and (b > 0 or k0 == 0)
        if block_table is None:
            ok = ok and k1 <= total_k and (b < batch - 1 or k1 == total_k)
        else:
            pages = block_table.shape[1]
            ok = ok and k1 - k0 <= pages * page_size
            ok = ok and all(0 <= i < num_blocks for i in block_table[b, : -(-(k1 - k0) // page_size)].tolist())
        ok = ok and whole
        pairs_q.append((q0, q1) if ok else (0, 0))
        pairs_k.append((k0, k1) if ok else (0, 0))
        if not ok:
            invalid.add(b)
    return pairs_q, pairs_k, invalid


# ---------------------------------------------------------------- mixture of experts


def moe_route_ref(router_logits, top_k, *, scoring="softmax", renormalize=True, bias=None):
    """Each token's ``top_k`` experts by a stable descending sort of ``x = logits + bias`` in fp32
    (equal values: lowest index first; a NaN sorts as ``-inf``): ``(weights fp32 [T, top_k], ids
    int32 [T, top_k])``. ``"softmax"``: ``softmax(x)`` over E at those experts, renormalized to sum 1
    if ``renormalize``; ``"topk_softmax"``: softmax over their ``x``. A row with a NaN gets NaN
    weights; one whose maximum is infinite gets them from the softmax. ``bias [E]`` is optional."""
    logits = router_logits.float() if bias is None else router_logits.float() + bias.float()
    nan = logits.isnan()
    order = logits.masked_fill(nan, float("-inf")).argsort(dim=-1, descending=True, stable=True)[:, :top_k]
    if scoring == "softmax":
        weights = torch.softmax(logits, dim=-1).gather(1, order)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        weights = torch.softmax(logits.gather(1, order), dim=-1)
    return weights.masked_fill(nan.any(dim=-1, keepdim=True), float("nan")), order.to(torch.int32)


def fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, *, activation="silu", w13_bias=None, w2_bias=None,
                  alpha=1.702, limit=7.0):
    """``sum_j topk_weights[t, j] * expert_e(hidden[t])`` with ``e = topk_ids[t, j]``, one expert at a
    time in fp32: ``expert_e(x) = act(x W_gate^T + b_gate, x W_up^T + b_up) W2[e]^T + b2[e]`` (w13
    ``[E, 2I, H]`` gate rows then up rows, w2 ``[E, H, I]``), the activation rounded to hidden's dtype.
    ``"silu"``: ``silu(g) * u``; ``"swigluoai"``: ``g = min(g, limit)``, ``u = clamp(u, -limit,
    limit)``, ``(u + 1) * g * sigmoid(alpha * g)``. A token with an id outside ``[0, E)`` gets NaN.
    Returns fp32 ``[T, H]``."""
    x = hidden.float()
    E, I = w13.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = x[tok] @ w13[e].float().t()
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        g, u = gate_up[:, :I], gate_up[:, I:]
        if activation == "silu":
            h = torch.nn.functional.silu(g) * u
        else:
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
            h = (u + 1) * g * torch.sigmoid(alpha * g)
        y = _rounded(h, hidden.dtype) @ w2[e].float().t()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    invalid = ((topk_ids < 0) | (topk_ids >= E)).any(dim=-1)
    return torch.where(invalid[:, None], float("nan"), out)


def matmul_ref(x, weight, bias=None, act=None):
    """``x @ weight.T + bias`` in fp32 for any number of rows (:func:`gemv_ref`'s product): x ``[M, K]``,
    weight ``[N, K]`` (``nn.Linear``'s layout), bias ``[N]`` -> ``[M, N]``. ``act`` (``"silu"``,
    ``"gelu_tanh"``): weight is a gated MLP's gate/up projection (gate rows first) and the result
    ``act(gate) * up`` ``[M, N / 2]`` of the product rounded to x's dtype."""
    y = gemv_ref(x, weight, bias)
    if not act:
        return y
    gate_up = y.to(x.dtype)
    return {"silu": silu_mul_ref, "gelu_tanh": gelu_tanh_mul_ref}[act](gate_up)
