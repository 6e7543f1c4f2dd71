"""The Gluon kernel of :mod:`pagedflash.ops.prefill_hopper`: a persistent, warp-specialized
FlashAttention forward for Hopper (sm90), FlashAttention-3's design as Gluon spells it (TMA, mbarriers,
async wgmma, warp specialization).

- Persistent: about one program per SM loops over work items of 128 query rows of one head, a
  head's row blocks next to each other (they run together and share its K/V in L2), the last
  first. Items go out in rounds, alternately left to right and right to left, which evens out the
  key tiles per program under causal masking (the host's ``programs()`` picks the count).
- A 1-warp load partition streams each item's Q and K/V tiles (128 keys) through TMA: K/V into a
  ring of ``STAGES`` shared-memory slots whose index runs on across items, Q into one slot per
  consumer; each slot has a "ready" mbarrier (the copy's bytes landed) and an "empty" one (its
  consumers are done with it). The next item's Q and first K/V tiles land while the consumers
  finish the last item's ``P V`` and store.
- Two 4-warp consumer partitions take 64 rows each and read the same ring. Each keeps the wgmma of
  ``S_j = Q K_j^T`` and of ``O += P_{j-1} V_{j-1}`` in flight together and runs tile j's softmax while
  the second finishes; the two consumers' softmax and wgmma interleave on the SM (ping-pong
  without explicit ordering).
- Softmax in the log2 domain with log2(e) folded into the scale; only the causal diagonal and the
  ragged last key tile are masked. Causal is bottom-right aligned.
- Dense: Q, K and V load through rank-4 descriptors over ``[B, S, H, D]`` with boxes
  ``[1, rows, 1, D]``: rows past a sequence's end are zero-filled by the copy engine, never read
  from the next sequence, so a ragged last tile needs no batch-size rule (a NaN or inf in another
  sequence's V cannot reach this one's ``P V``, where its probability 0 would not cancel it). Query
  rows past ``Sq`` are zeros too; their results are never stored. Any strides with a contiguous
  last dim and 16-byte multiples elsewhere work.
- Varlen (packed ``[total, H, D]`` with ``cu_seqlens``; ``VARLEN``): the loader makes each item's
  Q/K/V descriptors on the device over its sequence's rows of its heads (zero fill past the
  sequence, as dense has), after the copies through the last item's have landed; items past a
  sequence's rows are skipped and items whose rows see no key store 0 / -inf, by every partition
  alike.
- Paged K/V (``PAGE``, with varlen Q): a key tile is ``128 / CHUNK`` copies of ``CHUNK = min(PAGE,
  128)`` rows through host descriptors over the caches ``[blocks, PAGE, Hkv, D]``, at the pages the
  block table names (read once a tile for K and V); the chunks that reach past a sequence's last
  key go through descriptors made on the device over its last page's rows up to that key, so a
  page's stale rows (NaN, or another sequence's values) are zero fill.
- The output (and the natural-log LSE) leave through masked pointer stores: any ``out`` strides
  with a contiguous last dim.

Written against Triton 3.6's Gluon API, which is experimental and changes between releases (3.9
renamed the TMA copies); on any other Triton, under the interpreter and off NVIDIA the module
imports, defines no kernel, and :data:`UNAVAILABLE` says why. ``tools/gluon_compile_check.py``
compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton

from pagedflash.ops.utils import interpreted

BLOCK_M = 128  # query rows per program: two consumers of 64
BLOCK_N = 128  # keys per K/V tile
STAGES = {64: 3, 128: 2}  # K/V ring depth by head dim (shared memory: Q + STAGES x (K + V) tiles)
NUM_WARPS = 4  # the default partition (consumer 0); consumer 1 and the loader are worker warps
MAX_REGISTERS = 168  # per thread before the partitions rebalance (setmaxnreg)
CONSUMER_REGISTERS, LOADER_REGISTERS = 240, 24

# The kernel's integer arguments (the launcher passes them by name). Triton compiles a kernel anew for
# each class of an integer argument (1, a multiple of 16, other) it meets unless told not to: those in
# RUNTIME_INTS vary from call to call (a serving step's lengths, batch and block-table width) and are
# never specialized; the others are fixed by a model's shapes.
INT_ARGS = ("Sq", "Sk", "Hq", "B", "GROUP", "stride_ob", "stride_os", "stride_oh", "lse_b", "lse_h", "stride_qt",
            "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kb", "stride_vb", "stride_bt",
            "stride_bp")
RUNTIME_INTS = ("Sq", "Sk", "B", "lse_b", "lse_h", "stride_bt")

UNAVAILABLE: str | None = None  # why the kernel is not defined here; None when it is


def _unavailable() -> str | None:
    if interpreted():
        return "the Triton interpreter runs no Gluon kernels"
    if torch.version.hip is not None:
        return "a ROCm build of torch (the kernel is NVIDIA Hopper code)"
    if tuple(triton.__version__.split(".")[:2]) != ("3", "6"):
        return f"triton {triton.__version__}: the kernel is written against Triton 3.6's experimental Gluon API"
    return None


UNAVAILABLE = _unavailable()
if UNAVAILABLE is None:
    try:
        from triton.compiler.errors import CompilationError
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - the launcher's
    except ImportError as e:
        UNAVAILABLE = f"triton {triton.__version__} without the Gluon Hopper API ({e})"
    else:
        COMPILE_ERRORS = (CompilationError, *(getattr(triton.runtime.errors, name) for name in
                                               ("PTXASError", "OutOfResources") if hasattr(triton.runtime.errors, name)))

if UNAVAILABLE is None:
    LN2 = gl.constexpr(0.6931471805599453)

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
        (scaled, log2 domain) and sum ``l_i``; returns ``p``, the new state and O's rescale factor."""
        if MASK:
            cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            valid = cols[None, :] < Sk
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
            s = gl.where(valid, s, -float("inf"))
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
    def _store(o, m_i, l_i, O, LSE, b, h, tok0, row0, n_rows, stride_ob, stride_os, stride_oh, lse_b, lse_h,
               ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr, WRITE_LSE: gl.constexpr):
        """Normalize and store rows ``row0 ..`` of head ``h`` of sequence ``b`` (its rows start at
        token ``tok0``; rows from ``n_rows`` on are not stored); LSE in natural log at
        ``b * lse_b + h * lse_h + tok0 + row``. A row that saw no key gets 0 (and -inf)."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        l_o = gl.convert_layout(l_i, row_o)
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        out = o * (1.0 / l_safe)[:, None]
        rows = row0 + gl.arange(0, ROWS, layout=row_o)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        row_ok = rows < n_rows
        toks = (tok0 + rows).to(gl.int64)
        offs = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh + toks[:, None] * stride_os + cols[None, :]
        gl.store(O + offs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM))
        if WRITE_LSE:
            m_o = gl.convert_layout(m_i, row_o)
            lse = gl.where(l_o == 0.0, -float("inf"), (m_o + gl.log2(l_safe)) * LN2)
            gl.store(LSE + b.to(gl.int64) * lse_b + h.to(gl.int64) * lse_h + toks, lse, mask=row_ok)

    @gluon.jit
    def _sequence(b, Sq, Sk, CuQ, CuK, VARLEN: gl.constexpr):
        """``(first query token, queries, first key token, keys)`` of sequence ``b``: from the
        ``cu_seqlens`` with ``VARLEN``, else ``(0, Sq, 0, Sk)``."""
        q_start = 0
        k_start = 0
        sq = Sq
        sk = Sk
        if VARLEN:
            q_start = gl.load(CuQ + b)
            sq = gl.load(CuQ + b + 1) - q_start
            k_start = gl.load(CuK + b)
            sk = gl.load(CuK + b + 1) - k_start
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
        """Copy rows ``row ..`` of ``(b, head)`` into ``smem[slot]`` once its consumers freed it (a fresh
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
        others), read once for its K and V copies in one load (the loader waits on one latency, not
        one a chunk)."""
        c = gl.arange(0, BN // CHUNK, layout=gl.BlockedLayout([BN // CHUNK], [32], [1], [0]))
        p = j * BN + c * CHUNK
        return gl.load(BlockTable + b * stride_bt + (p // PAGE) * stride_bp, mask=p + CHUNK <= sk, other=0)

    @gluon.jit
    def _load_kv(desc, tail, smem, ready, empty, idx, b, j, head, sk, tail_start, ids, STAGES: gl.constexpr,
                 BN: gl.constexpr, HEAD_DIM: gl.constexpr, VARLEN: gl.constexpr, PAGE: gl.constexpr,
                 CHUNK: gl.constexpr):
        """Copy key tile ``j`` of K or V (sequence ``b``, head ``head``) into ring slot ``idx % STAGES``
        once its consumers freed it. ``PAGE``: ``CHUNK`` rows a copy, a chunk of keys the sequence
        holds through ``desc`` (the cache ``[blocks, PAGE, Hkv, D]``, at page ``ids[chunk]``, from
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

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, Kc, Vc, BlockTable, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                v_ready, k_empty, v_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_kb, stride_vb, stride_bt, stride_bp, ROWS: gl.constexpr,
                HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, VARLEN: gl.constexpr, PAGE: gl.constexpr, CHUNK: gl.constexpr):
        """The load partition: for each work item, K_0, both consumers' Q (once each has finished the
        last item's), V_0, then K_j and V_j; the K/V ring's index runs on across items, so the next
        item's first tiles land while the consumers finish the last one. ``VARLEN``: the descriptors
        are made here, per item, over its sequence's rows of its heads (zero fill past the sequence),
        each once the copies through the last item's have landed (a descriptor is rewritten in place).
        ``PAGE``: K/V come from the pages of a cache through the host's descriptors (``k_desc``,
        ``v_desc``), but for the chunks reaching past the sequence's last key, which go through
        descriptors made here over its last page (:func:`_load_kv`)."""
        q_layout: gl.constexpr = q_smem.layout
        k_layout: gl.constexpr = k_smem.layout
        v_layout: gl.constexpr = v_smem.layout
        n_m, count = _schedule(Sq, Hq, B, BM)
        it = 0
        nq = 0  # items loaded so far (the Q slots' phase)
        prev = 0  # ring index of the last loaded item's first tile
        for i in range(count):
            b, h, m0 = _item(i, n_m, Hq, BM)
            q_start, sq, k_start, sk = _sequence(b, Sq, Sk, CuQ, CuK, VARLEN)
            _, n_tiles, _ = _key_tiles(m0, sq, sk, BM, BN, CAUSAL)
            kv_head = h // GROUP
            busy = True  # dense: every item (refusal() leaves none without a key)
            if VARLEN:  # not for rows past the sequence or rows that see no key, as the consumers decide
                busy = (m0 < sq) & (n_tiles > 0)
            if busy:
                if VARLEN:
                    if nq > 0:
                        for c in gl.static_range(2):
                            mbarrier.wait(q_ready.index(c), (nq - 1) & 1)
                        for idx in range(gl.maximum(it - STAGES, prev), it):
                            mbarrier.wait(k_ready.index(idx % STAGES), (idx // STAGES) & 1)
                            mbarrier.wait(v_ready.index(idx % STAGES), (idx // STAGES) & 1)
                    qd = _rows(q_desc, q_start, h, sq, stride_qt, stride_qh, ROWS, HEAD_DIM, q_layout)
                    if PAGE > 0:
                        kd = k_desc
                        vd = v_desc
                        last_page = (sk - 1) // PAGE
                        tail_start = last_page * PAGE
                        blk = gl.load(BlockTable + b * stride_bt + last_page * stride_bp).to(gl.int64)
                        kt = _rows(Kc + blk * stride_kb, 0, kv_head, sk - tail_start, stride_kt, stride_kh, CHUNK,
                                   HEAD_DIM, k_layout)
                        vt = _rows(Vc + blk * stride_vb, 0, kv_head, sk - tail_start, stride_vt, stride_vh, CHUNK,
                                   HEAD_DIM, v_layout)
                    else:
                        kd = _rows(k_desc, k_start, kv_head, sk, stride_kt, stride_kh, BN, HEAD_DIM, k_layout)
                        vd = _rows(v_desc, k_start, kv_head, sk, stride_vt, stride_vh, BN, HEAD_DIM, v_layout)
                        kt = kd
                        vt = vd
                        tail_start = 0
                else:
                    qd = q_desc
                    kd = k_desc
                    vd = v_desc
                    kt = kd
                    vt = vd
                    tail_start = 0
                ids = 0
                if PAGE > 0:
                    ids = _page_ids(BlockTable, b, 0, sk, stride_bt, stride_bp, PAGE, CHUNK, BN)
                _load_kv(kd, kt, k_smem, k_ready, k_empty, it, b, 0, kv_head, sk, tail_start, ids, STAGES, BN, HEAD_DIM,
                         VARLEN, PAGE, CHUNK)
                for c in gl.static_range(2):
                    _load(qd, q_smem, q_ready, q_empty, c, nq & 1, b, m0 + c * ROWS, h, ROWS, HEAD_DIM, VARLEN)
                _load_kv(vd, vt, v_smem, v_ready, v_empty, it, b, 0, kv_head, sk, tail_start, ids, STAGES, BN, HEAD_DIM,
                         VARLEN, PAGE, CHUNK)
                for j in range(1, n_tiles):
                    if PAGE > 0:
                        ids = _page_ids(BlockTable, b, j, sk, stride_bt, stride_bp, PAGE, CHUNK, BN)
                    _load_kv(kd, kt, k_smem, k_ready, k_empty, it + j, b, j, kv_head, sk, tail_start, ids, STAGES, BN,
                             HEAD_DIM, VARLEN, PAGE, CHUNK)
                    _load_kv(vd, vt, v_smem, v_ready, v_empty, it + j, b, j, kv_head, sk, tail_start, ids, STAGES, BN,
                             HEAD_DIM, VARLEN, PAGE, CHUNK)
                prev = it
                it += n_tiles
                nq += 1

    @gluon.jit
    def _qk(idx, q, k_smem, k_ready, ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
            s_layout: gl.constexpr):
        """Issue ``S = Q K^T`` (async) for the K tile of ring index ``idx`` once it has landed."""
        slot = idx % STAGES
        mbarrier.wait(k_ready.index(slot), (idx // STAGES) & 1)
        return warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, BN], gl.float32, s_layout),
                             use_acc=False, is_async=True)

    @gluon.jit
    def _step(j, base, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, o, p16, m_i, l_i, qk_scale, rows, Sk,
              causal_off, ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """Key tile j of the item whose tile 0 has ring index ``base``: ``S_j = Q K_j^T`` and
        ``O += P_{j-1} V_{j-1}`` in flight together; the softmax of ``S_j`` runs while the PV wgmma
        finishes."""
        idx = base + j
        s = _qk(idx, q, k_smem, k_ready, ROWS, BN, STAGES, s_layout)
        prev = (idx - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((idx - 1) // STAGES) & 1)
        o = warpgroup_mma(p16, v_smem.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))  # QK^T (issued first) is done, PV may still run
        mbarrier.arrive(k_empty.index(idx % STAGES))
        p, m_new, l_new, alpha = _softmax_step(s, m_i, l_i, qk_scale, rows, j * BN, Sk, causal_off, BN, s_layout,
                                               MASK, CAUSAL)
        # Left alone, ptxas hoists the PV wait above the softmax (into the first shuffle's latency),
        # which serializes them; a branch on a runtime value (never false: the scale is > 0) pins it.
        if qk_scale > 0.0:
            o_done, p_done = warpgroup_mma_wait(0, deps=(o, p16))
        else:
            gl.thread_barrier()
            o_done, p_done = warpgroup_mma_wait(0, deps=(o, p16))
        mbarrier.arrive(v_empty.index(prev))
        o = o_done * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        return o, p16, m_new, l_new

    @gluon.jit
    def _attend(q, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o, m_i, l_i, qk_scale, rows,
                base, nq, n_full, n_tiles, Sk, causal_off, C: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr,
                STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                CAUSAL: gl.constexpr):
        """Consumer ``C``'s rows of one work item over its ``n_tiles`` key tiles (ring indices from
        ``base``; its Q is the ``nq``-th loaded). The Q slot is handed back after the item's last
        ``Q K^T``, so the loader fills it for the next item while this one's last ``P V`` runs."""
        mbarrier.wait(q_ready.index(C), nq & 1)
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
        mbarrier.arrive(q_empty.index(C))  # every Q K^T of the item has completed
        last = base + n_tiles - 1
        slot = last % STAGES
        mbarrier.wait(v_ready.index(slot), (last // STAGES) & 1)
        o = warpgroup_mma(p16, v_smem.index(slot), o, is_async=True)
        o, p16 = warpgroup_mma_wait(0, deps=(o, p16))
        mbarrier.arrive(v_empty.index(slot))
        return o, m_i, l_i

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, CuQ, CuK,
                  qk_scale, Sq, Sk, Hq, B, stride_ob, stride_os, stride_oh, lse_b, lse_h, C: gl.constexpr,
                  ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, VARLEN: gl.constexpr):
        """Consumer ``C``: for each work item, rows ``m0 + C * ROWS ..`` (:func:`_attend`), then the
        store. ``VARLEN``: an item past its sequence's rows is skipped, and one whose rows see no key
        stores 0 (LSE -inf) without waiting on the loader, which skips both alike."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROWS // 16, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROWS // 16, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q = q_smem.index(C)
        n_m, count = _schedule(Sq, Hq, B, BM)
        base = 0
        nq = 0
        for i in range(count):
            b, h, m0 = _item(i, n_m, Hq, BM)
            q_start, sq, k_start, sk = _sequence(b, Sq, Sk, CuQ, CuK, VARLEN)
            n_full, n_tiles, causal_off = _key_tiles(m0, sq, sk, BM, BN, CAUSAL)
            row0 = m0 + C * ROWS
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.full([ROWS], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
            o = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
            rows_here = True  # dense: every item has rows and keys (refusal())
            busy = True
            if VARLEN:  # items past the sequence's rows are skipped; rows that see no key store 0 / -inf
                rows_here = m0 < sq
                busy = rows_here & (n_tiles > 0)
            if busy:
                o, m_i, l_i = _attend(q, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o,
                                      m_i, l_i, qk_scale, rows, base, nq, n_full, n_tiles, sk, causal_off, C, ROWS,
                                      BN, STAGES, s_layout, o_layout, p_layout, CAUSAL)
                base += n_tiles
                nq += 1
            if rows_here:
                _store(o, m_i, l_i, O, LSE, b, h, q_start, row0, sq, stride_ob, stride_os, stride_oh, lse_b, lse_h,
                       ROWS, HEAD_DIM, o_layout, WRITE_LSE)

    @gluon.jit(do_not_specialize=RUNTIME_INTS)
    def prefill_kernel(q_desc, k_desc, v_desc, Kc, Vc, BlockTable, O, LSE, CuQ, CuK, qk_scale, Sq, Sk, Hq, B, GROUP,
                        stride_ob, stride_os, stride_oh, lse_b, lse_h, stride_qt, stride_qh, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_kb, stride_vb, stride_bt, stride_bp, HEAD_DIM: gl.constexpr,
                        BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        WRITE_LSE: gl.constexpr, VARLEN: gl.constexpr, PAGE: gl.constexpr, CHUNK: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Persistent: a grid of at most one program per SM, each looping over its work items
        (:func:`_schedule`). Dense: descriptors over ``[B, S, H, D]`` with ``[1, rows, 1, D]`` boxes
        (Q: ``BM // 2`` rows, K/V: ``BN``), ``Kc``/``Vc``/``BlockTable``/``CuQ``/``CuK`` None and the
        token strides unused. ``VARLEN``: q/k/v are the packed ``[total, H, D]`` tensors themselves with
        their token and head strides, ``Sq``/``Sk`` the longest lengths, and ``cu_seqlens`` say where
        each sequence is. ``PAGE`` (with ``VARLEN``; 0: not paged): K/V are the caches ``Kc``/``Vc``
        (``[blocks, PAGE, Hkv, D]``; token strides within a page, block strides), ``k_desc``/``v_desc``
        host descriptors over them with ``[1, CHUNK, 1, D]`` boxes, ``BlockTable`` each sequence's pages
        (strides by sequence and by page). ``qk_scale`` = softmax scale x log2(e)."""
        ROWS: gl.constexpr = BM // 2
        gl.static_assert(ROWS == 64)  # a consumer is one warpgroup: 16 rows per warp
        if VARLEN:
            dtype: gl.constexpr = q_desc.dtype.element_ty
        else:
            dtype: gl.constexpr = q_desc.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], dtype)

        q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM], kv_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):  # consumer c's Q slot
            mbarrier.init(q_ready.index(c), count=1)
            mbarrier.init(q_empty.index(c), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # a slot is free once both consumers arrived
            mbarrier.init(v_empty.index(i), count=2)

        # The argument tuples are written out inline: Triton 3.6's code generator turns the constexpr
        # elements of a tuple held in a variable (or concatenated) into int32 tensors.
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, CuQ,
                         CuK, qk_scale, Sq, Sk, Hq, B, stride_ob, stride_os, stride_oh, lse_b, lse_h, 0, ROWS,
                         HEAD_DIM, BM, BN, STAGES, CAUSAL, WRITE_LSE, VARLEN)),
            (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, CuQ,
                         CuK, qk_scale, Sq, Sk, Hq, B, stride_ob, stride_os, stride_oh, lse_b, lse_h, 1, ROWS,
                         HEAD_DIM, BM, BN, STAGES, CAUSAL, WRITE_LSE, VARLEN)),
            (_loader, (q_desc, k_desc, v_desc, Kc, Vc, BlockTable, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                       v_ready, k_empty, v_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_vt, stride_vh, stride_kb, stride_vb, stride_bt, stride_bp, ROWS, HEAD_DIM, BM,
                       BN, STAGES, CAUSAL, VARLEN, PAGE, CHUNK)),
        ], [ROWS // 16, 1], [CONSUMER_REGS, LOADER_REGS])


def kernel_config(head_dim: int, causal: bool, write_lse: bool, dtype: torch.dtype, varlen: bool = False,
                  page: int = 0) -> tuple:
    """What a launch for these values compiles: ``(constexprs, options, q block, k/v block, q layout,
    k/v layout)`` (the blocks and layouts of the host descriptors: dense Q/K/V, or the paged K/V
    caches with ``page``). Shared by the launcher and the sm90 compile check
    (tools/gluon_compile_check.py)."""
    chunk = min(page, BLOCK_N)
    consts = dict(HEAD_DIM=head_dim, BM=BLOCK_M, BN=BLOCK_N, STAGES=STAGES[head_dim], CAUSAL=causal,
                  WRITE_LSE=write_lse, VARLEN=varlen or page > 0, PAGE=page, CHUNK=chunk,
                  CONSUMER_REGS=CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS)
    options = dict(num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS)
    q_block, kv_block = [1, BLOCK_M // 2, 1, head_dim], [1, chunk if page else BLOCK_N, 1, head_dim]
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, gl_dtype)
    return consts, options, q_block, kv_block, q_layout, kv_layout
