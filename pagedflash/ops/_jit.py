"""The @triton.jit pieces shared by every kernel: constants, the online-softmax step, score
transforms, masks, the first index of a maximum and the merge of two softmax states. Kernels import
these; nothing here launches.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) == exp2(x * LOG2E)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # ln(2):   log(x) == log2(x) * LN2
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
FLT_MIN: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # the least normal fp32
# 2^23: for 0 <= y < 2^22, (y + 2^23) - 2^23 is y rounded to an integer, ties to even (fp32 spacing is 1 there)
ROUND_TO_INT: tl.constexpr = tl.constexpr(8388608.0)
SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)  # the tanh GELU's sqrt(2 / pi)


@triton.jit
def soft_cap(s, softcap):
    """``softcap * tanh(s / softcap)`` to a few fp32 ulps for every cap >= fp32's smallest normal,
    written with exp2 and a polynomial so that it runs on every Triton target and in the interpreter.

    With ``x = s / softcap``: for ``|x| < 1/4`` the odd Taylor series ``s * (1 - x^2/3 + 2x^4/15 -
    17x^6/315 + 62x^8/2835)`` (truncation under 1e-8 relative; it never forms ``softcap - ...``, whose
    cancellation loses the score under a large cap), else ``sign(s) * softcap * (1 - t) / (1 + t)``
    with ``t = exp(-2|x|) <= e^-0.5`` (1 - t loses at most 2 bits)."""
    x = s * (1.0 / softcap)
    a = tl.minimum(tl.abs(x), 0.25)  # the series' range (keeps the unused branch finite)
    u = a * a
    series = s * (1.0 + u * (-0.3333333333333333 + u * (0.13333333333333333 + u * (-0.05396825396825397
                                                                                   + u * 0.021869488536155203))))
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    tail = softcap * ((1.0 - t) / (1.0 + t))
    return tl.where(tl.abs(x) < 0.25, series, tl.where(s < 0, -tail, tail))


@triton.jit
def visible(q_pos, k_pos, seqlen_k, delta, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which keys each query row may attend: ``[M, 1] x [1, N] -> [M, N]`` boolean.

    ``delta = Sk - Sq`` aligns the causal diagonal bottom-right (flash-attn's convention); causal is
    ``window_right == 0``."""
    ok = k_pos < seqlen_k
    if HAS_LEFT:
        ok = ok & (k_pos >= q_pos + delta - window_left)
    if HAS_RIGHT:
        ok = ok & (k_pos <= q_pos + delta + window_right)
    return ok


@triton.jit
def online_softmax_step(m_i, l_i, acc, s):
    """Fold one tile of scores ``s`` ``[M, N]`` (log2 domain, masked entries ``-inf``) into the
    running max ``m_i`` and sum ``l_i`` ``[M]``, rescaling ``acc`` ``[M, D]``.

    Returns the new state and the tile's probabilities ``p`` (to be multiplied into V by the caller).
    A row that has seen only masked keys keeps ``m = -inf`` and contributes exact zeros, never NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))  # explicit: every kernel rounds it alike
    acc = acc * alpha[:, None]
    return m_new, l_i, acc, p


@triton.jit
def online_softmax_step_scaled(m_i, l_i, acc, s, scale):
    """:func:`online_softmax_step` of the scores ``s * scale`` (``scale > 0``; masked entries of ``s``
    ``-inf``), computed so that an entry's bits do not depend on the code around it
    (:func:`softmax_probs_scaled`). ``scale`` is a scalar or a column ``[M, 1]`` (a scale per row)."""
    m_new, l_i, alpha, p = softmax_probs_scaled(m_i, l_i, s, scale)
    acc = acc * alpha[:, None]
    return m_new, l_i, acc, p


@triton.jit
def softmax_probs_scaled(m_i, l_i, s, scale):
    """:func:`online_softmax_step_scaled` but the accumulator's rescale, for a caller whose
    accumulator is laid out apart from the scores (the Gluon prefill kernel): ``(m, l, alpha, p)``.
    The row max of ``s`` is scaled once (rounding is monotonic, so it is the max of the scaled
    scores) and each probability is ``exp2(fma(s, scale, -max))``, one explicit fused multiply-add,
    which a compiler neither splits nor forms differently in a masked and an unmasked tile."""
    m_new = tl.maximum(m_i, tl.max(tl.max(s, 1)[:, None] * scale, 1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    p = tl.exp2(tl.fma(s, scale, -m_safe[:, None]))
    alpha = tl.exp2(m_i - m_safe)
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    return m_new, l_i, alpha, p


@triton.jit
def add_sink(m_i, l_i, acc, sink):
    """Fold one extra logit per row, ``sink`` ``[M]`` (log2 domain; ``-inf`` adds nothing), into the
    running state: it joins the softmax denominator and carries no value (attention sinks). A row
    that saw no key ends with ``m = sink``, ``l = 1``, ``acc = 0``: output 0, lse = sink."""
    m_i, l_i, acc, _ = online_softmax_step(m_i, l_i, acc, sink[:, None])
    return m_i, l_i, acc


@triton.jit
def finalize(m_i, l_i, acc):
    """Normalize the accumulator; return ``(out, lse)`` with lse in natural log. One reciprocal a row,
    a multiply an element (the batch-invariant mode finalizes every split so: a division an element
    would cost as much as a tile's softmax).

    Rows that saw no key (``l == 0``) give out 0 and lse ``-inf``."""
    empty = l_i == 0.0
    out = acc * (1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, NEG_INF, (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    return out, lse


@triton.jit
def round_to_fp8(x, MANT: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr):
    """fp32 ``x`` saturated at ``±MAX`` and rounded to the nearest value (ties to even) of an fp8
    format with ``MANT`` mantissa bits and smallest normal exponent ``EMIN`` (e4m3fn: 3, -6, 448;
    e5m2: 2, -14, 57344). The result is exactly representable in the format, so the conversion that
    stores it is exact on every backend and rounding mode (the interpreter's own fp32->fp8 rounding
    is not); finite input never gives NaN, and NaN stays NaN (:func:`to_fp8` stores its bits)."""
    a = tl.minimum(tl.abs(x), MAX)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)  # a's exponent, >= EMIN
    step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MANT): the format's spacing at a
    inv_step = ((127 - e + MANT) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv_step + ROUND_TO_INT) - ROUND_TO_INT) * step  # a / step < 2^(MANT + 1): exact steps
    return tl.where(x != x, x, tl.where(x < 0, -r, r))


@triton.jit
def to_fp8(x, MANT: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 ``x`` as fp8 ``DTYPE`` by :func:`round_to_fp8`'s rule (the same arguments), bit-exact on
    every backend: NaN is stored as the format's NaN code with ``x``'s sign bit (``0x7F``/``0xFF``,
    as PyTorch's cast stores it), which the interpreter's own cast does not (it stores 384.0 in
    e4m3fn). GPU arithmetic before the store may already have dropped a NaN's sign."""
    bits = round_to_fp8(x, MANT, EMIN, MAX).to(DTYPE).to(tl.uint8, bitcast=True)
    nan = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8) | 0x7F
    return tl.where(x != x, nan, bits).to(DTYPE, bitcast=True)


# fp8 pairs to fp16 pairs in one instruction (NVIDIA sm_89+), for :func:`fp8_to_f16`.
_CVT_E4M3: tl.constexpr = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                       "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
_CVT_E5M2: tl.constexpr = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                       "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }")


@triton.jit
def fp8_to_f16(x):
    """fp8 (e4m3fn or e5m2) to fp16, exact, here, in the tile's current layout (NVIDIA sm_89+ only):
    the conversion instruction as opaque inline asm, which the compiler may not move past a layout
    change. A plain cast of a tile bound for a dot's second operand is sunk after its move into the
    operand layout, where one-byte elements along the dot's reduction dimension load from shared
    memory a byte at a time (V in ``P @ V``); converted first, the tile moves as fp16, through the
    transposing matrix loads (docs/performance.md, v26)."""
    if x.dtype == tl.float8e4nv:
        return tl.inline_asm_elementwise(_CVT_E4M3, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        tl.static_assert(x.dtype == tl.float8e5, "fp8_to_f16: e4m3fn or e5m2 only")
        return tl.inline_asm_elementwise(_CVT_E5M2, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def max_first_index(x, idx, ok, AXIS: tl.constexpr):
    """Along ``AXIS``: the maximum of ``x`` over the entries where ``ok``, and the lowest ``idx``
    (int32) among the entries ``ok`` that hold it (ties: the lowest index first, as ``torch.argmax``).
    ``x`` holds no NaN (the caller maps it first); where no entry is ``ok``: ``-inf`` and the int32
    maximum."""
    x = tl.where(ok, x, NEG_INF)
    m = tl.max(x, AXIS)
    first = tl.min(tl.where(ok & (x == tl.expand_dims(m, AXIS)), idx, 0x7FFFFFFF), AXIS)
    return m, first


@triton.jit
def empty_if_inf(lse):
    """An lse of ``+inf`` marks an empty state, like ``-inf`` (the convention vLLM's merge uses)."""
    return tl.where(lse == float("inf"), NEG_INF, lse)


@triton.jit
def gated_product(g, u, ACT: tl.constexpr):
    """``act(gate) * up`` of a gated MLP as its unfused kernels round it, for ``g`` and ``u`` as loaded
    (one dtype): the activation of the fp32 gate (:func:`gate_activation`) rounded to that dtype, times
    the fp32 up, rounded to it. Every kernel that forms the product computes it here, so that a fused
    form has the activation kernel's bits."""
    act = gate_activation(g.to(tl.float32), ACT).to(g.dtype).to(tl.float32)
    return (act * u.to(tl.float32)).to(g.dtype)


@triton.jit
def dot_over_k(acc, p_a, p_b, K, BK: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
               NUM_STAGES: tl.constexpr, a_rows=None):
    """``acc + A @ B`` over ``K`` in steps of ``BK``, in one fixed order: ``p_a`` points at A's first
    step ``[M, BK]`` (k along axis 1), ``p_b`` at B's ``[BK, N]`` (k along axis 0), k contiguous in
    both (each step moves them ``BK`` elements); past ``K`` the loads give zeros (unless ``EVEN_K``).
    ``a_rows`` (``[M]`` bool, or None: all): the rows of A to read; the others are zeros, read from
    nowhere (a tile's padding rows would otherwise all read one row: at M = 1, 64 reads of the same
    bytes a step from every SM)."""
    offs_k = tl.arange(0, BK)
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        if EVEN_K:
            if a_rows is None:
                a = tl.load(p_a)
            else:
                a = tl.load(p_a, mask=a_rows[:, None], other=0.0)
            b = tl.load(p_b)
        else:
            k_ok = offs_k < K - k0
            if a_rows is None:
                a = tl.load(p_a, mask=k_ok[None, :], other=0.0)
            else:
                a = tl.load(p_a, mask=a_rows[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(p_b, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        p_a += BK
        p_b += BK
    return acc


@triton.jit
def merge_weights(lse_a, lse_b):
    """The weights of two softmax states over disjoint key sets in their merge, and the merged lse:
    ``(w_a, w_b, lse)`` with ``out = fma(o_a, w_a, o_b * w_b)`` (:func:`merge_state`). lse natural
    log; ``+inf`` or ``-inf`` is an empty state (weight 0); two empty states give weights 0 and lse
    ``-inf``. Merging with an empty state returns the other exactly (weights 1 and 0, lse unchanged).
    Every multiply-add is an explicit fma, so that each kernel that merges rounds the same way (the
    batch-invariant mode merges splits in the attention kernel and in the combine)."""
    lse_a = empty_if_inf(lse_a)
    lse_b = empty_if_inf(lse_b)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    w_a = tl.exp2((lse_a - m_safe) * LOG2E)
    w_b = tl.exp2((lse_b - m_safe) * LOG2E)
    total = w_a + w_b
    empty = total == 0.0
    denom = tl.where(empty, 1.0, total)
    lse = tl.where(empty, NEG_INF, tl.fma(tl.log2(denom), LN2, m_safe))
    return w_a / denom, w_b / denom, lse


@triton.jit
def merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two softmax states over disjoint key sets: ``o`` ``[R, D]`` fp32, ``lse`` ``[R]``
    natural log (:func:`merge_weights`)."""
    w_a, w_b, lse = merge_weights(lse_a, lse_b)
    return tl.fma(o_a, w_a[:, None], o_b * w_b[:, None]), lse


@triton.jit
def report_fault(Faults, code: tl.constexpr, index, bad):
    """Record metadata fault ``code`` (:data:`pagedflash.validate.NUM_FAULTS` entries) at ``index``
    (a sequence or token; scalars or matching blocks) where ``bad``."""
    tl.atomic_max(Faults + code + index * 0, index, mask=bad)


@triton.jit
def mac(a, b, acc, DOT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr, WIDE: tl.constexpr = False):
    """``acc + a @ b`` for ``a`` ``[M, K]``, ``b`` ``[K, N]``, ``acc`` ``[M, N]`` fp32: by ``tl.dot``
    (every dim at least 16), or (``USE_DOT`` False, one row: ``M`` 1) as a matrix-vector product on
    the CUDA cores in fp32, ``b``'s tile reduced along K in the layout it was loaded in (as
    :mod:`pagedflash.ops.gemv` does). ``WIDE`` (CUDA cores only): ``acc`` is ``[K, N]``, the
    products added elementwise and reduced along K once, by :func:`mac_total` after the loop (no
    reduction across threads in the loop)."""
    if USE_DOT:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    else:
        tl.static_assert(a.shape[0] == 1, "mac: the CUDA-core product takes one row (M = 1)")
        x = tl.sum(a.to(tl.float32), axis=0)  # [K]: the one row
        if WIDE:
            return acc + b.to(tl.float32) * x[:, None]
        else:
            return acc + tl.sum(b.to(tl.float32) * x[:, None], axis=0)[None, :]


@triton.jit
def mac_zeros(BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr):
    """The fp32 accumulator :func:`mac` adds into: ``[BK, BN]`` with ``WIDE``, else ``[BM, BN]``."""
    if WIDE:
        return tl.zeros([BK, BN], dtype=tl.float32)
    else:
        return tl.zeros([BM, BN], dtype=tl.float32)


@triton.jit
def mac_total(acc, WIDE: tl.constexpr):
    """:func:`mac`'s accumulator as the ``[M, N]`` product: a ``WIDE`` one summed along K (one row)."""
    if WIDE:
        return tl.sum(acc, axis=0)[None, :]
    else:
        return acc


@triton.jit
def gate_activation(g, ACT: tl.constexpr):
    """A gated MLP's activation of its fp32 gate ``g``: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (Gemma's
    GeGLU, transformers' ``gelu_pytorch_tanh``), in fp32."""
    if ACT == "silu":
        act = g / (1.0 + tl.exp(-g))
    else:  # gelu_tanh: 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-2.0 * z))  # exp overflows to inf for very negative g: act -0.0, as tanh's -1
    return act


@triton.jit
def launch_dependents():
    """Programmatic dependent launch (sm90+): the kernel launched after this one with ``launch_pdl``
    may start once every program of this one has passed here (or ended)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def wait_for_primary():
    """Programmatic dependent launch (sm90+): wait until the kernel before this one (launched with
    ``launch_pdl``) has ended and its writes are visible."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the lines at ``ptrs`` (a tensor of global pointers, one per 128-byte line wanted) in L2,
    kept there before others (``evict_last``); nothing is loaded into registers. NVIDIA only."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
