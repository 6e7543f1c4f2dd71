"""The decoder's kernels besides attention (pagedflash.ops: norm, rope, activation, sampling, gemv)
against their fp32 references.

Under the interpreter: small odd sizes, rows that are strided views into NaN-padded buffers (a load
past a row's end, or past the last weight row, shows as NaN), outputs from NaN-poisoned
``torch.empty``. Compiled on a GPU, the same checks at real sizes: Llama-3 widths (hidden 2048 and
4096), a 128256-entry vocabulary, and the projections of a Llama-3-8B layer.
"""

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, ids, randn

from pagedflash import reference as ref
from pagedflash import validate
from pagedflash.ops import activation, gemv, norm, rope, sampling
from pagedflash.testing import compare

GPU_DTYPES = [torch.bfloat16, torch.float16]
gpu_only = pytest.mark.skipif(not ON_GPU, reason="real sizes are for the compiled GPU run")
# Llama-3-8B: hidden 4096, 32 query and 8 KV heads of 128, MLP 14336, vocabulary 128256
H8B, I8B, QKV8B, V = 4096, 14336, 6144, 128256


def in_wider_rows(t: torch.Tensor, pad: int = 5, fill: float = float("nan")) -> torch.Tensor:
    """``t`` as a view whose rows are followed by ``pad`` elements of ``fill``, and whose last row is
    followed by one more row of ``fill`` (a load past a row, or past the last row, reads ``fill``)."""
    rows, cols = t.shape
    buf = torch.full((rows + 1, cols + pad), fill, dtype=t.dtype, device=t.device)
    buf[:rows, :cols] = t
    return buf[:rows, :cols]


# ---------------------------------------------------------------------------------------------- norm
def check_rms_norm(t, h, dtype, with_residual):
    x, w = in_wider_rows(randn(t, h, dtype=dtype)), randn(h, dtype=dtype)
    res = in_wider_rows(randn(t, h, dtype=dtype)) if with_residual else None
    out, res_out = norm.rms_norm(x, w, 1e-5, res)
    want, want_res = ref.rms_norm_ref(x, w, 1e-5, res)
    assert out.dtype == dtype and res_out.dtype == dtype
    assert_close(out, want, dtype, "out")
    if with_residual:
        assert torch.equal(res_out.float(), want_res), "residual stream: the sum rounded to x's dtype"
    else:
        assert res_out is x


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("t,h", [(7, 100), (1, 16), (3, 1), (0, 8)])
def test_rms_norm(t, h, dtype, with_residual):
    check_rms_norm(t, h, dtype, with_residual)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("t,h", [(1, 2048), (333, 2048), (1, 4096), (333, 4096)])
def test_rms_norm_real_sizes(t, h, dtype, with_residual):
    check_rms_norm(t, h, dtype, with_residual)


# ---------------------------------------------------------------------------------------------- rope
def check_rope(t, num_heads, other_heads, head_dim, max_len, dtype, rotary_dim=None, table_width=None):
    """``num_heads`` rotated (q and k) then ``other_heads`` (v) left alone; the v columns hold NaN,
    which must stay as they are; cos/sin rows other than the positions', and every entry past the
    first ``rotary_dim / 2`` of a row (which the rotate-half tables repeat), are NaN and must not be
    read. ``rotary_dim < head_dim`` (partial rotary): each head's dims past it keep their bits.
    ``table_width``: cos/sin columns (default ``rotary_dim``)."""
    rotary_dim = rotary_dim or head_dim
    width = (num_heads + other_heads) * head_dim
    x = in_wider_rows(randn(t, width, dtype=dtype))
    x[:, num_heads * head_dim :] = float("nan")
    before = x.clone()
    positions = torch.randint(0, max_len, (t,), device=DEVICE)
    angles = positions[:, None].float() * torch.rand(rotary_dim // 2, device=DEVICE)[None, :]
    cos = torch.full((max_len, table_width or rotary_dim), float("nan"), device=DEVICE)
    sin = cos.clone()
    cos[positions, : rotary_dim // 2], sin[positions, : rotary_dim // 2] = angles.cos(), angles.sin()
    want = ref.rope_ref(x, positions, cos, sin, num_heads, head_dim, rotary_dim)
    rope.rope_(x, positions, cos, sin, num_heads=num_heads, head_dim=head_dim,
               rotary_dim=None if rotary_dim == head_dim else rotary_dim)
    rotated = num_heads * head_dim
    assert_close(x[:, :rotated], want[:, :rotated], dtype, "rotated heads")
    heads, heads_before = (v[:, :rotated].view(t, num_heads, head_dim) for v in (x, before))
    assert torch.equal(heads[..., rotary_dim:], heads_before[..., rotary_dim:]), "dims past rotary_dim untouched"
    assert x[:, rotated:].isnan().all(), "the heads after num_heads must be left alone"


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("t,num_heads,other_heads,head_dim", [(5, 5, 4, 20), (1, 1, 0, 2), (3, 17, 1, 24)])
def test_rope(t, num_heads, other_heads, head_dim, dtype):
    check_rope(t, num_heads, other_heads, head_dim, 64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("t,num_heads,other_heads,head_dim,rotary_dim,table_width", [
    (5, 5, 4, 20, 10, None), (3, 3, 1, 24, 18, 24), (2, 17, 2, 16, 2, 6)])
def test_rope_partial_rotary(t, num_heads, other_heads, head_dim, rotary_dim, table_width, dtype):
    """Phi-3's partial rotary (``partial_rotary_factor`` 0.5, 0.75, ...): the first ``rotary_dim`` dims
    of each head rotated, pairs ``(i, i + rotary_dim / 2)``, head stride ``head_dim``; tables as wide
    as ``rotary_dim`` or wider."""
    check_rope(t, num_heads, other_heads, head_dim, 64, dtype, rotary_dim, table_width)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("head_dim", [64, 128])  # Llama-3.2-1B, Llama-3-8B
@pytest.mark.parametrize("t", [1, 333])
def test_rope_real_sizes(t, head_dim, dtype):
    check_rope(t, 32 + 8, 8, head_dim, 8192, dtype)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("t", [1, 333])
def test_rope_partial_rotary_real_sizes(t, dtype):
    """Phi-4-mini: 24 q and 8 KV heads of 128, partial_rotary_factor 0.75 (96 rotated dims)."""
    check_rope(t, 24 + 8, 8, 128, 8192, dtype, rotary_dim=96)


# ---------------------------------------------------------------------------------------- activation
def check_gated_activations(t, n, dtype):
    """Against the reference rounded to the output's dtype, as the kernel rounds once: GELU's tail (gates
    below about -4) gives products under fp16's smallest normal, where one rounding step is most of the
    value and a single element's tolerance (relative to itself) could not hold it."""
    gate_up = in_wider_rows(randn(t, 2 * n, dtype=dtype) * 3)
    for fn, reference in ((activation.silu_mul, ref.silu_mul_ref), (activation.gelu_tanh_mul, ref.gelu_tanh_mul_ref)):
        out = fn(gate_up)
        assert out.shape == (t, n) and out.dtype == dtype
        assert_close(out, reference(gate_up).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("up", [3.0, -0.7])
def test_gelu_tanh_mul_over_every_gate(dtype, up):
    """24,001 gates from -12 to 12, each judged alone (its tolerance relative to its own value): the
    kernel's ``g * sigmoid(2 z)`` against the fp64 reference, through the tail where the product is
    subnormal in fp16."""
    gate = torch.linspace(-12, 12, 24001, device=DEVICE).to(dtype)
    gate_up = torch.cat([gate, torch.full_like(gate, up)])[None]
    out, want = activation.gelu_tanh_mul(gate_up)[0], ref.gelu_tanh_mul_ref(gate_up)[0].to(dtype)
    differ = (out != want).nonzero().flatten().tolist()  # the others pass any rule
    bad = [i for i in differ if not compare(out[i:i + 1], want[i:i + 1], dtype).ok]
    assert not bad, f"{len(bad)} gates off, first {gate[bad[0]].item()}: {out[bad[0]].item()} vs {want[bad[0]].item()}"


def test_gelu_tanh_mul_matches_torch_at_the_extremes():
    """Gemma's GeGLU: the kernel's ``g * sigmoid(2 z)`` form equals torch's ``0.5 g (1 + tanh(z))`` where
    its exponential overflows (very negative gates: -0.0 as torch's) and saturates (very positive: g),
    and is finite for every finite gate."""
    gate = torch.tensor([-1e4, -60.0, -6.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 6.0, 60.0, 1e4], device=DEVICE)
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    out = activation.gelu_tanh_mul(gate_up)[0]
    want = torch.nn.functional.gelu(gate.cpu(), approximate="tanh")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.signbit(out[:3].cpu()), torch.signbit(want[:3]))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("t,n", [(6, 300), (1, 1), (2, 1500), (0, 4)])  # 1500: two column blocks
def test_gated_activations(t, n, dtype):
    check_gated_activations(t, n, dtype)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("n", [8192, I8B])
@pytest.mark.parametrize("t", [1, 333])
def test_gated_activations_real_sizes(t, n, dtype):
    check_gated_activations(t, n, dtype)


# ------------------------------------------------------------------------------------------ sampling
def test_argmax_ties_nan_and_chunk_borders(monkeypatch):
    """First index of the maximum across chunk borders, with ties, a vocabulary that is not a multiple
    of the chunk, -inf rows and NaN (torch: NaN is the largest, above +inf); padding past each row is
    +inf, which would win if it were read."""
    monkeypatch.setattr(sampling, "ARGMAX_CHUNK", 64)
    v = 64 * 5 + 17
    for dtype in DTYPES:
        logits = randn(7, v).to(dtype)
        logits[1, [70, 300, 330]] = 9.0  # tie across chunks: the first wins
        logits[2, [3, 4]] = 9.0  # tie inside a chunk
        logits[3] = float("-inf")
        logits[4, v - 1] = 9.0  # the last, partial chunk
        logits[5, 200] = float("nan")
        logits[6, [10, 150]] = float("inf")  # +inf before NaN, in its chunk and in an earlier one
        logits[6, [160, 250]] = float("nan")
        got = sampling.argmax(in_wider_rows(logits, fill=float("inf")))
        assert got.dtype == torch.int64
        assert got.tolist() == ref.argmax_ref(logits).tolist()
        assert got.tolist()[1:] == [70, 3, 0, v - 1, 200, 160]


@pytest.mark.parametrize("rows,v", [(3, 5000), (1, 1), (0, 10)])
def test_argmax(rows, v):
    logits = in_wider_rows(randn(rows, v), fill=float("inf"))
    assert sampling.argmax(logits).tolist() == ref.argmax_ref(logits).tolist()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("rows", [1, 64])
def test_argmax_real_vocabulary(rows, dtype):
    logits = randn(rows, V, dtype=dtype) * 4  # bf16 at this scale: many ties at the maximum
    logits[0, [V - 1, 5]] = 1e4  # tie across the first and last chunk
    got = sampling.argmax(in_wider_rows(logits, fill=float("inf")))
    assert got.tolist() == ref.argmax_ref(logits).tolist()
    assert got[0].item() == 5


# ---------------------------------------------------------------------------------------------- gemv
def check_gemv(prologue, n, k, dtype, *, bias, residual):
    """One projection through the kernel against its reference. The weight is a view whose rows are
    followed by NaN and which has a NaN row after its last, so unmasked loads show."""
    w = in_wider_rows(randn(n, k, dtype=dtype))
    b = randn(n, dtype=dtype) if bias else None
    if prologue in gemv.GATED:
        gate_up = randn(1, 2 * k, dtype=dtype) * 3  # gates past the GELU's bend and the fp16 subnormals
        fused, want = ((gemv.silu_mul_gemv, ref.silu_mul_gemv_ref) if prologue == gemv.SILU_MUL else
                       (gemv.gelu_tanh_mul_gemv, ref.gelu_tanh_mul_gemv_ref))
        assert_close(fused(gate_up, w, b), want(gate_up, w, b), dtype)
        return
    x = randn(1, k, dtype=dtype)
    if prologue == gemv.PLAIN:
        out = torch.empty(1, n, dtype=dtype, device=DEVICE)
        assert gemv.gemv(x, w, b, out=out) is out
        assert_close(out, ref.gemv_ref(x, w, b), dtype)
        return
    res = randn(1, k, dtype=dtype) if residual else None
    nw = randn(k, dtype=dtype)
    out, res_out = gemv.rms_norm_gemv(x, w, b, norm_weight=nw, eps=1e-5, residual=res)
    want, want_res = ref.rms_norm_gemv_ref(x, w, b, norm_weight=nw, eps=1e-5, residual=res)
    assert_close(out, want, dtype)
    if residual:
        assert torch.equal(res_out.float(), want_res)
    else:
        assert res_out is x


PROLOGUES = {"plain": gemv.PLAIN, "rms_norm": gemv.RMS_NORM, "silu_mul": gemv.SILU_MUL,
             "gelu_tanh_mul": gemv.GELU_TANH_MUL}


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tile", [None, (16, 32, 4, 2)], ids=["table", "small_tile"])  # partial loop steps
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("bias,residual", [(True, True), (False, False)], ids=["bias_res", "bare"])
def test_gemv(monkeypatch, prologue, tile, dtype, bias, residual):
    monkeypatch.setattr(gemv, "TILE", tile)
    check_gemv(PROLOGUES[prologue], 37, 100, dtype, bias=bias, residual=residual)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("name,prologue,n,k,bias,residual", [
    ("qkv", gemv.RMS_NORM, QKV8B, H8B, True, False),  # layer 0: no residual yet; q/k/v bias as Qwen2
    ("o_proj", gemv.PLAIN, H8B, H8B, False, False),
    ("gate_up", gemv.RMS_NORM, 2 * I8B, H8B, False, True),
    ("down", gemv.SILU_MUL, H8B, I8B, False, False),
    ("down_geglu", gemv.GELU_TANH_MUL, H8B, I8B, False, False),  # Gemma's
    ("lm_head", gemv.RMS_NORM, V, H8B, False, True),
], ids=lambda v: v if isinstance(v, str) else None)
def test_gemv_llama3_8b_layer(name, prologue, n, k, bias, residual, dtype):
    check_gemv(prologue, n, k, dtype, bias=bias, residual=residual)


# ---------------------------------------------------------------------------------------- bad input
def _errors():
    x, w = randn(3, 8), randn(8)
    yield lambda: norm.rms_norm(x[0], w, 1e-6), ValueError, r"x: expected a 2-D tensor"
    yield lambda: norm.rms_norm(x.long(), w, 1e-6), TypeError, r"x: expected dtype in"
    yield lambda: norm.rms_norm(x[:, :0], w[:0], 1e-6), ValueError, r"x: expected at least one column"
    yield lambda: norm.rms_norm(x, w[:7], 1e-6), ValueError, r"weight: expected shape \(8,\), got \(7,\)"
    yield lambda: norm.rms_norm(x, w.half(), 1e-6), TypeError, r"weight: expected dtype torch.float32 \(the dtype of x\)"
    yield lambda: norm.rms_norm(x, w, 1e-6, x[:2]), ValueError, r"residual: expected shape \(3, 8\)"
    yield lambda: norm.rms_norm(x, w, float("nan")), ValueError, r"eps: expected a finite number >= 0"
    yield lambda: norm.rms_norm(x, w, None), ValueError, r"eps: expected a finite number >= 0, got None"
    yield lambda: norm.rms_norm(x.t(), randn(3), 1e-6), ValueError, r"x: the last dimension must be contiguous"
    yield lambda: norm.rms_norm(x.requires_grad_(), w, 1e-6), ValueError, r"x: requires grad"
    qkv, pos, cos = randn(2, 60), torch.tensor([0, 5], device=DEVICE), randn(16, 20)
    call = lambda **kw: rope.rope_(**{**dict(x=qkv, positions=pos, cos=cos, sin=cos, num_heads=3, head_dim=20), **kw})
    yield lambda: call(head_dim=15), ValueError, r"head_dim: expected an even number"
    yield lambda: call(num_heads=0), ValueError, r"num_heads must be an int >= 1, got 0"
    yield lambda: call(num_heads=4), ValueError, r"x: expected rows of at least num_heads \* head_dim = 80"
    yield lambda: call(positions=pos.float()), TypeError, r"positions: expected dtype in"
    yield lambda: call(positions=pos[:1]), ValueError, r"positions: expected shape \(2,\)"

    def debug_call(**kw):  # the positions' range is read on the host in the debug mode only
        with validate.value_checks(True):
            call(**kw)

    yield lambda: debug_call(positions=torch.tensor([0, 16], device=DEVICE)), ValueError, r"positions: expected values in \[0, 16\)"
    yield lambda: call(cos=cos.half()), TypeError, r"cos: expected dtype in \['torch.float32'\]"
    yield lambda: call(sin=randn(16, 10)), ValueError, r"sin: expected shape \[max_len, >= rotary_dim = 20\]"
    yield lambda: call(rotary_dim=7), ValueError, r"rotary_dim: expected an even number in \[2, head_dim = 20\]"
    yield lambda: call(rotary_dim=22), ValueError, r"rotary_dim: expected an even number in \[2, head_dim = 20\]"
    yield lambda: call(rotary_dim=0), ValueError, r"rotary_dim must be an int >= 2, got 0"
    yield (lambda: call(cos=randn(16, 8), sin=randn(16, 8), rotary_dim=10), ValueError,
           r"cos: expected shape \[max_len, >= rotary_dim = 10\], got \(16, 8\)")
    yield lambda: call(sin=randn(15, 20)), ValueError, r"sin: expected the shape of cos"
    yield lambda: activation.silu_mul(randn(2, 7)), ValueError, r"gate_up: expected an even, nonzero number of columns"
    yield lambda: activation.gelu_tanh_mul(randn(2, 0)), ValueError, r"gate_up: expected an even, nonzero number of columns"
    yield lambda: sampling.argmax(randn(2, 0)), ValueError, r"logits: expected between 1 and 2\*\*31 - 1 columns"
    yield lambda: sampling.argmax(randn(5)), ValueError, r"logits: expected a 2-D tensor"
    row, weight = randn(1, 8), randn(4, 8)
    yield lambda: gemv.gemv(randn(2, 8), weight), ValueError, r"x: expected shape \(1, \*\), got \(2, 8\)"
    yield lambda: gemv.gemv(row, randn(4, 9)), ValueError, r"weight: expected shape \(\*, 8\), got \(4, 9\)"
    yield lambda: gemv.gemv(row, randn(8, 4).t()), ValueError, r"weight: the last dimension must be contiguous"
    yield lambda: gemv.gemv(row, weight, randn(5)), ValueError, r"bias: expected shape \(4,\)"
    yield lambda: gemv.gemv(row, weight, out=randn(1, 5)), ValueError, r"out: expected shape \(1, 4\)"
    yield lambda: gemv.gemv(row, weight.half()), TypeError, r"weight: expected dtype torch.float32 \(the dtype of x\)"
    yield (lambda: gemv.rms_norm_gemv(row, weight, norm_weight=randn(7), eps=1e-6), ValueError,
           r"norm_weight: expected shape \(8,\)")
    yield (lambda: gemv.rms_norm_gemv(row, weight, norm_weight=randn(8), eps=-1.0), ValueError,
           r"eps: expected a finite number >= 0")
    yield lambda: gemv.silu_mul_gemv(randn(1, 9), weight), ValueError, r"gate_up: expected an even"
    yield lambda: gemv.gelu_tanh_mul_gemv(randn(1, 9), weight), ValueError, r"gate_up: expected an even"


@pytest.mark.parametrize("case", range(len(list(_errors()))))
def test_bad_input_is_refused_by_name(case):
    call, error, message = list(_errors())[case]
    with pytest.raises(error, match=message):
        call()


def test_rope_refusal_changes_nothing():
    """In the debug mode (tests/test_write_faults.py: by default, such rows become NaN)."""
    x = randn(2, 40)
    before = x.clone()
    with validate.value_checks(True), pytest.raises(ValueError, match="positions"):
        rope.rope_(x, torch.tensor([0, 99], device=DEVICE), randn(16, 20), randn(16, 20), num_heads=2, head_dim=20)
    assert torch.equal(x, before)


def test_a_signature_checked_once_still_refuses_other_inputs():
    """Checks run on a call signature's first call; every property a check reads (dtype, shape,
    strides, device, autograd) is part of the signature, so a call differing in one is checked."""
    x, w = randn(3, 8), randn(8)
    norm.rms_norm(x, w, 1e-6)
    norm.rms_norm(x, w, 1e-6)  # the cached signature
    with pytest.raises(ValueError, match="x: requires grad"):
        norm.rms_norm(x.clone().requires_grad_(), w, 1e-6)
    with pytest.raises(TypeError, match="weight: expected dtype"):
        norm.rms_norm(x, w.double(), 1e-6)
    with pytest.raises(ValueError, match="eps: expected a finite number"):
        norm.rms_norm(x, w, float("inf"))  # a value, checked on every call
    row, weight = randn(1, 8), randn(4, 8)
    gemv.gemv(row, weight)
    with pytest.raises(ValueError, match="weight: the last dimension must be contiguous"):
        gemv.gemv(row, randn(8, 4).t())


def test_cached_plans_keep_refusing_what_the_checks_refuse(monkeypatch):
    """Plan keys carry the types of the call's ints (``True == 1`` would share a plan), ``out`` may not
    share memory with an input (addresses: checked every call), a module constant a plan depends on
    is part of its key, and in the debug mode the operator route checks the RoPE positions' range too."""
    from pagedflash.ops import custom_ops

    qkv, pos, table = randn(2, 40), torch.tensor([0, 5], device=DEVICE), randn(16, 20)
    with validate.value_checks(False):
        rope.rope_(qkv, pos, table, table, num_heads=2, head_dim=20)
        with pytest.raises(ValueError, match="num_heads must be an int"):
            rope.rope_(qkv, pos, table, table, num_heads=2.0, head_dim=20)
    previous = custom_ops.dispatch_eager(True)
    try:
        with validate.value_checks(True), pytest.raises(ValueError, match=r"positions: expected values in \[0, 16\)"):
            rope.rope_(qkv, torch.tensor([0, 16], device=DEVICE), table, table, num_heads=2, head_dim=20)
    finally:
        custom_ops.dispatch_eager(previous)
    row, weight = randn(1, 8), randn(8, 8)
    with pytest.raises(ValueError, match="out: shares memory with x"):
        gemv.gemv(row, weight, out=row)
    logits = randn(3, 337)
    want = logits.argmax(-1)
    monkeypatch.setattr(sampling, "ARGMAX_CHUNK", 64)
    assert torch.equal(sampling.argmax(logits), want)
    monkeypatch.setattr(sampling, "ARGMAX_CHUNK", 4096)
    assert torch.equal(sampling.argmax(logits), want)
