"""The consumers' attention of one work item in :mod:`pagedflash.ops.prefill_hopper_kernel`: the
key tiles' ``S = Q K^T`` and ``O += P V`` wgmma kept in flight around each tile's softmax
(:func:`_attend`), and the batch-invariant mode's walk of the same tiles in the split rule's splits
(:func:`_attend_invariant`). Imported by that module only where its kernel is defined (Triton 3.6's
Gluon, compiled, NVIDIA).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedflash.ops._jit import LOG2E
from pagedflash.ops.attention_tiles import split_of, split_start
from pagedflash.ops.prefill_hopper_tiles import _fold, _softmax_step, _softmax_step_exact


@gluon.jit
def _qk(idx, q, k_smem, k_ready, ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
        s_layout: gl.constexpr):
    """Issue ``S = Q K^T`` (async) for the K tile of ring index ``idx`` once it has landed."""
    slot = idx % STAGES
    mbarrier.wait(k_ready.index(slot), (idx // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, BN], gl.float32, s_layout),
                         use_acc=False, is_async=True)

@gluon.jit
def _last_pv(o, p16, v_smem, v_ready, v_empty, q_empty, base, n_tiles, C: gl.constexpr, STAGES: gl.constexpr):
    """An item's end: consumer ``C``'s Q slot handed back (every ``Q K^T`` of the item has completed,
    so the K loader fills it for the next item meanwhile), then ``O += P V`` of the last key tile."""
    mbarrier.arrive(q_empty.index(C))
    last = base + n_tiles - 1
    slot = last % STAGES
    mbarrier.wait(v_ready.index(slot), (last // STAGES) & 1)
    o = warpgroup_mma(p16, v_smem.index(slot), o, is_async=True)
    o, p16 = warpgroup_mma_wait(0, deps=(o, p16))
    mbarrier.arrive(v_empty.index(slot))
    return o

@gluon.jit
def _issue(idx, q, o, p16, k_smem, v_smem, k_ready, v_ready, k_empty, ROWS: gl.constexpr, BN: gl.constexpr,
           STAGES: gl.constexpr, s_layout: gl.constexpr):
    """A steady step's wgmma: ``S = Q K^T`` of ring index ``idx`` and ``O += P V`` of the one before,
    both issued; returns ``S`` once it is done (K's slot handed back) and the ``P V`` still in flight."""
    s = _qk(idx, q, k_smem, k_ready, ROWS, BN, STAGES, s_layout)
    prev = (idx - 1) % STAGES
    mbarrier.wait(v_ready.index(prev), ((idx - 1) // STAGES) & 1)
    pv = warpgroup_mma(p16, v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s, ))  # QK^T (issued first) is done, PV may still run
    mbarrier.arrive(k_empty.index(idx % STAGES))
    return s, pv

@gluon.jit
def _pv_done(pv, p16, pin, v_empty, idx, STAGES: gl.constexpr):
    """Wait for the ``P V`` of ring index ``idx - 1`` (after the softmax the caller ran meanwhile) and
    hand its V slot back. Left alone, ptxas hoists this wait above the softmax (into the first
    shuffle's latency), which serializes them; a branch on a runtime value the compiler cannot prove
    positive (``pin``, never <= 0) pins it."""
    if pin > 0.0:
        o_done, p_done = warpgroup_mma_wait(0, deps=(pv, p16))
    else:
        gl.thread_barrier()
        o_done, p_done = warpgroup_mma_wait(0, deps=(pv, p16))
    mbarrier.arrive(v_empty.index((idx - 1) % STAGES))
    return o_done

@gluon.jit
def _step(j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i, l_i, qk_scale, rows, Sk,
          causal_off, ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
          o_layout: gl.constexpr, p_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tile j of the item whose tile 0 has ring index ``base``: ``S_j = Q K_j^T`` and
    ``O += P_{j-1} V_{j-1}`` in flight together; the softmax of ``S_j`` runs while the PV wgmma
    finishes."""
    idx = base + j
    s, pv = _issue(idx, q, o, p16, k_smem, v_smem, k_ready, v_ready, k_empty, ROWS, BN, STAGES, s_layout)
    p, m_new, l_new, alpha = _softmax_step(s, m_i, l_i, qk_scale, rows, j * BN, Sk, causal_off, BN, s_layout,
                                           MASK, CAUSAL)
    o_done = _pv_done(pv, p16, qk_scale, v_empty, idx, STAGES)
    o = o_done * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    return o, p16, m_new, l_new

@gluon.jit
def _q_to_fp16(q, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, ROWWISE: gl.constexpr = False):
    """A consumer's bf16 Q tile rewritten in place as fp16 for dots with fp16 (fp8) K/V: scaled by the
    power of two ``2^-shift`` that brings its largest finite magnitude to 2^14 (exact; a tile with
    an inf is not scaled; NaN is ignored by the max and stays NaN; ``shift`` held at -126 or above),
    as the portable kernel does. Returns the fp16 view and ``shift`` (the score scale takes ``2^shift``).
    ``ROWWISE`` (the batch-invariant mode, as the portable kernel's): a shift per row (``[ROWS]``; a row
    with an inf is not scaled)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [ROWS // 16, 1], [1, 0])
    x = q.load(layout).to(gl.float32)
    amax = gl.max(gl.abs(x), axis=1)
    if not ROWWISE:
        amax = gl.max(amax, axis=0)
    shift = gl.maximum(gl.ceil(gl.log2(amax)) - 14.0, -126.0)
    shift = gl.where((amax > 0.0) & (amax < float("inf")), shift, 0.0)
    gl.thread_barrier()  # every warp has read the tile before any overwrites it
    q16 = q._reinterpret(gl.float16, [ROWS, HEAD_DIM], q.layout)
    if ROWWISE:
        q16.store((x * gl.exp2(-shift)[:, None]).to(gl.float16))
    else:
        q16.store((x * gl.exp2(-shift)).to(gl.float16))
    fence_async_shared()  # these generic-proxy stores before the wgmma (async proxy) reads
    gl.thread_barrier()
    return q16, shift

@gluon.jit
def _attend(q, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o, m_i, l_i, qk_scale, rows,
            base, nq, n_full, n_tiles, Sk, causal_off, C: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr,
            STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
            CAUSAL: gl.constexpr):
    """Consumer ``C``'s rows of one work item over its ``n_tiles`` key tiles (ring indices from
    ``base``; its Q is the ``nq``-th loaded). The Q slot is handed back after the item's last
    ``Q K^T``, so the K loader fills it for the next item while this one's last ``P V`` runs."""
    mbarrier.wait(q_ready.index(C), nq & 1)
    if q.dtype != k_smem.dtype:  # bf16 q over fp8 K/V (converted to fp16): the dots run in fp16
        q, shift = _q_to_fp16(q, ROWS, k_smem.shape[2])
        qk_scale = qk_scale * gl.exp2(shift)
    # tile 0 alone, always masked (right for any tile), then the overlapped steady state
    s = _qk(base, q, k_smem, k_ready, ROWS, BN, STAGES, s_layout)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(base % STAGES))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, rows, 0, Sk, causal_off, BN, s_layout, True,
                                       CAUSAL)
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    for j in range(1, n_full):
        o, p16, m_i, l_i = _step(j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i,
                                 l_i, qk_scale, rows, Sk, causal_off, ROWS, BN, STAGES, s_layout, o_layout,
                                 p_layout, False, CAUSAL)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        o, p16, m_i, l_i = _step(j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i,
                                 l_i, qk_scale, rows, Sk, causal_off, ROWS, BN, STAGES, s_layout, o_layout,
                                 p_layout, True, CAUSAL)
    o = _last_pv(o, p16, v_smem, v_ready, v_empty, q_empty, base, n_tiles, C, STAGES)
    return o, m_i, l_i

@gluon.jit
def _step_invariant(j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i, l_i, out, lse,
                    qk_scale, pin, o_scale, rows, Sk, causal_off, ROWS: gl.constexpr, BN: gl.constexpr,
                    STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                    MASK: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_N: gl.constexpr, HEAD_N: gl.constexpr,
                    HEAD_KEYS: gl.constexpr, MID_N: gl.constexpr, MID_KEYS: gl.constexpr, V_SCALED: gl.constexpr):
    """:func:`_step` in the batch-invariant mode. Where key tile j starts a split of the rule
    (:func:`pagedflash.ops.attention_tiles.split_start`), the split before it, once ``P_{j-1}
    V_{j-1}`` has joined its accumulator, is folded into the row's ``(out, lse)`` (:func:`_fold`)
    and tile j's softmax starts from a fresh state; elsewhere the accumulator is rescaled as in the
    portable kernel (``acc * alpha_j``, then ``+ P_j V_j`` at the next step: its operations in its
    order). ``qk_scale``: a scalar or a column ``[ROWS, 1]``; ``pin``: a scalar > 0 (:func:`_pv_done`);
    ``o_scale``: the value descale (``V_SCALED``)."""
    idx = base + j
    n0 = j * BN
    fresh = split_start(split_of(n0, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS), SPLIT_N, HEAD_N, HEAD_KEYS,
                        MID_N, MID_KEYS) == n0
    s, pv = _issue(idx, q, o, p16, k_smem, v_smem, k_ready, v_ready, k_empty, ROWS, BN, STAGES, s_layout)
    m_new, l_new, alpha, p = _softmax_step_exact(s, gl.where(fresh, -float("inf"), m_i), gl.where(fresh, 0.0, l_i),
                                                 qk_scale, rows, n0, Sk, causal_off, BN, s_layout, MASK, CAUSAL)
    o_done = _pv_done(pv, p16, pin, v_empty, idx, STAGES)
    if fresh:
        out, lse = _fold(o_done, m_i, l_i, out, lse, o_scale, o_layout, V_SCALED)
        o = gl.zeros_like(o_done)  # the portable kernel's fresh accumulator times alpha 0: +0
    else:
        o = o_done * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    return o, p16, m_new, l_new, out, lse

@gluon.jit
def _attend_invariant(q, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, sm_scale, o_scale,
                      rows, base, nq, n_full, n_tiles, Sk, causal_off, C: gl.constexpr, ROWS: gl.constexpr,
                      HEAD_DIM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                      o_layout: gl.constexpr, p_layout: gl.constexpr, CAUSAL: gl.constexpr,
                      SPLIT_N: gl.constexpr, HEAD_N: gl.constexpr, HEAD_KEYS: gl.constexpr, MID_N: gl.constexpr,
                      MID_KEYS: gl.constexpr, V_SCALED: gl.constexpr):
    """:func:`_attend` in the batch-invariant mode (:mod:`pagedflash.batch_invariance`): the row's
    key tiles (``BN`` = the mode's key tile, 64 or 128 keys) through the portable kernel's EXACT step, in
    splits at the rule's absolute key positions, each from a fresh state, finalized and merged left to right
    (:func:`_step_invariant`): a row's output and LSE bit for bit the portable kernel's. ``sm_scale``:
    the softmax scale times the key descale (fp8 K/V), the portable kernel's first product; the score
    scale follows as there (bf16 q over fp8 K/V: q scaled per row, its shift's power of two next; then
    log2(e)). ``o_scale``: the value descale, applied to each split's output (``V_SCALED``). Returns the
    normalized ``(out, lse)`` (natural log)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    lse = gl.full([ROWS], -float("inf"), gl.float32, row_o)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([ROWS], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_ready.index(C), nq & 1)
    if q.dtype != k_smem.dtype:  # bf16 q over fp8 K/V (converted to fp16): a shift a row, as the portable kernel
        q, shift = _q_to_fp16(q, ROWS, HEAD_DIM, True)
        qk_scale = gl.convert_layout((sm_scale * gl.exp2(shift)) * LOG2E, gl.SliceLayout(1, s_layout))[:, None]
        pin = sm_scale
    else:
        qk_scale = sm_scale * LOG2E
        pin = qk_scale  # the one scalar (a second one live through the loop spills at D = 128)
    s = _qk(base, q, k_smem, k_ready, ROWS, BN, STAGES, s_layout)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(base % STAGES))
    m_i, l_i, alpha, p = _softmax_step_exact(s, m_i, l_i, qk_scale, rows, 0, Sk, causal_off, BN, s_layout, True,
                                             CAUSAL)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    for j in range(1, n_full):
        o, p16, m_i, l_i, out, lse = _step_invariant(
            j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i, l_i, out, lse, qk_scale,
            pin, o_scale, rows, Sk, causal_off, ROWS, BN, STAGES, s_layout, o_layout, p_layout, False, CAUSAL,
            SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS, V_SCALED)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        o, p16, m_i, l_i, out, lse = _step_invariant(
            j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i, l_i, out, lse, qk_scale,
            pin, o_scale, rows, Sk, causal_off, ROWS, BN, STAGES, s_layout, o_layout, p_layout, True, CAUSAL,
            SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS, V_SCALED)
    o = _last_pv(o, p16, v_smem, v_ready, v_empty, q_empty, base, n_tiles, C, STAGES)
    return _fold(o, m_i, l_i, out, lse, o_scale, o_layout, V_SCALED)
