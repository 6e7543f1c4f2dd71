"""FP8 K/V caches: quantizing writes, dequantizing reads, every attention path, bad input.

How fp8 is tested on the CPU: the Triton interpreter loads ``float8_e4m3fn``/``float8_e5m2`` tensors
and converts them to fp16/fp32 exactly, so the attention kernels run here on real fp8 caches (no
uint8 reinterpretation needed). Its fp32 -> fp8 *rounding* is wrong (a carry into the exponent is
dropped: 127.8 becomes 64, and nothing saturates), which is why the write kernel rounds in fp32
itself (``_jit.round_to_fp8``) and only ever converts exactly representable values; the tests below
check the stored bytes against PyTorch's own conversion bit for bit. Under the interpreter each
path runs a few covering cases (the CI's time is short); compiled on a GPU the full products run
(bf16 q, both fp8 formats, every page size and split mode), and long contexts and CUDA graphs
(marked ``gpu``).

References: attention over the *dequantized* cache (``stored.float() * descale[head]``) is checked
with the same tolerance as an unquantized cache of q's dtype; against the unquantized values the
error is quantization noise, bounded loosely here and reported by ``bench decode``/``bench paged``.
"""

import itertools

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, cu_seqlens, fp8_pool, ids, randn

from pagedflash import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    validate,
    write_kv_cache,
)
from pagedflash import reference as ref
from pagedflash.cache import KVCache
from pagedflash.ops import launch
from pagedflash.testing import capture_graph

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
PAGE_SIZES = [1, 2, 4, 5, 8, 16, 32, 64, 128, 256]
SCALES = ["none", "tensor", "head"]


def matrix(*axes, cpu):
    """The product of ``axes`` compiled on a GPU; ``cpu``, a covering subset, under the interpreter."""
    return list(itertools.product(*axes)) if ON_GPU else cpu


def descales(kind: str, hkv: int):
    """(k_descale, v_descale): none, one per tensor, or one per KV head (fp32 on the device)."""
    if kind == "none":
        return None, None
    if kind == "tensor":
        return torch.tensor(0.37, device=DEVICE), torch.tensor([1.9], device=DEVICE)
    return (torch.rand(hkv, device=DEVICE) + 0.25), (torch.rand(hkv, device=DEVICE) * 2 + 0.5)


def quantized(x: torch.Tensor, scale, fp8) -> torch.Tensor:
    return ref.quantize_fp8_ref(x, scale, fp8)


def fp8_values(fp8) -> torch.Tensor:
    """Inputs that exercise every rounding case: each finite code, the midpoints between neighbours
    (ties to even), their nearest fp32 neighbours, values past the largest finite one, infinities,
    fp32 subnormals and signed zeros, plus randn at several magnitudes."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    vals = codes[torch.isfinite(codes)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    top = torch.finfo(fp8).max
    special = torch.tensor([top * 1.01, -top * 1.01, top * 1.0624, 1e30, -1e30, float("inf"), float("-inf"),
                            0.0, -0.0, 1e-40, -1e-40, 2.0**-10, 2.0**-17])
    noise = torch.cat([torch.randn(400) * s for s in (1e-3, 1.0, 40.0, 1e3, 1e5)])
    return torch.cat([vals, mids, mids.nextafter(up), mids.nextafter(down), special, noise]).to(DEVICE)


@pytest.mark.parametrize("fp8,src,scale", matrix(FP8, DTYPES, SCALES, cpu=[
    (E4M3, torch.float32, "head"), (E5M2, torch.float16, "tensor"), (E4M3, torch.float16, "none")]), ids=ids)
def test_write_quantizes_like_pytorch(fp8, src, scale):
    """Stored bytes equal PyTorch's ``saturate(x / scale).to(fp8)`` (round to nearest even), never
    NaN from finite input; negative slots are skipped and other slots untouched."""
    hkv, d, page = 2, 32, 4
    x = fp8_values(fp8)
    if src == torch.float16:
        x = x.clamp(-6e4, 6e4).half().float()  # fp16's own range; the cast itself is not under test
    tokens = -(-x.numel() // (hkv * d))
    flat = torch.zeros(tokens * hkv * d, device=DEVICE)
    flat[: x.numel()] = x
    k = flat.view(tokens, hkv, d).to(src)
    v = k.flip(0)
    k_scale, v_scale = descales(scale, hkv)
    num_blocks = tokens // page + 3
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), device=DEVICE).to(fp8)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:tokens].long()
    slots[1] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    ref.write_kv_cache_ref(k, v, k_ref, v_ref, slots, k_scale=k_scale, v_scale=v_scale)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    written = k_cache.float().view(-1, hkv, d)[slots[slots >= 0]]
    assert not written.isnan().any() and written.abs().max() <= torch.finfo(fp8).max


@pytest.mark.parametrize("fp8", FP8, ids=ids)
def test_write_keeps_nan(fp8):
    """A NaN key or value is stored as one of the format's NaN codes (never as a finite ±max that
    would then dominate the softmax, nor as the interpreter's 384)."""
    k = torch.tensor([float("nan"), 1.0, -2.0, 1e30], device=DEVICE).view(4, 1, 1).expand(4, 1, 16).contiguous()
    k[0, 0, 8:] = -float("nan")
    k_cache = torch.zeros(2, 2, 1, 16, device=DEVICE).to(fp8)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.arange(4, device=DEVICE)
    write_kv_cache(k, k, k_cache, v_cache, slots)
    ref.write_kv_cache_ref(k, k, k_ref, v_ref, slots)
    got, want = k_cache.float().view(4, 16), k_ref.float().view(4, 16)
    assert got[0].isnan().all() and want[0].isnan().all()
    assert torch.equal(got[1:], want[1:]) and got[3, 0] == torch.finfo(fp8).max
    # the format's NaN codes, with the sign the value had when stored (a GPU's arithmetic, the
    # reference's division included, may return NaN without its sign: the sign is not compared)
    assert set(k_cache.view(torch.uint8).view(4, 16)[0].tolist()) <= {0x7F, 0xFF}


@pytest.mark.parametrize("dtype,fp8,scale,num_splits,heads", matrix(
    DTYPES, FP8, SCALES, [1, 3, 0], [(8, 2), (5, 1), (4, 4)],
    cpu=[(torch.float32, E4M3, "head", 3, (8, 2)), (torch.float16, E4M3, "tensor", 1, (5, 1)),
         (torch.float16, E5M2, "none", 3, (4, 4))]), ids=ids)
def test_decode_contiguous(dtype, fp8, scale, num_splits, heads):
    hq, hkv = heads
    b, s_max, d, sq = 3, 70, 64, 1 + (hq == 8) * 3  # GQA 4: speculative Sq = 4 as well
    kd, vd = descales(scale, hkv)
    q = randn(b, sq, hq, d, dtype=dtype)
    k_real, v_real = randn(b, s_max, hkv, d) * 3, randn(b, s_max, hkv, d)
    seqlens = torch.tensor([s_max, 33, 5], dtype=torch.int32, device=DEVICE)
    for row, n in enumerate(seqlens.tolist()):  # slots past each length hold NaN: never read
        k_real[row, n:] = float("nan")
        v_real[row, n:] = float("nan")
    k_cache, v_cache = quantized(k_real, kd, fp8), quantized(v_real, vd, fp8)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_lse=True, k_descale=kd, v_descale=vd)
    assert out.dtype == dtype
    ref_out, ref_lse = ref.kvcache_attention_ref(q, ref.dequantize_ref(k_cache, kd), ref.dequantize_ref(v_cache, vd),
                                                 seqlens)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


@pytest.mark.parametrize("fp8,page,num_splits", matrix(FP8, PAGE_SIZES, [1, 4, 0], cpu=[(E4M3, 5, 0), (E5M2, 64, 1)]),
                         ids=ids)
def test_paged_decode(fp8, page, num_splits):
    dtype = DTYPES[-1]
    seqlens = [1, page - 1 or 1, page, page + 1, 77]
    hq, hkv, d = 8, 2, 64
    k_cache, v_cache, table = fp8_pool(seqlens, page, hkv, d, fp8)
    kd, vd = descales("head", hkv)
    q = randn(len(seqlens), 1, hq, d, dtype=dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                  num_splits=num_splits, k_descale=kd, v_descale=vd)
    want = ref.kvcache_attention_ref(q, ref.dequantize_ref(k_cache, kd), ref.dequantize_ref(v_cache, vd), lens,
                                     block_table=table)[0]
    assert_close(out, want, dtype)


@pytest.mark.parametrize("page,s_new", [(0, 1), (0, 3), (1, 1), (16, 3)] if ON_GPU else [(0, 3), (16, 3)], ids=str)
def test_append_quantizes_new_tokens(page, s_new):
    """``flash_attn_with_kvcache(k=, v=)`` stores new tokens as ``saturate(k / k_descale)`` (the same
    bytes ``write_kv_cache`` would store) and attends over them."""
    dtype, hq, hkv, d = DTYPES[-1], 6, 2, 40
    kd, vd = descales("head", hkv)
    lens = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
    if page:
        k_cache, v_cache, table = fp8_pool([n + s_new for n in lens.tolist()], page, hkv, d)
    else:
        table = None
        k_cache = quantized(randn(3, 48, hkv, d), kd, E4M3)
        v_cache = quantized(randn(3, 48, hkv, d), vd, E4M3)
    q = randn(3, s_new, hq, d, dtype=dtype)
    k_new, v_new = randn(3, s_new, hkv, d, dtype=dtype) * 5, randn(3, s_new, hkv, d, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                                  num_splits=2, k_descale=kd, v_descale=vd)
    ref.append_ref(k_ref, v_ref, k_new, v_new, lens, block_table=table, k_scale=kd, v_scale=vd)
    assert torch.equal(k_cache.float().nan_to_num(7.0), k_ref.float().nan_to_num(7.0))
    assert torch.equal(v_cache.float().nan_to_num(7.0), v_ref.float().nan_to_num(7.0))
    want = ref.kvcache_attention_ref(q, ref.dequantize_ref(k_ref, kd), ref.dequantize_ref(v_ref, vd), lens + s_new,
                                     block_table=table)[0]
    assert_close(out, want, dtype)


@pytest.mark.parametrize("page,mode", matrix(PAGE_SIZES, [(0, dict(causal=True)),
                                                        (3, dict(causal=True, window_size=(20, 0), softcap=4.0))],
                                             cpu=[(16, (3, dict(causal=True, window_size=(20, 0), softcap=4.0)))]),
                         ids=str)
def test_chunked_prefill_and_mixed_batch(page, mode):
    """Prefill chunks over cached prefixes and decode rows in one paged varlen launch over an fp8 pool."""
    num_splits, opts = mode
    dtype = DTYPES[-1]
    new, cached = [20, 1, 1, 9, 3], [0, 40, 5, 20, 60]
    total = [c + n for c, n in zip(cached, new)]
    hq, hkv, d = 6, 2, 48
    k_cache, v_cache, table = fp8_pool(total, page, hkv, d)
    kd, vd = descales("tensor", hkv)
    q = randn(sum(new), hq, d, dtype=dtype)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), block_table=table,
                                      num_splits=num_splits, return_lse=True, k_descale=kd, v_descale=vd, **opts)
    ref_out, ref_lse = ref.paged_varlen_attention_ref(q, ref.dequantize_ref(k_cache, kd),
                                                      ref.dequantize_ref(v_cache, vd), cq, ck, table, **opts)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


def test_dense_varlen_fp8_kv():
    dtype, lens_q, lens_k = DTYPES[-1], [5, 0, 31], [9, 4, 31]
    kd, vd = descales("head", 2)
    q = randn(sum(lens_q), 8, 32, dtype=dtype)
    k = quantized(randn(sum(lens_k), 2, 32), kd, E5M2)
    v = quantized(randn(sum(lens_k), 2, 32), vd, E5M2)
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True, k_descale=kd, v_descale=vd)
    want = ref.varlen_attention_ref(q, ref.dequantize_ref(k, kd), ref.dequantize_ref(v, vd), cq, ck, causal=True)[0]
    assert_close(out, want, dtype)


@pytest.mark.parametrize("log2_q", [120, 105, -105, -124])
def test_bf16_queries_of_any_finite_magnitude(log2_q):
    """bf16 q over fp8 K/V runs its dots in fp16, each q tile scaled by a power of two into fp16's
    range: queries near bf16's largest values (2^120: a shift of ~108, where a cap at 100 gave inf)
    and near its smallest normals (2^-124: a shift of -126, where a floor at -100 lost the mantissa)
    give the reference's answer with the softmax scale that keeps their scores of order one, decode
    and varlen prefill alike (the portable kernel; on sm90 the varlen call is small enough to stay
    on it, ``tests/test_prefill_hopper*.py`` cover the Gluon one). Under the interpreter q stays out
    of bf16's subnormals: Triton 3.9's interpreter converts those to fp32 wrongly (-2.66e-39 became
    -9.55e-39), which failed 3 seeds of 40 at 2^-124; compiled, they are converted exactly."""
    hq, hkv, d, n = 4, 2, 64, 40
    scale = 2.0 ** -log2_q / d**0.5
    q = randn(2, 1, hq, d)
    if not ON_GPU:
        q = q.sign() * q.abs().clamp(min=2.0**(-126 - log2_q))
    q = (q * 2.0**log2_q).to(torch.bfloat16)
    kd, vd = descales("head", hkv)
    k8, v8 = (randn(2, n, hkv, d).to(E4M3) for _ in range(2))
    k, v = ref.dequantize_ref(k8, kd), ref.dequantize_ref(v8, vd)
    lens = torch.tensor([n, 17], dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, softmax_scale=scale, k_descale=kd, v_descale=vd)
    assert_close(out, ref.kvcache_attention_ref(q, k, v, lens, softmax_scale=scale)[0], torch.bfloat16)
    qs, cq, ck = q.view(2, hq, d), cu_seqlens([1, 1]), cu_seqlens([n, 17])
    k_packed, v_packed = (torch.cat([t[0], t[1, :17]]) for t in (k8, v8))
    out = flash_attn_varlen_func(qs, k_packed, v_packed, cq, ck, 1, n, softmax_scale=scale, k_descale=kd,
                                 v_descale=vd)
    want = ref.varlen_attention_ref(qs, ref.dequantize_ref(k_packed, kd), ref.dequantize_ref(v_packed, vd), cq, ck,
                                    softmax_scale=scale)[0]
    assert_close(out, want, torch.bfloat16)


def test_error_against_unquantized_values_is_quantization_noise():
    """With scales chosen from the data (amax / 448), the output over the fp8 cache stays within
    e4m3's noise of attention over the original values (3 mantissa bits: each element rounded by up
    to 1/16 of itself; measured ~8 % of the largest output here); without the descales it is far off."""
    q = randn(2, 1, 8, 64)
    k, v = randn(2, 90, 2, 64) * 2, randn(2, 90, 2, 64) * 0.01
    kd = (k.abs().amax(dim=(0, 1, 3)) / 448).float()
    vd = (v.abs().amax() / 448).float().reshape(1)
    k8, v8 = quantized(k, kd, E4M3), quantized(v, vd, E4M3)
    lens = torch.tensor([90, 41], dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, k_descale=kd, v_descale=vd)
    exact = ref.kvcache_attention_ref(q, k, v, lens)[0]
    err = (out - exact).abs().max() / exact.abs().max()
    assert err < 0.15, f"relative error {err:.3g} against the unquantized reference"
    wrong = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, k_descale=kd)  # values left scaled
    assert (wrong - exact).abs().max() / exact.abs().max() > 1


@pytest.fixture
def descriptors(monkeypatch):
    """Tensor descriptors allowed wherever the hardware has them (and under the interpreter)."""
    monkeypatch.setattr(launch, "TMA", True)
    monkeypatch.setattr(launch, "INTERPRET_TMA", True)
    launch.choose_config.cache_clear()
    yield monkeypatch
    launch.choose_config.cache_clear()


def test_fp8_loads_through_pointers_unless_opted_in(descriptors):
    """Descriptors are built for 16-bit K/V; fp8 caches take pointer tiles unless PAGEDFLASH_TMA_FP8=1."""
    if ON_GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need Hopper")
    k16 = torch.zeros(4, 64, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    k8 = k16.to(E4M3)
    assert launch.use_tma(k16, k16, paged=True) and launch.use_tma(k16, k16, paged=False)
    assert not launch.use_tma(k8, k8, paged=True) and not launch.use_tma(k8, k8, paged=False)
    descriptors.setattr(launch, "TMA_FP8", True)
    assert launch.use_tma(k8, k8, paged=True) and launch.use_tma(k8, k8, paged=False)


@pytest.mark.parametrize("page", [0, 64] if ON_GPU else [64], ids=lambda p: f"page{p}" if p else "dense")
def test_fp8_through_descriptors(descriptors, page):
    """The opt-in fp8 descriptor path (``PAGEDFLASH_TMA_FP8=1``): varlen prefill over dense K/V and over
    64-row pages whose unused slots hold NaN, through descriptors (checked by a spy on the launch).
    Under the interpreter here; compiled on Hopper in the GPU run, which tells whether it builds."""
    from pagedflash.ops import attention_launch

    if ON_GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need Hopper")
    descriptors.setattr(launch, "TMA_FP8", True)
    launched = []
    real = attention_launch.launch
    descriptors.setattr(attention_launch, "launch",
                        lambda plan, args, kernel: launched.append(plan.tma_on) or real(plan, args, kernel))
    dtype, hq, hkv, d = (torch.bfloat16 if ON_GPU else torch.float16), 8, 2, 64
    kd, vd = descales("head", hkv)
    new, total = [6, 64, 1], [70, 130, 64]
    q = randn(sum(new), hq, d, dtype=dtype)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    if page:
        k, v, table = fp8_pool(total, page, hkv, d)
        want = ref.paged_varlen_attention_ref(q, ref.dequantize_ref(k, kd), ref.dequantize_ref(v, vd), cq, ck, table,
                                              causal=True)[0]
    else:
        k, v, table = randn(sum(total), hkv, d, dtype=E4M3), randn(sum(total), hkv, d, dtype=E4M3), None
        want = ref.varlen_attention_ref(q, ref.dequantize_ref(k, kd), ref.dequantize_ref(v, vd), cq, ck,
                                        causal=True)[0]
    out = flash_attn_varlen_func(q, k, v, cq, ck, max(new), max(total), causal=True, block_table=table,
                                 k_descale=kd, v_descale=vd)
    assert launched == [True], "the launch did not take the descriptor path"
    assert_close(out, want, dtype)


# ---------------------------------------------------------------- bad input


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _call(**over):
    cache = torch.zeros(2, 16, 2, 32, device=DEVICE).to(E4M3)
    args = dict(q=randn(2, 1, 4, 32), k_cache=cache, v_cache=cache.clone(), cache_seqlens=i32([5, 8]),
                k_descale=torch.tensor([0.5, 2.0], device=DEVICE), v_descale=torch.tensor(1.5, device=DEVICE))
    args.update(over)
    return flash_attn_with_kvcache(**args)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(), None, None),
        (dict(k_descale=torch.tensor([0.5, 2.0, 1.0], device=DEVICE)), ValueError,
         r"k_descale: expected shape \[\] or \[1\] \(per tensor\) or \[2\] \(per KV head\), got \[3\]"),
        (dict(v_descale=torch.ones(1, device=DEVICE)), None, None),
        (dict(v_descale=torch.ones(1, 1, device=DEVICE)), ValueError, "v_descale: expected shape"),
        (dict(v_descale=torch.ones(2, 1, device=DEVICE)), ValueError, "v_descale: expected shape"),
        (dict(k_descale=torch.ones(2, dtype=torch.float16, device=DEVICE)), TypeError, "k_descale: expected dtype"),
        (dict(k_descale=[0.5, 2.0]), TypeError, "k_descale: expected a torch.Tensor"),
        (dict(k_descale=torch.tensor([0.5, 0.0], device=DEVICE)), ValueError, "k_descale: expected finite values > 0"),
        (dict(v_descale=torch.tensor(float("inf"), device=DEVICE)), ValueError, "v_descale: expected finite values"),
        (dict(k_cache=torch.zeros(2, 16, 2, 32, device=DEVICE)), TypeError,
         r"v_cache: expected dtype torch.float32 \(the dtype of k_cache\)"),
        (dict(k_cache=torch.zeros(2, 16, 2, 32, device=DEVICE).half()), TypeError,
         "k_cache: expected dtype torch.float32 .* or an fp8 dtype"),
        (dict(k=randn(2, 1, 2, 32).to(E4M3), v=randn(2, 1, 2, 32).to(E4M3)), TypeError, "k: expected dtype"),
    ],
)
def test_kvcache_rejects(over, exc, match):
    if exc is None:
        _call(**over)  # control: a valid variant passes
        return
    with validate.value_checks(True), pytest.raises(exc, match=match):  # descale values: the debug mode's
        _call(**over)


def test_scales_only_with_an_fp8_cache_and_fp8_only_where_supported():
    q, cache = randn(1, 4, 4, 32), randn(1, 4, 2, 32)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_descale: scales apply to fp8 caches only \(k_cache is torch.float32\)"):
        flash_attn_with_kvcache(q, cache, cache.clone(), k_descale=one)
    with pytest.raises(ValueError, match=r"v_descale: scales apply to fp8 caches only \(v is torch.float32\)"):
        flash_attn_varlen_func(q[0], cache[0], cache[0], i32([0, 4]), i32([0, 4]), 4, 4, v_descale=one)
    with pytest.raises(TypeError, match="k: expected dtype torch.float32 \\(the dtype of q\\)"):
        flash_attn_func(q, cache.to(E4M3), cache.to(E4M3))  # dense prefill keeps 16/32-bit K/V
    k8 = torch.zeros(4, 4, 2, 32, device=DEVICE).to(E4M3)
    k, v, slots = randn(2, 2, 32), randn(2, 2, 32), torch.tensor([0, 5], device=DEVICE)
    with pytest.raises(ValueError, match="k_scale: scales apply to fp8 caches only"):
        write_kv_cache(k, v, k8.float(), k8.float(), slots, k_scale=one)
    with pytest.raises(TypeError, match="k: expected dtype in"):
        write_kv_cache(k.to(E4M3), v.to(E4M3), k8, k8.clone(), slots)  # new tokens come unquantized
    with pytest.raises(ValueError, match=r"k_scale: expected shape .* got \[3\]"):
        write_kv_cache(k, v, k8, k8.clone(), slots, k_scale=torch.ones(3, device=DEVICE))
    before = k8.clone()
    with validate.value_checks(True), pytest.raises(ValueError, match="v_scale: expected finite values > 0"):
        write_kv_cache(k, v, k8, k8.clone(), slots, v_scale=torch.tensor(-1.0, device=DEVICE))
    assert torch.equal(k8.float(), before.float()), "a refused write changed the cache"


def test_kv_cache_pool_scales():
    sizes = dict(num_layers=3, num_blocks=4, page_size=2, num_kv_heads=2, head_dim=16, device=DEVICE)
    fp8 = KVCache(**sizes, dtype=E4M3, k_scale=[0.5, 1.0, 2.0])
    bf16 = KVCache(**sizes, dtype=torch.bfloat16)
    assert fp8.nbytes * 2 == bf16.nbytes
    assert KVCache.bytes_per_block(**{k: sizes[k] for k in ("num_layers", "page_size", "num_kv_heads", "head_dim")},
                                   dtype=E4M3) * 2 == bf16.nbytes // 4
    k_scale, v_scale = fp8.scales(2)
    assert k_scale.tolist() == [2.0] and v_scale.tolist() == [1.0] and k_scale.dtype == torch.float32
    assert bf16.scales(0) == (None, None)
    per_head = KVCache(**sizes, dtype=E4M3, k_scale=[0.5, [1.0, 3.0], 2.0])  # one layer per KV head
    assert per_head.k_scales.tolist() == [[0.5, 0.5], [1.0, 3.0], [2.0, 2.0]] and per_head.v_scales.shape == (3, 1)
    assert per_head.scales(1)[0].tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="k_scale must be a float or 3 entries"):
        KVCache(**sizes, dtype=E4M3, k_scale=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"v_scale must be .* each a float or 2 floats \(per KV head\)"):
        KVCache(**sizes, dtype=E4M3, v_scale=[1.0, [1.0, 2.0, 3.0], 1.0])
    with pytest.raises(ValueError, match="v_scale must be finite and > 0"):
        KVCache(**sizes, dtype=E4M3, v_scale=0.0)
    with pytest.raises(ValueError, match="scales apply to fp8 pools only"):
        KVCache(**sizes, dtype=torch.float16, k_scale=1.0)
    # the pool's views and scales feed the kernels directly
    k_cache, v_cache = fp8[1]
    k_new, v_new = randn(3, 2, 16), randn(3, 2, 16)
    slots = torch.tensor([0, 3, 6], device=DEVICE)
    ks, vs = fp8.scales(1)
    write_kv_cache(k_new, v_new, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
    assert torch.equal(k_cache.float().view(-1, 2, 16)[slots], quantized(k_new, ks, E4M3).float())


# ---------------------------------------------------------------- compiled (H200)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="long contexts are for the compiled GPU run")
@pytest.mark.parametrize("page", [0, 16, 64])
@pytest.mark.parametrize("b,n", [(1, 131072), (16, 16384), (64, 4100), (8, 65536)])
@pytest.mark.parametrize("d", [128, 64])
def test_long_context_bf16_q(page, b, n, d):
    hq, hkv = 32, 8
    q = randn(b, 1, hq, d, dtype=torch.bfloat16)
    kd, vd = descales("head", hkv)
    seqlens = [n - 37 * i for i in range(b)]
    if page:
        k_cache, v_cache, table = fp8_pool(seqlens, page, hkv, d, spare=1)
    else:
        table = None
        k_cache, v_cache = randn(b, n, hkv, d, dtype=E4M3), randn(b, n, hkv, d, dtype=E4M3)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, k_descale=kd,
                                  v_descale=vd)
    rows = sorted({0, b - 1})  # the reference of the first and last row (a pool is dequantized whole)
    k_real = ref.dequantize_ref(k_cache if page else k_cache[rows], kd)
    v_real = ref.dequantize_ref(v_cache if page else v_cache[rows], vd)
    want = ref.kvcache_attention_ref(q[rows], k_real, v_real, lens[rows], block_table=table[rows] if page else None)[0]
    assert_close(out[rows], want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("page", [0, 16, 64])
def test_cuda_graph_replay_with_appends(page):
    """A captured decode step over an fp8 cache (append + attention, fixed split count) replays with
    changing lengths, values and descales."""
    b, s_max, hq, hkv, d = 4, 1024, 16, 4, 128
    dtype = torch.bfloat16
    q = randn(b, 1, hq, d, dtype=dtype)
    if page:
        pool = b * s_max // page * 2
        k_cache, v_cache = randn(pool, page, hkv, d, dtype=E4M3), randn(pool, page, hkv, d, dtype=E4M3)
        table = torch.randperm(pool, device=DEVICE)[: b * s_max // page].view(b, -1).int()
    else:
        k_cache, v_cache, table = randn(b, s_max, hkv, d, dtype=E4M3), randn(b, s_max, hkv, d, dtype=E4M3), None
    k_new, v_new = randn(b, 1, hkv, d, dtype=dtype), randn(b, 1, hkv, d, dtype=dtype)
    kd, vd = descales("head", hkv)
    seqlens = torch.tensor([10, 100, 500, 1000], dtype=torch.int32, device=DEVICE)

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                       block_table=table, num_splits=8, k_descale=kd, v_descale=vd)

    graph, out = capture_graph(step)
    for lengths in ([1, 2, 3, 4], [1023, 0, 511, 64], [200, 300, 400, 1000]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(randn(b, 1, hq, d, dtype=dtype))
        kd.copy_(torch.rand(hkv, device=DEVICE) + 0.5)
        graph.replay()
        torch.cuda.synchronize()
        want = ref.kvcache_attention_ref(q, ref.dequantize_ref(k_cache, kd), ref.dequantize_ref(v_cache, vd),
                                         seqlens + 1, block_table=table)[0]
        assert_close(out, want, dtype)
