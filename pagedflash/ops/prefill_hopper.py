"""Prefill on Hopper (sm90): a persistent, warp-specialized FlashAttention forward written in Gluon.

:func:`pagedflash.flash_attn_func` launches this kernel instead of the portable one
(:mod:`pagedflash.ops.attention`) where :func:`refusal` finds nothing against it: an NVIDIA GPU of
compute capability 9.0, compiled (not interpreted), Triton 3.6's Gluon, fp16/bf16, a head dim and
sizes where it measured faster (:data:`MIN_SEQLEN`), no window, softcap or sinks, 16-byte aligned
operands. :func:`pagedflash.flash_attn_varlen_func` over packed (not paged) K/V does too where
:func:`refusal_varlen` finds nothing; it ignores
``num_splits``, which never changes a result. Everything else, and every call with
``PAGEDFLASH_GLUON=0``, takes the portable kernel, which stays the tested fallback.

The kernel (FlashAttention-3's design as Gluon spells it: TMA, mbarriers, async wgmma, warp
specialization):

- Persistent: about one program per SM loops over work items of 128 query rows of one head, a
  head's row blocks next to each other (they run together and share its K/V in L2), the last
  first. Items go out in rounds, alternately left to right and right to left, which evens out the
  key tiles per program under causal masking (:func:`programs`).
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
- Q, K and V load through rank-4 descriptors over ``[B, S, H, D]`` with boxes ``[1, rows, 1, D]``:
  rows past a sequence's end are zero-filled by the copy engine, never read from the next
  sequence, so a ragged last tile needs no batch-size rule (a NaN or inf in another sequence's V
  cannot reach this one's ``P V``, where its probability 0 would not cancel it). Query rows past
  ``Sq`` are zeros too; their results are never stored. Any strides with a contiguous last dim
  and 16-byte multiples elsewhere work.
- The output (and the natural-log LSE) leave through masked pointer stores: any ``out`` strides
  with a contiguous last dim.
- Varlen (packed ``[total, H, D]`` with ``cu_seqlens``, :func:`refusal_varlen`): the same kernel
  with ``VARLEN``. The
  loader makes each item's Q/K/V descriptors on the device over its sequence's rows of its heads
  (zero fill past the sequence, as dense has), after the copies through the last item's have
  landed; items past a sequence's rows are skipped and items whose rows see no key store 0 / -inf,
  by every partition alike.

Measured on an H200 (bf16, 16K tokens a launch, Hq·D = 2048, against the portable kernel and cuDNN
in the same run): docs/performance.md, v20 and v22 (persistent). Written against Triton 3.6's Gluon API, which is
experimental and changes between releases (3.9 renamed the TMA copies); on any other Triton, under
the interpreter and off NVIDIA the module imports, defines no kernel, and :data:`UNAVAILABLE` says
why.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton

from pagedflash.ops._jit import LOG2E
from pagedflash.ops.attention import ensure_tma_allocator
from pagedflash.ops.utils import PlanCache, cdiv, descriptor_aligned, interpreted, num_sms, nvidia_capability

# PAGEDFLASH_GLUON=0 sends every call to the portable kernel (tests flip this flag too).
ENABLED = os.environ.get("PAGEDFLASH_GLUON", "1") != "0"

# Where the Gluon kernel measured at least as fast as the portable kernel (docs/performance.md, v22:
# bf16, B·S = 16K tokens with Sq = Sk = S in 256 .. 2K, Hq·D = 2048, at least 2048 work items a
# launch), by (head dim, causal): the shortest Sq and Sk routed. The kernel is faster in every
# measured cell, by 1.08x (D=64 non-causal 2K) to 1.57x (D=128 non-causal 256).
# Shorter lengths were not measured and stay portable; fp16 follows bf16's rule.
MIN_SEQLEN = dict.fromkeys([(128, False), (128, True), (64, False), (64, True)], 256)
# The Gluon kernel never splits the key range; the portable one does when its grid has fewer
# programs than SMs. Launches of fewer work items than SMs (SMs left idle) were not measured: portable.
MIN_PROGRAMS_PER_SM = 1

BLOCK_M = 128  # query rows per program: two consumers of 64
BLOCK_N = 128  # keys per K/V tile
STAGES = {64: 3, 128: 2}  # K/V ring depth by head dim (shared memory: Q + STAGES x (K + V) tiles)
NUM_WARPS = 4  # the default partition (consumer 0); consumer 1 and the loader are worker warps
MAX_REGISTERS = 168  # per thread before the partitions rebalance (setmaxnreg)
CONSUMER_REGISTERS, LOADER_REGISTERS = 240, 24

UNAVAILABLE: str | None = None  # why the kernel is not defined here; None when it is
launches = 0  # Gluon launches so far (tests read it to see which path ran)


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
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError as e:
        UNAVAILABLE = f"triton {triton.__version__} without the Gluon Hopper API ({e})"
    else:
        _COMPILE_ERRORS = (CompilationError, *(getattr(triton.runtime.errors, name) for name in
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
    def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr):
        """The load partition: for each work item, K_0, both consumers' Q (once each has finished the
        last item's), V_0, then K_j and V_j; the K/V ring's index runs on across items, so the next
        item's first tiles land while the consumers finish the last one. ``VARLEN``: the descriptors
        are made here, per item, over its sequence's rows of its heads (zero fill past the sequence),
        each once the copies through the last item's have landed (a descriptor is rewritten in place)."""
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
                    qd = tma.make_tensor_descriptor(
                        q_desc + q_start.to(gl.int64) * stride_qt + h.to(gl.int64) * stride_qh, shape=[sq, HEAD_DIM],
                        strides=[stride_qt, 1], block_shape=[ROWS, HEAD_DIM], layout=q_smem.layout)
                    kd = tma.make_tensor_descriptor(
                        k_desc + k_start.to(gl.int64) * stride_kt + kv_head.to(gl.int64) * stride_kh,
                        shape=[sk, HEAD_DIM], strides=[stride_kt, 1], block_shape=[BN, HEAD_DIM],
                        layout=k_smem.layout)
                    vd = tma.make_tensor_descriptor(
                        v_desc + k_start.to(gl.int64) * stride_vt + kv_head.to(gl.int64) * stride_vh,
                        shape=[sk, HEAD_DIM], strides=[stride_vt, 1], block_shape=[BN, HEAD_DIM],
                        layout=v_smem.layout)
                else:
                    qd = q_desc
                    kd = k_desc
                    vd = v_desc
                _load(kd, k_smem, k_ready, k_empty, it % STAGES, (it // STAGES) & 1, b, 0, kv_head, BN, HEAD_DIM,
                      VARLEN)
                for c in gl.static_range(2):
                    _load(qd, q_smem, q_ready, q_empty, c, nq & 1, b, m0 + c * ROWS, h, ROWS, HEAD_DIM, VARLEN)
                _load(vd, v_smem, v_ready, v_empty, it % STAGES, (it // STAGES) & 1, b, 0, kv_head, BN, HEAD_DIM,
                      VARLEN)
                for j in range(1, n_tiles):
                    idx = it + j
                    _load(kd, k_smem, k_ready, k_empty, idx % STAGES, (idx // STAGES) & 1, b, j * BN, kv_head, BN,
                          HEAD_DIM, VARLEN)
                    _load(vd, v_smem, v_ready, v_empty, idx % STAGES, (idx // STAGES) & 1, b, j * BN, kv_head, BN,
                          HEAD_DIM, VARLEN)
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

    @gluon.jit
    def _prefill_kernel(q_desc, k_desc, v_desc, O, LSE, CuQ, CuK, qk_scale, Sq, Sk, Hq, B, GROUP, stride_ob, stride_os,
                        stride_oh, lse_b, lse_h, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, VARLEN: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Persistent: a grid of at most one program per SM, each looping over its work items
        (:func:`_schedule`). Dense: descriptors over ``[B, S, H, D]`` with ``[1, rows, 1, D]`` boxes
        (Q: ``BM // 2`` rows, K/V: ``BN``), ``CuQ``/``CuK`` None and the token strides unused.
        ``VARLEN``: q/k/v are the packed ``[total, H, D]`` tensors themselves with their token and head
        strides, ``Sq``/``Sk`` the longest lengths, and ``cu_seqlens`` say where each sequence is.
        ``qk_scale`` = softmax scale x log2(e)."""
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
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                       v_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                       stride_vh, ROWS, HEAD_DIM, BM, BN, STAGES, CAUSAL, VARLEN)),
        ], [ROWS // 16, 1], [CONSUMER_REGS, LOADER_REGS])


def kernel_config(head_dim: int, causal: bool, write_lse: bool, dtype: torch.dtype, varlen: bool = False) -> tuple:
    """What a launch for these values compiles: ``(constexprs, options, q block, k/v block, q layout,
    k/v layout)`` (the blocks and layouts of the dense launch's host descriptors). Shared by the
    launcher and the sm90 compile check (tools/gluon_compile_check.py)."""
    consts = dict(HEAD_DIM=head_dim, BM=BLOCK_M, BN=BLOCK_N, STAGES=STAGES[head_dim], CAUSAL=causal,
                  WRITE_LSE=write_lse, VARLEN=varlen, CONSUMER_REGS=CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS)
    options = dict(num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS)
    q_block, kv_block = [1, BLOCK_M // 2, 1, head_dim], [1, BLOCK_N, 1, head_dim]
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, gl_dtype)
    return consts, options, q_block, kv_block, q_layout, kv_layout


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int,
            softcap: float, sinks: torch.Tensor | None = None) -> str | None:
    """Why a validated dense call (:func:`pagedflash.flash_attn_func`'s operator arguments) does not
    take the Gluon kernel, or None when it does."""
    if not ENABLED:
        return "PAGEDFLASH_GLUON=0"
    if UNAVAILABLE is not None:
        return UNAVAILABLE
    batch, sq, hq, d = q.shape
    if window_right == 0 and sq > k.shape[1]:
        return "causal with Sq > Sk (rows that see no key)"
    return _refusal(q, k, v, batch, sq, k.shape[1], hq, k.shape[2], d, window_left, window_right, softcap, sinks)


def refusal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, max_seqlen_q: int,
                   max_seqlen_k: int, block_table: torch.Tensor | None, window_left: int, window_right: int,
                   softcap: float, sinks: torch.Tensor | None = None) -> str | None:
    """:func:`refusal` for a validated :func:`pagedflash.flash_attn_varlen_func` call; the longest
    lengths stand for the sequences' in the size rules."""
    if not ENABLED:
        return "PAGEDFLASH_GLUON=0"
    if UNAVAILABLE is not None:
        return UNAVAILABLE
    if block_table is not None:
        return "paged K/V"
    return _refusal(q, k, v, batch, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], window_left,
                    window_right, softcap, sinks)


def _refusal(q, k, v, batch: int, sq: int, sk: int, hq: int, hkv: int, d: int, window_left: int, window_right: int,
             softcap: float, sinks) -> str | None:
    causal = window_right == 0
    min_len = MIN_SEQLEN.get((d, causal))
    if min_len is None:
        return f"head dim {d} (routed: {sorted({dim for dim, _ in MIN_SEQLEN})})"
    if sk == 0:
        return "no keys"
    if min(sq, sk) < min_len:  # first among the rest: the common refusal (short prefill chunks) costs least
        return f"Sq={sq}, Sk={sk}: under the measured {min_len} for D={d}{' causal' if causal else ''}"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (fp16 or bf16 throughout only)"
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
    n_items, sms = cdiv(sq, BLOCK_M) * hq * batch, num_sms(q.device)
    if n_items < MIN_PROGRAMS_PER_SM * sms:
        return "fewer work items than SMs (the portable kernel splits the keys)"
    if n_items >= 2**31 - sms or cdiv(n_items, max(int(0.85 * sms), 1)) * cdiv(sk, BLOCK_N) >= 2**31:
        return "a program's work items or key tiles past int32"  # its ring index (programs() >= 85 % of sms)
    for name, t in (("q", q), ("k", k), ("v", v)):  # what a TMA descriptor takes
        if t.stride(-1) != 1 or min(t.stride()) <= 0 or not descriptor_aligned(t):
            return f"{name}: strides {t.stride()} / address not 16-byte multiples"
    return None


def programs(n_items: int, n_m: int, causal: bool, sms: int, sq: int, sk: int) -> int:
    """Programs of a launch over ``n_items`` work items, ``n_m`` row blocks per head. Non-causal
    items cost the same: one program per SM. A causal item costs its row block's key tiles, and how
    evenly the alternating rounds share them depends on the program count: at Sq = Sk every
    program's items pair up to ``n_m + 1`` tiles when ``n_m`` divides twice the count, and 16K rows
    of 16 heads leave the busiest of 132 programs 1.5x the mean, of 128 the mean. So a causal launch
    takes, of the counts from ``sms`` down to 85 % of it, the one whose busiest program ends first
    (the largest on a tie), stopping where even a perfect share of a smaller count could not."""
    if n_items <= sms:
        return n_items
    if not causal:
        return sms
    tiles = torch.clamp((torch.arange(1, n_m + 1, device="cpu") * BLOCK_M + sk - sq + BLOCK_N - 1) // BLOCK_N,
                        min=0, max=cdiv(sk, BLOCK_N)).double()  # key tiles of row block m
    t = torch.arange(n_items, device="cpu")
    cost = tiles[n_m - 1 - t % n_m]  # item t's key tiles (the kernel's _item order)
    total = cost.sum().item()

    def busiest(p: int) -> float:
        pid = torch.where(t // p % 2 == 0, t % p, p - 1 - t % p)  # the kernel's deal (_schedule)
        return torch.bincount(pid, weights=cost, minlength=p).max().item()

    best_p, best = sms, busiest(sms)
    for p in range(sms - 1, max(int(0.85 * sms), 1) - 1, -1):
        if best <= total / p:
            break
        if (load := busiest(p)) < best:
            best_p, best = p, load
    return best_p


class _Plan:
    """A launch for one call signature: what does not depend on the tensors' addresses."""

    __slots__ = ("grid", "consts", "options", "ints", "descs", "failed")


_PLANS = PlanCache()


def _make_plan(q, k, v, out, causal: bool, return_lse: bool, varlen: tuple | None) -> _Plan:
    consts, options, q_block, kv_block, q_layout, kv_layout = kernel_config(q.shape[-1], causal, return_lse, q.dtype,
                                                                            varlen is not None)
    plan = _Plan()
    if varlen is None:  # [B, S, H, D]: host descriptors; out and LSE by sequence
        batch, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        plan.ints = (sq, sk, hq, batch, hq // hkv, out.stride(0), out.stride(1), out.stride(2), hq * sq, sq,
                     0, 0, 0, 0, 0, 0)
        plan.descs = tuple((list(t.shape), list(t.stride()), block, layout)
                           for t, block, layout in ((q, q_block, q_layout), (k, kv_block, kv_layout),
                                                    (v, kv_block, kv_layout)))
    else:  # packed [total, H, D]: the kernel makes its descriptors; out and LSE [Hq, total_q] by token
        batch, sq, sk = varlen
        hq, hkv = q.shape[1], k.shape[1]
        plan.ints = (sq, sk, hq, batch, hq // hkv, 0, out.stride(0), out.stride(1), 0, q.shape[0],
                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        plan.descs = None
    n_m = cdiv(sq, BLOCK_M)
    plan.grid = (programs(n_m * hq * batch, n_m, causal, num_sms(q.device), sq, sk),)
    plan.consts, plan.options = consts, options
    plan.failed = False
    return plan


class Fallback(Exception):
    """The Gluon kernel failed to compile for this call's signature (warned once): the caller takes
    the portable kernel, for this call and every later one of the signature."""


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, sm_scale: float, causal: bool,
            return_lse: bool, varlen: tuple | None = None) -> torch.Tensor | None:
    """Attention of a call :func:`refusal` accepted, written into ``out``; returns the LSE
    ``[B, Hq, Sq]`` fp32 (natural log) with ``return_lse``, else None. ``varlen``: ``(cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a call :func:`refusal_varlen` accepted (q/k/v
    ``[total, H, D]``, LSE ``[Hq, total_q]``). Raises :class:`Fallback` where the kernel does not
    compile for the signature (the first time with a warning)."""
    global launches
    sizes = None if varlen is None else (varlen[0].shape[0] - 1, varlen[2], varlen[3])
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), q.dtype, q.device, causal,
           return_lse, sizes)
    plan = _PLANS.get(key) or _PLANS.add(key, _make_plan(q, k, v, out, causal, return_lse, sizes))
    if plan.failed:
        raise Fallback
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    if varlen is None:
        tensors = [TensorDescriptor(t, shape, strides, block, layout)
                   for t, (shape, strides, block, layout) in zip((q, k, v), plan.descs)] + [None, None]
    else:
        ensure_tma_allocator()  # the kernel's descriptors live in Triton's global scratch
        tensors = [q, k, v, varlen[0], varlen[1]]
    q_t, k_t, v_t, cu_q, cu_k = tensors
    try:
        _prefill_kernel[plan.grid](q_t, k_t, v_t, out, out if lse is None else lse, cu_q, cu_k,
                                   sm_scale * LOG2E.value, *plan.ints, **plan.consts, **plan.options)
    except _COMPILE_ERRORS as e:
        warnings.warn(f"pagedflash: the Gluon prefill kernel failed to compile ({type(e).__name__}: "
                      f"{str(e)[:200]}); this signature takes the portable kernel", stacklevel=4)
        plan.failed = True
        raise Fallback from e
    launches += 1
    return lse
