"""The Gluon kernel of :mod:`pagedflash.ops.prefill_hopper`: a persistent, warp-specialized
FlashAttention forward for Hopper (sm90), FlashAttention-3's design as Gluon spells it (TMA, mbarriers,
async wgmma, warp specialization).

- Persistent: about one program per SM loops over work items of 128 query rows of one head, a
  head's row blocks next to each other (they run together and share its K/V in L2), the last
  first. Items go out in rounds, alternately left to right and right to left, which evens out the
  key tiles per program under causal masking (the host's ``programs()`` picks the count).
- Two 1-warp load partitions stream each item's tiles through TMA, one K's (and Q), one V's: the
  128-key tiles into rings of ``STAGES`` shared-memory slots whose index runs on across items, Q
  into one slot per consumer; each slot has a "ready" mbarrier (the copy's bytes landed) and an
  "empty" one (its readers are done with it; with fp8 K/V the rings the loaders fill are the
  converter's, below). The next item's Q and first K/V tiles land while the consumers finish the
  last item's ``P V`` and store.
- Two 4-warp consumer partitions take 64 rows each and read the same rings. Each keeps the wgmma of
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
- Varlen (packed ``[total, H, D]`` with ``cu_seqlens``; ``VARLEN``): the loaders make each item's
  Q/K/V descriptors on the device over its sequence's rows of its heads (zero fill past the
  sequence, as dense has), after the copies through the last item's have landed; items past a
  sequence's rows are skipped and items whose rows see no key store 0 / -inf, by every partition
  alike.
- Paged K/V (``PAGE``, with varlen Q): a key tile is ``128 / CHUNK`` copies of ``CHUNK = min(PAGE,
  128)`` rows through host descriptors over the caches ``[blocks, PAGE, Hkv, D]``, at the pages the
  block table names (each loader reads them once a tile); the chunks that reach past a sequence's last
  key go through descriptors made on the device over its last page's rows up to that key, so a
  page's stale rows (NaN, or another sequence's values) are zero fill.
- fp8 K/V (``KV8``, varlen or paged, with bf16/fp16 q): the loaders' copies land in rings of fp8
  tiles; a convert partition (a warpgroup) turns each into fp16 in a second pair of rings (one instruction a
  pair, exact), which the consumers read as above, their dots in fp16: a bf16 Q tile is rewritten in
  place as fp16, scaled by a power of two into fp16's range (exact; the scale joins the score
  scale), and P is fp16. The key descale of the item's KV head joins the score scale, the value
  descale the output's.
- The output (and the natural-log LSE) leave through masked pointer stores: any ``out`` strides
  with a contiguous last dim.
- Batch-invariant mode (``INVARIANT``): the mode's key tiles (64 keys, in rings twice as deep, or
  128), the softmax by the portable kernel's EXACT step, and at each split of the mode's rule
  (``SPLIT_N``, ``HEAD_N``, ``HEAD_KEYS``, ``MID_N``, ``MID_KEYS``:
  :func:`pagedflash.ops.attention_tiles.split_start`) a fresh state, the ended split finalized and
  merged into the row's by the portable kernel's own functions: a row's output and LSE bit for bit the
  portable kernel's
  (:func:`pagedflash.ops.prefill_hopper_attend._attend_invariant`). Over fp8 K/V as the portable kernel
  does it in the mode: a bf16 Q tile scaled by a power of two a row, the value descale applied to each
  split's output (``prefill_hopper.INVARIANT_FP8`` off sends these calls to the portable kernel).

The helpers every partition shares (the item schedule, one softmax step, the store, the loads) are
in :mod:`pagedflash.ops.prefill_hopper_tiles`, the consumers' walk over an item's key tiles in
:mod:`pagedflash.ops.prefill_hopper_attend`.

Written against Triton 3.6's Gluon API, which is experimental and changes between releases (3.9
renamed the TMA copies); on any other Triton, under the interpreter and off NVIDIA the module
imports, defines no kernel, and :data:`UNAVAILABLE` says why. ``tools/gluon_compile_check.py``
compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton

from pagedflash.ops.launch import SplitRule, invariant_config
from pagedflash.ops.utils import interpreted

BLOCK_M = 128  # query rows per program: two consumers of 64
BLOCK_N = 128  # keys per K/V tile
INVARIANT_BLOCK_N = (64, 128)  # the batch-invariant mode's key tiles the variant takes (invariant_block_n)
STAGES = {64: 3, 128: 2}  # K/V ring depth by head dim (shared memory: Q + STAGES x (K + V) tiles, fp8 twice)
NUM_WARPS = 4  # the default partition (consumer 0); consumer 1, the two loaders (and the converter) are workers
MAX_REGISTERS = 168  # per thread before the partitions rebalance (setmaxnreg)
CONSUMER_REGISTERS, LOADER_REGISTERS = 240, 24
# fp8 K/V: a fourth worker partition, a warpgroup, converts each landed fp8 tile to fp16 in shared
# memory (wgmma takes 16-bit operands of one type; fp8 -> fp16 is one instruction a pair, exact). Four
# warpgroups start with 128 registers a thread; the consumers give some up for it (setmaxnreg:
# consumer 0 gets what is left, at least as much as consumer 1).
CONVERT_WARPS, CONVERT_REGISTERS, FP8_CONSUMER_REGISTERS, FP8_MAX_REGISTERS = 4, 56, 216, 128


# The kernel's integer arguments (the launcher passes them by name). Triton compiles a kernel anew for
# each class of an integer argument (1, a multiple of 16, other) it meets unless told not to: those in
# RUNTIME_INTS vary from call to call (a serving step's lengths, batch and block-table width) and are
# never specialized; the others are fixed by a model's shapes.
INT_ARGS = ("Sq", "Sk", "Hq", "B", "GROUP", "stride_ob", "stride_os", "stride_oh", "lse_b", "lse_h", "stride_qt",
            "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kb", "stride_vb", "stride_bt",
            "stride_bp", "stride_kds", "stride_vds")
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
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - the launcher's

        from pagedflash.ops.prefill_hopper_attend import _attend, _attend_invariant
        from pagedflash.ops.prefill_hopper_tiles import (
            _item,
            _key_tiles,
            _load,
            _load_kv,
            _page_ids,
            _rows,
            _schedule,
            _sequence,
            _store,
            _store_rows,
        )
    except ImportError as e:
        UNAVAILABLE = f"triton {triton.__version__} without the Gluon Hopper API ({e})"
    else:
        GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
                     torch.float8_e5m2: gl.float8e5}
        COMPILE_ERRORS = (CompilationError, *(getattr(triton.runtime.errors, name) for name in
                                               ("PTXASError", "OutOfResources")
                                               if hasattr(triton.runtime.errors, name)))

if UNAVAILABLE is None:
    @gluon.jit
    def _loader(q_desc, x_desc, Xc, BlockTable, q_smem, x_smem, q_ready, q_empty, x_ready, x_empty, CuQ, CuK, Sq,
                Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_xt, stride_xh, stride_xb, stride_bt, stride_bp,
                ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, PAGE: gl.constexpr,
                CHUNK: gl.constexpr, LOAD_Q: gl.constexpr):
        """A load partition (one warp): for each work item, the key tiles of one of K or V (``x``) into
        its ring, and with ``LOAD_Q`` (the K loader) both consumers' Q after tile 0 (each once its
        consumer has finished the last item's). The ring's index runs on across items, so the next
        item's first tiles land while the consumers finish the last one; K and V each have a loader, so
        the copies of a paged tile (``128 / CHUNK`` each) issue from two chains. ``VARLEN``: the
        descriptors are made here, per item, over its sequence's rows of its heads (zero fill past the
        sequence), each once this loader's copies through the last item's have landed (a descriptor is
        rewritten in place). ``PAGE``: the cache ``Xc``'s pages through the host's descriptor
        (``x_desc``), but for the chunks reaching past the sequence's last key, which go through one
        made here over its last page (:func:`_load_kv`)."""
        q_layout: gl.constexpr = q_smem.layout
        x_layout: gl.constexpr = x_smem.layout
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
                qd = q_desc
                xd = x_desc
                xt = x_desc
                tail_start = 0
                if VARLEN:
                    if nq > 0:
                        if LOAD_Q:
                            for c in gl.static_range(2):
                                mbarrier.wait(q_ready.index(c), (nq - 1) & 1)
                        for idx in range(gl.maximum(it - STAGES, prev), it):
                            mbarrier.wait(x_ready.index(idx % STAGES), (idx // STAGES) & 1)
                    if LOAD_Q:
                        qd = _rows(q_desc, q_start, h, sq, stride_qt, stride_qh, ROWS, HEAD_DIM, q_layout)
                    if PAGE > 0:
                        last_page = (sk - 1) // PAGE
                        tail_start = last_page * PAGE
                        blk = gl.load(BlockTable + b * stride_bt + last_page * stride_bp).to(gl.int64)
                        xt = _rows(Xc + blk * stride_xb, 0, kv_head, sk - tail_start, stride_xt, stride_xh, CHUNK,
                                   HEAD_DIM, x_layout)
                    else:
                        xd = _rows(x_desc, k_start, kv_head, sk, stride_xt, stride_xh, BN, HEAD_DIM, x_layout)
                        xt = xd
                for j in range(n_tiles):
                    ids = 0
                    if PAGE > 0:
                        ids = _page_ids(BlockTable, b, j, sk, stride_bt, stride_bp, PAGE, CHUNK, BN)
                    _load_kv(xd, xt, x_smem, x_ready, x_empty, it + j, b, j, kv_head, sk, tail_start, ids, STAGES, BN,
                             HEAD_DIM, VARLEN, PAGE, CHUNK)
                    if LOAD_Q:
                        if j == 0:
                            for c in gl.static_range(2):
                                _load(qd, q_smem, q_ready, q_empty, c, nq & 1, b, m0 + c * ROWS, h, ROWS, HEAD_DIM,
                                      VARLEN)
                prev = it
                it += n_tiles
                nq += 1

    @gluon.jit
    def _convert(src, dst, landed, src_free, converted, dst_free, idx, STAGES: gl.constexpr, layout: gl.constexpr):
        """Convert the fp8 tile of ring index ``idx`` (``src``, once its copy landed) into ``dst`` (fp16;
        once the consumers are done with that slot's last tile), the whole tile at once (in halves or
        quarters it measured 3-14 % slower: a barrier between each part's loads and stores); then free
        the fp8 slot for its loader and hand the converted one to the consumers."""
        slot = idx % STAGES
        phase = (idx // STAGES) & 1
        mbarrier.wait(landed.index(slot), phase)
        mbarrier.wait(dst_free.index(slot), phase ^ 1)
        x = src.index(slot).load(layout)
        dst.index(slot).store(x.to(dst.dtype))
        fence_async_shared()  # these generic-proxy stores before the consumers' wgmma (async proxy) reads
        gl.thread_barrier()  # every warp's rows are in before one thread arrives
        mbarrier.arrive(src_free.index(slot))
        mbarrier.arrive(converted.index(slot))

    @gluon.jit
    def _converter(k8_smem, v8_smem, k_smem, v_smem, k8_ready, v8_ready, k8_empty, v8_empty, k_ready, v_ready,
                   k_empty, v_empty, CuQ, CuK, Sq, Sk, Hq, B, HEAD_DIM: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                   WARPS: gl.constexpr):
        """The convert partition (fp8 K/V): the items' key tiles in order (K_j, then V_j), each from
        the fp8 ring its loader fills into the 16-bit ring the consumers read, slot for slot
        (:func:`_convert`). Exact: every fp8 value is one in fp16."""
        # 8 elements a thread (one 16-byte fp16 store), a warp's threads along whole rows: the stores
        # into the swizzled 16-bit ring are free of bank conflicts (docs/performance.md v26)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [WARPS, 1], [1, 0])
        n_m, count = _schedule(Sq, Hq, B, BM)
        it = 0
        for i in range(count):
            b, h, m0 = _item(i, n_m, Hq, BM)
            _, sq, _, sk = _sequence(b, Sq, Sk, CuQ, CuK, VARLEN)
            _, n_tiles, _ = _key_tiles(m0, sq, sk, BM, BN, CAUSAL)
            if VARLEN:  # the items the loaders skip
                n_tiles = gl.where((m0 < sq) & (n_tiles > 0), n_tiles, 0)
            for j in range(n_tiles):
                _convert(k8_smem, k_smem, k8_ready, k8_empty, k_ready, k_empty, it + j, STAGES, layout)
                _convert(v8_smem, v_smem, v8_ready, v8_empty, v_ready, v_empty, it + j, STAGES, layout)
            it += n_tiles

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, CuQ, CuK,
                  KDescale, VDescale, qk_scale, Sq, Sk, Hq, B, GROUP, stride_ob, stride_os, stride_oh, lse_b, lse_h,
                  stride_kds, stride_vds, C: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  WRITE_LSE: gl.constexpr, VARLEN: gl.constexpr, INVARIANT: gl.constexpr, SPLIT_N: gl.constexpr,
                  HEAD_N: gl.constexpr, HEAD_KEYS: gl.constexpr, MID_N: gl.constexpr, MID_KEYS: gl.constexpr):
        """Consumer ``C``: for each work item, rows ``m0 + C * ROWS ..`` (:func:`_attend`), then the
        store. ``VARLEN``: an item past its sequence's rows is skipped, and one whose rows see no key
        stores 0 (LSE -inf) without waiting on the loaders, which (and the converter)
        skip both alike. ``KDescale`` /
        ``VDescale`` (fp8 K/V, or None): the KV head's descale (head stride 0: one for all) joins the
        score scale / the output's."""
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
            scale = qk_scale  # the mode: the softmax scale itself (x the key descale, as the portable kernel)
            o_scale = 1.0
            if KDescale is not None:
                scale = qk_scale * gl.load(KDescale + (h // GROUP) * stride_kds)
            if VDescale is not None:
                o_scale = gl.load(VDescale + (h // GROUP) * stride_vds)
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
            if INVARIANT:  # rows that see no key: 0 / -inf, as the portable kernel's merge of no split gives
                lse = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, o_layout))
                if busy:
                    o, lse = _attend_invariant(q, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                                               v_empty, scale, o_scale, rows, base, nq, n_full, n_tiles, sk,
                                               causal_off, C, ROWS, HEAD_DIM, BN, STAGES, s_layout, o_layout,
                                               p_layout, CAUSAL, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS,
                                               VDescale is not None)
                    base += n_tiles
                    nq += 1
                if rows_here:
                    _store_rows(o, lse, O, LSE, b, h, q_start, row0, sq, stride_ob, stride_os, stride_oh, lse_b,
                                lse_h, ROWS, HEAD_DIM, o_layout, WRITE_LSE)
            else:
                if busy:
                    o, m_i, l_i = _attend(q, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o,
                                          m_i, l_i, scale, rows, base, nq, n_full, n_tiles, sk, causal_off, C, ROWS,
                                          BN, STAGES, s_layout, o_layout, p_layout, CAUSAL)
                    base += n_tiles
                    nq += 1
                if rows_here:
                    _store(o, m_i, l_i, O, LSE, b, h, q_start, row0, sq, stride_ob, stride_os, stride_oh, lse_b,
                           lse_h, o_scale, ROWS, HEAD_DIM, o_layout, WRITE_LSE)

    @gluon.jit(do_not_specialize=RUNTIME_INTS)
    def prefill_kernel(q_desc, k_desc, v_desc, Kc, Vc, BlockTable, O, LSE, CuQ, CuK, KDescale, VDescale, qk_scale, Sq,
                        Sk, Hq, B, GROUP, stride_ob, stride_os, stride_oh, lse_b, lse_h, stride_qt, stride_qh,
                        stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb, stride_bt, stride_bp,
                        stride_kds, stride_vds, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, VARLEN: gl.constexpr,
                        PAGE: gl.constexpr, CHUNK: gl.constexpr, KV8: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        LOADER_REGS: gl.constexpr, CONVERT_WARPS: gl.constexpr, CONVERT_REGS: gl.constexpr,
                        INVARIANT: gl.constexpr, SPLIT_N: gl.constexpr, HEAD_N: gl.constexpr,
                        HEAD_KEYS: gl.constexpr, MID_N: gl.constexpr, MID_KEYS: gl.constexpr):
        """Persistent: a grid of at most one program per SM, each looping over its work items
        (:func:`_schedule`). Dense: descriptors over ``[B, S, H, D]`` with ``[1, rows, 1, D]`` boxes
        (Q: ``BM // 2`` rows, K/V: ``BN``), ``Kc``/``Vc``/``BlockTable``/``CuQ``/``CuK`` None and the
        token strides unused. ``VARLEN``: q/k/v are the packed ``[total, H, D]`` tensors themselves with
        their token and head strides, ``Sq``/``Sk`` the longest lengths, and ``CuQ``/``CuK`` each
        sequence's ``(start, end)`` rows (int32 ``[B, 2]``, :func:`pagedflash.ops.metadata.varlen_bounds`:
        ``(0, 0)`` for a sequence with invalid metadata, which the kernel then skips). ``PAGE`` (with ``VARLEN``; 0: not paged): K/V are the caches ``Kc``/``Vc``
        (``[blocks, PAGE, Hkv, D]``; token strides within a page, block strides), ``k_desc``/``v_desc``
        host descriptors over them with ``[1, CHUNK, 1, D]`` boxes, ``BlockTable`` each sequence's pages
        (strides by sequence and by page). ``qk_scale`` = softmax scale x log2(e). ``KV8`` (with
        ``VARLEN``): K/V are fp8; the loaders fill rings of fp8 tiles that the convert partition turns
        into the fp16 rings the consumers read, and ``KDescale``/``VDescale`` (fp32, or None for 1.0;
        per KV head with strides ``stride_kds``/``stride_vds``, or one with stride 0) scale the real keys
        and values. ``INVARIANT``: the batch-invariant variant (``BN`` the mode's key tile, 64 or 128
        keys) under the split rule of ``SPLIT_N`` .. ``MID_KEYS``
        (:func:`pagedflash.ops.attention_tiles.split_start`'s);
        ``qk_scale`` is then the softmax scale itself (the kernel forms the portable kernel's products)."""
        ROWS: gl.constexpr = BM // 2
        gl.static_assert(ROWS == 64)  # a consumer is one warpgroup: 16 rows per warp
        if VARLEN:
            dtype: gl.constexpr = q_desc.dtype.element_ty
        else:
            dtype: gl.constexpr = q_desc.dtype
        if KV8:  # the dots run in fp16 (fp8 converts to it exactly; bf16 q is rescaled into its range)
            mma_dtype: gl.constexpr = gl.float16
        else:
            mma_dtype: gl.constexpr = dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], mma_dtype)

        q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(mma_dtype, [STAGES, BN, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(mma_dtype, [STAGES, BN, HEAD_DIM], kv_layout)
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
        if KV8:
            if PAGE > 0:
                kv8_dtype: gl.constexpr = Kc.dtype.element_ty
            else:
                kv8_dtype: gl.constexpr = k_desc.dtype.element_ty
            kv8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], kv8_dtype)
            k8_smem = gl.allocate_shared_memory(kv8_dtype, [STAGES, BN, HEAD_DIM], kv8_layout)
            v8_smem = gl.allocate_shared_memory(kv8_dtype, [STAGES, BN, HEAD_DIM], kv8_layout)
            k8_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v8_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k8_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v8_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(k8_ready.index(i), count=1)
                mbarrier.init(v8_ready.index(i), count=1)
                mbarrier.init(k8_empty.index(i), count=1)  # freed by the convert partition
                mbarrier.init(v8_empty.index(i), count=1)
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE,
                             CuQ, CuK, KDescale, VDescale, qk_scale, Sq, Sk, Hq, B, GROUP, stride_ob, stride_os,
                             stride_oh, lse_b, lse_h, stride_kds, stride_vds, 0, ROWS, HEAD_DIM, BM, BN, STAGES,
                             CAUSAL, WRITE_LSE, VARLEN, INVARIANT, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE,
                             CuQ, CuK, KDescale, VDescale, qk_scale, Sq, Sk, Hq, B, GROUP, stride_ob, stride_os,
                             stride_oh, lse_b, lse_h, stride_kds, stride_vds, 1, ROWS, HEAD_DIM, BM, BN, STAGES,
                             CAUSAL, WRITE_LSE, VARLEN, INVARIANT, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS)),
                (_loader, (q_desc, k_desc, Kc, BlockTable, q_smem, k8_smem, q_ready, q_empty, k8_ready,
                           k8_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_kt, stride_kh,
                           stride_kb, stride_bt, stride_bp, ROWS, HEAD_DIM, BM, BN, STAGES, CAUSAL, VARLEN, PAGE,
                           CHUNK, True)),
                (_loader, (q_desc, v_desc, Vc, BlockTable, q_smem, v8_smem, q_ready, q_empty, v8_ready,
                           v8_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_vt, stride_vh,
                           stride_vb, stride_bt, stride_bp, ROWS, HEAD_DIM, BM, BN, STAGES, CAUSAL, VARLEN, PAGE,
                           CHUNK, False)),
                (_converter, (k8_smem, v8_smem, k_smem, v_smem, k8_ready, v8_ready, k8_empty, v8_empty, k_ready,
                              v_ready, k_empty, v_empty, CuQ, CuK, Sq, Sk, Hq, B, HEAD_DIM, BM, BN, STAGES, CAUSAL,
                              VARLEN, CONVERT_WARPS)),
            ], [ROWS // 16, 1, 1, CONVERT_WARPS], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS, CONVERT_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE,
                             CuQ, CuK, KDescale, VDescale, qk_scale, Sq, Sk, Hq, B, GROUP, stride_ob, stride_os,
                             stride_oh, lse_b, lse_h, stride_kds, stride_vds, 0, ROWS, HEAD_DIM, BM, BN, STAGES,
                             CAUSAL, WRITE_LSE, VARLEN, INVARIANT, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE,
                             CuQ, CuK, KDescale, VDescale, qk_scale, Sq, Sk, Hq, B, GROUP, stride_ob, stride_os,
                             stride_oh, lse_b, lse_h, stride_kds, stride_vds, 1, ROWS, HEAD_DIM, BM, BN, STAGES,
                             CAUSAL, WRITE_LSE, VARLEN, INVARIANT, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS)),
                (_loader, (q_desc, k_desc, Kc, BlockTable, q_smem, k_smem, q_ready, q_empty, k_ready,
                           k_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_kt, stride_kh,
                           stride_kb, stride_bt, stride_bp, ROWS, HEAD_DIM, BM, BN, STAGES, CAUSAL, VARLEN, PAGE,
                           CHUNK, True)),
                (_loader, (q_desc, v_desc, Vc, BlockTable, q_smem, v_smem, q_ready, q_empty, v_ready,
                           v_empty, CuQ, CuK, Sq, Sk, Hq, B, GROUP, stride_qt, stride_qh, stride_vt, stride_vh,
                           stride_vb, stride_bt, stride_bp, ROWS, HEAD_DIM, BM, BN, STAGES, CAUSAL, VARLEN, PAGE,
                           CHUNK, False)),
            ], [ROWS // 16, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])


def invariant_block_n(head_dim: int) -> int:
    """The batch-invariant mode's key tile at ``head_dim`` on sm90, which its variant's K/V tiles take
    (:func:`pagedflash.ops.launch.invariant_config`: 64 keys unless ``PAGEDFLASH_INVARIANT_TILE`` says)."""
    return invariant_config(group=1, head_dim=head_dim, capability=(9, 0), interpreted=False, prefill=True).block_n


def kernel_config(head_dim: int, causal: bool, write_lse: bool, dtype: torch.dtype, varlen: bool = False,
                  page: int = 0, kv_dtype: torch.dtype | None = None, rule: SplitRule | None = None) -> tuple:
    """What a launch for these values compiles: ``(constexprs, options, q block, k/v block, q layout,
    k/v layout)`` (the blocks and layouts of the host descriptors: dense Q/K/V, or the paged K/V
    caches with ``page``). ``kv_dtype``: K/V's dtype where it is not q's (fp8, with ``varlen`` or
    ``page``). ``rule``: the batch-invariant variant with this split rule: the mode's key
    tiles (:func:`invariant_block_n`), in rings as much deeper as they are narrower (the same shared
    memory). Shared by the launcher and the sm90 compile check (tools/gluon_compile_check.py)."""
    bn = BLOCK_N if rule is None else invariant_block_n(head_dim)
    assert rule is None or bn in INVARIANT_BLOCK_N, f"a {bn}-key tile: the variant takes {INVARIANT_BLOCK_N}"
    chunk = min(page, bn)
    kv8 = kv_dtype is not None and kv_dtype != dtype
    consts = dict(HEAD_DIM=head_dim, BM=BLOCK_M, BN=bn, STAGES=STAGES[head_dim] * (BLOCK_N // bn), CAUSAL=causal,
                  WRITE_LSE=write_lse, VARLEN=varlen or page > 0, PAGE=page, CHUNK=chunk, KV8=kv8,
                  CONSUMER_REGS=FP8_CONSUMER_REGISTERS if kv8 else CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS,
                  CONVERT_WARPS=CONVERT_WARPS, CONVERT_REGS=CONVERT_REGISTERS, INVARIANT=rule is not None)
    rule = rule or SplitRule(bn)  # (unused off the mode)
    consts.update(SPLIT_N=rule.keys, HEAD_N=rule.head_split, HEAD_KEYS=rule.head_keys, MID_N=rule.mid_split,
                  MID_KEYS=rule.mid_end)
    options = dict(num_warps=NUM_WARPS, maxnreg=FP8_MAX_REGISTERS if kv8 else MAX_REGISTERS)
    q_block, kv_block = [1, BLOCK_M // 2, 1, head_dim], [1, chunk if page else bn, 1, head_dim]
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, GL_DTYPES[dtype])
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, GL_DTYPES[kv_dtype if kv8 else dtype])
    return consts, options, q_block, kv_block, q_layout, kv_layout
