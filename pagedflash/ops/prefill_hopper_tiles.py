"""The Gluon helpers every partition of :mod:`pagedflash.ops.prefill_hopper_kernel` shares: which work
items a program takes and what each covers (:func:`_schedule`, :func:`_item`, :func:`_sequence`,
:func:`_key_tiles`), one online-softmax step and the store, the batch-invariant mode's exact step and
split fold (:func:`_softmax_step_exact`, :func:`_fold`: the portable kernel's own arithmetic), and the
loads (through host or device descriptors, a paged tile's pages). Imported by that module only where its kernel is defined (Triton
3.6's Gluon, compiled, NVIDIA).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from pagedflash.ops import _jit

LN2 = gl.constexpr(0.6931471805599453)
FLT_MIN = gl.constexpr(1.1754943508222875e-38)  # the least normal fp32


@gluon.jit
def _key_tiles(m0, Sq, Sk, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles of the program whose rows start at ``m0``: ``[0, n_full)`` are visible to all its
    rows (no mask), ``[n_full, n_tiles)`` are the causal diagonal and the ragged last tile."""
    causal_off = Sk - Sq
    if CAUSAL:
        hi = gl.minimum(m0 + BM + causal_off, Sk)
        n_full = gl.minimum((m0 + causal_off + 1) // BN, Sk // BN)
    else:
        hi = Sk + 0
        n_full = Sk // BN
    n_tiles = (hi + BN - 1) // BN
    return n_full, n_tiles, causal_off

@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, rows, n0, Sk, causal_off, BN: gl.constexpr, s_layout: gl.constexpr,
                  MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """Fold raw scores ``s`` (fp32 ``[rows, BN]``, keys from ``n0``) into the running max ``m_i``
    (scaled, log2 domain) and sum ``l_i``; returns ``p``, the new state and O's rescale factor. A scale
    that underflowed to 0 (x the key descale, x the fp8 shift) is taken as the least normal: masked
    scores stay ``-inf`` (``-inf x 0`` is NaN). Clamped here, not where the callers' branch on the
    scale (``_step``) reads it, which must stay a value the compiler cannot prove positive."""
    qk_scale = gl.maximum(qk_scale, FLT_MIN)
    if MASK:
        s = _mask(s, rows, n0, Sk, causal_off, BN, s_layout, CAUSAL)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASK:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # no key yet: keep exp2 off (-inf) - (-inf)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha

@gluon.jit
def _mask(s, rows, n0, Sk, causal_off, BN: gl.constexpr, s_layout: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores ``s`` (keys from ``n0``) with the keys past ``Sk`` and, ``CAUSAL``, those after each row's
    diagonal set to ``-inf``."""
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    valid = cols[None, :] < Sk
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
    return gl.where(valid, s, -float("inf"))

@gluon.jit
def _softmax_step_exact(s, m_i, l_i, qk_scale, rows, n0, Sk, causal_off, BN: gl.constexpr,
                        s_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """The batch-invariant mode's step, as the portable kernel's (``EXACT``) takes it: the raw scores
    masked, then :func:`pagedflash.ops._jit.softmax_probs_scaled` (a scale that underflowed to 0 taken
    as the least normal, as there). Returns ``(m, l, alpha, p)``; a visible key's probability has the
    same bits masked or not."""
    if MASK:
        s = _mask(s, rows, n0, Sk, causal_off, BN, s_layout, CAUSAL)
    return _jit.softmax_probs_scaled(m_i, l_i, s, gl.maximum(qk_scale, FLT_MIN))

@gluon.jit
def _fold(o, m_i, l_i, out, lse, o_scale, o_layout: gl.constexpr, V_SCALED: gl.constexpr):
    """The batch-invariant mode's end of a split: its state (accumulator ``o``, running max and sum
    in the scores' row layout) finalized, times the value descale ``o_scale`` (``V_SCALED``), and
    merged into the row's ``(out, lse)`` after the splits before it, by the portable kernel's own
    :func:`pagedflash.ops._jit.finalize` and :func:`pagedflash.ops._jit.merge_state`, in its order."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_c, lse_c = _jit.finalize(gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o), o)
    if V_SCALED:
        o_c = o_c * o_scale
    return _jit.merge_state(out, lse, o_c, lse_c)

@gluon.jit
def _store(o, m_i, l_i, O, LSE, b, h, tok0, row0, n_rows, stride_ob, stride_os, stride_oh, lse_b, lse_h,
           o_scale, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr, WRITE_LSE: gl.constexpr):
    """Normalize, scale by ``o_scale`` (the value descale) and store (:func:`_store_rows`). A row that
    saw no key gets 0 (and -inf)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    l_safe = gl.where(l_o == 0.0, 1.0, l_o)
    out = o * (o_scale / l_safe)[:, None]
    lse = l_o  # (a placeholder: not stored without WRITE_LSE)
    if WRITE_LSE:
        m_o = gl.convert_layout(m_i, row_o)
        lse = gl.where(l_o == 0.0, -float("inf"), (m_o + gl.log2(l_safe)) * LN2)
    _store_rows(out, lse, O, LSE, b, h, tok0, row0, n_rows, stride_ob, stride_os, stride_oh, lse_b, lse_h, ROWS,
                HEAD_DIM, o_layout, WRITE_LSE)

@gluon.jit
def _store_rows(out, lse, O, LSE, b, h, tok0, row0, n_rows, stride_ob, stride_os, stride_oh, lse_b, lse_h,
                ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr, WRITE_LSE: gl.constexpr):
    """Store normalized rows ``row0 ..`` of head ``h`` of sequence ``b`` (its rows start at token
    ``tok0``; rows from ``n_rows`` on are not stored); LSE (natural log, with ``WRITE_LSE``) at ``b *
    lse_b + h * lse_h + tok0 + row``."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = row0 + gl.arange(0, ROWS, layout=row_o)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    row_ok = rows < n_rows
    toks = (tok0 + rows).to(gl.int64)
    offs = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh + toks[:, None] * stride_os + cols[None, :]
    gl.store(O + offs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM))
    if WRITE_LSE:
        gl.store(LSE + b.to(gl.int64) * lse_b + h.to(gl.int64) * lse_h + toks, lse, mask=row_ok)

@gluon.jit
def _sequence(b, Sq, Sk, CuQ, CuK, VARLEN: gl.constexpr):
    """``(first query token, queries, first key token, keys)`` of sequence ``b``: with ``VARLEN``
    from its ``(start, end)`` pairs (``[B, 2]``, :func:`pagedflash.ops.metadata.varlen_bounds`:
    ``(0, 0)`` for a sequence whose metadata is invalid), else ``(0, Sq, 0, Sk)``."""
    q_start = 0
    k_start = 0
    sq = Sq
    sk = Sk
    if VARLEN:
        q_start = gl.load(CuQ + 2 * b)
        sq = gl.load(CuQ + 2 * b + 1) - q_start
        k_start = gl.load(CuK + 2 * b)
        sk = gl.load(CuK + 2 * b + 1) - k_start
    return q_start, sq, k_start, sk

@gluon.jit
def _schedule(Sq, Hq, B, BM: gl.constexpr):
    """This program's share of the launch's work items (one per 128-row block of one head of one
    sequence): ``(row blocks per head, items of this program)``. Items go out in rounds of
    ``num_programs``, left to right in even rounds and right to left in odd ones."""
    n_m = (Sq + BM - 1) // BM
    total = n_m * Hq * B
    nprog = gl.num_programs(0)
    last = (total - 1) // nprog
    pid = gl.program_id(0)
    pos = pid + (last % 2) * (nprog - 1 - 2 * pid)  # this program's place in the last round
    count = last + (pos < total - last * nprog).to(gl.int32)
    return n_m, count

@gluon.jit
def _item(i, n_m, Hq, BM: gl.constexpr):
    """Work item ``i`` of this program: ``(b, h, m0)``. A head's row blocks are next to each other,
    the last (longest under causal masking) first: those running together read its K/V from L2."""
    nprog = gl.num_programs(0)
    pid = gl.program_id(0)
    t = i * nprog + pid + (i % 2) * (nprog - 1 - 2 * pid)
    bh = t // n_m
    return bh // Hq, bh % Hq, (n_m - 1 - t % n_m) * BM

@gluon.jit
def _load(desc, smem, ready, empty, slot, phase, b, row, head, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
          VARLEN: gl.constexpr):
    """Copy rows ``row ..`` of ``(b, head)`` into ``smem[slot]`` once its readers freed it (a fresh
    barrier passes the parity-1 wait at once). ``VARLEN``: ``desc`` covers one sequence's rows of
    one head (``[rows, D]``)."""
    mbarrier.wait(empty.index(slot), phase ^ 1)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    if VARLEN:
        tma.async_copy_global_to_shared(desc, [row, 0], ready.index(slot), smem.index(slot))
    else:
        tma.async_copy_global_to_shared(desc, [b, row, head, 0], ready.index(slot),
                                        smem.index(slot).reshape([1, ROWS, 1, HEAD_DIM]))

@gluon.jit
def _rows(base, tok0, head, rows, stride_t, stride_h, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
          layout: gl.constexpr):
    """A descriptor made on the device over ``rows`` tokens from ``tok0`` of one head (``[rows, D]``,
    zero fill past them), boxes of ``BLOCK_ROWS`` rows. Each call site owns its global scratch."""
    offset = gl.to_tensor(tok0).to(gl.int64) * stride_t + head.to(gl.int64) * stride_h
    return tma.make_tensor_descriptor(base + offset,
                                      shape=[rows, HEAD_DIM], strides=[stride_t, 1],
                                      block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)

@gluon.jit
def _page_ids(BlockTable, b, j, sk, stride_bt, stride_bp, PAGE: gl.constexpr, CHUNK: gl.constexpr,
              BN: gl.constexpr):
    """The pages of key tile ``j``'s chunks that hold ``CHUNK`` keys of sequence ``b`` (0 for the
    others), read in one load (the loader waits on one latency, not one a chunk)."""
    c = gl.arange(0, BN // CHUNK, layout=gl.BlockedLayout([BN // CHUNK], [32], [1], [0]))
    p = j * BN + c * CHUNK
    return gl.load(BlockTable + b * stride_bt + (p // PAGE) * stride_bp, mask=p + CHUNK <= sk, other=0)

@gluon.jit
def _load_kv(desc, tail, smem, ready, empty, idx, b, j, head, sk, tail_start, ids, STAGES: gl.constexpr,
             BN: gl.constexpr, HEAD_DIM: gl.constexpr, VARLEN: gl.constexpr, PAGE: gl.constexpr,
             CHUNK: gl.constexpr):
    """Copy key tile ``j`` of K or V (sequence ``b``, head ``head``) into ring slot ``idx % STAGES``
    once its readers (the consumers; for the fp8 ring the converter) freed it. ``PAGE``: ``CHUNK``
    rows a copy, a chunk of keys the sequence holds through ``desc`` (the cache ``[blocks, PAGE, Hkv, D]``, at page ``ids[chunk]``, from
    :func:`_page_ids`), one that reaches past its last key through ``tail`` (its last page's rows
    up to that key, zero fill after them: a page's stale rows never reach ``P V``)."""
    if PAGE > 0:
        slot = idx % STAGES
        mbarrier.wait(empty.index(slot), ((idx // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), (BN // CHUNK) * tail.block_type.nbytes)
        chunks = gl.arange(0, BN // CHUNK, layout=gl.BlockedLayout([BN // CHUNK], [32], [1], [0]))
        for c in gl.static_range(BN // CHUNK):
            p = j * BN + c * CHUNK
            if p + CHUNK <= sk:
                blk = gl.sum(gl.where(chunks == c, ids, 0), axis=0)
                tma.async_copy_global_to_shared(
                    desc, [blk, p % PAGE, head, 0], ready.index(slot),
                    smem.index(slot).reshape([1, BN, 1, HEAD_DIM]).slice(c * CHUNK, CHUNK, dim=1))
            else:
                tma.async_copy_global_to_shared(tail, [p - tail_start, 0], ready.index(slot),
                                                smem.index(slot).slice(c * CHUNK, CHUNK))
    else:
        _load(desc, smem, ready, empty, idx % STAGES, (idx // STAGES) & 1, b, j * BN, head, BN, HEAD_DIM, VARLEN)
